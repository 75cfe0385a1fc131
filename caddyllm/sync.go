package caddyllm

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/llmaffinity/caddy-llm-affinity/drain"
	"github.com/llmaffinity/caddy-llm-affinity/fleetsync"
	"github.com/llmaffinity/caddy-llm-affinity/router"
)

// SyncConfig shares the routing view of several routers (Caddy instances)
// over NATS; see package fleetsync.
type SyncConfig struct {
	// URLs are the NATS servers, nats://host:port or tls://host:port.
	URLs []string `json:"urls"`

	// Subject is the NATS subject. Routers sharing a subject share a view.
	// Default llm_affinity.
	Subject string `json:"subject,omitempty"`

	// Name identifies this router to its peers (logs, the admin view).
	// Default: the host name and process id.
	Name string `json:"name,omitempty"`

	// Creds is a NATS credentials file.
	Creds string `json:"creds,omitempty"`

	// TLSCA is a PEM file of the authorities that sign the NATS servers'
	// certificates.
	TLSCA string `json:"tls_ca,omitempty"`
}

// Timing of peers' state.
const (
	// peerSilence is how long a peer may go unheard (it heartbeats every
	// second) before its charges are released: it died, or the network
	// parted and this router routes on its own view.
	peerSilence = 5 * time.Second
	// peerChargeLife is the longest a peer's charge is kept without its
	// release (which may have been lost), as Dynamo's routers expire
	// theirs.
	peerChargeLife = time.Hour
)

// syncKey is the pool key of a Syncer: one connection per distinct
// configuration, shared by every policy that uses it and kept across
// reloads.
func syncKey(c SyncConfig) string {
	if c.Subject == "" {
		c.Subject = fleetsync.DefaultSubject
	}
	b, _ := json.Marshal(c)
	return "sync\x00" + string(b)
}

// syncEntry is a Syncer in the pool.
type syncEntry struct {
	sh     *shared
	syncer *fleetsync.Syncer
}

// Destruct closes the connection: no loaded policy uses it any more.
func (e *syncEntry) Destruct() error {
	e.sh.removeSyncer(e.syncer)
	e.syncer.Close()
	e.sh.closedSyncer(e.syncer)
	return nil
}

// acquireSync takes a reference on the Syncer of c, connecting it when it
// is new, and returns it and its pool key for releaseSync. load names the
// config load acquiring it (the config running while it loads): see
// retireReplaced.
func (sh *shared) acquireSync(c SyncConfig, logger *zap.Logger, load context.Context) (*fleetsync.Syncer, string, error) {
	key := syncKey(c)
	val, _, err := pool.LoadOrNew(key, func() (caddy.Destructor, error) {
		s, err := fleetsync.New(fleetsync.Config{
			URLs: c.URLs, Subject: c.Subject, Name: c.Name, Creds: c.Creds, TLSCA: c.TLSCA,
			OnMessage: sh.applyPeer,
			OnHeard:   func(peer string) { sh.fleet.Heard(peer, time.Now()) },
			Resync:    sh.liveMessages,
			// The peer lost events and restates its charges under its
			// new name: the old name's go now.
			OnSuperseded: func(peer string) { sh.fleet.DropPeer(peer, time.Now()) },
			// This router lost its connection: its peers' releases of
			// the outage may be lost too. They restate their charges
			// when they hear its new name.
			OnRenewed: func(peers []string) {
				for _, peer := range peers {
					sh.fleet.DropPeer(peer, time.Now())
				}
			},
			Snapshot:   sh.snapshotMessages,
			OnSnapshot: sh.applySnapshot,
			Instance:   sh.instance,
			Logger:     logger,
		})
		if err != nil {
			return nil, err
		}
		if err := s.Start(); err != nil {
			return nil, err
		}
		sh.addSyncer(s)
		return &syncEntry{sh: sh, syncer: s}, nil
	})
	if err != nil {
		return nil, "", fmt.Errorf("sync: %w", err)
	}
	s := val.(*syncEntry).syncer
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if sh.syncLoads == nil {
		sh.syncLoads = make(map[*fleetsync.Syncer]context.Context)
	}
	sh.syncLoads[s] = load
	return s, key, nil
}

// retireReplaced, once the config load named load runs, makes s the
// successor of the connections of the same router (name and subject) that
// no policy of that load acquired: a reload that changed the sync options
// keeps the old connection until the old config is cleaned up (see
// fleetsync.Syncer.Replaces). Connections the loaded config still uses,
// several sync blocks of one config among them, stay. It returns the
// connections s replaces.
func (sh *shared) retireReplaced(s *fleetsync.Syncer, load context.Context) []*fleetsync.Syncer {
	sh.mu.Lock()
	defer sh.mu.Unlock()
	var replaced []*fleetsync.Syncer
	for _, old := range sh.loadSyncers() {
		if old != s && old.SameRouter(s) && sh.syncLoads[old] != load {
			s.Replaces(old)
			replaced = append(replaced, old)
		}
	}
	return replaced
}

func (sh *shared) releaseSync(key string) { pool.Delete(key) }

// liveMessages restates this router's charges in flight, for a new
// connection or one that lost some of its events (fleetsync.Config.Resync).
func (sh *shared) liveMessages() []fleetsync.Message {
	return eventMessages(nil, sh.fleet.LiveEvents())
}

// eventMessages appends events to msgs as messages.
func eventMessages(msgs []fleetsync.Message, events []router.Event) []fleetsync.Message {
	for i := range events {
		msgs = append(msgs, fleetsync.Message{Event: &events[i]})
	}
	return msgs
}

// snapshotMessages restates, for a router that starts, the operators'
// drains in force here, with what is left of their deadlines (first: they
// matter most), the index and the stored responses' homes
// (fleetsync.Config.Snapshot).
func (sh *shared) snapshotMessages() []fleetsync.Message {
	var msgs []fleetsync.Message
	now := time.Now()
	for _, st := range sh.drains.Snapshot() {
		if st.Phase != drain.Active.String() && sh.drains.HeldBy(st.Key, drain.ByAdmin) {
			msgs = append(msgs, fleetsync.Message{Drain: st.Key, Deadline: max(0, st.Deadline.Sub(now))})
		}
	}
	return eventMessages(msgs, sh.fleet.SnapshotEvents(fleetsync.MaxEventHashes))
}

// applySnapshot applies one message of the snapshot this router starts
// with: the peer's index and homes behind what this router learned
// itself, its operators' drains as a peer's drain is applied.
func (sh *shared) applySnapshot(peer string, m fleetsync.Message) {
	if m.Event != nil {
		sh.fleet.Restore(*m.Event, time.Now())
		return
	}
	sh.applyPeer(peer, m)
}

// addSyncer and removeSyncer keep the list publishing reads without a
// lock: the fleet publishes under its own lock, on every decision. The
// fleet has a publisher only while there is a list to publish to: without
// one it builds no event at all (a stream's every token made one).
func (sh *shared) addSyncer(s *fleetsync.Syncer) {
	sh.mu.Lock()
	defer sh.mu.Unlock()
	// First the publisher, which publishes nothing until the list has s.
	sh.fleet.SetPublisher(sh.publishEvent)
	list := append(slices.Clone(sh.loadSyncers()), s)
	sh.syncers.Store(&list)
	// The charges in flight are kept only while they are shared, for
	// restating them (see liveMessages).
	sh.fleet.KeepLive(true)
}

// removeSyncer stops publishing to s, which is closing; closedSyncer
// keeps its counters once it has closed.
func (sh *shared) removeSyncer(s *fleetsync.Syncer) {
	sh.mu.Lock()
	defer sh.mu.Unlock()
	list := slices.DeleteFunc(slices.Clone(sh.loadSyncers()), func(x *fleetsync.Syncer) bool { return x == s })
	sh.syncers.Store(&list)
	delete(sh.syncLoads, s)
	sh.closingSyncers = append(sh.closingSyncers, s)
	sh.fleet.KeepLive(len(list) > 0)
	if len(list) == 0 {
		// No peer any more: the fleet's drains are this router's own
		// affair again, and no undrain of them could reach it.
		sh.fleetDrains = nil
		sh.fleet.SetPublisher(nil)
		sh.dropPeersLocked()
	}
}

// dropPeersLocked releases every peer's charges, when no connection is
// left: no release of theirs can reach this router any more, and they
// stayed, counted as queued work, until the peers went silent
// (peerSilence). Caller holds sh.mu.
func (sh *shared) dropPeersLocked() {
	now := time.Now()
	for _, p := range sh.fleet.Peers() {
		sh.fleet.DropPeer(p.Name, now)
	}
}

func (sh *shared) closedSyncer(s *fleetsync.Syncer) {
	sh.mu.Lock()
	defer sh.mu.Unlock()
	sh.closedSync.add(s.Stats())
	sh.closingSyncers = slices.DeleteFunc(sh.closingSyncers, func(x *fleetsync.Syncer) bool { return x == s })
	if len(sh.loadSyncers()) == 0 {
		// Again, now that s is closed: a batch it was applying while
		// removeSyncer dropped the peers (the connection reads until
		// Close) charged a peer again, and named it heard.
		sh.dropPeersLocked()
	}
}

// syncTotals are the sync connections' counters, summed.
type syncTotals struct {
	sent, applied, dropped, disconnects, renewals, missed, snapshotsIn, snapshotsOut float64
}

func (t *syncTotals) add(st fleetsync.Stats) {
	t.sent += float64(st.Sent)
	t.applied += float64(st.Applied)
	t.dropped += float64(st.Dropped)
	t.disconnects += float64(st.Disconnects)
	t.renewals += float64(st.Renewals)
	t.missed += float64(st.Missed)
	t.snapshotsOut += float64(st.SnapshotsSent)
	if st.SnapshotFrom != "" {
		t.snapshotsIn++
	}
}

func (sh *shared) loadSyncers() []*fleetsync.Syncer {
	if p := sh.syncers.Load(); p != nil {
		return *p
	}
	return nil
}

// publishEvent is the fleet's publisher: it hands the event of one of this
// router's charges to every connection (queued, never blocking).
func (sh *shared) publishEvent(ev router.Event) {
	// The list can be empty for a moment (a syncer about to join it, or
	// the last one leaving): return before anything takes ev's address
	// (which would move it to the heap).
	if len(sh.loadSyncers()) > 0 {
		sh.publishCharge(ev)
	}
}

// publishCharge is publishEvent's slow path, a function of its own so that
// ev escapes only here.
func (sh *shared) publishCharge(ev router.Event) {
	sh.publish(fleetsync.Message{Event: &ev})
}

// publish hands m to every connection: a charge's event, or an operator's
// drain or undrain made here.
func (sh *shared) publish(m fleetsync.Message) {
	for _, s := range sh.loadSyncers() {
		s.Publish(m)
	}
}

// applyPeer applies one message of a peer: its charges to the fleet, its
// operator's drains to the drain registry as this router's operator's
// would be (an undrain lifts the operators' hold only). Upstreams this
// router does not route to are ignored.
func (sh *shared) applyPeer(peer string, m fleetsync.Message) {
	now := time.Now()
	switch {
	case m.Event != nil:
		if ev := m.Event; ev.Kind == router.EventRouted && sh.fleet.ForeignBlockTokens(ev.BlockTokens) {
			sh.warnForeignBlocks(peer, ev.BlockTokens)
		}
		sh.fleet.Apply(peer, *m.Event, now)
	case m.Drain != "":
		// Kept also for an upstream this router does not route to now:
		// a config that names it later takes the drain (nameUpstreams).
		sh.fleetOp(m.Drain, true, m.Deadline)
	case m.Undrain != "":
		sh.fleetOp(m.Undrain, false, 0)
	}
}

// warnForeignBlocks warns, once for each block size, that a peer hashes
// prompts in blocks of another size than this router: their prefixes
// never match, and a conversation's next turn through one is cold where
// the other routed it.
func (sh *shared) warnForeignBlocks(peer string, blockTokens int) {
	sh.mu.Lock()
	first := !slices.Contains(sh.foreignBlockTokens, blockTokens) && len(sh.foreignBlockTokens) < maxForeignBlockTokens
	if first {
		sh.foreignBlockTokens = append(sh.foreignBlockTokens, blockTokens)
	}
	sh.mu.Unlock()
	if first {
		sh.logger.Warn("a peer router hashes prompts in blocks of another size: no prefix it routes matches this router's, "+
			"so affinity across the two is lost; give every router on the sync subject the same block_tokens (and salt)",
			zap.String("peer", peer), zap.Int("peer_block_tokens", blockTokens), zap.Ints("block_tokens", sh.fleet.OwnBlockTokens()))
	}
}

// maxForeignBlockTokens bounds the block sizes warned of.
const maxForeignBlockTokens = 16

// SyncView is the sync state of the admin API: each connection's counters
// and the peers heard from.
type SyncView struct {
	Connections []fleetsync.Stats `json:"connections"`
	Peers       []PeerView        `json:"peers"`
	// ResponseHomes counts the stored Responses API responses whose
	// upstream this router knows, its own and its peers'.
	ResponseHomes int `json:"response_homes"`
	// FleetDrains are the upstreams of the operators' drains in force in
	// the fleet that this router keeps, to hold again should a config
	// name one again (see README: Several routers).
	FleetDrains []string `json:"fleet_drains"`
}

// PeerView is one peer router.
type PeerView struct {
	Name string `json:"name"`
	// LastSeenSeconds is how long ago the peer was last heard from.
	LastSeenSeconds float64 `json:"last_seen_seconds"`
	// Charges counts the peer's requests in flight that this router
	// counts as queued work.
	Charges int `json:"charges"`
}

func (sh *shared) syncView(now time.Time) SyncView {
	v := SyncView{Connections: []fleetsync.Stats{}, Peers: []PeerView{}, ResponseHomes: sh.fleet.ResponseHomes(), FleetDrains: sh.fleetDrainDials()}
	for _, s := range sh.loadSyncers() {
		v.Connections = append(v.Connections, s.Stats())
	}
	for _, p := range sh.fleet.Peers() {
		v.Peers = append(v.Peers, PeerView{Name: p.Name, LastSeenSeconds: now.Sub(p.LastSeen).Seconds(), Charges: p.Charges})
	}
	slices.SortFunc(v.Peers, func(a, b PeerView) int { return strings.Compare(a.Name, b.Name) })
	return v
}

// handleSync serves GET /llm_affinity/sync.
func handleSync(w http.ResponseWriter, r *http.Request) error {
	if r.Method != http.MethodGet {
		return methodNotAllowed(w, r, http.MethodGet)
	}
	v := SyncView{Connections: []fleetsync.Stats{}, Peers: []PeerView{}, FleetDrains: []string{}}
	if sh := lookupShared(); sh != nil {
		v = sh.syncView(time.Now())
	}
	w.Header().Set("Content-Type", "application/json")
	return json.NewEncoder(w).Encode(v)
}

// syncCollector exports the connections' counters, summed, at scrape time.
type syncCollector struct {
	sh                                                                      *shared
	events, connected, peers, disconnects, renewals, missed, snapshots, age *prometheus.Desc
}

func newSyncCollector(sh *shared) *syncCollector {
	return &syncCollector{
		sh: sh,
		events: prometheus.NewDesc("caddy_llm_affinity_sync_events_total",
			"Routing events shared with peer routers: sent, applied (received from peers), dropped (queue full or NATS unreachable).", []string{"direction"}, nil),
		connected: prometheus.NewDesc("caddy_llm_affinity_sync_connected",
			"NATS connections of the sync option that are up.", nil, nil),
		peers: prometheus.NewDesc("caddy_llm_affinity_sync_peers",
			"Peer routers heard from recently.", nil, nil),
		disconnects: prometheus.NewDesc("caddy_llm_affinity_sync_disconnects_total",
			"NATS connection losses.", nil, nil),
		renewals: prometheus.NewDesc("caddy_llm_affinity_sync_renewals_total",
			"New identities taken after events to the peers were lost, each restating the charges in flight.", nil, nil),
		missed: prometheus.NewDesc("caddy_llm_affinity_sync_missed_total",
			"Times peers' batches were lost on the way while connected (a gap in their numbering: a route between NATS servers broke; or the NATS client dropped them, this router reading too slowly), each followed by a renewal.", nil, nil),
		snapshots: prometheus.NewDesc("caddy_llm_affinity_sync_snapshots_total",
			"Snapshots of the view (prefix index, stored responses' homes, drains): received, by the connections that started with one; sent, to routers that started.", []string{"direction"}, nil),
		age: prometheus.NewDesc("caddy_llm_affinity_sync_last_event_age_seconds",
			"Time since the last batch from a peer arrived (absent before the first).", nil, nil),
	}
}

// Describe implements prometheus.Collector.
func (c *syncCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.events, c.connected, c.peers, c.disconnects, c.renewals, c.missed, c.snapshots, c.age} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (c *syncCollector) Collect(ch chan<- prometheus.Metric) {
	// Closed connections' counters stay in the sums: a counter that went
	// down on a reload would read as a reset, and rate() as a spike.
	sh := c.sh
	sh.mu.Lock()
	syncers := append(slices.Clone(sh.loadSyncers()), sh.closingSyncers...)
	live := len(sh.loadSyncers())
	totals := sh.closedSync
	sh.mu.Unlock()
	if len(syncers) == 0 && totals == (syncTotals{}) {
		return
	}
	var connected float64
	var last time.Time
	for i, s := range syncers {
		st := s.Stats()
		totals.add(st)
		if st.Connected && i < live {
			connected++
		}
		if st.LastReceived.After(last) {
			last = st.LastReceived
		}
	}
	ch <- prometheus.MustNewConstMetric(c.events, prometheus.CounterValue, totals.sent, "sent")
	ch <- prometheus.MustNewConstMetric(c.events, prometheus.CounterValue, totals.applied, "applied")
	ch <- prometheus.MustNewConstMetric(c.events, prometheus.CounterValue, totals.dropped, "dropped")
	ch <- prometheus.MustNewConstMetric(c.connected, prometheus.GaugeValue, connected)
	ch <- prometheus.MustNewConstMetric(c.peers, prometheus.GaugeValue, float64(len(sh.fleet.Peers())))
	ch <- prometheus.MustNewConstMetric(c.disconnects, prometheus.CounterValue, totals.disconnects)
	ch <- prometheus.MustNewConstMetric(c.renewals, prometheus.CounterValue, totals.renewals)
	ch <- prometheus.MustNewConstMetric(c.missed, prometheus.CounterValue, totals.missed)
	ch <- prometheus.MustNewConstMetric(c.snapshots, prometheus.CounterValue, totals.snapshotsIn, "received")
	ch <- prometheus.MustNewConstMetric(c.snapshots, prometheus.CounterValue, totals.snapshotsOut, "sent")
	if !last.IsZero() {
		ch <- prometheus.MustNewConstMetric(c.age, prometheus.GaugeValue, time.Since(last).Seconds())
	}
}
