package router

import (
	"fmt"
	"testing"
)

// TestRequestGoesHome: a request with a home goes there while it is an
// available member that is not draining, whatever the others offer (one
// holds its whole prefix, idle); otherwise it is routed as any other.
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
	for range 5 {
		d := f.Decide(t0, req, ms, &opts, rng(), nil)
		if d.Charge == nil || d.Charge.Dial() != home {
			t.Fatalf("went to %v, home %s (holder %s)", d.Charge, home, holder)
		}
		served(f, d.Charge, t0)
	}
	for _, change := range []func(m *Member){
		func(m *Member) { m.Draining = true },
		func(m *Member) { m.Available = false },
	} {
		moved := members("a", "b", "c")
		for i := range moved {
			if moved[i].Dial == home {
				change(&moved[i])
			}
		}
		d := f.Decide(t0, req, moved, &opts, rng(), nil)
		if d.Charge == nil || d.Charge.Dial() == home {
			t.Fatalf("home %s draining or down: went to %v", home, d.Charge)
		}
		served(f, d.Charge, t0)
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
	if n := len(f.homes.byID); n != MaxResponseHomes || f.homes.order.Len() != n {
		t.Fatalf("%d remembered, want %d", n, MaxResponseHomes)
	}
}
