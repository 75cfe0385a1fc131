package router

import (
	"slices"
	"time"

	"github.com/llmaffinity/caddy-llm-affinity/scorer"
	"github.com/llmaffinity/caddy-llm-affinity/scrape"
)

// DefaultQueueLimit is how many requests one set of Options may hold at
// the gateway at once (Envoy's default for pending requests). A held
// request keeps its body in memory and is looked at again on every
// release of work it may fit: the limit bounds both.
const DefaultQueueLimit = 1024

// A Hold is a request waiting at the gateway because no upstream could
// start it in time. Its Ready channel is closed when an upstream it may go
// to releases work and the request would now pass the decision's filters
// there: the moment to decide again. Only such requests are woken, not
// every one held, so a release under overload costs one filter check per
// held request rather than a whole decision each.
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
	// readied says ready is closed. Guarded by Fleet.mu.
	readied bool
	// index is the hold's place in Fleet.holds, -1 when not held.
	index int
}

// Ready is closed when the request may fit somewhere it did not: decide
// again, then Hold it again if it still fits nowhere.
func (h *Hold) Ready() <-chan struct{} { return h.ready }

// Hold registers req, for which decision d chose nothing, to wait until
// deadline for a release of work on one of members it may fit. Pass the
// request's previous Hold to renew it after a retry that failed, nil the
// first time. It returns nil when opts.QueueLimit requests decided with
// opts are held already: shed this one. Holds are released by Unhold.
//
// A release between d and this call readies the hold at once, so no
// release is missed.
func (f *Fleet) Hold(h *Hold, d *Decision, req Request, deadline time.Time, members []Member, opts *Options) *Hold {
	f.mu.Lock()
	defer f.mu.Unlock()
	if h == nil {
		if f.held[opts] >= opts.QueueLimitValue() {
			return nil
		}
		h = &Hold{index: -1}
	}
	h.req, h.deadline, h.opts = req, deadline, opts
	h.members = append(h.members[:0], members...)
	h.engines = slices.Grow(h.engines[:0], len(members))
	h.upstreams = h.upstreams[:0]
	for i := range h.members {
		// nil for a member removed since the decision: none of its
		// releases can come.
		h.upstreams = append(h.upstreams, f.upstreams[h.members[i].Dial])
		if e := h.members[i].Engine; e != nil {
			h.engines = append(h.engines, *e)
			h.members[i].Engine = &h.engines[len(h.engines)-1]
		}
	}
	if h.index < 0 {
		h.index = len(f.holds)
		f.holds = append(f.holds, h)
		f.held[opts]++
	}
	h.ready, h.readied = make(chan struct{}), false
	if d.releases != f.releases {
		h.readyNow()
	}
	return h
}

// Unhold ends h's wait: its request was routed, shed or abandoned.
func (f *Fleet) Unhold(h *Hold) {
	if h == nil {
		return
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	i := h.index
	if i < 0 {
		return
	}
	last := len(f.holds) - 1
	f.holds[i] = f.holds[last]
	f.holds[i].index = i
	f.holds[last] = nil
	f.holds = f.holds[:last]
	h.index = -1
	if f.held[h.opts]--; f.held[h.opts] <= 0 {
		delete(f.held, h.opts)
	}
}

// Held returns how many requests wait at the gateway.
func (f *Fleet) Held() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.holds)
}

// readyHolds readies the held requests that may now fit on u, which just
// released work. Caller holds f.mu.
func (f *Fleet) readyHolds(u *upstream, now time.Time) {
	f.releases++
	if f.upstreams[u.dial] != u {
		return // forgotten with its last request: no decision goes there
	}
	for _, h := range f.holds {
		if h.readied {
			continue // not decided again yet
		}
		i := slices.Index(h.upstreams, u)
		if i < 0 {
			continue
		}
		// The member's availability was Caddy's at the hold (a full
		// upstream is unavailable until a request there ends): a release
		// is what may change it.
		m := h.members[i]
		m.Available = true
		req := h.req
		req.MaxWait = max(0, h.deadline.Sub(now))
		if f.fits(now, req, m, h.opts, false) {
			h.readyNow()
		}
	}
}

// readyNow closes h's Ready channel. Caller holds Fleet.mu.
func (h *Hold) readyNow() {
	close(h.ready)
	h.readied = true
}

// fits is Fits; caller holds f.mu. observe says m is the caller's current
// view, whose health and engine restart the fleet takes note of.
func (f *Fleet) fits(now time.Time, req Request, m Member, opts *Options, observe bool) bool {
	f.scratchMember[0] = m
	sreq, cands, _ := f.candidates(now, req, f.scratchMember[:], opts, observe)
	return scorer.Filter(sreq, &cands[0], opts.Scorer) == scorer.NotFiltered
}
