package caddyllm

import (
	"slices"
	"time"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"

	"github.com/llmaffinity/caddy-llm-affinity/router"
	"github.com/llmaffinity/caddy-llm-affinity/scrape"
)

// members describes pool to the decision engine, into dst: Caddy's
// verdicts (available, healthy), the drains, whether an earlier attempt of
// the request went there (and unreached, found nothing listening), the
// configured hardware and the engine's fresh
// scraped signals. Only engine signals fresher than ScrapeMaxAge count;
// older ones leave the router to its own accounting, but for the list of
// the models the engine serves, which keeps filtering.
//
// A request still deciding with a config that a reload replaced (it was
// held at the gateway, or is retried) takes its upstreams' KV capacity
// from the loaded configs, as new requests do: held under the replaced
// figure, it waited out queue_timeout when a reload raised it, and was
// let through too soon when one lowered it.
func (p *Policy) members(dst []router.Member, engines []scrape.Signals, pool reverseproxy.UpstreamPool, tried, unreached []string, now time.Time) ([]router.Member, []scrape.Signals) {
	// Room for every engine up front: members point into it.
	dst, engines = slices.Grow(dst[:0], len(pool)), slices.Grow(engines[:0], len(pool))
	replaced := p.replaced()
	for _, u := range pool {
		healthy := u.Healthy()
		// Filled in place: a member built apart is copied in whole.
		dst = dst[:len(dst)+1]
		m := &dst[len(dst)-1]
		*m = router.Member{}
		m.Dial = u.Dial
		m.Available = healthy && !u.Full() // u.Available(), asking Healthy once
		m.Healthy = healthy
		m.Draining = p.sh.drains.IsDraining(u.Dial)
		m.Hardware = p.defaultHardware
		if hw, ok := p.hardwareByDial[u.Dial]; ok {
			m.Hardware = hw
		}
		if replaced {
			if kv, named := p.sh.configuredKVOf(u.Dial); named {
				m.Hardware.KVCapacityTokens = kv
			}
		}
		for _, t := range tried {
			m.Tried = m.Tried || t == u.Dial
		}
		for _, t := range unreached {
			m.Unreached = m.Unreached || t == u.Dial
		}
		if p.scraper != nil {
			m.Scraped = true
			if sig, fresh, down := p.scraper.Current(u.Dial, now, time.Duration(p.ScrapeMaxAge)); fresh {
				engines = append(engines, sig)
				m.Engine = &engines[len(engines)-1]
			} else {
				// Stale metrics, or nothing listening since they were
				// read; the model list, fetched on its own schedule,
				// still says what the engine serves.
				m.Models, m.Down = p.listedModels(sig, down, now), down
			}
		}
	}
	return dst, engines
}

// listedModels is the model list in sig of an engine as decisions take
// it: fetched within ModelsMaxAge, or however old while nothing listens
// there (down: a model it never listed is not one it serves, 404; one it
// listed is one it does not run now, 503); nil when unknown.
func (p *Policy) listedModels(sig scrape.Signals, down bool, now time.Time) []scrape.ModelInfo {
	if sig.Models != nil && (down || now.Sub(sig.ModelsAt) <= p.scraper.ModelsMaxAge()) {
		return sig.Models
	}
	return nil
}

// EngineView is what the scrapers last saw of an upstream's engine, for
// the admin API. Counts the engine did not report are -1; so are the KV
// usage until the engine reported it, and the prefix cache hit rate until
// known (vLLM's is measured between the scrapes that read its counters,
// 10 s apart).
type EngineView struct {
	Engine          string   `json:"engine"`
	AgeSeconds      float64  `json:"age_seconds"`
	Running         int      `json:"running"`
	Waiting         int      `json:"waiting"`
	KVUsage         float64  `json:"kv_usage"`
	KVCapacity      int      `json:"kv_capacity_tokens"`
	PrefixHitRate   float64  `json:"prefix_hit_rate"`
	RunningAdapters []string `json:"running_adapters,omitempty"`
	Models          []string `json:"models,omitempty"`
	Errors          uint64   `json:"scrape_errors"`
	// LastError is the latest scrape's failure: empty once a scrape after
	// it succeeded (Errors still counts every failure).
	LastError string `json:"last_error,omitempty"`
	// ModelsError is the last model list fetch's failure, empty once one
	// succeeded (an engine behind an API key refuses it without
	// models_api_key).
	ModelsError string `json:"models_error,omitempty"`
	// lastScrape is when the status shown was last scraped, failed or not.
	lastScrape time.Time
}

// engineViews returns the freshest engine view of every scraped dial.
func (sh *shared) engineViews(now time.Time) map[string]*EngineView {
	out := map[string]*EngineView{}
	for _, s := range sh.liveScrapers() {
		for _, st := range s.Statuses() {
			v := out[st.Dial]
			if v == nil {
				v = &EngineView{Running: -1, Waiting: -1, KVUsage: -1, PrefixHitRate: -1}
				out[st.Dial] = v
			}
			// Several loaded configs may scrape the dial: show the state
			// of the latest scrape among them, not a stale failure.
			v.Errors = max(v.Errors, st.Errors)
			at := st.LastSuccess
			if st.LastErrorAt.After(at) {
				at = st.LastErrorAt
			}
			if !at.Before(v.lastScrape) {
				v.lastScrape, v.LastError, v.ModelsError = at, "", st.ModelsError
				if st.ConsecutiveErrors > 0 {
					v.LastError = st.LastError
				}
			}
			if sig, ok := s.Latest(st.Dial, now, time.Hour); ok && (v.Engine == "" || now.Sub(sig.ScrapedAt).Seconds() < v.AgeSeconds) {
				v.Engine, v.AgeSeconds = sig.Engine, now.Sub(sig.ScrapedAt).Seconds()
				v.Running, v.Waiting, v.KVCapacity = sig.Running, sig.Waiting, sig.KVCapacityTokens()
				v.KVUsage = -1
				if sig.KVKnown {
					v.KVUsage = sig.KVUsage
				}
				v.PrefixHitRate = sig.PrefixHitRate
				v.RunningAdapters, v.Models = sig.RunningAdapters, sig.ModelIDs()
			}
		}
	}
	return out
}
