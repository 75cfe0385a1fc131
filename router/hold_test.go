package router

import (
	"fmt"
	"slices"
	"testing"

	"github.com/llmaffinity/caddy-llm-affinity/scrape"
)

func isReady(h *Hold) bool {
	select {
	case <-h.Ready():
		return true
	default:
		return false
	}
}

// TestHoldReadiesOnlyWhatFits: a release readies the held requests that
// would now pass the filters on the upstream that released, and no
// other: not those for a model it does not serve, nor those too large for
// what it freed.
func TestHoldReadiesOnlyWhatFits(t *testing.T) {
	f := New()
	opts := Options{OutputEstimate: OutputFixed, OutputTokens: 100}.WithDefaults()
	ms := members("a", "b")
	for i, model := range []string{"m1", "m2"} {
		ms[i].Hardware.KVCapacityTokens = 3000
		ms[i].Engine = &scrape.Signals{Running: -1, Waiting: -1, Models: []scrape.ModelInfo{{ID: model}}}
	}
	fill := func(seed uint64, model string) *Charge {
		t.Helper()
		d := f.Decide(t0, Request{Hashes: hashes(seed, 2000), BlockTokens: 64, PromptTokens: 2000, Model: model}, ms, &opts, rng(), nil)
		if d.Charge == nil {
			t.Fatalf("filling request for %s not placed: %+v", model, d)
		}
		return d.Charge
	}
	onA, onB := fill(1, "m1"), fill(2, "m2")

	hold := func(seed uint64, model string, tokens int) *Hold {
		t.Helper()
		req := Request{Hashes: hashes(seed, tokens), BlockTokens: 64, PromptTokens: tokens, Model: model}
		d := f.Decide(t0, req, ms, &opts, rng(), nil)
		if d.Charge != nil {
			t.Fatalf("request for %s of %d tokens placed, want held", model, tokens)
		}
		h := f.Hold(nil, &d, req, t0, ms, &opts)
		if h == nil || isReady(h) {
			t.Fatalf("hold for %s: %v, ready at once", model, h)
		}
		return h
	}
	m1, m2, huge := hold(3, "m1", 2000), hold(4, "m2", 2000), hold(5, "m1", 2950)
	if f.Held() != 3 {
		t.Fatalf("Held %d, want 3", f.Held())
	}

	served(f, onA, t0)
	if !isReady(m1) {
		t.Error("m1's held request not readied by a's release")
	}
	if isReady(m2) {
		t.Error("m2's held request readied by a, which does not serve m2")
	}
	if isReady(huge) {
		t.Error("a request larger than a's free KV plus its output readied")
	}
	served(f, onB, t0)
	if !isReady(m2) {
		t.Error("m2's held request not readied by b's release")
	}
	for _, h := range []*Hold{m1, m2, huge} {
		f.Unhold(h, t0)
		f.Unhold(h, t0) // twice is harmless
	}
	if f.Held() != 0 {
		t.Fatalf("Held %d after Unhold, want 0", f.Held())
	}
}

// TestHoldQueueOrder: a release readies the first held request that fits,
// in arrival order; each one that then routes readies the next that fits,
// and the chain stops at one that does not. Behind an upstream that was
// unavailable (full, to Caddy), a release readies one request, not all.
func TestHoldQueueOrder(t *testing.T) {
	q, ms := newQueue(t, OutputFixed), fleetOf(3000, "a")
	f, opts := q.f, q.opts
	filler := q.place(1, 2000, ms)
	var reqs []Request
	var holds []*Hold
	for i := range 3 {
		req, h := q.hold(uint64(10+i), 1000, ms)
		reqs, holds = append(reqs, req), append(holds, h)
	}
	readied := func() (out []int) {
		for i, h := range holds {
			if isReady(h) {
				out = append(out, i)
			}
		}
		return out
	}
	served(f, filler, t0)
	if got := readied(); !slices.Equal(got, []int{0}) {
		t.Fatalf("after the release, readied %v, want [0]", got)
	}
	route := func(i int) {
		t.Helper()
		if f.Decide(t0, reqs[i], ms, &opts, rng(), nil).Charge == nil {
			t.Fatalf("readied request %d not placed", i)
		}
		f.Unhold(holds[i], t0)
	}
	route(0) // 1,100 tokens each: two fit in 3,000
	if got := readied(); !slices.Equal(got, []int{0, 1}) {
		t.Fatalf("after request 0 routed, readied %v, want [0 1]", got)
	}
	route(1)
	if got := readied(); !slices.Equal(got, []int{0, 1}) {
		t.Fatalf("request 2, which no longer fits, readied: %v", got)
	}
	f.Unhold(holds[2], t0)

	// Unavailable to Caddy (full): one release, one readied.
	g := New()
	full := members("b")
	full[0].Available = false
	var blocked []*Hold
	for i := range 5 {
		req := Request{Hashes: hashes(uint64(20+i), 100), BlockTokens: 64, PromptTokens: 100}
		d := g.Decide(t0, req, full, &opts, rng(), nil)
		blocked = append(blocked, g.Hold(nil, &d, req, t0, full, &opts))
	}
	running := g.Decide(t0, Request{PromptTokens: 10}, members("b"), &opts, rng(), nil)
	for _, h := range blocked { // the decision above released nothing
		if isReady(h) {
			t.Fatal("a hold readied without a release")
		}
	}
	g.Release(running.Charge, t0)
	n := 0
	for _, h := range blocked {
		if isReady(h) {
			n++
		}
	}
	if n != 1 || !isReady(blocked[0]) {
		t.Fatalf("one release behind a full upstream readied %d holds (the first: %v), want the first alone", n, isReady(blocked[0]))
	}
}

// TestHoldMissesNoRelease: a release between the decision and its Hold
// readies the hold at once, and the renewed hold of a request keeps its
// one place in the queue.
func TestHoldMissesNoRelease(t *testing.T) {
	f := New()
	opts := Options{OutputEstimate: OutputFixed, OutputTokens: 100}.WithDefaults()
	ms := members("a")
	ms[0].Hardware.KVCapacityTokens = 3000
	first := f.Decide(t0, Request{Hashes: hashes(1, 2000), BlockTokens: 64, PromptTokens: 2000}, ms, &opts, rng(), nil)
	req := Request{Hashes: hashes(2, 2000), BlockTokens: 64, PromptTokens: 2000}
	d := f.Decide(t0, req, ms, &opts, rng(), nil)
	if first.Charge == nil || d.Charge != nil {
		t.Fatal("want the first placed and the second not")
	}
	served(f, first.Charge, t0)
	h := f.Hold(nil, &d, req, t0, ms, &opts)
	if !isReady(h) {
		t.Fatal("a release before the Hold did not ready it")
	}
	// It retries; another request took the KV meanwhile.
	if f.Decide(t0, Request{Hashes: hashes(3, 2000), BlockTokens: 64, PromptTokens: 2000}, ms, &opts, rng(), nil).Charge == nil {
		t.Fatal("the other request not placed")
	}
	d = f.Decide(t0, req, ms, &opts, rng(), nil)
	if again := f.Hold(h, &d, req, t0, ms, &opts); again != h || isReady(h) || f.Held() != 1 {
		t.Fatalf("renewed hold: same %v, ready %v, held %d", again == h, isReady(h), f.Held())
	}
	f.Unhold(h, t0)
}

// TestHoldLimit: QueueLimit holds per Options, then Hold refuses; a
// negative limit has none.
func TestHoldLimit(t *testing.T) {
	f := New()
	ms := members("a")
	req := Request{Hashes: hashes(1, 100), BlockTokens: 64, PromptTokens: 100}
	var d Decision
	limited := Options{QueueLimit: 2}.WithDefaults()
	other := Options{}.WithDefaults()
	a := f.Hold(nil, &d, req, t0, ms, &limited)
	b := f.Hold(nil, &d, req, t0, ms, &limited)
	if a == nil || b == nil {
		t.Fatal("holds within the limit refused")
	}
	if f.Hold(nil, &d, req, t0, ms, &limited) != nil {
		t.Fatal("a third hold over a limit of 2 accepted")
	}
	if f.Hold(nil, &d, req, t0, ms, &other) == nil {
		t.Fatal("another site's options share the limit")
	}
	f.Unhold(a, t0)
	if f.Hold(nil, &d, req, t0, ms, &limited) == nil {
		t.Fatal("a hold after an Unhold refused")
	}
	unlimited := Options{QueueLimit: -1}.WithDefaults()
	for i := range DefaultQueueLimit + 1 {
		if f.Hold(nil, &d, req, t0, ms, &unlimited) == nil {
			t.Fatalf("hold %d refused with no limit", i)
		}
	}
	zero := Options{}.WithDefaults()
	for i := range DefaultQueueLimit {
		if f.Hold(nil, &d, req, t0, ms, &zero) == nil {
			t.Fatalf("hold %d refused under the default limit", i)
		}
	}
	if f.Hold(nil, &d, req, t0, ms, &zero) != nil {
		t.Fatal("the default limit does not hold")
	}
}

// BenchmarkReleaseWithHolds is one decision and its release across 64
// upstreams while 1,024 requests that fit nowhere wait: the release looks
// at each held request on the releasing upstream alone (compare
// BenchmarkDecide, one whole decision, which a wake of every waiter
// would cost each of them).
func BenchmarkReleaseWithHolds(b *testing.B) {
	f := New()
	opts := Options{OutputEstimate: OutputFixed, OutputTokens: 10}.WithDefaults()
	var ms []Member
	for i := range 64 {
		ms = append(ms, Member{Dial: "u" + string(rune('A'+i)), Available: true, Hardware: Hardware{KVCapacityTokens: 4096}})
	}
	for i := range ms {
		if f.Decide(t0, Request{Hashes: hashes(uint64(i), 4000), BlockTokens: 64, PromptTokens: 4000}, ms, &opts, rng(), nil).Charge == nil {
			b.Fatal("a filling request was not placed")
		}
	}
	for i := range DefaultQueueLimit {
		req := Request{Hashes: hashes(uint64(1000+i), 2048), BlockTokens: 64, PromptTokens: 2048}
		d := f.Decide(t0, req, ms, &opts, rng(), nil)
		if d.Charge != nil || f.Hold(nil, &d, req, t0, ms, &opts) == nil {
			b.Fatal("a held request was placed or refused")
		}
	}
	small := Request{Hashes: hashes(7, 10), BlockTokens: 64, PromptTokens: 10}
	r := rng()
	b.ReportAllocs()
	for b.Loop() {
		d := f.Decide(t0, small, ms, &opts, r, nil)
		if d.Charge == nil {
			b.Fatal("the small request was not placed")
		}
		served(f, d.Charge, t0)
	}
}

// TestHoldCheckChangesNothing: looking at a held request after a release
// uses the engine signals of its decision, which may be stale: it must not
// take the KV capacity they report, nor size the index by it.
func TestHoldCheckChangesNothing(t *testing.T) {
	f := New()
	opts := Options{OutputEstimate: OutputFixed, OutputTokens: 100}.WithDefaults()
	engine := func(blocks int) []Member {
		ms := members("a")
		ms[0].Engine = &scrape.Signals{Running: -1, Waiting: -1, BlockSize: 16, NumGPUBlocks: blocks}
		return ms
	}
	stale := engine(250) // 4,000 tokens
	first := f.Decide(t0, Request{Hashes: hashes(1, 2000), BlockTokens: 64, PromptTokens: 2000}, stale, &opts, rng(), nil)
	req := Request{Hashes: hashes(2, 3000), BlockTokens: 64, PromptTokens: 3000}
	d := f.Decide(t0, req, stale, &opts, rng(), nil)
	if first.Charge == nil || d.Charge != nil {
		t.Fatal("want the first placed and the second held")
	}
	h := f.Hold(nil, &d, req, t0, stale, &opts)
	fresh := engine(1000) // the engine now reports 16,000 tokens
	f.Decide(t0, Request{PromptTokens: 10}, fresh, &opts, rng(), nil)
	before := state(t, f, "a")
	served(f, first.Charge, t0)
	after := state(t, f, "a")
	if after.KVCapacityTokens != before.KVCapacityTokens || after.IndexCapacityBlocks != before.IndexCapacityBlocks {
		t.Fatalf("a held request's stale signals changed the upstream: capacity %d → %d tokens, index %d → %d blocks",
			before.KVCapacityTokens, after.KVCapacityTokens, before.IndexCapacityBlocks, after.IndexCapacityBlocks)
	}
	f.Unhold(h, t0)
}

// queue is a fleet with one set of options for the hold tests: place
// decides a request that must be placed, hold one that must be held (and
// holds it), retry decides a held request again and renews its hold when
// it is not placed.
type queue struct {
	t     *testing.T
	f     *Fleet
	opts  Options
	model string
}

func newQueue(t *testing.T, estimate string) *queue {
	return &queue{t: t, f: New(), opts: Options{OutputEstimate: estimate, OutputTokens: 100}.WithDefaults()}
}

// fleetOf returns members named dials with capacity tokens of KV each.
func fleetOf(capacity int, dials ...string) []Member {
	ms := members(dials...)
	for i := range ms {
		ms[i].Hardware.KVCapacityTokens = capacity
	}
	return ms
}

func (q *queue) request(seed uint64, prompt int) Request {
	return Request{Hashes: hashes(seed, prompt), BlockTokens: 64, PromptTokens: prompt, Model: q.model}
}

func (q *queue) place(seed uint64, prompt int, ms []Member) *Charge {
	q.t.Helper()
	d := q.f.Decide(t0, q.request(seed, prompt), ms, &q.opts, rng(), nil)
	if d.Charge == nil {
		q.t.Fatalf("request %d (%d tokens) not placed", seed, prompt)
	}
	return d.Charge
}

func (q *queue) hold(seed uint64, prompt int, ms []Member) (Request, *Hold) {
	q.t.Helper()
	req := q.request(seed, prompt)
	d := q.f.Decide(t0, req, ms, &q.opts, rng(), nil)
	if d.Charge != nil {
		q.t.Fatalf("request %d placed, want held", seed)
	}
	return req, q.f.Hold(nil, &d, req, t0, ms, &q.opts)
}

// wantReadied checks that req, held as h, would now be placed on m and
// that its hold is ready; why says what should have readied it.
func (q *queue) wantReadied(req Request, h *Hold, m Member, why string) {
	q.t.Helper()
	if !q.f.Fits(t0, req, m, &q.opts) {
		q.t.Fatalf("it would not be placed on %s", m.Dial)
	}
	if !isReady(h) {
		q.t.Errorf("its hold waits: %s", why)
	}
}

// retry decides req again; it reports whether it was placed, and renews h
// when it was not.
func (q *queue) retry(req Request, h *Hold, ms []Member) bool {
	d := q.f.Decide(t0, req, ms, &q.opts, rng(), nil)
	if d.Charge == nil {
		q.f.Hold(h, &d, req, t0, ms, &q.opts)
	}
	return d.Charge != nil
}

// TestHoldSkippedReleasesPassOn: releases on u while the hold u readied
// has not decided yet ready nothing; if that hold then fails and waits
// again, what they freed goes to the next held request that fits.
func TestHoldSkippedReleasesPassOn(t *testing.T) {
	q, ms := newQueue(t, OutputFixed), fleetOf(5000, "a")
	x1, x2, _ := q.place(1, 1400, ms), q.place(2, 500, ms), q.place(3, 2700, ms) // 1500+600+2800 = 4900 of 5000
	reqA, a := q.hold(10, 1400, ms)                                              // needs 1500
	reqB, b := q.hold(11, 400, ms)                                               // needs 500
	served(q.f, x1, t0)                                                          // free 1600: A is readied (by a)
	if !isReady(a) || isReady(b) {
		t.Fatalf("after x1: A ready %v B ready %v", isReady(a), isReady(b))
	}
	q.place(20, 1000, ms) // a new arrival (not held) takes 1100: free 500
	served(q.f, x2, t0)   // free 1100: readyNext returns early, A undecided
	if q.retry(reqA, a, ms) {
		t.Fatal("A (1,500) placed in 1,100")
	}
	q.wantReadied(reqB, b, ms[0], fmt.Sprintf("B fits on a (1100 free, needs 500), a has released, yet no hold is readied (A ready %v)", isReady(a)))
}

// TestHoldLearnedEstimateStrandsNone: completions on one upstream, the
// second raising the learned output estimate so that the hold the first
// readied fails; the smaller one behind it is readied at once, not at
// the upstream's next release (which, had the upstream gone idle, would
// never come).
func TestHoldLearnedEstimateStrandsNone(t *testing.T) {
	q, ms := newQueue(t, OutputAverage), fleetOf(5000, "a")
	q.model = "m"
	x1, x2 := q.place(1, 4550, ms), q.place(2, 100, ms) // 4650+200
	q.place(3, 50, ms)                                  // 150: 5000 in all, in flight throughout
	q.f.Progress(x1, 1, t0)
	q.f.Progress(x2, 1, t0)
	reqA, a := q.hold(10, 4500, ms)
	reqB, b := q.hold(11, 300, ms)
	q.f.Complete(x1, "m", Usage{OutputTokens: 1}, t0)    // mean 1: A (4501 <= 4650) readied
	q.f.Complete(x2, "m", Usage{OutputTokens: 2000}, t0) // mean ~1000; readyNext returns early
	if !isReady(a) {
		t.Fatal("A not readied")
	}
	if q.retry(reqA, a, ms) { // needs 5000 (its context, at most all the KV), 4850 free
		t.Fatal("A placed")
	}
	q.wantReadied(reqB, b, ms[0], "B fits on a, A failed, yet B's hold waits for a's next release")
}

// TestFailedTurnPassesOn: the readied hold fits nowhere after all, because
// a new request took part of what the release freed, and no release came
// meanwhile: what is left goes to the next held request that fits there.
// (Before, it waited for its own poll.)
func TestFailedTurnPassesOn(t *testing.T) {
	q, ms := newQueue(t, OutputFixed), fleetOf(5000, "a")
	x1, _, _ := q.place(1, 1400, ms), q.place(2, 500, ms), q.place(3, 2700, ms) // 4900 of 5000
	reqA, a := q.hold(10, 1400, ms)                                             // needs 1500
	reqB, b := q.hold(11, 400, ms)                                              // needs 500
	served(q.f, x1, t0)                                                         // free 1600: A readied
	if !isReady(a) || isReady(b) {
		t.Fatalf("A %v B %v", isReady(a), isReady(b))
	}
	q.place(20, 900, ms) // a new arrival takes 1000: free 600
	if q.retry(reqA, a, ms) {
		t.Fatal("A placed")
	}
	q.wantReadied(reqB, b, ms[0], "B fits in the 600 left, A gave up a's turn, yet B's hold waits")
	if isReady(a) {
		t.Errorf("A, which fitted nowhere, was readied again")
	}
}

// TestFullUpstreamTurnsDoNotLoop: holds behind an upstream Caddy counts as
// full (max_requests) do not hand the turn to each other when each fits
// nowhere and nothing was released: they wait for a release or the poll.
// (The failed turn's hand-on assumed a release, and looped.)
func TestFullUpstreamTurnsDoNotLoop(t *testing.T) {
	q, free := newQueue(t, OutputFixed), fleetOf(50000, "a")
	full := fleetOf(50000, "a")
	full[0].Available = false // Caddy: max_requests reached
	x := q.place(1, 1000, free)
	req1, h1 := q.hold(10, 500, full)
	req2, h2 := q.hold(11, 500, full)
	req3, h3 := q.hold(12, 500, full)
	served(q.f, x, t0)
	if !isReady(h1) || !q.retry(req1, h1, free) {
		t.Fatal("h1 not readied and placed by the release")
	}
	q.f.Unhold(h1, t0) // a is full again
	for range 5 {
		if !isReady(h2) {
			return
		}
		if q.retry(req2, h2, full) {
			t.Fatal("h2 placed")
		}
		if !isReady(h3) {
			return
		}
		if q.retry(req3, h3, full) {
			t.Fatal("h3 placed")
		}
	}
	t.Error("h2 and h3 readied each other 5 times without a release")
}

// TestFailedTurnAfterAReleaseStillPassesOn: holds recorded an upstream
// Caddy counted full; a release there readies A, which fits nowhere after
// all for another reason (a completion elsewhere raised the output
// estimate). The slot the release freed goes to B, which fits: a release
// since B's hold counts, not only one while A was deciding.
func TestFailedTurnAfterAReleaseStillPassesOn(t *testing.T) {
	q := newQueue(t, OutputAverage)
	q.model = "m"
	a, b := fleetOf(5000, "a"), fleetOf(5000, "b")
	fullA := fleetOf(5000, "a")
	fullA[0].Available = false // Caddy: max_requests reached on a
	x1 := q.place(1, 4550, a)
	q.place(3, 50, a)
	x2 := q.place(2, 100, b)
	q.f.Progress(x1, 1, t0)
	q.f.Progress(x2, 1, t0)
	reqA, hA := q.hold(10, 4500, fullA)
	reqB, hB := q.hold(11, 300, fullA)
	q.f.Complete(x1, "m", Usage{OutputTokens: 1}, t0) // release on a: A readied
	if !isReady(hA) || isReady(hB) {
		t.Fatalf("A %v B %v", isReady(hA), isReady(hB))
	}
	q.f.Complete(x2, "m", Usage{OutputTokens: 2000}, t0) // on b: estimate ~1000
	if q.retry(reqA, hA, a) {                            // a available now; A no longer fits
		t.Fatal("A placed")
	}
	q.wantReadied(reqB, hB, a[0], "B fits on a (a has the slot x1 freed), A gave up a's turn, yet B's hold waits for its poll")
}

// TestFullUpstreamReleaseWakesOneMore: a release on an upstream Caddy
// counts full (max_requests) readies the first hold, which takes the
// slot; its turn then wakes at most one more decision, not every hold in
// turn (each saw the upstream full before the release).
func TestFullUpstreamReleaseWakesOneMore(t *testing.T) {
	q, free := newQueue(t, OutputFixed), fleetOf(50000, "a")
	full := fleetOf(50000, "a")
	full[0].Available = false
	x := q.place(1, 1000, free)
	var reqs []Request
	var hs []*Hold
	for i := range 6 {
		r, h := q.hold(uint64(10+i), 500, full)
		reqs, hs = append(reqs, r), append(hs, h)
	}
	served(q.f, x, t0)
	if !isReady(hs[0]) || !q.retry(reqs[0], hs[0], free) {
		t.Fatal("h1 not readied and placed")
	}
	q.f.Unhold(hs[0], t0) // a is full again (Caddy)
	wasted := 0
	for progress := true; progress; {
		progress = false
		for i := 1; i < len(hs); i++ {
			if isReady(hs[i]) {
				if q.retry(reqs[i], hs[i], full) {
					t.Fatal("placed on a full upstream")
				}
				wasted++
				progress = true
			}
			if wasted > 100 {
				t.Fatal("loop")
			}
		}
	}
	if wasted > 1 {
		t.Errorf("one release whose slot h1 took readied %d more holds in a row, each a failed decision (want at most 1)", wasted)
	}
}

// TestReleaseBeforeTheDecisionReadiesTheHold: a held request's poll took
// Caddy's view (its upstream full) just before a release there, and
// decided after it: the view may predate the release, so its hold is
// readied at once, to decide again with a fresh view, rather than count
// the release as seen and wait for its next poll. A release on an
// upstream that is not its own readies nothing.
func TestReleaseBeforeTheDecisionReadiesTheHold(t *testing.T) {
	q := newQueue(t, OutputFixed)
	a, b, fullA := fleetOf(5000, "a"), fleetOf(5000, "b"), fleetOf(5000, "a")
	fullA[0].Available = false // Caddy: max_requests reached on a
	x, y := q.place(1, 4000, a), q.place(2, 100, b)
	q.f.Progress(x, 1, t0)
	q.f.Progress(y, 1, t0)
	reqB, hB := q.hold(11, 300, fullA)
	// A release elsewhere (b is not B's) readies nothing: no poll storm
	// from the fleet's other releases.
	reqB.ReleasesBefore = q.f.Releases()
	q.f.Release(y, t0)
	if q.retry(reqB, hB, fullA) || isReady(hB) {
		t.Fatal("a release on another upstream readied B")
	}
	reqB.ReleasesBefore = q.f.Releases() // B's poll reads it, then Caddy's view: a full
	q.f.Release(x, t0)                   // x ends on a
	if q.retry(reqB, hB, fullA) {
		t.Fatal("B placed on a view of a full upstream")
	}
	if !isReady(hB) {
		t.Error("a release came after B's view was taken, yet B's hold waits for its poll")
	}
	if !q.retry(reqB, hB, a) {
		t.Error("B, deciding again with a fresh view, was not placed")
	}
}

// TestPeersReleaseIsNoRoomToCaddy: a peer router's release on an upstream
// Caddy counts full here (max_requests counts this router's requests only)
// does not count as a release since the hold's view: it does not ready
// the hold at once.
func TestPeersReleaseIsNoRoomToCaddy(t *testing.T) {
	q := newQueue(t, OutputFixed)
	fullA := fleetOf(5000, "a")
	fullA[0].Available = false
	q.f.Name("a", t0)
	q.f.Apply("peer", Event{Kind: EventRouted, ID: 1, Dial: "a", Prefill: 100, Decode: 10, KV: 110}, t0)
	reqB, hB := q.hold(11, 300, fullA)
	reqB.ReleasesBefore = q.f.Releases()
	q.f.Apply("peer", Event{Kind: EventReleased, ID: 1}, t0)
	if q.retry(reqB, hB, fullA) || isReady(hB) {
		t.Error("a peer's release readied a hold behind an upstream full to Caddy")
	}
}

// TestFailedTurnPassesOnDespiteReleasesElsewhere: H has a's turn and fails
// (a new arrival took part of the room); G fits in what is left. Releases
// on b, which H cannot use, landing while H decides must not ready H again
// with a's turn kept, which would keep a's turn from G.
func TestFailedTurnPassesOnDespiteReleasesElsewhere(t *testing.T) {
	q := newQueue(t, OutputFixed)
	ms := fleetOf(5000, "a", "b")
	ms[1].Hardware.KVCapacityTokens = 400
	x1 := q.place(1, 1400, ms[:1])
	q.place(2, 500, ms[:1])
	q.place(3, 2700, ms[:1])
	reqH, hH := q.hold(10, 1400, ms[:1]) // H and G: a only (b is not even theirs)
	reqG, hG := q.hold(11, 400, ms[:1])
	served(q.f, x1, t0) // H readied by a
	if !isReady(hH) || isReady(hG) {
		t.Fatalf("H %v G %v", isReady(hH), isReady(hG))
	}
	q.place(20, 900, ms[:1]) // new arrival: 600 left on a
	for i := range 5 {
		y := q.place(uint64(200+i), 200, ms[1:]) // on b
		before := q.f.Releases()
		served(q.f, y, t0)
		reqH.ReleasesBefore = before
		if q.retry(reqH, hH, ms[:1]) {
			t.Fatal("H placed")
		}
	}
	q.wantReadied(reqG, hG, ms[0], fmt.Sprintf("G fits on a, H failed a's turn 5 times, yet G waits (H ready %v, kept a's turn)", isReady(hH)))
}

// TestHoldRenewalKeepsItsTurn: a release that readies a hold between its
// request's decision and its renewal (the plugin's two lock sections)
// gives it the turn all the same: once it routes, the next is readied.
func TestHoldRenewalKeepsItsTurn(t *testing.T) {
	q, ms := newQueue(t, OutputFixed), fleetOf(5000, "a")
	x, _ := q.place(1, 2000, ms), q.place(2, 2700, ms) // 2100+2800 = 4900
	reqA, a := q.hold(10, 1400, ms)                    // needs 1500
	reqC, c := q.hold(11, 400, ms)                     // needs 500
	// A's poll: it decides (no room), then x releases before its Hold.
	d := q.f.Decide(t0, reqA, ms, &q.opts, rng(), nil)
	served(q.f, x, t0)                     // free 2200: readyNext readies A (by = a)
	q.f.Hold(a, &d, reqA, t0, ms, &q.opts) // readied again by the release count, keeping the turn
	if !isReady(a) || isReady(c) {
		t.Fatalf("A %v C %v", isReady(a), isReady(c))
	}
	if !q.retry(reqA, a, ms) { // free 700
		t.Fatal("A not placed")
	}
	q.f.Unhold(a, t0)
	q.wantReadied(reqC, c, ms[0], "C fits in the 700 tokens left on a, but no hold is ready")
}

// TestHoldTriedUpstreamSkipped: a retried request is not readied by
// releases on the upstream it tried while its decision avoids it (another
// is available), so it does not take the turn of those behind it there.
func TestHoldTriedUpstreamSkipped(t *testing.T) {
	q, ms := newQueue(t, OutputFixed), fleetOf(3000, "a", "b")
	var xs []*Charge
	for i := range 5 {
		xs = append(xs, q.place(uint64(1+i), 500, ms[:1])) // a: 5 x 600 = 3000
	}
	q.place(9, 2900, ms[1:]) // b: full
	tried := slices.Clone(ms)
	tried[0].Tried = true // the retry of a request whose attempt on a failed
	reqR, r := q.hold(10, 400, tried)
	reqB, b := q.hold(11, 400, ms)
	for i, x := range xs[:3] {
		served(q.f, x, t0) // a frees 600 each time
		if isReady(r) && q.retry(reqR, r, tried) {
			t.Fatalf("release %d: R placed on the upstream it tried", i)
		}
		if !isReady(b) {
			t.Errorf("release %d: a has %d free, B fits there (%v), B not readied",
				i, 600*(i+1), q.f.Fits(t0, reqB, ms[0], &q.opts))
		}
	}
}
