package caddyllm

import (
	"cmp"
	"context"
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
	// inherited are the upstreams another site's health checks drained
	// when this one was provisioned; their holds stay until
	// keepInheritedUntil, unless this site finds them unhealthy itself.
	inherited          map[string]bool
	keepInheritedUntil time.Time
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
// starts once Caddy runs the config, or with the policy's first Select if
// that comes first: either way after Caddy provisioned the upstreams it
// reads.
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

// start does what starts with the config running: its deferred drains
// take effect, its health watcher starts, and so does its scraper if it
// has not. It runs once, through p.started (which holds a concurrent
// first request until the drains are in force): the config's first request calls it, or runOnceActive,
// whichever comes first.
func (p *Policy) start() {
	p.sh.startSites(p.site)
	if p.scraper != nil {
		p.scraper.Start(p.ctx) // started already, unless this is the process's first config
	}
	if p.syncer != nil {
		p.sh.retireReplaced(p.syncer, p.load)
	}
	go p.watchUpstreamHealth(p.ctx, p.parent)
}

// runOnceActive calls start when Caddy makes a config other than before
// (the one running when this policy was provisioned) the running one:
// that is this policy's own, whose upstreams are then provisioned (Caddy
// swaps the running config under a lock after starting it). So an idle
// router's drains, admin view, status page and metrics follow its config
// and the health checks without waiting for a request. It gives up when
// the config is unloaded, or was never started.
func (p *Policy) runOnceActive(before context.Context) {
	t := time.NewTicker(healthPollInterval)
	defer t.Stop()
	for {
		select {
		case <-p.ctx.Done():
			return
		case <-t.C:
		}
		if caddy.ActiveContext().Context != before {
			p.started.Do(p.start)
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
	settling := time.Now().Before(p.health.keepInheritedUntil)
	for _, u := range upstreams {
		healthy, held := u.Healthy(), p.sh.drains.Held(u.Dial, hold)
		p.sh.fleet.SetHealthy(u.Dial, healthy)
		switch {
		case !healthy:
			delete(p.health.inherited, u.Dial) // this site's own verdict now
			if !held {
				p.sh.drains.Drain(u.Dial, time.Duration(p.DrainDeadline), hold)
			}
		case held && !(settling && p.health.inherited[u.Dial]):
			p.sh.drains.Undrain(u.Dial, hold)
			delete(p.health.inherited, u.Dial)
		}
	}
	return true
}

// parentHealthVerdictDelay is how long after its provisioning the parent
// reverse_proxy's active health checks may take to find an upstream
// unhealthy: Caddy checks at once and then every interval, each check
// bounded by its timeout, and an upstream turns unhealthy after fails
// checks failed in a row. It is zero without active checks: passive
// health state is the host's, which outlives a reload.
func parentHealthVerdictDelay(ctx caddy.Context) time.Duration {
	for _, m := range ctx.Modules() {
		h, ok := m.(*reverseproxy.Handler)
		if !ok {
			continue
		}
		if h.HealthChecks == nil || h.HealthChecks.Active == nil || !h.HealthChecks.Active.IsEnabled() {
			return 0
		}
		// Caddy's defaults, which its Provision sets after this policy's.
		a := h.HealthChecks.Active
		interval := cmp.Or(time.Duration(a.Interval), 30*time.Second)
		timeout := cmp.Or(time.Duration(a.Timeout), 5*time.Second)
		// A second for the checks' own scheduling on a busy machine.
		return time.Duration(max(a.Fails, 1)-1)*interval + timeout + time.Second
	}
	return 0
}

// parentHasDynamicUpstreams reports whether the reverse_proxy handler that
// loads this policy has a dynamic upstream source.
func parentHasDynamicUpstreams(ctx caddy.Context) bool {
	for _, m := range ctx.Modules() {
		if h, ok := m.(*reverseproxy.Handler); ok {
			return h.DynamicUpstreamsRaw != nil
		}
	}
	return false
}

// parentWaitsToRetry says the reverse_proxy handler that loads this
// policy waits before asking it again after it chose nothing: under
// lb_try_duration (lb_try_interval, 250 ms by default, until the duration
// passes), or lb_retries with an lb_try_interval.
func parentWaitsToRetry(ctx caddy.Context) bool {
	for _, m := range ctx.Modules() {
		if h, ok := m.(*reverseproxy.Handler); ok && h.LoadBalancing != nil {
			lb := h.LoadBalancing
			return lb.TryDuration > 0 || lb.Retries > 0 && lb.TryInterval > 0
		}
	}
	return false
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
