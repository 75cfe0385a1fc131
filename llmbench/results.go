package llmbench

import (
	"context"
	"math"
	"slices"
	"time"

	"github.com/llmaffinity/caddy-llm-affinity/kvsim"
)

// Runner replays a workload under one routing policy and measures every request. The
// simulator ([Sim]) is one; an HTTP runner that drives a real Caddy in front of kvsim servers
// is another. Results are independent of the mode, so the report code serves both.
type Runner interface {
	Replay(ctx context.Context, w *Workload, policy string) (*Results, error)
}

// Config is what every runner needs besides the workload and the policy.
type Config struct {
	// Replicas is the number of engine replicas behind the router.
	Replicas int
	// Engine configures every replica (zero fields take kvsim's defaults).
	Engine kvsim.Config
	// Seed drives the llm_affinity routers' random choices (ties) and the generators. Caddy's
	// own random and least_conn draw from Caddy's unseeded source: their figures vary a
	// little between runs.
	Seed uint64
	// Progress, when set, is called as requests complete with the count done so far and
	// the total. It may be called often; keep it cheap.
	Progress func(done, total int)
}

// HTTPRunner builds the runner of --mode http. Its settings are a [Sim]'s (the replicas, the
// engine, the seed, the progress callback and the llm_affinity options: queue timeout, output
// estimate, scorer rates and tuning), so that both modes configure the router alike.
// timeScale runs the kvsim engines that many times faster than wall clock (0 means 1): requests
// are sent at arrival/timeScale wall seconds and times are reported in simulated seconds.
//
// It is nil until a package that can start a Caddy with the llm_affinity plugin in front of
// kvsim servers sets it (llmbench/httprun, which the llmbench command imports), so that this
// package stays free of Caddy.
var HTTPRunner func(settings *Sim, timeScale float64) (Runner, error)

// RequestResult is what one request measured. Times are seconds of the replay's clock:
// virtual in sim mode, wall clock times the time scale in http mode.
type RequestResult struct {
	// Index is the request's position in the workload; Replica the index
	// of the replica that served it, -1 when none did.
	Index   int `json:"index"`
	Replica int `json:"replica"`
	// Arrival is when the request arrived, from the start of the workload;
	// TTFT the time from arrival to the first token (0 when none came) and
	// E2E to the last (0 when unfinished).
	Arrival time.Duration `json:"arrival_ns"`
	TTFT    time.Duration `json:"ttft_ns"`
	E2E     time.Duration `json:"e2e_ns"`
	// PromptTokens, CachedTokens (prompt tokens served from the prefix cache, when the engine
	// says) and OutputTokens (generated) are the engine's counts.
	PromptTokens int `json:"prompt_tokens"`
	CachedTokens int `json:"cached_tokens"`
	OutputTokens int `json:"output_tokens"`
	// Shed is true when the router refused the request (no replica fits).
	Shed bool `json:"shed,omitempty"`
	// Err describes a failure (an engine or HTTP error); empty on success.
	Err string `json:"error,omitempty"`
}

// Completed reports whether the request finished without error.
func (r *RequestResult) Completed() bool { return !r.Shed && r.Err == "" && r.E2E > 0 }

// ReplicaResult is one replica's share of a replay.
type ReplicaResult struct {
	// Name identifies the replica (its dial address in http mode).
	Name string `json:"name"`
	// Requests is how many requests the router sent it.
	Requests int `json:"requests"`
	// PromptTokens and OutputTokens are the tokens of the requests sent to it.
	PromptTokens int64 `json:"prompt_tokens"`
	OutputTokens int64 `json:"output_tokens"`
	// PrefixQueries and PrefixHits are the engine's prefix cache counters in tokens
	// (vllm:prefix_cache_queries_total and _hits_total); both 0 when unknown.
	PrefixQueries uint64 `json:"prefix_queries"`
	PrefixHits    uint64 `json:"prefix_hits"`
	// AdapterLoads and AdapterHostLoads count the LoRA adapters the engine loaded into a
	// GPU slot from storage and from host memory (sim mode only).
	AdapterLoads     uint64 `json:"adapter_loads,omitempty"`
	AdapterHostLoads uint64 `json:"adapter_host_loads,omitempty"`
}

// Results is everything one replay measured.
type Results struct {
	// Policy is the routing policy replayed.
	Policy string `json:"policy"`
	// Replicas holds one entry per replica.
	Replicas []ReplicaResult `json:"replicas"`
	// Requests holds one entry per workload request, in workload order.
	Requests []RequestResult `json:"requests"`
	// Wall is the wall-clock time the replay took.
	Wall time.Duration `json:"wall_ns"`
}

// Summary is a policy's headline figures. Times are in seconds.
//
// A shed or failed request is a failed request, not a missing one: the
// percentiles are over every request of the workload, and a request that
// never got its first token (shed, errored, or unfinished) counts as +Inf
// for TTFT, one that did not finish as +Inf for E2E. A policy that sheds
// more than 1% of the requests therefore has an infinite p99: it did not
// serve its 99th percentile at all. (Percentiles over the served requests
// alone made a policy that sheds look faster.)
type Summary struct {
	Policy string `json:"policy"`
	// HitRate is token-weighted: prompt tokens served from the prefix cache over prompt
	// tokens queried, from the engines' counters (or the requests' cached tokens when the
	// engines' counters are unknown).
	HitRate float64 `json:"hit_rate"`
	// TTFTP50 to E2EP99 are nearest-rank percentiles over every request, failures as +Inf.
	TTFTP50 float64 `json:"ttft_p50_s"`
	TTFTP90 float64 `json:"ttft_p90_s"`
	TTFTP99 float64 `json:"ttft_p99_s"`
	// TTFTMean is over the requests that got a first token.
	TTFTMean float64 `json:"ttft_mean_s"`
	E2EP50   float64 `json:"e2e_p50_s"`
	E2EP99   float64 `json:"e2e_p99_s"`
	// Throughput is output tokens per second of the replay's clock, from the first arrival
	// to the last completion.
	Throughput float64 `json:"throughput_tok_s"`
	// Goodput is the requests served (completed without error) per second of the same
	// span: what the policy delivered, with nothing for a shed or failed request.
	Goodput float64 `json:"goodput_req_s"`
	// MaxMeanLoad is the busiest replica's request count over the mean (1 is perfectly even).
	MaxMeanLoad float64 `json:"max_mean_load"`
	// MaxMeanTokens is the same by prompt plus output tokens.
	MaxMeanTokens float64 `json:"max_mean_tokens"`
	// Cold counts the served requests that had a prompt and found none of it in the prefix
	// cache: the first sight of a prefix, or a copy of it onto another replica.
	Cold      int `json:"cold"`
	Requests  int `json:"requests"`
	Completed int `json:"completed"`
	Shed      int `json:"shed"`
	Errors    int `json:"errors"`
	// WallSeconds is the wall-clock time the replay took.
	WallSeconds float64 `json:"wall_s"`
	// TTFTs holds the TTFTs in seconds of the requests that got a first token, sorted, for
	// plots.
	TTFTs []float64 `json:"-"`
}

// Summarize computes the headline figures of a replay.
func Summarize(r *Results) Summary {
	s := Summary{Policy: r.Policy, Requests: len(r.Requests), WallSeconds: r.Wall.Seconds()}
	ttft := make([]float64, 0, len(r.Requests))
	e2e := make([]float64, 0, len(r.Requests))
	var queries, hits uint64
	var outTokens float64
	start, end := time.Duration(math.MaxInt64), time.Duration(0)
	inf := math.Inf(1)
	for i := range r.Requests {
		q := &r.Requests[i]
		start = min(start, q.Arrival)
		switch {
		case q.Shed:
			s.Shed++
		case q.Err != "":
			s.Errors++
		}
		if q.Shed || q.Err != "" {
			ttft, e2e = append(ttft, inf), append(e2e, inf)
			continue
		}
		if q.TTFT > 0 {
			ttft = append(ttft, q.TTFT.Seconds())
		} else {
			ttft = append(ttft, inf)
		}
		if q.Completed() {
			s.Completed++
			e2e = append(e2e, q.E2E.Seconds())
			end = max(end, q.Arrival+q.E2E)
			outTokens += float64(q.OutputTokens)
		} else {
			e2e = append(e2e, inf)
		}
		queries += uint64(q.PromptTokens)
		hits += uint64(q.CachedTokens)
		if q.PromptTokens > 0 && q.CachedTokens == 0 {
			s.Cold++
		}
	}
	var rq, rh uint64
	for _, rep := range r.Replicas {
		rq += rep.PrefixQueries
		rh += rep.PrefixHits
	}
	if rq > 0 {
		queries, hits = rq, rh
	}
	if queries > 0 {
		s.HitRate = float64(hits) / float64(queries)
	}
	slices.Sort(ttft)
	slices.Sort(e2e)
	served := ttft[:len(ttft)-countInf(ttft)]
	s.TTFTs = served
	s.TTFTP50, s.TTFTP90, s.TTFTP99 = percentile(ttft, 0.5), percentile(ttft, 0.9), percentile(ttft, 0.99)
	s.TTFTMean = mean(served)
	s.E2EP50, s.E2EP99 = percentile(e2e, 0.5), percentile(e2e, 0.99)
	if end > start {
		span := (end - start).Seconds()
		s.Throughput = outTokens / span
		s.Goodput = float64(s.Completed) / span
	}
	s.MaxMeanLoad = maxOverMean(r.Replicas, func(x ReplicaResult) float64 { return float64(x.Requests) })
	s.MaxMeanTokens = maxOverMean(r.Replicas, func(x ReplicaResult) float64 { return float64(x.PromptTokens + x.OutputTokens) })
	return s
}

// countInf counts the +Inf values at the end of sorted.
func countInf(sorted []float64) int {
	n := 0
	for n < len(sorted) && math.IsInf(sorted[len(sorted)-1-n], 1) {
		n++
	}
	return n
}

// percentile returns the p-quantile of sorted values (nearest rank), NaN when empty.
func percentile(sorted []float64, p float64) float64 {
	if len(sorted) == 0 {
		return math.NaN()
	}
	rank := int(math.Ceil(p*float64(len(sorted)))) - 1
	return sorted[min(max(rank, 0), len(sorted)-1)]
}

func mean(xs []float64) float64 {
	if len(xs) == 0 {
		return math.NaN()
	}
	var t float64
	for _, x := range xs {
		t += x
	}
	return t / float64(len(xs))
}

func maxOverMean(reps []ReplicaResult, f func(ReplicaResult) float64) float64 {
	if len(reps) == 0 {
		return math.NaN()
	}
	var total, peak float64
	for _, r := range reps {
		v := f(r)
		total += v
		peak = max(peak, v)
	}
	if total == 0 {
		return math.NaN()
	}
	return peak / (total / float64(len(reps)))
}
