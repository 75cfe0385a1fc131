package caddyllm

import (
	"slices"
	"sync"
	"time"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"

	"github.com/llmaffinity/caddy-llm-affinity/scorer"
	"github.com/llmaffinity/caddy-llm-affinity/scrape"
)

// This file turns the router's own accounting and, when scraping is on,
// the engines' reported state into the scorer's candidates.

// candidateInput is what decide computed for one upstream.
type candidateInput struct {
	matched     int
	available   bool
	adapter     string
	blockTokens int
	engine      scraped
}

// scraped is an upstream's last scraped engine signals, as scraped, and
// whether they are fresh; looked up once per upstream and decision.
type scraped struct {
	sig   scrape.Signals
	fresh bool
}

// scrapedSignals looks up the scraped signals of every upstream of pool
// into dst (zero values without a scraper).
func (p *Policy) scrapedSignals(dst []scraped, pool reverseproxy.UpstreamPool, now time.Time) []scraped {
	dst = slices.Grow(dst[:0], len(pool))[:len(pool)]
	for i, u := range pool {
		dst[i] = scraped{}
		if p.scraper != nil {
			dst[i].sig, dst[i].fresh = p.scraper.Latest(u.Dial, now, time.Duration(p.ScrapeMaxAge))
		}
	}
	return dst
}

// candidate describes upstream u to the scorer. Caller holds state.mu.
//
// Without fresh engine signals it uses what the router itself knows: the
// work it routed there and the configured hardware. With them:
//   - KV capacity is the engine's, and free KV the smaller of what the
//     engine reports (plus what the router charged since the scrape) and
//     what the router's own reservations leave;
//   - requests the engine has that the router did not send (another
//     router, direct clients) add to the queue, at the mean prompt and
//     output lengths the router has seen;
//   - the model list filters models, and the engine's running adapters say
//     which adapters are resident.
func (p *Policy) candidate(u *reverseproxy.Upstream, us *upstreamState, now time.Time, in candidateInput) scorer.Candidate {
	hp := p.profile(u.Dial)
	c := scorer.Candidate{
		Name:                   u.Dial,
		Available:              in.available,
		Draining:               drains.IsDraining(u.Dial),
		MatchedTokens:          in.matched,
		QueuedPrefillTokens:    max(0, us.queuedPrefill),
		QueuedDecodeTokens:     max(0, us.queuedDecode),
		InFlight:               us.inFlight,
		Waiting:                -1,
		PrefillTokensPerSecond: hp.PrefillTokensPerSecond,
		DecodeTokensPerSecond:  hp.DecodeTokensPerSecond,
		FreeKVTokens:           -1,
		KVCapacityTokens:       hp.KVCapacityTokens,
		Adapter:                scorer.AdapterResident,
	}
	raw, sig, fresh := engineSignals(in.engine, us)
	if fresh {
		if capacity := sig.KVCapacityTokens(); capacity > 0 {
			c.KVCapacityTokens = capacity
		}
		c.Waiting = sig.Waiting
		c.Models = sig.ModelIDs()
		// Foreign requests: what the engine had at the scrape beyond what
		// the router had in flight there at that moment.
		if raw.Running >= 0 && raw.Waiting >= 0 {
			if foreign := raw.Running + raw.Waiting - raw.Mark.InFlight; foreign > 0 {
				c.ForeignInFlight = foreign // they share the engine's steps too
				prompt, output := state.meanPrompt.value, p.meanOutputLocked()
				c.QueuedPrefillTokens += int(float64(min(foreign, raw.Waiting)) * prompt)
				c.QueuedDecodeTokens += int(float64(foreign) * output)
			}
		}
	}
	if c.KVCapacityTokens > 0 {
		sizeIndex(us, c.KVCapacityTokens, in.blockTokens)
		c.FreeKVTokens = max(0, c.KVCapacityTokens-us.kvTokens)
		if fresh {
			if engineFree := sig.FreeKVTokens(); engineFree >= 0 {
				c.FreeKVTokens = min(c.FreeKVTokens, engineFree)
			}
		}
	}
	if in.adapter != "" {
		c.Adapter, c.AdapterLoadSeconds = p.adapterCost(in.adapter, us, raw, fresh)
	}
	return c
}

// sizeIndex gives us's prefix index the capacity of its KV cache, when
// that changed. Caller holds state.mu.
func sizeIndex(us *upstreamState, capacityTokens, blockTokens int) {
	if us.capacityTokens == capacityTokens && us.indexBlockTokens == blockTokens {
		return
	}
	us.capacityTokens, us.indexBlockTokens = capacityTokens, blockTokens
	state.index.SetCapacity(us.id, max(1, capacityTokens/max(1, blockTokens)))
}

// engineSignals returns an upstream's scraped signals as scraped and
// with the charges the router made since the scrape added, and whether
// they are fresh.
func engineSignals(s scraped, us *upstreamState) (raw, current scrape.Signals, fresh bool) {
	if !s.fresh {
		return s.sig, current, false
	}
	requests, kv := us.charged.Since(s.sig.Mark)
	return s.sig, s.sig.PlusRouted(requests, kv), true
}

// adapterCost says where u has adapter and what making it resident costs.
// Resident: a running request uses it on the engine, or it is among the
// last max_loras adapters the router sent there (vLLM keeps recently used
// adapters in its GPU slots). Host: the router sent it there earlier, so
// the engine likely holds it in host memory. Otherwise it must be fetched
// from storage: being listed in /v1/models does not mean it was ever
// loaded. The cost is finite, so a busy replica holding the adapter loses
// to an idle one once its queue outweighs the load, and the second
// replica then holds it too: adapters replicate as far as the load needs.
func (p *Policy) adapterCost(adapter string, us *upstreamState, sig scrape.Signals, fresh bool) (scorer.AdapterState, float64) {
	running := fresh && sig.AdaptersKnown && slices.Contains(sig.RunningAdapters, adapter)
	switch i := slices.Index(us.adapters, adapter); {
	case running || (i >= 0 && i < p.MaxLoras):
		return scorer.AdapterResident, 0
	case i >= 0:
		return scorer.AdapterHost, time.Duration(p.AdapterLoadHost).Seconds()
	}
	return scorer.AdapterRemote, time.Duration(p.AdapterLoadRemote).Seconds()
}

// adapterOf returns model when it names a LoRA adapter: configured in
// Adapters, or listed with a parent in some upstream's /v1/models.
func (p *Policy) adapterOf(model string, engines []scraped) string {
	if model == "" {
		return ""
	}
	if p.adapters[model] {
		return model
	}
	for _, e := range engines {
		if e.fresh && slices.ContainsFunc(e.sig.Models, func(m scrape.ModelInfo) bool { return m.ID == model && m.Parent != "" }) {
			return model
		}
	}
	return ""
}

// meanOutputLocked is the expected output of a request of unknown model,
// for sizing foreign load. Caller holds state.mu.
func (p *Policy) meanOutputLocked() float64 {
	var sum float64
	var n int
	for _, m := range state.outputs {
		if m.n > 0 {
			sum += m.value
			n++
		}
	}
	if n == 0 {
		return float64(p.OutputTokens)
	}
	return sum / float64(n)
}

// liveScrapers are the scrapers of the loaded configs, for the admin API.
var liveScrapers sync.Map // *scrape.Scraper → struct{}

// registerScraper lists s until it stops with its config.
func registerScraper(s *scrape.Scraper) {
	liveScrapers.Store(s, struct{}{})
	go func() {
		<-s.Stopped()
		liveScrapers.Delete(s)
	}()
}

// EngineView is what the scrapers last saw of an upstream's engine, for
// the admin API. Counts the engine did not report are -1; so is the
// prefix cache hit rate until known (vLLM's is measured between the
// scrapes that read its counters, 10 s apart).
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
	LastError       string   `json:"last_error,omitempty"`
}

// engineViews returns the freshest engine view of every scraped dial.
func engineViews(now time.Time) map[string]*EngineView {
	out := map[string]*EngineView{}
	liveScrapers.Range(func(k, _ any) bool {
		s := k.(*scrape.Scraper)
		for _, st := range s.Statuses() {
			v := out[st.Dial]
			if v == nil {
				v = &EngineView{Running: -1, Waiting: -1, PrefixHitRate: -1}
				out[st.Dial] = v
			}
			v.Errors, v.LastError = st.Errors, st.LastError
			if sig, ok := s.Latest(st.Dial, now, time.Hour); ok && (v.Engine == "" || now.Sub(sig.ScrapedAt).Seconds() < v.AgeSeconds) {
				v.Engine, v.AgeSeconds = sig.Engine, now.Sub(sig.ScrapedAt).Seconds()
				v.Running, v.Waiting, v.KVUsage, v.KVCapacity = sig.Running, sig.Waiting, sig.KVUsage, sig.KVCapacityTokens()
				v.PrefixHitRate = sig.PrefixHitRate
				v.RunningAdapters, v.Models = sig.RunningAdapters, sig.ModelIDs()
			}
		}
		return true
	})
	return out
}
