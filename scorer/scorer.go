// Package scorer decides which upstream a request goes to: hard filters
// first, then a cost per remaining candidate, then a tie-break. It is pure:
// plain structs in, a Decision out, no I/O, no clocks, no Caddy, so the
// same code runs in the router and in a discrete-event simulation.
//
// The default strategy, ttft, estimates each candidate's time to first
// token:
//
//	est = queued_seconds + uncached_tokens/prefill_rate + adapter_load_seconds
//
// For a warm replica A holding k prefix tokens and a cold replica B this
// is the tolerance rule "route to A iff Q_A − Q_B < t_prefill(k)": affinity
// is worth more for long prefixes and less under load, and a hot prefix
// spills to a cold replica, which then becomes warm.
//
// A replica whose free KV cannot hold the request now is filtered out
// unless its KV is expected to free within Request.MaxKVWaitSeconds; that
// wait (KVWaitSeconds) is then part of its estimate.
package scorer

import "fmt"

// Strategy names a decision rule. Besides the default, the rules of other
// routers are available for side-by-side benchmarks and for users
// migrating from them.
type Strategy string

// Strategies.
const (
	// TTFT minimises the estimated time to first token plus a tenth of
	// the delay its prefill imposes on the requests already on a replica
	// and a tenth of its own generation time there (the default; see
	// Options.ImposedDelayWeight and Options.DecodeWeight).
	TTFT Strategy = "ttft"
	// SGLang is SGLang router's cache_aware policy.
	SGLang Strategy = "sglang"
	// LLMD is llm-d's default scoring profile with a max-score picker.
	LLMD Strategy = "llmd"
	// Dynamo is NVIDIA Dynamo's KV router cost.
	Dynamo Strategy = "dynamo"
	// LeastWork picks the fewest queued tokens, ignoring the cache.
	LeastWork Strategy = "least_work"
)

// Strategies lists every strategy, default first.
var Strategies = []Strategy{TTFT, SGLang, LLMD, Dynamo, LeastWork}

// ParseStrategy returns the strategy with the given name; "" means TTFT.
func ParseStrategy(name string) (Strategy, error) {
	if name == "" {
		return TTFT, nil
	}
	for _, s := range Strategies {
		if string(s) == name {
			return s, nil
		}
	}
	return "", fmt.Errorf("unknown strategy %q (want one of ttft, sglang, llmd, dynamo, least_work)", name)
}

// AdapterState says where a candidate has the request's LoRA adapter.
type AdapterState uint8

// Adapter states, cheapest first.
const (
	// AdapterUnknown: the router does not know; the caller sets the load
	// cost it wants to assume.
	AdapterUnknown AdapterState = iota
	// AdapterResident: loaded on the GPU (or the request needs none).
	AdapterResident
	// AdapterHost: loadable quickly, from host memory or into a free slot.
	AdapterHost
	// AdapterRemote: must be fetched from storage.
	AdapterRemote
)

func (s AdapterState) String() string {
	switch s {
	case AdapterResident:
		return "resident"
	case AdapterHost:
		return "host"
	case AdapterRemote:
		return "remote"
	}
	return "unknown"
}

// Request is what the decision needs to know of a request.
type Request struct {
	// PromptTokens is the (estimated) prompt length in tokens.
	PromptTokens int
	// Blocks is the number of full prefix blocks hashed from the prompt.
	Blocks int
	// BlockTokens is the number of tokens in one block.
	BlockTokens int
	// OutputTokens is the expected number of generated tokens of each of
	// the request's sequences.
	OutputTokens int
	// Sequences is how many sequences the engine generates for the
	// request (n choices, a batch's prompts; 0 or 1: one), side by side:
	// each takes KV for its own output, and they share steps.
	Sequences int
	// Model is the requested base model; empty matches any.
	Model string
	// Adapter is the requested LoRA adapter, empty for the base model.
	Adapter string
	// MaxKVWaitSeconds is how long the request may wait at an engine for
	// KV memory to free before its prefill starts. A candidate whose free
	// KV is short of the request's needs passes the KV filter when its
	// estimated wait (KVWaitSeconds) is at most this; 0 means the request
	// must fit now.
	MaxKVWaitSeconds float64
	// LeastKVTokens is the KV the whole request surely takes: its prompt
	// (less the estimate's tolerance when it is counted from text) and
	// its max_tokens when the client set one. A candidate whose KV
	// capacity is smaller can never run it: an engine refuses a request
	// longer than its context, and its KV holds its context. 0: unknown.
	LeastKVTokens int
	// ContextTokens is the context the request is expected to take: its
	// prompt as estimated and its max_tokens when the client set one. An
	// engine refuses a request whose prompt and max_tokens exceed the
	// model's context length (vLLM's max_model_len), so a candidate with
	// a shorter one is left out while another can take the request; only
	// one shorter than LeastKVTokens surely refuses it. 0: unknown.
	ContextTokens int

	// cutAtContext lets a candidate whose KV holds LeastKVTokens but not
	// the request's whole estimate pass the KV filter, its need cut to
	// the whole KV (an engine stops a sequence at its context), and one
	// whose context holds LeastKVTokens but not ContextTokens pass the
	// context filter. Choose sets it only when no candidate holds the
	// whole estimate.
	cutAtContext bool
}

// Candidate is one upstream's state as the decision sees it.
type Candidate struct {
	// Name identifies the upstream in explanations (its dial address).
	Name string
	// Available is false when the proxy considers the upstream down or
	// full.
	Available bool
	// Draining upstreams take no new requests.
	Draining bool
	// MatchedTokens is how many leading prompt tokens it holds in cache.
	MatchedTokens int
	// QueuedPrefillTokens is prefill work routed there and not done.
	QueuedPrefillTokens int
	// QueuedDecodeTokens is expected output routed there and not yet
	// generated.
	QueuedDecodeTokens int
	// InFlight is the number of requests routed there and not finished.
	InFlight int
	// ForeignInFlight is the number of requests the engine reported beyond
	// the router's own (another router's, direct clients'), 0 when unknown.
	// The ttft strategy counts them with InFlight; the strategies that
	// mirror other routers see only their own traffic, as those do.
	ForeignInFlight int
	// Waiting is the engine's waiting queue length, or -1 when unknown.
	Waiting int
	// PrefillTokensPerSecond is its prefill throughput.
	PrefillTokensPerSecond float64
	// DecodeTokensPerSecond is its aggregate decode throughput over the
	// batch.
	DecodeTokensPerSecond float64
	// FreeKVTokens is its free KV cache in tokens, or -1 when unknown.
	FreeKVTokens int
	// KVCapacityTokens is its whole KV cache in tokens, 0 when unknown.
	KVCapacityTokens int
	// ContextTokens is the requested model's context length there (the
	// engine's max_model_len), 0 when unknown: the engine refuses a
	// request whose prompt and max_tokens together exceed it.
	ContextTokens int
	// UncachedRoomTokens is how many more prompt tokens its prefix cache
	// takes before each new one evicts a cached one (the router's index
	// of what it sent there, against the KV capacity), or -1 when unknown.
	UncachedRoomTokens int
	// KVOvercommitTokens is the KV charged there beyond its capacity: the
	// requests queued at the engine until KV frees for them. It is freed
	// before a new request's KV is.
	KVOvercommitTokens int
	// Adapter says where it has the request's adapter.
	Adapter AdapterState
	// AdapterLoadSeconds is the cost of making the adapter resident there;
	// ignored when the adapter is resident.
	AdapterLoadSeconds float64
	// AdapterEvictedSeconds is what making the adapter resident there
	// costs the adapter it evicts from the engine's GPU slots (its reload
	// when its next request comes), 0 when a slot is free; ignored when
	// the adapter is resident.
	AdapterEvictedSeconds float64
	// Models lists the models (base and adapters) it serves; nil when
	// unknown, in which case it is assumed to serve any.
	Models []string
}

// FilterReason says why a candidate was excluded.
type FilterReason uint8

// Filter reasons.
const (
	NotFiltered FilterReason = iota
	FilteredModel
	FilteredUnavailable
	FilteredDraining
	FilteredKV
	// FilteredContext: the request is longer than the model's context
	// length there (max_model_len), which the engine refuses with 400.
	FilteredContext
)

func (f FilterReason) String() string {
	switch f {
	case FilteredModel:
		return "model"
	case FilteredUnavailable:
		return "unavailable"
	case FilteredDraining:
		return "draining"
	case FilteredKV:
		return "kv"
	case FilteredContext:
		return "context"
	}
	return ""
}

// Reason says why the chosen candidate won, in the words the metrics use.
type Reason string

// Reasons.
const (
	// Warm: the chosen candidate holds the longest matched prefix.
	Warm Reason = "warm"
	// Cold: no candidate held any of the prompt.
	Cold Reason = "cold"
	// Spill: a warmer candidate existed but its queue outweighed the
	// prefill it would save.
	Spill Reason = "spill"
	// Adapter: the chosen candidate must load the request's adapter.
	Adapter Reason = "adapter"
	// Shed: no candidate passed the filters.
	Shed Reason = "shed"
)
