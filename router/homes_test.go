package router

import (
	"container/list"
	"fmt"
	"math/rand/v2"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/llmaffinity/caddy-llm-affinity/scrape"
)

// TestRequestGoesHome: a request with a home goes there while it is a
// healthy member that is not draining, whatever the others offer (one
// holds its whole prefix, idle) and though it was tried before; a full
// home is waited for; a home down (by Caddy's health checks or its
// scrape), draining or found unreachable by an earlier attempt leaves the request routed as any other.
func TestRequestGoesHome(t *testing.T) {
	f := New()
	opts := Options{OutputEstimate: OutputFixed, OutputTokens: 10}.WithDefaults()
	ms := members("a", "b", "c")
	warm := Request{Hashes: hashes(3, 2048), BlockTokens: 64, PromptTokens: 2048}
	d := f.Decide(t0, warm, ms, &opts, rng(), nil)
	served(f, d.Charge, t0)
	holder := ms[d.Chosen].Dial
	home := "a"
	if holder == home {
		home = "b"
	}
	req := warm
	req.Home = home
	with := func(change func(m *Member)) []Member {
		ms := members("a", "b", "c")
		for i := range ms {
			if ms[i].Dial == home {
				change(&ms[i])
			}
		}
		return ms
	}
	for _, ms := range [][]Member{
		with(func(*Member) {}),
		with(func(m *Member) { m.Tried = true }), // a retry after its stream broke there
	} {
		for range 3 {
			d := f.Decide(t0, req, ms, &opts, rng(), nil)
			if d.Charge == nil || d.Charge.Dial() != home {
				t.Fatalf("went to %v, home %s (holder %s)", d.Charge, home, holder)
			}
			served(f, d.Charge, t0)
		}
	}
	if d := f.Decide(t0, req, with(func(m *Member) { m.Available = false }), &opts, rng(), nil); d.Charge != nil {
		t.Fatalf("home full: went to %s, want a wait", d.Charge.Dial())
	}
	for _, change := range []func(m *Member){
		func(m *Member) { m.Draining = true },
		func(m *Member) { m.Available, m.Healthy = false, false },
		// Its engine crashed since the health checks last looked: the
		// attempt there got no answer, and the response is gone with it.
		func(m *Member) { m.Tried, m.Unreached = true, true },
		// Its last scrape found nothing listening there.
		func(m *Member) { m.Down = true },
	} {
		d := f.Decide(t0, req, with(change), &opts, rng(), nil)
		if d.Charge == nil || d.Charge.Dial() == home {
			t.Fatalf("home %s draining or down: went to %v", home, d.Charge)
		}
		served(f, d.Charge, t0)
	}
	// A home whose list lacks the model asked for (unloaded there, or a
	// conversation going on with another model) is no home: the request
	// goes to an upstream serving the model at once, where waiting for
	// the home would only end in a shed.
	lora := req
	lora.Model = "tenant-m"
	lists := func(m *Member) {
		m.Models = []scrape.ModelInfo{{ID: "base"}}
		if m.Dial != home {
			m.Models = append(m.Models, scrape.ModelInfo{ID: "tenant-m", Parent: "base"})
		}
	}
	ms = members("a", "b", "c")
	for i := range ms {
		lists(&ms[i])
	}
	if d := f.Decide(t0, lora, ms, &opts, rng(), nil); d.Charge == nil || d.Charge.Dial() == home {
		t.Fatalf("home %s without the model: went to %v (%+v)", home, d.Charge, d)
	}
}

// TestPinnedHoldWaitsForItsHome: a request waiting for its full home is
// readied by its home's releases only; another upstream's release readies
// the request behind it that fits there.
func TestPinnedHoldWaitsForItsHome(t *testing.T) {
	q, ms := newQueue(t, OutputFixed), fleetOf(5000, "a", "b")
	xa := q.place(1, 4800, ms) // a: 4900 of 5000
	xb := q.place(2, 4800, ms) // b: 4900
	if xa.Dial() == xb.Dial() {
		t.Fatal("both on one upstream")
	}
	pinned := q.request(10, 1000)
	pinned.Home = xa.Dial()
	d := q.f.Decide(t0, pinned, ms, &q.opts, rng(), nil)
	if d.Charge != nil {
		t.Fatal("pinned request placed")
	}
	p := q.f.Hold(nil, &d, pinned, t0, ms, &q.opts)
	_, other := q.hold(11, 1000, ms)
	served(q.f, xb, t0) // b frees
	if isReady(p) || !isReady(other) {
		t.Fatalf("b's release readied the pinned request %v, the other %v", isReady(p), isReady(other))
	}
	served(q.f, xa, t0) // its home frees
	if !isReady(p) {
		t.Fatal("its home's release did not ready the pinned request")
	}
}

// TestResponseHomesBounded: the fleet remembers the latest
// MaxResponseHomes responses' upstreams, the least recently used going
// first.
func TestResponseHomesBounded(t *testing.T) {
	f := New()
	f.RememberResponse("resp_first", "a")
	for i := range MaxResponseHomes - 1 {
		f.RememberResponse(fmt.Sprint("resp_", i), "b")
	}
	if f.ResponseHome("resp_first") != "a" { // used: now the most recent
		t.Fatal("resp_first forgotten too soon")
	}
	f.RememberResponse("resp_new", "c")
	if f.ResponseHome("resp_0") != "" || f.ResponseHome("resp_first") != "a" || f.ResponseHome("resp_new") != "c" {
		t.Fatalf("resp_0 %q resp_first %q resp_new %q", f.ResponseHome("resp_0"), f.ResponseHome("resp_first"), f.ResponseHome("resp_new"))
	}
	if n := len(f.homes.byID); n != MaxResponseHomes || len(f.homes.newestFirst()) != n || len(f.homes.entries) != n {
		t.Fatalf("%d remembered, want %d", n, MaxResponseHomes)
	}
}

// TestStoredResponsesReachPeers: a router tells its peers which upstream
// stored a response, once per id and home; a peer that routes to that
// upstream remembers it without telling anyone again, one that does not
// forgets what it knew of the id.
func TestStoredResponsesReachPeers(t *testing.T) {
	a, b, c := New(), New(), New()
	var told []Event
	a.SetPublisher(func(ev Event) { told = append(told, ev) })
	b.SetPublisher(func(ev Event) { t.Errorf("b told its peers %+v", ev) })
	b.Name("x", t0)
	c.Name("y", t0)

	a.RememberResponse("resp_1", "x")
	a.RememberResponse("resp_1", "x") // the same again: nothing new
	a.RememberResponse("resp_2", "x")
	a.RememberResponse("resp_2", "y") // sent again, elsewhere
	a.RememberResponse("", "x")
	a.RememberResponse(strings.Repeat("r", MaxResponseIDBytes+1), "x")
	want := []Event{
		{Kind: EventStored, Dial: "x", Response: "resp_1"},
		{Kind: EventStored, Dial: "x", Response: "resp_2"},
		{Kind: EventStored, Dial: "y", Response: "resp_2"},
	}
	if !reflect.DeepEqual(told, want) {
		t.Fatalf("a told %+v, want %+v", told, want)
	}
	for _, ev := range told {
		b.Apply("a", ev, t0)
		c.Apply("a", ev, t0)
	}
	if b.ResponseHome("resp_1") != "x" || b.ResponseHome("resp_2") != "" || b.ResponseHomes() != 1 {
		t.Fatalf("b: resp_1 on %q, resp_2 on %q, %d homes", b.ResponseHome("resp_1"), b.ResponseHome("resp_2"), b.ResponseHomes())
	}
	if c.ResponseHome("resp_1") != "" || c.ResponseHome("resp_2") != "y" {
		t.Fatalf("c: resp_1 on %q, resp_2 on %q", c.ResponseHome("resp_1"), c.ResponseHome("resp_2"))
	}
}

// BenchmarkRememberResponse is what a stored response costs the router:
// its home noted (a new id, the table full, so the least recently used
// goes) and looked up by the next turn of its conversation.
func BenchmarkRememberResponse(b *testing.B) {
	f := New()
	ids := make([]string, 2*MaxResponseHomes)
	for i := range ids {
		ids[i] = fmt.Sprintf("resp_%024x", i)
	}
	for _, id := range ids[:MaxResponseHomes] {
		f.RememberResponse(id, "a")
	}
	b.ReportAllocs()
	i := MaxResponseHomes
	for b.Loop() {
		id := ids[i%len(ids)]
		f.RememberResponse(id, "b")
		if f.ResponseHome(id) != "b" {
			b.Fatal("forgotten")
		}
		i++
	}
}

// TestResponseHomesKeepTheOrderOfUse: the table of homes, linked by index,
// does what a container/list in order of use does (the implementation it
// replaced), over random remembers, lookups, forgets and restores of a
// few ids in tables of one to eight: the same homes, the same evictions,
// the same order for a snapshot; and its links stay whole (check).
func TestResponseHomesKeepTheOrderOfUse(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for run := range 200 {
		limit := 1 + run%8
		h := responseHomes{limit: limit}
		var ref list.List // of responseHome, most recently used first
		find := func(id string) *list.Element {
			for e := ref.Front(); e != nil; e = e.Next() {
				if e.Value.(responseHome).id == id {
					return e
				}
			}
			return nil
		}
		for step := range 200 {
			id, dial := fmt.Sprint("resp_", rng.IntN(14)), fmt.Sprint("u", rng.IntN(3))
			var what string
			switch op := rng.IntN(4); op {
			case 0:
				what = "remember " + id + " at " + dial
				e := find(id)
				want := e == nil || e.Value.(responseHome).dial != dial
				if e != nil {
					ref.Remove(e)
				} else if ref.Len() >= limit {
					ref.Remove(ref.Back())
				}
				ref.PushFront(responseHome{id: id, dial: dial})
				if got := h.remember(id, dial); got != want {
					t.Fatalf("run %d step %d: %s: news %v, want %v", run, step, what, got, want)
				}
			case 1:
				what = "look up " + id
				want := ""
				if e := find(id); e != nil {
					want = e.Value.(responseHome).dial
					ref.MoveToFront(e)
				}
				if got := h.home(id); got != want {
					t.Fatalf("run %d step %d: %s: %q, want %q", run, step, what, got, want)
				}
			case 2:
				what = "forget " + id
				if e := find(id); e != nil {
					ref.Remove(e)
				}
				h.forget(id)
			case 3:
				what = "restore " + id + " at " + dial
				want := find(id) == nil && ref.Len() < limit
				if want {
					ref.PushBack(responseHome{id: id, dial: dial})
				}
				if got := h.restore(id, dial); got != want {
					t.Fatalf("run %d step %d: %s: restored %v, want %v", run, step, what, got, want)
				}
			}
			var want []responseHome
			for e := ref.Front(); e != nil; e = e.Next() {
				want = append(want, e.Value.(responseHome))
			}
			if got := h.newestFirst(); !slices.Equal(got, want) {
				t.Fatalf("run %d step %d: after %s: homes %v, want %v", run, step, what, got, want)
			}
			if len(h.byID) != len(want) {
				t.Fatalf("run %d step %d: after %s: %d ids indexed, want %d", run, step, what, len(h.byID), len(want))
			}
			if err := h.check(); err != nil {
				t.Fatalf("run %d step %d: after %s: %v", run, step, what, err)
			}
		}
	}
}

// check reports what is wrong with h's links: each entry linked both ways
// from newest to oldest, every id indexed at its entry, the free list
// holding every other entry, emptied.
func (h *responseHomes) check() error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.byID == nil {
		return nil
	}
	linked, prev := 0, int32(-1)
	for i := h.newest; i >= 0; i = h.entries[i].next {
		if linked++; linked > len(h.entries) {
			return fmt.Errorf("the order of use loops")
		}
		e := h.entries[i]
		if e.prev != prev {
			return fmt.Errorf("entry %d links back to %d, not %d", i, e.prev, prev)
		}
		if at, ok := h.byID[e.id]; !ok || at != i {
			return fmt.Errorf("entry %d's id %q indexed at %d (%v)", i, e.id, at, ok)
		}
		prev = i
	}
	if h.oldest != prev {
		return fmt.Errorf("oldest is %d, the list ends at %d", h.oldest, prev)
	}
	if linked != len(h.byID) {
		return fmt.Errorf("%d entries linked, %d ids indexed", linked, len(h.byID))
	}
	free := 0
	for i := h.free; i >= 0; i = h.entries[i].next {
		if free++; free > len(h.entries) {
			return fmt.Errorf("the free list loops")
		}
		if e := h.entries[i]; e.id != "" || e.dial != "" {
			return fmt.Errorf("free entry %d still holds %q at %q", i, e.id, e.dial)
		}
	}
	if linked+free != len(h.entries) {
		return fmt.Errorf("%d linked and %d free of %d entries", linked, free, len(h.entries))
	}
	return nil
}
