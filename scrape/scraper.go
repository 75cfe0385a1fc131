package scrape

import (
	"context"
	"errors"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"go.uber.org/zap"
)

// scrapeTarget is one upstream being scraped.
type scrapeTarget struct {
	// dial names the target, as the proxy names the upstream; addr is
	// where it is reached (see Config.Address).
	dial, addr string
	// lastRestart is when the engine was last seen restarting (see
	// Signals.LastRestart);
	// unreachable says the last failures included a refused connection;
	// prevSlow is the last full read, for its counters. Guarded by mu.
	lastRestart time.Time
	unreachable bool
	prevSlow    Signals
	// metricsRequests are the metrics GETs of each metricsQuery, by
	// index, and modelsRequest the models GET, made once (see newGet).
	// They are nil, and requestErr says why, when the dial makes no URL.
	metricsRequests [numMetricsQueries]*http.Request
	modelsRequest   *http.Request
	requestErr      error
	// rawRequests are the metrics GETs as sent on conn, by query index,
	// when the scraper's own client fetches them (plain HTTP, no
	// Config.Client; see fetchKeptAlive); nil otherwise.
	rawRequests [numMetricsQueries][]byte
	// conn is the target's kept connection for rawRequests.
	conn keptConn

	// latest is the last successful scrape, read without locks; down
	// says the last attempt found nothing listening (see Scraper.Down).
	latest atomic.Pointer[Signals]
	down   atomic.Bool

	// mu guards the fields below.
	mu       sync.Mutex
	busy     bool // a fetch is in flight
	status   Status
	models   []ModelInfo
	modelsAt time.Time // when models was fetched
	// modelsChanged says models differs from the list before, not yet
	// counted in Scraper.listsChanged (see modelsFetchEnded).
	modelsChanged bool
	// forgotModels are the models ForgetModel took off the list, and
	// when: a list fetched before that still names them.
	forgotModels map[string]time.Time
	// modelsAuthWarned says a refusal of the list (401, 403) was logged
	// since the last list came.
	modelsAuthWarned bool
	modelsDue        time.Time
	// modelsSent is when the last fetch of the models was sent;
	// modelsFetching says one is under way, and modelsTimer that one is
	// to be sent (see AskModels).
	modelsSent     time.Time
	modelsFetching bool
	modelsTimer    *time.Timer
	// modelsFailures counts the list's fetches that failed since the
	// last that did not; removed says the target is no longer scraped.
	modelsFailures int
	removed        bool
	// modelsAgain says RefreshModels asked for a list while one sent
	// before was under way.
	modelsAgain bool
	// mode is how the metrics are asked for; see metricsMode. In
	// modeWhole the filtered query is tried again from probeDue on.
	mode     metricsMode
	probeDue time.Time
	// slow holds the figures of the slow families last read, until
	// slowDue.
	slow    Signals
	slowDue time.Time
}

// Scraper polls the engines' metrics (and model lists) of a set of
// upstreams in the background and keeps the latest Signals of each.
// One scraper belongs to one policy instance: the policy creates it in
// Provision, gives it its static upstreams with SetTargets, starts it
// with the caddy.Context (it stops when the config is unloaded) and reads
// signals while routing. A reload builds a new scraper, which scrapes at
// once; until its first results the policy uses its own tracking.
type Scraper struct {
	cfg Config
	// client is the configured or the scraper's own client;
	// metricsClient, the same without following redirects, fetches the
	// models, the metrics of https targets and all metrics with a
	// Config.Client. transport is theirs when the scraper made it (no
	// Config.Client), closed with it. Plain HTTP metrics with the
	// scraper's own client go on each target's kept connection instead
	// (rawRequests).
	client, metricsClient *http.Client
	transport             *http.Transport
	raw                   bool // plain HTTP metrics on kept connections

	mu      sync.RWMutex
	targets map[string]*scrapeTarget
	// noTarget holds dials found not scrapable (up to maxNoTargets): the
	// policy offers every pool member with each request, and resolving
	// a placeholder each time would cost it.
	noTarget map[string]bool

	kick    chan struct{} // asks for a round now
	done    chan struct{} // closed when the run loop has stopped
	started atomic.Bool
	// modelsFetched is closed, and replaced, whenever a fetch of a
	// target's models ends (see AskModels); listsChanged counts the
	// fetches whose list differed from the one before (see
	// ModelListsChanged), once the list is in the target's signals and
	// before modelsFetched closes.
	modelsFetched atomic.Pointer[chan struct{}]
	listsChanged  atomic.Uint64
	// ctx is the context Start was given, for fetches AskModels sends;
	// alone counts those fetches under way, and stopping (under aloneMu)
	// says the run loop is waiting for them: no new one starts.
	ctx      atomic.Pointer[context.Context]
	aloneMu  sync.Mutex
	alone    sync.WaitGroup
	stopping bool
	// refetchSpacing is modelsRefetchSpacing (tests lengthen it);
	// resolveSpacing is resolveAgainSpacing (tests shorten it).
	refetchSpacing, resolveSpacing time.Duration
}

// New returns a scraper with cfg (defaults filled in). It does
// nothing until Start.
func New(cfg Config) *Scraper {
	cfg = cfg.withDefaults()
	s := &Scraper{
		cfg:     cfg,
		client:  cfg.Client,
		targets: make(map[string]*scrapeTarget),
		kick:    make(chan struct{}, 1),
		done:    make(chan struct{}),
	}
	fetched := make(chan struct{})
	s.modelsFetched.Store(&fetched)
	s.refetchSpacing, s.resolveSpacing = modelsRefetchSpacing, resolveAgainSpacing
	if s.client == nil {
		s.transport = newTransport(cfg)
		s.client = &http.Client{Transport: s.transport}
		s.raw = cfg.Scheme == "http"
	}
	metrics := *s.client
	metrics.CheckRedirect = noRedirects
	s.metricsClient = &metrics
	return s
}

// SetTargets replaces the set of dials scraped. New dials are scraped at
// once; dropped ones are forgotten with their signals. Dials that are not
// host:port addresses (unix sockets) are skipped.
func (s *Scraper) SetTargets(dials []string) {
	s.mu.Lock()
	keep := make(map[string]bool, len(dials))
	added := false
	for _, d := range dials {
		keep[d] = true
		added = s.addLocked(d) || added
	}
	dropped := false
	for d := range s.targets {
		if !keep[d] {
			dropped = s.dropLocked(d) || dropped
		}
	}
	s.mu.Unlock()
	s.dropped(dropped)
	if added {
		s.poke()
	}
}

// RemoveTargets stops scraping dials and forgets their signals (the
// policy's dynamic upstreams, once idle long enough to be forgotten).
func (s *Scraper) RemoveTargets(dials ...string) {
	s.mu.Lock()
	dropped := false
	for _, d := range dials {
		dropped = s.dropLocked(d) || dropped
	}
	s.mu.Unlock()
	s.dropped(dropped)
}

// dropLocked forgets target d, reporting whether there was one. Caller
// holds s.mu for writing.
func (s *Scraper) dropLocked(d string) bool {
	t, ok := s.targets[d]
	if ok {
		t.conn.close()
		delete(s.targets, d)
		s.cancelScheduledModels(t)
		if p := t.latest.Load(); p != nil && p.Models != nil {
			// Its list leaves ModelLists: a change, for whoever reads
			// them again when the count moves.
			s.listsChanged.Add(1)
		}
	}
	return ok
}

// cancelScheduledModels drops the fetch of t's list AskModels held back,
// if any, and tells the waiters, to decide without it.
func (s *Scraper) cancelScheduledModels(t *scrapeTarget) {
	t.mu.Lock()
	timer := t.modelsTimer
	t.modelsTimer, t.removed = nil, true
	t.mu.Unlock()
	if timer != nil && timer.Stop() {
		s.modelsFetchEnded(nil)
	}
}

// dropped closes idle connections after targets were dropped: theirs go;
// the others' are dialled again at their next scrape.
func (s *Scraper) dropped(some bool) {
	if some && s.transport != nil {
		s.transport.CloseIdleConnections()
	}
}

// AddTargets adds dials not scraped yet and scrapes them at once, leaving
// the others alone. It is cheap when every dial is already a target, so
// the policy may call it with each pool it sees (dynamic upstreams);
// SetTargets and RemoveTargets remove targets.
func (s *Scraper) AddTargets(dials ...string) {
	s.mu.RLock()
	missing := false
	for _, d := range dials {
		if _, ok := s.targets[d]; !ok && !s.noTarget[d] {
			missing = true
			break
		}
	}
	s.mu.RUnlock()
	if !missing {
		return
	}
	s.mu.Lock()
	added := false
	for _, d := range dials {
		added = s.addLocked(d) || added
	}
	s.mu.Unlock()
	if added {
		s.poke()
	}
}

// schemeOf returns the URL scheme to scrape dial with: the configured
// one, or http for a port the proxy reaches without TLS.
func (s *Scraper) schemeOf(dial string) string {
	if s.cfg.Scheme == "https" && len(s.cfg.PlainPorts) > 0 {
		if _, port, err := net.SplitHostPort(dial); err == nil && slices.Contains(s.cfg.PlainPorts, port) {
			return "http"
		}
	}
	return s.cfg.Scheme
}

// addLocked adds dial as a target if it is new and scrapable, and says
// whether it did. Caller holds s.mu for writing.
func (s *Scraper) addLocked(d string) bool {
	if _, ok := s.targets[d]; ok || s.noTarget[d] {
		return false
	}
	return s.addAtLocked(d, s.addressOf(d))
}

// addAtLocked adds dial d, not a target, as one reached at addr, or
// remembers it in noTarget when addr is not scrapable, and says whether
// it added it. Caller holds s.mu for writing.
func (s *Scraper) addAtLocked(d, addr string) bool {
	if !scrapable(addr) {
		if len(s.noTarget) < maxNoTargets {
			if s.noTarget == nil {
				s.noTarget = make(map[string]bool)
			}
			s.noTarget[d] = true
		}
		return false
	}
	base := s.schemeOf(addr) + "://" + addr
	t := &scrapeTarget{dial: d, addr: addr, status: Status{Dial: d}}
	t.modelsRequest, t.requestErr = newGet(base+s.cfg.ModelsPath, "application/json")
	if t.modelsRequest != nil && s.cfg.ModelsAPIKey != "" {
		t.modelsRequest.Header.Set("Authorization", "Bearer "+s.cfg.ModelsAPIKey)
	}
	for mode := range numMetricsModes {
		for _, skipSlow := range []bool{false, true} {
			q := metricsQuery{mode, skipSlow}
			req, err := newGet(base+q.path(s.cfg.MetricsPath), scrapeAcceptHeader)
			if err == nil && s.raw {
				t.rawRequests[q.index()], err = rawRequest(req)
			}
			if err != nil {
				t.requestErr, req = err, nil
			}
			t.metricsRequests[q.index()] = req
		}
	}
	s.targets[d] = t
	return true
}

// maxNoTargets bounds Scraper.noTarget: past it, a dial not scrapable
// costs AddTargets the write lock each time, as dials are not invented
// by clients (they come from the config and dynamic upstream sources).
const maxNoTargets = 1024

// addressOf returns the address dial is reached at (see Config.Address).
func (s *Scraper) addressOf(dial string) string {
	if s.cfg.Address == nil || !strings.Contains(dial, "{") {
		return dial
	}
	return s.cfg.Address(dial)
}

// resolveAgainSpacing is how often the run loop replaces the global
// placeholders of the dials that have some again (see resolveAgain).
const resolveAgainSpacing = 10 * time.Second

// resolveAgain replaces the placeholders of the dials named with some
// again, as Caddy's proxy does with each request and its active health
// checks with each check: one not resolved before (an {env.*} empty, a
// {file.*} not yet written when the config loaded) becomes a target once
// it is, rather than staying unscraped until the next config load; a
// target whose address changed (a {file.*} rewritten) is scraped at the
// new one from then on, as a new target. A target whose placeholders do
// not resolve now keeps its address. It runs on the run loop, never with
// a request, and calls Config.Address without holding s.mu ({file.*}
// reads the disk).
func (s *Scraper) resolveAgain() {
	if s.cfg.Address == nil {
		return
	}
	type dialAddr struct{ dial, addr string }
	var dials []dialAddr // the address each had, "" for no target
	s.mu.RLock()
	for d := range s.noTarget {
		if strings.Contains(d, "{") {
			dials = append(dials, dialAddr{d, ""})
		}
	}
	for d, t := range s.targets {
		if t.addr != d {
			dials = append(dials, dialAddr{d, t.addr})
		}
	}
	s.mu.RUnlock()
	if len(dials) == 0 {
		return
	}
	changed := dials[:0]
	for _, da := range dials {
		if addr := s.cfg.Address(da.dial); scrapable(addr) && addr != da.addr {
			changed = append(changed, dialAddr{da.dial, addr})
		}
	}
	if len(changed) == 0 {
		return
	}
	s.mu.Lock()
	added, dropped := false, false
	for _, da := range changed {
		if _, ok := s.targets[da.dial]; ok {
			dropped = s.dropLocked(da.dial) || dropped
		} else if !s.noTarget[da.dial] {
			continue // gone meanwhile (SetTargets)
		}
		delete(s.noTarget, da.dial)
		added = s.addAtLocked(da.dial, da.addr) || added
	}
	s.mu.Unlock()
	s.dropped(dropped)
	if added {
		s.poke()
	}
}

// scrapable says whether addr is a host:port the scraper can reach (not
// empty, not a unix socket, and no placeholder left, such as
// {http.request.header.X-Upstream}: its host is known only per request).
func scrapable(addr string) bool {
	return addr != "" && !strings.ContainsAny(addr, "/{")
}

// poke asks the run loop for a round now.
func (s *Scraper) poke() {
	select {
	case s.kick <- struct{}{}:
	default:
	}
}

// Start runs the scraper in the background until ctx is done. Calling it
// again does nothing.
func (s *Scraper) Start(ctx context.Context) {
	if !s.started.CompareAndSwap(false, true) {
		return
	}
	s.ctx.Store(&ctx)
	go s.run(ctx)
}

// runCtx is the context the scraper runs with (Background before Start).
func (s *Scraper) runCtx() context.Context {
	if ctx := s.ctx.Load(); ctx != nil {
		return *ctx
	}
	return context.Background()
}

// Stopped returns a channel closed once the scraper has stopped and its
// fetches have returned.
func (s *Scraper) Stopped() <-chan struct{} { return s.done }

// run is the scraper's loop: a round at start, then one per interval
// (and whenever targets are added), each handing the idle targets to a
// fixed pool of workers.
func (s *Scraper) run(ctx context.Context) {
	defer close(s.done)
	jobs := make(chan *scrapeTarget)
	var wg sync.WaitGroup
	for range s.cfg.Workers {
		wg.Go(func() {
			for t := range jobs {
				s.scrape(ctx, t)
			}
		})
	}
	defer func() {
		close(jobs)
		wg.Wait()
		s.aloneMu.Lock()
		s.stopping = true
		s.aloneMu.Unlock()
		s.alone.Wait()
		for _, t := range s.targetList() {
			s.cancelScheduledModels(t)
		}
		if s.transport != nil {
			s.transport.CloseIdleConnections()
		}
		s.mu.RLock()
		for _, t := range s.targets {
			t.conn.close()
		}
		s.mu.RUnlock()
	}()

	ticker := time.NewTicker(s.cfg.Interval)
	defer ticker.Stop()
	resolveDue := time.Now().Add(s.resolveSpacing)
	for {
		if now := time.Now(); !now.Before(resolveDue) {
			s.resolveAgain()
			resolveDue = now.Add(s.resolveSpacing)
		}
		s.round(ctx, jobs)
		select {
		case <-ctx.Done():
			return
		case <-ticker.C:
		case <-s.kick:
		}
	}
}

// round hands every target without a fetch in flight to the workers.
func (s *Scraper) round(ctx context.Context, jobs chan<- *scrapeTarget) {
	for _, t := range s.targetList() {
		t.mu.Lock()
		if t.busy {
			t.mu.Unlock()
			continue
		}
		t.busy = true
		t.mu.Unlock()
		select {
		case jobs <- t:
		case <-ctx.Done():
			t.mu.Lock()
			t.busy = false
			t.mu.Unlock()
			return
		}
	}
}

// scrape fetches t's metrics (and models when due) and records the
// outcome.
func (s *Scraper) scrape(ctx context.Context, t *scrapeTarget) {
	start := time.Now()
	t.mu.Lock()
	skipSlow := t.slow.NumGPUBlocks > 0 && start.Before(t.slowDue)
	mode := t.mode
	if mode == modeWhole && !start.Before(t.probeDue) {
		// Now and then ask for less again: the engine behind the dial may
		// have changed.
		mode, t.mode, t.probeDue = modeNamed, modeNamed, start.Add(wholeProbeIntervals*s.cfg.SlowInterval)
	}
	t.mu.Unlock()
	sig, err := s.fetchMetricsMode(ctx, t, mode, skipSlow)
	if err == nil {
		start = sig.ScrapedAt
	}
	if err != nil && ctx.Err() != nil {
		t.mu.Lock()
		t.busy = false
		t.mu.Unlock()
		return // shutting down: not the upstream's fault
	}

	down := err != nil && refused(err)
	t.mu.Lock()
	// The model list has a schedule of its own: an engine whose /metrics
	// fails or is slow still says what it serves (unless nothing listens).
	// So has an engine answering again after refusals (a new process,
	// perhaps with other adapters).
	modelsDue := !down && s.cfg.ModelsInterval > 0 && !t.modelsFetching &&
		(!start.Before(t.modelsDue) || err == nil && t.unreachable)
	if modelsDue {
		t.modelsDue = start.Add(s.cfg.ModelsInterval)
		t.modelsSent, t.modelsFetching = time.Now(), true
	}
	t.mu.Unlock()

	var models []ModelInfo
	var modelsErr error
	if modelsDue {
		models, modelsErr = s.fetchModels(ctx, t)
	}

	var restartedAt time.Time // told once t.mu is released
	defer func() {
		if !restartedAt.IsZero() && s.cfg.Restarted != nil {
			s.cfg.Restarted(t.dial, restartedAt)
		}
	}()
	t.mu.Lock()
	defer t.mu.Unlock()
	t.busy = false
	if modelsDue {
		s.endModelsFetchLocked(t)
		// Under t.mu, once the list is recorded: whoever sees the new list
		// (AskModels, which takes t.mu) sees the channel closed.
		defer s.modelsFetchEnded(t)
	}
	st := &t.status
	t.down.Store(down)
	if err != nil {
		if down {
			// Nothing listens on the engine's port: when it answers
			// again it is a new process, with an empty prefix cache.
			t.unreachable = true
		}
		st.Errors++
		st.ConsecutiveErrors++
		st.LastError, st.LastErrorAt = truncate(err.Error(), maxScrapeErrorMessages), time.Now()
		if st.ConsecutiveErrors == 1 {
			s.cfg.Logger.Debug("engine metrics scrape failing", zap.String("upstream", t.dial), zap.Error(err))
		}
		if modelsDue {
			s.noteModels(t, st, models, modelsErr, start)
			if modelsErr == nil {
				t.publishModelsLocked()
			}
		}
		return
	}
	if st.ConsecutiveErrors > 0 {
		s.cfg.Logger.Debug("engine metrics scrape recovered", zap.String("upstream", t.dial),
			zap.Int("failures", st.ConsecutiveErrors))
	}
	st.Scrapes++
	st.ConsecutiveErrors = 0
	st.LastSuccess = start
	if modelsDue {
		s.noteModels(t, st, models, modelsErr, start)
	}

	e := engineNamed(sig.Engine)
	switch {
	case skipSlow && sig.Engine == t.slow.Engine:
		e.carrySlow(&sig, t.slow)
	case skipSlow:
		// Another engine answers on this dial now: read everything from
		// it next time.
		t.slow = Signals{}
	default:
		if !e.reads(prefixHitRate) && sig.Engine == t.slow.Engine {
			sig.PrefixHitRate = hitRateSince(t.slow, sig)
		}
		t.slow = sig
		t.slowDue = start.Add(s.cfg.SlowInterval)
	}
	if t.unreachable || (!skipSlow && countersReset(t.prevSlow, sig)) || processRestarted(t.latest.Load(), sig) {
		t.lastRestart = time.Now()
		t.unreachable = false
		restartedAt = t.lastRestart
	}
	if !skipSlow {
		t.prevSlow = sig
	}
	sig.LastRestart = t.lastRestart
	sig.Models, sig.ModelsAt = t.models, t.modelsAt
	sig.Seq = st.Scrapes
	t.latest.Store(&sig)
}

// noteModels records a fetch of t's model list, sent at start; caller
// holds t.mu.
func (s *Scraper) noteModels(t *scrapeTarget, st *Status, models []ModelInfo, err error, start time.Time) {
	if err != nil {
		var status *statusError
		if errors.As(err, &status) && (status.code == http.StatusUnauthorized || status.code == http.StatusForbidden) && !t.modelsAuthWarned {
			// Not the engine's trouble but the router's: say how to mend
			// it, once until a list comes.
			t.modelsAuthWarned = true
			s.cfg.Logger.Warn("the engine refused its model list to the router: set models_api_key to the engines' API key",
				zap.String("upstream", t.dial), zap.Error(err))
		}
		st.ModelsError = truncate(err.Error(), maxScrapeErrorMessages)
		t.modelsFailures++
		// Try again soon rather than a whole models interval later: one
		// timeout would leave the router without the list (which models
		// and adapters the engine serves) for that long. Backing off,
		// from one scrape interval to 64 (or the models interval, if
		// shorter), keeps an engine that always refuses from being asked
		// every scrape.
		// Due half an interval early: scrapes start about an interval
		// apart, not exactly, and one a hair early would put the retry
		// off by a whole interval.
		retry := s.cfg.Interval << min(t.modelsFailures-1, 6)
		if retry <= 0 || retry > s.cfg.ModelsInterval {
			retry = s.cfg.ModelsInterval
		}
		t.modelsDue = start.Add(retry - s.cfg.Interval/2)
		return
	}
	for model, at := range t.forgotModels {
		if start.Before(at) {
			// Sent before the engine unloaded it (see ForgetModel).
			models = slices.DeleteFunc(models, func(m ModelInfo) bool { return m.ID == model })
		} else {
			delete(t.forgotModels, model)
		}
	}
	if t.models == nil || !sameModels(t.models, models) {
		t.modelsChanged = true // counted once readers can see it
	}
	st.ModelsError, t.modelsAuthWarned = "", false
	t.models, t.modelsAt, t.modelsFailures = models, start, 0
}

// sameModels says two lists of one engine name the same models, in the
// same order, with the same parents, roots and context lengths; the rest
// of each entry (vLLM's "created" is the time of the answer) may differ.
func sameModels(a, b []ModelInfo) bool {
	return slices.EqualFunc(a, b, func(x, y ModelInfo) bool {
		return x.ID == y.ID && x.Parent == y.Parent && x.Root == y.Root && x.MaxModelLen == y.MaxModelLen
	})
}

// publishModelsLocked makes the list just fetched part of t's latest
// signals, which stay as stale as they were (none yet: signals all stale),
// for a list fetched without a metrics scrape that succeeded. Caller holds
// t.mu.
func (t *scrapeTarget) publishModelsLocked() {
	var sig Signals
	if prev := t.latest.Load(); prev != nil {
		sig = *prev
	}
	sig.Models, sig.ModelsAt = t.models, t.modelsAt
	t.latest.Store(&sig)
}

// refused reports whether err is a failure to connect (nothing listening),
// rather than a slow or failing answer.
func refused(err error) bool {
	// Only a refusal: a timeout or a failed lookup is a network problem,
	// which says nothing about the engine's process. Some dialers wrap
	// the error without Unwrap (Caddy's reverse proxy transport, which
	// engines behind TLS are scraped with, makes a DialError of it): its
	// text still says so.
	return errors.Is(err, syscall.ECONNREFUSED) || strings.Contains(err.Error(), syscall.ECONNREFUSED.Error())
}

// processRestarted reports whether the engine's process start time moved
// since prev, its last scrape: a restart too quick for a refused
// connection to show (a supervisor's, or a port a proxy keeps open), which
// the counters would tell only at the next full read.
func processRestarted(prev *Signals, cur Signals) bool {
	return prev != nil && prev.Engine == cur.Engine && prev.ProcessStart > 0 && cur.ProcessStart > 0 &&
		cur.ProcessStart != prev.ProcessStart
}

// countersReset reports whether the engine's cumulative prefix counters
// went backwards between two reads: the engine restarted.
func countersReset(prev, cur Signals) bool {
	return prev.Engine == cur.Engine && prev.PrefixQueries > 0 && cur.PrefixQueries >= 0 && cur.PrefixQueries < prev.PrefixQueries
}

// truncate shortens s to at most n bytes.
func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n]
}
