package caddyllm

import (
	"math/rand/v2"
	"slices"
	"sync"
	"time"

	"github.com/llmaffinity/caddy-llm-affinity/prefixindex"
	"github.com/llmaffinity/caddy-llm-affinity/scorer"
	"github.com/llmaffinity/caddy-llm-affinity/scrape"
)

// fleet is the routing state that must outlive any one config: the prefix
// index and each upstream's queued work, keyed by dial address. Caddy
// builds new module instances on every reload, so this lives at package
// level; an upstream's entry survives as long as it is in some config or
// has work in flight, and expires after idleExpiry without either.
type fleet struct {
	index *prefixindex.Index

	// mu serialises decisions with the charges they make, so two
	// concurrent requests never both see an idle upstream. It also guards
	// upstreams and outputs.
	mu        sync.Mutex
	upstreams map[string]*upstreamState
	outputs   map[string]*runningMean // observed output tokens by model
	// meanPrompt is the running mean of routed prompt lengths, for sizing
	// requests the router sees only as counts in engine metrics.
	meanPrompt runningMean

	// changed is closed and replaced when work is released while some
	// request waits at the gateway for capacity (waiting says so).
	changed chan struct{}
	waiting bool

	// Scratch space of decisions, which all run under mu: the candidates,
	// their states and the matched depths, reused instead of allocated
	// for every request.
	scratchCands  []scorer.Candidate
	scratchStates []*upstreamState
	scratchDepths []int
	// scratchEngines is written by Policy.scrapedSignals.
	scratchEngines []scraped
}

// upstreamState is one upstream's router-side accounting. Guarded by
// fleet.mu.
type upstreamState struct {
	dial string
	id   prefixindex.UpstreamID
	// queuedPrefill is uncached prompt tokens routed here whose first
	// token has not come back yet.
	queuedPrefill int
	// queuedDecode is expected output tokens routed here and not yet
	// streamed back.
	queuedDecode int
	// kvTokens is the new KV the in-flight requests occupy (uncached
	// prompt plus expected output), for the KV-fit filter.
	kvTokens int
	inFlight int
	lastUsed time.Time
	// charged counts every request routed here and the KV tokens charged
	// for them; it only grows, so engine scrapes can tell which charges
	// came after their snapshot.
	charged scrape.Mark

	// Observed figures, for the admin API and metrics.
	completed        int64
	lastTTFT         time.Duration
	lastEstimate     float64 // estimated TTFT of the last request routed here
	capacityTokens   int     // KV capacity in tokens as last applied to the index
	indexBlockTokens int     // block size that capacity was applied with
	healthSeen       bool    // healthy holds Caddy's verdict at the last decision
	healthy          bool

	// adapters are the LoRA adapters routed here, most recent first: the
	// first max_loras are presumed on the GPU, the rest in host memory.
	adapters []string
}

// maxRememberedAdapters is how many adapters an upstream is presumed to
// keep in host memory (vLLM's --max-cpu-loras default is larger; this
// bounds the list).
const maxRememberedAdapters = 16

// useAdapter records that adapter was routed to u. Caller holds fleet.mu.
func (u *upstreamState) useAdapter(adapter string) {
	u.adapters = slices.DeleteFunc(u.adapters, func(a string) bool { return a == adapter })
	u.adapters = slices.Insert(u.adapters, 0, adapter)
	if len(u.adapters) > maxRememberedAdapters {
		u.adapters = u.adapters[:maxRememberedAdapters]
	}
}

// idleExpiry is how long an upstream with no work in flight that no
// config references keeps its state (dynamic upstreams come and go).
var idleExpiry = time.Hour

var state = newFleet()

func newFleet() *fleet {
	return &fleet{
		index:     prefixindex.New(0),
		upstreams: make(map[string]*upstreamState),
		outputs:   make(map[string]*runningMean),
		changed:   make(chan struct{}),
	}
}

// upstream returns the state of dial, creating it. Caller holds f.mu.
func (f *fleet) upstream(dial string, now time.Time) *upstreamState {
	u, ok := f.upstreams[dial]
	if !ok {
		u = &upstreamState{dial: dial, id: f.index.Register(dial)}
		f.upstreams[dial] = u
	}
	u.lastUsed = now
	return u
}

// wake tells waiting requests that capacity may have freed. Caller holds
// f.mu.
func (f *fleet) wake() {
	if f.waiting {
		close(f.changed)
		f.changed = make(chan struct{})
		f.waiting = false
	}
}

// waitChannel returns the channel closed at the next release. Caller
// holds f.mu.
func (f *fleet) waitChannel() <-chan struct{} {
	f.waiting = true
	return f.changed
}

// expire forgets upstreams idle since before cutoff with nothing in
// flight. Returns how many were dropped.
func (f *fleet) expire(cutoff time.Time) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	n := 0
	for dial, u := range f.upstreams {
		if u.inFlight == 0 && u.lastUsed.Before(cutoff) {
			f.index.Remove(u.id)
			delete(f.upstreams, dial)
			n++
		}
	}
	return n
}

var janitorOnce sync.Once

// startJanitor runs expiry in the background for the life of the process.
func startJanitor() {
	janitorOnce.Do(func() {
		go func() {
			t := time.NewTicker(time.Minute)
			defer t.Stop()
			for now := range t.C {
				state.expire(now.Add(-idleExpiry))
			}
		}()
	})
}

// runningMean is an exponentially weighted mean of observed output
// lengths, so the estimate follows a changing workload.
type runningMean struct {
	value float64
	n     int
}

func (m *runningMean) add(x float64) {
	m.n++
	alpha := max(0.05, 1/float64(m.n)) // plain mean at first, then EWMA
	m.value += alpha * (x - m.value)
}

// attempt is one routing of a request to an upstream: the charge made
// there, released when the response finishes or a retry picks again.
type attempt struct {
	up        *upstreamState
	dial      string
	estimate  float64 // estimated TTFT in seconds
	endFlight func()  // deregisters from the drain registry
	prefill   int     // uncached prompt tokens charged
	decode    int     // expected output tokens still charged
	kv        int
	started   time.Time
	firstByte time.Time
	tokens    int // output tokens seen streaming back
}

// charge records a new attempt on u. Caller holds f.mu.
func (f *fleet) charge(u *upstreamState, prefill, decode, kv int, now time.Time) *attempt {
	u.queuedPrefill += prefill
	u.queuedDecode += decode
	u.kvTokens += kv
	u.inFlight++
	u.lastUsed = now
	f.meanPrompt.add(float64(prefill))
	u.charged.Requests++
	u.charged.KVTokens += uint64(max(0, kv))
	return &attempt{up: u, dial: u.dial, prefill: prefill, decode: decode, kv: kv, started: now}
}

// release returns what is left of a's charge. Safe to call twice.
func (f *fleet) release(a *attempt) {
	if a == nil {
		return
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.releaseLocked(a)
}

// complete releases a's charges after a completed response of model with
// outputTokens generated, which it learns, under one acquisition of f.mu.
func (f *fleet) complete(a *attempt, model string, outputTokens int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.learnOutput(model, outputTokens)
	if a.up != nil {
		a.up.completed++
	}
	f.releaseLocked(a)
}

// releaseLocked is release; caller holds f.mu.
func (f *fleet) releaseLocked(a *attempt) {
	if a.up == nil {
		return
	}
	u := a.up
	if a.endFlight != nil {
		a.endFlight()
	}
	u.queuedPrefill -= a.prefill
	u.queuedDecode -= a.decode
	u.kvTokens -= a.kv
	u.inFlight--
	u.lastUsed = time.Now()
	a.up, a.prefill, a.decode, a.kv = nil, 0, 0, 0
	f.wake()
}

// progress records n more output tokens from a's upstream: the first one
// ends the prefill charge, each one decays the decode charge.
func (f *fleet) progress(a *attempt, n int, now time.Time) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if a.up == nil || n <= 0 {
		return
	}
	u := a.up
	if a.firstByte.IsZero() {
		a.firstByte = now
		u.lastTTFT = now.Sub(a.started)
		u.queuedPrefill -= a.prefill
		a.prefill = 0
	}
	a.tokens += n
	d := min(n, a.decode)
	u.queuedDecode -= d
	a.decode -= d
}

// learnOutput feeds an observed output length into the model's estimate.
// Caller holds f.mu.
func (f *fleet) learnOutput(model string, tokens int) {
	m := f.outputs[model]
	if m == nil {
		m = &runningMean{}
		f.outputs[model] = m
	}
	m.add(float64(tokens))
}

// meanOutput returns the learned mean output length of model. Caller holds
// f.mu.
func (f *fleet) meanOutput(model string) (float64, bool) {
	m := f.outputs[model]
	if m == nil || m.n == 0 {
		return 0, false
	}
	return m.value, true
}

// lockedRand is a random source safe for concurrent Selects.
type lockedRand struct {
	mu sync.Mutex
	r  *rand.Rand
}

func newLockedRand() *lockedRand {
	return &lockedRand{r: rand.New(rand.NewPCG(rand.Uint64(), rand.Uint64()))}
}

// IntN returns a random int in [0, n).
func (l *lockedRand) IntN(n int) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.r.IntN(n)
}

// markOf returns the cumulative charges routed to dial, for the scraper's
// snapshots.
func (f *fleet) markOf(dial string) scrape.Mark {
	f.mu.Lock()
	defer f.mu.Unlock()
	if u := f.upstreams[dial]; u != nil {
		m := u.charged
		m.InFlight = u.inFlight
		return m
	}
	return scrape.Mark{}
}
