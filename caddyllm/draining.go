package caddyllm

import (
	"sync"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"go.uber.org/zap"

	"github.com/llmaffinity/caddy-llm-affinity/drain"
)

// defaultDrainDeadline is how long a drain lets in-flight requests run
// when nothing else is said.
const defaultDrainDeadline = 30 * time.Second

// healthPollInterval is how often a policy compares its upstreams' health
// with their drain state.
const healthPollInterval = 250 * time.Millisecond

// healthWatch lets Cleanup stop a policy's health watcher for good: the
// watcher changes drains only under mu and while open, so no health hold
// is added after Cleanup released the site's holds.
type healthWatch struct {
	mu     sync.Mutex
	closed bool
}

// close stops the watcher's drain changes; it returns once none is in
// progress.
func (w *healthWatch) close() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.closed = true
}

// watchUpstreamHealth drains upstreams that Caddy's active or passive health
// checks mark unhealthy, with the policy's deadline, instead of letting
// their streams be cut; it lifts drains it started once they are healthy
// again. It stops with the config, whose Cleanup lifts what it holds. It
// starts with the policy's first Select, once Caddy has finished
// provisioning the upstreams it reads.
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
		if !p.checkHealth(upstreams()) {
			return
		}
	}
}

// checkHealth drains the unhealthy upstreams and undrains the healthy ones
// this site drained. It reports false once the policy was cleaned up.
func (p *Policy) checkHealth(upstreams []*reverseproxy.Upstream) bool {
	p.health.mu.Lock()
	defer p.health.mu.Unlock()
	if p.health.closed {
		return false
	}
	// The hold is this site's: another site sharing the upstream with a
	// different verdict neither lifts it nor is lifted by it.
	hold := drain.Hold{Cause: drain.ByHealth, Owner: p.site}
	for _, u := range upstreams {
		healthy, held := u.Healthy(), p.sh.drains.Held(u.Dial, hold)
		p.sh.fleet.SetHealthy(u.Dial, healthy)
		switch {
		case !healthy && !held:
			p.sh.drains.Drain(u.Dial, time.Duration(p.DrainDeadline), hold)
		case healthy && held:
			p.sh.drains.Undrain(u.Dial, hold)
		}
	}
	return true
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
