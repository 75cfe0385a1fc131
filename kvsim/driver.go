package kvsim

import (
	"sync"
	"time"
)

// Driver runs an [Engine] in real time: simulated time is wall-clock time since Start
// multiplied by a speed factor. It owns the engine; use [Driver.Do] to read or change it.
type Driver struct {
	mu       sync.Mutex
	engine   *Engine
	speed    float64
	simBase  time.Duration // simulated time at wallBase
	wallBase time.Time
	frozen   bool
	streams  map[*Request]*Stream
	observe  func(Event)
	events   []Event

	wake    chan struct{}
	stop    chan struct{}
	done    chan struct{}
	started bool
	stopped bool
}

// Stream delivers one request's events from a [Driver]. Events are queued without bound, so
// the driver never blocks on a slow reader.
type Stream struct {
	mu     sync.Mutex
	events []Event
	notify chan struct{}
}

// Ready is signalled when events are available.
func (s *Stream) Ready() <-chan struct{} { return s.notify }

// Take returns and clears the queued events. Their Text is a private copy.
func (s *Stream) Take() []Event {
	s.mu.Lock()
	defer s.mu.Unlock()
	evs := s.events
	s.events = nil
	return evs
}

func (s *Stream) push(ev Event) {
	ev.Text = append([]byte(nil), ev.Text...)
	s.mu.Lock()
	s.events = append(s.events, ev)
	s.mu.Unlock()
	select {
	case s.notify <- struct{}{}:
	default:
	}
}

// NewDriver returns a driver of e running speed times faster than wall clock (speed <= 0
// means 1). observe, if not nil, sees every event, under the driver's lock.
func NewDriver(e *Engine, speed float64, observe func(Event)) *Driver {
	if speed <= 0 {
		speed = 1
	}
	return &Driver{
		engine:  e,
		speed:   speed,
		streams: make(map[*Request]*Stream),
		observe: observe,
		wake:    make(chan struct{}, 1),
		stop:    make(chan struct{}),
		done:    make(chan struct{}),
	}
}

// Done is closed when the driver has stopped; streams then get no more events.
func (d *Driver) Done() <-chan struct{} { return d.done }

// Speed returns the speed factor.
func (d *Driver) Speed() float64 { return d.speed }

// Start starts the driver's goroutine.
func (d *Driver) Start() {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.started {
		return
	}
	d.started = true
	d.simBase = d.engine.Now()
	d.wallBase = time.Now()
	go d.run()
}

// Stop stops the driver's goroutine and waits for it. Pending streams get no more events.
func (d *Driver) Stop() {
	d.mu.Lock()
	if !d.started || d.stopped {
		d.mu.Unlock()
		return
	}
	d.stopped = true
	d.mu.Unlock()
	close(d.stop)
	<-d.done
}

// nowLocked returns the current simulated time.
func (d *Driver) nowLocked() time.Duration {
	if d.frozen || !d.started {
		return d.simBase
	}
	return d.simBase + time.Duration(float64(time.Since(d.wallBase))*d.speed)
}

// Now returns the current simulated time.
func (d *Driver) Now() time.Duration {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.nowLocked()
}

// SetFrozen stops (true) or restarts (false) simulated time. While frozen the engine makes no
// progress: requests are accepted but produce nothing.
func (d *Driver) SetFrozen(frozen bool) {
	d.mu.Lock()
	if frozen != d.frozen {
		d.simBase = d.nowLocked()
		d.wallBase = time.Now()
		d.frozen = frozen
	}
	d.mu.Unlock()
	d.poke()
}

// Frozen reports whether simulated time is stopped.
func (d *Driver) Frozen() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.frozen
}

// Submit submits req to the engine now and returns the stream of its events.
func (d *Driver) Submit(req *Request) (*Stream, error) {
	d.mu.Lock()
	now := d.nowLocked()
	d.advanceLocked(now)
	if err := d.engine.Submit(req, now); err != nil {
		d.mu.Unlock()
		return nil, err
	}
	s := &Stream{notify: make(chan struct{}, 1)}
	d.streams[req] = s
	d.mu.Unlock()
	d.poke()
	return s, nil
}

// Abort aborts req, freeing its KV blocks; a no-op if it already finished.
func (d *Driver) Abort(req *Request) {
	d.mu.Lock()
	d.engine.Abort(req, d.nowLocked())
	delete(d.streams, req)
	d.mu.Unlock()
	d.poke()
}

// InFlight returns the number of submitted requests that have not finished or been aborted.
func (d *Driver) InFlight() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.streams)
}

// Do calls f with the engine under the driver's lock, after bringing it up to date.
func (d *Driver) Do(f func(e *Engine)) {
	d.mu.Lock()
	d.advanceLocked(d.nowLocked())
	f(d.engine)
	d.mu.Unlock()
	d.poke()
}

func (d *Driver) poke() {
	select {
	case d.wake <- struct{}{}:
	default:
	}
}

// advanceLocked runs the engine to now and dispatches the events.
func (d *Driver) advanceLocked(now time.Duration) {
	if now < d.engine.Now() {
		return
	}
	d.events = d.engine.AdvanceTo(now, d.events[:0])
	for _, ev := range d.events {
		if d.observe != nil {
			d.observe(ev)
		}
		s := d.streams[ev.Request]
		if s == nil {
			continue
		}
		s.push(ev)
		if ev.Kind == EventFinished {
			delete(d.streams, ev.Request)
		}
	}
	clear(d.events)
}

func (d *Driver) run() {
	defer close(d.done)
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		d.mu.Lock()
		now := d.nowLocked()
		d.advanceLocked(now)
		wait := time.Hour
		if next, ok := d.engine.NextEventTime(); ok && !d.frozen {
			wait = time.Duration(float64(next-now) / d.speed)
		}
		d.mu.Unlock()
		timer.Reset(max(wait, 0))
		select {
		case <-d.stop:
			return
		case <-d.wake:
		case <-timer.C:
		}
	}
}
