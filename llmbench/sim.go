package llmbench

import (
	"cmp"
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"net/http"
	"slices"
	"strconv"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"

	"github.com/llmaffinity/caddy-llm-affinity/kvsim"
	"github.com/llmaffinity/caddy-llm-affinity/prefixindex"
	"github.com/llmaffinity/caddy-llm-affinity/router"
	"github.com/llmaffinity/caddy-llm-affinity/scorer"
)

// Router-side settings: the Caddy plugin's defaults, from the packages that define them.
const (
	// RouterBlockTokens is the router's hash block size in tokens.
	RouterBlockTokens = prefixindex.DefaultBlockTokens
	// DefaultQueueTimeout is how long a request may wait to start (queued at an engine for KV,
	// or at the gateway when no replica can start it in time).
	DefaultQueueTimeout = router.DefaultQueueTimeout
	// DefaultOutputTokens is the output estimate before any output was observed.
	DefaultOutputTokens = router.DefaultOutputTokens
	// decodeRateBatch is the batch size at which the derived decode rate is taken.
	decodeRateBatch = 64
)

// Output estimates, as the plugin's output_estimate option names them.
const (
	// OutputAverage expects the running average of observed outputs of the model, bounded
	// by max_tokens (the plugin's default).
	OutputAverage = router.OutputAverage
	// OutputMaxTokens expects max_tokens.
	OutputMaxTokens = router.OutputMaxTokens
	// OutputFixed expects OutputTokens.
	OutputFixed = router.OutputFixed
)

// Sim replays a workload through the router's own decision engine (package router, which the
// Caddy plugin calls too) and Replicas kvsim engine models in virtual time: one event loop, no
// HTTP, no goroutine per request. It implements [Runner].
//
// For an llm_affinity policy, on arrival it hashes the prompt (64-token blocks, 4 bytes a
// token, seeded by model and adapter) and asks router.Fleet.Decide, as the plugin does, with
// one member per replica (its hardware profile: the rates of [Sim.Rates] and the engine's KV
// capacity); each output token is router.Fleet.Progress, the finish router.Fleet.Complete. A
// request goes where its KV is free or expected to free within what is left of QueueTimeout
// (router.Request.MaxWait; the engine queues it meanwhile). One that no replica can start in
// time waits at the gateway (router.Fleet.Hold, as the plugin's requests: at most QueueLimit
// of them, or it is shed at once), is retried when its hold is readied by a release of work
// where it may now fit, first come first served, and is shed once QueueTimeout has passed.
// Waiting requests also decide again every router.HoldPollInterval, as the plugin's do,
// which catches what readies no hold (a lower output estimate learned from a response may
// let a request fit on a replica that released nothing). Engine metrics are not
// read: this is the plugin with scrape_interval off, its default.
//
// Caddy's own policies are Caddy's selection policy types themselves (round_robin,
// least_conn, random, first, header), choosing among reverseproxy.Upstreams whose request
// counts the simulation keeps as Caddy's proxy would. random and least_conn's ties draw from
// Caddy's own (unseeded) random source, so their results vary from run to run.
type Sim struct {
	Config
	// QueueTimeout is how long a request may wait to start, at an engine for KV to free or at
	// the gateway, before it is shed: 0 means DefaultQueueTimeout, a negative value sends it
	// only where it fits now and sheds it at once otherwise.
	QueueTimeout time.Duration
	// QueueLimit is how many requests may wait at each router's gateway at once; one more
	// is shed at once. 0 means router.DefaultQueueLimit, negative no limit.
	QueueLimit int
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
	// Routers is how many routers share the replicas (0 means 1). Arrivals go to them in
	// turn, per request, as an L4 balancer in front of several gateways would spread them;
	// each router has its own state (for Caddy's policies, its own request counts).
	Routers int
	// Sync shares the llm_affinity routers' state: each applies the others' events
	// (router.Fleet.Apply) SyncDelay after they happened.
	Sync      bool
	SyncDelay time.Duration
	// KVCapacityTokens is the KV capacity the llm_affinity routers are told each replica has
	// (the plugin's kv_capacity, or what scraping reads): 0 is the engines' own; negative
	// leaves it unknown, as the plugin is without kv_capacity and scrape_interval.
	KVCapacityTokens int
	// RestartAt, when positive, restarts the first llm_affinity router at that time of the
	// replay: a new process under a new name takes its arrivals (a rolling restart: the old
	// one finishes what it has in flight, and with Sync the new one hears it as a peer).
	// With Sync its peers restate their charges to it, and with RestartSnapshot it starts
	// with the next router's snapshot of the view (index, adapters and homes), as the
	// plugin's sync gives a router that starts; without, its index is empty.
	RestartAt       time.Duration
	RestartSnapshot bool
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

	heapPos int
	result  *ReplicaResult
}

// inflight is a request sent to an engine and not finished.
type inflight struct {
	req     *Request
	res     *RequestResult
	replica int
	router  *simRouter
	charge  *router.Charge // llm_affinity's charge, nil under Caddy's policies
	fleet   *router.Fleet  // the fleet that made charge (a restarted router's old one)
	kreq    kvsim.Request
}

// simRouter is one router: llm_affinity's decision engine, or one of Caddy's selection
// policies with that router's own view of the upstreams (their request counts).
type simRouter struct {
	name     string
	fleet    *router.Fleet
	selector reverseproxy.Selector
	pool     reverseproxy.UpstreamPool
}

// delivery is an event of one router's charges on its way to the others: from is the
// sending router's index, name its name when it sent it.
type delivery struct {
	at   time.Duration
	from int
	name string
	ev   router.Event
}

// waiter is a request waiting at a router's gateway for a replica that fits.
type waiter struct {
	router   *simRouter
	req      *Request
	text     []byte
	hashes   []uint64 // the prompt's block hashes, computed at arrival
	deadline time.Duration
	// hold is its wait in the router's gateway queue, nil for Caddy's policies (retried
	// after every release).
	hold *router.Hold
}

// ready says whether wt may fit somewhere it did not when it last failed.
func (wt *waiter) ready() bool {
	if wt.hold == nil {
		return true
	}
	select {
	case <-wt.hold.Ready():
		return true
	default:
		return false
	}
}

// unhold ends wt's wait in its router's gateway queue at now.
func (wt *waiter) unhold(now time.Duration) {
	if wt.hold != nil {
		wt.router.fleet.Unhold(wt.hold, at(now))
		wt.hold = nil
	}
}

// simRun is the state of one replay.
type simRun struct {
	sim      *Sim
	policy   string
	affinity bool
	cfg      kvsim.Config
	rng      *rand.Rand

	replicas     []simReplica
	heap         engineHeap
	hasher       prefixindex.Hasher
	queueTimeout time.Duration

	// The routers, the llm_affinity options and one member per replica; the events between
	// routers in flight, in order of delivery; the request Caddy's policies see.
	routers    []simRouter
	nextRouter int
	ropts      router.Options
	members    []router.Member
	outbox     []delivery
	now        time.Duration
	httpReq    *http.Request
	restarted  bool // router 0 was restarted (see Sim.RestartAt)

	inflight map[*kvsim.Request]*inflight
	gateway  []waiter
	nextPoll time.Duration // when the waiting requests next decide again (the plugin's poll)
	released bool          // a charge was released since the gateway was last retried
	results  *Results
	events   []kvsim.Event
	seeds    map[string]uint64
	done     int
}

// simEpoch is the wall-clock instant virtual time 0 stands for, for the decision engine.
var simEpoch = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

func at(t time.Duration) time.Time { return simEpoch.Add(t) }

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
		run.replicas[i].result.AdapterLoads = st.StorageLoads
		run.replicas[i].result.AdapterHostLoads = st.HostLoads
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
	if err := (router.Options{OutputEstimate: s.OutputEstimate}).Validate(); err != nil {
		return nil, err
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
		queueTimeout: cmp.Or(s.QueueTimeout, DefaultQueueTimeout),
	}
	run.results = &Results{
		Policy:   policy,
		Replicas: make([]ReplicaResult, s.Replicas),
		Requests: make([]RequestResult, len(w.Requests)),
	}
	for i := range run.results.Requests {
		r := &w.Requests[i]
		run.results.Requests[i] = RequestResult{Index: r.Index, Replica: -1, Arrival: r.Arrival, PromptTokens: r.PromptTokens}
	}
	run.replicas = make([]simReplica, s.Replicas)
	for i := range run.replicas {
		eng, err := kvsim.NewEngine(cfg)
		if err != nil {
			return nil, err
		}
		rep := &run.replicas[i]
		rep.name = "replica-" + strconv.Itoa(i)
		rep.engine = eng
		rep.result = &run.results.Replicas[i]
		rep.result.Name = rep.name
	}
	run.heap.init(run.replicas)

	strategy, affinity := AffinityStrategy(policy)
	run.affinity = affinity
	run.routers = make([]simRouter, max(1, s.Routers))
	if !affinity {
		run.httpReq = &http.Request{Header: http.Header{}}
		for i := range run.routers {
			rt := &run.routers[i]
			sel, err := caddySelector(policy)
			if err != nil {
				return nil, err
			}
			rt.name, rt.selector = "router-"+strconv.Itoa(i), sel
			for j := range run.replicas {
				rt.pool = append(rt.pool, &reverseproxy.Upstream{Dial: run.replicas[j].name, Host: new(reverseproxy.Host)})
			}
		}
		return run, nil
	}
	run.ropts = router.Options{
		Scorer:            s.Scorer,
		OutputEstimate:    s.OutputEstimate,
		OutputTokens:      s.OutputTokens,
		Adapters:          make(map[string]bool),
		MaxLoras:          cfg.MaxLoRAs,
		AdapterLoadHost:   cfg.LoRAHostLoad,
		AdapterLoadRemote: cfg.LoRAStorageLoad,
		QueueLimit:        s.QueueLimit,
	}.WithDefaults()
	run.ropts.Scorer.Strategy = strategy
	for _, a := range cfg.Adapters {
		run.ropts.Adapters[a] = true
	}
	prefill, decode := s.Rates(w)
	hw := router.Hardware{PrefillTokensPerSecond: prefill, DecodeTokensPerSecond: decode, KVCapacityTokens: cfg.NumGPUBlocks * cfg.BlockSize}
	switch {
	case s.KVCapacityTokens > 0:
		hw.KVCapacityTokens = s.KVCapacityTokens
	case s.KVCapacityTokens < 0:
		hw.KVCapacityTokens = 0
	}
	for i := range run.replicas {
		run.members = append(run.members, router.Member{Dial: run.replicas[i].name, Available: true, Healthy: true, Hardware: hw})
	}
	for i := range run.routers {
		run.startRouter(i, "router-"+strconv.Itoa(i))
	}
	return run, nil
}

// startRouter gives router i a new fleet under name, publishing to the others with sync.
func (run *simRun) startRouter(i int, name string) {
	rt := &run.routers[i]
	rt.name, rt.fleet = name, router.New()
	for _, m := range run.members {
		rt.fleet.Name(m.Dial, at(0))
	}
	if s := run.sim; s.Sync && len(run.routers) > 1 {
		rt.fleet.KeepLive(true) // for restating them to a router that starts
		rt.fleet.SetPublisher(func(ev router.Event) {
			run.outbox = append(run.outbox, delivery{at: run.now + max(0, s.SyncDelay), from: i, name: name, ev: ev})
		})
	}
}

// restart restarts router 0 at now (see Sim.RestartAt).
func (run *simRun) restart(now time.Duration) {
	// Its waiters' holds are the old fleet's: they wait at the new one's gateway.
	for i := range run.gateway {
		if wt := &run.gateway[i]; wt.router == &run.routers[0] {
			wt.unhold(now)
		}
	}
	old, oldName := run.routers[0].fleet, run.routers[0].name
	run.startRouter(0, "router-0#restarted")
	if !run.sim.Sync || len(run.routers) < 2 {
		return
	}
	fresh := run.routers[0].fleet
	if run.sim.RestartSnapshot {
		for _, ev := range run.routers[1].fleet.SnapshotEvents(fleetsyncMaxEventHashes) {
			fresh.Restore(ev, at(now))
		}
	}
	// Its peers, its predecessor among them, hear it and restate their
	// charges in flight.
	restate := func(f *router.Fleet, from int, name string) {
		for _, ev := range f.LiveEvents() {
			run.outbox = append(run.outbox, delivery{at: now + max(0, run.sim.SyncDelay), from: from, name: name, ev: ev})
		}
	}
	restate(old, 0, oldName)
	for j := 1; j < len(run.routers); j++ {
		restate(run.routers[j].fleet, j, run.routers[j].name)
	}
}

// fleetsyncMaxEventHashes is the hashes a snapshot's event carries (fleetsync's).
const fleetsyncMaxEventHashes = 8192

// deliver applies the next event in flight between routers to every router but its sender.
func (run *simRun) deliver() {
	d := run.outbox[0]
	run.outbox = run.outbox[1:]
	for i := range run.routers {
		// A restarted router hears its predecessor, which finishes
		// what it has in flight, as a peer.
		if run.routers[i].name != d.name {
			run.routers[i].fleet.Apply(d.name, d.ev, at(d.at))
		}
	}
	if d.ev.Kind == router.EventCompleted || d.ev.Kind == router.EventReleased {
		run.released = true
	}
}

// caddySelector returns Caddy's own selection policy of that name, provisioned as Caddy
// would.
func caddySelector(policy string) (reverseproxy.Selector, error) {
	switch policy {
	case "round_robin":
		return new(reverseproxy.RoundRobinSelection), nil
	case "least_conn":
		return reverseproxy.LeastConnSelection{}, nil
	case "random":
		return reverseproxy.RandomSelection{}, nil
	case "first":
		return reverseproxy.FirstSelection{}, nil
	case "header":
		ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
		defer cancel()
		sel := &reverseproxy.HeaderHashSelection{Field: SessionHeader}
		if err := sel.Provision(ctx); err != nil {
			return nil, fmt.Errorf("provisioning Caddy's header policy: %w", err)
		}
		return sel, nil
	}
	return nil, fmt.Errorf("unknown policy %q", policy)
}

// SessionHeader is the request header Caddy's header policy hashes; the benchmark's clients
// set it to [HeaderKey] of each request.
const SessionHeader = "X-Session-Id"

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
		tDeliver := never
		if len(run.outbox) > 0 {
			tDeliver = run.outbox[0].at
		}
		tPoll := never
		if len(run.gateway) > 0 {
			tPoll = run.nextPoll
		}
		tRestart := never
		if run.affinity && !run.restarted && run.sim.RestartAt > 0 {
			tRestart = run.sim.RestartAt
		}
		switch {
		case tArrive == never && tEngine == never && tDeliver == never && tPoll == never:
			// Nothing runs and nothing arrives: whoever still waits can never fit.
			for _, wt := range run.gateway {
				wt.unhold(run.now)
				run.shed(wt.req)
			}
			run.gateway = nil
			return nil
		case tRestart <= tArrive && tRestart <= tEngine && tRestart <= tDeliver && tRestart <= tPoll:
			run.now = tRestart
			run.restarted = true
			run.restart(tRestart)
		case tEngine <= tArrive && tEngine <= tDeliver && tEngine <= tPoll:
			run.now = tEngine
			run.events = run.replicas[ei].engine.AdvanceTo(tEngine, run.events[:0])
			for i := range run.events {
				run.handle(&run.events[i])
			}
			run.heap.fix(ei)
			if run.released {
				run.released = false
				run.retryGateway(tEngine, false)
			}
		case tDeliver <= tArrive && tDeliver <= tPoll:
			run.now = tDeliver
			run.deliver()
			if run.released {
				// A peer's release frees KV as this router sees it.
				run.released = false
				run.retryGateway(tDeliver, false)
			}
		case tPoll <= tArrive:
			// The plugin's held requests decide again every HoldPollInterval.
			run.now = tPoll
			run.nextPoll = tPoll + router.HoldPollInterval
			run.retryGateway(tPoll, true)
		default:
			run.now = tArrive
			r := &w.Requests[next]
			next++
			rt := &run.routers[run.nextRouter%len(run.routers)]
			run.nextRouter++
			run.arrive(waiter{router: rt, req: r, text: r.AppendPrompt(nil), deadline: tArrive + run.queueTimeout}, tArrive)
			if run.released { // an engine refused it: its release may ready a hold
				run.released = false
				run.retryGateway(tArrive, false)
			}
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
		}
		if f.charge != nil {
			f.fleet.Progress(f.charge, 1, at(ev.Time))
		}
	case kvsim.EventFinished:
		if f.charge != nil {
			f.fleet.Complete(f.charge, run.modelName(f.req), router.Usage{PromptTokens: f.req.PromptTokens, OutputTokens: ev.GeneratedTokens}, at(ev.Time))
		} else {
			countRequest(f.router.pool[f.replica].Host, -1)
		}
		run.released = true
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

// routerRequest is what the decision engine sees of a waiting request at now: it may wait
// for KV at an engine as long as it may still wait at the gateway, as the plugin's requests.
func (run *simRun) routerRequest(wt *waiter, now time.Duration) router.Request {
	r := wt.req
	return router.Request{
		Hashes: wt.hashes, BlockTokens: RouterBlockTokens, PromptTokens: r.PromptTokens,
		MaxTokens: r.MaxTokens, Model: run.modelName(r), MaxWait: max(0, wt.deadline-now),
	}
}

// retryGateway routes again, in arrival order, the waiting requests whose holds are ready
// (a release readies the first that may now fit on the replica that released, and each one
// routed from there the next), until none is, or with all every waiting request (the
// plugin's poll); and sheds those whose deadline passed.
func (run *simRun) retryGateway(now time.Duration, all bool) {
	for retried := true; retried && len(run.gateway) > 0; all = false {
		retried = false
		waiting := run.gateway
		run.gateway = nil
		for _, wt := range waiting {
			switch {
			case now > wt.deadline:
				wt.unhold(now)
				run.shed(wt.req)
			case all || wt.ready():
				// A hold readied again calls for another pass; a request of
				// Caddy's policies (no hold) is tried once a release.
				retried = retried || wt.hold != nil
				run.arrive(wt, now)
			default:
				run.gateway = append(run.gateway, wt)
			}
		}
	}
}

// shedExpired sheds the waiting requests whose deadline passed before now, as the plugin
// does at their deadlines, and reports whether there were any.
func (run *simRun) shedExpired(now time.Duration) bool {
	n := len(run.gateway)
	run.gateway = slices.DeleteFunc(run.gateway, func(wt waiter) bool {
		if now > wt.deadline {
			wt.unhold(now)
			run.shed(wt.req)
			return true
		}
		return false
	})
	return len(run.gateway) < n
}

// arrive routes a request at time now and submits it to the chosen engine. When no replica
// fits, the request waits at the gateway (unless the queue timeout is negative, when it is
// shed at once).
func (run *simRun) arrive(wt waiter, now time.Duration) {
	r, text, rt := wt.req, wt.text, wt.router
	res := &run.results.Requests[r.Index]
	var choice int
	var charge *router.Charge
	if run.affinity {
		if wt.hashes == nil {
			wt.hashes = run.hasher.HashBytes(nil, run.seed(r), text)
		}
		rreq := run.routerRequest(&wt, now)
		d := rt.fleet.Decide(at(now), rreq, run.members, &run.ropts, run.rng, nil)
		choice, charge = d.Chosen, d.Charge
		switch {
		case d.Unservable || d.TooLong:
			// The plugin answers these at once (404, 400): waiting cannot help.
			wt.unhold(now)
			run.shed(r)
			return
		case choice >= 0:
			wt.unhold(now)
		case now < wt.deadline:
			// Held as the plugin holds it; shed at once when the queue is full
			// (of requests still waiting: the plugin's leave at their deadline).
			hold := rt.fleet.Hold(wt.hold, &d, rreq, at(wt.deadline), run.members, &run.ropts)
			if hold == nil && run.shedExpired(now) {
				hold = rt.fleet.Hold(nil, &d, rreq, at(wt.deadline), run.members, &run.ropts)
			}
			if wt.hold = hold; hold == nil {
				run.shed(r)
				return
			}
			if run.nextPoll <= now {
				run.nextPoll = now + router.HoldPollInterval
			}
			run.gateway = append(run.gateway, wt)
			return
		default:
			wt.unhold(now)
			run.shed(r)
			return
		}
	} else {
		choice = run.chooseCaddy(rt, r)
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
	f := &inflight{req: r, res: res, replica: choice, router: rt, charge: charge, fleet: rt.fleet}
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
		if charge != nil {
			// As the plugin does: a 404 says the engine does not serve
			// the model or adapter.
			if e, ok := err.(*kvsim.APIError); ok && e.Code == http.StatusNotFound {
				rt.fleet.Refused(charge, at(now))
			} else {
				rt.fleet.Release(charge, at(now))
			}
			run.released = true
		}
		run.progress()
		return
	}
	if charge == nil {
		countRequest(rt.pool[choice].Host, 1)
	}
	run.heap.fix(choice)
	run.inflight[&f.kreq] = f
}

func (run *simRun) seed(r *Request) uint64 {
	s, ok := run.seeds[r.Model]
	if !ok {
		s = prefixindex.Seed(run.modelName(r), r.Model, "")
		run.seeds[r.Model] = s
	}
	return s
}

// chooseCaddy asks Caddy's selection policy, as reverse_proxy would, with the request's
// routing key in the header the header policy hashes. It returns the replica, -1 for none.
func (run *simRun) chooseCaddy(rt *simRouter, r *Request) int {
	if key := HeaderKey(r); key != "" {
		run.httpReq.Header.Set(SessionHeader, key)
	} else {
		run.httpReq.Header.Del(SessionHeader)
	}
	up := rt.selector.Select(rt.pool, run.httpReq, nil)
	if up == nil {
		return -1
	}
	return slices.Index(rt.pool, up)
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
