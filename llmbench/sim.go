package llmbench

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strconv"
	"time"

	"github.com/zeebo/xxh3"

	"github.com/llmaffinity/caddy-llm-affinity/kvsim"
	"github.com/llmaffinity/caddy-llm-affinity/prefixindex"
	"github.com/llmaffinity/caddy-llm-affinity/scorer"
)

// Router-side settings the simulation shares with the Caddy plugin's defaults.
const (
	// RouterBlockTokens is the router's hash block size in tokens.
	RouterBlockTokens = 64
	// DefaultQueueTimeout is how long a request that fits nowhere waits at the gateway.
	DefaultQueueTimeout = 5 * time.Second
	// DefaultOutputTokens is the output estimate before any output was observed.
	DefaultOutputTokens = 256
	// decodeRateBatch is the batch size at which the derived decode rate is taken.
	decodeRateBatch = 64
)

// Output estimates, as the plugin's output_estimate option names them.
const (
	// OutputAverage expects the running average of observed outputs of the model, bounded
	// by max_tokens (the plugin's default).
	OutputAverage = "average"
	// OutputMaxTokens expects max_tokens.
	OutputMaxTokens = "max_tokens"
	// OutputFixed expects OutputTokens.
	OutputFixed = "fixed"
)

// Sim replays a workload through the router's own decision code (prefixindex and scorer) and
// Replicas kvsim engine models in virtual time: one event loop, no HTTP, no goroutine per
// request. It implements [Runner].
//
// The router side mirrors the Caddy plugin's llm_affinity policy: on arrival it hashes the
// prompt (64-token blocks, 4 bytes a token, seeded by model and adapter), matches it against
// the shared index, builds a scorer.Candidate per replica and calls scorer.Choose; it then
// charges the chosen replica with the uncached prompt tokens (queued prefill), the expected
// output (queued decode) and the prompt plus expected output (KV in use), and inserts the
// prompt's blocks into that replica's index (capacity: the engine's KV in 64-token blocks).
// The first token releases the prefill charge, each token decays the decode charge by one,
// the finish releases the rest and teaches the output estimate. A candidate's free KV is its
// capacity minus the KV charged to it; the adapters it holds are the last max_loras adapters
// sent there (older ones remembered are taken as in host memory). A request that fits nowhere
// waits at the gateway, retried whenever a charge is released, and is shed after QueueTimeout.
// Engine metrics are not read: this is the plugin with scrape_interval off, its default.
type Sim struct {
	Config
	// QueueTimeout is how long a request that fits nowhere waits at the gateway before it is
	// shed: 0 means DefaultQueueTimeout, a negative value sheds at once.
	QueueTimeout time.Duration
	// OutputEstimate is OutputAverage (default), OutputMaxTokens or OutputFixed.
	OutputEstimate string
	// OutputTokens is the output estimate before any output was observed, and the fixed
	// estimate. 0 means DefaultOutputTokens.
	OutputTokens int
	// PrefillTokensPerSecond and DecodeTokensPerSecond are the rates the scorer assumes (the
	// plugin's hardware profile); 0 derives them from the engine configuration (see
	// [Sim.Rates]).
	PrefillTokensPerSecond float64
	DecodeTokensPerSecond  float64
	// Scorer tunes the llm_affinity decision; its Strategy is set from the policy name.
	Scorer scorer.Options
}

// Rates returns the prefill and decode rates the scorer is given for workload w: prefill is
// 1/PerPrefillToken; decode is the aggregate tokens per second of a batch of 64 sequences
// whose context is the workload's mean prompt plus half its mean output.
func (s *Sim) Rates(w *Workload) (prefill, decode float64) {
	cfg := s.Engine.WithDefaults()
	prefill = s.PrefillTokensPerSecond
	if prefill <= 0 {
		prefill = 1 / cfg.PerPrefillToken.Seconds()
	}
	decode = s.DecodeTokensPerSecond
	if decode <= 0 {
		st := w.Stats()
		batch := float64(min(decodeRateBatch, cfg.MaxNumSeqs))
		ctxTokens := st.MeanPromptTokens + st.MeanOutputTokens/2
		step := cfg.StepOverhead.Seconds() + batch*(cfg.PerDecodeSequence.Seconds()+ctxTokens*cfg.PerContextToken.Seconds())
		decode = batch / step
	}
	return prefill, decode
}

// simReplica is one engine and the router's view of it.
type simReplica struct {
	name   string
	engine *kvsim.Engine
	id     prefixindex.UpstreamID

	// Router-local accounting, as the plugin keeps it.
	queuedPrefill int
	queuedDecode  int
	kvTokens      int
	inFlight      int
	adapters      []string // the last max_loras adapters sent here, most recent first

	heapPos        int
	result         *ReplicaResult
	capacityTokens int
}

// inflight is a request sent to an engine and not finished.
type inflight struct {
	req           *Request
	res           *RequestResult
	replica       int
	prefillCharge int
	decodeCharge  int
	kvCharge      int
	kreq          kvsim.Request
}

// waiter is a request waiting at the gateway for a replica that fits.
type waiter struct {
	req      *Request
	text     []byte
	hashes   []uint64 // the prompt's block hashes, computed at arrival
	deadline time.Duration
}

// runningMean is the plugin's output estimate: a plain mean at first, then an exponentially
// weighted one, so it follows a changing workload.
type runningMean struct {
	value float64
	n     int
}

func (m *runningMean) add(x float64) {
	m.n++
	m.value += max(0.05, 1/float64(m.n)) * (x - m.value)
}

// simRun is the state of one replay.
type simRun struct {
	sim      *Sim
	policy   string
	strategy scorer.Strategy
	affinity bool
	opts     scorer.Options
	cfg      kvsim.Config
	rng      *rand.Rand

	replicas     []simReplica
	heap         engineHeap
	index        *prefixindex.Index
	hasher       prefixindex.Hasher
	prefill      float64
	decode       float64
	queueTimeout time.Duration
	outputs      map[string]*runningMean

	inflight map[*kvsim.Request]*inflight
	gateway  []waiter
	released bool // a charge was released since the gateway was last retried
	results  *Results
	events   []kvsim.Event
	matched  []int
	cands    []scorer.Candidate
	seeds    map[string]uint64
	robin    int
	done     int
}

// Replay runs the workload under policy and returns what every request measured.
func (s *Sim) Replay(ctx context.Context, w *Workload, policy string) (*Results, error) {
	start := time.Now()
	run, err := s.newRun(w, policy)
	if err != nil {
		return nil, err
	}
	if err := run.loop(ctx, w); err != nil {
		return nil, err
	}
	for i := range run.replicas {
		st := run.replicas[i].engine.Stats()
		run.replicas[i].result.PrefixQueries = st.PrefixQueries
		run.replicas[i].result.PrefixHits = st.PrefixHits
	}
	run.results.Wall = time.Since(start)
	return run.results, nil
}

func (s *Sim) newRun(w *Workload, policy string) (*simRun, error) {
	if s.Replicas < 1 {
		return nil, fmt.Errorf("replicas must be at least 1, got %d", s.Replicas)
	}
	if !ValidPolicy(policy) {
		return nil, fmt.Errorf("unknown policy %q", policy)
	}
	switch s.OutputEstimate {
	case "", OutputAverage, OutputMaxTokens, OutputFixed:
	default:
		return nil, fmt.Errorf("output estimate must be average, max_tokens or fixed, got %q", s.OutputEstimate)
	}
	cfg := s.Engine.WithDefaults()
	cfg.Adapters = append(append([]string(nil), cfg.Adapters...), w.Adapters...)
	if cfg.BytesPerToken != BytesPerToken {
		return nil, fmt.Errorf("engine bytes_per_token must be %d, the workload's token size", BytesPerToken)
	}
	run := &simRun{
		sim:          s,
		policy:       policy,
		cfg:          cfg,
		rng:          rand.New(rand.NewPCG(s.Seed, 0x726f75746572)),
		hasher:       prefixindex.Hasher{BlockTokens: RouterBlockTokens, BytesPerToken: BytesPerToken},
		inflight:     make(map[*kvsim.Request]*inflight),
		seeds:        make(map[string]uint64),
		outputs:      make(map[string]*runningMean),
		queueTimeout: s.QueueTimeout,
	}
	if run.queueTimeout == 0 {
		run.queueTimeout = DefaultQueueTimeout
	}
	run.strategy, run.affinity = AffinityStrategy(policy)
	run.opts = s.Scorer
	run.opts.Strategy = run.strategy
	run.prefill, run.decode = s.Rates(w)

	run.results = &Results{
		Policy:   policy,
		Replicas: make([]ReplicaResult, s.Replicas),
		Requests: make([]RequestResult, len(w.Requests)),
	}
	for i := range run.results.Requests {
		r := &w.Requests[i]
		run.results.Requests[i] = RequestResult{Index: r.Index, Replica: -1, Arrival: r.Arrival, PromptTokens: r.PromptTokens}
	}
	capacityTokens := cfg.NumGPUBlocks * cfg.BlockSize
	run.index = prefixindex.New(capacityTokens / RouterBlockTokens)
	run.replicas = make([]simReplica, s.Replicas)
	for i := range run.replicas {
		eng, err := kvsim.NewEngine(cfg)
		if err != nil {
			return nil, err
		}
		rep := &run.replicas[i]
		rep.name = "replica-" + strconv.Itoa(i)
		rep.engine = eng
		rep.id = run.index.Register(rep.name)
		run.index.SetCapacity(rep.id, capacityTokens/RouterBlockTokens)
		rep.capacityTokens = capacityTokens
		rep.result = &run.results.Replicas[i]
		rep.result.Name = rep.name
	}
	run.heap.init(run.replicas)
	run.cands = make([]scorer.Candidate, s.Replicas)
	return run, nil
}

// loop is the discrete-event loop: the next thing to happen is an engine's step end or an
// arrival, the engine first on equal times, so that a router deciding at time t sees every
// engine event up to t. Requests waiting at the gateway are retried after any release.
func (run *simRun) loop(ctx context.Context, w *Workload) error {
	never := time.Duration(math.MaxInt64)
	next := 0
	for iter := 0; ; iter++ {
		if iter&8191 == 0 {
			if err := ctx.Err(); err != nil {
				return err
			}
		}
		tArrive := never
		if next < len(w.Requests) {
			tArrive = w.Requests[next].Arrival
		}
		tEngine, ei := run.heap.min()
		switch {
		case tArrive == never && tEngine == never:
			// Nothing runs and nothing arrives: whoever still waits can never fit.
			for _, wt := range run.gateway {
				run.shed(wt.req)
			}
			run.gateway = nil
			return nil
		case tEngine <= tArrive:
			run.events = run.replicas[ei].engine.AdvanceTo(tEngine, run.events[:0])
			for i := range run.events {
				run.handle(&run.events[i])
			}
			run.heap.fix(ei)
			if run.released {
				run.released = false
				run.retryGateway(tEngine, ei)
			}
		default:
			r := &w.Requests[next]
			next++
			run.arrive(waiter{req: r, text: r.AppendPrompt(nil), deadline: tArrive + run.queueTimeout}, tArrive)
		}
	}
}

// handle applies one engine event to the router's accounting and the request's result.
func (run *simRun) handle(ev *kvsim.Event) {
	f := run.inflight[ev.Request]
	if f == nil {
		return
	}
	rep := &run.replicas[f.replica]
	switch ev.Kind {
	case kvsim.EventFirstToken, kvsim.EventToken:
		if ev.Kind == kvsim.EventFirstToken {
			f.res.TTFT = max(ev.Time-f.req.Arrival, 1)
			rep.queuedPrefill -= f.prefillCharge
			f.prefillCharge = 0
		}
		if f.decodeCharge > 0 {
			f.decodeCharge--
			rep.queuedDecode--
		}
	case kvsim.EventFinished:
		rep.queuedPrefill -= f.prefillCharge
		rep.queuedDecode -= f.decodeCharge
		rep.kvTokens -= f.kvCharge
		rep.inFlight--
		run.released = true
		f.res.E2E = max(ev.Time-f.req.Arrival, 1)
		f.res.PromptTokens = ev.PromptTokens
		f.res.CachedTokens = ev.CachedTokens
		f.res.OutputTokens = ev.GeneratedTokens
		rep.result.OutputTokens += int64(ev.GeneratedTokens)
		run.learnOutput(f.req, ev.GeneratedTokens)
		delete(run.inflight, ev.Request)
		run.progress()
	}
}

func (run *simRun) progress() {
	run.done++
	if run.sim.Progress != nil {
		run.sim.Progress(run.done, len(run.results.Requests))
	}
}

func (run *simRun) shed(r *Request) {
	run.results.Requests[r.Index].Shed = true
	run.progress()
}

// modelName is the model field of the request as sent: the adapter, or the base model.
func (run *simRun) modelName(r *Request) string {
	if r.Model != "" {
		return r.Model
	}
	return run.cfg.Model
}

func (run *simRun) learnOutput(r *Request, tokens int) {
	m := run.outputs[run.modelName(r)]
	if m == nil {
		m = &runningMean{}
		run.outputs[run.modelName(r)] = m
	}
	m.add(float64(tokens))
}

// expectedOutput is the plugin's output estimate for r.
func (run *simRun) expectedOutput(r *Request) int {
	fallback := run.sim.OutputTokens
	if fallback <= 0 {
		fallback = DefaultOutputTokens
	}
	switch run.sim.OutputEstimate {
	case OutputFixed:
		return fallback
	case OutputMaxTokens:
		return r.MaxTokens
	}
	est := fallback
	if m := run.outputs[run.modelName(r)]; m != nil && m.n > 0 {
		est = int(math.Round(m.value))
	}
	return min(est, r.MaxTokens)
}

// retryGateway routes again the waiting requests that may now fit on replica j, which just
// released work, in arrival order, and sheds those whose deadline passed. Only j's free KV
// grew, so a request that fitted nowhere before can fit only there: checking j alone gives
// the plugin's wake-everyone retry at a fraction of the cost. (One difference: a waiter whose
// output estimate fell since its last try is retried at the next release of a replica it
// fits, not at once.)
func (run *simRun) retryGateway(now time.Duration, j int) {
	if len(run.gateway) == 0 {
		return
	}
	waiting := run.gateway
	run.gateway = nil
	for _, wt := range waiting {
		switch {
		case now > wt.deadline:
			run.shed(wt.req)
		case run.mayFit(wt, j):
			run.arrive(wt, now)
		default:
			run.gateway = append(run.gateway, wt)
		}
	}
}

// mayFit reports whether the waiting request passes the scorer's KV filter on replica j.
func (run *simRun) mayFit(wt waiter, j int) bool {
	rep := &run.replicas[j]
	free := rep.capacityTokens - rep.kvTokens
	r := wt.req
	fixed := run.expectedOutput(r) + run.opts.KVMarginTokens
	switch {
	case r.PromptTokens+fixed <= free:
		return true
	case fixed > free:
		return false
	}
	run.matched = run.index.Match(wt.hashes, run.matched)
	matched := min(run.matched[rep.id]*RouterBlockTokens, r.PromptTokens)
	return r.PromptTokens-matched+fixed <= free
}

// arrive routes a request at time now and submits it to the chosen engine. When no replica
// fits, the request waits at the gateway (unless the queue timeout is negative, when it is
// shed at once).
func (run *simRun) arrive(wt waiter, now time.Duration) {
	r, text := wt.req, wt.text
	res := &run.results.Requests[r.Index]
	output := r.MaxTokens
	var choice, prefillCharge int
	if run.affinity {
		if wt.hashes == nil {
			wt.hashes = run.hasher.HashBytes(nil, run.seed(r), text)
		}
		output = run.expectedOutput(r)
		choice, prefillCharge = run.chooseAffinity(r, wt.hashes, output)
	} else {
		choice = run.chooseCaddy(r)
		prefillCharge = r.PromptTokens
	}
	if choice < 0 {
		if run.queueTimeout > 0 {
			run.gateway = append(run.gateway, wt)
			return
		}
		run.shed(r)
		return
	}
	rep := &run.replicas[choice]
	f := &inflight{req: r, res: res, replica: choice}
	f.kreq = kvsim.Request{
		ID:            strconv.Itoa(r.Index),
		Adapter:       r.Model,
		Context:       text,
		OutputTokens:  min(r.OutputTokens, r.MaxTokens),
		LengthLimited: r.MaxTokens <= r.OutputTokens,
	}
	res.Replica = choice
	rep.result.Requests++
	rep.result.PromptTokens += int64(r.PromptTokens)
	if err := rep.engine.Submit(&f.kreq, now); err != nil {
		res.Err = err.Error()
		run.progress()
		return
	}
	run.heap.fix(choice)
	run.inflight[&f.kreq] = f
	rep.inFlight++
	if run.affinity {
		f.prefillCharge, f.decodeCharge, f.kvCharge = prefillCharge, output, prefillCharge+output
		rep.queuedPrefill += f.prefillCharge
		rep.queuedDecode += f.decodeCharge
		rep.kvTokens += f.kvCharge
		if r.Model != "" {
			rep.useAdapter(r.Model)
		}
		run.index.Insert(rep.id, wt.hashes)
	}
}

// rememberedAdapters is how many adapters the plugin remembers per upstream, most recent first.
const rememberedAdapters = 16

// useAdapter records that adapter was sent to rep: the plugin presumes the last max_loras
// adapters sent somewhere resident, and older ones in its host memory.
func (rep *simReplica) useAdapter(adapter string) {
	rep.adapters = slices.DeleteFunc(rep.adapters, func(a string) bool { return a == adapter })
	rep.adapters = slices.Insert(rep.adapters, 0, adapter)
	if len(rep.adapters) > rememberedAdapters {
		rep.adapters = rep.adapters[:rememberedAdapters]
	}
}

func (run *simRun) seed(r *Request) uint64 {
	s, ok := run.seeds[r.Model]
	if !ok {
		s = prefixindex.Seed(run.modelName(r), r.Model, "")
		run.seeds[r.Model] = s
	}
	return s
}

// chooseAffinity is the llm_affinity selection: hash, match, build candidates, Choose. It
// returns the chosen replica (-1 when none fits) and the uncached prompt tokens there.
func (run *simRun) chooseAffinity(r *Request, hashes []uint64, output int) (int, int) {
	run.matched = run.index.Match(hashes, run.matched)
	promptTokens := r.PromptTokens
	req := scorer.Request{
		PromptTokens: promptTokens,
		Blocks:       len(hashes),
		BlockTokens:  RouterBlockTokens,
		OutputTokens: output,
		Model:        run.modelName(r),
		Adapter:      r.Model,
	}
	for i := range run.replicas {
		rep := &run.replicas[i]
		c := &run.cands[i]
		*c = scorer.Candidate{
			Name:                   rep.name,
			Available:              true,
			MatchedTokens:          min(run.matched[rep.id]*RouterBlockTokens, promptTokens),
			QueuedPrefillTokens:    max(rep.queuedPrefill, 0),
			QueuedDecodeTokens:     max(rep.queuedDecode, 0),
			InFlight:               rep.inFlight,
			Waiting:                -1,
			PrefillTokensPerSecond: run.prefill,
			DecodeTokensPerSecond:  run.decode,
			FreeKVTokens:           max(0, rep.capacityTokens-rep.kvTokens),
			KVCapacityTokens:       rep.capacityTokens,
			Adapter:                scorer.AdapterResident,
		}
		if r.Model != "" {
			switch i := slices.Index(rep.adapters, r.Model); {
			case i >= 0 && i < run.cfg.MaxLoRAs:
			case i >= 0:
				c.Adapter, c.AdapterLoadSeconds = scorer.AdapterHost, run.cfg.LoRAHostLoad.Seconds()
			default:
				c.Adapter, c.AdapterLoadSeconds = scorer.AdapterRemote, run.cfg.LoRAStorageLoad.Seconds()
			}
		}
	}
	d := scorer.Choose(req, run.cands, run.opts, run.rng, nil)
	if d.Chosen < 0 {
		return -1, 0
	}
	return d.Chosen, max(0, promptTokens-run.cands[d.Chosen].MatchedTokens)
}

// chooseCaddy is one of Caddy's own selection policies.
func (run *simRun) chooseCaddy(r *Request) int {
	n := len(run.replicas)
	switch run.policy {
	case "round_robin":
		c := run.robin % n
		run.robin++
		return c
	case "least_conn":
		// Fewest in-flight requests, uniformly random among ties (reservoir sampling, as
		// Caddy's LeastConnSelection does).
		best, ties := -1, 0
		for i := range run.replicas {
			switch {
			case best < 0 || run.replicas[i].inFlight < run.replicas[best].inFlight:
				best, ties = i, 1
			case run.replicas[i].inFlight == run.replicas[best].inFlight:
				ties++
				if run.rng.IntN(ties) == 0 {
					best = i
				}
			}
		}
		return best
	case "random":
		return run.rng.IntN(n)
	case "first":
		return 0
	case "header":
		return rendezvous(run.replicas, HeaderKey(r))
	}
	return 0
}

// HeaderKey is the routing key the header policy hashes: the request's session (the user in
// mrqa, the tenant in lora, a trace's session field), or, when it has none, the id of the
// first prompt segment: hash_ids[0] for a trace (the same for every request of the Mooncake
// conversation trace, whose block 0 is a shared system prompt), the group's system prompt in
// gsp, a unique id in noprefix.
func HeaderKey(r *Request) string {
	if r.Session != "" {
		return r.Session
	}
	if len(r.Segments) > 0 {
		return strconv.FormatUint(r.Segments[0].ID, 16)
	}
	return ""
}

// rendezvous picks the replica of highest hash of name+key, as Caddy's hash-based policies
// (highest random weight) do.
func rendezvous(reps []simReplica, key string) int {
	best, bestHash := 0, uint64(0)
	for i := range reps {
		if h := xxh3.HashString(reps[i].name + key); i == 0 || h > bestHash {
			best, bestHash = i, h
		}
	}
	return best
}

// engineHeap orders replicas by the time their engine next has something to do; idle
// engines sort last. It is indexed, so a replica's entry can be fixed after it changes.
type engineHeap struct {
	reps  []simReplica
	order []int
	keys  []time.Duration
}

func (h *engineHeap) init(reps []simReplica) {
	h.reps = reps
	h.order = make([]int, len(reps))
	h.keys = make([]time.Duration, len(reps))
	for i := range reps {
		h.order[i] = i
		reps[i].heapPos = i
		h.keys[i] = math.MaxInt64
	}
}

func (h *engineHeap) key(rep int) time.Duration {
	if t, ok := h.reps[rep].engine.NextEventTime(); ok {
		return t
	}
	return math.MaxInt64
}

// min returns the earliest next event time and its replica.
func (h *engineHeap) min() (time.Duration, int) {
	return h.keys[h.order[0]], h.order[0]
}

// fix re-reads replica rep's next event time and restores the heap order.
func (h *engineHeap) fix(rep int) {
	h.keys[rep] = h.key(rep)
	i := h.reps[rep].heapPos
	if !h.up(i) {
		h.down(i)
	}
}

func (h *engineHeap) less(i, j int) bool {
	a, b := h.order[i], h.order[j]
	if h.keys[a] != h.keys[b] {
		return h.keys[a] < h.keys[b]
	}
	return a < b
}

func (h *engineHeap) swap(i, j int) {
	h.order[i], h.order[j] = h.order[j], h.order[i]
	h.reps[h.order[i]].heapPos = i
	h.reps[h.order[j]].heapPos = j
}

func (h *engineHeap) up(i int) bool {
	moved := false
	for i > 0 {
		parent := (i - 1) / 2
		if !h.less(i, parent) {
			break
		}
		h.swap(i, parent)
		i = parent
		moved = true
	}
	return moved
}

func (h *engineHeap) down(i int) {
	n := len(h.order)
	for {
		l := 2*i + 1
		if l >= n {
			return
		}
		small := l
		if r := l + 1; r < n && h.less(r, l) {
			small = r
		}
		if !h.less(small, i) {
			return
		}
		h.swap(i, small)
		i = small
	}
}
