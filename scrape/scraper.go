package scrape

import (
	"context"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
)

// Scraper defaults and bounds.
const (
	defaultScrapeInterval  = time.Second
	MinInterval            = 100 * time.Millisecond
	defaultModelsInterval  = 10 * time.Second
	defaultSlowInterval    = 10 * time.Second
	defaultMetricsPath     = "/metrics"
	defaultModelsPath      = "/v1/models"
	defaultScrapeWorkers   = 64
	maxExpositionBytes     = 8 << 20 // real vLLM expositions are ~100-300 KB
	maxModelsBytes         = 4 << 20
	scrapeAcceptHeader     = "text/plain;version=0.0.4;q=1,*/*;q=0.1"
	defaultStaleIntervals  = 3 // signals older than this many intervals are stale by default
	maxScrapeErrorMessages = 256
)

// Config configures a scraper. Zero values mean the defaults.
type Config struct {
	// Interval is the time between scrapes of each target. Default 1s,
	// minimum 100ms.
	Interval time.Duration
	// Timeout bounds one fetch. Default Interval.
	Timeout time.Duration
	// ModelsInterval is the time between fetches of /v1/models. Default
	// 10s; negative disables them.
	ModelsInterval time.Duration
	// SlowInterval is the time between reads of the figures that change
	// slowly or only feed the admin API (vLLM's cache configuration, the
	// prefix cache figures), carried over in between. Default 10s, never
	// less than Interval.
	SlowInterval time.Duration
	// MetricsPath is the metrics endpoint's path. Default /metrics.
	MetricsPath string
	// ModelsPath is the models endpoint's path. Default /v1/models.
	ModelsPath string
	// Scheme is the URL scheme of the targets. Default http.
	Scheme string
	// Workers bounds the fetches in flight at once. Default 64: a round's
	// fetches in flight together cost less CPU each than one after
	// another, since the runtime's network poller wakes for many at once.
	Workers int
	// Client makes the requests. Default: a client of its own that keeps
	// connections alive, ignores proxy environment variables and does not
	// ask for compression (cheaper on both ends at these sizes).
	Client *http.Client
	// Mark, when set, is called with the dial just before each metrics
	// request is sent; its result is stored in EngineSignals.Mark. The
	// policy passes its cumulative charges to the dial, so that the
	// charges made since the scrape are now.since(sig.Mark).
	Mark func(dial string) Mark
	// Logger receives scrape failures and recoveries at debug level.
	Logger *zap.Logger
}

// withDefaults returns c with defaults filled in and bounds applied.
func (c Config) withDefaults() Config {
	if c.Interval <= 0 {
		c.Interval = defaultScrapeInterval
	}
	c.Interval = max(c.Interval, MinInterval)
	if c.Timeout <= 0 {
		c.Timeout = c.Interval
	}
	if c.ModelsInterval == 0 {
		c.ModelsInterval = defaultModelsInterval
	}
	if c.SlowInterval <= 0 {
		c.SlowInterval = defaultSlowInterval
	}
	c.SlowInterval = max(c.SlowInterval, c.Interval)
	if c.MetricsPath == "" {
		c.MetricsPath = defaultMetricsPath
	}
	if c.ModelsPath == "" {
		c.ModelsPath = defaultModelsPath
	}
	if c.Scheme == "" {
		c.Scheme = "http"
	}
	if c.Workers <= 0 {
		c.Workers = defaultScrapeWorkers
	}
	if c.Logger == nil {
		c.Logger = zap.NewNop()
	}
	return c
}

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

// scrapeTarget is one upstream being scraped.
type scrapeTarget struct {
	dial      string
	modelsURL string
	// metricsURLs are the metrics URLs of each metricsQuery, by index.
	metricsURLs [numMetricsQueries]string
	// metricsRequests are the metrics GETs of each metricsQuery, by index,
	// as sent on a kept-alive connection (plain HTTP only); nil to go
	// through the http.Client.
	metricsRequests [numMetricsQueries][]byte

	// conn is the target's own kept-alive connection for metrics, used
	// by one fetch at a time (busy), closed when the target goes.
	connMu sync.Mutex
	conn   *bufferedConn
	closed bool

	// latest is the last successful scrape, read without locks.
	latest atomic.Pointer[Signals]

	// mu guards the fields below.
	mu        sync.Mutex
	busy      bool // a fetch is in flight
	status    Status
	models    []ModelInfo
	modelsDue time.Time
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
// upstreams in the background and keeps the latest EngineSignals of
// each. One scraper belongs to one policy instance: the policy creates it
// in Provision, gives it its static upstreams with setTargets, starts it
// with the caddy.Context (it stops when the config is unloaded) and reads
// signals while routing. A reload builds a new scraper, which scrapes at
// once; until its first results the policy uses its own tracking.
type Scraper struct {
	cfg        Config
	client     *http.Client
	ownsClient bool

	mu      sync.RWMutex
	targets map[string]*scrapeTarget

	kick    chan struct{} // asks for a round now
	done    chan struct{} // closed when the run loop has stopped
	started atomic.Bool
}

// New returns a scraper with cfg (defaults filled in). It does
// nothing until start.
func New(cfg Config) *Scraper {
	cfg = cfg.withDefaults()
	s := &Scraper{
		cfg:     cfg,
		client:  cfg.Client,
		targets: make(map[string]*scrapeTarget),
		kick:    make(chan struct{}, 1),
		done:    make(chan struct{}),
	}
	if s.client == nil {
		tr := http.DefaultTransport.(*http.Transport).Clone()
		tr.Proxy = nil // upstreams are dialled directly, as reverse_proxy does
		tr.DisableCompression = true
		tr.MaxIdleConnsPerHost = 2
		tr.MaxIdleConns = 0
		tr.ForceAttemptHTTP2 = false
		tr.ReadBufferSize = 64 << 10 // an exposition in a few reads, not dozens
		s.client = &http.Client{Transport: tr}
		s.ownsClient = true
	}
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
	for d, t := range s.targets {
		if !keep[d] {
			t.closeConn()
			delete(s.targets, d)
		}
	}
	s.mu.Unlock()
	if added {
		s.poke()
	}
}

// AddTargets adds dials not scraped yet and scrapes them at once, leaving
// the others alone. It is cheap when every dial is already a target, so
// the policy may call it with each pool it sees (dynamic upstreams);
// only setTargets removes targets.
func (s *Scraper) AddTargets(dials ...string) {
	s.mu.RLock()
	missing := false
	for _, d := range dials {
		if _, ok := s.targets[d]; !ok && scrapable(d) {
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

// addLocked adds dial as a target if it is new and scrapable, and says
// whether it did. Caller holds s.mu for writing.
func (s *Scraper) addLocked(d string) bool {
	if _, ok := s.targets[d]; ok || !scrapable(d) {
		return false
	}
	base := s.cfg.Scheme + "://" + d
	t := &scrapeTarget{dial: d, modelsURL: base + s.cfg.ModelsPath, status: Status{Dial: d}}
	for mode := range numMetricsModes {
		for _, skipSlow := range []bool{false, true} {
			q := metricsQuery{mode, skipSlow}
			path := q.path(s.cfg.MetricsPath)
			t.metricsURLs[q.index()] = base + path
			if s.cfg.Scheme == "http" && s.ownsClient {
				t.metricsRequests[q.index()] = []byte("GET " + path + " HTTP/1.1\r\nHost: " + d +
					"\r\nAccept: " + scrapeAcceptHeader + "\r\nUser-Agent: caddy-llm-affinity\r\n\r\n")
			}
		}
	}
	s.targets[d] = t
	return true
}

// scrapable says whether dial is a host:port the scraper can reach (not
// empty, not a unix socket).
func scrapable(dial string) bool {
	return dial != "" && !strings.Contains(dial, "/")
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
	go s.run(ctx)
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
		if s.ownsClient {
			s.client.CloseIdleConnections()
		}
		s.mu.RLock()
		for _, t := range s.targets {
			t.closeConn()
		}
		s.mu.RUnlock()
	}()

	ticker := time.NewTicker(s.cfg.Interval)
	defer ticker.Stop()
	for {
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
	s.mu.RLock()
	ts := make([]*scrapeTarget, 0, len(s.targets))
	for _, t := range s.targets {
		ts = append(ts, t)
	}
	s.mu.RUnlock()
	for _, t := range ts {
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

	t.mu.Lock()
	modelsDue := err == nil && s.cfg.ModelsInterval > 0 && !start.Before(t.modelsDue)
	if modelsDue {
		t.modelsDue = start.Add(s.cfg.ModelsInterval)
	}
	t.mu.Unlock()

	var models []ModelInfo
	var modelsErr error
	if modelsDue {
		models, modelsErr = s.fetchModels(ctx, t.modelsURL)
	}

	t.mu.Lock()
	defer t.mu.Unlock()
	t.busy = false
	st := &t.status
	if err != nil {
		st.Errors++
		st.ConsecutiveErrors++
		st.LastError, st.LastErrorAt = truncate(err.Error(), maxScrapeErrorMessages), time.Now()
		if st.ConsecutiveErrors == 1 {
			s.cfg.Logger.Debug("engine metrics scrape failing", zap.String("upstream", t.dial), zap.Error(err))
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
		if modelsErr != nil {
			st.ModelsError = truncate(modelsErr.Error(), maxScrapeErrorMessages)
		} else {
			st.ModelsError = ""
			t.models = models
		}
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
	sig.Models = t.models
	sig.Seq = st.Scrapes
	t.latest.Store(&sig)
}

// truncate shortens s to at most n bytes.
func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n]
}

// Latest returns dial's latest signals. ok is false when there are none
// or they are older than maxAge at now (maxAge ≤ 0 means three scrape
// intervals); the caller then relies on its own tracking. It never
// blocks on a fetch.
func (s *Scraper) Latest(dial string, now time.Time, maxAge time.Duration) (Signals, bool) {
	if s == nil {
		return Signals{}, false
	}
	s.mu.RLock()
	t := s.targets[dial]
	s.mu.RUnlock()
	if t == nil {
		return Signals{}, false
	}
	p := t.latest.Load()
	if p == nil {
		return Signals{}, false
	}
	if maxAge <= 0 {
		maxAge = defaultStaleIntervals * s.cfg.Interval
	}
	if now.Sub(p.ScrapedAt) > maxAge {
		return *p, false
	}
	return *p, true
}

// Seq returns how many successful scrapes of dial there have been,
// 0 when none: a cheap way to see that new signals arrived.
func (s *Scraper) Seq(dial string) uint64 {
	if s == nil {
		return 0
	}
	s.mu.RLock()
	t := s.targets[dial]
	s.mu.RUnlock()
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
	if s == nil {
		return Status{}, false
	}
	s.mu.RLock()
	t := s.targets[dial]
	s.mu.RUnlock()
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
	s.mu.RLock()
	ts := make([]*scrapeTarget, 0, len(s.targets))
	for _, t := range s.targets {
		ts = append(ts, t)
	}
	s.mu.RUnlock()
	out := make([]Status, 0, len(ts))
	for _, t := range ts {
		t.mu.Lock()
		out = append(out, t.status)
		t.mu.Unlock()
	}
	slices.SortFunc(out, func(a, b Status) int { return strings.Compare(a.Dial, b.Dial) })
	return out
}
