package caddyllm

import (
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"go.uber.org/zap"

	"github.com/llmaffinity/caddy-llm-affinity/drain"
)

// defaultDrainDeadline is how long a drain lets in-flight requests run
// when nothing else is said.
const defaultDrainDeadline = 30 * time.Second

// drains is the drain state of every upstream, keyed by dial address; it
// lives at package level so a drain survives config reloads.
var drains = drain.New(drain.Events{
	Draining: func(dial string, cause drain.Cause, deadline time.Duration) {
		metricDrainTransitions.WithLabelValues("draining").Inc()
		drainLogger().Info("upstream draining", zap.String("upstream", dial),
			zap.String("cause", string(cause)), zap.Duration("deadline", deadline))
	},
	Undrained: func(dial string, cause drain.Cause) {
		metricDrainTransitions.WithLabelValues("undrained").Inc()
		drainLogger().Info("upstream undrained", zap.String("upstream", dial), zap.String("cause", string(cause)))
	},
	Drained: func(dial string) {
		metricDrainTransitions.WithLabelValues("drained").Inc()
		drainLogger().Info("upstream drained", zap.String("upstream", dial))
	},
	DeadlineCut: func(dial string, n int) {
		drainLogger().Info("drain deadline passed; moving requests", zap.String("upstream", dial), zap.Int("requests", n))
	},
})

// adminDrainDeadline is the deadline of admin drains that give none: the
// drain_deadline of the most recently provisioned policy.
var adminDrainDeadline atomic.Int64

func init() { adminDrainDeadline.Store(int64(defaultDrainDeadline)) }

func drainLogger() *zap.Logger { return caddy.Log().Named("llm_affinity.drain") }

// healthPollInterval is how often a policy compares its upstreams' health
// with their drain state.
var healthPollInterval = 250 * time.Millisecond

// watchUpstreamHealth drains upstreams that Caddy's active or passive health
// checks mark unhealthy, with the policy's deadline, instead of letting
// their streams be cut; it lifts drains it started once they are healthy
// again. It stops with the config. It starts with the policy's first
// Select, once Caddy has finished provisioning the upstreams it reads.
func (p *Policy) watchUpstreamHealth(ctx caddy.Context, upstreams func() []*reverseproxy.Upstream) {
	defer func() {
		if v := recover(); v != nil {
			p.logger.Error("health watcher panicked", zap.Any("panic", v))
		}
	}()
	t := time.NewTicker(healthPollInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		for _, u := range upstreams() {
			healthy := u.Healthy()
			switch phase := drains.Phase(u.Dial); {
			case !healthy && phase == drain.Active:
				drains.Drain(u.Dial, time.Duration(p.DrainDeadline), drain.ByHealth)
			case healthy && phase != drain.Active:
				drains.Undrain(u.Dial, drain.ByHealth)
			}
		}
	}
}

// parentUpstreams finds the reverse_proxy handler that loads this policy
// and returns a function listing its static upstreams. Its upstreams are
// provisioned after the policy, so they are read lazily.
func parentUpstreams(ctx caddy.Context) func() []*reverseproxy.Upstream {
	for _, m := range ctx.Modules() {
		if h, ok := m.(*reverseproxy.Handler); ok {
			return func() []*reverseproxy.Upstream { return h.Upstreams }
		}
	}
	return func() []*reverseproxy.Upstream { return nil }
}
