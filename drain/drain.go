// Package drain tracks each upstream's lifecycle for graceful removal:
// active → draining (until a deadline) → drained, and back to active on
// undrain. It keeps a registry of the requests in flight on each upstream
// with a cancel function, so that at the deadline whatever is left can be
// cut and moved elsewhere by the caller. It knows nothing of HTTP or
// Caddy; upstreams are keyed by dial address.
//
// An upstream drains while anything holds it: an operator (admin), a
// loaded configuration that lists it under drain, or a site whose health
// checks find it down. Each hold names its owner, and each owner lifts
// only its own holds, so two sites sharing an upstream never lift each
// other's drains, and their health verdicts cannot make it flap. An
// admin undrain lifts every hold.
package drain

import (
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Phase is where an upstream is in its lifecycle.
type Phase uint8

// Phases.
const (
	Active Phase = iota
	// Draining: no new requests; in-flight ones run until the deadline.
	Draining
	// Drained: draining and nothing left in flight.
	Drained
)

func (p Phase) String() string {
	switch p {
	case Draining:
		return "draining"
	case Drained:
		return "drained"
	}
	return "active"
}

// Cause says what kind of hold keeps an upstream draining.
type Cause string

// Causes.
const (
	ByAdmin  Cause = "admin"
	ByConfig Cause = "config"
	ByHealth Cause = "health"
)

// Hold is one reason an upstream drains: its cause and its owner (the
// site, for config and health holds; empty for the admin).
type Hold struct {
	Cause Cause
	Owner string
}

// Admin is the operator's hold.
var Admin = Hold{Cause: ByAdmin}

// Status is a snapshot of one upstream's drain state.
type Status struct {
	Key   string `json:"dial"`
	Phase string `json:"phase"`
	// Cause lists the causes of the holds, sorted and comma-separated.
	Cause    Cause     `json:"cause,omitempty"`
	Deadline time.Time `json:"deadline,omitzero"`
	InFlight int       `json:"in_flight"`
	// CutAtDeadline is how many requests the deadline cut in this drain.
	CutAtDeadline int `json:"cut_at_deadline"`
}

// Events receives lifecycle notices, for logs and metrics, in the order
// the transitions happened, on the goroutine that caused them and without
// the registry's lock held. They must not block for long, and must not
// call back into the Registry (delivery is serialised; a call from a
// callback would wait on itself). Any may be nil.
type Events struct {
	// Draining is called when an active upstream starts draining.
	Draining func(key string, cause Cause, deadline time.Duration)
	// Undrained is called when a draining or drained upstream returns to
	// active.
	Undrained func(key string, cause Cause)
	// Drained is called when a draining upstream has nothing in flight.
	Drained func(key string)
	// DeadlineCut is called with how many requests the deadline cut.
	DeadlineCut func(key string, n int)
}

// Registry holds the drain state of every upstream. It is safe for
// concurrent use.
type Registry struct {
	mu        sync.Mutex
	upstreams map[string]*upstream
	nextID    uint64
	// closed counts the upstreams not active. It changes under mu, with
	// the phases, and is read without it: IsDraining is asked for every
	// upstream on every request, and almost always none is draining.
	closed atomic.Int32
	events Events
	now    func() time.Time

	// delivering is taken before mu is released and held while events
	// are delivered, so they arrive in the order of the transitions.
	delivering sync.Mutex
	pending    []func()
}

type upstream struct {
	phase    Phase
	holds    []Hold
	deadline time.Time
	timer    *time.Timer
	// flights are the requests in flight, in slots reused through free:
	// a slot's id is 0 while free. Entering and ending a request took two
	// map operations here, on every request.
	flights  []flight
	free     []int32
	inFlight int
	cut      int
	// expired says the deadline has cut what was in flight: a request
	// entering while those end is past it already.
	expired bool
}

// flight is a request in flight and whether a deadline took it to cut:
// its Cut may then run after it ended (see Flight.EndPending).
type flight struct {
	id      uint64
	cut     Cutter
	cutting bool
}

// maxIdle is how many upstreams the registry may hold and still keep one
// that is active with nothing in flight: the usual pool stays, where
// forgetting each after its request and remaking it for the next cost
// two map operations a request at low load. Beyond it (upstreams that
// come and go, from dynamic upstreams) each is forgotten when its last
// request ends.
const maxIdle = 256

// New returns an empty registry.
func New(events Events) *Registry {
	return &Registry{upstreams: make(map[string]*upstream), events: events, now: time.Now}
}

// lock takes the registry's lock; unlock releases it and delivers the
// events queued meanwhile, in order.
func (r *Registry) lock() { r.mu.Lock() }

func (r *Registry) unlock() {
	if len(r.pending) == 0 {
		r.mu.Unlock()
		return
	}
	events := r.pending
	r.pending = nil
	r.delivering.Lock()
	r.mu.Unlock()
	defer r.delivering.Unlock()
	for _, e := range events {
		e()
	}
}

// emit queues an event for delivery at unlock. Caller holds r.mu.
func (r *Registry) emit(e func()) { r.pending = append(r.pending, e) }

func (r *Registry) get(key string) *upstream {
	u := r.upstreams[key]
	if u == nil {
		u = new(upstream)
		r.upstreams[key] = u
	}
	return u
}

// Drain adds hold to key, closing it to new work; requests in flight there
// are cut at now + deadline (a deadline of 0 or less cuts them at once).
// An upstream already draining keeps the earlier deadline.
func (r *Registry) Drain(key string, deadline time.Duration, hold Hold) {
	r.lock()
	defer r.unlock()
	u := r.get(key)
	if !slices.Contains(u.holds, hold) {
		u.holds = append(u.holds, hold)
	}
	at := r.now().Add(max(0, deadline))
	if u.phase != Active && !u.deadline.IsZero() && !at.Before(u.deadline) {
		return
	}
	if u.phase == Active {
		u.cut = 0
		if e := r.events.Draining; e != nil {
			r.emit(func() { e(key, hold.Cause, deadline) })
		}
		u.phase = Draining
		r.closed.Add(1)
	}
	u.deadline, u.expired = at, false
	if u.timer != nil {
		u.timer.Stop()
	}
	u.timer = time.AfterFunc(max(0, deadline), func() { r.expire(key, at) })
	r.settle(key, u)
}

// AddHold adds hold to key if key is closed to new work already (draining
// or drained), leaving its phase and deadline as they are, and reports
// whether it did. A new configuration takes over the drains it shares with
// the running one this way, without changing them before it runs.
func (r *Registry) AddHold(key string, hold Hold) bool {
	r.lock()
	defer r.unlock()
	u := r.upstreams[key]
	if u == nil || u.phase == Active {
		return false
	}
	if !slices.Contains(u.holds, hold) {
		u.holds = append(u.holds, hold)
	}
	return true
}

// Undrain lifts hold from key; the admin's hold lifts every hold. It
// reports whether the upstream is now active.
func (r *Registry) Undrain(key string, hold Hold) bool {
	return r.lift(key, hold, hold.Cause == ByAdmin)
}

// Lift removes exactly hold from key's holds, even the admin's, and
// reports whether the upstream is now active: a peer router's operator
// undrained it, which lifts that operator's hold and no one else's.
func (r *Registry) Lift(key string, hold Hold) bool {
	return r.lift(key, hold, false)
}

// lift removes hold (every hold when all is set) from key and reports
// whether the upstream is now active.
func (r *Registry) lift(key string, hold Hold, all bool) bool {
	r.lock()
	defer r.unlock()
	u := r.upstreams[key]
	if u == nil || u.phase == Active {
		return true
	}
	u.holds = slices.DeleteFunc(u.holds, func(h Hold) bool { return all || h == hold })
	r.activateIfFree(key, u, hold.Cause)
	return u.phase == Active
}

// HeldBy reports whether any hold of cause is on key.
func (r *Registry) HeldBy(key string, cause Cause) bool {
	r.lock()
	defer r.unlock()
	u := r.upstreams[key]
	return u != nil && slices.ContainsFunc(u.holds, func(h Hold) bool { return h.Cause == cause })
}

// Held reports whether hold is among key's holds.
func (r *Registry) Held(key string, hold Hold) bool {
	r.lock()
	defer r.unlock()
	u := r.upstreams[key]
	return u != nil && slices.Contains(u.holds, hold)
}

// ReleaseOwner lifts every hold owner has on any upstream (its site was
// unloaded).
func (r *Registry) ReleaseOwner(owner string) {
	r.lock()
	defer r.unlock()
	for key, u := range r.upstreams {
		var lifted Cause
		u.holds = slices.DeleteFunc(u.holds, func(h Hold) bool {
			mine := h.Owner == owner && h.Cause != ByAdmin
			if mine {
				lifted = h.Cause
			}
			return mine
		})
		if lifted != "" {
			r.activateIfFree(key, u, lifted)
		}
	}
}

// Forget lifts every hold on key, the admin's too: no configuration lists
// the upstream any more. Requests in flight there are still tracked.
func (r *Registry) Forget(key string) {
	r.lock()
	defer r.unlock()
	if u := r.upstreams[key]; u != nil {
		u.holds = u.holds[:0]
		r.activateIfFree(key, u, "removed")
	}
}

// activateIfFree returns a draining upstream without holds to active.
// Caller holds r.mu.
func (r *Registry) activateIfFree(key string, u *upstream, cause Cause) {
	if len(u.holds) > 0 || u.phase == Active {
		return
	}
	if u.timer != nil {
		u.timer.Stop()
		u.timer = nil
	}
	u.phase, u.deadline = Active, time.Time{}
	r.closed.Add(-1)
	r.prune(key, u)
	if e := r.events.Undrained; e != nil {
		r.emit(func() { e(key, cause) })
	}
}

// cause lists u's hold causes, sorted and comma-separated.
func (u *upstream) cause() Cause {
	causes := make([]string, 0, len(u.holds))
	for _, h := range u.holds {
		if !slices.Contains(causes, string(h.Cause)) {
			causes = append(causes, string(h.Cause))
		}
	}
	slices.Sort(causes)
	return Cause(strings.Join(causes, ","))
}

// IsDraining reports whether key takes no new work (draining or drained).
func (r *Registry) IsDraining(key string) bool {
	if r.closed.Load() == 0 {
		return false
	}
	r.lock()
	defer r.unlock()
	u := r.upstreams[key]
	return u != nil && u.phase != Active
}

// Phase returns key's phase.
func (r *Registry) Phase(key string) Phase {
	r.lock()
	defer r.unlock()
	if u := r.upstreams[key]; u != nil {
		return u.phase
	}
	return Active
}

// Cutter is a request in flight that a drain deadline can cut.
type Cutter interface {
	// Cut cuts the request; it runs without the registry's lock held.
	Cut()
}

// CutFunc is a function as a Cutter.
type CutFunc func()

// Cut calls f.
func (f CutFunc) Cut() { f() }

// Flight is a request registered in flight on an upstream; End it when the
// request finishes there (also after it was cut). The zero Flight ends
// nothing.
type Flight struct {
	r    *Registry
	u    *upstream
	key  string
	id   uint64
	slot int32
}

// Enter registers a request in flight on key, with what cuts it. It does
// not allocate once the upstream is known.
func (r *Registry) Enter(key string, cut Cutter) Flight {
	r.lock()
	u := r.get(key)
	r.nextID++
	id := r.nextID
	f := flight{id: id, cut: cut}
	// A request routed just as the upstream drained is in flight there
	// after all, and the deadline applies to it.
	switch {
	case u.phase == Drained:
		u.phase = Draining
		at := u.deadline
		if u.timer != nil {
			u.timer.Stop()
		}
		u.timer = time.AfterFunc(max(0, at.Sub(r.now())), func() { r.expire(key, at) })
	case u.phase == Draining && u.expired:
		// The deadline cut the others, which have not all ended yet: no
		// timer is left to cut this one. It is cut on a goroutine of its
		// own, as a timer would: the caller may not be ready for it yet
		// (it has the Flight to store first, maybe under its own lock).
		u.cut++
		if e := r.events.DeadlineCut; e != nil {
			r.emit(func() { e(key, 1) })
		}
		f.cutting = true
		go cut.Cut()
	}
	slot := int32(len(u.flights))
	if n := len(u.free); n > 0 {
		slot, u.free = u.free[n-1], u.free[:n-1]
		u.flights[slot] = f
	} else {
		u.flights = append(u.flights, f)
	}
	u.inFlight++
	r.unlock()
	return Flight{r: r, u: u, key: key, id: id, slot: slot}
}

// End unregisters the request. Calls after the first do nothing.
func (f Flight) End() { f.EndPending() }

// EndPending is End, reporting whether the drain deadline took the
// request to cut before it ended: its Cut may then still run, or be about
// to, and whatever Cut reaches must stay valid. The first call reports it;
// later ones report false.
func (f Flight) EndPending() (cutPending bool) {
	if f.r == nil {
		return false
	}
	f.r.lock()
	defer f.r.unlock()
	// Ids are never reused, so a flight already ended is not found, also
	// when its slot or its upstream's record was reused.
	u := f.u
	if int(f.slot) >= len(u.flights) || u.flights[f.slot].id != f.id {
		return false
	}
	fl := u.flights[f.slot]
	u.flights[f.slot] = flight{} // lets the Cutter go
	u.free = append(u.free, f.slot)
	u.inFlight--
	f.r.settle(f.key, f.u)
	f.r.prune(f.key, f.u)
	return fl.cutting
}

// Begin is Enter for a cut function, returning the end function.
func (r *Registry) Begin(key string, cut func()) (end func()) {
	return r.Enter(key, CutFunc(cut)).End
}

// expire runs at a drain's deadline and cuts what is left.
func (r *Registry) expire(key string, at time.Time) {
	r.lock()
	u := r.upstreams[key]
	if u == nil || u.phase != Draining || !u.deadline.Equal(at) {
		r.unlock()
		return
	}
	cuts := make([]Cutter, 0, u.inFlight)
	for i := range u.flights {
		if f := &u.flights[i]; f.id != 0 {
			cuts = append(cuts, f.cut)
			f.cutting = true
		}
	}
	u.cut += len(cuts)
	u.expired = true
	if e := r.events.DeadlineCut; e != nil && len(cuts) > 0 {
		r.emit(func() { e(key, len(cuts)) })
	}
	r.unlock()
	for _, c := range cuts {
		c.Cut()
	}
}

// settle moves a draining upstream with nothing in flight to drained.
// Caller holds r.mu.
func (r *Registry) settle(key string, u *upstream) {
	if u.phase == Draining && u.inFlight == 0 {
		u.phase = Drained
		if e := r.events.Drained; e != nil {
			r.emit(func() { e(key) })
		}
	}
}

// prune clears an active upstream with nothing in flight, as new, and
// forgets it while the registry holds more than maxIdle upstreams.
// Caller holds r.mu.
func (r *Registry) prune(key string, u *upstream) {
	if u.phase != Active || u.inFlight != 0 {
		return
	}
	*u = upstream{holds: u.holds[:0], flights: u.flights[:0], free: u.free[:0]}
	if len(r.upstreams) <= maxIdle {
		return
	}
	delete(r.upstreams, key)
}

// Snapshot lists the upstreams that are draining, drained, or have
// requests registered, sorted by key.
func (r *Registry) Snapshot() []Status {
	r.lock()
	defer r.unlock()
	out := make([]Status, 0, len(r.upstreams))
	for k, u := range r.upstreams {
		if u.phase == Active && u.inFlight == 0 {
			continue // kept for reuse (see maxIdle)
		}
		s := Status{Key: k, Phase: u.phase.String(), Cause: u.cause(), InFlight: u.inFlight, CutAtDeadline: u.cut}
		if u.phase != Active {
			s.Deadline = u.deadline
		}
		out = append(out, s)
	}
	slices.SortFunc(out, func(a, b Status) int { return strings.Compare(a.Key, b.Key) })
	return out
}
