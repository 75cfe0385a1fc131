package caddyllm

import (
	"errors"
	"maps"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/llmaffinity/caddy-llm-affinity/drain"
	"github.com/llmaffinity/caddy-llm-affinity/router"
	"github.com/llmaffinity/caddy-llm-affinity/scorer"
)

// metrics are the plugin's collectors. They live in the shared host, so
// their values survive reloads; each Provision registers them with that
// config's fresh registry. Label sets are bounded: reasons are a fixed
// set, and the upstream label is a dial address only for upstreams a
// loaded config names (others share the label "other"); a forgotten
// upstream's series are deleted.
type metrics struct {
	decisions        *prometheus.CounterVec
	shed             *prometheus.CounterVec
	refused          *prometheus.CounterVec
	queued           prometheus.Counter
	matchedTokens    prometheus.Histogram
	cachedTokens     *prometheus.CounterVec
	drainCompleted   prometheus.Counter
	movedRequests    *prometheus.CounterVec
	drainTransitions *prometheus.CounterVec

	// The latency histograms, by upstream and decision reason (queue
	// wait by reason only: a shed request has no upstream).
	timeToFirstToken *prometheus.HistogramVec
	requestDuration  *prometheus.HistogramVec
	queueWait        *prometheus.HistogramVec
	estimateError    *prometheus.HistogramVec
	prefixMatch      *prometheus.HistogramVec

	collectors []prometheus.Collector

	// Series resolved once, since WithLabelValues hashes and looks up
	// its labels on every call and these are on every request's path:
	// the prompt token counters, and (as first used) the decision
	// counter and queue wait of each reason and the latency series of
	// each named upstream and reason, plus other's series by reason
	// (keyed with an empty dial). The maps are copied on write under mu,
	// so a lookup takes no lock; only the router's reasons are kept, so
	// they are bounded by the named upstreams.
	promptTokens, cachedPromptTokens prometheus.Counter
	decisionsBy                      atomic.Pointer[map[string]prometheus.Counter]
	queueWaitBy                      atomic.Pointer[map[string]prometheus.Observer]
	series                           atomic.Pointer[map[seriesKey]*latencySeries]

	mu sync.RWMutex
	// named holds the upstreams a loaded config names: the only dials
	// used as label values. namings counts its changes, which change
	// what latency returns (see seriesRef).
	named   map[string]bool
	namings atomic.Uint64
	// recent are the named upstreams' recent first tokens.
	recent map[string]*ttftRing
}

// reasons are the decision reasons the router gives.
var reasons = []string{
	string(scorer.Warm), string(scorer.Cold), string(scorer.Spill), string(scorer.Adapter), string(scorer.Shed), fallbackReason, refusedReason,
	canceledWhileHeld,
}

// fallbackReason is the reason of requests balanced without parsed
// content.
const fallbackReason = "fallback"

// seriesKey names an upstream's latency series for one reason.
type seriesKey struct{ dial, reason string }

// latencySeries are the latency histograms' series of one upstream label
// and reason, and the reason's decision counter and queue wait, which a
// decision observes with them.
type latencySeries struct {
	ttft, duration, estimateError, prefixMatch prometheus.Observer
	decisions                                  prometheus.Counter
	queueWait                                  prometheus.Observer
}

// otherUpstream is the upstream label of upstreams no loaded config names
// (dynamic ones), which would otherwise make the label set unbounded.
const otherUpstream = "other"

// latencyBuckets are the buckets of the latency histograms, in seconds:
// 5 ms to about 82 s, doubling; durationBuckets go on to about 11
// minutes, for whole generations (production.Caddyfile lets one take 5).
var (
	latencyBuckets  = prometheus.ExponentialBuckets(0.005, 2, 15)
	durationBuckets = prometheus.ExponentialBuckets(0.005, 2, 18)
)

// estimateErrorBuckets are signed: observed minus estimated TTFT is
// negative when the first token came sooner than estimated. Prometheus
// histograms accept negative bounds (le="-0.5" counts errors ≤ -0.5 s);
// the series' _sum can then fall, so take rate() of _count and _bucket
// only. Symmetric around 0, 10 ms to 20 s each way.
var estimateErrorBuckets = func() []float64 {
	pos := []float64{0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20}
	out := make([]float64, 0, 2*len(pos)+1)
	for i := len(pos) - 1; i >= 0; i-- {
		out = append(out, -pos[i])
	}
	out = append(out, 0)
	return append(out, pos...)
}()

func newMetrics(sh *shared) *metrics {
	m := &metrics{
		decisions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "caddy", Subsystem: "llm_affinity", Name: "decisions_total",
			Help: "Routing decisions by reason (warm, cold, spill, adapter, fallback, shed, refused).",
		}, []string{"reason"}),
		shed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "caddy", Subsystem: "llm_affinity", Name: "shed_total",
			Help: "Requests shed (503 with Retry-After) after waiting at the gateway for queue_timeout, or at once when queue_limit requests waited (blocked_by=queue_full), drains moved them too often (blocked_by=moved) or only upstreams that are down might serve their model (blocked_by=not_running), by what blocked them.",
		}, []string{"blocked_by"}),
		refused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "caddy", Subsystem: "llm_affinity", Name: "refused_total",
			Help: "Requests answered at once with an error no wait can cure, by its code: model_not_found (404), context_length_exceeded (400), 400 (no model named in a pool serving several, or a body that is not valid UTF-8 naming a model no upstream lists).",
		}, []string{"code"}),
		queued: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: "caddy", Subsystem: "llm_affinity", Name: "gateway_queued_total",
			Help: "Requests that had to wait at the gateway because no upstream fit.",
		}),
		matchedTokens: prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: "caddy", Subsystem: "llm_affinity", Name: "matched_tokens",
			Help:    "Prompt tokens the chosen upstream was expected to hold in its prefix cache.",
			Buckets: append([]float64{0}, prometheus.ExponentialBuckets(64, 2, 12)...), // 0: cold
		}),
		timeToFirstToken: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: "caddy", Subsystem: "llm_affinity", Name: "time_to_first_token_seconds",
			Help:    "Time from the request's arrival to its first streamed token (non-streaming: the response headers), by upstream and decision reason.",
			Buckets: latencyBuckets,
		}, []string{"upstream", "reason"}),
		requestDuration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: "caddy", Subsystem: "llm_affinity", Name: "request_duration_seconds",
			Help:    "Time from the request's arrival to the last byte of its response, for routed requests, by upstream and decision reason.",
			Buckets: durationBuckets,
		}, []string{"upstream", "reason"}),
		queueWait: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: "caddy", Subsystem: "llm_affinity", Name: "queue_wait_seconds",
			Help:    "Time a routing attempt was held at the gateway (0 when an upstream fit at once), by the decision's reason (shed: it gave up).",
			Buckets: append([]float64{0}, latencyBuckets...),
		}, []string{"reason"}),
		estimateError: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: "caddy", Subsystem: "llm_affinity", Name: "ttft_estimate_error_seconds",
			Help:    "Observed minus estimated time to first token of streamed responses, both from the decision; negative when the token came sooner than estimated (signed buckets; _sum may fall).",
			Buckets: estimateErrorBuckets,
		}, []string{"upstream", "reason"}),
		prefixMatch: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: "caddy", Subsystem: "llm_affinity", Name: "prefix_match_ratio",
			Help:    "Per decision, the share of the prompt's tokens the chosen upstream was expected to hold in its prefix cache.",
			Buckets: []float64{0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1},
		}, []string{"upstream", "reason"}),
		cachedTokens: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "caddy", Subsystem: "llm_affinity", Name: "prompt_tokens_total",
			Help: "Prompt tokens of completed requests as the engines reported them, and how many were cached.",
		}, []string{"kind"}),
		drainCompleted: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: "caddy", Subsystem: "llm_affinity", Name: "drain_completed_total",
			Help: "Requests that completed on an upstream while it was draining (a drain, or no loaded config naming it any more).",
		}),
		movedRequests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "caddy", Subsystem: "llm_affinity", Name: "moved_requests_total",
			Help: "Requests cut off their upstream (cause: drain deadline or upstream_error), by outcome: redispatched (not started, sent elsewhere), continued (stream continued elsewhere to its end), cut (ended with an error event, its continuation included, or the client left).",
		}, []string{"cause", "outcome"}),
		drainTransitions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "caddy", Subsystem: "llm_affinity", Name: "drain_transitions_total",
			Help: "Upstream drain state changes (draining, drained, undrained).",
		}, []string{"to"}),
		named:  make(map[string]bool),
		recent: make(map[string]*ttftRing),
	}
	m.promptTokens = m.cachedTokens.WithLabelValues("prompt")
	m.cachedPromptTokens = m.cachedTokens.WithLabelValues("cached")
	// The counters whose labels have a fixed set of values start at 0,
	// so that a rate or an alert sees them before their first event.
	for _, blockedBy := range []string{"kv", "context", "draining", "unavailable", "model", "none", queueFullReason, movedReason, notRunningReason} {
		m.shed.WithLabelValues(blockedBy)
	}
	for _, code := range []string{"model_not_found", "context_length_exceeded", "400"} {
		m.refused.WithLabelValues(code)
	}
	for _, reason := range []string{string(scorer.Warm), string(scorer.Cold), string(scorer.Spill), string(scorer.Adapter),
		fallbackReason, string(scorer.Shed), refusedReason} {
		m.decisions.WithLabelValues(reason)
	}
	for _, to := range []string{"draining", "drained", "undrained"} {
		m.drainTransitions.WithLabelValues(to)
	}
	for _, cause := range []string{"drain", "upstream_error"} {
		for _, outcome := range []string{"redispatched", "continued", "cut"} {
			m.movedRequests.WithLabelValues(cause, outcome)
		}
	}
	m.collectors = []prometheus.Collector{
		m.decisions, m.shed, m.refused, m.queued, m.matchedTokens, m.cachedTokens,
		m.timeToFirstToken, m.requestDuration, m.queueWait, m.estimateError, m.prefixMatch,
		m.drainCompleted, m.movedRequests, m.drainTransitions, newFleetCollector(sh), newSyncCollector(sh),
	}
	return m
}

// register registers the collectors with ctx's registry, ignoring the ones
// it already has.
func (m *metrics) register(ctx caddy.Context) {
	reg := ctx.GetMetricsRegistry()
	if reg == nil {
		return
	}
	for _, c := range m.collectors {
		var already prometheus.AlreadyRegisteredError
		if err := reg.Register(c); err != nil && !errors.As(err, &already) {
			ctx.Logger().Warn("registering metric", zap.Error(err))
		}
	}
}

// registerRunningMetrics registers the running configs' router metrics
// with the registry of ctx, the config being loaded, before anything in
// it can fail. Caddy's admin API serves the registry of the last config it
// tried to load, also when it rejected it (the running one goes on): the
// router's metrics then stay there until a load succeeds, as long as the
// rejection came from the router's own modules or after them.
func registerRunningMetrics(ctx caddy.Context) {
	if sh := lookupShared(); sh != nil {
		sh.metrics.register(ctx)
	}
}

// name makes dial a label value: a loaded config names it.
func (m *metrics) name(dial string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if !m.named[dial] {
		m.named[dial] = true
		m.namings.Add(1)
	}
}

// forget deletes dial's series: no loaded config names it any more. All
// under mu, so that no lookup resolves and keeps a series of dial
// between the drop from the cache and the deletion.
func (m *metrics) forget(dial string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	delete(m.named, dial)
	m.namings.Add(1)
	delete(m.recent, dial)
	if old := m.series.Load(); old != nil {
		for k := range *old {
			if k.dial == dial {
				series := maps.Clone(*old)
				maps.DeleteFunc(series, func(k seriesKey, _ *latencySeries) bool { return k.dial == dial })
				m.series.Store(&series)
				break
			}
		}
	}
	for _, v := range []*prometheus.HistogramVec{m.timeToFirstToken, m.requestDuration, m.estimateError, m.prefixMatch} {
		v.DeletePartialMatch(prometheus.Labels{"upstream": dial})
	}
}

// cached looks k up in the copy-on-write map p.
func cached[K comparable, V any](p *atomic.Pointer[map[K]V], k K) (V, bool) {
	if m := p.Load(); m != nil {
		v, ok := (*m)[k]
		return v, ok
	}
	var zero V
	return zero, false
}

// cacheLocked adds k to the copy-on-write map p; the caller holds the
// lock that orders its writes.
func cacheLocked[K comparable, V any](p *atomic.Pointer[map[K]V], k K, v V) {
	m := make(map[K]V)
	if old := p.Load(); old != nil {
		m = maps.Clone(*old)
	}
	m[k] = v
	p.Store(&m)
}

// decision is the decisions counter of reason.
func (m *metrics) decision(reason string) prometheus.Counter {
	return byReason(m, &m.decisionsBy, reason, m.decisions.WithLabelValues)
}

// queueWaitOf is the queue wait series of reason.
func (m *metrics) queueWaitOf(reason string) prometheus.Observer {
	return byReason(m, &m.queueWaitBy, reason, m.queueWait.WithLabelValues)
}

// byReason returns reason's series from the copy-on-write map p,
// resolving it the first time; only the router's reasons are kept.
func byReason[V any](m *metrics, p *atomic.Pointer[map[string]V], reason string, resolve func(...string) V) V {
	if v, ok := cached(p, reason); ok {
		return v
	}
	v := resolve(reason)
	if slices.Contains(reasons, reason) {
		m.mu.Lock()
		cacheLocked(p, reason, v)
		m.mu.Unlock()
	}
	return v
}

// latency returns the latency series of dial and reason.
func (m *metrics) latency(dial, reason string) *latencySeries {
	if s, ok := cached(&m.series, seriesKey{dial, reason}); ok {
		return s
	}
	m.mu.RLock()
	named := m.named[dial]
	m.mu.RUnlock()
	if !named {
		// Upstreams no config names share other's series, kept once
		// per reason rather than per dial: their number is unbounded.
		if s, ok := cached(&m.series, seriesKey{reason: reason}); ok {
			return s
		}
	}
	// Resolved before the lock, which resolving them may take.
	decisions, queueWait := m.decision(reason), m.queueWaitOf(reason)
	// Under the lock, so that forget cannot run between the check of
	// the name and the store.
	m.mu.Lock()
	defer m.mu.Unlock()
	key, label := seriesKey{dial, reason}, dial
	if !m.named[dial] {
		key, label = seriesKey{reason: reason}, otherUpstream
	}
	if s, ok := cached(&m.series, key); ok {
		return s
	}
	s := &latencySeries{
		ttft:          m.timeToFirstToken.WithLabelValues(label, reason),
		duration:      m.requestDuration.WithLabelValues(label, reason),
		estimateError: m.estimateError.WithLabelValues(label, reason),
		prefixMatch:   m.prefixMatch.WithLabelValues(label, reason),
		decisions:     decisions,
		queueWait:     queueWait,
	}
	if slices.Contains(reasons, reason) {
		cacheLocked(&m.series, key, s)
	}
	return s
}

// seriesRef keeps the latency series a request's decision resolved (see
// metrics.latency) for the observations that follow it, its first token
// and its end, which would otherwise look it up again, each. It holds
// while the metrics' named upstreams are as they were (namings): naming
// or forgetting an upstream changes the series latency returns.
type seriesRef struct {
	m       *metrics
	namings uint64
	series  *latencySeries
}

// latencyOf returns the latency series of dec's upstream and reason,
// from dec's seriesRef while it holds, resolving and keeping it
// otherwise.
func (m *metrics) latencyOf(dec *decisionRecord) *latencySeries {
	ref := &dec.series
	// Read before latency: a change after the read makes the next use
	// resolve again.
	namings := m.namings.Load()
	if ref.series == nil || ref.m != m || ref.namings != namings {
		*ref = seriesRef{m: m, namings: namings, series: m.latency(dec.upstream, dec.reason)}
	}
	return ref.series
}

// placesCached is how many of a pool's first places a seriesCache keeps.
const placesCached = 64

// seriesCache keeps the latency series that decisions for the upstream
// at each of a policy pool's first places resolved (see resolveAt): the
// pool's order is Caddy's, the same from one request to the next, so a
// decision finds its series by its place without hashing its upstream and
// reason. Entries are never changed once stored.
type seriesCache [placesCached]atomic.Pointer[placedSeries]

// placedSeries is the latency series of dial, by reason (as in reasons),
// as m resolved them while its named upstreams were at namings.
type placedSeries struct {
	m        *metrics
	namings  uint64
	dial     string
	byReason [8]*latencySeries
}

// resolveAt resolves dec's latency series (see latencyOf) through c (none
// when nil), for a decision that chose the upstream at place in the pool.
func (m *metrics) resolveAt(c *seriesCache, place int, dec *decisionRecord) {
	r := slices.Index(reasons, dec.reason)
	if c == nil || place < 0 || place >= len(c) || r < 0 || r >= len(placedSeries{}.byReason) {
		return // latencyOf resolves it
	}
	// Read before latency, as in latencyOf.
	namings := m.namings.Load()
	e := c[place].Load()
	if e != nil && (e.m != m || e.namings != namings || e.dial != dec.upstream) {
		e = nil
	}
	if e != nil && e.byReason[r] != nil {
		dec.series = seriesRef{m: m, namings: namings, series: e.byReason[r]}
		return
	}
	next := &placedSeries{m: m, namings: namings, dial: dec.upstream}
	if e != nil {
		next.byReason = e.byReason
	}
	next.byReason[r] = m.latency(dec.upstream, dec.reason)
	c[place].Store(next)
	dec.series = seriesRef{m: m, namings: namings, series: next.byReason[r]}
}

// observeDecision counts a decision and records its prefix match,
// resolving its latency series for the observations after it.
func (m *metrics) observeDecision(dec *decisionRecord) {
	series := m.latencyOf(dec)
	series.decisions.Inc()
	m.matchedTokens.Observe(float64(dec.matched))
	if dec.prompt > 0 {
		series.prefixMatch.Observe(min(1, float64(dec.matched)/float64(dec.prompt)))
	}
}

// observeFirstToken records a request's time to first token since its
// arrival.
func (m *metrics) observeFirstToken(dec *decisionRecord, sinceArrival time.Duration) {
	m.latencyOf(dec).ttft.Observe(sinceArrival.Seconds())
}

// observeEstimateError records a streamed request's observed minus
// estimated TTFT, both from the decision, in seconds.
func (m *metrics) observeEstimateError(dec *decisionRecord, seconds float64) {
	m.latencyOf(dec).estimateError.Observe(seconds)
}

// observeDuration records a routed request's time from arrival to its
// response's last byte.
func (m *metrics) observeDuration(dec *decisionRecord, sinceArrival time.Duration) {
	m.latencyOf(dec).duration.Observe(sinceArrival.Seconds())
}

// observeCompletion records a finished response's figures. The engine's
// usage is not taken on trust: a counter's Add panics on a negative
// count (which left the request's charge behind, and the client without
// its answer), a count no prompt can have would swamp the counter's rate
// for good, and a cached count over the prompt's its hit rate.
func (m *metrics) observeCompletion(rec *tokenRecorder) {
	if p := rec.usage.promptTokens; rec.hasUsage && p > 0 && p <= router.MaxTokens {
		m.promptTokens.Add(float64(p))
		if n := rec.cachedTokens(); n > 0 {
			m.cachedPromptTokens.Add(float64(min(n, p)))
		}
	}
}

// recentTTFTs is how many of an upstream's recent first tokens (of
// streamed responses) the admin view keeps, for the status page's chart.
const recentTTFTs = 60

// ttftRing holds an upstream's last recentTTFTs observed and estimated
// TTFTs (both from the decision), oldest first once full.
type ttftRing struct {
	observed, estimated [recentTTFTs]float64
	next, n             int
}

func (r *ttftRing) add(observed, estimated float64) {
	r.observed[r.next], r.estimated[r.next] = observed, estimated
	r.next = (r.next + 1) % recentTTFTs
	r.n = min(r.n+1, recentTTFTs)
}

// list returns the samples oldest first.
func (r *ttftRing) list() (observed, estimated []float64) {
	observed, estimated = make([]float64, 0, r.n), make([]float64, 0, r.n)
	for i := range r.n {
		j := (r.next - r.n + i + recentTTFTs) % recentTTFTs
		observed, estimated = append(observed, r.observed[j]), append(estimated, r.estimated[j])
	}
	return observed, estimated
}

// recordTTFT keeps a first token of a named upstream for the admin view
// (dynamic upstreams are not kept: their number is unbounded).
func (m *metrics) recordTTFT(dial string, observed, estimated float64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if !m.named[dial] {
		return
	}
	r := m.recent[dial]
	if r == nil {
		r = new(ttftRing)
		m.recent[dial] = r
	}
	r.add(observed, estimated)
}

// recentTTFT returns dial's recent first tokens, oldest first.
func (m *metrics) recentTTFT(dial string) (observed, estimated []float64) {
	m.mu.RLock()
	defer m.mu.RUnlock()
	if r := m.recent[dial]; r != nil {
		return r.list()
	}
	return nil, nil
}

// fleetCollector exports each upstream's live state at scrape time.
type fleetCollector struct {
	sh                                       *shared
	queued, inFlight, blocks, draining, held *prometheus.Desc
}

func newFleetCollector(sh *shared) *fleetCollector {
	return &fleetCollector{
		sh: sh,
		queued: prometheus.NewDesc("caddy_llm_affinity_upstream_queued_tokens",
			"Tokens routed to the upstream and not yet processed, by phase.", []string{"upstream", "phase"}, nil),
		inFlight: prometheus.NewDesc("caddy_llm_affinity_upstream_in_flight",
			"Requests routed to the upstream and not finished.", []string{"upstream"}, nil),
		blocks: prometheus.NewDesc("caddy_llm_affinity_upstream_index_blocks",
			"Prefix blocks the index believes the upstream holds.", []string{"upstream"}, nil),
		draining: prometheus.NewDesc("caddy_llm_affinity_upstream_drain_phase",
			"1 for the upstream's drain phase (active, draining, drained); for upstream=\"other\", how many of the upstreams no config names are in it.", []string{"upstream", "phase"}, nil),
		held: prometheus.NewDesc("caddy_llm_affinity_gateway_held",
			"Requests waiting at the gateway now for an upstream that can start them, over every loaded policy (each holds at most its queue_limit).", nil, nil),
	}
}

// Describe implements prometheus.Collector.
func (c *fleetCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.queued
	ch <- c.inFlight
	ch <- c.blocks
	ch <- c.draining
	ch <- c.held
}

// Collect implements prometheus.Collector. Upstreams no loaded config
// names (dynamic ones, whose number has no bound) are summed under
// upstream="other", their drain phases counted.
func (c *fleetCollector) Collect(ch chan<- prometheus.Metric) {
	c.sh.startSites("") // the drain phases of the running config
	ch <- prometheus.MustNewConstMetric(c.held, prometheus.GaugeValue, float64(c.sh.fleet.Held()))
	m := c.sh.metrics
	var other UpstreamSnapshot
	otherPhases := map[string]int{}
	for _, u := range c.sh.snapshot() {
		m.mu.RLock()
		named := m.named[u.Dial]
		m.mu.RUnlock()
		if !named {
			other.QueuedPrefillTokens += u.QueuedPrefillTokens
			other.QueuedDecodeTokens += u.QueuedDecodeTokens
			other.InFlight += u.InFlight
			other.IndexBlocks += u.IndexBlocks
			otherPhases[u.Drain]++
			continue
		}
		c.collect(ch, u, u.Dial)
		ch <- prometheus.MustNewConstMetric(c.draining, prometheus.GaugeValue, 1, u.Dial, u.Drain)
	}
	if len(otherPhases) > 0 {
		c.collect(ch, other, otherUpstream)
		for phase, n := range otherPhases {
			ch <- prometheus.MustNewConstMetric(c.draining, prometheus.GaugeValue, float64(n), otherUpstream, phase)
		}
	}
}

// collect sends u's gauges under the label upstream.
func (c *fleetCollector) collect(ch chan<- prometheus.Metric, u UpstreamSnapshot, upstream string) {
	ch <- prometheus.MustNewConstMetric(c.queued, prometheus.GaugeValue, float64(u.QueuedPrefillTokens), upstream, "prefill")
	ch <- prometheus.MustNewConstMetric(c.queued, prometheus.GaugeValue, float64(u.QueuedDecodeTokens), upstream, "decode")
	ch <- prometheus.MustNewConstMetric(c.inFlight, prometheus.GaugeValue, float64(u.InFlight), upstream)
	ch <- prometheus.MustNewConstMetric(c.blocks, prometheus.GaugeValue, float64(u.IndexBlocks), upstream)
}

// UpstreamSnapshot is one upstream's live state, for the admin API and
// metrics.
type UpstreamSnapshot struct {
	Dial                string `json:"dial"`
	QueuedPrefillTokens int    `json:"queued_prefill_tokens"`
	QueuedDecodeTokens  int    `json:"queued_decode_tokens"`
	KVTokensInFlight    int    `json:"kv_tokens_in_flight"`
	// InFlight counts the requests routed to the upstream and not
	// finished, every router's (their events tell of theirs).
	InFlight int `json:"in_flight"`
	// ThisRouterInFlight counts this router's requests on the upstream,
	// routed or passed through (embeddings, models lists, tokenization:
	// not routed, so not in InFlight): what a drain through this router
	// waits for.
	ThisRouterInFlight int   `json:"this_router_in_flight"`
	IndexBlocks        int   `json:"index_blocks"`
	IndexCapacity      int   `json:"index_capacity_blocks"`
	Completed          int64 `json:"completed"`
	// LastTTFTSeconds is the last observed time to first token, from the
	// decision.
	LastTTFTSeconds float64 `json:"last_ttft_seconds"`
	// LastEstimatedTTFTSeconds is the estimate made for the request whose
	// first token LastTTFTSeconds measured.
	LastEstimatedTTFTSeconds float64 `json:"last_estimated_ttft_seconds"`
	// RecentTTFTSeconds are the last (up to 60) observed times to first
	// token, from the decision, oldest first, and RecentEstimatedSeconds
	// the estimates made for the same requests. Kept for upstreams a
	// loaded config names.
	RecentTTFTSeconds      []float64 `json:"recent_ttft_seconds,omitempty"`
	RecentEstimatedSeconds []float64 `json:"recent_estimated_ttft_seconds,omitempty"`
	// KVCapacityTokens is the KV capacity the index and filter use, 0
	// when unknown.
	KVCapacityTokens int `json:"kv_capacity_tokens"`
	// Healthy is Caddy's health verdict, as of the last decision or health
	// poll (every 250 ms once the policy has routed; absent before).
	Healthy     *bool    `json:"healthy,omitempty"`
	Adapters    []string `json:"adapters,omitempty"`
	IdleSeconds float64  `json:"idle_seconds"`
	// IndexResets counts the times the upstream's prefixes were forgotten
	// because its engine restarted (seen by scraping).
	IndexResets int `json:"index_resets"`
	// Engine is what the engine last reported, when scraping is on.
	Engine *EngineView `json:"engine,omitempty"`
	// Drain is the drain phase: active, draining or drained. An
	// upstream no loaded config names any more, listed while requests
	// are in flight there, is draining with DrainCause removed.
	Drain         string    `json:"drain"`
	DrainCause    string    `json:"drain_cause,omitempty"`
	DrainDeadline time.Time `json:"drain_deadline,omitzero"`
}

// removedCause is the drain cause of an upstream no loaded config names
// any more, whose requests in flight run out.
const removedCause = "removed"

// snapshot copies the state of every upstream the router knows: those it
// holds routing state for, and those drained before it ever routed there.
func (sh *shared) snapshot() []UpstreamSnapshot {
	now := time.Now()
	engines := sh.engineViews(now)
	drainOf := map[string]drain.Status{}
	for _, s := range sh.drains.Snapshot() {
		drainOf[s.Key] = s
	}
	states := sh.fleet.Snapshot(now)
	configured := sh.configuredKV()
	out := make([]UpstreamSnapshot, 0, len(states))
	known := make(map[string]bool, len(states))
	for _, u := range states {
		known[u.Dial] = true
		s := UpstreamSnapshot{
			Dial: u.Dial, QueuedPrefillTokens: u.QueuedPrefillTokens, QueuedDecodeTokens: u.QueuedDecodeTokens,
			KVTokensInFlight: u.KVTokensInFlight, InFlight: u.InFlight,
			IndexBlocks: u.IndexBlocks, IndexCapacity: u.IndexCapacityBlocks,
			Completed: u.Completed, LastTTFTSeconds: u.LastTTFT.Seconds(),
			LastEstimatedTTFTSeconds: u.LastEstimatedTTFTSeconds, KVCapacityTokens: u.KVCapacityTokens,
			Healthy: u.Healthy, Adapters: u.Adapters, IdleSeconds: u.Idle.Seconds(), IndexResets: u.IndexResets,
			Drain: "active", Engine: engines[u.Dial],
		}
		if s.KVCapacityTokens == 0 {
			// Not routed to yet: the figure a loaded config gives.
			s.KVCapacityTokens = configured[u.Dial]
		}
		s.RecentTTFTSeconds, s.RecentEstimatedSeconds = sh.metrics.recentTTFT(u.Dial)
		if d, ok := drainOf[u.Dial]; ok {
			s.Drain, s.DrainCause, s.DrainDeadline, s.ThisRouterInFlight = d.Phase, string(d.Cause), d.Deadline, d.InFlight
		}
		if u.Removed {
			// No config names it: its drains were lifted, but nothing
			// routes there any more while its requests run out.
			s.Drain, s.DrainCause, s.DrainDeadline = drain.Draining.String(), removedCause, time.Time{}
		}
		out = append(out, s)
	}
	for dial, d := range drainOf {
		if !known[dial] && d.Phase != "active" {
			out = append(out, UpstreamSnapshot{Dial: dial, Drain: d.Phase, DrainCause: string(d.Cause), DrainDeadline: d.Deadline, ThisRouterInFlight: d.InFlight})
		}
	}
	return out
}
