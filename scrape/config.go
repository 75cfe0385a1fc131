package scrape

import (
	"net/http"
	"time"

	"go.uber.org/zap"
)

// MinInterval is the shortest scrape interval: Config.Interval is
// raised to it.
const MinInterval = 100 * time.Millisecond

// Scraper defaults.
const (
	defaultScrapeInterval  = time.Second
	defaultModelsInterval  = 10 * time.Second
	defaultSlowInterval    = 10 * time.Second
	defaultMetricsPath     = "/metrics"
	defaultModelsPath      = "/v1/models"
	defaultScrapeWorkers   = 64
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
	// 10s; negative disables them. A fetch that failed is tried again
	// sooner: one Interval later, then twice that, and so on up to 64
	// Intervals or ModelsInterval, whichever is shorter.
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
	// ModelsAPIKey, when set, is sent as a bearer token with each model
	// list's request: vLLM's --api-key guards its /v1 routes (not its
	// /metrics), and an engine behind one refuses the list without it.
	ModelsAPIKey string
	// Scheme is the URL scheme of the targets. Default http.
	Scheme string
	// PlainPorts lists the ports whose targets are scraped over plain
	// http when Scheme is https, as Caddy's HTTP transport reaches them
	// (its tls_except_ports).
	PlainPorts []string
	// Workers bounds the fetches in flight at once. Default 64: a round's
	// fetches in flight together cost less CPU each than one after
	// another, since the runtime's network poller wakes for many at once.
	Workers int
	// Client makes the requests. Default: the scraper's own, which
	// fetches the metrics of plain HTTP targets on a kept connection per
	// target with an HTTP/1.1 client of its own (cheaper than net/http;
	// see fetchKeptAlive), and the rest with a transport that
	// keeps one connection per target alive, dials directly (no proxy)
	// over HTTP/1.1 and does not ask for compression (cheaper on both
	// ends at these sizes). Whichever client, metrics requests do not
	// follow redirects: a redirect says how to ask next (see
	// metricsMode).
	Client *http.Client
	// Mark, when set, is called with the dial just before each metrics
	// request is sent; its result is stored in Signals.Mark. The policy
	// passes its cumulative charges to the dial, so that the charges made
	// since the scrape are now.Since(sig.Mark).
	Mark func(dial string) Mark
	// Restarted, when set, is told of each engine restart as the scrape
	// that sees it ends (without the scraper's locks held), with the time
	// Signals.LastRestart then holds: the index forgets what the engine no
	// longer holds at once, not at the next decision that reads the
	// signals.
	Restarted func(dial string, at time.Time)
	// Address, when set, gives the network address a target's dial is
	// reached at, or "" when it is known only per request. The policy
	// replaces Caddy's global placeholders ({env.*}) there, as Caddy's
	// active health checks do: an upstream "localhost:{env.PORT}" is one
	// fixed engine. Without it a dial with a placeholder is not scraped.
	// The run loop asks again every 10 s (see Scraper.resolveAgain).
	Address func(dial string) string
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
