package caddyllm

import (
	"errors"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/llmaffinity/caddy-llm-affinity/drain"
	"github.com/llmaffinity/caddy-llm-affinity/router"
)

// metrics are the plugin's collectors. They live in the shared host, so
// their values survive reloads; each Provision registers them with that
// config's fresh registry. Label sets are bounded: reasons are a fixed
// set, upstreams are the configured ones.
type metrics struct {
	decisions        *prometheus.CounterVec
	shed             *prometheus.CounterVec
	queued           prometheus.Counter
	matchedTokens    prometheus.Histogram
	ttft             *prometheus.HistogramVec
	cachedTokens     *prometheus.CounterVec
	drainCompleted   prometheus.Counter
	movedRequests    *prometheus.CounterVec
	drainTransitions *prometheus.CounterVec
	collectors       []prometheus.Collector
}

func newMetrics(sh *shared) *metrics {
	m := &metrics{
		decisions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "caddy", Subsystem: "llm_affinity", Name: "decisions_total",
			Help: "Routing decisions by reason (warm, cold, spill, adapter, fallback, shed).",
		}, []string{"reason"}),
		shed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "caddy", Subsystem: "llm_affinity", Name: "shed_total",
			Help: "Requests shed after waiting at the gateway, by what blocked them.",
		}, []string{"blocked_by"}),
		queued: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: "caddy", Subsystem: "llm_affinity", Name: "gateway_queued_total",
			Help: "Requests that had to wait at the gateway because no upstream fit.",
		}),
		matchedTokens: prometheus.NewHistogram(prometheus.HistogramOpts{
			Namespace: "caddy", Subsystem: "llm_affinity", Name: "matched_tokens",
			Help:    "Prompt tokens the chosen upstream was expected to hold in its prefix cache.",
			Buckets: prometheus.ExponentialBuckets(64, 2, 12),
		}),
		ttft: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: "caddy", Subsystem: "llm_affinity", Name: "ttft_seconds",
			Help:    "Time to first token of streamed responses: estimated at routing and observed.",
			Buckets: prometheus.ExponentialBuckets(0.005, 2, 14),
		}, []string{"kind"}),
		cachedTokens: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "caddy", Subsystem: "llm_affinity", Name: "prompt_tokens_total",
			Help: "Prompt tokens of completed requests as the engines reported them, and how many were cached.",
		}, []string{"kind"}),
		drainCompleted: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: "caddy", Subsystem: "llm_affinity", Name: "drain_completed_total",
			Help: "Requests that completed on an upstream while it was draining.",
		}),
		movedRequests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "caddy", Subsystem: "llm_affinity", Name: "moved_requests_total",
			Help: "Requests cut off their upstream (cause: drain deadline or upstream_error), by outcome: redispatched (not started, sent elsewhere), continued (stream continued elsewhere), cut (ended with an error event).",
		}, []string{"cause", "outcome"}),
		drainTransitions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Namespace: "caddy", Subsystem: "llm_affinity", Name: "drain_transitions_total",
			Help: "Upstream drain state changes (draining, drained, undrained).",
		}, []string{"to"}),
	}
	m.collectors = []prometheus.Collector{
		m.decisions, m.shed, m.queued, m.matchedTokens, m.ttft, m.cachedTokens,
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

// observeCompletion records a finished response's figures.
func (m *metrics) observeCompletion(c *router.Charge, st *requestState, rec *tokenRecorder) {
	if !c.FirstToken.IsZero() && st.req.Stream {
		m.ttft.WithLabelValues("estimated").Observe(c.Estimate)
		m.ttft.WithLabelValues("observed").Observe(c.FirstToken.Sub(c.Started).Seconds())
	}
	if rec.usage != nil {
		m.cachedTokens.WithLabelValues("prompt").Add(float64(rec.usage.PromptTokens))
		if n := rec.cachedTokens(); n > 0 {
			m.cachedTokens.WithLabelValues("cached").Add(float64(n))
		}
	}
}

// fleetCollector exports each upstream's live state at scrape time.
type fleetCollector struct {
	sh                                 *shared
	queued, inFlight, blocks, draining *prometheus.Desc
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
			"1 for the upstream's drain phase (active, draining, drained).", []string{"upstream", "phase"}, nil),
	}
}

// Describe implements prometheus.Collector.
func (c *fleetCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- c.queued
	ch <- c.inFlight
	ch <- c.blocks
	ch <- c.draining
}

// Collect implements prometheus.Collector.
func (c *fleetCollector) Collect(ch chan<- prometheus.Metric) {
	for _, u := range c.sh.snapshot() {
		ch <- prometheus.MustNewConstMetric(c.queued, prometheus.GaugeValue, float64(u.QueuedPrefillTokens), u.Dial, "prefill")
		ch <- prometheus.MustNewConstMetric(c.queued, prometheus.GaugeValue, float64(u.QueuedDecodeTokens), u.Dial, "decode")
		ch <- prometheus.MustNewConstMetric(c.inFlight, prometheus.GaugeValue, float64(u.InFlight), u.Dial)
		ch <- prometheus.MustNewConstMetric(c.blocks, prometheus.GaugeValue, float64(u.IndexBlocks), u.Dial)
		ch <- prometheus.MustNewConstMetric(c.draining, prometheus.GaugeValue, 1, u.Dial, u.Drain)
	}
}

// UpstreamSnapshot is one upstream's live state, for the admin API and
// metrics.
type UpstreamSnapshot struct {
	Dial                string  `json:"dial"`
	QueuedPrefillTokens int     `json:"queued_prefill_tokens"`
	QueuedDecodeTokens  int     `json:"queued_decode_tokens"`
	KVTokensInFlight    int     `json:"kv_tokens_in_flight"`
	InFlight            int     `json:"in_flight"`
	IndexBlocks         int     `json:"index_blocks"`
	IndexCapacity       int     `json:"index_capacity_blocks"`
	Completed           int64   `json:"completed"`
	LastTTFTSeconds     float64 `json:"last_ttft_seconds"`
	// LastEstimatedTTFTSeconds is the estimate made for the last request
	// routed here, to compare with LastTTFTSeconds.
	LastEstimatedTTFTSeconds float64 `json:"last_estimated_ttft_seconds"`
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
	// Drain is the drain phase: active, draining or drained.
	Drain         string    `json:"drain"`
	DrainCause    string    `json:"drain_cause,omitempty"`
	DrainDeadline time.Time `json:"drain_deadline,omitzero"`
}

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
		if d, ok := drainOf[u.Dial]; ok {
			s.Drain, s.DrainCause, s.DrainDeadline = d.Phase, string(d.Cause), d.Deadline
		}
		out = append(out, s)
	}
	for dial, d := range drainOf {
		if !known[dial] && d.Phase != "active" {
			out = append(out, UpstreamSnapshot{Dial: dial, Drain: d.Phase, DrainCause: string(d.Cause), DrainDeadline: d.Deadline})
		}
	}
	return out
}
