package scrape

import (
	"slices"
	"strings"
	"time"
)

// Status is a target's scrape health, for the admin API and logs.
type Status struct {
	// Dial is the target's dial address.
	Dial string `json:"dial"`
	// Scrapes counts successful metrics scrapes.
	Scrapes uint64 `json:"scrapes"`
	// Errors counts failed metrics scrapes.
	Errors uint64 `json:"errors"`
	// ConsecutiveErrors counts failures since the last success.
	ConsecutiveErrors int `json:"consecutive_errors"`
	// LastSuccess is when the last successful scrape was sent.
	LastSuccess time.Time `json:"last_success,omitzero"`
	// LastError is the last failure's message (never request content).
	LastError string `json:"last_error,omitempty"`
	// LastErrorAt is when the last failure happened.
	LastErrorAt time.Time `json:"last_error_at,omitzero"`
	// ModelsError is the last /v1/models failure, cleared by a success.
	ModelsError string `json:"models_error,omitempty"`
}

// target returns dial's target, nil when it is none (or s is nil).
func (s *Scraper) target(dial string) *scrapeTarget {
	if s == nil {
		return nil
	}
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.targets[dial]
}

// targetList returns the targets, for walking them without s.mu held.
func (s *Scraper) targetList() []*scrapeTarget {
	s.mu.RLock()
	defer s.mu.RUnlock()
	ts := make([]*scrapeTarget, 0, len(s.targets))
	for _, t := range s.targets {
		ts = append(ts, t)
	}
	return ts
}

// Latest returns dial's latest signals. ok is false when there are none
// or they are older than maxAge at now (maxAge ≤ 0 means three scrape
// intervals); the caller then relies on its own tracking. It never
// blocks on a fetch.
func (s *Scraper) Latest(dial string, now time.Time, maxAge time.Duration) (Signals, bool) {
	sig, young, _ := s.latest(s.target(dial), now, maxAge)
	return sig, young
}

// Current is Latest, and whether dial's last scrape found nothing
// listening (see Down): signals are not fresh then, however young, since
// they describe an engine that is gone.
func (s *Scraper) Current(dial string, now time.Time, maxAge time.Duration) (sig Signals, fresh, down bool) {
	sig, young, down := s.latest(s.target(dial), now, maxAge)
	return sig, young && !down, down
}

// latest is t's latest signals, whether they are within maxAge of now
// (see Latest), and whether its last scrape found nothing listening; t
// may be nil.
func (s *Scraper) latest(t *scrapeTarget, now time.Time, maxAge time.Duration) (sig Signals, young, down bool) {
	if t == nil {
		return Signals{}, false, false
	}
	down = t.down.Load()
	p := t.latest.Load()
	if p == nil {
		return Signals{}, false, down
	}
	if maxAge <= 0 {
		maxAge = defaultStaleIntervals * s.cfg.Interval
	}
	return *p, now.Sub(p.ScrapedAt) <= maxAge, down
}

// RefreshModels fetches dial's model list at the next round, which it
// asks for now, rather than at its next models interval (an adapter was
// loaded or unloaded there): alone, as AskModels fetches it, and again
// after a fetch under way, which was sent before.
func (s *Scraper) RefreshModels(dial string) {
	t := s.target(dial)
	if t == nil {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.modelsFetching {
		t.modelsAgain = true
		return
	}
	s.scheduleModelsLocked(t, time.Now())
}

// ForgetModel takes model off dial's last model list at once, for an
// adapter its engine has just unloaded: requests for it must not go there
// while the list is fetched again (see RefreshModels). A list fetched
// before this (under way meanwhile) does not bring it back; one fetched
// after has the last word.
func (s *Scraper) ForgetModel(dial, model string) {
	t := s.target(dial)
	if t == nil {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.forgotModels == nil || len(t.forgotModels) >= maxForgotModels {
		t.forgotModels = make(map[string]time.Time)
	}
	t.forgotModels[model] = time.Now()
	i := slices.IndexFunc(t.models, func(m ModelInfo) bool { return m.ID == model })
	if i < 0 {
		return
	}
	// A new slice: readers hold the old one.
	t.models = slices.Delete(slices.Clone(t.models), i, i+1)
	t.publishModelsLocked()
	s.listsChanged.Add(1) // once readable, as ModelLists promises
}

// maxForgotModels bounds the unloads a target remembers until a list
// fetched after them comes (clients choose adapter names).
const maxForgotModels = 64

// endModelsFetchLocked notes that t's list fetch under way ended, and
// sends the one RefreshModels asked for meanwhile. Caller holds t.mu.
func (s *Scraper) endModelsFetchLocked(t *scrapeTarget) {
	t.modelsFetching = false
	if t.modelsAgain {
		t.modelsAgain = false
		s.scheduleModelsLocked(t, time.Now())
	}
}

// AskModels has the model lists of dials fetched anew, by themselves (no
// metrics scrape), where the list in hand was fetched before since (a
// request's arrival), and returns how many of them have no list fetched
// since then. A fetch that fails is sent again (an engine whose list
// failed twice running is not waited for). ModelsFetched's channel, taken before the lists were
// last read, tells when one more has come, and ModelListsChanged whether
// any came back changed. A router about to answer that no engine serves a
// model looks again this way, deciding again when a list changed: an
// adapter loaded on an engine directly is listed there before the next
// models interval. Fetches of one list are
// modelsRefetchSpacing apart at least, and shared by all who ask, so that
// clients asking for unknown models cost each engine ten fetches a second
// at most and nothing more. Dials the scraper does not scrape, where
// nothing listens or whose last scrape failed (a list would be as late as
// its metrics) are left out.
func (s *Scraper) AskModels(dials []string, since time.Time) (outstanding int) {
	if s.cfg.ModelsInterval <= 0 {
		return 0 // the lists are not fetched at all
	}
	select {
	case <-s.done:
		return 0
	default:
	}
	now := time.Now()
	for _, d := range dials {
		t := s.target(d)
		if t == nil || t.down.Load() {
			continue
		}
		t.mu.Lock()
		if t.status.ConsecutiveErrors == 0 && t.modelsFailures < 2 && t.modelsAt.Before(since) {
			outstanding++
			s.scheduleModelsLocked(t, now)
		}
		t.mu.Unlock()
	}
	return outstanding
}

// ModelsFetched returns a channel closed when the next fetch of any model
// list ends (see AskModels).
func (s *Scraper) ModelsFetched() <-chan struct{} { return *s.modelsFetched.Load() }

// ModelListsChanged counts the model lists fetched that differed from the
// engine's list before (its first list counts): read before a decision,
// it tells whether a list the decision read has changed since, without
// deciding again. It counts before ModelsFetched's channel closes for the
// same fetch.
func (s *Scraper) ModelListsChanged() uint64 { return s.listsChanged.Load() }

// ModelLists returns the list each target last gave, however old, in no
// particular order; targets with none are left out. A list counted in
// ModelListsChanged is among them, so a caller that reads the count first
// and these after, and reads them again when the count moves, misses no
// change. The lists are shared and must not be modified.
func (s *Scraper) ModelLists() [][]ModelInfo {
	var lists [][]ModelInfo
	for _, t := range s.targetList() {
		if p := t.latest.Load(); p != nil && p.Models != nil {
			lists = append(lists, p.Models)
		}
	}
	return lists
}

// scheduleModelsLocked starts a fetch of t's list, now or, to keep fetches
// modelsRefetchSpacing apart, when the last one sent is that old, unless
// one is under way or scheduled. Caller holds t.mu.
func (s *Scraper) scheduleModelsLocked(t *scrapeTarget, now time.Time) {
	if t.modelsFetching || t.modelsTimer != nil {
		return
	}
	if wait := t.modelsSent.Add(s.refetchSpacing).Sub(now); wait > 0 {
		t.modelsTimer = time.AfterFunc(wait, func() { s.scheduledModels(t) })
		return
	}
	if !s.startAlone() {
		return
	}
	t.modelsFetching, t.modelsSent = true, now
	go s.fetchModelsAlone(t, now)
}

// scheduledModels sends the fetch of t's list a timer held back, unless t
// is no longer one to fetch: removed, down, failing, or the scraper
// stopping. Then the waiters are told, to decide without it.
func (s *Scraper) scheduledModels(t *scrapeTarget) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.modelsTimer = nil
	if t.removed || t.down.Load() || t.status.ConsecutiveErrors > 0 || s.runCtx().Err() != nil {
		defer s.modelsFetchEnded(t)
		return
	}
	s.scheduleModelsLocked(t, time.Now())
}

// startAlone counts a fetch AskModels sends, unless the scraper stops.
func (s *Scraper) startAlone() bool {
	s.aloneMu.Lock()
	defer s.aloneMu.Unlock()
	if s.stopping {
		return false
	}
	s.alone.Add(1)
	return true
}

// fetchModelsAlone fetches t's list, sent at sent, and records it.
func (s *Scraper) fetchModelsAlone(t *scrapeTarget, sent time.Time) {
	defer s.alone.Done()
	ctx := s.runCtx()
	models, err := s.fetchModels(ctx, t)
	t.mu.Lock()
	defer t.mu.Unlock()
	// Under t.mu, once the list is recorded: whoever sees the new list
	// (AskModels, which takes t.mu) sees the channel closed.
	defer s.modelsFetchEnded(t)
	s.endModelsFetchLocked(t)
	if ctx.Err() != nil {
		return // stopping: not the engine's fault
	}
	s.noteModels(t, &t.status, models, err, sent)
	if err == nil {
		t.publishModelsLocked()
	}
}

// modelsRefetchSpacing is the least time between two fetches of one
// engine's list that AskModels sends.
const modelsRefetchSpacing = 100 * time.Millisecond

// modelsFetchEnded tells AskModels' callers that a fetch of t's list
// ended (t nil: one held back was dropped), first counting t's list as
// changed if it was: readers can see it by now. It is called with t's lock
// held, after its list is recorded and published.
func (s *Scraper) modelsFetchEnded(t *scrapeTarget) {
	if t != nil && t.modelsChanged {
		t.modelsChanged = false
		s.listsChanged.Add(1)
	}
	next := make(chan struct{})
	close(*s.modelsFetched.Swap(&next))
}

// ModelsMaxAge is how long a model list stands without a newer fetch
// (Signals.ModelsAt): as many fetch intervals as signals stay fresh.
func (s *Scraper) ModelsMaxAge() time.Duration {
	return defaultStaleIntervals * s.cfg.ModelsInterval
}

// Down reports whether the last scrape of dial found nothing listening on
// its port (the connection refused): its engine is not running.
func (s *Scraper) Down(dial string) bool {
	t := s.target(dial)
	return t != nil && t.down.Load()
}

// Seq returns how many successful scrapes of dial there have been,
// 0 when none: a cheap way to see that new signals arrived.
func (s *Scraper) Seq(dial string) uint64 {
	t := s.target(dial)
	if t == nil {
		return 0
	}
	if p := t.latest.Load(); p != nil {
		return p.Seq
	}
	return 0
}

// StatusOf returns dial's scrape health.
func (s *Scraper) StatusOf(dial string) (Status, bool) {
	t := s.target(dial)
	if t == nil {
		return Status{}, false
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.status, true
}

// Statuses returns every target's scrape health, ordered by dial.
func (s *Scraper) Statuses() []Status {
	if s == nil {
		return nil
	}
	ts := s.targetList()
	out := make([]Status, 0, len(ts))
	for _, t := range ts {
		t.mu.Lock()
		out = append(out, t.status)
		t.mu.Unlock()
	}
	slices.SortFunc(out, func(a, b Status) int { return strings.Compare(a.Dial, b.Dial) })
	return out
}

// Inherit gives each of s's targets what from last saw of the same dial:
// its latest signals, its model list, whether nothing listened there,
// and what tells an engine's restart (its last counters, a refusal not
// yet followed by an answer). A reloaded config's scraper so starts where
// the replaced one left off: it routes with the engines' state at once,
// keeps the model list of an engine that is down, and sees an engine that
// restarted across the reload. Call it before Start.
func (s *Scraper) Inherit(from *Scraper) {
	for _, t := range s.targetList() {
		ft := from.target(t.dial)
		if ft == nil || ft == t {
			continue
		}
		ft.mu.Lock()
		models, modelsAt := ft.models, ft.modelsAt
		unreachable, prevSlow, lastRestart := ft.unreachable, ft.prevSlow, ft.lastRestart
		ft.mu.Unlock()
		latest := ft.latest.Load()

		t.mu.Lock()
		if t.latest.Load() == nil && t.status.Scrapes+t.status.Errors == 0 { // nothing of its own yet
			if latest != nil {
				sig := *latest
				sig.Seq = 0 // this scraper's count of its own scrapes
				t.latest.Store(&sig)
			}
			t.down.Store(ft.down.Load())
			t.unreachable, t.prevSlow, t.lastRestart = unreachable, prevSlow, lastRestart
		}
		if models != nil && modelsAt.After(t.modelsAt) {
			t.models, t.modelsAt = models, modelsAt
			t.publishModelsLocked()
		}
		t.mu.Unlock()
	}
}
