package fleetsync

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/llmaffinity/caddy-llm-affinity/internal/natstest"
	"github.com/llmaffinity/caddy-llm-affinity/router"
)

// startNATS runs a real NATS server in-process on port (-1: any free
// port); it stops with the test.
func startNATS(t testing.TB, port int) *server.Server { return natstest.Start(t, port) }

func sampleBatch() *Batch {
	return &Batch{Sender: "router-1", Epoch: 42, Instance: 9, Messages: []Message{
		{Event: &router.Event{Kind: router.EventRouted, ID: 7, Dial: "10.0.0.1:8000", Hashes: []uint64{1, 1 << 63, 12345},
			BlockTokens: 64, Prefill: 1000, Decode: 256, KV: 1256, Adapter: "tenant-a"}},
		{Event: &router.Event{Kind: router.EventProgressed, ID: 7, Tokens: 12}},
		{Event: &router.Event{Kind: router.EventCompleted, ID: 7, Model: "m", Tokens: 200, PromptBytes: 4100, PromptTokens: 1000}},
		{Event: &router.Event{Kind: router.EventReleased, ID: 8}},
		{Drain: "10.0.0.2:8000", Deadline: 30 * time.Second},
		{Undrain: "10.0.0.2:8000"},
	}}
}

func TestCodecRoundTrip(t *testing.T) {
	b := sampleBatch()
	p := AppendBatch(nil, b)
	got, err := DecodeBatch(p)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, b) {
		t.Fatalf("round trip:\n got %+v\nwant %+v", got, b)
	}
	// Every truncation is an error, never a panic or a partial batch.
	for i := range p {
		if b, err := DecodeBatch(p[:i]); err == nil {
			t.Fatalf("truncated at %d decoded: %+v", i, b)
		}
	}
	if _, err := DecodeBatch(append(p, 0)); err == nil {
		t.Fatal("trailing bytes accepted")
	}
}

// TestCodecReadsVersion2: a batch of a router one version older (a
// completion without prompt bytes and tokens) decodes, so a rolling
// upgrade keeps the view shared as far as the older router can read.
func TestCodecReadsVersion2(t *testing.T) {
	v2 := []byte{2}
	v2 = appendString(v2, "old-router")
	v2 = append(v2, 5, 6, 2) // epoch, instance, two messages
	v2 = append(v2, byte(router.EventCompleted), 7)
	v2 = appendString(v2, "m")
	v2 = append(v2, 100)                           // tokens
	v2 = append(v2, byte(router.EventReleased), 8) // then a release
	want := &Batch{Sender: "old-router", Epoch: 5, Instance: 6, Messages: []Message{
		{Event: &router.Event{Kind: router.EventCompleted, ID: 7, Model: "m", Tokens: 100}},
		{Event: &router.Event{Kind: router.EventReleased, ID: 8}},
	}}
	got, err := DecodeBatch(v2)
	if err != nil || !reflect.DeepEqual(got, want) {
		t.Fatalf("version 2 batch: %+v, %v", got, err)
	}
	if _, err := DecodeBatch(append([]byte{1}, v2[1:]...)); err == nil {
		t.Fatal("version 1 accepted")
	}
}

// storedBatch is a batch of the Responses API's stored responses.
func storedBatch() *Batch {
	return &Batch{Sender: "router-1", Epoch: 42, Instance: 9, Messages: []Message{
		{Event: &router.Event{Kind: router.EventStored, Dial: "10.0.0.1:8000", Response: "resp_0123456789abcdef"}},
		{Event: &router.Event{Kind: router.EventStored, Dial: "10.0.0.2:8000", Response: "resp_fedcba9876543210"}},
	}}
}

// TestCodecStoredResponses: a batch that carries a stored response is
// version 4 and round-trips; one without stays version 3, which routers
// of the version before read; a stored response in a version 3 batch, or
// without its dial or id, is malformed.
func TestCodecStoredResponses(t *testing.T) {
	p := AppendBatch(nil, storedBatch())
	if p[0] != 4 {
		t.Fatalf("a batch of stored responses is version %d, want 4", p[0])
	}
	got, err := DecodeBatch(p)
	if err != nil || !reflect.DeepEqual(got, storedBatch()) {
		t.Fatalf("round trip: %+v, %v", got, err)
	}
	for i := range p {
		if b, err := DecodeBatch(p[:i]); err == nil {
			t.Fatalf("truncated at %d decoded: %+v", i, b)
		}
	}
	if v := AppendBatch(nil, sampleBatch())[0]; v != 3 {
		t.Fatalf("a batch of charges and drains is version %d, want 3", v)
	}
	v3 := append([]byte{3}, p[1:]...)
	if _, err := DecodeBatch(v3); err == nil {
		t.Fatal("a stored response in a version 3 batch decoded")
	}
	for _, ev := range []router.Event{
		{Kind: router.EventStored, Dial: "", Response: "resp_1"},
		{Kind: router.EventStored, Dial: "10.0.0.1:8000", Response: ""},
	} {
		b := &Batch{Sender: "r", Messages: []Message{{Event: &ev}}}
		if _, err := DecodeBatch(AppendBatch(nil, b)); err == nil {
			t.Fatalf("%+v decoded", ev)
		}
	}
	if _, err := DecodeBatch(append([]byte{wireVersion + 1}, p[1:]...)); err == nil {
		t.Fatalf("version %d accepted", wireVersion+1)
	}
}

func indexBatch() *Batch {
	return &Batch{Sender: "router-1", Epoch: 42, Instance: 9, Messages: []Message{
		{Event: &router.Event{Kind: router.EventForgot, ID: 7, Dial: "10.0.0.1:8000", From: 16, Hashes: []uint64{5, 1 << 63}}},
		{Event: &router.Event{Kind: router.EventPrefilled, ID: 8, Dial: "10.0.0.1:8000", Hashes: []uint64{1, 2, 3}, At: time.Unix(0, 1796180000123456789)}},
		{Event: &router.Event{Kind: router.EventPrefilled, ID: 9, Dial: "10.0.0.1:8000", Hashes: []uint64{4}}},
	}}
}

// TestCodecIndexChanges: a batch of forgotten and prefilled blocks is
// version 7 and round-trips; such blocks in an older version, or without
// a dial, are malformed.
func TestCodecIndexChanges(t *testing.T) {
	p := AppendBatch(nil, indexBatch())
	if p[0] != 7 {
		t.Fatalf("a batch of index changes is version %d, want 7", p[0])
	}
	got, err := DecodeBatch(p)
	if err != nil || !reflect.DeepEqual(got, indexBatch()) {
		t.Fatalf("round trip: %+v, %v", got, err)
	}
	for i := range p {
		if b, err := DecodeBatch(p[:i]); err == nil {
			t.Fatalf("truncated at %d decoded: %+v", i, b)
		}
	}
	if _, err := DecodeBatch(append([]byte{6}, p[1:]...)); err == nil {
		t.Fatal("index changes in a version 6 batch decoded")
	}
	for _, kind := range []router.EventKind{router.EventForgot, router.EventPrefilled} {
		b := &Batch{Sender: "r", Messages: []Message{{Event: &router.Event{Kind: kind, Hashes: []uint64{1}}}}}
		if _, err := DecodeBatch(AppendBatch(nil, b)); err == nil {
			t.Fatalf("kind %d without a dial decoded", kind)
		}
	}
}

func cachedBatch() *Batch {
	return &Batch{Sender: "router-1", Epoch: 42, Instance: 9, Messages: []Message{
		{Event: &router.Event{Kind: router.EventCached, Dial: "10.0.0.1:8000", BlockTokens: 16, KV: 1 << 20, Hashes: []uint64{3, 2, 1}}},
		{Event: &router.Event{Kind: router.EventCached, Dial: "10.0.0.1:8000", Adapter: "sql-lora", Hashes: []uint64{}}},
		{Event: &router.Event{Kind: router.EventStored, Dial: "10.0.0.2:8000", Response: "resp_1"}},
		{Drain: "10.0.0.3:8000", Deadline: time.Minute},
	}}
}

// TestCodecCachedBlocks: a snapshot's batch, which carries cached blocks,
// is version 6 and round-trips; cached blocks in an older version, or
// without a dial, are malformed.
func TestCodecCachedBlocks(t *testing.T) {
	p := AppendBatch(nil, cachedBatch())
	if p[0] != 6 {
		t.Fatalf("a batch of cached blocks is version %d, want 6", p[0])
	}
	got, err := DecodeBatch(p)
	if err != nil || !reflect.DeepEqual(got, cachedBatch()) {
		t.Fatalf("round trip: %+v, %v", got, err)
	}
	for i := range p {
		if b, err := DecodeBatch(p[:i]); err == nil {
			t.Fatalf("truncated at %d decoded: %+v", i, b)
		}
	}
	if _, err := DecodeBatch(append([]byte{4}, p[1:]...)); err == nil {
		t.Fatal("cached blocks in a version 4 batch decoded")
	}
	// Version 5 (this snapshot's first form) had no adapter: its parts
	// still decode, from a router of that version in a rolling upgrade.
	v5 := []byte{5}
	v5 = appendString(v5, "router-1")
	v5 = binary.AppendUvarint(v5, 42)
	v5 = binary.AppendUvarint(v5, 9)
	v5 = binary.AppendUvarint(v5, 1)
	v5 = append(v5, byte(router.EventCached), 0)
	v5 = appendString(v5, "10.0.0.1:8000")
	v5 = binary.AppendUvarint(v5, 16)
	v5 = binary.AppendUvarint(v5, 1<<20)
	v5 = appendHashes(v5, []uint64{3, 2, 1})
	b5, err := DecodeBatch(v5)
	if err != nil || len(b5.Messages) != 1 || !reflect.DeepEqual(b5.Messages[0].Event.Hashes, []uint64{3, 2, 1}) || b5.Messages[0].Event.KV != 1<<20 {
		t.Fatalf("a version 5 part: %+v, %v", b5, err)
	}
	b := &Batch{Sender: "r", Messages: []Message{{Event: &router.Event{Kind: router.EventCached, Hashes: []uint64{1}}}}}
	if _, err := DecodeBatch(AppendBatch(nil, b)); err == nil {
		t.Fatal("cached blocks without a dial decoded")
	}
}

func FuzzDecodeBatch(f *testing.F) {
	f.Add(AppendBatch(nil, sampleBatch()))
	f.Add(AppendBatch(nil, storedBatch()))
	f.Add(AppendBatch(nil, cachedBatch()))
	f.Add(AppendBatch(nil, indexBatch()))
	f.Add([]byte{wireVersion, 0, 0, 0})
	f.Add([]byte{wireVersion, 1, 'a', 1, 1, 1, 1, 0xff, 0xff, 0xff, 0xff, 0x0f})
	f.Fuzz(func(t *testing.T, p []byte) {
		b, err := DecodeBatch(p)
		if err != nil {
			return
		}
		// What decodes re-encodes to a batch that decodes the same.
		again, err := DecodeBatch(AppendBatch(nil, b))
		if err != nil || !reflect.DeepEqual(again, b) {
			t.Fatalf("re-encoding %+v: %+v, %v", b, again, err)
		}
	})
}

// received collects what a syncer's peers said.
type received struct {
	mu    sync.Mutex
	msgs  []Message
	peers map[string]bool
}

func (r *received) config(c Config) Config {
	r.peers = map[string]bool{}
	c.OnMessage = func(peer string, m Message) {
		r.mu.Lock()
		defer r.mu.Unlock()
		r.msgs = append(r.msgs, m)
	}
	c.OnHeard = func(peer string) {
		r.mu.Lock()
		defer r.mu.Unlock()
		r.peers[peer] = true
	}
	return c
}

func (r *received) count() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.msgs)
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	// Generous: a busy machine (or -race) slows pings and reconnections;
	// the wait ends as soon as cond holds.
	deadline := time.Now().Add(60 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func startSyncer(t *testing.T, c Config) *Syncer {
	t.Helper()
	s, err := New(c)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	return s
}

// TestPeersExchangeThroughNATS: what one router publishes the other
// receives, in order, with hashes intact; a router never hears itself.
func TestPeersExchangeThroughNATS(t *testing.T) {
	ns := startNATS(t, -1)
	var ra, rb received
	a := startSyncer(t, ra.config(Config{URLs: []string{ns.ClientURL()}, Name: "a", Subject: "test.exchange"}))
	b := startSyncer(t, rb.config(Config{URLs: []string{ns.ClientURL()}, Name: "b", Subject: "test.exchange"}))
	waitFor(t, "both connected", func() bool { return a.Stats().Connected && b.Stats().Connected })
	// NATS delivers to subscriptions registered when the message is
	// published: b hears a's heartbeats once its subscription is live.
	waitFor(t, "b hearing a", func() bool { rb.mu.Lock(); defer rb.mu.Unlock(); return rb.peers[a.Name()] })
	for _, m := range sampleBatch().Messages {
		if !a.Publish(m) {
			t.Fatal("publish dropped on an idle queue")
		}
	}
	waitFor(t, "b receiving a's messages", func() bool { return rb.count() == len(sampleBatch().Messages) })
	rb.mu.Lock()
	got := rb.msgs
	rb.mu.Unlock()
	if !reflect.DeepEqual(got, sampleBatch().Messages) {
		t.Fatalf("b got %+v", got)
	}
	if ra.count() != 0 {
		t.Fatalf("a heard its own %d messages", ra.count())
	}
	if st := a.Stats(); st.Sent != uint64(len(got)) || st.Dropped != 0 {
		t.Fatalf("a's stats %+v", st)
	}
	if st := b.Stats(); st.Applied != uint64(len(got)) || st.LastReceived.IsZero() {
		t.Fatalf("b's stats %+v", st)
	}
}

// spyOn subscribes to subject at url, as a peer would, and returns what
// has been published there so far.
func spyOn(t *testing.T, url, subject string) func() []*nats.Msg {
	t.Helper()
	spy, err := nats.Connect(url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(spy.Close)
	var mu sync.Mutex
	var seen []*nats.Msg
	if _, err := spy.Subscribe(subject, func(m *nats.Msg) {
		mu.Lock()
		defer mu.Unlock()
		seen = append(seen, m)
	}); err != nil {
		t.Fatal(err)
	}
	if err := spy.Flush(); err != nil {
		t.Fatal(err)
	}
	return func() []*nats.Msg {
		mu.Lock()
		defer mu.Unlock()
		return slices.Clone(seen)
	}
}

// TestStoredResponsesTravelApart: stored responses published among
// charges reach the peer, and travel in batches of their own: every
// batch on the wire that carries a charge is version 3, which a router of
// the version before reads whole.
func TestStoredResponsesTravelApart(t *testing.T) {
	ns := startNATS(t, -1)
	wire := spyOn(t, ns.ClientURL(), "test.stored")
	var ra, rb received
	a := startSyncer(t, ra.config(Config{URLs: []string{ns.ClientURL()}, Name: "a", Subject: "test.stored"}))
	startSyncer(t, rb.config(Config{URLs: []string{ns.ClientURL()}, Name: "b", Subject: "test.stored"}))
	waitFor(t, "b hearing a", func() bool { rb.mu.Lock(); defer rb.mu.Unlock(); return rb.peers[a.Name()] })
	var charges, stored []Message
	for round := range 20 {
		for _, m := range sampleBatch().Messages {
			if m.Event != nil {
				m.Event.ID += uint64(100 * round) // progress of one charge would merge
			}
			charges = append(charges, m)
			a.Publish(m)
		}
		m := Message{Event: &router.Event{Kind: router.EventStored, Dial: "10.0.0.1:8000", Response: fmt.Sprint("resp_", round)}}
		stored = append(stored, m)
		a.Publish(m)
	}
	waitFor(t, "b receiving everything", func() bool { return rb.count() == len(charges)+len(stored) })
	var gotCharges, gotStored []Message
	rb.mu.Lock()
	for _, m := range rb.msgs {
		if m.Event != nil && m.Event.Kind == router.EventStored {
			gotStored = append(gotStored, m)
		} else {
			gotCharges = append(gotCharges, m)
		}
	}
	rb.mu.Unlock()
	if !reflect.DeepEqual(gotCharges, charges) || !reflect.DeepEqual(gotStored, stored) {
		t.Fatalf("b got charges %+v\nand stored %+v", gotCharges, gotStored)
	}
	for _, m := range wire() {
		p := m.Data
		batch, err := DecodeBatch(p)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range batch.Messages {
			if isStored := m.Event != nil && m.Event.Kind == router.EventStored; isStored != (p[0] == 4) {
				t.Fatalf("a version %d batch carries %+v", p[0], m.Event)
			}
		}
	}
}

// TestNATSOutageNeverBlocks: with the server gone, publishing neither
// blocks nor errors (it drops and counts); when the server is back on its
// address the peers exchange again.
func TestNATSOutageNeverBlocks(t *testing.T) {
	ns := startNATS(t, -1)
	port := ns.Addr().(*net.TCPAddr).Port
	url := ns.ClientURL()
	var rb received
	a := startSyncer(t, Config{URLs: []string{url}, Name: "a", Subject: "test.outage", QueueLength: 16})
	b := startSyncer(t, rb.config(Config{URLs: []string{url}, Name: "b", Subject: "test.outage"}))
	waitFor(t, "b hearing a", func() bool { rb.mu.Lock(); defer rb.mu.Unlock(); return rb.peers[a.Name()] })

	ns.Shutdown()
	waitFor(t, "a noticing the loss", func() bool { return !a.Stats().Connected })
	ev := &router.Event{Kind: router.EventReleased, ID: 1}
	for range 1000 {
		a.Publish(Message{Event: ev}) // returns at once whatever happens
	}
	waitFor(t, "the outage's events dropped", func() bool { return a.Stats().Dropped > 0 })
	if a.Stats().Disconnects == 0 {
		t.Fatal("the loss was not counted")
	}

	startNATS(t, port) // the same address
	waitFor(t, "a and b reconnected", func() bool { return a.Stats().Connected && b.Stats().Connected })
	before := rb.count()
	waitFor(t, "b receiving a's events again", func() bool {
		a.Publish(Message{Undrain: "x:1"})
		time.Sleep(20 * time.Millisecond)
		return rb.count() > before
	})
}

// TestCloseWithoutNATS: closing a syncer whose server is gone returns at
// once (a Caddy reload or shutdown must not wait on NATS).
func TestCloseWithoutNATS(t *testing.T) {
	ns := startNATS(t, -1)
	s, err := New(Config{URLs: []string{ns.ClientURL()}, Name: "a"})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Start(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "connected", func() bool { return s.Stats().Connected })
	ns.Shutdown()
	waitFor(t, "the loss noticed", func() bool { return !s.Stats().Connected })
	s.Publish(Message{Undrain: "x:1"})
	closed := make(chan struct{})
	go func() { s.Close(); close(closed) }()
	select {
	case <-closed:
	case <-time.After(5 * time.Second): // nats.go's own flush timeout is 10 s
		t.Fatal("Close waited on the unreachable server")
	}
}

// TestLongPromptsNeverLoseReleases: a burst of routed events with long
// hash lists is cut into publications NATS accepts, so the releases queued
// among them all arrive.
func TestLongPromptsNeverLoseReleases(t *testing.T) {
	ns := startNATS(t, -1)
	var releases, routed atomic.Int64
	b := startSyncer(t, Config{URLs: []string{ns.ClientURL()}, Name: "b", Subject: "test.big",
		OnMessage: func(_ string, m Message) {
			switch {
			case m.Event == nil:
			case m.Event.Kind == router.EventReleased:
				releases.Add(1)
			case m.Event.Kind == router.EventRouted && len(m.Event.Hashes) == MaxEventHashes:
				routed.Add(1)
			}
		}})
	waitFor(t, "b connected", func() bool { return b.Stats().Connected })
	waitFor(t, "b's connection handed over", func() bool { return b.conn() != nil })
	b.conn().Flush() // b's subscription is registered with the server
	a, err := New(Config{URLs: []string{ns.ClientURL()}, Name: "a", Subject: "test.big"})
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(a.Close)
	waitFor(t, "a publishing", a.live.Load)
	hashes := make([]uint64, 3*MaxEventHashes) // capped to MaxEventHashes on the wire
	for i := range 200 {                       // faster than they are published: they batch
		a.Publish(Message{Event: &router.Event{Kind: router.EventRouted, ID: uint64(i), Dial: "x:1", Hashes: hashes}})
		a.Publish(Message{Event: &router.Event{Kind: router.EventReleased, ID: uint64(i)}})
	}
	waitFor(t, "every release delivered", func() bool { return releases.Load() == 200 && routed.Load() == 200 })
	if st := a.Stats(); st.Dropped != 0 {
		t.Fatalf("dropped %d", st.Dropped)
	}
}

// TestOneRoutersConnectionsIgnoreEachOther: two connections of one router
// (two sync configurations in one process) never apply each other's
// batches, whatever their names; another router's they do.
func TestOneRoutersConnectionsIgnoreEachOther(t *testing.T) {
	ns := startNATS(t, -1)
	var r1, r2, other received
	c1 := startSyncer(t, r1.config(Config{URLs: []string{ns.ClientURL()}, Subject: "test.echo", Instance: 7}))
	c2 := startSyncer(t, r2.config(Config{URLs: []string{ns.ClientURL()}, Name: "gw-1", Subject: "test.echo", Instance: 7}))
	o := startSyncer(t, other.config(Config{URLs: []string{ns.ClientURL()}, Name: "other", Subject: "test.echo"}))
	waitFor(t, "the other router hearing both connections", func() bool {
		other.mu.Lock()
		defer other.mu.Unlock()
		return other.peers[c1.Name()] && other.peers[c2.Name()]
	})
	waitFor(t, "both connections hearing the other router", func() bool {
		r1.mu.Lock()
		h1 := r1.peers[o.Name()]
		r1.mu.Unlock()
		r2.mu.Lock()
		defer r2.mu.Unlock()
		return h1 && r2.peers[o.Name()]
	})
	r1.mu.Lock()
	defer r1.mu.Unlock()
	r2.mu.Lock()
	defer r2.mu.Unlock()
	if r1.peers[c2.Name()] || r2.peers[c1.Name()] {
		t.Fatal("one router's connections heard each other")
	}
}

// stallingLink is a TCP path to a NATS server that can stall: once
// stalled it stops carrying bytes either way and stops reading, as a
// network path that silently drops packets does, with both ends'
// connections left open; it carries no later connection either. freeze
// stops only the connections carried so far (a frozen server: nothing
// answers, nothing closes); later ones are carried again.
type stallingLink struct {
	ln      net.Listener
	stalled chan struct{}
	once    sync.Once
	mu      sync.Mutex
	frozen  chan struct{} // of the connections carried so far
}

func newStallingLink(t *testing.T, target string) *stallingLink {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	l := &stallingLink{ln: ln, stalled: make(chan struct{}), frozen: make(chan struct{})}
	var conns []net.Conn
	t.Cleanup(func() {
		l.ln.Close()
		l.mu.Lock()
		defer l.mu.Unlock()
		for _, c := range conns {
			c.Close()
		}
	})
	go func() {
		for {
			client, err := ln.Accept()
			if err != nil {
				return
			}
			server, err := net.Dial("tcp", target)
			if err != nil {
				client.Close()
				continue
			}
			l.mu.Lock()
			conns = append(conns, client, server)
			frozen := l.frozen
			l.mu.Unlock()
			go l.carry(client, server, frozen)
			go l.carry(server, client, frozen)
		}
	}()
	return l
}

// carry copies from src to dst until the link stalls or this connection
// freezes, then reads no more.
func (l *stallingLink) carry(src, dst net.Conn, frozen chan struct{}) {
	stopped := func() bool {
		select {
		case <-l.stalled:
			return true
		case <-frozen:
			return true
		default:
			return false
		}
	}
	buf := make([]byte, 32<<10)
	for !stopped() {
		n, err := src.Read(buf)
		if err != nil || stopped() {
			return // what was read is swallowed
		}
		if _, err := dst.Write(buf[:n]); err != nil {
			return
		}
	}
}

func (l *stallingLink) url() string { return "nats://" + l.ln.Addr().String() }

func (l *stallingLink) stall() { l.once.Do(func() { close(l.stalled) }) }

func (l *stallingLink) freeze() {
	l.mu.Lock()
	defer l.mu.Unlock()
	close(l.frozen)
	l.frozen = make(chan struct{})
}

// TestStalledNATSNeverStalls: when the path to NATS stalls (packets
// dropped, no connection closed), the publisher's writes back up; the
// router's view of the sync (Stats, which the admin API and the metrics
// read) still answers at once, and Close (a reload) returns promptly.
func TestStalledNATSNeverStalls(t *testing.T) {
	ns := startNATS(t, -1)
	link := newStallingLink(t, ns.Addr().String())
	s, err := New(Config{URLs: []string{link.url()}, Name: "a", Subject: "test.stall"})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Start(); err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	waitFor(t, "connected", func() bool { return s.Stats().Connected })
	link.stall()
	t0 := time.Now()

	// Long routed events until the publisher has backed up: its queue
	// overflows (drops) while it is stuck writing.
	hashes := make([]uint64, MaxEventHashes)
	for i := range hashes {
		hashes[i] = uint64(i) * 0x9e3779b97f4a7c15
	}
	stats := make(chan Stats, 1)
	for i := uint64(0); ; i++ {
		s.Publish(Message{Event: &router.Event{Kind: router.EventRouted, ID: i, Dial: "x:1", Hashes: hashes, BlockTokens: 64}})
		if i%64 != 0 {
			continue
		}
		go func() { stats <- s.Stats() }()
		select {
		case st := <-stats:
			if st.Dropped > 0 {
				goto backedUp
			}
		case <-time.After(5 * time.Second):
			t.Fatal("Stats waited on the stalled NATS connection")
		}
	}
backedUp:
	t.Logf("backed up after %v", time.Since(t0))
	// While the publisher is stuck, Stats still answers.
	for range 20 {
		go func() { stats <- s.Stats() }()
		select {
		case <-stats:
		case <-time.After(5 * time.Second):
			t.Fatal("Stats waited on the stalled NATS connection")
		}
		time.Sleep(10 * time.Millisecond)
	}
	closed := make(chan struct{})
	t1 := time.Now()
	go func() { s.Close(); close(closed) }()
	select {
	case <-closed:
		t.Logf("closed in %v", time.Since(t1))
	case <-time.After(15 * time.Second):
		t.Fatal("Close waited on the stalled NATS connection")
	}
}

// TestStartDoesNotWaitForNATS: a NATS server that accepts the connection
// and never answers (a path that drops packets) holds neither Start, which
// a Caddy reload runs, nor Close; the router routes on its own view.
func TestStartDoesNotWaitForNATS(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	accepted := make(chan net.Conn, 4)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			accepted <- c // held open, silent
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		for len(accepted) > 0 {
			(<-accepted).Close()
		}
	})
	// Without the background connect, Start would wait the whole timeout.
	s, err := New(Config{URLs: []string{"nats://" + ln.Addr().String()}, Name: "a", ConnectTimeout: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	started := make(chan error, 1)
	go func() { started <- s.Start() }()
	select {
	case err := <-started:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Start waited on a NATS server that never answers")
	}
	select {
	case <-accepted: // the attempt is under way, and stays so
	case <-time.After(30 * time.Second):
		t.Fatal("no connection attempt")
	}
	if st := s.Stats(); st.Connected {
		t.Fatal("connected to a server that never answered")
	}
	// Events while connecting are dropped and counted, as an outage's:
	// published late, they would charge peers with work long released.
	if s.Publish(Message{Undrain: "x:1"}) || s.Stats().Dropped != 1 {
		t.Fatalf("an event while connecting was queued: %+v", s.Stats())
	}
	closed := make(chan struct{})
	go func() { s.Close(); close(closed) }()
	select {
	case <-closed:
	case <-time.After(30 * time.Second):
		t.Fatal("Close waited on the connection attempt")
	}
}

func writeFile(t *testing.T, name, content string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// TestNothingAppliedAfterClose: a peer's batch that the client hands over
// after Close (the config that owned the routing state is unloaded) is
// not applied. (One whose callback was already running when Close came may
// still be: nats.go does not wait for its callbacks.)
func TestNothingAppliedAfterClose(t *testing.T) {
	var r received
	s, err := New(r.config(Config{URLs: []string{"nats://127.0.0.1:1"}, Name: "a"}))
	if err != nil {
		t.Fatal(err)
	}
	s.Close()
	s.receive(&nats.Msg{Data: AppendBatch(nil, sampleBatch())})
	if n := r.count(); n != 0 || s.Stats().Applied != 0 {
		t.Fatalf("%d messages applied after Close", n)
	}
}

// TestCodecBoundsCounts: a count beyond what a decoder accepts (an
// engine's absurd usage report) is sent at the bound, so peers do not
// reject the batch and the releases in it.
func TestCodecBoundsCounts(t *testing.T) {
	for _, m := range sampleBatch().Messages {
		if n, size := len(appendMessage(nil, &m)), encodedSize(&m); n > size {
			t.Errorf("%+v encodes to %d bytes, encodedSize says at most %d", m, n, size)
		}
	}
	b := &Batch{Sender: "a", Messages: []Message{
		{Event: &router.Event{Kind: router.EventCompleted, ID: 1, Model: "m", Tokens: 1 << 40, PromptTokens: 1 << 40, PromptBytes: -5}},
		{Event: &router.Event{Kind: router.EventReleased, ID: 2}},
	}}
	got, err := DecodeBatch(AppendBatch(nil, b))
	if err != nil {
		t.Fatal(err)
	}
	if ev := got.Messages[0].Event; ev.Tokens != math.MaxInt32 || ev.PromptTokens != math.MaxInt32 || ev.PromptBytes != 0 || len(got.Messages) != 2 {
		t.Fatalf("decoded %+v", got.Messages)
	}
}

// TestStartChecksItsConfiguration: what can be wrong without a network
// fails Start (the config), not each connection attempt.
func TestStartChecksItsConfiguration(t *testing.T) {
	for name, c := range map[string]Config{
		"URL":                  {URLs: []string{"nats://[::1"}},
		"no host":              {URLs: []string{"nats://"}},
		"credentials":          {URLs: []string{"nats://127.0.0.1:1"}, Creds: filepath.Join(t.TempDir(), "missing.creds")},
		"CA file":              {URLs: []string{"nats://127.0.0.1:1"}, TLSCA: filepath.Join(t.TempDir(), "missing.pem")},
		"credentials' content": {URLs: []string{"nats://127.0.0.1:1"}, Creds: writeFile(t, "router.creds", "not a credentials file")},
		"subject":              {URLs: []string{"nats://127.0.0.1:1"}, Subject: "pool a"},
		"subject's tokens":     {URLs: []string{"nats://127.0.0.1:1"}, Subject: "llm..pool"},
		"wildcard subject":     {URLs: []string{"nats://127.0.0.1:1"}, Subject: "llm.>"},
		"mixed schemes":        {URLs: []string{"nats://127.0.0.1:1", "ws://127.0.0.1:2"}},
		"scheme":               {URLs: []string{"http://127.0.0.1:8222"}},
		"unknown scheme":       {URLs: []string{"foo://127.0.0.1:4222"}},
	} {
		s, err := New(c)
		if err != nil {
			t.Fatalf("%s: New: %v", name, err)
		}
		if err := s.Start(); err == nil {
			s.Close()
			t.Errorf("a wrong %s started", name)
		}
	}
}

// fleetPair wires two routers' fleets through NATS, each naming x:1: b
// applies what a publishes (dropping a's earlier names), and records the
// drains a's operators made; a publishes its charges and restates them
// when it renews its name. a connects through aURL, b through bURL.
func fleetPair(t *testing.T, bURL, aURL, subject string) (fa, fb *router.Fleet, a *Syncer, drained *sync.Map) {
	t.Helper()
	fa, fb, drained = router.New(), router.New(), new(sync.Map)
	fa.Name("x:1", time.Now())
	fb.Name("x:1", time.Now())
	startSyncer(t, Config{URLs: []string{bURL}, Name: "b", Subject: subject,
		OnHeard:      func(peer string) { fb.Heard(peer, time.Now()) },
		OnSuperseded: func(peer string) { fb.DropPeer(peer, time.Now()) },
		OnMessage: func(peer string, m Message) {
			if m.Event != nil {
				fb.Apply(peer, *m.Event, time.Now())
			}
			if m.Drain != "" {
				drained.Store(m.Drain, true)
			}
		}})
	a = startSyncer(t, Config{URLs: []string{aURL}, Name: "a", Subject: subject, Resync: func() []Message {
		var msgs []Message
		for _, ev := range fa.LiveEvents() {
			msgs = append(msgs, Message{Event: &ev})
		}
		return msgs
	}})
	fa.SetPublisher(func(ev router.Event) { a.Publish(Message{Event: &ev}) })
	fa.KeepLive(true)
	return fa, fb, a, drained
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

// TestShortOutageLeavesNoPhantomCharges: a NATS outage shorter than the
// peers' silence expiry (a server restart) used to leave the releases of
// the outage lost and their charges counted by the peers for an hour.
// The router that lost events now takes a new name once reconnected and
// restates its charges in flight under it, and the operators' drains it
// could not send; the peer drops the old name's charges as soon as it
// hears the new one, and counts exactly what is in flight.
func TestShortOutageLeavesNoPhantomCharges(t *testing.T) {
	ns := startNATS(t, -1)
	port, url := ns.Addr().(*net.TCPAddr).Port, ns.ClientURL()
	fa, fb, a, drained := fleetPair(t, url, url, "test.renew")
	inFlight := func(f *router.Fleet) int { return inFlightOn(f, "x:1") }
	first := a.Name()
	waitFor(t, "b hearing a", func() bool {
		for _, p := range fb.Peers() {
			if p.Name == first {
				return true
			}
		}
		return false
	})
	opts := router.Options{}.WithDefaults()
	members := []router.Member{{Dial: "x:1", Available: true, Healthy: true}}
	decide := func() *router.Charge {
		return fa.Decide(time.Now(), router.Request{Hashes: []uint64{1, 2}, BlockTokens: 16, PromptTokens: 32}, members, &opts, rand.New(rand.NewPCG(1, 2)), nil).Charge
	}
	early := decide()
	waitFor(t, "b counting a's request", func() bool { return inFlight(fb) == 1 })

	ns.Shutdown()
	waitFor(t, "a noticing the loss", func() bool { return !a.Stats().Connected })
	fa.Release(early, time.Now()) // its release is lost
	late := decide()              // and this one's routing
	a.Publish(Message{Drain: "x:1", Deadline: time.Minute})
	startNATS(t, port) // back within the peers' 5 s
	waitFor(t, "a sharing again under a new name, its request in flight restated, the old name dropped", func() bool {
		peers := fb.Peers()
		return len(peers) == 1 && peers[0].Name == a.Name() && peers[0].Name != first && peers[0].Charges == 1
	})
	if st := a.Stats(); st.Renewals != 1 || st.Name == first {
		t.Fatalf("stats after the outage: %+v", st)
	}
	waitFor(t, "the drain made during the outage reaching b", func() bool { _, ok := drained.Load("x:1"); return ok })
	if got, want := inFlight(fb), inFlight(fa); got != want || want != 1 {
		t.Fatalf("b counts %d in flight from a, a has %d", got, want)
	}
	fa.Release(late, time.Now())
	waitFor(t, "the restated charge released", func() bool { return inFlight(fb) == 0 })
}

// TestFrozenServerIsNoticed: a server that stops answering while the
// connection stays open (a frozen process; here a link that stops carrying
// bytes) is counted lost within a few seconds by its unanswered pings,
// though the few writes of an idle router (its heartbeats) fit in the
// socket's buffers and never time out. nats.go's default noticed it only
// after two minutes, meanwhile reporting the connection up and counting
// the events buffered for a late delivery as sent.
func TestFrozenServerIsNoticed(t *testing.T) {
	ns := startNATS(t, -1)
	link := newStallingLink(t, ns.Addr().String())
	s := startSyncer(t, Config{URLs: []string{link.url()}, Name: "a", Subject: "test.frozen"})
	waitFor(t, "connected", func() bool { return s.Stats().Connected })
	link.stall()
	waitFor(t, "the frozen server noticed", func() bool { return !s.Stats().Connected })
	if s.Stats().Disconnects == 0 {
		t.Fatal("the loss was not counted")
	}
}

// TestReleaseLostOnADyingConnection: a release written to a connection
// whose server has stopped answering is counted as sent, yet never
// arrives. Once the connection is found dead (its pings go unanswered)
// and a new one is made, the router renews its name and restates what it
// has in flight, so the peer drops the charge whose release was lost.
func TestReleaseLostOnADyingConnection(t *testing.T) {
	ns := startNATS(t, -1)
	link := newStallingLink(t, ns.Addr().String())
	fa, fb, a, _ := fleetPair(t, ns.ClientURL(), link.url(), "test.dying")
	inFlight := func() int { return inFlightOn(fb, "x:1") }
	waitFor(t, "a connected", func() bool { return a.Stats().Connected })
	opts := router.Options{}.WithDefaults()
	c := fa.Decide(time.Now(), router.Request{Hashes: []uint64{1}, BlockTokens: 16, PromptTokens: 16},
		[]router.Member{{Dial: "x:1", Available: true, Healthy: true}}, &opts, rand.New(rand.NewPCG(1, 2)), nil).Charge
	waitFor(t, "b counting a's request", func() bool { return inFlight() == 1 })

	link.freeze()
	before := a.Stats()
	fa.Release(c, time.Now()) // written to the frozen connection
	waitFor(t, "the release sent into the frozen connection", func() bool { return a.Stats().Sent > before.Sent })
	if a.Stats().Dropped != before.Dropped {
		t.Fatalf("the release was dropped, not lost in the connection: %+v", a.Stats())
	}
	waitFor(t, "a renewed on a new connection, b counting nothing in flight", func() bool {
		return a.Stats().Renewals == 1 && inFlight() == 0
	})
}

// TestKeptDrainIsNotUndone: an operator's drain kept while it could not
// be sent goes out after earlier drains and undrains of the same upstream
// that were still queued, which would otherwise undo it at the peers.
func TestKeptDrainIsNotUndone(t *testing.T) {
	s, err := New(Config{URLs: []string{"nats://127.0.0.1:1"}})
	if err != nil {
		t.Fatal(err)
	}
	undrain, drain, other := Message{Undrain: "x:1"}, Message{Drain: "x:1", Deadline: time.Minute}, Message{Drain: "y:1"}
	for _, m := range []*Message{&undrain, &drain, &other} {
		s.numberOp(m)
	}
	s.keepOp(drain)   // dropped on a full queue, after the undrain was queued
	s.keepOp(undrain) // then the undrain, in a batch that failed to send
	if !s.supersededOp(&undrain) || s.supersededOp(&drain) || s.supersededOp(&other) {
		t.Fatalf("superseded: the undrain %v (want true), the kept drain %v, another upstream's %v",
			s.supersededOp(&undrain), s.supersededOp(&drain), s.supersededOp(&other))
	}
	if kept := s.takeLostOps(); len(kept) != 1 || kept[0].Drain != "x:1" {
		t.Fatalf("kept %+v", kept)
	}
}

// TestKeptDrainKeepsItsDeadline: a drain kept while the router was cut off
// reaches the peers with what is left of its deadline, counted from when
// the operator made it (as it is on this router), not a whole one from
// the reconnection.
func TestKeptDrainKeepsItsDeadline(t *testing.T) {
	s, err := New(Config{URLs: []string{"nats://127.0.0.1:1"}})
	if err != nil {
		t.Fatal(err)
	}
	drain, gone := Message{Drain: "x:1", Deadline: time.Minute}, Message{Drain: "y:1", Deadline: time.Minute}
	s.numberOp(&drain)
	s.numberOp(&gone)
	drain.made = drain.made.Add(-20 * time.Second) // made 20 s ago
	gone.made = gone.made.Add(-2 * time.Minute)    // its deadline passed while cut off
	s.keepOp(drain)
	s.keepOp(gone)
	for _, m := range s.takeLostOps() {
		switch {
		case m.Drain == "x:1" && (m.Deadline > 40*time.Second || m.Deadline < 30*time.Second):
			t.Errorf("x:1's drain goes with %v left of its minute, made 20 s ago", m.Deadline)
		case m.Drain == "y:1" && m.Deadline != 0:
			t.Errorf("y:1's drain goes with %v left; its deadline passed", m.Deadline)
		}
	}
}

// eventMessages are evs as messages, as the plugin publishes them.
func eventMessages(evs []router.Event) []Message {
	msgs := make([]Message, len(evs))
	for i := range evs {
		msgs[i].Event = &evs[i]
	}
	return msgs
}

// peerRouter is one router's fleet wired to its Syncer as the plugin wires
// them: peers' charges, drains (recorded in drained), renewals, its
// restatements and snapshots.
type peerRouter struct {
	fleet   *router.Fleet
	syncer  *Syncer
	drained sync.Map // dial -> deadline
}

func startPeerRouter(t *testing.T, url, name, subject string, dials ...string) *peerRouter {
	t.Helper()
	r := &peerRouter{fleet: router.New()}
	for _, d := range dials {
		r.fleet.Name(d, time.Now())
	}
	r.syncer = startSyncer(t, Config{URLs: []string{url}, Name: name, Subject: subject,
		OnHeard:      func(peer string) { r.fleet.Heard(peer, time.Now()) },
		OnSuperseded: func(peer string) { r.fleet.DropPeer(peer, time.Now()) },
		OnRenewed: func(peers []string) {
			for _, p := range peers {
				r.fleet.DropPeer(p, time.Now())
			}
		},
		Resync: func() []Message { return eventMessages(r.fleet.LiveEvents()) },
		Snapshot: func() []Message {
			msgs := eventMessages(r.fleet.SnapshotEvents(MaxEventHashes))
			r.drained.Range(func(dial, deadline any) bool {
				msgs = append(msgs, Message{Drain: dial.(string), Deadline: deadline.(time.Duration)})
				return true
			})
			return msgs
		},
		OnMessage: func(peer string, m Message) {
			if m.Event != nil {
				r.fleet.Apply(peer, *m.Event, time.Now())
			}
			r.applyOp(m)
		},
		OnSnapshot: func(peer string, m Message) {
			if m.Event != nil {
				r.fleet.Restore(*m.Event, time.Now())
			}
			r.applyOp(m)
		}})
	r.fleet.SetPublisher(func(ev router.Event) { r.syncer.Publish(Message{Event: &ev}) })
	r.fleet.KeepLive(true)
	return r
}

// applyOp records an operator's drain or undrain.
func (r *peerRouter) applyOp(m Message) {
	switch {
	case m.Drain != "":
		r.drained.Store(m.Drain, m.Deadline)
	case m.Undrain != "":
		r.drained.Delete(m.Undrain)
	}
}

// decide routes a request of prompt blocks hashes to the fleet's only
// upstream, x:1.
func (r *peerRouter) decide(hashes []uint64) router.Decision {
	opts := router.Options{}.WithDefaults()
	members := []router.Member{{Dial: "x:1", Available: true, Healthy: true, Hardware: router.Hardware{KVCapacityTokens: 1 << 20}}}
	return r.fleet.Decide(time.Now(), router.Request{Hashes: hashes, BlockTokens: 16, PromptTokens: 16 * len(hashes)},
		members, &opts, rand.New(rand.NewPCG(1, 2)), nil)
}

// answering waits until a router answers starting routers' requests on
// subject (it joined their queue group).
func answering(t *testing.T, ns *server.Server, subject string) {
	waitFor(t, "a router answering requests for snapshots", func() bool {
		sz, err := ns.Subsz(&server.SubszOptions{Test: subject + ".snapshot", Subscriptions: true})
		return err == nil && sz.Total > 0
	})
}

// TestStartingRouterGetsTheView: a router that starts while a peer has
// routed for a while asks it for a snapshot and starts with its view:
// the prefix index (more blocks than one event carries, in the same
// recency order, so the next turn of a conversation is warm through
// either), the stored responses' homes, the operators' drain in force,
// and, restated by the peer when it hears the newcomer, the charges in
// flight. It used to start with an empty index, none of these, and
// counted none of the requests already in flight.
func TestStartingRouterGetsTheView(t *testing.T) {
	ns := startNATS(t, -1)
	a := startPeerRouter(t, ns.ClientURL(), "a", "test.snapshot", "x:1")
	answering(t, ns, "test.snapshot")
	if st := a.syncer.Stats(); st.SnapshotFrom != "" {
		t.Fatalf("the first router started with a snapshot: %+v", st)
	}
	var convs [][]uint64
	for i := range 40 {
		h := make([]uint64, 512)
		for j := range h {
			h[j] = uint64(i)<<32 | uint64(j+1)
		}
		convs = append(convs, h)
		d := a.decide(h)
		a.fleet.Progress(d.Charge, 1, time.Now())
		a.fleet.Release(d.Charge, time.Now())
	}
	inFlight := a.decide(convs[0][:64]).Charge
	a.fleet.RememberResponse("resp_1", "x:1")
	a.drained.Store("x:1", time.Minute)

	b := startPeerRouter(t, ns.ClientURL(), "b", "test.snapshot", "x:1")
	waitFor(t, "b starting with a's view", func() bool { return b.syncer.Stats().SnapshotFrom == a.syncer.Name() })
	ua, ub := a.fleet.Snapshot(time.Now())[0], b.fleet.Snapshot(time.Now())[0]
	if ub.IndexBlocks != ua.IndexBlocks || ua.IndexBlocks != 40*512 || ub.IndexCapacityBlocks != ua.IndexCapacityBlocks {
		t.Fatalf("b's index holds %d of %d blocks, a's %d of %d", ub.IndexBlocks, ub.IndexCapacityBlocks, ua.IndexBlocks, ua.IndexCapacityBlocks)
	}
	// a counts its answer once it has sent the end, which b may have
	// read before that.
	waitFor(t, "a counting the snapshot it sent", func() bool { return a.syncer.Stats().SnapshotsSent == 1 })
	if st := b.syncer.Stats(); st.SnapshotMessages == 0 {
		t.Fatalf("snapshot counters: b %+v, a %+v", st, a.syncer.Stats())
	}
	for i, h := range convs {
		if d := b.decide(h); d.MatchedTokens != 16*512 {
			t.Fatalf("conversation %d's next turn through b matched %d tokens, want %d", i, d.MatchedTokens, 16*512)
		} else {
			b.fleet.Release(d.Charge, time.Now())
		}
	}
	if b.fleet.ResponseHome("resp_1") != "x:1" {
		t.Fatal("b does not know where a's stored response is")
	}
	if deadline, ok := b.drained.Load("x:1"); !ok || deadline.(time.Duration) <= 0 || deadline.(time.Duration) > time.Minute {
		t.Fatalf("the operators' drain reached b as %v, %v", deadline, ok)
	}
	waitFor(t, "b counting the request a had in flight when b started", func() bool { return inFlightOn(b.fleet, "x:1") == 1 })
	a.fleet.Release(inFlight, time.Now())
	waitFor(t, "its release reaching b", func() bool { return inFlightOn(b.fleet, "x:1") == 0 })
}

// TestCutOffRouterDropsPeersCharges: a router whose connection died
// missed its peers' releases meanwhile, though its peers never lost
// theirs and did not renew. Once connected again it renews, drops every
// peer's charges and counts what they restate when they hear its new
// name: exactly what is in flight. It used to count the released charges
// for an hour.
func TestCutOffRouterDropsPeersCharges(t *testing.T) {
	ns := startNATS(t, -1)
	link := newStallingLink(t, ns.Addr().String())
	a := startPeerRouter(t, ns.ClientURL(), "a", "test.cutoff", "x:1")
	b := startPeerRouter(t, link.url(), "b", "test.cutoff", "x:1")
	waitFor(t, "both connected", func() bool { return a.syncer.Stats().Connected && b.syncer.Stats().Connected })
	released, kept := a.decide([]uint64{1}).Charge, a.decide([]uint64{2}).Charge
	waitFor(t, "b counting a's two requests", func() bool { return inFlightOn(b.fleet, "x:1") == 2 })

	link.freeze()
	waitFor(t, "b noticing its dead connection", func() bool { return b.syncer.Stats().Disconnects > 0 })
	a.fleet.Release(released, time.Now()) // b is not there to hear it
	waitFor(t, "b back under a new name, counting a's one request in flight", func() bool {
		return b.syncer.Stats().Renewals == 1 && inFlightOn(b.fleet, "x:1") == 1
	})
	a.fleet.Release(kept, time.Now())
	waitFor(t, "the restated charge released", func() bool { return inFlightOn(b.fleet, "x:1") == 0 })
}

// BenchmarkSnapshot measures a router's start with a peer's view through
// a real NATS server: eight upstreams of 16,384 indexed blocks each (1 MB
// of hashes; a 1M-token KV cache each at 64-token blocks), from the
// request to the last block restored.
func BenchmarkSnapshot(b *testing.B) {
	ns := startNATS(b, -1)
	var dials []string
	for i := range 8 {
		dials = append(dials, fmt.Sprintf("10.0.0.%d:8000", i))
	}
	a := router.New()
	for _, d := range dials {
		a.Name(d, time.Now())
	}
	opts := router.Options{}.WithDefaults()
	for i, d := range dials {
		m := []router.Member{{Dial: d, Available: true, Healthy: true, Hardware: router.Hardware{KVCapacityTokens: 1 << 20}}}
		for c := range 32 {
			h := make([]uint64, 512)
			for j := range h {
				h[j] = uint64(i)<<48 | uint64(c)<<32 | uint64(j+1)
			}
			d := a.Decide(time.Now(), router.Request{Hashes: h, BlockTokens: 64, PromptTokens: 64 * 512}, m, &opts, rand.New(rand.NewPCG(1, 2)), nil)
			a.Progress(d.Charge, 1, time.Now())
			a.Release(d.Charge, time.Now())
		}
	}
	sa, err := New(Config{URLs: []string{ns.ClientURL()}, Name: "a", Subject: "bench.snapshot",
		Snapshot: func() []Message { return eventMessages(a.SnapshotEvents(MaxEventHashes)) }})
	if err != nil || sa.Start() != nil {
		b.Fatal(err)
	}
	defer sa.Close()
	for {
		sz, err := ns.Subsz(&server.SubszOptions{Test: "bench.snapshot.snapshot", Subscriptions: true})
		if err == nil && sz.Total > 0 {
			break
		}
		time.Sleep(time.Millisecond)
	}
	b.ResetTimer()
	for b.Loop() {
		f := router.New()
		for _, d := range dials {
			f.Name(d, time.Now())
		}
		s, err := New(Config{URLs: []string{ns.ClientURL()}, Name: "b", Subject: "bench.snapshot",
			OnSnapshot: func(_ string, m Message) { f.Restore(*m.Event, time.Now()) }})
		if err != nil || s.Start() != nil {
			b.Fatal(err)
		}
		for s.Stats().SnapshotFrom == "" {
			time.Sleep(100 * time.Microsecond)
		}
		s.Close()
		if n := f.Snapshot(time.Now())[0].IndexBlocks; n != 16384 {
			b.Fatalf("restored %d blocks of the first upstream, want 16384", n)
		}
	}
}

// snapshotResponder is a peer that answers starting routers' requests on
// subject by hand, as the test says.
type snapshotResponder struct {
	t    *testing.T
	nc   *nats.Conn
	reqs *nats.Subscription
}

func newSnapshotResponder(t *testing.T, url, subject string) *snapshotResponder {
	nc, err := nats.Connect(url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	reqs, err := nc.QueueSubscribeSync(subject+".snapshot", subject+".snapshot")
	if err != nil || nc.Flush() != nil {
		t.Fatal(err)
	}
	return &snapshotResponder{t: t, nc: nc, reqs: reqs}
}

// request waits for a starting router's request and returns its inbox.
func (r *snapshotResponder) request() string {
	req, err := r.reqs.NextMsg(30 * time.Second)
	if err != nil {
		r.t.Fatal(err)
	}
	return req.Reply
}

// part sends part n of a snapshot to inbox.
func (r *snapshotResponder) part(inbox string, n int, msgs ...Message) {
	m := nats.NewMsg(inbox)
	m.Header.Set(partHeader, fmt.Sprint(n))
	m.Data = AppendBatch(nil, &Batch{Sender: "a", Epoch: 1, Instance: 7, Messages: msgs})
	if err := r.nc.PublishMsg(m); err != nil || r.nc.Flush() != nil {
		r.t.Fatal(err)
	}
}

func cachedMessage(dial string, hashes ...uint64) Message {
	return Message{Event: &router.Event{Kind: router.EventCached, Dial: dial, BlockTokens: 16, KV: 1 << 20, Hashes: hashes}}
}

// TestSnapshotStopsAtALostPart: a part of a snapshot lost on the way (the
// requester reconnected meanwhile) ends what is applied of it: the part
// after it could hold a chain's blocks without their parent, which the
// index would then match as cached. The router asks again; a whole
// snapshot then restores the rest.
func TestSnapshotStopsAtALostPart(t *testing.T) {
	ns := startNATS(t, -1)
	a := newSnapshotResponder(t, ns.ClientURL(), "test.gap")
	b := startPeerRouter(t, ns.ClientURL(), "b", "test.gap", "x:1")
	const A, B, C = 101, 102, 103 // one chain: A, then B, then C
	inbox := a.request()
	a.part(inbox, 1, cachedMessage("x:1", A))
	a.part(inbox, 3, cachedMessage("x:1", C)) // part 2 (B) lost
	a.part(inbox, 4)
	inbox = a.request() // asked again
	// Looked at, not routed: a request released before its first token
	// would make the index forget its blocks, and keep them from the
	// next snapshot too.
	if blocks := b.fleet.Snapshot(time.Now())[0].IndexBlocks; blocks != 1 || b.syncer.Stats().SnapshotFrom != "" {
		t.Fatalf("after a lost part, the index holds %d blocks (want 1: A alone); snapshot from %q", blocks, b.syncer.Stats().SnapshotFrom)
	}
	for i, m := range []Message{cachedMessage("x:1", A), cachedMessage("x:1", B), cachedMessage("x:1", C)} {
		a.part(inbox, i+1, m)
	}
	a.part(inbox, 4)
	waitFor(t, "b's whole snapshot", func() bool { return b.syncer.Stats().SnapshotFrom == "a#1" })
	if d := b.decide([]uint64{A, B, C}); d.MatchedTokens != 48 {
		t.Fatalf("after the whole snapshot, chain A,B,C matches %d tokens, want 48", d.MatchedTokens)
	}
}

// TestLiveUndrainBeatsSnapshotsDrain: an operator's undrain that reaches
// a starting router live while its snapshot (made before the undrain)
// still travels is not undone by the snapshot's drain of the same
// upstream; a drain of another upstream in it still applies.
func TestLiveUndrainBeatsSnapshotsDrain(t *testing.T) {
	ns := startNATS(t, -1)
	a := newSnapshotResponder(t, ns.ClientURL(), "test.stale")
	q := startSyncer(t, Config{URLs: []string{ns.ClientURL()}, Name: "q", Subject: "test.stale"}) // neither asks nor answers
	b := startPeerRouter(t, ns.ClientURL(), "b", "test.stale", "x:1", "y:1")
	inbox := a.request()
	waitFor(t, "b hearing q", func() bool { return len(b.fleet.Peers()) > 0 && q.Stats().Connected })
	b.drained.Store("x:1", time.Minute) // as the live drain before it left it
	q.Publish(Message{Undrain: "x:1"})
	waitFor(t, "b hearing the undrain", func() bool { _, drained := b.drained.Load("x:1"); return !drained })
	a.part(inbox, 1, Message{Drain: "x:1", Deadline: time.Minute}, Message{Drain: "y:1", Deadline: time.Minute})
	a.part(inbox, 2)
	waitFor(t, "b's snapshot", func() bool { return b.syncer.Stats().SnapshotFrom != "" })
	_, x := b.drained.Load("x:1")
	_, y := b.drained.Load("y:1")
	if x || !y {
		t.Fatalf("after the snapshot b has x:1 drained %v (want false: the live undrain is newer), y:1 %v (want true)", x, y)
	}
}

// TestRenewalDropsOnlyItsOwnPeers: one router with two sync connections
// (two subjects, one fleet). The first loses its connection and renews:
// it drops the charges of the peers it heard, which restate theirs when
// they hear its new name, and not those of the second connection's peers,
// which never hear it.
func TestRenewalDropsOnlyItsOwnPeers(t *testing.T) {
	ns := startNATS(t, -1)
	link := newStallingLink(t, ns.Addr().String())
	a := startPeerRouter(t, ns.ClientURL(), "a", "test.two", "x:1")
	fb := router.New()
	fb.Name("x:1", time.Now())
	cfg := func(url, subject string) Config {
		return Config{URLs: []string{url}, Name: "b", Subject: subject, Instance: 77,
			OnHeard:      func(peer string) { fb.Heard(peer, time.Now()) },
			OnSuperseded: func(peer string) { fb.DropPeer(peer, time.Now()) },
			OnRenewed: func(peers []string) {
				for _, p := range peers {
					fb.DropPeer(p, time.Now())
				}
			},
			OnMessage: func(peer string, m Message) {
				if m.Event != nil {
					fb.Apply(peer, *m.Event, time.Now())
				}
			}}
	}
	one := startSyncer(t, cfg(link.url(), "test.one"))
	startSyncer(t, cfg(ns.ClientURL(), "test.two"))
	waitFor(t, "b's first connection up", func() bool { return one.Stats().Connected })
	a.decide([]uint64{1})
	waitFor(t, "b counting a's request", func() bool { return inFlightOn(fb, "x:1") == 1 })
	link.freeze()
	waitFor(t, "the first connection renewed", func() bool { return one.Stats().Renewals == 1 })
	if got := inFlightOn(fb, "x:1"); got != 1 {
		t.Fatalf("a has 1 request in flight on the other subject; b counts %d after its first connection renewed", got)
	}
}

// TestSnapshotWithDocumentedPermissions: the NATS permissions the README
// gives a router's user are enough to ask for a snapshot and to answer
// one.
//
// The server runs the example configuration users copy
// (caddyfile-examples/nats-server.conf), read as nats-server reads it:
// `allow_responses: true` there, as the README once said, allows one reply
// a request, and the snapshot's end was refused.
func TestSnapshotWithDocumentedPermissions(t *testing.T) {
	t.Setenv("ROUTER_PASSWORD", "p")
	opts, err := server.ProcessConfigFile("../caddyfile-examples/nats-server.conf")
	if err != nil {
		t.Fatal(err)
	}
	opts.Port = -1
	ns := natstest.StartWith(t, opts)
	url := "nats://router:p@" + ns.Addr().String()
	a := startPeerRouter(t, url, "a", "llm_affinity", "x:1")
	answering(t, ns, "llm_affinity")
	a.decide([]uint64{1, 2, 3})
	b := startPeerRouter(t, url, "b", "llm_affinity", "x:1")
	waitFor(t, "b starting with a's view", func() bool { return b.syncer.Stats().SnapshotFrom == a.syncer.Name() })
	if d := b.decide([]uint64{1, 2, 3}); d.MatchedTokens != 48 {
		t.Fatalf("b matched %d tokens of a's request, want 48", d.MatchedTokens)
	}
}

// TestReloadedConnectionKeepsItsView: a router's new connection (a reload
// changed its sync options) asks for a snapshot while its earlier one is
// still in the queue group that answers: when that one gets the request,
// it says at once that the view is the asker's own, where it used to stay
// silent, leaving the new connection to wait 5 s and log that no peer
// answered, with peers there.
func TestReloadedConnectionKeepsItsView(t *testing.T) {
	ns := startNATS(t, -1)
	snapshot := func() []Message { return []Message{{Drain: "x:1", Deadline: time.Minute}} }
	var applied atomic.Int64
	cfg := Config{URLs: []string{ns.ClientURL()}, Name: "r", Subject: "test.reload", Instance: 7,
		Snapshot: snapshot, OnSnapshot: func(string, Message) { applied.Add(1) }}
	old := startSyncer(t, cfg)
	waitFor(t, "the first connection answering snapshot requests", func() bool {
		return old.Stats().Connected && queueSubscribed(ns, "test.reload.snapshot")
	})
	core, logs := observer.New(zapcore.InfoLevel)
	cfg.Logger = zap.New(core)
	successor := startSyncer(t, cfg)
	successor.Replaces(old)
	waitFor(t, "the new connection's snapshot phase", func() bool {
		return logs.FilterMessageSnippet("snapshot").Len() > 0
	})
	if n := logs.FilterMessageSnippet("kept this router's own view").Len(); n != 1 {
		t.Errorf("the new connection's snapshot: %v", logs.All())
	}
	if applied.Load() != 0 || old.Stats().SnapshotsSent != 0 {
		t.Errorf("its own view applied again (%d messages) or counted as a snapshot given (%d)", applied.Load(), old.Stats().SnapshotsSent)
	}
}

// queueSubscribed says the server has a queue subscription on subject.
func queueSubscribed(ns *server.Server, subject string) bool {
	subs, err := ns.Subsz(&server.SubszOptions{Subscriptions: true, Test: subject})
	return err == nil && subs.Total > 0
}

// TestConnectionTroubleSaysWhy: a NATS nothing answers at is logged with
// the reason, once however many times the client tries, and Stats carry
// it while not connected; closing a connection (a reload, a shutdown) is
// neither logged nor counted as losing it.
func TestConnectionTroubleSaysWhy(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closed := ln.Addr().String()
	ln.Close()
	core, logs := observer.New(zapcore.InfoLevel)
	s := startSyncer(t, Config{URLs: []string{"nats://" + closed}, Name: "r", Subject: "test.why", Logger: zap.New(core)})
	waitFor(t, "the reason in the stats", func() bool { return strings.Contains(s.Stats().LastError, "refused") })
	waitFor(t, "the reason logged", func() bool { return loggedReason(logs, "refused") })
	// The client tries every second: each reason is logged once, until a
	// connection is made. (On a connection not started, which no client
	// reports to meanwhile.)
	core3, logs3 := observer.New(zapcore.InfoLevel)
	quiet, err := New(Config{URLs: []string{"nats://" + closed}, Name: "r3", Subject: "test.why", Logger: zap.New(core3)})
	if err != nil {
		t.Fatal(err)
	}
	for _, err := range []error{errors.New("one"), errors.New("one"), errors.New("two"), nil, errors.New("two")} {
		quiet.noteConnError(err)
	}
	var reasons []string
	for _, e := range logs3.All() {
		reasons = append(reasons, fmt.Sprint(e.ContextMap()["error"]))
	}
	if !slices.Equal(reasons, []string{"one", "two", "two"}) {
		t.Errorf("reasons logged: %q, want one, two, and two again after a connection", reasons)
	}

	ns := startNATS(t, -1)
	core2, logs2 := observer.New(zapcore.InfoLevel)
	up := startSyncer(t, Config{URLs: []string{ns.ClientURL()}, Name: "r2", Subject: "test.why", Logger: zap.New(core2)})
	waitFor(t, "connected", func() bool { return up.Stats().Connected })
	if st := up.Stats(); st.LastError != "" {
		t.Errorf("connected, yet last_error %q", st.LastError)
	}
	up.Close()
	if st := up.Stats(); st.Disconnects != 0 || logs2.FilterMessageSnippet("lost the NATS connection").Len() != 0 {
		t.Errorf("closing counted as an outage: %d disconnects, logs %v", st.Disconnects, logs2.All())
	}
}

// TestLonelyAndTwinRoutersAreTold: a router that finds no peer on its
// subject (the first, or one whose subject has a typo) says so, naming
// the subject; one that hears a peer under its own name warns once.
func TestLonelyAndTwinRoutersAreTold(t *testing.T) {
	ns := startNATS(t, -1)
	core, logs := observer.New(zapcore.InfoLevel)
	cfg := Config{URLs: []string{ns.ClientURL()}, Name: "twin", Subject: "test.twins", Logger: zap.New(core),
		Snapshot: func() []Message { return nil }, OnSnapshot: func(string, Message) {}}
	first := startSyncer(t, cfg)
	waitFor(t, "the first router's lonely start", func() bool {
		return logs.FilterMessageSnippet("no peer on the sync subject").FilterField(zap.String("subject", "test.twins")).Len() == 1
	})
	core2, logs2 := observer.New(zapcore.InfoLevel)
	cfg.Logger = zap.New(core2)
	second := startSyncer(t, cfg)
	waitFor(t, "both connected", func() bool { return first.Stats().Connected && second.Stats().Connected })
	// Connected is not subscribed yet: what is published before the
	// second's subscription reaches the server is lost. So publish until
	// three are heard.
	id := uint64(0)
	waitFor(t, "three heard", func() bool {
		id++
		first.Publish(Message{Event: &router.Event{Kind: router.EventReleased, ID: id}})
		return second.Stats().Applied >= 3
	})
	waitFor(t, "the twin's warning", func() bool { return logs2.FilterMessageSnippet("uses this router's name").Len() > 0 })
	if n := logs2.FilterMessageSnippet("uses this router's name").Len(); n != 1 {
		t.Errorf("warned %d times, want once", n)
	}
}

// loggedReason says logs hold a "cannot connect to NATS" line whose error
// mentions reason.
func loggedReason(logs *observer.ObservedLogs, reason string) bool {
	for _, e := range logs.FilterMessageSnippet("cannot connect to NATS").All() {
		if strings.Contains(fmt.Sprint(e.ContextMap()["error"]), reason) {
			return true
		}
	}
	return false
}

// TestHandshakeTroubleSaysWhy: a NATS that answers but whose TLS
// handshake fails (the client reports it to no handler) is logged and
// shown with its reason too; the same reason from several servers is
// logged once.
func TestHandshakeTroubleSaysWhy(t *testing.T) {
	free, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := free.Addr().(*net.TCPAddr).Port
	free.Close()
	ns := startNATS(t, port)
	core, logs := observer.New(zapcore.InfoLevel)
	s := startSyncer(t, Config{URLs: []string{ns.ClientURL()}, Name: "r", Subject: "test.tls", Logger: zap.New(core)})
	waitFor(t, "connected", func() bool { return s.Stats().Connected })
	// The server goes; on its port now, one that asks for TLS and cannot
	// speak it: the client reconnects, and fails after connecting.
	ns.Shutdown()
	ns.WaitForShutdown()
	var ln net.Listener
	waitFor(t, "the port free again", func() bool {
		ln, err = net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port))
		return err == nil
	})
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			fmt.Fprint(c, `INFO {"server_id":"fake","version":"2.10.0","proto":1,"max_payload":1048576,"tls_required":true}`+"\r\n")
			fmt.Fprint(c, "not a TLS record\r\n")
			c.Close()
		}
	}()
	waitFor(t, "the handshake's failure in the stats", func() bool { return strings.Contains(s.Stats().LastError, "tls") })
	waitFor(t, "the handshake's failure logged", func() bool { return loggedReason(logs, "tls") })

	core2, logs2 := observer.New(zapcore.InfoLevel)
	quiet, err := New(Config{URLs: []string{"nats://127.0.0.1:1"}, Name: "q", Subject: "test.tls", Logger: zap.New(core2)})
	if err != nil {
		t.Fatal(err)
	}
	for _, port := range []int{1, 2, 1} { // one reason, the servers' addresses in its text differing
		quiet.noteConnError(&net.OpError{Op: "dial", Net: "tcp", Addr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: port},
			Err: errors.New("connect: connection refused")})
	}
	quiet.noteConnError(nats.ErrNoServers)
	if n := logs2.Len(); n != 1 {
		t.Errorf("one reason from several servers, and the client's round of them: %d lines: %v", n, logs2.All())
	}
}

// TestRefusedCredentialsKeepTrying: a server that refuses the router's
// credentials again and again does not make it give up for good (nats.go
// stops after the same refusal twice): once the server takes them, the
// router connects, without a reload.
func TestRefusedCredentialsKeepTrying(t *testing.T) {
	auth := &countingAuth{}
	ns := natstest.StartWith(t, &server.Options{Port: -1, CustomClientAuthentication: auth})
	core, logs := observer.New(zapcore.InfoLevel)
	s := startSyncer(t, Config{URLs: []string{ns.ClientURL()}, Name: "r", Subject: "test.auth", Logger: zap.New(core)})
	waitFor(t, "three refusals", func() bool { return auth.refused.Load() >= 3 })
	auth.accept.Store(true) // the server's side fixed
	waitFor(t, "connected once the server takes the credentials", func() bool { return s.Stats().Connected })

	// Refused again after a connection (credentials revoked): the client
	// reports each refusal as an error, which is one reason, logged once.
	before := logs.Len()
	auth.accept.Store(false)
	refused := auth.refused.Load()
	cz, err := ns.Connz(nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range cz.Conns {
		_ = ns.DisconnectClientByID(c.Cid)
	}
	waitFor(t, "four more refusals", func() bool { return auth.refused.Load() >= refused+4 })
	var lines []string
	for _, e := range logs.All()[before:] {
		if e.Message == "NATS error" || strings.Contains(e.Message, "cannot connect") {
			lines = append(lines, e.Message+": "+fmt.Sprint(e.ContextMap()["error"]))
		}
	}
	if len(lines) != 1 {
		t.Errorf("four refusals of revoked credentials logged as %q, want one line", lines)
	}
}

// countingAuth refuses every client until accept, counting refusals.
type countingAuth struct {
	accept  atomic.Bool
	refused atomic.Int64
}

func (a *countingAuth) Check(server.ClientAuthentication) bool {
	if a.accept.Load() {
		return true
	}
	a.refused.Add(1)
	return false
}

// TestCredentialsInURLsAreNotLogged: a user and password, or a token, in
// a NATS URL stay out of the "unreachable" log line, which names the
// servers.
func TestCredentialsInURLsAreNotLogged(t *testing.T) {
	core, logs := observer.New(zapcore.InfoLevel)
	startSyncer(t, Config{URLs: []string{"nats://alice:s3cretPW@127.0.0.1:1", "nats://tok3nSECRET@127.0.0.1:2", "bob:pw2SECRET@127.0.0.1:3",
		"nats://carol:pw3SECRET@127.0.0.1:4,nats://dave:pw4SECRET@127.0.0.1:5", "nats://tok#5SECRET@127.0.0.1:6"},
		Name: "r", Subject: "test.creds", Logger: zap.New(core)})
	waitFor(t, "the unreachable line", func() bool { return logs.FilterMessageSnippet("NATS unreachable").Len() > 0 })
	for _, e := range logs.All() {
		line := e.Message + fmt.Sprint(e.ContextMap())
		if strings.Contains(line, "SECRET") || strings.Contains(line, "s3cretPW") || strings.Contains(line, "alice") {
			t.Errorf("credentials logged: %s", line)
		}
	}
	if got := fmt.Sprint(logs.FilterMessageSnippet("NATS unreachable").All()[0].ContextMap()["servers"]); !strings.Contains(got, "127.0.0.1:1") {
		t.Errorf("the servers are no longer named: %s", got)
	}
	// Nor in the error a wrong URL gets.
	wrong, err := New(Config{URLs: []string{"http://alice:s3cretPW@127.0.0.1:1"}, Name: "r", Subject: "test.creds"})
	if err == nil {
		err = wrong.Start()
		wrong.Close()
	}
	if err == nil || strings.Contains(err.Error(), "s3cretPW") {
		t.Errorf("a wrong URL's error: %v", err)
	}
}

// TestIndexChangesTravelInOrder: forgotten and prefilled blocks reach the
// peer in the order of the charges around them (a forget that overtook
// the routing that inserted its blocks would forget nothing, and one
// overtaken by a later routing of the same blocks would forget them),
// in batches of their own and unnumbered: a router of the version
// before, which rejects them, sees no gap in the numbers of the batches
// it reads, and renews for nothing.
func TestIndexChangesTravelInOrder(t *testing.T) {
	ns := startNATS(t, -1)
	wire := spyOn(t, ns.ClientURL(), "test.index")
	var ra, rb received
	a := startSyncer(t, ra.config(Config{URLs: []string{ns.ClientURL()}, Name: "a", Subject: "test.index"}))
	b := startSyncer(t, rb.config(Config{URLs: []string{ns.ClientURL()}, Name: "b", Subject: "test.index"}))
	waitFor(t, "b hearing a", func() bool { rb.mu.Lock(); defer rb.mu.Unlock(); return rb.peers[a.Name()] })
	var sent []Message
	for round := range 50 {
		id := uint64(10 * round)
		hashes := []uint64{id + 1, id + 2}
		for _, ev := range []router.Event{
			{Kind: router.EventRouted, ID: id + 1, Dial: "x:1", Hashes: hashes, BlockTokens: 16, Prefill: 32},
			{Kind: router.EventReleased, ID: id + 1},
			{Kind: router.EventForgot, ID: id + 1, Dial: "x:1", Hashes: hashes},
			{Kind: router.EventRouted, ID: id + 2, Dial: "x:1", Hashes: hashes, BlockTokens: 16, Prefill: 32},
			{Kind: router.EventPrefilled, ID: id + 2, Dial: "x:1", Hashes: hashes},
			{Kind: router.EventCompleted, ID: id + 2, Model: "m", Tokens: 3},
		} {
			m := Message{Event: &ev}
			sent = append(sent, m)
			if !a.Publish(m) {
				t.Fatal("publish dropped on an idle queue")
			}
		}
	}
	waitFor(t, "b receiving everything", func() bool { return rb.count() == len(sent) })
	rb.mu.Lock()
	got := slices.Clone(rb.msgs)
	rb.mu.Unlock()
	if !reflect.DeepEqual(got, sent) {
		for i := range got {
			if !reflect.DeepEqual(got[i], sent[i]) {
				t.Fatalf("message %d: b got %+v, a sent %+v", i, got[i].Event, sent[i].Event)
			}
		}
	}
	if st := b.Stats(); st.Missed != 0 || st.Malformed != 0 {
		t.Fatalf("b's stats: %+v", st)
	}
	var last uint64
	for _, m := range wire() {
		batch, err := DecodeBatch(m.Data)
		if err != nil {
			t.Fatal(err)
		}
		if batch.Sender != "a" {
			continue
		}
		index := 0
		for _, bm := range batch.Messages {
			if isIndexEvent(bm.Event.Kind) {
				index++
			}
		}
		seq := batchSeq(m)
		switch {
		case index > 0 && (index < len(batch.Messages) || m.Data[0] != 7 || seq != 0):
			t.Fatalf("a version %d batch numbered %d carries %d index changes among %d messages", m.Data[0], seq, index, len(batch.Messages))
		case index == 0 && seq != last+1:
			t.Fatalf("a batch of charges numbered %d follows %d", seq, last)
		case index == 0:
			last = seq
		}
	}
}

// TestPeersForgetAFailedRequestsBlocks: through a real NATS server, a
// request that fails before its first token at one router takes its
// blocks back at the other: the next turn through it is not warm there.
func TestPeersForgetAFailedRequestsBlocks(t *testing.T) {
	ns := startNATS(t, -1)
	a := startPeerRouter(t, ns.ClientURL(), "a", "test.forget", "x:1")
	b := startPeerRouter(t, ns.ClientURL(), "b", "test.forget", "x:1")
	waitFor(t, "each router hearing the other", func() bool {
		return len(a.fleet.Peers()) == 1 && len(b.fleet.Peers()) == 1
	})
	h := make([]uint64, 64)
	for i := range h {
		h[i] = uint64(i + 1)
	}
	d := a.decide(h)
	waitFor(t, "b counting a's request", func() bool { return inFlightOn(b.fleet, "x:1") == 1 })
	if got := b.fleet.Snapshot(time.Now())[0].IndexBlocks; got != 64 {
		t.Fatalf("b's index holds %d of the routed request's 64 blocks", got)
	}
	a.fleet.Release(d.Charge, time.Now()) // the engine answered 500 before any token
	waitFor(t, "b forgetting the failed request's blocks", func() bool {
		return b.fleet.Snapshot(time.Now())[0].IndexBlocks == 0
	})
	if st := b.syncer.Stats(); st.Missed != 0 || st.Renewals != 0 {
		t.Fatalf("b's stats: %+v", st)
	}
}

// TestUnnumberedBatchKeepsTheCount: an unnumbered batch (index changes)
// between numbered ones neither is a gap nor hides one.
func TestUnnumberedBatchKeepsTheCount(t *testing.T) {
	s, err := New(Config{URLs: []string{"nats://127.0.0.1:1"}, Name: "b", Subject: "test.count"})
	if err != nil {
		t.Fatal(err)
	}
	b := &Batch{Sender: "a", Epoch: 1, Instance: 7}
	now := time.Now()
	for _, step := range []struct {
		seq uint64
		gap bool
	}{{1, false}, {0, false}, {2, false}, {0, false}, {4, true}, {0, false}, {5, false}} {
		if _, gap := s.latestName(b, step.seq, now); gap != step.gap {
			t.Fatalf("batch %d: gap %v, want %v", step.seq, gap, step.gap)
		}
	}
}

// TestSnapshotLeavesOutWhatFailedMeanwhile: a starting router hears live
// that a request failed before its first token (EventForgot) while its
// snapshot is on the way, from a peer that took it before it heard of
// the failure: the failed blocks stay out of the index. The blocks before
// those the failed request's router forgot are restored.
func TestSnapshotLeavesOutWhatFailedMeanwhile(t *testing.T) {
	ns := startNATS(t, -1)
	a := newSnapshotResponder(t, ns.ClientURL(), "test.forgot")
	q := startSyncer(t, Config{URLs: []string{ns.ClientURL()}, Name: "q", Subject: "test.forgot"}) // neither asks nor answers
	b := startPeerRouter(t, ns.ClientURL(), "b", "test.forgot", "x:1")
	const A, B, C = 201, 202, 203 // one chain: A, then B, then C
	inbox := a.request()
	waitFor(t, "b hearing q", func() bool { return len(b.fleet.Peers()) > 0 && q.Stats().Connected })
	applied := b.syncer.Stats().Applied
	q.Publish(Message{Event: &router.Event{Kind: router.EventForgot, ID: 9, Dial: "x:1", From: 1, Hashes: []uint64{A, B, C}}})
	waitFor(t, "b hearing of the failure", func() bool { return b.syncer.Stats().Applied > applied })
	a.part(inbox, 1, cachedMessage("x:1", A, B, C))
	a.part(inbox, 2)
	waitFor(t, "b's snapshot", func() bool { return b.syncer.Stats().SnapshotFrom != "" })
	if d := b.decide([]uint64{A, B, C}); d.MatchedTokens != 16 {
		t.Fatalf("after the snapshot, chain A,B,C matches %d tokens, want 16 (A alone: B and C failed)", d.MatchedTokens)
	}
}

// TestForgetLostInAnOutageIsSent: a request fails before its first token
// while its router is cut off from NATS: its forget, which could not be
// sent, is sent once connected again, so the peer, which had learned its
// blocks from its routing, does not keep them (the renewal's restatement
// carries no hashes).
func TestForgetLostInAnOutageIsSent(t *testing.T) {
	ns := startNATS(t, -1)
	port, url := ns.Addr().(*net.TCPAddr).Port, ns.ClientURL()
	fa, fb, a, _ := fleetPair(t, url, url, "test.lostforget")
	waitFor(t, "b hearing a", func() bool { return len(fb.Peers()) == 1 })
	opts := router.Options{}.WithDefaults()
	members := []router.Member{{Dial: "x:1", Available: true, Healthy: true}}
	d := fa.Decide(time.Now(), router.Request{Hashes: []uint64{11, 12, 13}, BlockTokens: 16, PromptTokens: 48}, members, &opts, rand.New(rand.NewPCG(1, 2)), nil)
	blocks := func() int { return fb.Snapshot(time.Now())[0].IndexBlocks }
	waitFor(t, "b learning the request's blocks", func() bool { return blocks() == 3 })

	ns.Shutdown()
	waitFor(t, "a noticing the loss", func() bool { return !a.Stats().Connected })
	fa.Release(d.Charge, time.Now()) // 503 before any token; its forget cannot go
	waitFor(t, "the forget dropped", func() bool { return a.Stats().Dropped > 0 })
	startNATS(t, port)
	waitFor(t, "b forgetting the failed request's blocks", func() bool { return blocks() == 0 })
}

// TestResponseStoredInAnOutageIsSent: a response stored while its router
// is cut off from NATS is made known once connected again, so that its
// next turn through the peer goes home; before, its home was dropped with
// the outage's other events, and nothing restated it: the peer sent every
// later turn by its input alone, to engines that answered 404.
func TestResponseStoredInAnOutageIsSent(t *testing.T) {
	ns := startNATS(t, -1)
	port, url := ns.Addr().(*net.TCPAddr).Port, ns.ClientURL()
	fa, fb, a, _ := fleetPair(t, url, url, "test.loststored")
	waitFor(t, "b hearing a", func() bool { return len(fb.Peers()) == 1 })
	ns.Shutdown()
	waitFor(t, "a noticing the loss", func() bool { return !a.Stats().Connected })
	fa.RememberResponse("resp_outage", "x:1")
	waitFor(t, "the home dropped", func() bool { return a.Stats().Dropped > 0 })
	startNATS(t, port)
	waitFor(t, "b learning the response's home", func() bool { return fb.ResponseHome("resp_outage") == "x:1" })
}

// TestKeptMessagesCountAsDroppedOnce: a failed request's forget and an
// operator's drain that could not be sent are kept to send once
// connected; a try that fails again does not count them again.
func TestKeptMessagesCountAsDroppedOnce(t *testing.T) {
	s := &Syncer{}
	forget := Message{Event: &router.Event{Kind: router.EventForgot, ID: 9, Dial: "x:1", Hashes: []uint64{1, 2}}}
	drain := Message{Drain: "x:2", Deadline: time.Minute}
	s.unsent(forget)
	s.unsent(drain)
	for try := 1; try <= 3; try++ {
		if got := s.dropped.Load(); got != 2 {
			t.Fatalf("try %d: dropped %d, want 2", try, got)
		}
		forgets, ops := s.takeLostForgets(), s.takeLostOps()
		if len(forgets) != 1 || len(ops) != 1 {
			t.Fatalf("try %d: kept %d forgets and %d drains, want 1 and 1", try, len(forgets), len(ops))
		}
		s.unsent(forgets[0]) // the connection broke again
		s.unsent(ops[0])
	}
	s.unsent(Message{Event: &router.Event{Kind: router.EventForgot, ID: 10, Dial: "x:1", Hashes: []uint64{3}}})
	if got := s.dropped.Load(); got != 3 {
		t.Fatalf("a new forget unsent: dropped %d, want 3", got)
	}
}

// TestOpAfterAFastPeersStands: a peer whose clock runs an hour fast stamps
// its drain an hour ahead. An operator's undrain made here after that
// drain came is placed after it (each upstream's ops are ordered as a
// Lamport clock), so every router takes the undrain, and none takes the
// fast peer's drain back when it is restated; a drain's deadline still
// counts from when the operator made it.
func TestOpAfterAFastPeersStands(t *testing.T) {
	here, other := unconnected(t), unconnected(t)
	ahead := time.Now().Add(time.Hour).UnixNano()
	fastDrain := Message{Drain: "x:1", Deadline: time.Minute}
	if !here.peerOp(&fastDrain, ahead) || !other.peerOp(&fastDrain, ahead) {
		t.Fatal("the fast peer's drain did not stand")
	}
	undrain := Message{Undrain: "x:1"}
	here.numberOp(&undrain)
	here.noteOwnOp(undrain)
	h := nats.Header{}
	setOpTimes(h, []Message{undrain})
	at := opTimes(&nats.Msg{Header: h})
	if len(at) != 1 || at[0] <= ahead {
		t.Fatalf("the undrain is sent as made at %v, not after the fast peer's drain (%d)", at, ahead)
	}
	if !other.peerOp(&undrain, at[0]) {
		t.Fatal("a peer took the undrain for older than the fast peer's drain")
	}
	for name, s := range map[string]*Syncer{"here": here, "the peer": other} {
		if s.peerOp(&fastDrain, ahead) {
			t.Errorf("%s: the fast peer's drain, restated, undid the undrain made after it", name)
		}
	}
	drain := Message{Drain: "x:1", Deadline: time.Minute}
	here.numberOp(&drain)
	if left := drain.deadlineLeft().Deadline; left > time.Minute || left < 59*time.Second {
		t.Errorf("a drain made after the fast peer's has %v of its minute left", left)
	}
}

// TestOpsAfterTheSameFastOpAgree: two routers that heard the same fast
// peer's drain, whose operators then act on the upstream at once, stamp
// their ops apart, so both take the later of the two, and neither takes
// the other's and drops its own (which would split them for good). Two
// ops made one after the other on one router are ordered so as well.
func TestOpsAfterTheSameFastOpAgree(t *testing.T) {
	a, b := unconnected(t), unconnected(t)
	ahead := time.Now().Add(time.Hour).UnixNano()
	fast := Message{Drain: "x:1", Deadline: time.Minute}
	a.peerOp(&fast, ahead)
	b.peerOp(&fast, ahead)
	undrain, drain := Message{Undrain: "x:1"}, Message{Drain: "x:1", Deadline: time.Minute}
	a.numberOp(&undrain)
	a.noteOwnOp(undrain)
	b.numberOp(&drain)
	b.noteOwnOp(drain)
	if undrain.order <= ahead || drain.order <= ahead || undrain.order == drain.order {
		t.Fatalf("orders: the fast drain %d, a's undrain %d, b's drain %d; want both after it, apart", ahead, undrain.order, drain.order)
	}
	aTakes, bTakes := a.peerOp(&drain, drain.order), b.peerOp(&undrain, undrain.order)
	if aTakes != (drain.order > undrain.order) || bTakes != (undrain.order > drain.order) {
		t.Fatalf("a takes b's drain: %v, b takes a's undrain: %v; want only the later one taken", aTakes, bTakes)
	}
	first, second := Message{Undrain: "x:1"}, Message{Drain: "x:1", Deadline: time.Minute}
	a.numberOp(&first)
	a.numberOp(&second)
	if second.order <= first.order {
		t.Fatalf("one router's ops in a row ordered %d then %d", first.order, second.order)
	}
}

// unconnected is a syncer that was never started, for its bookkeeping.
func unconnected(t *testing.T) *Syncer {
	t.Helper()
	s, err := New(Config{URLs: []string{"nats://127.0.0.1:1"}})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// TestSnapshotCarriesOpTimes: a router that starts from a peer's snapshot
// learns when the drains in it were made, as the peer knows it, so its
// own later op of such an upstream is placed after them, even after one
// stamped by a peer whose clock ran an hour fast.
func TestSnapshotCarriesOpTimes(t *testing.T) {
	ns := startNATS(t, -1)
	a := startPeerRouter(t, ns.ClientURL(), "a", "test.optimes", "x:1")
	answering(t, ns, "test.optimes")
	ahead := time.Now().Add(time.Hour).UnixNano()
	if !a.syncer.peerOp(&Message{Drain: "x:1", Deadline: time.Minute}, ahead) {
		t.Fatal("a did not take the fast peer's drain")
	}
	a.drained.Store("x:1", time.Minute)

	b := startPeerRouter(t, ns.ClientURL(), "b", "test.optimes", "x:1")
	waitFor(t, "b starting with a's view", func() bool { return b.syncer.Stats().SnapshotFrom == a.syncer.Name() })
	if _, ok := b.drained.Load("x:1"); !ok {
		t.Fatal("the drain did not reach b")
	}
	undrain := Message{Undrain: "x:1"}
	b.syncer.numberOp(&undrain)
	if undrain.order <= ahead {
		t.Fatalf("b's undrain is placed at %d, before the drain it learned from the snapshot (%d)", undrain.order, ahead)
	}
	if !a.syncer.peerOp(&undrain, undrain.order) {
		t.Fatal("a ignored b's undrain")
	}
}

// TestOpTableForgetsTheOldest: past its bound the table of op times
// forgets the upstream whose latest op is the oldest, not every one: an
// upstream a fast peer drained stays ordered after that drain.
func TestOpTableForgetsTheOldest(t *testing.T) {
	s := unconnected(t)
	ahead := time.Now().Add(time.Hour).UnixNano()
	s.peerOp(&Message{Drain: "x:1", Deadline: time.Minute}, ahead)
	for i := range maxLostOps + 10 {
		s.peerOp(&Message{Drain: fmt.Sprintf("u%d:1", i)}, time.Now().UnixNano())
	}
	undrain := Message{Undrain: "x:1"}
	s.numberOp(&undrain)
	if undrain.order <= ahead || len(s.opAt) > maxLostOps {
		t.Fatalf("after %d other upstreams' ops the undrain is placed at %d, before the fast drain (%d); %d times kept", maxLostOps+10, undrain.order, ahead, len(s.opAt))
	}
}
