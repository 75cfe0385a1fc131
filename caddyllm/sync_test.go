package caddyllm

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/http/httptest"
	"net/url"
	"slices"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/llmaffinity/caddy-llm-affinity/drain"
	"github.com/llmaffinity/caddy-llm-affinity/fleetsync"
	"github.com/llmaffinity/caddy-llm-affinity/internal/natstest"
	"github.com/llmaffinity/caddy-llm-affinity/router"
)

// TestSyncCountersSurviveClosing: the sync counters keep what a connection
// counted after it closes (a reload that changes the sync options): a
// Prometheus counter that goes down reads as a reset.
func TestSyncCountersSurviveClosing(t *testing.T) {
	sh, _, key := syncedShared(t, "counters-test", "counting")
	sent := func() float64 {
		for _, s := range sh.loadSyncers() {
			return float64(s.Stats().Sent)
		}
		return -1
	}
	for deadline := time.Now().Add(10 * time.Second); sent() < 1; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("nothing sent")
		}
		sh.publish(fleetsync.Message{Drain: "counted:1", Deadline: time.Second})
	}
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(newSyncCollector(sh))
	sentCounted := func() float64 {
		mfs, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		for _, mf := range mfs {
			if mf.GetName() != "caddy_llm_affinity_sync_events_total" {
				continue
			}
			for _, m := range mf.GetMetric() {
				if m.GetLabel()[0].GetValue() == "sent" {
					return m.GetCounter().GetValue()
				}
			}
		}
		return -1
	}
	before := sentCounted()
	if before < 1 {
		t.Fatalf("sent events counted before closing: %v", before)
	}
	sh.releaseSync(key) // the last reference: the connection closes
	if len(sh.loadSyncers()) != 0 {
		t.Fatal("the connection is still in use")
	}
	if after := sentCounted(); after < before {
		t.Fatalf("sent events counted after closing: %v, before %v", after, before)
	}
}

// TestReloadRetiresOnlyReplacedConnections: two sync blocks of one config
// with the same (default) name and subject, over two NATS servers, are
// both in use: neither retires the other. A reload that replaces them
// with a third retires both, once the third is connected.
func TestReloadRetiresOnlyReplacedConnections(t *testing.T) {
	ns1, ns2 := natstest.Start(t, -1), natstest.Start(t, -1)
	sh := newShared()
	defer sh.Destruct()
	type load struct{}
	first, second := context.Background(), context.WithValue(context.Background(), load{}, 2) // two config loads
	acquire := func(url string, load context.Context) *fleetsync.Syncer {
		t.Helper()
		s, key, err := sh.acquireSync(SyncConfig{URLs: []string{url}, Subject: "retire-test"}, zap.NewNop(), load)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { sh.releaseSync(key) })
		return s
	}
	a, b := acquire(ns1.ClientURL(), first), acquire(ns2.ClientURL(), first)
	if got := sh.retireReplaced(a, first); len(got) != 0 {
		t.Fatalf("a retires %d connections of its own config", len(got))
	}
	if got := sh.retireReplaced(b, first); len(got) != 0 {
		t.Fatalf("b retires %d connections of its own config", len(got))
	}
	c := acquire(ns1.ClientURL()+","+ns2.ClientURL(), second)
	if got := sh.retireReplaced(c, second); len(got) != 2 {
		t.Fatalf("the reload's connection retires %d, want a and b", len(got))
	}
	for deadline := time.Now().Add(30 * time.Second); !a.Stats().Retired || !b.Stats().Retired; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("a %+v, b %+v", a.Stats(), b.Stats())
		}
	}
	if c.Stats().Retired {
		t.Fatal("the connection in use was retired")
	}
}

// TestFleetDrainComesBackWithItsUpstream: an operator's drain heard from
// a peer holds for an upstream a reload names again after dropping it (the
// drop lifted it here; the fleet's other routers still hold it), and for
// one a config names only later; an undrain heard meanwhile ends it.
func TestFleetDrainComesBackWithItsUpstream(t *testing.T) {
	sh := newShared()
	defer close(sh.stop)
	s, err := fleetsync.New(fleetsync.Config{URLs: []string{"nats://127.0.0.1:1"}}) // never started: syncing, no peer
	if err != nil {
		t.Fatal(err)
	}
	sh.addSyncer(s)
	dial := fmt.Sprintf("fleet-drain-%d:1", time.Now().UnixNano())
	later := dial + "0"
	sh.nameUpstreams([]string{dial})
	sh.applyPeer("peer#1", fleetsync.Message{Drain: dial, Deadline: time.Minute})
	sh.applyPeer("peer#1", fleetsync.Message{Drain: later, Deadline: time.Minute}) // named nowhere yet
	if phase := sh.drains.Phase(dial); phase == drain.Active {
		t.Fatalf("the peer's drain: %v", phase)
	}
	releaseUpstreams([]string{dial}) // a reload drops it ...
	if phase := sh.drains.Phase(dial); phase != drain.Active {
		t.Fatalf("dropped: %v, want its drains lifted", phase)
	}
	sh.nameUpstreams([]string{dial, later}) // ... and the next names it again
	for _, d := range []string{dial, later} {
		if phase := sh.drains.Phase(d); phase == drain.Active || !sh.drains.HeldBy(d, drain.ByAdmin) {
			t.Errorf("%s named again: %v, want the fleet's drain", d, phase)
		}
	}
	sh.applyPeer("peer#1", fleetsync.Message{Undrain: dial})
	releaseUpstreams([]string{dial, later})
	sh.nameUpstreams([]string{dial})
	defer releaseUpstreams([]string{dial})
	if phase := sh.drains.Phase(dial); phase != drain.Active {
		t.Errorf("undrained by the peer, then named again: %v, want active", phase)
	}
}

// TestFleetDrainsOfRemovedUpstreams: a drain the fleet holds on an
// upstream no config here names any more can be undrained through this
// router's admin API (else it would come back, unliftable, with a new
// replica on that address), shows in the sync view but does not go to a
// starting router in the snapshot (an undrain this router missed would
// spread with it), keeps the newest when the record is full, and is
// forgotten with the last sync connection, after which a peer's drain
// still arriving on the closing connection is not kept.
func TestFleetDrainsOfRemovedUpstreams(t *testing.T) {
	sh := acquireShared()
	defer releaseShared()
	s, err := fleetsync.New(fleetsync.Config{URLs: []string{"nats://127.0.0.1:1"}}) // never started: syncing, no peer
	if err != nil {
		t.Fatal(err)
	}
	sh.addSyncer(s)
	d := fmt.Sprintf("removed-%d:1", time.Now().UnixNano())
	path := "/llm_affinity/upstreams/" + url.PathEscape(d) + "/drain"
	sh.nameUpstreams([]string{d})
	if err := handleDrain(httptest.NewRecorder(), httptest.NewRequest("POST", path+"?deadline=1ms", nil)); err != nil {
		t.Fatal(err)
	}
	releaseUpstreams([]string{d}) // decommissioned here
	snapshotDrains := func() []string {
		var dials []string
		for _, m := range sh.snapshotMessages() {
			if m.Drain != "" {
				dials = append(dials, m.Drain)
			}
		}
		return dials
	}
	if got := snapshotDrains(); slices.Contains(got, d) {
		t.Errorf("a starting router's snapshot has the drain of %s, which this router does not route to: %v", d, got)
	}
	if got := sh.syncView(time.Now()).FleetDrains; !slices.Contains(got, d) {
		t.Errorf("the sync view lacks the fleet's drain of %s: %v", d, got)
	}
	if err := handleDrain(httptest.NewRecorder(), httptest.NewRequest("DELETE", path, nil)); err != nil {
		t.Fatalf("undrain of a removed upstream the fleet holds: %v", err)
	}
	sh.nameUpstreams([]string{d}) // a new replica on that address
	if phase := sh.drains.Phase(d); phase != drain.Active {
		t.Errorf("undrained, then named again: %v", phase)
	}
	releaseUpstreams([]string{d})

	// Full: the drain whose deadline passed longest ago makes room.
	for i := range maxFleetDrains {
		sh.applyPeer("peer#1", fleetsync.Message{Drain: fmt.Sprintf("old-%d:1", i), Deadline: time.Duration(i) * time.Millisecond})
	}
	sh.applyPeer("peer#1", fleetsync.Message{Drain: d, Deadline: time.Minute})
	if !sh.heldByFleet(d) || sh.heldByFleet("old-0:1") || !sh.heldByFleet("old-1:1") {
		t.Errorf("full record: the new drain %v, the oldest %v, the next %v", sh.heldByFleet(d), sh.heldByFleet("old-0:1"), sh.heldByFleet("old-1:1"))
	}
	sh.removeSyncer(s)
	if sh.heldByFleet(d) {
		t.Error("the last sync connection gone, the fleet's drains are still held")
	}
	sh.applyPeer("peer#1", fleetsync.Message{Drain: "late:1", Deadline: time.Minute}) // the closing connection's last batch
	if sh.heldByFleet("late:1") {
		t.Error("no sync connection left, yet a peer's late drain is kept")
	}
}

// TestPublisherFollowsTheSyncers: the fleet has a publisher while a sync
// connection is in use, and only then: a stored response's home reaches
// the connection of the config loaded, across a reload that replaces it
// (the new config acquired before the old one is released, as Caddy
// provisions and cleans up), and again once another comes after the last
// was gone.
func TestPublisherFollowsTheSyncers(t *testing.T) {
	ns := natstest.Start(t, -1)
	sh := newShared()
	defer sh.Destruct()
	acquire := func(subject string) (*fleetsync.Syncer, string) {
		t.Helper()
		s, key, err := sh.acquireSync(SyncConfig{URLs: []string{ns.ClientURL()}, Subject: subject}, zap.NewNop(), nil)
		if err != nil {
			t.Fatal(err)
		}
		return s, key
	}
	n := 0
	remember := func() {
		n++
		sh.fleet.RememberResponse(fmt.Sprintf("resp_%d", n), "up:1")
	}
	// published remembers a new response's home and waits until s has
	// counted it: sent, or dropped while it connects.
	published := func(s *fleetsync.Syncer) {
		t.Helper()
		counted := func() uint64 { st := s.Stats(); return st.Sent + st.Dropped }
		before := counted()
		remember()
		for deadline := time.Now().Add(10 * time.Second); counted() == before; time.Sleep(5 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("response %d's home not published to %s", n, s.Stats().Subject)
			}
		}
	}
	remember() // no sync: nothing to publish to
	a, keyA := acquire("publisher-a")
	published(a)
	b, keyB := acquire("publisher-b") // a reload: the new config first
	sh.releaseSync(keyA)              // then the old one's cleanup
	published(b)
	sh.releaseSync(keyB)
	remember()
	c, keyC := acquire("publisher-c")
	defer sh.releaseSync(keyC)
	published(c)
}

// TestPeerWithOtherBlockSizeWarned: a peer whose routed requests were
// hashed in blocks of another size than this router's never shares a
// prefix with it; its first such request is warned of, once for the size,
// where before the loss of affinity across the two was silent. A peer of
// the same size, or one heard before this router routed anything, is not.
func TestPeerWithOtherBlockSizeWarned(t *testing.T) {
	sh := newShared()
	defer sh.Destruct()
	core, logs := observer.New(zapcore.WarnLevel)
	sh.logger = zap.New(core)
	dial := "blocks:1"
	sh.fleet.Name(dial, time.Now())
	routed := func(id uint64, blockTokens int) fleetsync.Message {
		return fleetsync.Message{Event: &router.Event{Kind: router.EventRouted, ID: id, Dial: dial, Hashes: []uint64{1, 2}, BlockTokens: blockTokens, Prefill: 64, Decode: 16, KV: 80}}
	}
	sh.applyPeer("early#1", routed(1, 32)) // nothing routed here yet: nothing to compare
	opts := router.Options{}.WithDefaults()
	members := []router.Member{{Dial: dial, Available: true, Healthy: true}}
	sh.fleet.Decide(time.Now(), router.Request{Hashes: []uint64{7}, BlockTokens: 16, PromptTokens: 16}, members, &opts, rand.New(rand.NewPCG(1, 2)), nil)
	sh.applyPeer("same#1", routed(2, 16))
	sh.applyPeer("other#1", routed(3, 32))
	sh.applyPeer("other#1", routed(4, 32))
	warned := logs.FilterMessageSnippet("blocks of another size")
	if warned.Len() != 1 || warned.All()[0].ContextMap()["peer_block_tokens"] != int64(32) || warned.All()[0].ContextMap()["peer"] != "other#1" {
		t.Fatalf("warnings: %v, want one for other#1's blocks of 32 tokens", logs.All())
	}
}

// TestPeersGoWithTheLastConnection: when the last sync connection closes
// (a reload that removes sync), the peers' charges go with it, since no
// release of theirs can arrive any more; they stayed, counted as queued
// work, until the peers were silent for peerSilence.
func TestPeersGoWithTheLastConnection(t *testing.T) {
	sh, _, key := syncedShared(t, "peers-go-test", "leaving")
	now := time.Now()
	sh.fleet.Name("engine:1", now)
	if !sh.fleet.Apply("peer", router.Event{Kind: router.EventRouted, ID: 1, Dial: "engine:1", Prefill: 1000, Decode: 10, KV: 1010}, now) {
		t.Fatal("the peer's charge was not applied")
	}
	if n := inFlightOn(sh.fleet, "engine:1"); n != 1 {
		t.Fatalf("in flight with the peer's charge: %d", n)
	}
	sh.releaseSync(key) // the last reference: the connection closes
	if peers, n := sh.fleet.Peers(), inFlightOn(sh.fleet, "engine:1"); len(peers) != 0 || n != 0 {
		t.Fatalf("after the last connection closed: peers %+v, in flight %d", peers, n)
	}
}

// TestPeersGoWithTheLastConnectionClosed: a batch the connection applies
// after removeSyncer dropped the peers (it reads until Close) leaves no
// peer charge once the connection has closed: the peer it named stayed,
// its charge counted as queued work, until it went silent.
func TestPeersGoWithTheLastConnectionClosed(t *testing.T) {
	sh, s, key := syncedShared(t, "peers-closed-test", "leaving")
	defer sh.releaseSync(key)
	now := time.Now()
	sh.fleet.Name("engine:1", now)
	// The order of syncEntry.Destruct, with a peer's batch applied between
	// removeSyncer and Close.
	sh.removeSyncer(s)
	sh.applyPeer("peer", fleetsync.Message{Event: &router.Event{Kind: router.EventRouted, ID: 1, Dial: "engine:1", Prefill: 1000, Decode: 10, KV: 1010}})
	s.Close()
	sh.closedSyncer(s)
	if peers := sh.fleet.Peers(); len(peers) != 0 {
		t.Fatalf("after the last connection closed: peers %+v", peers)
	}
	if n := inFlightOn(sh.fleet, "engine:1"); n != 0 {
		t.Fatalf("after the last connection closed: %d in flight at engine:1", n)
	}
}

// syncedShared returns a shared host (destroyed when t ends) with one sync
// connection, to a NATS server of its own, on subject under name, and the
// connection's pool key for releaseSync.
func syncedShared(t *testing.T, subject, name string) (*shared, *fleetsync.Syncer, string) {
	t.Helper()
	ns := natstest.Start(t, -1)
	sh := newShared()
	t.Cleanup(func() { sh.Destruct() })
	s, key, err := sh.acquireSync(SyncConfig{URLs: []string{ns.ClientURL()}, Subject: subject, Name: name}, zap.NewNop(), nil)
	if err != nil {
		t.Fatal(err)
	}
	return sh, s, key
}

// inFlightOn is the requests f counts in flight on dial, -1 when it does
// not know dial.
func inFlightOn(f *router.Fleet, dial string) int {
	for _, u := range f.Snapshot(time.Now()) {
		if u.Dial == dial {
			return u.InFlight
		}
	}
	return -1
}
