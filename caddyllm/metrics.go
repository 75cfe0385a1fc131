package caddyllm

import (
	"errors"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/llmaffinity/caddy-llm-affinity/drain"
)

// Collectors are package-level so their values survive reloads; each
// Provision registers them with that config's fresh registry. Label sets
// are bounded: reasons are a fixed set, upstreams are the configured ones.
var (
	metricDecisions = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "caddy", Subsystem: "llm_affinity", Name: "decisions_total",
		Help: "Routing decisions by reason (warm, cold, spill, adapter, fallback, shed).",
	}, []string{"reason"})
	metricShed = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "caddy", Subsystem: "llm_affinity", Name: "shed_total",
		Help: "Requests shed after waiting at the gateway, by what blocked them.",
	}, []string{"blocked_by"})
	metricQueued = prometheus.NewCounter(prometheus.CounterOpts{
		Namespace: "caddy", Subsystem: "llm_affinity", Name: "gateway_queued_total",
		Help: "Requests that had to wait at the gateway because no upstream fit.",
	})
	metricMatchedTokens = prometheus.NewHistogram(prometheus.HistogramOpts{
		Namespace: "caddy", Subsystem: "llm_affinity", Name: "matched_tokens",
		Help:    "Prompt tokens the chosen upstream was expected to hold in its prefix cache.",
		Buckets: prometheus.ExponentialBuckets(64, 2, 12),
	})
	metricTTFT = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Namespace: "caddy", Subsystem: "llm_affinity", Name: "ttft_seconds",
		Help:    "Time to first token of streamed responses: estimated at routing and observed.",
		Buckets: prometheus.ExponentialBuckets(0.005, 2, 14),
	}, []string{"kind"})
	metricCachedTokens = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "caddy", Subsystem: "llm_affinity", Name: "prompt_tokens_total",
		Help: "Prompt tokens of completed requests as the engines reported them, and how many were cached.",
	}, []string{"kind"})

	metricDrainCompleted = prometheus.NewCounter(prometheus.CounterOpts{
		Namespace: "caddy", Subsystem: "llm_affinity", Name: "drain_completed_total",
		Help: "Requests that completed on an upstream while it was draining.",
	})
	metricMovedRequests = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "caddy", Subsystem: "llm_affinity", Name: "moved_requests_total",
		Help: "Requests cut off their upstream (cause: drain deadline or upstream_error), by outcome: redispatched (not started, sent elsewhere), continued (stream continued elsewhere), cut (ended with an error event).",
	}, []string{"cause", "outcome"})
	metricDrainTransitions = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "caddy", Subsystem: "llm_affinity", Name: "drain_transitions_total",
		Help: "Upstream drain state changes (draining, drained, undrained).",
	}, []string{"to"})
)

var collectors = []prometheus.Collector{
	metricDrainCompleted, metricMovedRequests, metricDrainTransitions,
	metricDecisions, metricShed, metricQueued, metricMatchedTokens, metricTTFT, metricCachedTokens,
	newFleetCollector(),
}

// registerMetrics registers the collectors with ctx's registry, ignoring
// the ones it already has.
func registerMetrics(ctx caddy.Context) {
	reg := ctx.GetMetricsRegistry()
	if reg == nil {
		return
	}
	for _, c := range collectors {
		var already prometheus.AlreadyRegisteredError
		if err := reg.Register(c); err != nil && !errors.As(err, &already) {
			ctx.Logger().Warn("registering metric", zap.Error(err))
		}
	}
}

// observeCompletion records a finished response's figures.
func observeCompletion(a *attempt, st *requestState, rec *tokenRecorder) {
	if !a.firstByte.IsZero() && st.req.Stream {
		metricTTFT.WithLabelValues("estimated").Observe(a.estimate)
		metricTTFT.WithLabelValues("observed").Observe(a.firstByte.Sub(a.started).Seconds())
	}
	if rec.usage != nil {
		metricCachedTokens.WithLabelValues("prompt").Add(float64(rec.usage.PromptTokens))
		if c := rec.cachedTokens(); c > 0 {
			metricCachedTokens.WithLabelValues("cached").Add(float64(c))
		}
	}
}

// fleetCollector exports each upstream's live state at scrape time.
type fleetCollector struct {
	queued, inFlight, blocks, draining *prometheus.Desc
}

func newFleetCollector() *fleetCollector {
	return &fleetCollector{
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
	for _, u := range snapshotUpstreams() {
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
	// Healthy is Caddy's health verdict at the last decision (absent
	// before the first).
	Healthy     *bool    `json:"healthy,omitempty"`
	Adapters    []string `json:"adapters,omitempty"`
	IdleSeconds float64  `json:"idle_seconds"`
	// Engine is what the engine last reported, when scraping is on.
	Engine *EngineView `json:"engine,omitempty"`
	// Drain is the drain phase: active, draining or drained.
	Drain         string    `json:"drain"`
	DrainCause    string    `json:"drain_cause,omitempty"`
	DrainDeadline time.Time `json:"drain_deadline,omitzero"`
}

// snapshotUpstreams copies the fleet's state.
func snapshotUpstreams() []UpstreamSnapshot {
	engines := engineViews(time.Now())
	drainOf := map[string]drain.Status{}
	for _, s := range drains.Snapshot() {
		drainOf[s.Key] = s
	}
	state.mu.Lock()
	defer state.mu.Unlock()
	out := make([]UpstreamSnapshot, 0, len(state.upstreams))
	for _, u := range state.upstreams {
		out = append(out, UpstreamSnapshot{
			Dial: u.dial, QueuedPrefillTokens: u.queuedPrefill, QueuedDecodeTokens: u.queuedDecode,
			KVTokensInFlight: u.kvTokens, InFlight: u.inFlight,
			IndexBlocks: state.index.Blocks(u.id), IndexCapacity: state.index.Capacity(u.id),
			Completed: u.completed, LastTTFTSeconds: u.lastTTFT.Seconds(),
			LastEstimatedTTFTSeconds: u.lastEstimate, KVCapacityTokens: u.capacityTokens,
			Adapters: append([]string(nil), u.adapters...), IdleSeconds: time.Since(u.lastUsed).Seconds(),
			Drain: "active", Engine: engines[u.dial],
		})
		if u.healthSeen {
			healthy := u.healthy
			out[len(out)-1].Healthy = &healthy
		}
		if d, ok := drainOf[u.dial]; ok {
			s := &out[len(out)-1]
			s.Drain, s.DrainCause, s.DrainDeadline = d.Phase, string(d.Cause), d.Deadline
		}
	}
	// Upstreams drained before the router ever routed to them.
	for dial, d := range drainOf {
		if state.upstreams[dial] == nil {
			out = append(out, UpstreamSnapshot{Dial: dial, Drain: d.Phase, DrainCause: string(d.Cause), DrainDeadline: d.Deadline})
		}
	}
	return out
}
