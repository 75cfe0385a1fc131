// Package router is llm_affinity's decision engine. A Fleet holds what
// the router knows of every upstream it routes to, keyed by dial address:
// the prefix index of the prompts it sent there, the work it charged there
// and not yet saw finish, the output lengths it learned per model and the
// LoRA adapters it presumes resident. Decide turns a request and the
// upstreams it may go to into a choice (calling package scorer) and
// charges it; Progress, Complete and Release account for the response.
//
// It knows nothing of Caddy or HTTP, and time is always an argument: the
// Caddy policy (package caddyllm) drives it with the wall clock, the
// benchmark's simulator (package llmbench) in virtual time, through the
// very same functions.
package router

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/llmaffinity/caddy-llm-affinity/prefixindex"
	"github.com/llmaffinity/caddy-llm-affinity/scorer"
	"github.com/llmaffinity/caddy-llm-affinity/scrape"
)

// Fleet is the routing state of a set of upstreams. It is safe for
// concurrent use: one mutex serialises decisions with the charges they
// make, so two concurrent requests never both see an idle upstream.
type Fleet struct {
	// homes are the stored responses' upstreams (see Request.Home).
	homes responseHomes
	// pending holds a peer's snapshot events for upstreams not known yet
	// (see Restore), pendingHashes, pendingResponses and pendingOthers what
	// they hold, pendingForgot the blocks they leave out.
	pending                                                       map[string]*pendingRestore
	pendingHashes, pendingResponses, pendingOthers, pendingForgot int

	mu        sync.Mutex
	index     *prefixindex.Index
	upstreams map[string]*upstream
	// models holds what responses taught of each model (bounded, see
	// maxModels); modelClock orders their use.
	models     map[string]*modelStats
	modelClock uint64
	// lastModel is the entry of models under lastModelName that the last
	// lookup found (nil for none): a request looks its model up three
	// times, and most requests name the model the one before did.
	lastModelName string
	lastModel     *modelStats
	// meanPrompt is the running mean of charged (uncached) prompt
	// lengths, for sizing requests the router sees only as counts in
	// engine metrics.
	meanPrompt runningMean
	// outputs are the output lengths of the responses completed, every
	// model's, for the output still to come of a request in flight.
	outputs outputLengths

	// holds are the requests waiting at the gateway (see Hold), held
	// counts them by their Options, and releases counts releases of work.
	holds []*Hold
	held  map[*Options]int
	// releases is written under mu; Releases reads it without.
	releases atomic.Uint64
	// decisions counts Decide's calls that took mu (see Decisions).
	decisions atomic.Uint64
	// ownBlockTokens are the block sizes this router's requests were
	// hashed with (one a handler; a few at most), written under mu and
	// read without it (see ForeignBlockTokens).
	ownBlockTokens atomic.Pointer[[]int]

	// publisher receives the events of this router's own charges; remote
	// holds the peers' charges applied here, peers when each peer was
	// last heard from; nextID numbers this router's charges.
	publisher func(Event)
	// publishing says publisher is set, for RememberResponse, which need
	// not take mu without one.
	publishing atomic.Bool
	remote     map[remoteKey]*Charge
	// remoteCharges counts each peer's entries in remote.
	remoteCharges map[string]int
	peers         map[string]time.Time
	nextID        uint64
	// local holds this router's charges in flight by id while KeepLive
	// is on (nil otherwise), to restate them to the peers (LiveEvents).
	local map[uint64]*Charge

	// Scratch space of decisions, which all run under mu.
	scratchCands  []scorer.Candidate
	scratchStates []*upstream
	scratchDepths []int
	scratchMember [1]Member
}

// upstream is one upstream's accounting. Guarded by Fleet.mu.
type upstream struct {
	dial string
	id   prefixindex.UpstreamID
	// queuedPrefill is uncached prompt tokens charged here whose first
	// token has not come back yet.
	queuedPrefill int
	// queuedDecode is expected output tokens charged here and not yet
	// generated.
	queuedDecode int
	// kvTokens is the new KV the charged requests occupy (uncached prompt
	// plus expected output), for the KV-fit filter.
	kvTokens int
	inFlight int
	lastUsed time.Time
	// charged counts every request charged here and its KV tokens; it
	// only grows, so engine scrapes can tell which charges came after
	// their snapshot.
	charged scrape.Mark
	// named says a loaded configuration lists the upstream (see Name);
	// forgotten that the last one naming it was unloaded, so its state
	// goes with its last request in flight.
	named, forgotten bool
	// removed says f.upstreams no longer holds it: a pointer kept in the
	// scratch space of decisions must not be taken for dial's state.
	removed bool

	completed    int64
	lastTTFT     time.Duration
	lastEstimate float64 // estimated TTFT of the request lastTTFT measured
	healthSeen   bool    // healthy holds the caller's verdict at the last decision
	healthy      bool

	// capacityTokens is the KV capacity the index was sized for, and
	// indexBlockTokens the block size: the smallest any request routed
	// here used, so sites hashing with different block sizes never shrink
	// each other's share of the index.
	capacityTokens   int
	indexBlockTokens int
	// capacitySeen is when a decision last used a configured capacity of
	// capacityTokens (see capacityMemory).
	capacitySeen time.Time
	// blockSeen is when a request last used blocks of indexBlockTokens
	// (see sizeIndex).
	blockSeen time.Time
	// capacityFromPeer says capacityTokens is a peer's figure (see
	// applyCached): a loaded config that gives none leaves it in place,
	// where it takes back a figure of this router's own.
	capacityFromPeer bool

	// engineRestart is the latest engine restart a scraper reported;
	// indexResets counts the times its prefixes were forgotten because
	// the engine restarted (its cache is empty). engineCapacityTokens is
	// the KV capacity the engine last reported, which outlives a stale
	// scrape.
	engineRestart        time.Time
	indexResets          int
	engineCapacityTokens int
	// owed says a release here readied nothing because the hold an
	// earlier one readied had not decided yet (see Hold); lastRelease is
	// the fleet's release count at this router's latest release of work
	// here.
	owed        bool
	lastRelease uint64
	// pending are this router's charges here still waiting for their
	// first token, and prefilled, when it shares its view, those past it
	// and still in flight.
	pending   []*Charge
	prefilled []*Charge

	// adapters are the LoRA adapters charged here, most recent first:
	// the first MaxLoras (or the engine's own count of adapter slots,
	// engineMaxLoras, once reported) are presumed on the GPU, the rest in
	// host memory.
	adapters       []string
	engineMaxLoras int
	// configuredMaxLoras is the MaxLoras of the last decision that
	// weighed an adapter here: the list keeps at least that many too.
	configuredMaxLoras int
	// refusedAdapters are the adapters its engine answered 404 for lately
	// (see Fleet.Refused), at most maxRefusedAdapters.
	refusedAdapters []refusedAdapter

	// lists are what decisions derived from the last two model lists
	// they read for this upstream, the latest first (see models): two,
	// as two sites' scrapers (or a reload's old and new one) may take
	// turns.
	lists [2]modelList
}

// modelList is what decisions read of one of an upstream's model lists:
// its ids, in order, and for a long list where each id first comes.
type modelList struct {
	of  []scrape.ModelInfo
	ids []string
	at  map[string]int
}

// models returns list's ids and index, made once per list rather than
// at every decision: an engine may list thousands of adapters, and
// copying 20,000 ids for each candidate, then searching them, made a
// decision (under the fleet's lock) take 2 ms. A list is never changed
// in place (scrape.Signals.Models), so the same slice has the same ids.
// Caller holds f.mu.
func (u *upstream) models(list []scrape.ModelInfo) *modelList {
	if list == nil {
		return &noModels
	}
	same := func(l *modelList) bool {
		return l.ids != nil && len(list) == len(l.of) && (len(list) == 0 || &list[0] == &l.of[0])
	}
	switch {
	case same(&u.lists[0]):
	case same(&u.lists[1]):
		u.lists[0], u.lists[1] = u.lists[1], u.lists[0]
	default:
		l := modelList{of: list, ids: scrape.ModelIDs(list)}
		if len(list) > shortModelList {
			l.at = make(map[string]int, len(list))
			for i, m := range list {
				if _, seen := l.at[m.ID]; !seen {
					l.at[m.ID] = i
				}
			}
		}
		u.lists[0], u.lists[1] = l, u.lists[0]
	}
	return &u.lists[0]
}

// noModels is an unknown list's (nil ids): never changed.
var noModels modelList

// shortModelList is the longest list searched in order rather than
// through an index: the usual list, a model and a few adapters, is
// searched faster than its id is hashed.
const shortModelList = 16

// find returns the first model of l named id, nil for none.
func (l *modelList) find(id string) *scrape.ModelInfo {
	if l.at == nil {
		for i := range l.of {
			if l.of[i].ID == id {
				return &l.of[i]
			}
		}
		return nil
	}
	if i, ok := l.at[id]; ok {
		return &l.of[i]
	}
	return nil
}

// contextTokens is scrape.ContextTokens over l: the context length of
// the model named id, or of its base model when it is an adapter listed
// without one; 0 when unknown.
func (l *modelList) contextTokens(id string) int {
	m := l.find(id)
	if m == nil {
		return 0
	}
	if m.MaxModelLen > 0 || m.Parent == "" {
		return m.MaxModelLen
	}
	if base := l.find(m.Parent); base != nil {
		return base.MaxModelLen
	}
	return 0
}

// New returns an empty fleet.
func New() *Fleet {
	f := &Fleet{
		index:         prefixindex.New(0),
		upstreams:     make(map[string]*upstream),
		models:        make(map[string]*modelStats),
		held:          make(map[*Options]int),
		remote:        make(map[remoteKey]*Charge),
		remoteCharges: make(map[string]int),
		peers:         make(map[string]time.Time),
	}
	f.releases.Store(1) // 0 is "not read" (Request.ReleasesBefore)
	return f
}

// upstream returns the state of dial, creating it. Caller holds f.mu.
func (f *Fleet) upstream(dial string, now time.Time) *upstream {
	u, ok := f.upstreams[dial]
	if !ok {
		u = &upstream{dial: dial, id: f.index.Register(dial)}
		f.upstreams[dial] = u
		f.restorePending(u, now)
	}
	u.lastUsed = now
	return u
}

// remove forgets u and its index entries. Caller holds f.mu.
func (f *Fleet) remove(u *upstream) {
	f.index.Remove(u.id)
	delete(f.upstreams, u.dial)
	u.removed = true
}

// upstreamHinted is f.upstream(dial, now), taking hint when it is dial's
// state: the upstream at the same place in the previous decision's
// members. Members come in the same order request after request (Caddy's
// pool), and the map lookup by dial was a tenth of a decision at four
// upstreams. Caller holds f.mu.
func (f *Fleet) upstreamHinted(hint *upstream, dial string, now time.Time) *upstream {
	if hint != nil && !hint.removed && hint.dial == dial {
		hint.lastUsed = now
		return hint
	}
	return f.upstream(dial, now)
}

// Name records that a loaded configuration lists dial, so its state stays
// while idle. The caller counts references (Caddy's usage pool) and calls
// Forget when the last configuration naming dial is unloaded.
func (f *Fleet) Name(dial string, now time.Time) {
	f.mu.Lock()
	defer f.mu.Unlock()
	u := f.upstream(dial, now)
	u.named, u.forgotten = true, false
}

// Forget undoes Name: dial's state goes now if nothing is in flight
// there, else when its last request is released.
func (f *Fleet) Forget(dial string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	u := f.upstreams[dial]
	if u == nil {
		return
	}
	u.named, u.forgotten = false, true
	if u.inFlight == 0 {
		f.remove(u)
	}
}

// Expire forgets the unnamed upstreams (dynamic ones, which no
// configuration lists) idle since before cutoff with nothing in flight.
// It returns the dials it dropped, so that what else is kept per
// upstream (drains, metrics) can go too.
func (f *Fleet) Expire(cutoff time.Time) []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var dropped []string
	for dial, u := range f.upstreams {
		if !u.named && u.inFlight == 0 && u.lastUsed.Before(cutoff) {
			f.remove(u)
			dropped = append(dropped, dial)
		}
	}
	return dropped
}

// SetHealthy records the caller's health verdict on dial between
// decisions (the admin view shows the latest), for upstreams it knows.
func (f *Fleet) SetHealthy(dial string, healthy bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if u := f.upstreams[dial]; u != nil {
		u.healthSeen, u.healthy = true, healthy
	}
}

// Routable reports whether dial is an upstream requests may still be
// routed to: a loaded configuration names it, or it is a dynamic one the
// fleet has seen. An upstream forgotten while requests are in flight
// there is known but not routable.
func (f *Fleet) Routable(dial string) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	u := f.upstreams[dial]
	return u != nil && !u.forgotten
}

// Dynamic lists the upstreams the fleet holds state for that no loaded
// configuration names (dynamic ones) and that take requests.
func (f *Fleet) Dynamic() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []string
	for dial, u := range f.upstreams {
		if !u.named && !u.forgotten {
			out = append(out, dial)
		}
	}
	return out
}

// IsDynamic reports whether dial is one of Dynamic's upstreams.
func (f *Fleet) IsDynamic(dial string) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	u := f.upstreams[dial]
	return u != nil && !u.named && !u.forgotten
}

// Known reports whether the fleet holds state for dial.
func (f *Fleet) Known(dial string) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.upstreams[dial] != nil
}

// MarkOf returns the cumulative charges made to dial and how many are in
// flight, for the scraper's snapshots (scrape.Config.Mark).
func (f *Fleet) MarkOf(dial string) scrape.Mark {
	f.mu.Lock()
	defer f.mu.Unlock()
	if u := f.upstreams[dial]; u != nil {
		m := u.charged
		m.InFlight = u.inFlight
		return m
	}
	return scrape.Mark{}
}

// QueuedTokens returns the prompt and output tokens charged to dial and
// not yet processed, 0 when unknown.
func (f *Fleet) QueuedTokens(dial string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	if u := f.upstreams[dial]; u != nil {
		return max(0, u.queuedPrefill) + max(0, u.queuedDecode)
	}
	return 0
}

// UpstreamState is one upstream's accounting as a snapshot, for the admin
// API and metrics.
type UpstreamState struct {
	Dial                string
	QueuedPrefillTokens int
	QueuedDecodeTokens  int
	KVTokensInFlight    int
	InFlight            int
	IndexBlocks         int
	IndexCapacityBlocks int
	Completed           int64
	LastTTFT            time.Duration
	// LastEstimatedTTFTSeconds is the estimate made for the request whose
	// first token LastTTFT measured (not the last one routed here, which
	// may have failed, been abandoned or still be prefilling).
	LastEstimatedTTFTSeconds float64
	// KVCapacityTokens is the KV capacity the index and filter use, 0
	// when unknown.
	KVCapacityTokens int
	// Healthy is the caller's latest health verdict (at a decision or
	// SetHealthy), nil before any.
	Healthy  *bool
	Adapters []string
	Idle     time.Duration
	// IndexResets counts the times the upstream's prefixes were forgotten
	// because its engine restarted.
	IndexResets int
	// Removed says the last configuration naming the upstream was
	// unloaded (Forget) while requests were in flight there: it takes no
	// new ones, and its state goes with the last.
	Removed bool
}

// Snapshot copies every upstream's state.
func (f *Fleet) Snapshot(now time.Time) []UpstreamState {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := make([]UpstreamState, 0, len(f.upstreams))
	for _, u := range f.upstreams {
		s := UpstreamState{
			Dial: u.dial, QueuedPrefillTokens: u.queuedPrefill, QueuedDecodeTokens: u.queuedDecode,
			KVTokensInFlight: u.kvTokens, InFlight: u.inFlight,
			IndexBlocks: f.index.Blocks(u.id), IndexCapacityBlocks: f.index.Capacity(u.id),
			Completed: u.completed, LastTTFT: u.lastTTFT, LastEstimatedTTFTSeconds: u.lastEstimate,
			KVCapacityTokens: u.capacityTokens, Adapters: append([]string(nil), u.adapters...),
			Idle: now.Sub(u.lastUsed), IndexResets: u.indexResets, Removed: u.forgotten,
		}
		if u.healthSeen {
			healthy := u.healthy
			s.Healthy = &healthy
		}
		out = append(out, s)
	}
	return out
}

// runningMean is an exponentially weighted mean, so an estimate follows a
// changing workload: a plain mean of the first 20 values, then each new
// value weighs 5%.
type runningMean struct {
	value float64
	n     int
}

func (m *runningMean) add(x float64) {
	m.n++
	m.value += max(0.05, 1/float64(m.n)) * (x - m.value)
}
