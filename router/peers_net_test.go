package router

import (
	"slices"
	"testing"
	"time"
)

// peerNet is n routers sharing "x", each receiver with its own FIFO queue.
type peerNet struct {
	fleets []*Fleet
	names  []string
	q      [][]histQueued
}

func newPeerNet(n int) *peerNet {
	w := &peerNet{q: make([][]histQueued, n)}
	for i := range n {
		f := New()
		f.Name("x", t0)
		f.KeepLive(true)
		w.names = append(w.names, string(rune('a'+i)))
		f.SetPublisher(func(ev Event) {
			ev.Hashes = slices.Clone(ev.Hashes)
			w.send(i, ev)
		})
		w.fleets = append(w.fleets, f)
	}
	return w
}

func (w *peerNet) send(i int, ev Event) {
	for j := range w.fleets {
		if j != i {
			w.q[j] = append(w.q[j], histQueued{from: i, peer: w.names[i], ev: ev})
		}
	}
}

// deliver hands receiver j its next n events (all for n < 0).
func (w *peerNet) deliver(j, n int) {
	for ; n != 0 && len(w.q[j]) > 0; n-- {
		e := w.q[j][0]
		w.q[j] = w.q[j][1:]
		if e.drop != "" {
			w.fleets[j].DropPeer(e.drop, t0)
			continue
		}
		w.fleets[j].Apply(e.peer, e.ev, t0)
	}
}

func (w *peerNet) deliverAll() {
	for busy := true; busy; {
		busy = false
		for j := range w.fleets {
			busy = busy || len(w.q[j]) > 0
			w.deliver(j, -1)
		}
	}
}

// rename is fleetsync's renewal: the peers drop the old name, then hear
// the restatement under the new one.
func (w *peerNet) rename(i int, name string) {
	for j := range w.fleets {
		if j != i {
			w.q[j] = append(w.q[j], histQueued{drop: w.names[i]})
		}
	}
	w.names[i] = name
	for _, ev := range w.fleets[i].LiveEvents() {
		w.send(i, ev)
	}
}

// TestRenamedPeersForgetFromTheRoot: a renamed router's request fails.
// The peers' copy of its charge was dropped with the old name and
// restated without hashes, so they do not know how deep their indexes
// held its chain when its routing came: they forget from the root, not
// from the sender's depth, which can be deeper than theirs.
func TestRenamedPeersForgetFromTheRoot(t *testing.T) {
	opts := Options{}.WithDefaults()
	ms := members("x")
	w := newPeerNet(2)
	a, b := w.fleets[0], w.fleets[1]
	p := a.Decide(t0, sharedTurn(100), ms, &opts, rng(), nil)
	a.Release(p.Charge, t0)                                   // 503: a forgets, Forgot+Released queued for b
	w.deliver(1, 1)                                           // b hears only the routing so far
	q := b.Decide(t0, sharedTurn(100), ms, &opts, rng(), nil) // warm at b: held 32
	w.rename(1, "b#2")                                        // b lost an event elsewhere and renews
	b.Release(q.Charge, t0)                                   // 503 too: Forgot{From: 32}
	w.deliverAll()
	for i, f := range w.fleets {
		if got := quietMatch(t, f, sharedTurn(100)); got != 0 {
			t.Errorf("router %s matches %d tokens no engine prefilled", w.names[i], got)
		}
	}
}

// TestPrefilledBeforeARestartIsIgnored: router a sees an engine restart
// before router c. A request that fails in between (a restarting engine
// answers 503) makes c protect its prefill of before the restart and
// publish it; a, which cleared its index, ignores it: it was prefilled
// before a saw the restart.
func TestPrefilledBeforeARestartIsIgnored(t *testing.T) {
	opts := Options{}.WithDefaults()
	ms := members("x")
	w := newPeerNet(3)
	a, b, c := w.fleets[0], w.fleets[1], w.fleets[2]
	p := c.Decide(t0, sharedTurn(100), ms, &opts, rng(), nil)
	c.Progress(p.Charge, 1, t0) // prefilled, still streaming
	w.deliverAll()
	a.EngineRestarted("x", t0.Add(time.Second)) // a's scrape sees the restart first
	q := b.Decide(t0, sharedTurn(200), ms, &opts, rng(), nil)
	b.Release(q.Charge, t0) // 503 from the restarting engine
	w.deliverAll()          // c protects P's system prompt: Prefilled
	b.EngineRestarted("x", t0.Add(2*time.Second))
	c.EngineRestarted("x", t0.Add(2*time.Second))
	w.deliverAll()
	for i, f := range w.fleets {
		if got := quietMatch(t, f, sharedTurn(300)); got != 0 {
			t.Errorf("router %s matches %d tokens at an engine that restarted and prefilled nothing since", w.names[i], got)
		}
	}
}
