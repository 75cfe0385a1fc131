// Package drain tracks each upstream's lifecycle for graceful removal:
// active → draining (until a deadline) → drained, and back to active on
// undrain. It keeps a registry of the requests in flight on each upstream
// with a cancel function, so that at the deadline whatever is left can be
// cut and moved elsewhere by the caller. It knows nothing of HTTP or
// Caddy; upstreams are keyed by dial address.
package drain

import (
	"slices"
	"strings"
	"sync"
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

// Cause says who started a drain; an undrain by health or config only
// lifts a drain it started.
type Cause string

// Causes.
const (
	ByAdmin  Cause = "admin"
	ByConfig Cause = "config"
	ByHealth Cause = "health"
)

// Status is a snapshot of one upstream's drain state.
type Status struct {
	Key      string    `json:"dial"`
	Phase    string    `json:"phase"`
	Cause    Cause     `json:"cause,omitempty"`
	Deadline time.Time `json:"deadline,omitzero"`
	InFlight int       `json:"in_flight"`
	// CutAtDeadline is how many requests the deadline cut in this drain.
	CutAtDeadline int `json:"cut_at_deadline"`
}

// Events receives lifecycle notices, for logs and metrics. Any may be nil.
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
	events    Events
	now       func() time.Time
}

type upstream struct {
	phase    Phase
	cause    Cause
	deadline time.Time
	timer    *time.Timer
	flights  map[uint64]func()
	cut      int
}

// New returns an empty registry.
func New(events Events) *Registry {
	return &Registry{upstreams: make(map[string]*upstream), events: events, now: time.Now}
}

func (r *Registry) get(key string) *upstream {
	u := r.upstreams[key]
	if u == nil {
		u = &upstream{flights: make(map[uint64]func())}
		r.upstreams[key] = u
	}
	return u
}

// Drain closes key to new work; requests in flight there are cut at now +
// deadline (a deadline of 0 or less cuts them at once). Draining an
// upstream that is already draining keeps the earlier deadline if it
// comes first.
func (r *Registry) Drain(key string, deadline time.Duration, cause Cause) {
	r.mu.Lock()
	defer r.mu.Unlock()
	u := r.get(key)
	at := r.now().Add(max(0, deadline))
	if u.phase != Active && !u.deadline.IsZero() && u.deadline.Before(at) {
		return
	}
	if u.phase == Active {
		u.cut = 0
		if r.events.Draining != nil {
			go r.events.Draining(key, cause, deadline)
		}
	}
	u.phase, u.cause, u.deadline = Draining, cause, at
	if u.timer != nil {
		u.timer.Stop()
	}
	u.timer = time.AfterFunc(max(0, deadline), func() { r.expire(key, at) })
	r.settle(key, u)
}

// Undrain returns key to active. An admin undrain lifts any drain; health
// and config only lift the drains they started. It reports whether the
// upstream is now active.
func (r *Registry) Undrain(key string, cause Cause) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	u := r.upstreams[key]
	if u == nil || u.phase == Active {
		return true
	}
	if cause != ByAdmin && u.cause != cause {
		return false
	}
	if u.timer != nil {
		u.timer.Stop()
		u.timer = nil
	}
	u.phase, u.cause, u.deadline = Active, "", time.Time{}
	r.prune(key, u)
	if r.events.Undrained != nil {
		go r.events.Undrained(key, cause)
	}
	return true
}

// IsDraining reports whether key takes no new work (draining or drained).
func (r *Registry) IsDraining(key string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	u := r.upstreams[key]
	return u != nil && u.phase != Active
}

// Phase returns key's phase.
func (r *Registry) Phase(key string) Phase {
	r.mu.Lock()
	defer r.mu.Unlock()
	if u := r.upstreams[key]; u != nil {
		return u.phase
	}
	return Active
}

// Begin registers a request in flight on key with the function that cuts
// it; call the returned end function when the request finishes there
// (also after it was cut). cut runs without the registry's lock held.
func (r *Registry) Begin(key string, cut func()) (end func()) {
	r.mu.Lock()
	defer r.mu.Unlock()
	u := r.get(key)
	r.nextID++
	id := r.nextID
	u.flights[id] = cut
	var once sync.Once
	return func() {
		once.Do(func() {
			r.mu.Lock()
			defer r.mu.Unlock()
			delete(u.flights, id)
			r.settle(key, u)
			r.prune(key, u)
		})
	}
}

// expire runs at a drain's deadline and cuts what is left.
func (r *Registry) expire(key string, at time.Time) {
	r.mu.Lock()
	u := r.upstreams[key]
	if u == nil || u.phase != Draining || !u.deadline.Equal(at) {
		r.mu.Unlock()
		return
	}
	cuts := make([]func(), 0, len(u.flights))
	for _, c := range u.flights {
		cuts = append(cuts, c)
	}
	u.cut += len(cuts)
	r.mu.Unlock()
	if len(cuts) > 0 && r.events.DeadlineCut != nil {
		r.events.DeadlineCut(key, len(cuts))
	}
	for _, c := range cuts {
		c()
	}
}

// settle moves a draining upstream with nothing in flight to drained.
// Caller holds r.mu.
func (r *Registry) settle(key string, u *upstream) {
	if u.phase == Draining && len(u.flights) == 0 {
		u.phase = Drained
		if r.events.Drained != nil {
			go r.events.Drained(key)
		}
	}
}

// prune forgets an active upstream with nothing in flight. Caller holds
// r.mu.
func (r *Registry) prune(key string, u *upstream) {
	if u.phase == Active && len(u.flights) == 0 {
		delete(r.upstreams, key)
	}
}

// Snapshot lists the upstreams that are draining, drained, or have
// requests registered, sorted by key.
func (r *Registry) Snapshot() []Status {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]Status, 0, len(r.upstreams))
	for k, u := range r.upstreams {
		s := Status{Key: k, Phase: u.phase.String(), Cause: u.cause, InFlight: len(u.flights), CutAtDeadline: u.cut}
		if u.phase != Active {
			s.Deadline = u.deadline
		}
		out = append(out, s)
	}
	slices.SortFunc(out, func(a, b Status) int { return strings.Compare(a.Key, b.Key) })
	return out
}
