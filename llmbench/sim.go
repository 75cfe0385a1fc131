package llmbench

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"strconv"
	"time"

	"github.com/zeebo/xxh3"

	"github.com/llmaffinity/caddy-llm-affinity/kvsim"
	"github.com/llmaffinity/caddy-llm-affinity/prefixindex"
	"github.com/llmaffinity/caddy-llm-affinity/scorer"
)

// Router-side constants the simulation shares with the Caddy plugin's defaults.
const (
	// RouterBlockTokens is the router's hash block size in tokens.
	RouterBlockTokens = 64
	// DefaultScrapeInterval is how often the simulated router reads the engines' metrics.
	DefaultScrapeInterval = 100 * time.Millisecond
	// decodeRateBatch is the batch size at which the derived decode rate is taken.
	decodeRateBatch = 64
)

// Sim replays a workload through the router's own decision code (prefixindex and scorer) and
// Replicas kvsim engine models in virtual time: one event loop, no HTTP, no goroutine per
// request. It implements [Runner].
//
// The router side mirrors the Caddy plugin: on arrival it hashes the prompt (64-token blocks,
// 4 bytes a token), matches it against the shared index, builds a scorer.Candidate per replica
// and calls scorer.Choose; it then charges the chosen replica's queued prefill (the uncached
// prompt tokens) and queued decode (max_tokens), and inserts the prompt's blocks into that
// replica's index (capacity: the engine's KV in 64-token blocks). The first token releases
// the prefill charge, each token decays the decode charge by one, the finish releases the
// rest. Engine metrics (KV usage, waiting queue, adapters) are read every ScrapeInterval, as
// the plugin scrapes /metrics; the free KV a candidate shows is the last scrape's minus what
// was sent there since.
type Sim struct {
	Config
	// ScrapeInterval is how often engine metrics are read: 0 means DefaultScrapeInterval, a
	// negative value never (free KV and waiting unknown, so the KV filter never sheds).
	ScrapeInterval time.Duration
	// GatewayWait is how long a request that fits nowhere waits at the gateway, retried at
	// every scrape, before it is shed; 0 sheds it at once.
	GatewayWait time.Duration
	// PrefillTokensPerSecond and DecodeTokensPerSecond are the rates the scorer assumes;
	// 0 derives them from the engine configuration (see [Sim.Rates]).
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
	inFlight      int

	// Last scrape of the engine's metrics.
	freeKVTokens  int // -1 when unknown
	waiting       int // -1 when unknown
	adapters      map[string]scorer.AdapterState
	sentKVTokens  int             // KV promised to requests sent since the scrape
	sentAdapters  map[string]bool // adapters requested there since the scrape
	heapPos       int
	result        *ReplicaResult
	capacityToken int
}

// inflight is a request sent to an engine and not finished.
type inflight struct {
	req           *Request
	res           *RequestResult
	replica       int
	prefillCharge int
	decodeCharge  int
	kreq          kvsim.Request
}

// waiter is a request waiting at the gateway for a replica that fits.
type waiter struct {
	req      *Request
	text     []byte
	deadline time.Duration
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

	replicas []simReplica
	heap     engineHeap
	index    *prefixindex.Index
	hasher   prefixindex.Hasher
	prefill  float64
	decode   float64
	scrape   time.Duration

	inflight map[*kvsim.Request]*inflight
	gateway  []waiter
	results  *Results
	events   []kvsim.Event
	hashes   []uint64
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
	cfg := s.Engine.WithDefaults()
	cfg.Adapters = append(append([]string(nil), cfg.Adapters...), w.Adapters...)
	if cfg.BytesPerToken != BytesPerToken {
		return nil, fmt.Errorf("engine bytes_per_token must be %d, the workload's token size", BytesPerToken)
	}
	run := &simRun{
		sim:      s,
		policy:   policy,
		cfg:      cfg,
		rng:      rand.New(rand.NewPCG(s.Seed, 0x726f75746572)),
		hasher:   prefixindex.Hasher{BlockTokens: RouterBlockTokens, BytesPerToken: BytesPerToken},
		inflight: make(map[*kvsim.Request]*inflight),
		seeds:    make(map[string]uint64),
		scrape:   s.ScrapeInterval,
	}
	if run.scrape == 0 {
		run.scrape = DefaultScrapeInterval
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
	capacityBlocks := cfg.NumGPUBlocks * cfg.BlockSize / RouterBlockTokens
	run.index = prefixindex.New(capacityBlocks)
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
		run.index.SetCapacity(rep.id, capacityBlocks)
		rep.freeKVTokens, rep.waiting = -1, -1
		rep.capacityToken = cfg.NumGPUBlocks * cfg.BlockSize
		rep.result = &run.results.Replicas[i]
		rep.result.Name = rep.name
	}
	run.heap.init(run.replicas)
	run.cands = make([]scorer.Candidate, s.Replicas)
	return run, nil
}

// loop is the discrete-event loop: the next thing to happen is an engine's step end, a
// metrics scrape, or an arrival, in that order on equal times, so that a router deciding at
// time t sees every engine event up to t.
func (run *simRun) loop(ctx context.Context, w *Workload) error {
	inf := time.Duration(math.MaxInt64)
	next := 0
	scraping := run.scrape > 0
	nextScrape := time.Duration(0)
	if len(w.Requests) > 0 {
		nextScrape = w.Requests[0].Arrival
	}
	for iter := 0; ; iter++ {
		if iter&8191 == 0 {
			if err := ctx.Err(); err != nil {
				return err
			}
		}
		tArrive := inf
		if next < len(w.Requests) {
			tArrive = w.Requests[next].Arrival
		}
		tEngine, ei := run.heap.min()
		tScrape := inf
		if scraping && (next < len(w.Requests) || len(run.inflight) > 0 || len(run.gateway) > 0) {
			tScrape = nextScrape
		}
		switch {
		case tArrive == inf && tEngine == inf && tScrape == inf:
			return nil
		case tEngine <= tArrive && tEngine <= tScrape:
			run.events = run.replicas[ei].engine.AdvanceTo(tEngine, run.events[:0])
			for i := range run.events {
				run.handle(&run.events[i])
			}
			run.heap.fix(ei)
		case tScrape <= tArrive:
			run.scrapeAll()
			run.retryGateway(tScrape)
			nextScrape = tScrape + run.scrape
		default:
			r := &w.Requests[next]
			next++
			run.arrive(r, r.AppendPrompt(nil), tArrive, tArrive+run.sim.GatewayWait, run.sim.GatewayWait > 0)
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
		rep.inFlight--
		f.res.E2E = max(ev.Time-f.req.Arrival, 1)
		f.res.PromptTokens = ev.PromptTokens
		f.res.CachedTokens = ev.CachedTokens
		f.res.OutputTokens = ev.GeneratedTokens
		rep.result.OutputTokens += int64(ev.GeneratedTokens)
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

// scrapeAll reads every engine's metrics as the plugin would from /metrics: free KV from the
// KV usage gauge, the waiting queue, and where each adapter is.
func (run *simRun) scrapeAll() {
	for i := range run.replicas {
		rep := &run.replicas[i]
		st := rep.engine.Stats()
		rep.freeKVTokens = (st.TotalBlocks - st.UsedBlocks) * run.cfg.BlockSize
		rep.waiting = st.Waiting
		rep.sentKVTokens = 0
		if len(run.cfg.Adapters) == 0 {
			continue
		}
		if rep.adapters == nil {
			rep.adapters = make(map[string]scorer.AdapterState)
			rep.sentAdapters = make(map[string]bool)
		}
		clear(rep.adapters)
		clear(rep.sentAdapters)
		for _, a := range st.HostAdapters {
			rep.adapters[a] = scorer.AdapterHost
		}
		for _, a := range st.LoadingAdapters {
			rep.adapters[a] = scorer.AdapterHost
		}
		for _, a := range st.GPUAdapters {
			rep.adapters[a] = scorer.AdapterResident
		}
	}
}

// retryGateway routes the waiting requests again, in arrival order, and sheds those whose
// deadline passed.
func (run *simRun) retryGateway(now time.Duration) {
	if len(run.gateway) == 0 {
		return
	}
	waiting := run.gateway
	run.gateway = nil
	for _, wt := range waiting {
		run.arrive(wt.req, wt.text, now, wt.deadline, now < wt.deadline)
	}
}

// arrive routes a request at time now and submits it to the chosen engine. When no replica
// fits, the request waits at the gateway if canWait, else it is shed.
func (run *simRun) arrive(r *Request, text []byte, now, deadline time.Duration, canWait bool) {
	res := &run.results.Requests[r.Index]
	var choice, prefillCharge int
	if run.affinity {
		choice, prefillCharge = run.chooseAffinity(r, text)
	} else {
		choice = run.chooseCaddy(r)
		prefillCharge = r.PromptTokens
	}
	if choice < 0 {
		if canWait {
			run.gateway = append(run.gateway, waiter{req: r, text: text, deadline: deadline})
			return
		}
		res.Shed = true
		run.progress()
		return
	}
	rep := &run.replicas[choice]
	f := &inflight{req: r, res: res, replica: choice, prefillCharge: prefillCharge, decodeCharge: r.MaxTokens}
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
		rep.queuedPrefill += f.prefillCharge
		rep.queuedDecode += f.decodeCharge
		rep.sentKVTokens += f.prefillCharge + r.MaxTokens
		if r.Model != "" && rep.sentAdapters != nil {
			rep.sentAdapters[r.Model] = true
		}
		run.index.Insert(rep.id, run.hashes)
	}
}

func (run *simRun) seed(adapter string) uint64 {
	s, ok := run.seeds[adapter]
	if !ok {
		s = prefixindex.Seed(run.cfg.Model, adapter, "")
		run.seeds[adapter] = s
	}
	return s
}

// chooseAffinity is the llm_affinity selection: hash, match, build candidates, Choose. It
// returns the chosen replica (-1 when none fits) and the uncached prompt tokens there.
func (run *simRun) chooseAffinity(r *Request, text []byte) (int, int) {
	run.hashes = run.hasher.HashBytes(run.hashes[:0], run.seed(r.Model), text)
	run.matched = run.index.Match(run.hashes, run.matched)
	promptTokens := len(text) / BytesPerToken
	req := scorer.Request{
		PromptTokens: promptTokens,
		Blocks:       len(run.hashes),
		BlockTokens:  RouterBlockTokens,
		OutputTokens: r.MaxTokens,
		Model:        run.cfg.Model,
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
			Waiting:                rep.waiting,
			PrefillTokensPerSecond: run.prefill,
			DecodeTokensPerSecond:  run.decode,
			FreeKVTokens:           -1,
			KVCapacityTokens:       rep.capacityToken,
			Adapter:                scorer.AdapterResident,
		}
		if rep.freeKVTokens >= 0 {
			c.FreeKVTokens = max(0, rep.freeKVTokens-rep.sentKVTokens)
		}
		if r.Model != "" {
			c.Adapter, c.AdapterLoadSeconds = run.adapterState(rep, r.Model)
		}
	}
	d := scorer.Choose(req, run.cands, run.opts, run.rng, nil)
	if d.Chosen < 0 {
		return -1, 0
	}
	return d.Chosen, max(0, promptTokens-run.cands[d.Chosen].MatchedTokens)
}

// adapterState says where a replica has an adapter, from the last scrape; an adapter sent
// there since is taken as resident, since its load is already under way.
func (run *simRun) adapterState(rep *simReplica, adapter string) (scorer.AdapterState, float64) {
	if rep.sentAdapters[adapter] {
		return scorer.AdapterResident, 0
	}
	if rep.adapters == nil {
		return scorer.AdapterUnknown, run.cfg.LoRAHostLoad.Seconds()
	}
	switch rep.adapters[adapter] {
	case scorer.AdapterResident:
		return scorer.AdapterResident, 0
	case scorer.AdapterHost:
		return scorer.AdapterHost, run.cfg.LoRAHostLoad.Seconds()
	}
	return scorer.AdapterRemote, run.cfg.LoRAStorageLoad.Seconds()
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
