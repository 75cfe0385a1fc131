package router

import (
	"maps"
	"slices"
	"strings"
	"time"
)

// Several routers in front of the same upstreams share one view by telling
// each other what they charged: each Fleet publishes an Event for every
// change to its own charges, and applies its peers' events to its state as
// if it had made those charges itself. The prefix index learns what peers
// routed, peers' charges count as queued work until released, their
// completions teach the output estimate, and the responses they saw
// stored tell where a conversation continues. Events carry hashes, counts
// and response ids, never prompt text. Delivery is best-effort: a lost
// charge event is made good by expiry, and a peer that goes silent loses
// its charges; a lost forget leaves blocks in the peers' indexes until
// they are evicted.

// EventKind says what happened to a charge.
type EventKind uint8

// Event kinds.
const (
	// EventRouted: a request was charged to Dial.
	EventRouted EventKind = iota + 1
	// EventProgressed: the request's response has produced Tokens output
	// tokens so far (the first one ends the prefill charge).
	EventProgressed
	// EventCompleted: the response completed with Tokens output tokens
	// for Model, its prompt PromptTokens tokens as the engine counted it
	// and PromptBytes bytes as the router read it (0 when not known); the
	// charge is released.
	EventCompleted
	// EventReleased: the request ended without a completed response; the
	// charge is released.
	EventReleased
	// EventStored: Dial answered, and stored, the Responses API response
	// Response (see Fleet.RememberResponse). It is about no charge.
	EventStored
	// EventCached: Dial's engine holds the prefix blocks Hashes, as the
	// sending router's index has them, most recently used first, in an
	// index sized for KV tokens of blocks of BlockTokens, or (with
	// Adapter) the LoRA adapter Adapter was charged there. It is about no
	// charge: a router that starts learns its peers' view this way (see
	// SnapshotEvents and Restore; Apply ignores it).
	EventCached
	// EventForgot: the charge ID, whose request's chain is Hashes, failed
	// before its first token, so Dial's engine most likely did not
	// prefill the blocks its routing added to the indexes: from From on
	// in the sender's (the blocks before were held there already, or
	// another request's prefill ran through them). It comes before the
	// charge's EventReleased. Peers forget what its routing added to
	// theirs, except what their own requests' prefills there hold.
	EventForgot
	// EventPrefilled: Dial's engine prefilled the blocks Hashes no
	// earlier than At (zero: unknown), which a failure or an engine
	// restart had made the sending router's index forget, or which it
	// kept from a peer's forget (see EventForgot). ID, when set, is the
	// charge whose first token said so; the event changes no charge. A
	// router that saw the engine restart since At ignores it: the engine
	// may have lost them.
	EventPrefilled
)

// Event is one change to a router's charges, as its peers learn it.
type Event struct {
	Kind EventKind
	// ID names the charge within the router that made it.
	ID uint64
	// Dial, Hashes, BlockTokens, the charges and Adapter describe a
	// routed request.
	Dial        string
	Hashes      []uint64
	BlockTokens int
	Prefill     int
	Decode      int
	// KV is a routed request's KV tokens, or the KV capacity a cached
	// event's index was sized for.
	KV      int
	Adapter string
	// Model is a completed request's model field.
	Model string
	// Tokens is the output so far (progressed), or the whole output of
	// each of the request's sequences on average (completed: all of it
	// for one sequence; see Request.Sequences).
	Tokens int
	// PromptBytes and PromptTokens of a completed request teach the
	// model's bytes per token, as its own responses teach the router.
	PromptBytes, PromptTokens int
	// Response is a stored response's id.
	Response string
	// From is where a forgot event's sender forgot its chain from.
	From int
	// At is, on the sender's clock, a time no later than a prefilled
	// event's prefill (a first token, or a waiting request's decision,
	// before which nothing it shares was confirmed).
	At time.Time
}

// SenderForgot is the blocks a forgot event's sender forgot: its
// Hashes from From on.
func (ev *Event) SenderForgot() []uint64 {
	return ev.Hashes[min(max(0, ev.From), len(ev.Hashes)):]
}

// KeepLive makes f keep its own charges in flight, from now on, for
// LiveEvents (a router that shares its view), or stop keeping them.
func (f *Fleet) KeepLive(on bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if on == (f.local != nil) {
		return
	}
	f.local = nil
	if on {
		f.local = make(map[uint64]*Charge)
	}
}

// LiveEvents restates this router's charges in flight (those made while
// KeepLive was on) as the events a peer that never heard of them needs:
// each one routed with what it still holds, then its output so far. A
// router whose events to its peers were lost sends them under a new name
// (see fleetsync), so that its peers count what is in flight, no more.
// The prefix hashes are left out: the index learned them the first time,
// and a peer's index entries do not go with the name.
func (f *Fleet) LiveEvents() []Event {
	f.mu.Lock()
	defer f.mu.Unlock()
	// A charge leaves local when released: all of them are in flight.
	ids := slices.Sorted(maps.Keys(f.local))
	out := make([]Event, 0, 2*len(ids))
	for _, id := range ids {
		c := f.local[id]
		// The output so far follows, and lowers the decode charge as it
		// did here: routed with what it had then, it ends with what it
		// holds now.
		out = append(out, Event{Kind: EventRouted, ID: id, Dial: c.dial, Prefill: c.prefill, Decode: c.decode + c.Tokens, KV: c.kv})
		if c.Tokens > 0 {
			out = append(out, Event{Kind: EventProgressed, ID: id, Tokens: c.Tokens})
		}
	}
	return out
}

// SnapshotEvents restates what this router knows that outlives any
// charge, for a router that starts (see fleetsync), which applies them in
// order with Restore: what its index holds of each upstream (EventCached,
// at most maxHashes hashes an event), the adapters charged there
// (EventCached with Adapter) and the stored responses' homes
// (EventStored), each most recent first. Charges in flight are each
// router's own to restate (see LiveEvents).
func (f *Fleet) SnapshotEvents(maxHashes int) []Event {
	type holding struct {
		dial                  string
		capacity, blockTokens int
		adapters              []string
	}
	f.mu.Lock()
	held := make([]holding, 0, len(f.upstreams))
	for dial, u := range f.upstreams {
		if !u.forgotten {
			held = append(held, holding{dial, u.capacityTokens, u.indexBlockTokens, slices.Clone(u.adapters)})
		}
	}
	f.mu.Unlock()
	slices.SortFunc(held, func(a, b holding) int { return strings.Compare(a.dial, b.dial) })

	// The index has locks of its own: decisions need not wait for the
	// copy.
	var out []Event
	var hashes []uint64
	maxHashes = max(1, maxHashes)
	for _, h := range held {
		hashes = f.index.Entries(h.dial, hashes[:0])
		for len(hashes) > 0 {
			n := min(len(hashes), maxHashes)
			out = append(out, Event{Kind: EventCached, Dial: h.dial, Hashes: slices.Clone(hashes[:n]), KV: h.capacity, BlockTokens: h.blockTokens})
			hashes = hashes[n:]
		}
		for _, a := range h.adapters {
			out = append(out, Event{Kind: EventCached, Dial: h.dial, Adapter: a})
		}
	}
	for _, home := range f.homes.newestFirst() {
		out = append(out, Event{Kind: EventStored, Dial: home.dial, Response: home.id})
	}
	return out
}

// Restore applies one of a peer's SnapshotEvents, in their order, and
// reports whether it changed anything. What it restores goes behind what
// this router learned itself, which is more recent, and never evicts
// that: index blocks (see prefixindex.Index.Restore) and stored
// responses' homes. Events for an upstream this router does not know yet
// (a dynamic one, known at its first request) are kept for it, within
// pendingRestoreLife; those for an upstream it forgot are ignored.
func (f *Fleet) Restore(ev Event, now time.Time) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	u := f.upstreams[ev.Dial]
	switch {
	case u == nil:
		f.keepForLater(ev, now)
		return false
	case u.forgotten:
		return false
	}
	return f.restore(u, ev, now)
}

// restore applies a snapshot's event to u. Caller holds f.mu.
func (f *Fleet) restore(u *upstream, ev Event, now time.Time) bool {
	switch ev.Kind {
	case EventCached:
		if ev.Adapter != "" {
			u.restoreAdapter(ev.Adapter)
			return true
		}
		f.applyCached(u, ev, now)
		return true
	case EventStored:
		return f.homes.restore(ev.Response, u.dial)
	}
	return false
}

// Bounds of the snapshot events kept for upstreams not known yet.
const (
	pendingRestoreLife  = 5 * time.Minute
	maxPendingDials     = 1024
	maxPendingHashes    = 1 << 20
	maxPendingResponses = MaxResponseHomes
	// maxPendingOthers bounds the events that carry neither hashes nor a
	// response (an upstream's adapters): a snapshot has at most
	// maxEngineAdapterSlots of them an upstream.
	maxPendingOthers = 1 << 14
	// maxPendingForgot bounds the blocks failures made the peers forget
	// that the snapshots kept leave out (see forgetPending).
	maxPendingForgot = 1 << 16
)

// pendingRestore is a peer's snapshot events for one upstream this router
// does not know yet, and when they came; forgot, the blocks failures
// there made the peers forget since (see forgetPending).
type pendingRestore struct {
	at     time.Time
	events []Event
	forgot map[uint64]struct{}
}

// keepForLater keeps ev for its upstream, within bounds. Caller holds
// f.mu.
func (f *Fleet) keepForLater(ev Event, now time.Time) {
	if ev.Kind != EventCached && ev.Kind != EventStored || ev.Dial == "" {
		return
	}
	if f.pending == nil {
		f.pending = make(map[string]*pendingRestore)
	}
	p := f.pending[ev.Dial]
	if p == nil {
		if len(f.pending) >= maxPendingDials {
			return
		}
		p = &pendingRestore{at: now}
		f.pending[ev.Dial] = p
	}
	other := ev.Kind == EventCached && len(ev.Hashes) == 0
	switch {
	case ev.Kind == EventCached && f.pendingHashes+len(ev.Hashes) > maxPendingHashes,
		ev.Kind == EventStored && f.pendingResponses >= maxPendingResponses,
		other && f.pendingOthers >= maxPendingOthers:
		return
	}
	f.pendingHashes += len(ev.Hashes)
	if ev.Kind == EventStored {
		f.pendingResponses++
	}
	if other {
		f.pendingOthers++
	}
	p.events = append(p.events, ev)
}

// expirePending drops what peers' snapshots had for upstreams that did not
// come within pendingRestoreLife (a peer's other sites). Caller holds
// f.mu.
func (f *Fleet) expirePending(now time.Time) {
	for dial, p := range f.pending {
		if now.Sub(p.at) > pendingRestoreLife {
			f.takePending(dial)
		}
	}
}

// restorePending applies what a peer's snapshot had for u, a new
// upstream, if it came within pendingRestoreLife. Caller holds f.mu.
func (f *Fleet) restorePending(u *upstream, now time.Time) {
	p := f.takePending(u.dial)
	if p == nil || now.Sub(p.at) > pendingRestoreLife {
		return
	}
	for _, ev := range p.events {
		if ev.Kind == EventCached && len(p.forgot) > 0 {
			ev.Hashes = slices.DeleteFunc(slices.Clone(ev.Hashes), func(h uint64) bool { _, ok := p.forgot[h]; return ok })
		}
		f.restore(u, ev, now)
	}
}

// takePending removes and returns what is kept for dial, nil for nothing.
// Caller holds f.mu.
func (f *Fleet) takePending(dial string) *pendingRestore {
	p := f.pending[dial]
	if p == nil {
		return nil
	}
	delete(f.pending, dial)
	f.pendingForgot -= len(p.forgot)
	for _, ev := range p.events {
		f.pendingHashes -= len(ev.Hashes)
		switch {
		case ev.Kind == EventStored:
			f.pendingResponses--
		case len(ev.Hashes) == 0:
			f.pendingOthers--
		}
	}
	return p
}

// maxCachedCapacity bounds the KV capacity, in tokens, a peer's cached
// event may size an index by: 8M tokens, past the largest engines'
// caches, 512k blocks (about 20 MB of index) at vLLM's 16-token blocks.
const maxCachedCapacity = 1 << 23

// applyCached restores a peer's index holdings of u (see SnapshotEvents):
// behind what this router learned itself, which is more recent. An index
// this router never sized takes the peer's capacity, so that it is not
// cut to the default. Caller holds f.mu.
func (f *Fleet) applyCached(u *upstream, ev Event, now time.Time) {
	if ev.BlockTokens >= minPeerBlockTokens {
		capacity := u.capacityTokens
		if capacity == 0 {
			capacity = min(max(0, ev.KV), maxCachedCapacity)
			u.capacityFromPeer = capacity > 0
		}
		if capacity > 0 {
			f.sizeIndex(u, capacity, ev.BlockTokens, now)
		}
	}
	f.index.Restore(u.id, ev.Hashes)
}

// remoteKey names a peer's charge.
type remoteKey struct {
	peer string
	id   uint64
}

// SetPublisher makes f call publish with every change to its own charges.
// publish runs under the fleet's lock, in the order of the changes: it
// must not block (hand the event to a bounded queue), and must copy
// Hashes if it keeps them beyond the call.
func (f *Fleet) SetPublisher(publish func(Event)) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.publisher = publish
	f.publishing.Store(publish != nil)
}

// publish hands ev to the publisher, if any. Caller holds f.mu.
func (f *Fleet) publish(ev Event) {
	if f.publisher != nil {
		f.publisher(ev)
	}
}

// Apply applies peer's event at now, as if f had made the change itself,
// and reports whether it changed anything. Events for upstreams f does
// not route to (no config of this router names them, it never routed
// there, or it forgot them) are ignored, as are events of charges it
// never saw routed; except a forget, which forgets from the root what a
// charge it does not know may have added (see applyForgot), and is noted
// for a peer's snapshot kept for an upstream not known yet (see
// forgetPending).
func (f *Fleet) Apply(peer string, ev Event, now time.Time) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.hear(peer, now) {
		return false
	}
	if ev.Kind == EventStored {
		if u := f.upstreams[ev.Dial]; u == nil || u.forgotten {
			// Stored where this router does not route: what it knew of
			// the id is out of date.
			f.homes.forget(ev.Response)
			return false
		}
		return f.homes.remember(ev.Response, ev.Dial)
	}
	key := remoteKey{peer, ev.ID}
	if ev.Kind == EventForgot || ev.Kind == EventPrefilled {
		u := f.upstreams[ev.Dial]
		switch {
		case len(ev.Hashes) == 0:
			return false
		case u == nil && ev.Kind == EventForgot:
			// Perhaps in a peer's snapshot kept for it: the sender's
			// depth is the best guess of what was held before.
			return f.forgetPending(ev.Dial, ev.SenderForgot())
		case u == nil || u.forgotten:
			return false
		case ev.Kind == EventPrefilled:
			if !ev.At.IsZero() && !ev.At.After(u.engineRestart) {
				return false // prefilled by the engine before it restarted
			}
			f.index.Insert(u.id, ev.Hashes)
			return true
		}
		// From this router's own depth at the routing: without it (a
		// charge restated without hashes, or dropped with its peer's
		// earlier name), from the root, since the sender's depth may be
		// more than this index held. That loses hits only.
		from := 0
		if c := f.remote[key]; c != nil && c.up == u && c.held >= 0 {
			from = min(int(c.held), len(ev.Hashes))
		}
		f.applyForgot(u, ev.Hashes, from)
		return true
	}
	if ev.Kind == EventRouted {
		u := f.upstreams[ev.Dial]
		if u == nil || u.forgotten || f.remoteCharges[peer] >= maxPeerCharges || len(f.remote) >= maxRemoteCharges {
			return false
		}
		if c := f.remote[key]; c != nil {
			// Counted already, from a restatement that overtook the
			// routing (restatements carry no hashes): the prefix is
			// still news.
			if len(ev.Hashes) == 0 || c.up != u {
				return false
			}
			c.held = int32(f.index.Insert(u.id, ev.Hashes))
			return true
		}
		// A peer's figures are bounded by what one request can hold: a
		// wrong one (or a hostile peer) must not fill the upstream's KV
		// for every local request.
		limit := MaxTokens
		if capacity := max(u.engineCapacityTokens, u.capacityTokens); capacity > 0 {
			limit = capacity
		}
		c := f.charge(u, min(max(0, ev.Prefill), limit), min(max(0, ev.Decode), limit), min(max(0, ev.KV), limit), now, nil)
		c.id, c.remote = ev.ID, true
		f.remote[key] = c
		f.remoteCharges[peer]++
		if ev.Adapter != "" {
			u.useAdapter(ev.Adapter, 0)
		}
		// Blocks smaller than an engine's would size the index beyond
		// any cache.
		if ev.BlockTokens >= minPeerBlockTokens && u.capacityTokens > 0 {
			f.sizeIndex(u, u.capacityTokens, ev.BlockTokens, now)
		}
		// What it adds here is what its failure takes back here.
		c.held = -1
		if len(ev.Hashes) > 0 {
			c.held = int32(f.index.Insert(u.id, ev.Hashes))
		}
		return true
	}
	c := f.remote[key]
	if c == nil {
		return false
	}
	switch ev.Kind {
	case EventProgressed:
		if n := ev.Tokens - c.Tokens; n > 0 {
			f.progress(c, n, now)
		}
		return true
	case EventCompleted:
		f.learn(ev.Model, ev.PromptBytes, Usage{PromptTokens: ev.PromptTokens, OutputTokens: ev.Tokens})
		c.up.completed++
	case EventReleased:
	default:
		return false
	}
	f.dropRemote(key)
	f.release(c, now)
	return true
}

// applyForgot makes u's index forget the blocks a peer's request, whose
// chain was hashes, failed to prefill there (EventForgot): those from from
// on, which its routing added here. Except those a prefill of this
// router's there ran through: one still in flight, or one a request still
// waiting there shares blocks with (its kept). The peers, which forgot
// them too, learn them again. This router's requests still waiting for
// their first token there insert their chains again at it (see forget).
// Caller holds f.mu.
func (f *Fleet) applyForgot(u *upstream, hashes []uint64, from int) {
	// at is no later than the engine's prefill of the blocks kept: the
	// first token of the request that ran through them, or, for a
	// waiting request's kept, its decision (the prefill came after it).
	held, at := 0, time.Time{}
	for _, c := range u.prefilled {
		if n := sharedBlocks(c.chain, hashes); n > held {
			held, at = n, c.FirstToken
		}
	}
	for _, c := range u.pending {
		if n := min(int(c.kept), sharedBlocks(c.chain, hashes)); n > held {
			held, at = n, c.Started
		}
	}
	if held > 0 {
		f.publish(Event{Kind: EventPrefilled, Dial: u.dial, Hashes: hashes[:held], At: at})
	}
	from = max(from, held)
	f.forget(u, from, hashes[from:])
}

// forgetPending notes hashes, blocks a peer's request failed to prefill
// at dial, for the peer's snapshot kept for dial (see keepForLater), which
// then restores without them; it reports whether there is such a
// snapshot. At most maxPendingForgot blocks are noted. Caller holds f.mu.
func (f *Fleet) forgetPending(dial string, hashes []uint64) bool {
	p := f.pending[dial]
	if p == nil {
		return false
	}
	if p.forgot == nil {
		p.forgot = make(map[uint64]struct{})
	}
	for _, h := range hashes {
		if f.pendingForgot >= maxPendingForgot {
			break
		}
		if _, ok := p.forgot[h]; !ok {
			p.forgot[h] = struct{}{}
			f.pendingForgot++
		}
	}
	return true
}

// maxPeerCharges bounds one peer's charges in flight here, and
// maxRemoteCharges all peers' together; routed events beyond them are
// ignored. maxPeers bounds the peers heard at once: events of a new one
// beyond it are ignored until one goes silent (a fleet has tens of
// routers; a sender inventing names must not grow the table).
// minPeerBlockTokens is the smallest block a peer's events may size an
// index by (an engine's block: vLLM's is 16).
const (
	maxPeerCharges     = 1 << 16
	maxRemoteCharges   = 1 << 18
	maxPeers           = 256
	minPeerBlockTokens = 16
)

// hear records that peer was alive at now, and reports false for a new
// peer beyond maxPeers, whose events are ignored. Caller holds f.mu.
func (f *Fleet) hear(peer string, now time.Time) bool {
	if _, known := f.peers[peer]; !known && len(f.peers) >= maxPeers {
		return false
	}
	f.peers[peer] = now
	return true
}

// dropRemote forgets a peer's charge. Caller holds f.mu.
func (f *Fleet) dropRemote(key remoteKey) {
	delete(f.remote, key)
	if f.remoteCharges[key.peer]--; f.remoteCharges[key.peer] <= 0 {
		delete(f.remoteCharges, key.peer)
	}
}

// DropPeer releases peer's charges and forgets it, at once: the peer took
// a new name, under which it restates what it still has in flight (see
// LiveEvents). It returns how many charges it released.
func (f *Fleet) DropPeer(peer string, now time.Time) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	n := 0
	if f.remoteCharges[peer] > 0 {
		n = f.releaseRemote(now, func(key remoteKey, _ *Charge) bool { return key.peer == peer })
	}
	delete(f.peers, peer)
	return n
}

// releaseRemote releases the peers' charges drop picks and returns how
// many. Caller holds f.mu.
func (f *Fleet) releaseRemote(now time.Time, drop func(remoteKey, *Charge) bool) int {
	n := 0
	for key, c := range f.remote {
		if drop(key, c) {
			f.dropRemote(key)
			f.release(c, now)
			n++
		}
	}
	return n
}

// Heard records that peer was alive at now (a heartbeat), so its charges
// are kept.
func (f *Fleet) Heard(peer string, now time.Time) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.hear(peer, now)
}

// ExpirePeers releases the charges of peers not heard from since
// silentSince (the router died or the network parted: its requests are
// finished or will never be reported) and peers' charges made before
// chargedBefore (their release was lost), and drops what peers'
// snapshots had for upstreams that never came. It returns how many
// charges it released.
func (f *Fleet) ExpirePeers(now, silentSince, chargedBefore time.Time) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	n := f.releaseRemote(now, func(key remoteKey, c *Charge) bool {
		return f.peers[key.peer].Before(silentSince) || c.Started.Before(chargedBefore)
	})
	f.expirePending(now)
	for peer, seen := range f.peers {
		if seen.Before(silentSince) {
			delete(f.peers, peer)
		}
	}
	return n
}

// PeerState is what a router knows of one peer, for the admin view.
type PeerState struct {
	Name     string
	LastSeen time.Time
	// Charges counts the peer's charges in flight here.
	Charges int
}

// Peers lists the peers heard from and their charges in flight.
func (f *Fleet) Peers() []PeerState {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := make([]PeerState, 0, len(f.peers))
	for name, seen := range f.peers {
		out = append(out, PeerState{Name: name, LastSeen: seen, Charges: f.remoteCharges[name]})
	}
	return out
}
