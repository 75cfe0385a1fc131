package router

import (
	"slices"
	"time"

	"github.com/llmaffinity/caddy-llm-affinity/scorer"
	"github.com/llmaffinity/caddy-llm-affinity/scrape"
)

// DefaultQueueLimit is how many requests one set of Options may hold at
// the gateway at once (Envoy's default for pending requests). A held
// request keeps its body in memory and is looked at on releases of work
// where it may fit: the limit bounds both.
const DefaultQueueLimit = 1024

// HoldPollInterval is how often a held request decides again whether or
// not its hold was readied: what readies no hold (an upstream turning
// healthy, fresher engine signals, a lower output estimate learned from a
// response) lets it through within this.
const HoldPollInterval = 250 * time.Millisecond

// A Hold is a request waiting at the gateway because no upstream could
// start it in time. Holds queue in arrival order. A release of work on an
// upstream readies the first hold that would now pass the decision's
// filters there: its Ready channel closes, the moment to decide again.
// When that request ends its wait (Unhold: routed, shed or gone), the next
// hold that fits there is readied, and so on while they fit; releases
// there meanwhile ready nothing more, but if the readied request fits
// nowhere after all (a new request took part of the room) and waits
// again, the next that fits in what is left there is readied.
// A release under overload so costs one filter check per held request and
// a whole decision for each request it lets through (and one more), not
// one for every request held; and held requests are served first come,
// first served (a new request that fits somewhere does not queue behind
// them).
type Hold struct {
	ready    chan struct{}
	req      Request
	deadline time.Time
	opts     *Options
	// members are the upstreams the request may go to, as its last
	// decision saw them; engines holds their engine signals, copied, as
	// the caller's may be reused.
	members []Member
	engines []scrape.Signals
	// upstreams are the members' states, in the same order, to find the
	// releasing upstream among them without comparing addresses (nil for
	// one removed since the decision).
	upstreams []*upstream
	// releasesSeen are the members' lastRelease at the hold: an upstream
	// Caddy counted full may have room only after a release.
	releasesSeen []uint64
	// Guarded by Fleet.mu: held says the hold is in Fleet.holds; readied
	// that ready is closed; by the upstream whose release readied it (it
	// has that upstream's turn), whose next fitting hold it readies when
	// its wait ends. avoidTried says its decision avoids the members it
	// tried (another is available), so their releases do not ready it.
	held, readied bool
	by            *upstream
	avoidTried    bool
	// home is the index of the request's home among members (see
	// Request.Home), -1 when it has none there: only its releases ready
	// the hold.
	home int
}

// Ready is closed when the request may fit where it did not: decide
// again, then Hold it again if it still fits nowhere.
func (h *Hold) Ready() <-chan struct{} { return h.ready }

// Hold queues req, for which decision d chose nothing, to wait until
// deadline for a release of work on one of members where it may fit. Pass
// the request's Hold to renew it after a retry that failed (it keeps its
// place), nil the first time. It returns nil when opts.QueueLimit requests
// decided with opts are held already: shed this one. Every Hold ends with
// Unhold.
//
// A release between d and this call readies the hold at once, so no
// release is missed.
func (f *Fleet) Hold(h *Hold, d *Decision, req Request, deadline time.Time, members []Member, opts *Options) *Hold {
	f.mu.Lock()
	defer f.mu.Unlock()
	if h == nil || !h.held {
		if f.held[opts] >= opts.QueueLimitValue() {
			return nil
		}
		if h == nil {
			h = new(Hold)
		}
		h.held, h.opts = true, opts
		f.holds = append(f.holds, h)
		f.held[opts]++
	}
	prev := h.by
	if prev != nil && f.upstreams[prev.dial] != prev {
		prev = nil
	}
	h.req, h.deadline = req, deadline
	h.members = append(h.members[:0], members...)
	h.engines = slices.Grow(h.engines[:0], len(members))
	h.upstreams, h.releasesSeen = h.upstreams[:0], h.releasesSeen[:0]
	h.avoidTried, h.home = false, -1
	for i := range h.members {
		if h.home < 0 && isHome(&req, &h.members[i]) {
			h.home = i
		}
		h.avoidTried = h.avoidTried || (h.members[i].Available && !h.members[i].Tried)
		u := f.upstreams[h.members[i].Dial]
		h.upstreams = append(h.upstreams, u)
		var seen uint64
		if u != nil {
			seen = u.lastRelease
		}
		h.releasesSeen = append(h.releasesSeen, seen)
		if e := h.members[i].Engine; e != nil {
			h.engines = append(h.engines, *e)
			h.members[i].Engine = &h.engines[len(h.engines)-1]
		}
	}
	h.ready, h.readied, h.by = make(chan struct{}), false, nil
	if d.releases != f.releases.Load() || h.releasedSinceView(req.ReleasesBefore) {
		close(h.ready)
		h.readied, h.by = true, prev // it keeps the turn a release gave it
	} else if prev != nil {
		// It had prev's turn and fitted nowhere after all (a new request
		// may have taken part of the room): what is left there, and what
		// prev released while it was to decide, goes to the next that
		// fits, not to it again. If its decision found prev full to Caddy
		// (max_requests), the releases the others have not seen made no
		// room there, unless one came while it decided: otherwise one
		// release would cost a failed decision of every hold in turn.
		room := prev.owed
		if i := slices.Index(h.upstreams, prev); i >= 0 {
			room = room || !fullToCaddy(&h.members[i])
		}
		prev.owed = false
		f.readyNext(prev, d.at, h, room)
	}
	return h
}

// releasedSinceView says work ended, after the fleet's release count was
// before (0: not known), on a member the caller's view showed full to
// Caddy (max_requests): the view may predate it. Caller holds f.mu.
func (h *Hold) releasedSinceView(before uint64) bool {
	if before == 0 {
		return false
	}
	for i, u := range h.upstreams {
		if u != nil && u.lastRelease > before && fullToCaddy(&h.members[i]) && h.considers(i) {
			return true
		}
	}
	return false
}

// fullToCaddy says Caddy counted m full (max_requests), not down.
func fullToCaddy(m *Member) bool { return !m.Available && m.Healthy }

// considers says h's decision would send its request to member i: its
// home, if it has one among them, and not one it tried while another is
// available.
func (h *Hold) considers(i int) bool {
	if h.home >= 0 {
		return i == h.home
	}
	return !(h.members[i].Tried && h.avoidTried)
}

// Unhold ends h's wait at now: its request was routed, shed or abandoned.
// If a release readied it, the next held request that fits where that
// release was is readied.
func (f *Fleet) Unhold(h *Hold, now time.Time) {
	if h == nil {
		return
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if !h.held {
		return
	}
	if i := slices.Index(f.holds, h); i >= 0 {
		f.holds = slices.Delete(f.holds, i, i+1)
	}
	h.held = false
	if f.held[h.opts]--; f.held[h.opts] <= 0 {
		delete(f.held, h.opts)
	}
	if by := h.by; by != nil && f.upstreams[by.dial] == by {
		h.by = nil
		by.owed = false
		f.readyNext(by, now, nil, true)
	}
}

// Releases counts the releases of work so far, from 1 (see
// Request.ReleasesBefore). It does not take the fleet's lock.
func (f *Fleet) Releases() uint64 { return f.releases.Load() }

// Held returns how many requests wait at the gateway.
func (f *Fleet) Held() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.holds)
}

// readyHolds follows a release of work on u, this router's own (local)
// or a peer's. Caller holds f.mu.
func (f *Fleet) readyHolds(u *upstream, now time.Time, local bool) {
	n := f.releases.Add(1)
	if local {
		// Only this router's requests count in Caddy's max_requests
		// here: a peer's release makes no room in that count.
		u.lastRelease = n
	}
	if len(f.holds) == 0 || f.upstreams[u.dial] != u {
		return // nothing waits, or u was forgotten with its last request
	}
	f.readyNext(u, now, nil, true)
}

// readyNext readies the first held request but skip, in arrival order,
// that would now pass the filters on u, unless one readied by u has not
// decided yet. mayHaveRoom says u may no longer be full to Caddy for the
// holds that saw it so before a release there. Caller holds f.mu.
func (f *Fleet) readyNext(u *upstream, now time.Time, skip *Hold, mayHaveRoom bool) {
	for _, h := range f.holds {
		if h.by == u {
			u.owed = true
			return // u's last one has not decided yet
		}
	}
	for _, h := range f.holds {
		if h.readied || h == skip {
			continue
		}
		i := slices.Index(h.upstreams, u)
		if i < 0 {
			continue
		}
		// The member's availability was Caddy's at the hold (a full
		// upstream is unavailable until a request there ends): a release
		// is what may change it.
		if !h.considers(i) {
			continue // it goes home, or its decision avoids it
		}
		m := h.members[i]
		if mayHaveRoom && u.lastRelease != h.releasesSeen[i] {
			// Full to Caddy at the hold, not down: work ended there
			// since, which may have made room. (Without a release it is
			// as full as it was: two holds behind an upstream at
			// max_requests would hand the turn to each other without end.)
			m.Available = m.Available || m.Healthy
		}
		req := h.req
		req.MaxWait = max(0, h.deadline.Sub(now))
		if f.fits(now, req, m, h.opts, false) {
			close(h.ready)
			h.readied, h.by = true, u
			return
		}
	}
}

// fits is Fits; caller holds f.mu. observe says m is the caller's current
// view, which the fleet takes note of (see candidates).
func (f *Fleet) fits(now time.Time, req Request, m Member, opts *Options, observe bool) bool {
	f.scratchMember[0] = m
	sreq, cands, _ := f.candidates(now, &req, f.scratchMember[:], opts, observe)
	return scorer.Filter(sreq, &cands[0], opts.Scorer) == scorer.NotFiltered
}
