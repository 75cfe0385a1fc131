package scorer

import (
	"cmp"
	"math"
	"slices"
)

// Options tune the decision. The zero value is the ttft strategy with the
// defaults below.
type Options struct {
	// Strategy is the decision rule; empty means TTFT.
	Strategy Strategy
	// TieSeconds: ttft costs within this many seconds of the best are
	// ties. Among ties the candidates that leave the least prompt to
	// prefill win, then power of two random choices. Default
	// DefaultTieSeconds.
	TieSeconds float64
	// KVMarginTokens is the headroom the KV-fit filter keeps beyond the
	// uncached prompt and the expected output. Default 0.
	KVMarginTokens int
	// ImposedDelayWeight is how much the delay a request's prefill imposes
	// on the requests already on a replica (ImposedDelaySeconds) counts
	// against its own time to first token, in the ttft strategy. Default
	// DefaultImposedDelayWeight; negative turns the term off.
	ImposedDelayWeight float64
	// DecodeWeight is how much the request's own generation time on a
	// replica (GenerationSeconds) counts against its time to first token,
	// in the ttft strategy. Default DefaultDecodeWeight; negative turns the
	// term off.
	DecodeWeight float64
	// EvictionWeight is how much what placing req evicts counts, in the
	// ttft strategy: the prefill of cached prompts pushed out of a full
	// prefix cache (EvictedSeconds), and the reload of an adapter pushed
	// out of full GPU slots (AdapterEvictedSeconds). Default
	// DefaultEvictionWeight; negative turns the term off.
	EvictionWeight float64
	// SGLang tunes the sglang strategy.
	SGLang SGLangOptions
	// LLMD tunes the llmd strategy.
	LLMD LLMDOptions
	// Dynamo tunes the dynamo strategy.
	Dynamo DynamoOptions
}

// DefaultTieSeconds is the default Options.TieSeconds.
const DefaultTieSeconds = 0.002

// Rand is the random source for tie-breaks; *math/rand/v2.Rand satisfies
// it. Inject a seeded one for deterministic decisions.
type Rand interface {
	IntN(n int) int
}

// Decision is the outcome of Choose.
type Decision struct {
	// Chosen is the index of the chosen candidate, or -1 when none fits.
	Chosen int
	// Reason says why it won (Shed when Chosen is -1).
	Reason Reason
	// EstimatedTTFTSeconds is the ttft estimate of the chosen candidate
	// (computed whatever the strategy, for comparison with observations).
	EstimatedTTFTSeconds float64
	// Eligible is how many candidates passed the filters.
	Eligible int
	// Blocked is the most common filter reason when none fits.
	Blocked FilterReason
	// CutAtContext says no candidate holds the request's whole estimate:
	// the chosen one holds what it surely needs, and may cut it at its
	// context.
	CutAtContext bool
}

// Explanation is filled by Choose when asked for, for logs and headers.
type Explanation struct {
	// Top holds the best candidates by the strategy's order, best first.
	Top []Explained
	// Filtered holds every candidate the filters excluded.
	Filtered []Excluded
}

// Explained is one candidate's features in an explanation.
type Explained struct {
	Index         int
	Name          string
	Cost          float64
	TTFTSeconds   float64
	MatchedTokens int
	QueuedTokens  int
	Adapter       AdapterState
}

// Excluded names a filtered candidate and why.
type Excluded struct {
	Index  int
	Name   string
	Reason FilterReason
}

// explainTop is how many candidates an explanation lists.
const explainTop = 3

// Choose picks a candidate for req. It never chooses a filtered candidate.
// When explain is non-nil it is filled in; otherwise explaining costs
// nothing. Choose does not allocate unless explain is non-nil.
func Choose(req Request, cands []Candidate, opts Options, rng Rand, explain *Explanation) Decision {
	d, estimateFiltered := choose(&req, cands, &opts, rng, explain)
	if d.Chosen < 0 && estimateFiltered > 0 && req.LeastKVTokens > 0 {
		// No candidate holds the request's whole estimate: one whose KV
		// holds what it surely needs may run it, cut at its context, and
		// one whose context may hold it may take it.
		req.cutAtContext = true
		if explain != nil {
			explain.Filtered = explain.Filtered[:0]
		}
		d, _ = choose(&req, cands, &opts, rng, explain)
		d.CutAtContext = d.Chosen >= 0
	}
	return d
}

// choose is Choose with req as it is; it also returns how many candidates
// the KV and context filters excluded.
func choose(req *Request, cands []Candidate, opts *Options, rng Rand, explain *Explanation) (Decision, int) {
	d := Decision{Chosen: -1, Reason: Shed}
	var blocked [FilteredContext + 1]int
	bestMatch := 0
	var passed uint64 // the first passedBits candidates that passed, for the coster
	for i := range cands {
		f := filter(req, &cands[i], opts.KVMarginTokens)
		if f != NotFiltered {
			blocked[f]++
			if explain != nil {
				explain.Filtered = append(explain.Filtered, Excluded{Index: i, Name: cands[i].Name, Reason: f})
			}
			continue
		}
		d.Eligible++
		bestMatch = max(bestMatch, cands[i].MatchedTokens)
		if i < passedBits {
			passed |= 1 << i
		}
	}
	if d.Eligible == 0 {
		d.Blocked = FilteredUnavailable
		for f := range blocked {
			if blocked[f] > blocked[d.Blocked] {
				d.Blocked = FilterReason(f)
			}
		}
		return d, blocked[FilteredKV] + blocked[FilteredContext]
	}

	var k coster
	if opts.Strategy == SGLang {
		d.Chosen = chooseSGLang(req, cands, opts, rng)
	} else {
		k = newCoster(req, cands, opts, passed)
		d.Chosen = pickLowest(&k, rng)
	}

	c := &cands[d.Chosen]
	d.EstimatedTTFTSeconds = EstimateTTFT(req, c)
	switch {
	case req.Adapter != "" && c.Adapter != AdapterResident:
		d.Reason = Adapter
	case bestMatch == 0:
		d.Reason = Cold
	case c.MatchedTokens < bestMatch:
		d.Reason = Spill
	default:
		d.Reason = Warm
	}
	if explain != nil {
		if opts.Strategy == SGLang { // no per-candidate cost; rank by ttft
			k = coster{req: req, cands: cands, opts: opts, strategy: TTFT, passed: passed}
		}
		explain.Top = explainBest(&k)
	}
	return d, blocked[FilteredKV] + blocked[FilteredContext]
}

// Filter says whether Choose would consider c for req (NotFiltered) or
// why it would not: the hard filters in order of how fundamental they are.
// A request that c's KV holds only cut at its context passes (Choose
// takes such a candidate only when none holds the request whole).
func Filter(req Request, c *Candidate, opts Options) FilterReason {
	req.cutAtContext = true
	return filter(&req, c, opts.KVMarginTokens)
}

func filter(req *Request, c *Candidate, marginTokens int) FilterReason {
	if !ServesModel(req, c) {
		return FilteredModel
	}
	if c.ContextTokens > 0 {
		need := max(req.ContextTokens, req.LeastKVTokens)
		if req.cutAtContext {
			need = req.LeastKVTokens // what it surely takes
		}
		if need > c.ContextTokens {
			return FilteredContext
		}
	}
	if !c.Available {
		return FilteredUnavailable
	}
	if c.Draining {
		return FilteredDraining
	}
	// Never park a request on a replica that cannot hold it, or not
	// before the request's wait runs out. (The engine queues a request
	// until KV frees: shedding one that would start there in time turns
	// a short wait into a failure.) Except one the engine may refuse at
	// once: its expected context is beyond the engine's, which counts the
	// prompt exactly and answers 400 before it needs any KV; held here
	// for KV it would never use, it would be shed with 503 and retried.
	// (Not where the wait is endless: nothing queued there frees the KV,
	// and the estimate would be infinite.)
	if c.FreeKVTokens >= 0 {
		if wait := kvWait(req, c, marginTokens); wait > 0 && !(wait <= req.MaxKVWaitSeconds) &&
			(math.IsInf(wait, 1) || !mayBeTooLong(req, c)) {
			return FilteredKV
		}
	}
	return NotFiltered
}

// mayBeTooLong says req, let through the context filter only cut at its
// context, is expected to exceed c's context length or its whole KV: the
// engine may well refuse it (an engine's context fits in its KV: vLLM
// does not start otherwise), and if it does not, it queues the request
// until its KV frees, as the gateway would.
func mayBeTooLong(req *Request, c *Candidate) bool {
	return req.cutAtContext && (c.ContextTokens > 0 && max(req.ContextTokens, req.LeastKVTokens) > c.ContextTokens ||
		c.KVCapacityTokens > 0 && req.ContextTokens > c.KVCapacityTokens)
}

// OutputKVTokens is the KV the request's output takes: each sequence's.
func (req *Request) OutputKVTokens() int {
	return max(0, req.OutputTokens) * min(max(1, req.Sequences), MaxSequences)
}

// MaxSequences bounds a request's sequences wherever they are counted:
// far more than an engine runs for one request (vLLM's max_num_seqs is
// 256 a batch by default), and small enough that every product of it with
// a token count stays exact.
const MaxSequences = 1 << 16

// KVWaitSeconds is how long req would wait on c for KV memory before its
// prefill could start: 0 when c's free KV holds its uncached prompt and
// expected output now (or c's free KV is unknown), +Inf when c's whole KV
// cannot hold them, or when nothing is known to be queued there to free
// any.
//
// Free KV is what c's requests leave, counting the KV charged for the
// requests queued at the engine, which will hold it before this one does
// (engines admit first come, first served), and beyond it the KV of the
// requests queued for KV already (KVOvercommitTokens). The request must
// wait until that share of the KV in use is freed, and KV frees only as
// requests end. What an engine batching continuously does sets when:
//
//   - The requests in flight decode side by side, a token each a step, so
//     they end in the order of their remaining output, not one after
//     another: of n requests at random points of outputs with a mean m
//     left, the k-th to end does after 2·m·k/(n+1) steps, and the share
//     of the KV is free once the k = ⌈share·n⌉ holding it have (a single
//     request frees nothing before it ends).
//   - While requests are queued for KV, each one that ends is replaced
//     by one of them, so every one of those steps is a token of n
//     requests at the decode rate. With none queued the batch shrinks as
//     they end: by the time the share e = k/n has, e·(2−e) of the queued
//     output is decoded.
//   - Every one of those steps also carries a chunk of the prefill queued
//     there (up to PrefillChunkTokens), which lengthens it: the queued
//     prefill runs while the KV frees, up to a chunk a step.
//
// Against kvsim the engine's wait is within a few percent of this at the
// median (router.TestKVWaitAgainstTheEngine); an estimate that scaled the
// whole queue's work by the share, as if the KV freed evenly over it, was
// 1.4 times short there and 3.8 times on the requests the filter let
// through under the Mooncake trace 4× faster (BENCHMARKS.md §11). Counting
// the requests queued for KV among the n that decode side by side is an
// approximation: one charged with little output lowers the mean m and can
// shorten the estimate for the next. The router's output estimates are
// averages, so this stays a first-order estimate.
func KVWaitSeconds(req *Request, c *Candidate) float64 { return kvWait(req, c, 0) }

func kvWait(req *Request, c *Candidate, marginTokens int) float64 {
	if c.FreeKVTokens < 0 {
		return 0
	}
	need := max(0, req.PromptTokens-c.MatchedTokens) + req.OutputKVTokens() + marginTokens
	if c.KVCapacityTokens > 0 {
		if req.LeastKVTokens > c.KVCapacityTokens {
			return math.Inf(1)
		}
		if req.cutAtContext {
			// Whatever it needs beyond that is an estimate (the
			// expected output, the prompt's count from text): an engine
			// stops a sequence at its context, so it never takes more
			// than all the KV, and it starts once all of it is free.
			need = min(need, c.KVCapacityTokens)
		}
	}
	over := max(0, c.KVOvercommitTokens)
	short := need - c.FreeKVTokens + over
	if short <= 0 {
		return 0
	}
	inUse := c.KVCapacityTokens - c.FreeKVTokens + over
	if need > c.KVCapacityTokens || inUse <= 0 {
		return math.Inf(1)
	}
	prefill := rate(c.PrefillTokensPerSecond, 10_000)
	decode := rate(c.DecodeTokensPerSecond, 2_000)
	queuedPrefill, queuedDecode := float64(max(0, c.QueuedPrefillTokens)), float64(max(0, c.QueuedDecodeTokens))
	if queuedPrefill+queuedDecode <= 0 {
		return math.Inf(1)
	}
	// The k requests of n in flight that hold the share must end: at
	// random points of outputs whose mean remaining is m, the k-th to end
	// does after 2·m·k/(n+1) steps (at least the step under way).
	n := float64(max(1, inFlight(c)))
	k := math.Ceil(n * float64(short) / float64(inUse))
	steps := max(1, 2*queuedDecode/n*k/(n+1))
	decoding := steps * n / decode // each ended request's KV goes to one queued for it
	if over == 0 {
		// Nothing is queued for KV, so the batch shrinks as requests end:
		// by the time the share e = k/n of them has, they have decoded
		// all their output and the rest as much each, e·(2−e) of it.
		ended := k / n
		decoding = min(decoding, queuedDecode*ended*(2-ended)/decode)
	}
	return decoding + min(queuedPrefill, steps*PrefillChunkTokens)/prefill
}

// ServesModel says c serves the model or adapter req asks for, or does
// not say what it serves (Models nil).
func ServesModel(req *Request, c *Candidate) bool {
	want := req.Model
	if req.Adapter != "" {
		want = req.Adapter
	}
	return c.Models == nil || want == "" || slices.Contains(c.Models, want)
}

// EstimateTTFT is the ttft strategy's cost: the seconds until c would emit
// the first token of req.
//
// Engines batch continuously with chunked prefill, so a new prompt waits
// for the prefill queued ahead of it, not for the others' generations:
// the running sequences share every step with the prefill, one token
// each. Queued seconds are therefore the queued prefill at the prefill
// rate, plus, for each step until this prompt starts (the queued prefill
// in chunks, and one), a token for every request in flight at the batch's
// decode rate. (Dividing all queued output by the decode rate, as if
// generations ran one after another, made warm replicas look busy and
// spilled prefixes needlessly: see BENCHMARKS.md.)
//
// A request that must wait for KV to free (KVWaitSeconds) starts after
// that wait or after the queue ahead, whichever is longer: the queue's
// prefill runs while the KV frees.
func EstimateTTFT(req *Request, c *Candidate) float64 {
	prefill := rate(c.PrefillTokensPerSecond, 10_000)
	est := max(QueuedSeconds(c), KVWaitSeconds(req, c)) + float64(max(0, req.PromptTokens-c.MatchedTokens))/prefill
	if req.Adapter != "" && c.Adapter != AdapterResident {
		est += c.AdapterLoadSeconds
	}
	return est
}

// ImposedDelaySeconds is the delay that placing req on c adds to the
// requests already there, summed over them: its uncached prompt lengthens
// the engine steps they share by its prefill time. It is what a copy of a
// prefix costs everyone else. A request that only minimised its own first
// token would copy a hot prefix onto a replica whose queue is momentarily
// shorter, and the copies' prefill slows every generation on that replica
// and lowers the fleet's hit rate; see BENCHMARKS.md.
func ImposedDelaySeconds(req *Request, c *Candidate) float64 {
	prefill := rate(c.PrefillTokensPerSecond, 10_000)
	return float64(max(0, req.PromptTokens-c.MatchedTokens)) / prefill * float64(inFlight(c))
}

// inFlight counts every request on c's engine, the router's and others'.
func inFlight(c *Candidate) int { return c.InFlight + max(0, c.ForeignInFlight) }

// DefaultImposedDelayWeight is the default Options.ImposedDelayWeight: a
// second of delay spread over the others' generations counts a tenth of a
// second of this request's wait for its first token. Measured with
// llmbench in BENCHMARKS.md: 0.05 to 0.25 all raise the hit rate of
// shared-prefix workloads to the concentrating policies' level while
// keeping the tails low; 1 starts to pile load up.
const DefaultImposedDelayWeight = 0.1

// GenerationSeconds is how long req would take to generate its expected
// output on c once started, up to GenerationHorizonTokens: every engine
// step carries one token of each request in flight, so a crowded replica
// decodes each of them slower. The first token does not see this (a new
// prompt shares the steps, see QueuedSeconds); the rest of the response
// does, and a router that looked only at the first token piled up
// generations on replicas holding a few hot prefixes (BENCHMARKS.md §7).
func GenerationSeconds(req *Request, c *Candidate) float64 {
	decode := rate(c.DecodeTokensPerSecond, 2_000)
	tokens := min(max(0, req.OutputTokens), GenerationHorizonTokens)
	return float64(tokens) * float64(inFlight(c)+1) / decode
}

// EvictedSeconds is the prefill time of the cached prompt tokens that
// placing req on c pushes out of a full prefix cache: every uncached
// token beyond the cache's room evicts the least recently used cached
// one, which a later request sharing it must prefill again. A copy of a
// prefix onto a full replica costs the fleet that much of its hit rate;
// onto a replica with room, nothing.
func EvictedSeconds(req *Request, c *Candidate) float64 {
	if c.UncachedRoomTokens < 0 {
		return 0
	}
	prefill := rate(c.PrefillTokensPerSecond, 10_000)
	return float64(max(0, uncached(req, c)-c.UncachedRoomTokens)) / prefill
}

// AdapterEvictedSeconds is what loading req's adapter on c costs the
// adapter it evicts: an engine keeps as many adapters as it has GPU
// slots and, when all hold others, evicts the least recently used, which
// its next request there reloads. Without the term every new adapter's
// first request weighed the same load on every idle replica, and one
// replica could gather more adapters than it has slots while others had
// slots free; each request there then waited for its adapter to be loaded
// again (with one adapter more than slots, requests in turn all do).
func AdapterEvictedSeconds(req *Request, c *Candidate) float64 {
	if req.Adapter == "" || c.Adapter == AdapterResident {
		return 0
	}
	return max(0, c.AdapterEvictedSeconds)
}

// DefaultEvictionWeight is the default Options.EvictionWeight.
//
// 1 counts every evicted token as prefilled again by a later request: an
// upper bound, since the cache evicts the least recently used. On the
// Mooncake conversation trace it raised the hit rate from 16.1% to
// 17.0–17.4% at 8 replicas (0.5 gave 16.6–16.9%) with time to first token
// unchanged; workloads whose caches never fill see no change
// (BENCHMARKS.md §11).
const DefaultEvictionWeight = 1

// GenerationHorizonTokens caps the output GenerationSeconds counts. The
// requests in flight now finish within a few hundred tokens, so the
// crowding seen now says nothing about a generation's later steps; and
// without the cap a client's max_tokens of 100,000 (with output_estimate
// max_tokens) made the term outweigh any cached prefix.
const GenerationHorizonTokens = 1024

// DefaultDecodeWeight is the default Options.DecodeWeight: a second of
// generation counts a tenth of a second of waiting for the first token.
// Measured with llmbench in BENCHMARKS.md §7: it removes the pile-ups of
// a few hot prefixes (gsp with 4 or 8 groups on 8 replicas, E2E p99 7.3–
// 7.8 s down to 3.8–4.0 s) for a few tenths of a point of hit rate;
// larger weights trade first-token time for more.
const DefaultDecodeWeight = 0.1

// QueuedSeconds is how long c's queue delays a new prompt's prefill.
func QueuedSeconds(c *Candidate) float64 {
	prefill := rate(c.PrefillTokensPerSecond, 10_000)
	decode := rate(c.DecodeTokensPerSecond, 2_000)
	steps := 1 + float64(c.QueuedPrefillTokens)/PrefillChunkTokens
	return float64(c.QueuedPrefillTokens)/prefill + steps*float64(inFlight(c))/decode
}

// PrefillChunkTokens is the prefill one engine step carries (vLLM's
// max_num_batched_tokens default).
const PrefillChunkTokens = 8192

func rate(r, fallback float64) float64 {
	if r > 0 {
		return r
	}
	return fallback
}

func queuedTokens(c *Candidate) int { return c.QueuedPrefillTokens + c.QueuedDecodeTokens }

// coster computes a strategy's cost of each candidate (lower is better).
// It is a plain value rather than a closure so that Choose does not
// allocate.
type coster struct {
	req      *Request
	cands    []Candidate
	opts     *Options
	strategy Strategy
	llmd     llmdScale
	// imposedWeight and decodeWeight weigh ImposedDelaySeconds and
	// GenerationSeconds in the ttft cost.
	imposedWeight, decodeWeight, evictionWeight float64
	// passed marks the first passedBits candidates that pass the
	// filters, as choose found them (filtering again costs as much as
	// the cost).
	passed uint64
}

// passedBits is how many candidates coster.passed covers; eligible
// filters those beyond again.
const passedBits = 64

// Weight resolves a configured weight (Options.ImposedDelayWeight,
// DecodeWeight, EvictionWeight) to the one the ttft cost uses: 0 means
// fallback, the default; a negative value (or NaN) turns the term off.
func Weight(configured, fallback float64) float64 {
	switch {
	case configured == 0:
		return fallback
	case configured > 0:
		return configured
	}
	return 0
}

func newCoster(req *Request, cands []Candidate, opts *Options, passed uint64) coster {
	k := coster{req: req, cands: cands, opts: opts, strategy: opts.Strategy, passed: passed}
	if k.strategy == "" {
		k.strategy = TTFT
	}
	k.imposedWeight = Weight(opts.ImposedDelayWeight, DefaultImposedDelayWeight)
	k.decodeWeight = Weight(opts.DecodeWeight, DefaultDecodeWeight)
	k.evictionWeight = Weight(opts.EvictionWeight, DefaultEvictionWeight)
	if k.strategy == LLMD {
		k.llmd = newLLMDScale(req, cands, opts)
	}
	return k
}

func (k *coster) eligible(i int) bool {
	if i < passedBits {
		return k.passed&(1<<i) != 0
	}
	return filter(k.req, &k.cands[i], k.opts.KVMarginTokens) == NotFiltered
}

// cost is the strategy's cost of candidate i; NaN (from extreme inputs)
// counts as +Inf, so that it never wins and comparisons stay ordered.
func (k *coster) cost(i int) float64 {
	if c := k.rawCost(i); !math.IsNaN(c) {
		return c
	}
	return math.Inf(1)
}

func (k *coster) rawCost(i int) float64 {
	c := &k.cands[i]
	switch k.strategy {
	case LLMD:
		return k.llmd.cost(k.req, c)
	case Dynamo:
		return dynamoCost(k.req, c, k.opts)
	case LeastWork:
		return float64(queuedTokens(c))
	}
	cost := EstimateTTFT(k.req, c)
	if k.imposedWeight > 0 {
		cost += k.imposedWeight * ImposedDelaySeconds(k.req, c)
	}
	if k.evictionWeight > 0 {
		cost += k.evictionWeight * (EvictedSeconds(k.req, c) + AdapterEvictedSeconds(k.req, c))
	}
	if k.decodeWeight > 0 {
		cost += k.decodeWeight * GenerationSeconds(k.req, c)
	}
	return cost
}

// tolerance is how close to the best cost counts as a tie.
func (k *coster) tolerance(best float64) float64 {
	if k.strategy == TTFT {
		if k.opts.TieSeconds > 0 {
			return k.opts.TieSeconds
		}
		return DefaultTieSeconds
	}
	return 1e-9 * math.Max(1, math.Abs(best))
}

// pickLowest returns the eligible candidate of lowest cost. Costs within
// the tie tolerance of the best tie. Among ties, the ttft strategy keeps
// those with the least prompt to prefill; then ttft and least_work draw
// two at random and take the one with less queued work (power of two
// choices), so equal replicas do not herd; the other
// routers' rules take one uniformly at random, as llm-d's max-score picker
// (shuffle, then stable sort) and Dynamo's selector (after its tree-size
// tie-break, which the port lacks) do. Without rng, the first wins.
func pickLowest(k *coster, rng Rand) int {
	// Each eligible candidate's cost, computed once; NaN marks the
	// ineligible (cost never returns NaN). On the stack for usual pools.
	var stack [64]float64
	costs := stack[:0]
	if len(k.cands) > len(stack) {
		costs = make([]float64, 0, len(k.cands))
	}
	best, bestCost := -1, math.Inf(1)
	for i := range k.cands {
		c := math.NaN()
		if k.eligible(i) {
			c = k.cost(i)
			// The first eligible candidate stands even if every cost is
			// infinite.
			if best < 0 || c < bestCost {
				best, bestCost = i, c
			}
		}
		costs = append(costs, c)
	}
	limit := bestCost + k.tolerance(bestCost)
	ties := 0
	for _, c := range costs {
		if c <= limit { // false for NaN
			ties++
		}
	}
	if ties < 2 || rng == nil {
		return best
	}
	if k.strategy != TTFT && k.strategy != LeastWork {
		return nthTie(costs, limit, rng.IntN(ties))
	}
	if k.strategy == TTFT {
		// Of equally fast candidates, those that prefill the least: the
		// estimate cannot tell them apart, and a copy of the prefix costs
		// the fleet its prefill again and the KV it takes from others.
		least := math.MaxInt
		for i, c := range costs {
			if c <= limit {
				least = min(least, uncached(k.req, &k.cands[i]))
			}
		}
		ties = 0
		for i, c := range costs {
			if c <= limit && uncached(k.req, &k.cands[i]) > least {
				costs[i] = math.NaN()
			} else if c <= limit {
				ties++
			}
		}
		if ties < 2 {
			return nthTie(costs, limit, 0)
		}
	}
	a, b := nthTie(costs, limit, rng.IntN(ties)), nthTie(costs, limit, rng.IntN(ties))
	if queuedTokens(&k.cands[b]) < queuedTokens(&k.cands[a]) {
		return b
	}
	return a
}

// uncached is the prompt c would have to prefill for req.
func uncached(req *Request, c *Candidate) int { return max(0, req.PromptTokens-c.MatchedTokens) }

// nthTie returns the index of the nth cost within limit.
func nthTie(costs []float64, limit float64, n int) int {
	for i, c := range costs {
		if c <= limit {
			if n == 0 {
				return i
			}
			n--
		}
	}
	return -1
}

// explainBest lists the best few eligible candidates by cost.
func explainBest(k *coster) []Explained {
	var all []Explained
	for i := range k.cands {
		if !k.eligible(i) {
			continue
		}
		c := &k.cands[i]
		all = append(all, Explained{
			Index: i, Name: c.Name, Cost: k.cost(i), TTFTSeconds: EstimateTTFT(k.req, c),
			MatchedTokens: c.MatchedTokens, QueuedTokens: queuedTokens(c), Adapter: c.Adapter,
		})
	}
	slices.SortStableFunc(all, func(a, b Explained) int { return cmp.Compare(a.Cost, b.Cost) })
	return all[:min(len(all), explainTop)]
}
