package scorer

// The other routers' rules, reimplemented from their public sources:
// SGLang's router (sgl-project/sglang, sgl-model-gateway/src/policies/
// cache_aware.rs), llm-d's scheduler (llm-d/llm-d-router, the default
// scheduling profile: prefix-cache-scorer 3, queue-scorer 2,
// kv-cache-utilization-scorer 2) and NVIDIA Dynamo's KV router
// (ai-dynamo/dynamo, docs/architecture/kv_cache_routing.md: cost =
// overlap_score_weight × prefill blocks + decode blocks).

// SGLangOptions tune the sglang strategy. Zero fields take the defaults
// SGLang released with its router in v0.4 (Dec 2024): 0.5 / 32 / 1.0001.
type SGLangOptions struct {
	// CacheThreshold: a match rate above it routes to the holder.
	CacheThreshold float64
	// BalanceAbsThreshold and BalanceRelThreshold: the load is imbalanced
	// when max−min > abs and max > rel·min; then the least loaded wins.
	BalanceAbsThreshold float64
	BalanceRelThreshold float64
}

// chooseSGLang follows SGLang router's cache_aware select_worker
// (sgl-router src/policies/cache_aware.rs, research §1.2): load is the
// router-local in-flight request count; when imbalanced, route to the
// least loaded; otherwise to the worker with the deepest prefix match if
// the match rate exceeds the threshold, else to the least loaded (SGLang
// takes the worker with the smallest approximate tree there, which this
// port does not keep; BENCHMARKS.md says so).
//
// Ties are broken at random. SGLang's deepest node's tenant is whichever
// one its concurrent map yields first; its least-loaded choice takes the
// first minimum, the lowest index, which is what piled work onto
// low-numbered replicas at low load when this port copied it. Without
// rng, the first wins.
func chooseSGLang(req *Request, cands []Candidate, opts *Options, rng Rand) int {
	o := opts.SGLang
	threshold := orDefault(o.CacheThreshold, 0.5)
	abs := orDefault(o.BalanceAbsThreshold, 32)
	rel := orDefault(o.BalanceRelThreshold, 1.0001)

	// Reservoir sampling keeps a uniformly random one of the ties without
	// allocating.
	minLoad, maxLoad, least, deepest := -1, -1, -1, -1
	leastTies, deepestTies := 0, 0
	for i := range cands {
		if filter(req, &cands[i], opts.KVMarginTokens) != NotFiltered {
			continue
		}
		load := cands[i].InFlight
		switch {
		case least < 0 || load < minLoad:
			least, minLoad, leastTies = i, load, 1
		case load == minLoad:
			leastTies++
			if rng != nil && rng.IntN(leastTies) == 0 {
				least = i
			}
		}
		maxLoad = max(maxLoad, load)
		switch {
		case deepest < 0 || cands[i].MatchedTokens > cands[deepest].MatchedTokens:
			deepest, deepestTies = i, 1
		case cands[i].MatchedTokens == cands[deepest].MatchedTokens:
			deepestTies++
			if rng != nil && rng.IntN(deepestTies) == 0 {
				deepest = i
			}
		}
	}
	if float64(maxLoad-minLoad) > abs && float64(maxLoad) > rel*float64(minLoad) {
		return least
	}
	if req.PromptTokens > 0 && float64(cands[deepest].MatchedTokens)/float64(req.PromptTokens) > threshold {
		return deepest
	}
	return least
}

// LLMDOptions tune the llmd strategy: the weights of llm-d's default
// scheduling profile (prefix-cache-scorer 3, queue-scorer 2,
// kv-cache-utilization-scorer 2; research llm-d §1.3). Zero fields take
// those defaults.
type LLMDOptions struct {
	PrefixWeight float64
	QueueWeight  float64
	KVWeight     float64
}

// llmdScale holds what llm-d's scorers normalise over the candidates.
type llmdScale struct {
	wp, wq, wk  float64
	minQ, maxQ  int
	blockTokens int
}

func llmdQueue(c *Candidate) int {
	if c.Waiting >= 0 {
		return c.Waiting
	}
	return c.InFlight
}

func newLLMDScale(req *Request, cands []Candidate, opts *Options) llmdScale {
	s := llmdScale{
		wp: orDefault(opts.LLMD.PrefixWeight, 3), wq: orDefault(opts.LLMD.QueueWeight, 2),
		wk: orDefault(opts.LLMD.KVWeight, 2), minQ: -1, maxQ: -1, blockTokens: max(req.BlockTokens, 1),
	}
	for i := range cands {
		if filter(req, &cands[i], opts.KVMarginTokens) != NotFiltered {
			continue
		}
		q := llmdQueue(&cands[i])
		if s.minQ < 0 || q < s.minQ {
			s.minQ = q
		}
		s.maxQ = max(s.maxQ, q)
	}
	return s
}

// cost returns the negated weighted score (lower is better), so llm-d's
// max-score picker becomes pickLowest:
//   - prefix: matched blocks / total blocks;
//   - queue: (maxQ − q)/(maxQ − minQ) over the candidates, 1 if all equal,
//     with q the engine's waiting queue (the router's in-flight count
//     when unknown);
//   - kv: 1 − KV utilisation (1 when unknown).
func (s *llmdScale) cost(req *Request, c *Candidate) float64 {
	prefix := 0.0
	if req.Blocks > 0 {
		prefix = min(1, float64(c.MatchedTokens/s.blockTokens)/float64(req.Blocks))
	}
	qs := 1.0
	if s.maxQ > s.minQ {
		qs = float64(s.maxQ-llmdQueue(c)) / float64(s.maxQ-s.minQ)
	}
	kv := 1.0
	if c.FreeKVTokens >= 0 && c.KVCapacityTokens > 0 {
		kv = float64(c.FreeKVTokens) / float64(c.KVCapacityTokens)
	}
	return -(s.wp*prefix + s.wq*qs + s.wk*kv)
}

// DynamoOptions tune the dynamo strategy.
type DynamoOptions struct {
	// OverlapWeight scales prefill blocks against decode blocks. Default 1.
	OverlapWeight float64
}

// dynamoCost is Dynamo's classic KV router cost (docs
// architecture/kv_cache_routing.md, research Dynamo §2.1):
// overlap_weight · prefill_blocks + decode_blocks, where prefill_blocks
// are the request's uncached blocks plus the worker's queued prefill, and
// decode_blocks the worker's active blocks plus the request's.
func dynamoCost(req *Request, c *Candidate, opts *Options) float64 {
	w := orDefault(opts.Dynamo.OverlapWeight, 1)
	bt := float64(max(req.BlockTokens, 1))
	prefill := float64(max(0, req.PromptTokens-c.MatchedTokens)+c.QueuedPrefillTokens) / bt
	// Active blocks: from the engine's KV use when known, else the work the
	// router itself has in flight there.
	active := c.QueuedPrefillTokens + c.QueuedDecodeTokens
	if c.FreeKVTokens >= 0 && c.KVCapacityTokens > 0 {
		active = max(0, c.KVCapacityTokens-c.FreeKVTokens)
	}
	decode := float64(active+req.PromptTokens) / bt
	return w*prefill + decode
}

func orDefault(v, def float64) float64 {
	if v > 0 {
		return v
	}
	return def
}
