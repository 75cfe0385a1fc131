package fleetsync

import (
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/url"
	"os"
	"reflect"
	"strconv"
	"strings"
	"sync"
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

// cuttableLink forwards TCP to target; cut closes its connections and
// refuses new ones until heal.
type cuttableLink struct {
	ln      net.Listener
	mu      sync.Mutex
	conns   []net.Conn
	refused bool
}

func newCuttableLink(t *testing.T, target string) *cuttableLink {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	l := &cuttableLink{ln: ln}
	t.Cleanup(func() { ln.Close(); l.cut() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			l.mu.Lock()
			refused := l.refused
			l.mu.Unlock()
			s, err := net.Dial("tcp", target)
			if refused || err != nil {
				c.Close()
				if s != nil {
					s.Close()
				}
				continue
			}
			l.mu.Lock()
			l.conns = append(l.conns, c, s)
			l.mu.Unlock()
			go func() { io.Copy(s, c); s.Close() }()
			go func() { io.Copy(c, s); c.Close() }()
		}
	}()
	return l
}

func (l *cuttableLink) cut() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.refused = true
	for _, c := range l.conns {
		c.Close()
	}
	l.conns = nil
}

func (l *cuttableLink) heal() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.refused = false
}

// routedCluster runs two clustered NATS servers whose route goes through
// a link the test can cut: their clients stay connected while it is cut.
func routedCluster(t *testing.T) (s1, s2 *server.Server, link *cuttableLink) {
	t.Helper()
	cluster := func() server.ClusterOpts {
		return server.ClusterOpts{Name: "c", Host: "127.0.0.1", Port: -1, NoAdvertise: true, PoolSize: -1}
	}
	s1 = natstest.StartWith(t, &server.Options{Port: -1, ServerName: "s1", Cluster: cluster()})
	link = newCuttableLink(t, s1.ClusterAddr().String())
	route, _ := url.Parse("nats-route://" + link.ln.Addr().String())
	s2 = natstest.StartWith(t, &server.Options{Port: -1, ServerName: "s2", Routes: []*url.URL{route}, Cluster: cluster()})
	waitFor(t, "the route up", func() bool { return s1.NumRoutes() > 0 && s2.NumRoutes() > 0 })
	return s1, s2, link
}

// TestRouteBreakIsNoticed: two routers on two servers of one NATS cluster,
// whose route breaks for a moment while both stay connected: what one
// publishes meanwhile (a release, an operator's drain) is lost for the
// other, and no disconnection tells either. The gap in its batch numbers
// does: the receiver renews, drops the peer's charges and has them
// restated, with the drain, so it counts what is in flight again.
func TestRouteBreakIsNoticed(t *testing.T) {
	s1, s2, link := routedCluster(t)
	a := startPeerRouter(t, s1.ClientURL(), "a", "test.route", "x:1")
	b := startPeerRouter(t, s2.ClientURL(), "b", "test.route", "x:1")
	waitFor(t, "both connected", func() bool { return a.syncer.Stats().Connected && b.syncer.Stats().Connected })
	released, kept := a.decide([]uint64{1}).Charge, a.decide([]uint64{2}).Charge
	waitFor(t, "b counting a's two requests", func() bool { return inFlightOn(b.fleet, "x:1") == 2 })
	// A router a has heard from before is one whose renewal makes a
	// restate its operators' drains (a new one has them from a snapshot).
	waitFor(t, "a hearing b", func() bool { return len(a.fleet.Peers()) == 1 })

	link.cut()
	waitFor(t, "the route down", func() bool { return s1.NumRoutes() == 0 && s2.NumRoutes() == 0 })
	sent := a.syncer.Stats().Sent
	a.fleet.Release(released, time.Now())
	a.syncer.Publish(Message{Drain: "x:1", Deadline: time.Minute}) // an operator's drain through a
	waitFor(t, "a publishing both", func() bool { return a.syncer.Stats().Sent >= sent+2 })
	link.heal()

	waitFor(t, "b counting only what a has in flight, and a's drain", func() bool {
		_, drained := b.drained.Load("x:1")
		return drained && inFlightOn(b.fleet, "x:1") == 1
	})
	// One of the two saw a gap first and renewed; the other heard its
	// new name.
	if sa, sb := a.syncer.Stats(), b.syncer.Stats(); sa.Missed+sb.Missed == 0 || sa.Renewals+sb.Renewals == 0 {
		t.Fatalf("a %+v\nb %+v", sa, sb)
	}
	a.fleet.Release(kept, time.Now())
	waitFor(t, "b counting nothing in flight", func() bool { return inFlightOn(b.fleet, "x:1") == 0 })
}

// TestSlowReaderIsNoticed: a router that reads its peers' batches too
// slowly has some dropped by the NATS client (past its pending limit)
// while the connection stays up. The client says so; the router renews,
// drops the peer's charges and has them restated, so a release among the
// dropped batches does not leave a charge counted for an hour.
func TestSlowReaderIsNoticed(t *testing.T) {
	ns := startNATS(t, -1)
	a := startPeerRouter(t, ns.ClientURL(), "a", "test.slow", "x:1")
	fb := router.New()
	fb.Name("x:1", time.Now())
	var gate sync.RWMutex
	b := startSyncer(t, Config{URLs: []string{ns.ClientURL()}, Name: "b", Subject: "test.slow",
		PendingBytes: 64 << 10,
		OnHeard:      func(peer string) { fb.Heard(peer, time.Now()) },
		OnRenewed: func(peers []string) {
			for _, p := range peers {
				fb.DropPeer(p, time.Now())
			}
		},
		OnMessage: func(peer string, m Message) {
			gate.RLock() // a slow apply
			defer gate.RUnlock()
			if m.Event != nil {
				fb.Apply(peer, *m.Event, time.Now())
			}
		}})
	waitFor(t, "both connected", func() bool { return a.syncer.Stats().Connected && b.Stats().Connected })
	waitFor(t, "b hearing a", func() bool { return len(fb.Peers()) == 1 })
	first := a.decide([]uint64{1}).Charge
	waitFor(t, "b counting a's request", func() bool { return inFlightOn(fb, "x:1") == 1 })

	gate.Lock()                    // b falls behind
	hashes := make([]uint64, 2048) // 16 KB a message: a few fill b's 64 KB
	for i := range 64 {
		sent := a.syncer.Stats().Sent
		a.syncer.Publish(Message{Event: &router.Event{Kind: router.EventRouted, ID: uint64(1000 + i), Dial: "x:1", Hashes: hashes, BlockTokens: 16, Prefill: 1, KV: 1}})
		a.syncer.Publish(Message{Event: &router.Event{Kind: router.EventReleased, ID: uint64(1000 + i)}})
		waitFor(t, "a publishing", func() bool { return a.syncer.Stats().Sent >= sent+2 })
	}
	a.fleet.Release(first, time.Now())
	waitFor(t, "the client dropping b's batches", func() bool { return b.Stats().Missed > 0 })
	gate.Unlock()
	waitFor(t, "b renewing, then counting nothing of a's in flight", func() bool {
		return b.Stats().Renewals > 0 && inFlightOn(fb, "x:1") == 0
	})
}

// TestReplacedConnectionStaysQuiet: a reload that changes the sync options
// but keeps the name opens a new connection (same Instance and name, a
// later epoch) while the old one lives until the old config is cleaned
// up. Once the new one is up the old publishes nothing, and a blip of its
// server does not make it renew: a renewal would give it the router's
// latest name, and the peers would ignore the new connection's batches.
func TestReplacedConnectionStaysQuiet(t *testing.T) {
	ns := startNATS(t, -1)
	link := newCuttableLink(t, ns.Addr().String())
	b := startPeerRouter(t, ns.ClientURL(), "b", "test.overlap", "x:1")
	fa := router.New()
	fa.Name("x:1", time.Now())
	resync := func() []Message { return eventMessages(fa.LiveEvents()) }
	const instance = 77
	old := startSyncer(t, Config{URLs: []string{"nats://" + link.ln.Addr().String()}, Name: "a", Subject: "test.overlap", Instance: instance, Resync: resync})
	waitFor(t, "the old connection up", func() bool { return old.Stats().Connected })
	replacing := startSyncer(t, Config{URLs: []string{ns.ClientURL()}, Name: "a", Subject: "test.overlap", Instance: instance, Resync: resync})
	if !replacing.SameRouter(old) {
		t.Fatal("two connections of one name and subject are not the same router")
	}
	replacing.Replaces(old)
	fa.SetPublisher(func(ev router.Event) {
		old.Publish(Message{Event: &ev})
		replacing.Publish(Message{Event: &ev})
	})
	fa.KeepLive(true)
	waitFor(t, "the old connection retired", func() bool { return old.Stats().Retired })
	waitFor(t, "b hearing the new connection", func() bool {
		for _, p := range b.fleet.Peers() {
			if p.Name == replacing.Name() {
				return true
			}
		}
		return false
	})

	link.cut() // the old connection's server blips
	waitFor(t, "the old connection noticing", func() bool { return !old.Stats().Connected })
	link.heal()
	waitFor(t, "the old connection back", func() bool { return old.Stats().Connected })
	old.Close() // the old config is cleaned up

	opts := router.Options{}.WithDefaults()
	c := fa.Decide(time.Now(), router.Request{Hashes: []uint64{1}, BlockTokens: 16, PromptTokens: 16},
		[]router.Member{{Dial: "x:1", Available: true, Healthy: true}}, &opts, rand.New(rand.NewPCG(1, 2)), nil).Charge
	waitFor(t, "b counting the request routed through the new connection", func() bool { return inFlightOn(b.fleet, "x:1") == 1 })
	if st := old.Stats(); st.Renewals != 0 || st.Sent != 0 {
		t.Fatalf("the retired connection renewed or sent: %+v", st)
	}
	fa.Release(c, time.Now())
	waitFor(t, "b counting nothing in flight", func() bool { return inFlightOn(b.fleet, "x:1") == 0 })
}

// TestPeerHeardAgainAfterSilence: a peer heard again under the same name
// after more than three heartbeats of silence may have dropped this
// router's charges as a silent peer's: this router restates them, and
// its operators' drains, whether or not the peer numbers its batches.
func TestPeerHeardAgainAfterSilence(t *testing.T) {
	for _, seqs := range [][2]uint64{{0, 0}, {7, 8}} {
		s, err := New(Config{URLs: []string{"nats://127.0.0.1:1"}, Name: "self", Subject: "x", Instance: 3})
		if err != nil {
			t.Fatal(err)
		}
		t0 := time.Now()
		b := &Batch{Sender: "peer", Epoch: 1, Instance: 9}
		s.latestName(b, seqs[0], t0)
		s.restate.Store(false)
		s.restateOps.Store(false)
		if current, gap := s.latestName(b, seqs[1], t0.Add(10*s.cfg.HeartbeatInterval)); !current || gap {
			t.Fatalf("seq %v: current %v, gap %v", seqs, current, gap)
		}
		if !s.restate.Load() || !s.restateOps.Load() {
			t.Errorf("seq %v: heard again after 10 heartbeats of silence: restate %v, restateOps %v", seqs, s.restate.Load(), s.restateOps.Load())
		}
	}
}

// TestReconnectIsNoGap: a router whose own connection drops and comes
// back counts a disconnection, and the batches its peers numbered
// meanwhile are no batches missed while connected.
func TestReconnectIsNoGap(t *testing.T) {
	ns := startNATS(t, -1)
	link := newCuttableLink(t, ns.Addr().String())
	a := startPeerRouter(t, ns.ClientURL(), "a", "test.reconnect", "x:1")
	b := startPeerRouter(t, "nats://"+link.ln.Addr().String(), "b", "test.reconnect", "x:1")
	waitFor(t, "b hearing a", func() bool { return len(b.fleet.Peers()) == 1 })
	link.cut()
	waitFor(t, "b disconnected", func() bool { return !b.syncer.Stats().Connected })
	sent := a.syncer.Stats().Sent
	c := a.decide([]uint64{1}).Charge // numbered while b is away
	waitFor(t, "a publishing", func() bool { return a.syncer.Stats().Sent > sent })
	link.heal()
	waitFor(t, "b back", func() bool { return b.syncer.Stats().Connected })
	back := time.Now()
	waitFor(t, "b hearing a again", func() bool { return b.syncer.Stats().LastReceived.After(back) })
	if st := b.syncer.Stats(); st.Missed != 0 || st.Disconnects == 0 {
		t.Fatalf("b: %+v", st)
	}
	a.fleet.Release(c, time.Now())
}

// TestStaleDrainDoesNotUndoLaterUndrain: an operator drains through a,
// the route between the NATS servers breaks, an operator undrains through
// b (a misses it), the route heals. Each router restates its operators'
// latest op; a's drain, made before b's undrain, is ignored where the
// undrain is known, and a takes b's undrain: both end undrained.
func TestStaleDrainDoesNotUndoLaterUndrain(t *testing.T) {
	s1, s2, link := routedCluster(t)
	a := startPeerRouter(t, s1.ClientURL(), "a", "test.ops", "x:1")
	b := startPeerRouter(t, s2.ClientURL(), "b", "test.ops", "x:1")
	waitFor(t, "both hearing each other", func() bool { return len(a.fleet.Peers()) == 1 && len(b.fleet.Peers()) == 1 })
	a.drained.Store("x:1", time.Minute) // the operator's drain, applied where it was made
	a.syncer.Publish(Message{Drain: "x:1", Deadline: time.Minute})
	waitFor(t, "b drained", func() bool { _, ok := b.drained.Load("x:1"); return ok })

	link.cut()
	waitFor(t, "the route down", func() bool { return s1.NumRoutes() == 0 && s2.NumRoutes() == 0 })
	sent := b.syncer.Stats().Sent
	b.drained.Delete("x:1") // the operator's undrain, later, through b
	b.syncer.Publish(Message{Undrain: "x:1"})
	waitFor(t, "b publishing", func() bool { return b.syncer.Stats().Sent > sent })
	link.heal()

	waitFor(t, "a taking b's undrain", func() bool { _, ok := a.drained.Load("x:1"); return !ok })
	// a no longer restates its drain, and b ignored it if it came first.
	waitFor(t, "a's drain no longer its own latest op", func() bool {
		a.syncer.opsMu.Lock()
		defer a.syncer.opsMu.Unlock()
		_, own := a.syncer.ownOps["x:1"]
		return !own
	})
	if _, ok := b.drained.Load("x:1"); ok {
		t.Fatalf("b drained again by a's earlier drain: a %+v\nb %+v", a.syncer.Stats(), b.syncer.Stats())
	}
}

// TestMissedBatchesWarnOncePerRenewal: a router that keeps losing its
// peers' batches (a peer that publishes faster than this router applies,
// so the NATS client drops some at every turn) renews at most every
// renewInterval, and warns once for each renewal it makes, not for each
// batch missed: a warning a batch came hundreds a second, written by the
// very goroutine that reads too slowly.
func TestMissedBatchesWarnOncePerRenewal(t *testing.T) {
	ns := startNATS(t, -1)
	core, logs := observer.New(zapcore.InfoLevel)
	b := startSyncer(t, Config{URLs: []string{ns.ClientURL()}, Name: "b", Subject: "test.gaps", Logger: zap.New(core)})
	waitFor(t, "b connected", func() bool { return b.Stats().Connected })
	nc, err := nats.Connect(ns.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	// A peer whose batches come with every other number missing, as a
	// client that drops every other one would deliver them.
	const batches = 50
	for i := range batches {
		msg := nats.NewMsg("test.gaps")
		msg.Header.Set(seqHeader, strconv.Itoa(2*i+1))
		msg.Data = AppendBatch(nil, &Batch{Sender: "a", Epoch: 1, Instance: 5})
		if err := nc.PublishMsg(msg); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, "b seeing every gap", func() bool { return b.Stats().Missed == batches-1 })
	warned := logs.FilterMessageSnippet("were lost on the way").Len()
	if renewals := b.Stats().Renewals; warned == 0 || uint64(warned) > renewals+1 {
		t.Fatalf("%d batches missed, %d renewals, %d warnings", batches-1, renewals, warned)
	}
}

// TestRefusedPublicationSaysWhy: a NATS server whose max_payload is below
// one event's size refuses it (batches are cut to the server's limit, but
// an event goes whole). The router counts its events as dropped and
// renews, as for any loss; it also says why, once, where before nothing
// told the operator why peers kept losing its events.
func TestRefusedPublicationSaysWhy(t *testing.T) {
	ns := natstest.StartWith(t, &server.Options{Port: -1, MaxPayload: 4096})
	core, logs := observer.New(zapcore.InfoLevel)
	a := startSyncer(t, Config{URLs: []string{ns.ClientURL()}, Name: "a", Subject: "test.payload", Logger: zap.New(core)})
	waitFor(t, "a connected", func() bool { return a.Stats().Connected })
	hashes := make([]uint64, 1024) // 8 KB: over the server's 4 KB
	for i := range 3 {
		dropped := a.Stats().Dropped
		a.Publish(Message{Event: &router.Event{Kind: router.EventRouted, ID: uint64(i + 1), Dial: "x:1", Hashes: hashes, BlockTokens: 16, Prefill: 1, KV: 1}})
		waitFor(t, "the publication refused", func() bool { return a.Stats().Dropped > dropped })
	}
	refused := logs.FilterMessageSnippet("NATS refused a publication")
	if refused.Len() != 1 || !strings.Contains(refused.All()[0].ContextMap()["error"].(string), "maximum payload") {
		t.Fatalf("3 publications refused, logged: %v", logs.All())
	}
}

// TestBadHeadersWarnOnce: a message on the subject whose NATS headers do
// not decode reaches the router anyway (the client passes it through, and
// a batch that does not decode is counted as malformed, not logged); the
// client also reports each to the error handler. Whoever may publish on
// the subject could send any number: the router warns of the first only,
// where it warned of each (a line a message, 5,000 lines for 5,000).
func TestBadHeadersWarnOnce(t *testing.T) {
	ns := startNATS(t, -1)
	core, logs := observer.New(zapcore.InfoLevel)
	b := startSyncer(t, Config{URLs: []string{ns.ClientURL()}, Name: "b", Subject: "test.headers", Logger: zap.New(core)})
	waitFor(t, "b connected", func() bool { return b.Stats().Connected })
	c, err := net.Dial("tcp", ns.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	// The protocol by hand: nats.go never sends a header block it cannot
	// decode.
	const messages = 20
	hdr, payload := "XXXXXXXX\r\n\r\n", "\x07"
	proto := "CONNECT {\"verbose\":false,\"headers\":true,\"protocol\":1}\r\n"
	for range messages {
		proto += fmt.Sprintf("HPUB test.headers %d %d\r\n%s%s\r\n", len(hdr), len(hdr)+len(payload), hdr, payload)
	}
	if _, err := io.WriteString(c, proto+"PING\r\n"); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "b counting them malformed", func() bool { return b.Stats().Malformed == messages })
	// The client reports errors and a lost connection in order: once b
	// has noticed the server dropping it, every report of the messages
	// before was handled.
	dropFromServer(t, ns, b, "b")
	if n := logs.FilterMessageSnippet("NATS error").Len() + logs.FilterMessageSnippet("headers").Len(); n == 0 || n > 1 {
		t.Fatalf("%d messages with bad headers, logged: %v", messages, logs.All())
	}
}

// TestRefusedPermissionWarnsOnce: a NATS user not allowed to publish on
// the sync subject (a permissions typo) has every batch refused, each
// reported to the error handler while the connection stays up. The router
// warns once, where it warned of each batch (4,390 lines in 4 s at 940
// requests/s).
func TestRefusedPermissionWarnsOnce(t *testing.T) {
	ns := natstest.StartWith(t, &server.Options{Port: -1, Users: []*server.User{{Username: "u", Password: "p",
		Permissions: &server.Permissions{Publish: &server.SubjectPermission{Allow: []string{"test.perm.snapshot"}}}}}})
	core, logs := observer.New(zapcore.InfoLevel)
	a := startSyncer(t, Config{URLs: []string{"nats://u:p@" + ns.Addr().String()}, Name: "a", Subject: "test.perm", Logger: zap.New(core)})
	waitFor(t, "a connected", func() bool { return a.Stats().Connected })
	const batches = 20
	for i := range batches {
		sent := a.Stats().Sent
		a.Publish(Message{Event: &router.Event{Kind: router.EventReleased, ID: uint64(i + 1)}})
		waitFor(t, "a publishing", func() bool { return a.Stats().Sent > sent })
	}
	// A ping answered means the server has sent every refusal before it.
	// The client reports errors and a lost connection in order: once a
	// has noticed the server dropping it, the refusals were all handled.
	if err := a.conn().Flush(); err != nil {
		t.Fatal(err)
	}
	dropFromServer(t, ns, a, "a")
	if n := logs.FilterMessageSnippet("NATS error").Len(); n != 1 {
		t.Fatalf("%d batches refused, %d warnings: %v", batches, n, logs.FilterMessageSnippet("NATS").All())
	}
}

// TestLostConnectionIsNoRefusedPublication: a publication the client
// refuses because the connection was just lost (with no reconnect buffer
// it answers ErrReconnectBufExceeded until the disconnection handler has
// run) is the connection's loss, which its handler logs: not a refusal
// to explain. A server shut down under a publishing router logged "NATS
// refused a publication" with "outbound buffer limit exceeded", an
// option this router sets on purpose, in two of five runs.
func TestLostConnectionIsNoRefusedPublication(t *testing.T) {
	core, logs := observer.New(zapcore.InfoLevel)
	s, err := New(Config{URLs: []string{"nats://127.0.0.1:1"}, Name: "a", Logger: zap.New(core)})
	if err != nil {
		t.Fatal(err)
	}
	var logged loggedReasons
	for _, err := range []error{nats.ErrReconnectBufExceeded, nats.ErrConnectionClosed, nats.ErrConnectionReconnecting,
		nats.ErrConnectionDraining, fmt.Errorf("write: %w", os.ErrDeadlineExceeded)} {
		s.notePublishError(err, &logged)
	}
	if logs.Len() != 0 {
		t.Fatalf("the connection's loss logged as a refusal: %v", logs.All())
	}
	s.notePublishError(nats.ErrMaxPayload, &logged)
	if logs.FilterMessageSnippet("NATS refused a publication").Len() != 1 {
		t.Fatalf("a refusal not logged: %v", logs.All())
	}
}

// dropFromServer has the server drop the connection of s, the syncer
// named name, and waits until s has noticed: the client reports errors and
// a lost connection in order, so every report before was handled by then.
func dropFromServer(t *testing.T, ns *server.Server, s *Syncer, name string) {
	t.Helper()
	connz, err := ns.Connz(&server.ConnzOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, ci := range connz.Conns {
		if ci.Name == "caddy-llm-affinity "+name {
			if err := ns.DisconnectClientByID(ci.Cid); err != nil {
				t.Fatal(err)
			}
		}
	}
	waitFor(t, name+" noticing the disconnection", func() bool { return s.Stats().Disconnects > 0 })
}

// TestBatchesFitTheServersPayload: a NATS server whose max_payload is
// below the batches' bound (256 KB) gets publications within its own
// limit: a router's restatement of what it has in flight, and its answer
// to a starting router's snapshot, are each forty 2 KB events, which in
// one publication the server refused (every event of it lost, and lost
// again at each renewal).
func TestBatchesFitTheServersPayload(t *testing.T) {
	ns := natstest.StartWith(t, &server.Options{Port: -1, MaxPayload: 16 << 10})
	const events = 40
	live := make([]Message, events)
	for i := range live {
		hashes := make([]uint64, 256) // 2 KB
		for j := range hashes {
			hashes[j] = uint64(i)<<32 | uint64(j+1)
		}
		live[i] = Message{Event: &router.Event{Kind: router.EventRouted, ID: uint64(i + 1), Dial: "x:1", Hashes: hashes, BlockTokens: 16, Prefill: 1, KV: 1}}
	}
	var rb received
	b := startSyncer(t, rb.config(Config{URLs: []string{ns.ClientURL()}, Name: "b", Subject: "test.fit"}))
	waitFor(t, "b connected", func() bool { return b.Stats().Connected })
	core, logs := observer.New(zapcore.InfoLevel)
	a := startSyncer(t, Config{URLs: []string{ns.ClientURL()}, Name: "a", Subject: "test.fit", Logger: zap.New(core),
		Resync:   func() []Message { return live },
		Snapshot: func() []Message { return live }})
	waitFor(t, "b receiving a's restatement", func() bool { return rb.count() >= events })
	if st := a.Stats(); st.Dropped != 0 || logs.FilterMessageSnippet("NATS refused").Len() != 0 {
		t.Fatalf("a's stats %+v, logged %v", st, logs.All())
	}
	var snapshot []Message
	var mu sync.Mutex
	c := startSyncer(t, Config{URLs: []string{ns.ClientURL()}, Name: "c", Subject: "test.fit",
		OnSnapshot: func(_ string, m Message) { mu.Lock(); snapshot = append(snapshot, m); mu.Unlock() }})
	waitFor(t, "c's snapshot", func() bool { return c.Stats().SnapshotFrom != "" })
	mu.Lock()
	defer mu.Unlock()
	if len(snapshot) != events || !reflect.DeepEqual(snapshot[events-1].Event.Hashes, live[events-1].Event.Hashes) {
		t.Fatalf("c's snapshot from %q: %d messages, want %d", c.Stats().SnapshotFrom, len(snapshot), events)
	}
}
