package scrape

import (
	"encoding/json"
	"math"
	"time"
)

// ModelInfo is one entry of an engine's /v1/models: a base model (Parent
// empty) or a LoRA adapter (Parent is its base model, Root its path).
type ModelInfo struct {
	// ID is the name requests use in their "model" field.
	ID string `json:"id"`
	// Parent is the base model of an adapter, empty for a base model.
	Parent string `json:"parent,omitempty"`
	// Root is the model's origin: the base model's name or the adapter's
	// path.
	Root string `json:"root,omitempty"`
	// MaxModelLen is the model's context length on this engine, in
	// tokens (vLLM's max_model_len: prompt and output together); 0 when
	// not listed (vLLM lists none for an adapter: its base model's holds).
	MaxModelLen int `json:"max_model_len,omitempty"`
	// Card is the entry as the engine sent it (its max_model_len,
	// owned_by and the rest), for a gateway's list of the whole fleet;
	// every list the scraper fetched has it.
	Card json.RawMessage `json:"-"`
}

// Signals is one engine's state as its /metrics (and /v1/models)
// reported it. Counts are summed over data parallel ranks (vLLM's engine
// label, SGLang's dp_rank) and model names; a figure the engine did not
// report is -1 (counts) or flagged unknown. The slices are shared between
// readers and must not be modified.
type Signals struct {
	// Engine is "vllm" or "sglang".
	Engine string
	// Running is the number of requests in the running batch, -1 when not
	// reported.
	Running int
	// Waiting is the number of requests queued in the engine, -1 when not
	// reported.
	Waiting int
	// KVUsage is the fraction of KV cache memory in use, 0..1 (averaged
	// over ranks, weighted by their capacity when known). Valid when
	// KVKnown.
	KVUsage float64
	// KVKnown says whether KVUsage was reported.
	KVKnown bool
	// BlockSize is the number of tokens in one KV block (SGLang: a page;
	// 1 when only its token total is known). 0 when unknown.
	BlockSize int
	// NumGPUBlocks is the number of KV blocks over all ranks, so the KV
	// capacity in tokens is BlockSize × NumGPUBlocks. 0 when unknown.
	NumGPUBlocks int
	// MaxLoRAs is the number of adapter slots (vLLM --max-loras, SGLang
	// max_loras_per_batch), 0 when unknown.
	MaxLoRAs int
	// AdaptersKnown says RunningAdapters and WaitingAdapters were reported
	// (vLLM with --enable-lora).
	AdaptersKnown bool
	// RunningAdapters are the adapters of running requests: resident on
	// the GPU. Adapters loaded but idle are not listed by vLLM.
	RunningAdapters []string
	// WaitingAdapters are the adapters of waiting requests.
	WaitingAdapters []string
	// PrefixQueries and PrefixHits are vLLM's cumulative prefix cache
	// counters, in tokens; -1 when not reported.
	PrefixQueries, PrefixHits float64
	// PrefixHitRate is the recent prefix cache hit rate, 0..1, or -1 when
	// unknown: SGLang's cache_hit_rate gauge, or for vLLM the ratio of the
	// counters' increase between the last two scrapes that read them
	// (set by the scraper).
	PrefixHitRate float64
	// Models are the models the engine serves, from /v1/models; nil when
	// not fetched yet (then any model is assumed servable). ModelsAt is
	// when they were fetched: the list is fetched on its own schedule, and
	// also while the metrics fail (the signals are then the last good
	// ones, stale, with the newer list). A list is never changed in
	// place: a new one is a new slice (the router keeps what it derives
	// from a list by its slice).
	Models   []ModelInfo
	ModelsAt time.Time
	// ScrapedAt is when the metrics request was sent: the snapshot
	// includes the work routed before it and not the work routed after.
	ScrapedAt time.Time
	// Mark is what the scraper's Mark function returned for this dial
	// just before the request was sent (zero without one), and MarkAfter
	// what it returned once the answer was read: the requests routed in
	// between may be in the snapshot or not, whichever moment the engine
	// rendered it at.
	Mark, MarkAfter Mark
	// LastRestart is when this scraper last saw the engine restart (zero:
	// never): its port refused connections and then answered again, or
	// its cumulative counters went backwards. A restarted engine's prefix
	// cache is empty. A time rather than a count, so that scrapers of the
	// same dial (two sites, or a reload's old and new config) agree.
	LastRestart time.Time
	// ProcessStart is the engine process's start time in Unix seconds
	// (process_start_time_seconds), 0 when it does not export it: one
	// that changes says the engine restarted, however quickly.
	ProcessStart float64
	// Seq counts successful scrapes of this dial, from 1.
	Seq uint64

	// kvByRank and rankCapacity are the KV usage and capacity (tokens) of
	// each data parallel rank, so that a scrape without the capacity
	// (vLLM's slow cache_config_info) can weight the ranks as the last one
	// with it did.
	kvByRank     groups
	rankCapacity map[string]float64
}

// Mark is a snapshot of the router's cumulative charges to one
// upstream: every request it routed there and the KV tokens (prompt plus
// expected output) it charged for them. Both only grow.
type Mark struct {
	// Requests counts the requests routed to the upstream.
	Requests uint64
	// KVTokens sums the KV tokens charged for them.
	KVTokens uint64
	// InFlight is how many of them were unfinished at the time, so that
	// the engine's request counts can be split into the router's own and
	// foreign ones.
	InFlight int
}

// Since returns the charges made between old and m, for
// Signals.PlusRouted.
func (m Mark) Since(old Mark) (requests, kvTokens int) {
	if m.Requests >= old.Requests {
		requests = int(min(m.Requests-old.Requests, math.MaxInt32))
	}
	if m.KVTokens >= old.KVTokens {
		kvTokens = int(min(m.KVTokens-old.KVTokens, math.MaxInt32))
	}
	return requests, kvTokens
}

// KVCapacityTokens returns the engine's KV cache size in tokens, 0 when
// unknown.
func (s Signals) KVCapacityTokens() int {
	if s.BlockSize <= 0 || s.NumGPUBlocks <= 0 {
		return 0
	}
	return s.BlockSize * s.NumGPUBlocks
}

// FreeKVTokens returns the engine's free KV cache in tokens, or -1 when
// its usage or capacity is unknown (scorer.Candidate.FreeKVTokens).
func (s Signals) FreeKVTokens() int {
	c := s.KVCapacityTokens()
	if !s.KVKnown || c == 0 {
		return -1
	}
	return max(0, int(math.Floor((1-s.KVUsage)*float64(c))))
}

// ModelIDs returns the IDs of the served models, nil when unknown
// (scorer.Candidate.Models).
func (s Signals) ModelIDs() []string { return ModelIDs(s.Models) }

// ContextTokens is the context length (MaxModelLen) of the model named
// id among models, or of its base model when it is an adapter listed
// without one; 0 when unknown.
func ContextTokens(models []ModelInfo, id string) int {
	for i := range models {
		if models[i].ID != id {
			continue
		}
		if n := models[i].MaxModelLen; n > 0 || models[i].Parent == "" {
			return n
		}
		parent := models[i].Parent
		for j := range models {
			if models[j].ID == parent {
				return models[j].MaxModelLen
			}
		}
		return 0
	}
	return 0
}

// ModelIDs returns the IDs of models, nil for nil.
func ModelIDs(models []ModelInfo) []string {
	if models == nil {
		return nil
	}
	ids := make([]string, len(models))
	for i, m := range models {
		ids[i] = m.ID
	}
	return ids
}

// PlusRouted returns s corrected for the work the router sent since the
// scrape: requests more requests waiting and kvTokens more KV in use. The
// caller counts only charges made at or after s.ScrapedAt (or since
// s.Mark), which the snapshot cannot contain, so nothing is counted twice;
// requests that also finished since make the estimate pessimistic until
// the next scrape, never optimistic.
func (s Signals) PlusRouted(requests, kvTokens int) Signals {
	if s.Waiting >= 0 && requests > 0 {
		s.Waiting += requests
	}
	if c := s.KVCapacityTokens(); s.KVKnown && c > 0 && kvTokens > 0 {
		s.KVUsage = min(1, s.KVUsage+float64(kvTokens)/float64(c))
	}
	return s
}

// hitRateSince returns the prefix cache hit rate between two scrapes
// from the counters (vLLM's, which has no hit rate metric):
// the previous rate when no tokens were queried in between, -1 when the
// counters are missing or were reset.
func hitRateSince(prev, cur Signals) float64 {
	if prev.PrefixQueries < 0 || cur.PrefixQueries < 0 || prev.PrefixHits < 0 || cur.PrefixHits < 0 {
		return -1
	}
	dq, dh := cur.PrefixQueries-prev.PrefixQueries, cur.PrefixHits-prev.PrefixHits
	switch {
	case dq < 0 || dh < 0: // engine restarted
		return -1
	case dq == 0:
		return prev.PrefixHitRate
	}
	return clamp01(dh / dq)
}

// clamp01 bounds a fraction to 0..1 (NaN: 0).
func clamp01(v float64) float64 {
	if math.IsNaN(v) {
		return 0
	}
	return min(1, max(0, v))
}
