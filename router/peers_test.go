package router

import (
	"fmt"
	mrand "math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/llmaffinity/caddy-llm-affinity/prefixindex"
	"github.com/llmaffinity/caddy-llm-affinity/scorer"
)

// TestPeersShareTheView: what router a routes, router b's index and
// queues see; a's completion teaches b's output estimate and releases
// the charge on b.
func TestPeersShareTheView(t *testing.T) {
	a, b := New(), New()
	for _, f := range []*Fleet{a, b} {
		f.Name("x", t0)
		f.Name("y", t0)
	}
	var sent []Event
	a.SetPublisher(func(ev Event) { sent = append(sent, ev) })
	opts := Options{OutputTokens: 50}.WithDefaults()
	req := Request{Hashes: hashes(1, 1024), BlockTokens: 64, PromptTokens: 1024, MaxTokens: 100, Model: "m"}
	d := a.Decide(t0, req, members("x", "y"), &opts, rng(), nil)
	if len(sent) != 1 || sent[0].Kind != EventRouted || sent[0].Dial != d.Charge.Dial() || len(sent[0].Hashes) != 16 {
		t.Fatalf("events %+v", sent)
	}
	for _, ev := range sent {
		if !b.Apply("a", ev, t0) {
			t.Fatalf("b ignored %+v", ev)
		}
	}
	dial := d.Charge.Dial()
	if u := state(t, b, dial); u.QueuedPrefillTokens != 1024 || u.QueuedDecodeTokens != 50 || u.InFlight != 1 || u.IndexBlocks != 16 {
		t.Fatalf("b's view of a's charge: %+v", u)
	}
	sent = sent[:0]
	a.Progress(d.Charge, 1, t0.Add(time.Second))
	a.Progress(d.Charge, 4, t0.Add(time.Second))
	for _, ev := range sent {
		b.Apply("a", ev, t0.Add(time.Second))
	}
	if u := state(t, b, dial); u.QueuedPrefillTokens != 0 || u.QueuedDecodeTokens != 45 {
		t.Fatalf("b after a's first 5 tokens: %+v", u)
	}
	// Turn 2 through b lands warm where a sent turn 1.
	d2 := b.Decide(t0, req, members("x", "y"), &opts, rng(), nil)
	if d2.Charge.Dial() != dial || d2.Reason != scorer.Warm {
		t.Fatalf("b routed turn 2 to %s (%s), a sent turn 1 to %s", d2.Charge.Dial(), d2.Reason, dial)
	}
	b.Release(d2.Charge, t0)

	sent = sent[:0]
	a.Complete(d.Charge, "m", Usage{OutputTokens: 20}, t0.Add(2*time.Second))
	for _, ev := range sent {
		b.Apply("a", ev, t0.Add(2*time.Second))
	}
	if u := state(t, b, dial); u.QueuedPrefillTokens != 0 || u.QueuedDecodeTokens != 0 || u.InFlight != 0 || u.Completed != 1 {
		t.Fatalf("b after a's completion: %+v", u)
	}
	if got := b.expectedOutput(&Request{Model: "m"}, &opts); got != 20 {
		t.Fatalf("b learned output %d from a's completion, want 20", got)
	}
	if b.Apply("a", Event{Kind: EventReleased, ID: d.Charge.id}, t0) {
		t.Fatal("a second release of the same charge changed something")
	}
}

// TestPeerEventsForUnknownUpstreamsAreIgnored: a peer routing to an
// upstream this router does not have changes nothing here.
func TestPeerEventsForUnknownUpstreamsAreIgnored(t *testing.T) {
	b := New()
	b.Name("x", t0)
	if b.Apply("a", Event{Kind: EventRouted, ID: 1, Dial: "elsewhere:1", Prefill: 100}, t0) || b.Known("elsewhere:1") {
		t.Fatal("applied a charge to an upstream this router does not have")
	}
	if b.Apply("a", Event{Kind: EventProgressed, ID: 7, Tokens: 3}, t0) {
		t.Fatal("applied progress of a charge never routed")
	}
}

// TestSilentPeersLoseTheirCharges: a peer that stops talking (it died)
// leaves no charge behind once its silence passes the limit; a charge
// whose release was lost expires after the longest a request may take.
func TestSilentPeersLoseTheirCharges(t *testing.T) {
	b := New()
	b.Name("x", t0)
	b.Apply("dead", Event{Kind: EventRouted, ID: 1, Dial: "x", Prefill: 100, Decode: 10, KV: 110}, t0)
	b.Apply("alive", Event{Kind: EventRouted, ID: 1, Dial: "x", Prefill: 100, Decode: 10, KV: 110}, t0)
	b.Apply("alive", Event{Kind: EventRouted, ID: 2, Dial: "x", Prefill: 100, Decode: 10, KV: 110}, t0.Add(50*time.Minute))
	now := t0.Add(time.Hour)
	b.Heard("alive", now)
	if n := b.ExpirePeers(now, now.Add(-30*time.Second), now.Add(-30*time.Minute)); n != 2 {
		t.Fatalf("released %d charges, want the dead peer's and the alive peer's lost one", n)
	}
	if u := state(t, b, "x"); u.InFlight != 1 || u.QueuedPrefillTokens != 100 {
		t.Fatalf("after expiry: %+v", u)
	}
	if ps := b.Peers(); len(ps) != 1 || ps[0].Name != "alive" || ps[0].Charges != 1 {
		t.Fatalf("peers %+v", ps)
	}
}

// TestForgottenUpstreamsTakeNoPeerCharges: once no config names an
// upstream, peers' new charges there are ignored, so their traffic cannot
// keep it alive; it goes with the last charge it had.
func TestForgottenUpstreamsTakeNoPeerCharges(t *testing.T) {
	b := New()
	b.Name("x", t0)
	b.Apply("a", Event{Kind: EventRouted, ID: 1, Dial: "x", Prefill: 100}, t0)
	b.Forget("x")
	if !b.Known("x") || b.Routable("x") {
		t.Fatal("a forgotten upstream with a charge in flight: want known, not routable")
	}
	if b.Apply("a", Event{Kind: EventRouted, ID: 2, Dial: "x", Prefill: 100}, t0) {
		t.Fatal("a peer's new charge was applied to a forgotten upstream")
	}
	b.Apply("a", Event{Kind: EventReleased, ID: 1}, t0)
	if b.Known("x") {
		t.Fatal("the forgotten upstream stayed after its last charge")
	}
}

// TestPeerFiguresBounded: a peer's routed event cannot charge an upstream
// more KV than it has (a wrong or hostile peer would shed every local
// request), cannot size the index by blocks smaller than an engine's, and
// cannot hold more than maxPeerCharges charges here.
func TestPeerFiguresBounded(t *testing.T) {
	f := New()
	opts := Options{}.WithDefaults()
	ms := members("a")
	ms[0].Hardware.KVCapacityTokens = 100_000
	served(f, f.Decide(t0, Request{Hashes: hashes(1, 256), BlockTokens: 64, PromptTokens: 256, MaxTokens: 1, Model: "m"}, ms, &opts, rng(), nil).Charge, t0)
	capacity := state(t, f, "a").IndexCapacityBlocks
	f.Apply("p", Event{Kind: EventRouted, ID: 1, Dial: "a", KV: 1 << 30, Prefill: 1 << 30, Decode: 1 << 30, BlockTokens: 1, Hashes: []uint64{7}}, t0)
	if u := state(t, f, "a"); u.KVTokensInFlight > 100_000 || u.IndexCapacityBlocks != capacity {
		t.Fatalf("one peer event: KV %d of 100,000, index capacity %d (was %d)", u.KVTokensInFlight, u.IndexCapacityBlocks, capacity)
	}
	for i := uint64(2); i < maxPeerCharges+10; i++ {
		f.Apply("p", Event{Kind: EventRouted, ID: i, Dial: "a", KV: 1}, t0)
	}
	if u := state(t, f, "a"); u.InFlight != maxPeerCharges {
		t.Fatalf("a peer holds %d charges here, want at most %d", u.InFlight, maxPeerCharges)
	}
	f.Apply("p", Event{Kind: EventReleased, ID: 1}, t0)
	if f.remoteCharges["p"] != maxPeerCharges-1 {
		t.Fatalf("the count after a release: %d", f.remoteCharges["p"])
	}
}

// TestPeersTeachBytesPerToken: the bytes per token a router learns from
// its responses' usage reach its peers with each completion, so a peer's
// prompt estimates follow the same engines' counts.
func TestPeersTeachBytesPerToken(t *testing.T) {
	a, b := New(), New()
	for _, f := range []*Fleet{a, b} {
		f.Name("x", t0)
	}
	var sent []Event
	a.SetPublisher(func(ev Event) { sent = append(sent, ev) })
	opts := Options{}.WithDefaults()
	for i := range 5 {
		req := Request{Hashes: hashes(uint64(i), 1000), BlockTokens: 64, PromptTokens: 1000, PromptBytes: 4000, Model: "code"}
		d := a.Decide(t0, req, members("x"), &opts, rng(), nil)
		a.Complete(d.Charge, "code", Usage{PromptTokens: 2000, OutputTokens: 10}, t0) // 2 bytes a token
	}
	for _, ev := range sent {
		b.Apply("a", ev, t0)
	}
	for name, f := range map[string]*Fleet{"a": a, "b": b} {
		if got, ok := f.BytesPerToken("code"); !ok || got != 2 {
			t.Errorf("%s learned %v bytes per token (%v), want 2", name, got, ok)
		}
	}
}

// TestLiveEventsRestateCharges: a peer that hears a router's charges in
// flight restated (LiveEvents, under the router's new name after its
// events were lost) counts on each upstream what one that heard every
// event counts: released charges are gone, and a charge's output so far
// has lowered its decode charge and ended its prefill. A peer that heard
// the old name's events and then drops it (DropPeer, as it does on hearing
// the new name) counts the same.
func TestLiveEventsRestateCharges(t *testing.T) {
	a, heard, restated, renamed := New(), New(), New(), New()
	for _, f := range []*Fleet{a, heard, restated, renamed} {
		f.Name("x", t0)
		f.Name("y", t0)
	}
	var sent []Event
	a.SetPublisher(func(ev Event) { sent = append(sent, ev) })
	a.KeepLive(true)
	opts := Options{OutputTokens: 50}.WithDefaults()
	var charges []*Charge
	for i := range 6 {
		req := Request{Hashes: hashes(uint64(100*i), 512*(i+1)), BlockTokens: 64, PromptTokens: 512 * (i + 1), MaxTokens: 100, Model: "m"}
		charges = append(charges, a.Decide(t0, req, members("x", "y"), &opts, rng(), nil).Charge)
	}
	a.Progress(charges[0], 1, t0.Add(time.Second))
	a.Progress(charges[0], 70, t0.Add(2*time.Second)) // beyond its expected 50
	a.Progress(charges[1], 10, t0.Add(time.Second))
	a.Complete(charges[2], "m", Usage{OutputTokens: 5}, t0.Add(time.Second))
	a.Release(charges[3], t0.Add(time.Second))
	for _, ev := range sent {
		heard.Apply("a#1", ev, t0)
	}
	// renamed heard the first 3 routings under the old name, lost the
	// rest, then hears the new name's restatement.
	for _, ev := range sent[:3] {
		renamed.Apply("a#1", ev, t0)
	}
	live := a.LiveEvents()
	if renamed.DropPeer("a#1", t0) != 3 {
		t.Fatal("the old name's 3 charges not dropped")
	}
	for _, ev := range live {
		if len(ev.Hashes) != 0 {
			t.Fatalf("restated with hashes: %+v", ev)
		}
		restated.Apply("a#2", ev, t0)
		renamed.Apply("a#2", ev, t0)
	}
	if n := len(live); n != 4+2 { // four in flight, two with output
		t.Fatalf("%d events restate 4 charges: %+v", n, live)
	}
	for _, dial := range []string{"x", "y"} {
		h := state(t, heard, dial)
		for _, r := range []UpstreamState{state(t, restated, dial), state(t, renamed, dial)} {
			if h.QueuedPrefillTokens != r.QueuedPrefillTokens || h.QueuedDecodeTokens != r.QueuedDecodeTokens ||
				h.KVTokensInFlight != r.KVTokensInFlight || h.InFlight != r.InFlight {
				t.Errorf("%s: heard every event %+v, restated %+v", dial, h, r)
			}
			// A peer's first token says nothing of this router's TTFT
			// (it has no estimate here).
			if r.LastTTFT != 0 || r.LastEstimatedTTFTSeconds != 0 {
				t.Errorf("%s: a peer's first token set last TTFT %v, estimate %v", dial, r.LastTTFT, r.LastEstimatedTTFTSeconds)
			}
		}
	}
	// Released here, they are no longer restated.
	for _, c := range charges {
		a.Release(c, t0.Add(3*time.Second))
	}
	if live := a.LiveEvents(); len(live) != 0 {
		t.Fatalf("restated after every release: %+v", live)
	}
}

// TestSnapshotRestoresTheView: a router that starts, given a peer's
// SnapshotEvents (through Restore), holds what the peer's index holds (the same blocks in
// the same recency order, in an index of the peer's size where its own
// was never sized) and knows the stored responses' homes; upstreams it
// does not route to are skipped.
func TestSnapshotRestoresTheView(t *testing.T) {
	a, b := New(), New()
	for _, d := range []string{"x", "y", "z"} {
		a.Name(d, t0)
	}
	b.Name("x", t0)
	b.Name("y", t0)
	ms := members("x", "y", "z")
	for i := range ms {
		ms[i].Hardware.KVCapacityTokens = 1 << 20 // 16384 blocks of 64
	}
	opts := Options{}.WithDefaults()
	var reqs []Request
	for i := range 120 {
		req := Request{Hashes: hashes(uint64(i), 4096), BlockTokens: 64, PromptTokens: 4096, MaxTokens: 10}
		reqs = append(reqs, req)
		d := a.Decide(t0, req, ms[i%3:i%3+1], &opts, rng(), nil)
		served(a, d.Charge, t0)
	}
	a.RememberResponse("resp_old", "x")
	a.RememberResponse("resp_new", "y")
	a.RememberResponse("resp_z", "z")

	events := a.SnapshotEvents(1000)
	for _, ev := range events {
		if len(ev.Hashes) > 1000 {
			t.Fatalf("an event of %d hashes", len(ev.Hashes))
		}
		b.Restore(ev, t0)
	}
	for _, dial := range []string{"x", "y"} {
		ua, ub := state(t, a, dial), state(t, b, dial)
		if ua.IndexBlocks <= 2048 || ub.IndexBlocks != ua.IndexBlocks || ub.IndexCapacityBlocks != ua.IndexCapacityBlocks {
			t.Fatalf("%s: b's index %d of %d blocks, a's %d of %d (more than the default 2048 wanted)",
				dial, ub.IndexBlocks, ub.IndexCapacityBlocks, ua.IndexBlocks, ua.IndexCapacityBlocks)
		}
		if !slices.Equal(a.index.Entries(dial, nil), b.index.Entries(dial, nil)) {
			t.Fatalf("%s: b's index holds a's blocks in another order", dial)
		}
		// b's config gives no figure of its own: the peer's stays.
		b.Configure(dial, 0, false, t0)
		if ub := state(t, b, dial); ub.IndexCapacityBlocks != ua.IndexCapacityBlocks || ub.IndexBlocks != ua.IndexBlocks {
			t.Fatalf("%s: b's config, giving no capacity, cut the peer's index to %d of %d blocks", dial, ub.IndexBlocks, ub.IndexCapacityBlocks)
		}
	}
	for _, req := range reqs {
		da, db := b.index.Match(req.Hashes, nil), a.index.Match(req.Hashes, nil)
		for _, dial := range []string{"x", "y"} {
			ia, _ := a.index.Lookup(dial)
			ib, _ := b.index.Lookup(dial)
			if db[ia] != da[ib] {
				t.Fatalf("%s matches %d blocks on b, %d on a", dial, da[ib], db[ia])
			}
		}
	}
	if b.ResponseHome("resp_old") != "x" || b.ResponseHome("resp_new") != "y" || b.ResponseHome("resp_z") != "" || b.Known("z") {
		t.Fatalf("homes on b: %q %q %q; z known: %v", b.ResponseHome("resp_old"), b.ResponseHome("resp_new"), b.ResponseHome("resp_z"), b.Known("z"))
	}
	if u := state(t, b, "x"); u.InFlight != 0 || u.QueuedPrefillTokens != 0 {
		t.Fatalf("a snapshot charged b: %+v", u)
	}
}

// TestSnapshotSendsNoOtherUpstreamsBlocks: an upstream forgotten while a
// snapshot is made gives its index handle to the next one named; the
// snapshot must not send the new one's blocks under the old one's dial.
func TestSnapshotSendsNoOtherUpstreamsBlocks(t *testing.T) {
	for iter := range 200 {
		f := New()
		for i := range 4 {
			d := fmt.Sprintf("a%d", i)
			f.Name(d, t0)
			id, _ := f.index.Lookup(d)
			f.index.SetCapacity(id, 1<<12)
			chain := make([]uint64, 1<<12)
			for j := range chain {
				chain[j] = uint64(i+1)<<40 | uint64(j)
			}
			f.index.Insert(id, chain)
		}
		f.Name("y", t0)
		yid, _ := f.index.Lookup("y")
		f.index.Insert(yid, []uint64{1 << 50})
		done := make(chan struct{})
		go func() {
			defer close(done)
			f.Forget("y")   // a reload drops y...
			f.Name("z", t0) // ...and names z, which takes y's handle
			zid, _ := f.index.Lookup("z")
			f.index.Insert(zid, []uint64{2 << 50})
		}()
		events := f.SnapshotEvents(8192)
		<-done
		for _, ev := range events {
			if ev.Kind == EventCached && ev.Dial == "y" && ev.Hashes[0] == 2<<50 {
				t.Fatalf("iteration %d: z's block sent as y's", iter)
			}
		}
	}
}

// TestRestoredHomesGoBehind: a peer's snapshot of stored responses' homes
// goes behind what this router learned itself meanwhile, and a full table
// evicts none of its own: its own newest response's home stays known.
func TestRestoredHomesGoBehind(t *testing.T) {
	a, b := New(), New()
	a.Name("x", t0)
	b.Name("x", t0)
	for i := range MaxResponseHomes {
		a.RememberResponse(fmt.Sprintf("resp_%d", i), "x")
	}
	events := a.SnapshotEvents(8192)
	b.RememberResponse("resp_mine", "x") // stored through b while the snapshot travels
	for _, ev := range events {
		b.Restore(ev, t0)
	}
	if b.ResponseHome("resp_mine") != "x" || b.ResponseHomes() != MaxResponseHomes {
		t.Fatalf("b's own newest home: %q, %d homes", b.ResponseHome("resp_mine"), b.ResponseHomes())
	}
	// The restored ones keep the peer's order: its newest are kept.
	if b.ResponseHome(fmt.Sprintf("resp_%d", MaxResponseHomes-1)) != "x" || b.ResponseHome("resp_0") != "" {
		t.Fatal("b kept the peer's oldest home rather than its newest")
	}
}

// TestRoutingAfterItsRestatement: a peer's routed event that arrives after
// a restatement of the same charge (restatements carry no hashes, and may
// overtake the routing in the peer's queue) is not counted twice, and its
// prefix is indexed.
func TestRoutingAfterItsRestatement(t *testing.T) {
	b := New()
	b.Name("x", t0)
	h := hashes(1, 512)
	b.Apply("a#1", Event{Kind: EventRouted, ID: 7, Dial: "x", Prefill: 512, KV: 600}, t0)
	b.Apply("a#1", Event{Kind: EventRouted, ID: 7, Dial: "x", Prefill: 512, KV: 600, Hashes: h, BlockTokens: 64}, t0)
	if u := state(t, b, "x"); u.InFlight != 1 || u.IndexBlocks != len(h) {
		t.Fatalf("after the restatement and the routing: %+v", u)
	}
}

// TestSnapshotOfAnUpstreamNotKnownYet: a peer's snapshot of an upstream
// this router does not know yet (a dynamic one, known at its first
// request) is restored when the upstream comes, within
// pendingRestoreLife, behind what the first request put in the index;
// later than that it is dropped.
func TestSnapshotOfAnUpstreamNotKnownYet(t *testing.T) {
	a := New()
	a.Name("x", t0)
	a.Name("late", t0)
	ms := members("x")
	ms[0].Hardware.KVCapacityTokens = 1 << 20
	req := Request{Hashes: hashes(1, 4096), BlockTokens: 64, PromptTokens: 4096}
	aOpts := Options{}.WithDefaults()
	served(a, a.Decide(t0, req, ms, &aOpts, rng(), nil).Charge, t0)
	a.RememberResponse("resp_1", "x")
	events := a.SnapshotEvents(16)
	for _, tc := range []struct {
		name   string
		after  time.Duration
		blocks int
		home   string
	}{{"soon", time.Minute, 64, "x"}, {"too late", pendingRestoreLife + time.Second, 0, ""}} {
		b := New()
		for _, ev := range events {
			if b.Restore(ev, t0) {
				t.Fatalf("%s: restored %v for an upstream b does not know", tc.name, ev.Kind)
			}
		}
		opts := Options{}.WithDefaults()
		d := b.Decide(t0.Add(tc.after), Request{Hashes: hashes(2, 64), BlockTokens: 64, PromptTokens: 64}, members("x"), &opts, rng(), nil)
		served(b, d.Charge, t0.Add(tc.after))
		if u := state(t, b, "x"); u.IndexBlocks != 1+tc.blocks || b.ResponseHome("resp_1") != tc.home {
			t.Fatalf("%s: b's index holds %d blocks and resp_1's home is %q; want %d and %q", tc.name, u.IndexBlocks, b.ResponseHome("resp_1"), 1+tc.blocks, tc.home)
		}
		if len(b.pending) != 0 || b.pendingHashes != 0 || b.pendingResponses != 0 {
			t.Fatalf("%s: pending left: %d dials, %d hashes, %d responses", tc.name, len(b.pending), b.pendingHashes, b.pendingResponses)
		}
	}
	// An upstream that never comes (a peer's other site): what the
	// snapshot had for it goes once its time is up.
	b := New()
	for _, ev := range events {
		b.Restore(ev, t0)
	}
	b.ExpirePeers(t0.Add(time.Minute), t0, t0)
	if len(b.pending) != 1 || b.pendingHashes == 0 {
		t.Fatalf("kept for a minute: %d dials, %d hashes", len(b.pending), b.pendingHashes)
	}
	b.ExpirePeers(t0.Add(pendingRestoreLife+time.Second), t0, t0)
	if len(b.pending) != 0 || b.pendingHashes != 0 || b.pendingResponses != 0 {
		t.Fatalf("after its time: %d dials, %d hashes, %d responses", len(b.pending), b.pendingHashes, b.pendingResponses)
	}
}

// TestPendingSnapshotIsBounded: what is kept for upstreams not known yet
// is bounded in events of every kind, adapters too (a peer's snapshot
// sends each of an upstream's adapters as an event of its own), and the
// counts go back to zero with what they counted.
func TestPendingSnapshotIsBounded(t *testing.T) {
	b := New()
	for i := range 2 * maxPendingOthers {
		b.Restore(Event{Kind: EventCached, Dial: fmt.Sprintf("unknown-%d", i%8), Adapter: fmt.Sprintf("lora-%d", i)}, t0)
	}
	kept := 0
	for _, p := range b.pending {
		kept += len(p.events)
	}
	if kept != maxPendingOthers || b.pendingOthers != maxPendingOthers {
		t.Fatalf("kept %d adapter events (counted %d), want the bound %d", kept, b.pendingOthers, maxPendingOthers)
	}
	b.ExpirePeers(t0.Add(pendingRestoreLife+time.Second), t0, t0)
	if len(b.pending) != 0 || b.pendingOthers != 0 {
		t.Fatalf("after its time: %d dials, %d other events", len(b.pending), b.pendingOthers)
	}
}

// TestSnapshotRestoresAdapters: the adapters a peer charged on each
// upstream come with its snapshot, behind the ones this router charged
// there itself, so an adapter resident by the peer's traffic is resident
// here too.
func TestSnapshotRestoresAdapters(t *testing.T) {
	a, b := New(), New()
	a.Name("x", t0)
	b.Name("x", t0)
	opts := Options{MaxLoras: 2, Adapters: map[string]bool{"l1": true, "l2": true, "l3": true, "l9": true}}.WithDefaults()
	for _, ad := range []string{"l1", "l2", "l3"} {
		served(a, a.Decide(t0, Request{Hashes: hashes(1, 64), BlockTokens: 64, PromptTokens: 64, Model: ad}, members("x"), &opts, rng(), nil).Charge, t0)
	}
	served(b, b.Decide(t0, Request{Hashes: hashes(2, 64), BlockTokens: 64, PromptTokens: 64, Model: "l9"}, members("x"), &opts, rng(), nil).Charge, t0)
	for _, ev := range a.SnapshotEvents(8192) {
		b.Restore(ev, t0)
	}
	if got := state(t, b, "x").Adapters; !slices.Equal(got, []string{"l9", "l3", "l2", "l1"}) {
		t.Fatalf("b's adapters on x: %v, want its own l9, then a's l3 l2 l1", got)
	}
}

// TestPeersAreBounded: a sender inventing router names gets no further
// than maxPeers of them heard at once, and all peers' charges together no
// further than maxRemoteCharges: beyond, their events are ignored (the
// peers already heard go on), until silent peers expire.
func TestPeersAreBounded(t *testing.T) {
	f := New()
	f.Name("x", t0)
	for i := range maxPeers + 10 {
		f.Apply(fmt.Sprintf("peer-%d", i), Event{Kind: EventRouted, ID: 1, Dial: "x", Prefill: 1}, t0)
	}
	if n := len(f.Peers()); n != maxPeers {
		t.Fatalf("%d peers heard, want the bound %d", n, maxPeers)
	}
	if !f.Apply("peer-0", Event{Kind: EventRouted, ID: 2, Dial: "x", Prefill: 1}, t0) {
		t.Fatal("a peer heard before was ignored")
	}
	if u := state(t, f, "x"); u.InFlight != maxPeers+1 {
		t.Fatalf("%d charges in flight, want %d", u.InFlight, maxPeers+1)
	}
	f.ExpirePeers(t0.Add(time.Hour), t0.Add(time.Minute), t0)
	if !f.Apply("peer-new", Event{Kind: EventRouted, ID: 1, Dial: "x", Prefill: 1}, t0.Add(time.Hour)) {
		t.Fatal("a new peer was ignored after the silent ones expired")
	}

	// All peers' charges together.
	g := New()
	g.Name("x", t0)
	for i := range maxRemoteCharges + 10 {
		g.Apply(fmt.Sprintf("peer-%d", i/maxPeerCharges), Event{Kind: EventRouted, ID: uint64(i + 1), Dial: "x", Prefill: 1}, t0)
	}
	if u := state(t, g, "x"); u.InFlight != maxRemoteCharges {
		t.Fatalf("%d peer charges in flight, want the bound %d", u.InFlight, maxRemoteCharges)
	}
}

// wired is routers that share their view, each event handed to every
// other router at once, in order, as a sync connection without losses
// does.
type wired struct {
	names  []string
	fleets []*Fleet
	queue  []wiredEvent
	// told counts the events of each kind sent.
	told map[EventKind]int
}

type wiredEvent struct {
	from int
	ev   Event
}

func wire(t *testing.T, dials ...string) *wired {
	t.Helper()
	w := &wired{names: []string{"a", "b"}, told: map[EventKind]int{}}
	for i := range w.names {
		f := New()
		for _, d := range dials {
			f.Name(d, t0)
		}
		f.KeepLive(true)
		f.SetPublisher(func(ev Event) {
			ev.Hashes = slices.Clone(ev.Hashes)
			w.queue = append(w.queue, wiredEvent{i, ev})
			w.told[ev.Kind]++
		})
		w.fleets = append(w.fleets, f)
	}
	return w
}

// deliver hands every event sent so far, and those applying them send,
// to the other routers.
func (w *wired) deliver() {
	for len(w.queue) > 0 {
		e := w.queue[0]
		w.queue = w.queue[1:]
		for i, f := range w.fleets {
			if i != e.from {
				f.Apply(w.names[e.from], e.ev, t0)
			}
		}
	}
}

// allMatch fails t unless every router's index matches want tokens of
// req, asked quietly (see quietMatch); what says what req is.
func (w *wired) allMatch(t *testing.T, req Request, want int, what string) {
	t.Helper()
	for i, f := range w.fleets {
		if got := quietMatch(t, f, req); got != want {
			t.Errorf("router %s matched %d %s, want %d", w.names[i], got, what, want)
		}
	}
}

// TestPeersForgetWhatAFailedRequestDidNotPrefill: a request that fails
// before its first token takes its blocks back at every router, not only
// at its own: the conversation's next turn is not sent "warm" through
// another gateway to an engine that never prefilled it. What a prefill
// there ran through stays, whichever router it went through: a peer's
// request past its first token keeps what it shares with the failed one
// (and its router tells the failed one's), and one still waiting for its
// first token inserts its blocks again at it. A failure after the first
// token forgets nothing, and a release whose first-token event was lost
// on the way is no failure at the peers.
func TestPeersForgetWhatAFailedRequestDidNotPrefill(t *testing.T) {
	opts := Options{}.WithDefaults()
	ms := members("x")
	turn := sharedTurn
	matched := func(f *Fleet, req Request) int { t.Helper(); return quietMatch(t, f, req) }

	t.Run("alone", func(t *testing.T) {
		w := wire(t, "x")
		a, b := w.fleets[0], w.fleets[1]
		r := a.Decide(t0, turn(100), ms, &opts, rng(), nil)
		w.deliver()
		if got := matched(b, turn(100)); got != 2048 {
			t.Fatalf("b matched %d of the routed turn's 2,048 tokens", got)
		}
		a.Release(r.Charge, t0) // the engine answered 500 at once
		w.deliver()
		w.allMatch(t, turn(100), 0, "tokens of a prompt no engine prefilled")
	})

	t.Run("a peer's request past its first token", func(t *testing.T) {
		w := wire(t, "x")
		a, b := w.fleets[0], w.fleets[1]
		r := a.Decide(t0, turn(100), ms, &opts, rng(), nil)
		w.deliver()
		s := b.Decide(t0, turn(200), ms, &opts, rng(), nil) // warm on the system prompt
		b.Progress(s.Charge, 1, t0)
		w.deliver()
		a.Release(r.Charge, t0) // a knows nothing of s's prompt: it forgets all 32 blocks
		w.deliver()
		for i, f := range w.fleets {
			if got := matched(f, turn(300)); got != 1024 {
				t.Errorf("router %s matched %d tokens of the system prompt s prefilled, want 1,024", w.names[i], got)
			}
			if got := matched(f, turn(100)); got != 1024 {
				t.Errorf("router %s matched %d tokens of the failed turn, want its system prompt's 1,024", w.names[i], got)
			}
			if got := matched(f, turn(200)); got != 2048 {
				t.Errorf("router %s matched %d of s's 2,048 tokens", w.names[i], got)
			}
		}
		if w.told[EventPrefilled] != 1 {
			t.Errorf("%d prefilled events, want b's one", w.told[EventPrefilled])
		}
	})

	t.Run("a peer's request waiting for its first token", func(t *testing.T) {
		w := wire(t, "x")
		a, b := w.fleets[0], w.fleets[1]
		r := a.Decide(t0, turn(100), ms, &opts, rng(), nil)
		w.deliver()
		s := b.Decide(t0, turn(200), ms, &opts, rng(), nil)
		w.deliver()
		a.Release(r.Charge, t0)
		w.deliver()
		b.Progress(s.Charge, 1, t0) // the engine prefilled s's prompt after all
		w.deliver()
		for i, f := range w.fleets {
			if got := matched(f, turn(200)); got != 2048 {
				t.Errorf("router %s matched %d of s's 2,048 tokens", w.names[i], got)
			}
			if got := matched(f, turn(100)); got != 1024 {
				t.Errorf("router %s matched %d tokens of the failed turn, want its system prompt's 1,024", w.names[i], got)
			}
		}
	})

	t.Run("a failure after the first token", func(t *testing.T) {
		w := wire(t, "x")
		a := w.fleets[0]
		r := a.Decide(t0, turn(100), ms, &opts, rng(), nil)
		a.Progress(r.Charge, 1, t0)
		a.Release(r.Charge, t0) // the client left mid-stream
		// The first token's event was lost on the way (fleetsync drops
		// progress without renewing: the next one makes good).
		w.queue = slices.DeleteFunc(w.queue, func(e wiredEvent) bool { return e.ev.Kind == EventProgressed })
		w.deliver()
		if w.told[EventForgot] != 0 {
			t.Errorf("a told its peers to forget the blocks of a request past its first token")
		}
		w.allMatch(t, turn(100), 2048, "of the prefilled turn's 2,048 tokens")
	})
}

// TestPeersForgetWhatTwoFailuresDidNotPrefill: two routers' requests fail
// at one engine, the second routed warm on blocks the first added. Router
// a forgets the first's blocks, then hears the second's routing, which
// inserts them again; router b, told of the first's failure, no longer
// counts them as the second's held, so its failure takes them back at a
// too. Nothing that no engine prefilled stays anywhere.
func TestPeersForgetWhatTwoFailuresDidNotPrefill(t *testing.T) {
	opts := Options{}.WithDefaults()
	ms := members("x")
	w := wire(t, "x")
	a, b := w.fleets[0], w.fleets[1]
	r := a.Decide(t0, sharedTurn(100), ms, &opts, rng(), nil)
	w.deliver()
	s := b.Decide(t0, sharedTurn(200), ms, &opts, rng(), nil)
	if s.MatchedTokens != 1024 {
		t.Fatalf("s matched %d, want the system prompt's 1,024", s.MatchedTokens)
	}
	a.Release(r.Charge, t0) // 503 before any token
	w.deliver()             // a hears s's routing, b hears r's failure
	b.Release(s.Charge, t0) // the engine fails s too
	w.deliver()
	w.allMatch(t, sharedTurn(300), 0, "tokens of a system prompt no engine prefilled")
}

// TestRestartedEngineProtectsNothing: a request past its first token when
// its engine restarted (the scraper saw it; the index is cleared) keeps
// nothing from a peer's failure there afterwards: the engine lost what
// its prefill held.
func TestRestartedEngineProtectsNothing(t *testing.T) {
	opts := Options{}.WithDefaults()
	ms := members("x")
	w := wire(t, "x")
	a, b := w.fleets[0], w.fleets[1]
	s := b.Decide(t0, sharedTurn(200), ms, &opts, rng(), nil)
	b.Progress(s.Charge, 1, t0)
	w.deliver()
	for _, f := range w.fleets {
		f.EngineRestarted("x", t0.Add(1))
	}
	r := a.Decide(t0, sharedTurn(100), ms, &opts, rng(), nil) // cold: the engine restarted
	w.deliver()
	a.Release(r.Charge, t0)
	w.deliver()
	w.allMatch(t, sharedTurn(300), 0, "tokens at an engine that restarted and prefilled nothing since")
}

// TestPendingSnapshotDoesNotUndoAForget: a router that does not know an
// upstream yet (a dynamic one) keeps a peer's snapshot of it for later; a
// failure there it hears meanwhile takes the failed blocks out of it, so
// they do not come back when the upstream becomes known.
func TestPendingSnapshotDoesNotUndoAForget(t *testing.T) {
	opts := Options{}.WithDefaults()
	ms := members("x")
	w := wire(t, "x")
	a, b := w.fleets[0], w.fleets[1]
	r := a.Decide(t0, sharedTurn(100), ms, &opts, rng(), nil)
	w.deliver()
	snapshot := b.SnapshotEvents(8192) // taken before b heard of the failure
	a.Release(r.Charge, t0)
	var forgot Event
	for _, e := range w.queue {
		if e.ev.Kind == EventForgot {
			forgot = e.ev
		}
	}
	w.deliver()
	c := New() // x is not named: dynamic, known at c's first request there
	c.KeepLive(true)
	for _, ev := range snapshot {
		c.Restore(ev, t0)
	}
	if !c.Apply("a", forgot, t0.Add(time.Second)) {
		t.Fatal("the forget changed nothing in the snapshot kept for x")
	}
	if got := quietMatch(t, c, sharedTurn(100)); got != 0 {
		t.Errorf("the starting router matched %d tokens of a prompt no engine prefilled", got)
	}
}

// TestPeersForgetWhatTwoFailuresAtOnceDidNotPrefill: two routers'
// requests fail at one engine at once (a burst it answers 503), the
// second routed warm on blocks the first added, before either router
// heard of the other's failure. Each router forgets what each request's
// routing added to its own index: router a, which forgot the system
// prompt with its own request and learned it again from b's routing,
// forgets it again at b's failure, though b's own index held it.
func TestPeersForgetWhatTwoFailuresAtOnceDidNotPrefill(t *testing.T) {
	opts := Options{}.WithDefaults()
	ms := members("x")
	w := wire(t, "x")
	a, b := w.fleets[0], w.fleets[1]
	r := a.Decide(t0, sharedTurn(100), ms, &opts, rng(), nil)
	w.deliver()
	s := b.Decide(t0, sharedTurn(200), ms, &opts, rng(), nil) // warm: 1,024
	a.Release(r.Charge, t0)
	b.Release(s.Charge, t0) // both 503, nothing crossed yet
	w.deliver()
	w.allMatch(t, sharedTurn(300), 0, "tokens of a system prompt no engine prefilled")
}

// TestUnrelatedForgetRepublishesNothing: a peer's failure that forgot
// nothing a request waiting here shares does not make it publish its
// chain again at its first token.
func TestUnrelatedForgetRepublishesNothing(t *testing.T) {
	opts := Options{}.WithDefaults()
	ms := members("x")
	w := wire(t, "x")
	a, b := w.fleets[0], w.fleets[1]
	other := Request{Hashes: hashes(999, 1024), BlockTokens: 64, PromptTokens: 1024, Model: "m"}
	s := b.Decide(t0, sharedTurn(200), ms, &opts, rng(), nil)
	r := a.Decide(t0, other, ms, &opts, rng(), nil)
	w.deliver()
	a.Release(r.Charge, t0)
	w.deliver()
	b.Progress(s.Charge, 1, t0)
	if n := w.told[EventPrefilled]; n != 0 {
		t.Errorf("b published %d prefilled events at a first token, though no failure forgot any of its blocks", n)
	}
}

// sharedTurn is a 2,048-token prompt: a 16-block system prompt every turn
// shares and 16 blocks of its own.
func sharedTurn(seed uint64) Request {
	h := append(append([]uint64(nil), hashes(5, 1024)...), hashes(seed, 1024)...)
	return Request{Hashes: h, BlockTokens: 64, PromptTokens: 2048, Model: "m"}
}

// quietMatch is what req matches at f, asked quietly: a probe tells the
// peers nothing and leaves the index as it was.
func quietMatch(t *testing.T, f *Fleet, req Request) int {
	t.Helper()
	opts := Options{}.WithDefaults()
	f.mu.Lock()
	publisher := f.publisher
	f.publisher = nil
	f.mu.Unlock()
	d := f.Decide(t0, req, members("x"), &opts, rng(), nil)
	f.mu.Lock()
	defer f.mu.Unlock()
	f.publisher = publisher
	f.failed(d.Charge, t0)
	return d.MatchedTokens
}

// randomPrompt is a prompt of a system prompt (one of two) and up to three
// turns (each one of three), whole blocks each, hashed as one text.
func randomPrompt(r *mrand.Rand) Request {
	var text []byte
	segment := func(kind, v, blocks int) {
		for i := range blocks * 256 {
			text = append(text, byte('a'+(i*7+kind*31+v*13+i/256)%26))
		}
	}
	segment(0, r.IntN(2), 4)
	path := 0
	for d := range r.IntN(4) {
		path = path*3 + r.IntN(3)
		segment(1+d, path, 2)
	}
	h := prefixindex.Hasher{BlockTokens: 64, BytesPerToken: 4}.HashBytes(nil, 1, text)
	return Request{Hashes: h, BlockTokens: 64, PromptTokens: len(text) / 4, Model: "m"}
}
