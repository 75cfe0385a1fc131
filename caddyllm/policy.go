package caddyllm

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/llmaffinity/caddy-llm-affinity/drain"
	"github.com/llmaffinity/caddy-llm-affinity/fleetsync"
	"github.com/llmaffinity/caddy-llm-affinity/router"
	"github.com/llmaffinity/caddy-llm-affinity/scorer"
	"github.com/llmaffinity/caddy-llm-affinity/scrape"
)

// Output estimates (the engine's router.OutputAverage and the others).
const (
	// OutputMaxTokens expects each request to generate its max_tokens.
	OutputMaxTokens = router.OutputMaxTokens
	// OutputAverage expects the running average of observed outputs for
	// the model, bounded by max_tokens.
	OutputAverage = router.OutputAverage
	// OutputFixed expects OutputTokens for every request.
	OutputFixed = router.OutputFixed
)

// Policy is the llm_affinity selection policy for reverse_proxy. It sends
// each request parsed by the llm_affinity handler to the upstream where
// its first token is expected soonest: the one whose queued work plus the
// prefill it must still do (the part of the prompt it does not hold in
// its prefix cache) plus any adapter load is smallest. It filters out
// upstreams that are unavailable, draining, or cannot hold the request in
// KV memory within QueueTimeout (an upstream whose KV is full is a
// candidate when the KV the request needs is expected to free in time: the
// engine queues the request, and the wait counts in its estimate); when
// none is left, the request waits at the gateway until capacity frees or
// QueueTimeout passes, then is shed with ShedStatus and Retry-After.
//
// Requests the handler did not parse (GET /v1/models, /health, other
// paths) go to the Fallback policy, by default the upstream with the
// least queued work.
type Policy struct {
	// Strategy is the decision rule: ttft (default; the estimated time to
	// first token), sglang (SGLang router's cache_aware), llmd (llm-d's
	// default scorer weights), dynamo (Dynamo's KV router cost) or
	// least_work (queued tokens only).
	Strategy string `json:"strategy,omitempty"`

	// OutputEstimate is how a request's output length is estimated before
	// it is known: "average" (default; the running average observed for
	// the model, bounded by max_tokens), "max_tokens" (max_tokens, or
	// OutputTokens when absent) or "fixed" (always OutputTokens).
	OutputEstimate string `json:"output_estimate,omitempty"`

	// OutputTokens is the output estimate before any output was observed,
	// and the fixed estimate. Default 256.
	OutputTokens int `json:"output_tokens,omitempty"`

	// Hardware is the default profile of an upstream.
	Hardware *HardwareProfile `json:"hardware,omitempty"`

	// Upstreams overrides the hardware profile per dial address.
	Upstreams map[string]*HardwareProfile `json:"upstreams,omitempty"`

	// Adapters names the LoRA adapters the upstreams serve; a request
	// whose model is one of them pays the adapter load cost on an
	// upstream that does not have it resident.
	Adapters []string `json:"adapters,omitempty"`

	// MaxLoras is how many adapters an upstream keeps resident (vLLM's
	// --max-loras). The policy remembers the adapters it last sent to each
	// upstream and treats those as resident. An engine that reports its
	// slot count (vLLM's lora_requests_info max_lora label) is taken at
	// its word instead. Default 4.
	MaxLoras int `json:"max_loras,omitempty"`

	// AdapterLoadHost is the cost of loading an adapter the engine has
	// registered (in host memory) into a GPU slot. Default 30ms.
	AdapterLoadHost caddy.Duration `json:"adapter_load_host,omitempty"`

	// AdapterLoadRemote is the cost of loading an adapter that is not
	// resident. Default 2s.
	AdapterLoadRemote caddy.Duration `json:"adapter_load_remote,omitempty"`

	// QueueTimeout is how long a request may wait to start, from its
	// arrival (Caddy's retries share it; a request moved off a drained
	// upstream has it anew): queued at an engine for KV to free, or at
	// the gateway when no upstream can start it in time, after which it
	// is shed. Default 5s; a negative value sends a request only where it
	// fits now and sheds it at once otherwise.
	QueueTimeout caddy.Duration `json:"queue_timeout,omitempty"`

	// ShedStatus is the HTTP status of a shed request. Default 503.
	ShedStatus int `json:"shed_status,omitempty"`

	// QueueLimit is how many requests this policy may hold at the
	// gateway at once, waiting for an upstream that can start them; one
	// more is shed at once (ShedStatus, Retry-After). A held request keeps
	// its body in memory. Each policy counts its own (a reload's old and
	// new config apart). 0 means the default, 1024; a negative value sets
	// no limit.
	QueueLimit int `json:"queue_limit,omitempty"`

	// KVMarginTokens is the KV headroom the fit filter keeps beyond the
	// uncached prompt and expected output: 0 or more.
	KVMarginTokens int `json:"kv_margin_tokens,omitempty"`

	// TieSeconds: ttft estimates closer than this are ties, broken by power
	// of two random choices. Default 2ms.
	TieSeconds float64 `json:"tie_seconds,omitempty"`

	// ImposedDelayWeight is how much the delay a request's prefill would
	// impose on the requests already running on an upstream (its uncached
	// prompt's prefill time, once for each of them) counts against its own
	// time to first token, in the ttft strategy. It keeps a shared prefix
	// from being copied to every replica whose queue is momentarily
	// shorter. Default 0.1, at most 100; a negative value turns it off.
	ImposedDelayWeight float64 `json:"imposed_delay_weight,omitempty"`

	// DecodeWeight is how much a request's own generation time on an
	// upstream (its expected output at the decode rate it would share
	// with every request in flight there) counts against its time to
	// first token, in the ttft strategy. It keeps a few hot prefixes from
	// piling generations onto the replicas that hold them. Default 0.1, at
	// most 100; a negative value turns it off.
	DecodeWeight float64 `json:"decode_weight,omitempty"`

	// EvictionWeight is how much the prefill of the cached prompts a
	// request would push out of a full prefix cache counts against its
	// time to first token, in the ttft strategy: a copy of a prefix onto
	// a full replica evicts others' prefixes, which later requests prefill
	// again. An upstream's cache counts as full when the prefixes the
	// router sent there fill its KV capacity (known from kv_capacity or
	// the engine's metrics). The same weight counts the reload of the
	// adapter that loading a request's adapter evicts from GPU slots all
	// holding others (adapter_load_host): so new adapters take free slots
	// first. Default 1, at most 100; a negative value turns it off.
	EvictionWeight float64 `json:"eviction_weight,omitempty"`

	// SGLangCacheThreshold, SGLangBalanceAbs and SGLangBalanceRel tune
	// the sglang strategy (defaults 0.5, 32, 1.0001).
	SGLangCacheThreshold float64 `json:"sglang_cache_threshold,omitempty"`
	SGLangBalanceAbs     float64 `json:"sglang_balance_abs,omitempty"`
	SGLangBalanceRel     float64 `json:"sglang_balance_rel,omitempty"`

	// LLMDWeights are the llmd strategy's prefix, queue and KV weights
	// (default 3, 2, 2).
	LLMDWeights []float64 `json:"llmd_weights,omitempty"`

	// DynamoOverlapWeight tunes the dynamo strategy (default 1).
	DynamoOverlapWeight float64 `json:"dynamo_overlap_weight,omitempty"`

	// DrainDeadline is how long a draining upstream's in-flight requests
	// may run before they are cut and moved to another upstream (streams
	// are continued there). It applies to drains started by health checks
	// and by the Drain list, and to admin drains that give no deadline.
	// Default 30s.
	DrainDeadline caddy.Duration `json:"drain_deadline,omitempty"`

	// Drain lists dial addresses to drain when this config loads. A
	// later config that no longer lists one of its upstreams undrains it
	// (drains made through the admin API or by health stay).
	Drain []string `json:"drain,omitempty"`

	// ScrapeInterval turns on scraping of each upstream's engine metrics
	// (vLLM's or SGLang's /metrics) and model list (/v1/models) at this
	// interval (at least 100ms); then free KV, queues fed by other routers,
	// the KV capacity, the served models and resident adapters come from
	// the engines. Off by default.
	ScrapeInterval caddy.Duration `json:"scrape_interval,omitempty"`

	// ScrapeMaxAge is how old scraped signals may be before the policy
	// falls back to its own tracking (the last model list still filters).
	// Default 3 scrape intervals.
	ScrapeMaxAge caddy.Duration `json:"scrape_max_age,omitempty"`

	// ModelsInterval is how often /v1/models is fetched when scraping.
	// Default 10s. A fetch that failed is tried again sooner, a
	// ScrapeInterval later, backing off up to ModelsInterval.
	ModelsInterval caddy.Duration `json:"models_interval,omitempty"`

	// MetricsPath is the engines' metrics path. Default /metrics.
	MetricsPath string `json:"metrics_path,omitempty"`

	// ModelsAPIKey is sent as a bearer token with the engines' model
	// list requests: vLLM's --api-key guards /v1/models (not /metrics).
	// Placeholders such as {env.VLLM_API_KEY} are replaced at load.
	ModelsAPIKey string `json:"models_api_key,omitempty"`

	// ExplainHeader adds an X-LLM-Affinity response header saying where
	// the request went and why (no prompt text).
	ExplainHeader bool `json:"explain_header,omitempty"`

	// Sync shares this router's view with other routers over NATS: each
	// publishes its routing events and operators' drains, and applies the
	// others'. Off by default.
	Sync *SyncConfig `json:"sync,omitempty"`

	// FallbackRaw is the selection policy for requests without parsed
	// content. Default: the upstream with the least queued work.
	FallbackRaw json.RawMessage `json:"fallback,omitempty" caddy:"namespace=http.reverse_proxy.selection_policies inline_key=policy"`

	ctx    caddy.Context
	parent func() []*reverseproxy.Upstream
	// started runs start once: the config's first request, or Caddy
	// making it the running config, calls it.
	started *sync.Once
	// warnedUnparsed records that the missing handler was logged.
	warnedUnparsed *atomic.Bool
	// parentDials are the parent reverse_proxy's static upstreams, which
	// drain and upstream must name; parentDynamic says it has dynamic
	// ones too, which cannot be checked.
	parentDials   []string
	parentDynamic bool
	// parentTries says the parent waits to ask again: see answered.
	parentTries bool
	health      *healthWatch

	// sh is the shared routing state; site names this policy as the
	// owner of its drains there; named lists the upstreams it references.
	sh    *shared
	site  string
	named []string

	scraper *scrape.Scraper
	// names holds the model names of the scraper's lists (see
	// seedModel).
	names *namesCache
	// syncer is the policy's sync connection (syncKey its pool key), and
	// load the config load that acquired it: the config running then.
	syncer   *fleetsync.Syncer
	syncKey  string
	load     context.Context
	fallback reverseproxy.Selector
	opts     router.Options
	// hardwareByDial and defaultHardware are the merged profiles, made
	// once in Provision rather than per decision.
	hardwareByDial  map[string]router.Hardware
	defaultHardware router.Hardware
	logger          *zap.Logger
	rng             *lockedRand
	// series holds the latency series of the upstreams at the pool's
	// places, as decisions resolved them.
	series *seriesCache
}

// HardwareProfile describes what an upstream can do, for the time
// estimates and the KV-fit filter.
type HardwareProfile struct {
	// PrefillTokensPerSecond is its prompt processing throughput.
	// Default 12000.
	PrefillTokensPerSecond float64 `json:"prefill_tokens_per_second,omitempty"`

	// DecodeTokensPerSecond is its aggregate generation throughput over a
	// batch. Default 2500.
	DecodeTokensPerSecond float64 `json:"decode_tokens_per_second,omitempty"`

	// KVCapacityTokens is its KV cache size in tokens. It sizes the prefix
	// index and enables the KV-fit filter; 0 means unknown (no filter, an
	// index of 2048 blocks).
	KVCapacityTokens int `json:"kv_capacity_tokens,omitempty"`
}

// CaddyModule returns the Caddy module information.
func (Policy) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.reverse_proxy.selection_policies.llm_affinity",
		New: func() caddy.Module { return new(Policy) },
	}
}

// maxCostWeight bounds the cost terms' weights: beyond it a
// term alone decides, and costs can overflow.
const maxCostWeight = 100

// Provision sets defaults, loads the fallback policy and takes its share
// of the routing state.
func (p *Policy) Provision(ctx caddy.Context) error {
	p.logger = ctx.Logger()
	registerRunningMetrics(ctx)
	strategy, err := scorer.ParseStrategy(p.Strategy)
	if err != nil {
		return err
	}
	sopts := scorer.Options{
		Strategy:           strategy,
		TieSeconds:         p.TieSeconds,
		KVMarginTokens:     p.KVMarginTokens,
		ImposedDelayWeight: p.ImposedDelayWeight,
		DecodeWeight:       p.DecodeWeight,
		EvictionWeight:     p.EvictionWeight,
		SGLang: scorer.SGLangOptions{
			CacheThreshold:      p.SGLangCacheThreshold,
			BalanceAbsThreshold: p.SGLangBalanceAbs,
			BalanceRelThreshold: p.SGLangBalanceRel,
		},
		Dynamo: scorer.DynamoOptions{OverlapWeight: p.DynamoOverlapWeight},
	}
	if len(p.LLMDWeights) == 3 {
		sopts.LLMD = scorer.LLMDOptions{PrefixWeight: p.LLMDWeights[0], QueueWeight: p.LLMDWeights[1], KVWeight: p.LLMDWeights[2]}
	}
	p.opts = router.Options{
		Scorer:            sopts,
		OutputEstimate:    p.OutputEstimate,
		OutputTokens:      p.OutputTokens,
		MaxLoras:          p.MaxLoras,
		AdapterLoadHost:   time.Duration(p.AdapterLoadHost),
		AdapterLoadRemote: time.Duration(p.AdapterLoadRemote),
		Adapters:          make(map[string]bool, len(p.Adapters)),
		QueueLimit:        p.QueueLimit,
	}.WithDefaults()
	for _, a := range p.Adapters {
		p.opts.Adapters[a] = true
	}
	p.OutputEstimate, p.OutputTokens = p.opts.OutputEstimate, p.opts.OutputTokens
	p.defaultHardware = p.hardware("")
	p.hardwareByDial = make(map[string]router.Hardware, len(p.Upstreams))
	for dial := range p.Upstreams {
		p.hardwareByDial[dial] = p.hardware(dial)
	}
	if p.QueueTimeout == 0 {
		p.QueueTimeout = caddy.Duration(router.DefaultQueueTimeout)
	}
	if p.ShedStatus == 0 {
		p.ShedStatus = http.StatusServiceUnavailable
	}
	if p.FallbackRaw != nil {
		// Caddy's own answer to a fallback that names no policy shows
		// the object as a Go map.
		var named map[string]any
		if json.Unmarshal(p.FallbackRaw, &named) != nil || named == nil {
			return fmt.Errorf(`fallback: want an object naming a selection policy, such as {"policy": "least_conn"}`)
		}
		if name, _ := named["policy"].(string); name == "" {
			return fmt.Errorf(`fallback: no selection policy named: want its name in "policy", such as {"policy": "least_conn"}`)
		}
		mod, err := ctx.LoadModule(p, "FallbackRaw")
		if err != nil {
			return fmt.Errorf("loading fallback selection policy: %w", err)
		}
		p.fallback = mod.(reverseproxy.Selector)
	}
	if p.DrainDeadline <= 0 {
		p.DrainDeadline = caddy.Duration(defaultDrainDeadline)
	}
	// The parent's upstreams and health checks are provisioned after this
	// policy, so the health watcher starts once Caddy runs this config (or
	// with the first request, if that comes first); the static upstreams'
	// dials are known now (read in the parent's own Provision, so without
	// a race).
	p.ctx, p.parent, p.started, p.health = ctx, parentUpstreams(ctx), new(sync.Once), new(healthWatch)
	p.warnedUnparsed = new(atomic.Bool)
	// The config running now; once Caddy runs another, it is this one.
	running := caddy.ActiveContext().Context
	go p.runOnceActive(running)
	for _, u := range p.parent() {
		p.named = append(p.named, u.Dial)
		p.parentDials = append(p.parentDials, u.Dial)
	}
	p.parentDynamic = parentHasDynamicUpstreams(ctx)
	if p.ScrapeInterval > 0 && p.ScrapeMaxAge > 0 && p.ScrapeMaxAge < p.ScrapeInterval {
		// Signals are that old between two scrapes most of the time.
		p.logger.Warn("scrape_max_age is shorter than scrape_interval: the engines' signals are ignored for most of each interval",
			zap.Duration("scrape_max_age", time.Duration(p.ScrapeMaxAge)), zap.Duration("scrape_interval", time.Duration(p.ScrapeInterval)))
	}
	// Caddy asks a policy that chose nothing again, after a wait, until
	// lb_try_duration passes (or lb_retries are spent): the router's own
	// answers must not wait.
	p.parentTries = parentWaitsToRetry(ctx)
	for dial := range p.Upstreams {
		p.named = append(p.named, dial)
	}
	p.named = append(p.named, p.Drain...)
	slices.Sort(p.named)
	p.named = slices.Compact(p.named)

	p.sh = acquireShared()
	p.sh.nameUpstreams(p.named)
	kv := make(map[string]int)
	for _, dial := range p.named {
		if n := p.hardware(dial).KVCapacityTokens; n > 0 {
			kv[dial] = n
		}
	}
	// Its capacities and new drains take effect once this config runs:
	// Caddy may still reject it, and a rejected config must not drain,
	// cut or resize anything.
	p.site = p.sh.addSite(&site{drainDeadline: time.Duration(p.DrainDeadline), dials: p.named, kvCapacity: kv,
		scrapes: p.ScrapeInterval > 0, dynamic: p.parentDynamic, defaultKV: p.defaultHardware.KVCapacityTokens}, running)
	// A config drain already in force (the running config has it too) is
	// held by this site from now on, so a reload never lets it lapse.
	var pending []string
	for _, dial := range p.Drain {
		if !p.sh.drains.AddHold(dial, drain.Hold{Cause: drain.ByConfig, Owner: p.site}) {
			pending = append(pending, dial)
		}
	}
	p.sh.deferDrains(p.site, pending)
	// An upstream some site's health checks drained stays drained under
	// this site's name until this site's own checks find it healthy: on a
	// reload the old site lets go of its hold before this site's watcher
	// has looked, and the drain must not lapse, nor its deadline change,
	// meanwhile.
	// Caddy's verdicts start over with the new config (its upstreams
	// start healthy), so the hold stays at least until this config's
	// active checks could have found the upstream unhealthy.
	for _, dial := range p.named {
		if p.sh.drains.HeldBy(dial, drain.ByHealth) {
			p.sh.drains.AddHold(dial, drain.Hold{Cause: drain.ByHealth, Owner: p.site})
			if p.health.inherited == nil {
				p.health.inherited = make(map[string]bool)
			}
			p.health.inherited[dial] = true
		}
	}
	p.health.keepInheritedUntil = time.Now().Add(parentHealthVerdictDelay(ctx))
	if p.ScrapeInterval > 0 {
		cfg := scrape.Config{
			Interval:       time.Duration(p.ScrapeInterval),
			ModelsInterval: time.Duration(p.ModelsInterval),
			MetricsPath:    p.MetricsPath,
			ModelsAPIKey:   p.modelsAPIKey(),
			Mark:           p.sh.fleet.MarkOf,
			Restarted:      p.sh.fleet.EngineRestarted,
			Address:        globalAddress,
			Logger:         p.logger.Named("scrape"),
		}
		// Engines behind TLS are scraped over https with the proxy's own
		// TLS settings (and its tls_except_ports over http); plain HTTP
		// ones keep the scraper's cheaper client.
		t, plainPorts := parentTLSTransport(ctx)
		if t != nil {
			cfg.Scheme, cfg.Client, cfg.PlainPorts = "https", &http.Client{Transport: t}, plainPorts
		}
		p.scraper = scrape.New(cfg)
		if t != nil {
			go func() { <-p.scraper.Stopped(); t.CloseIdleConnections() }()
		}
		// Dynamic upstreams are added as requests see them.
		p.scraper.SetTargets(p.named)
		p.sh.inheritScrapes(p.scraper)
		if running != nil {
			// A reload: scrape now, so that the config has the engines'
			// state when it takes over. The process's first config starts
			// its scraper once it runs (see start): its own sites (an
			// embedded kvsim fleet) listen only then.
			p.scraper.Start(ctx)
		}
		p.sh.addScraper(p.scraper)
	}
	if p.Sync != nil {
		syncer, key, err := p.sh.acquireSync(*p.Sync, p.logger.Named("sync"), running)
		if err != nil {
			return err
		}
		p.syncer, p.syncKey, p.load = syncer, key, running
	}
	p.rng, p.names, p.series = newLockedRand(), new(namesCache), new(seriesCache)
	p.sh.metrics.register(ctx)
	return nil
}

// Cleanup gives back the policy's share of the routing state: its drains
// are lifted, and the upstreams no other loaded config names are
// forgotten once idle.
func (p *Policy) Cleanup() error {
	if p.sh == nil {
		return nil
	}
	p.health.close()
	if p.scraper != nil {
		p.sh.removeScraper(p.scraper)
		// One the config never started stops at once (its context is
		// done), which closes its Stopped channel.
		p.scraper.Start(p.ctx)
	}
	if p.syncKey != "" {
		p.sh.releaseSync(p.syncKey)
	}
	p.sh.removeSite(p.site)
	releaseUpstreams(p.named)
	releaseShared()
	return nil
}

// Validate checks the options.
func (p *Policy) Validate() error {
	if err := (router.Options{OutputEstimate: p.OutputEstimate}).Validate(); err != nil {
		return err
	}
	if p.ScrapeInterval > 0 && time.Duration(p.ScrapeInterval) < scrape.MinInterval {
		return fmt.Errorf("scrape_interval must be at least %v", scrape.MinInterval)
	}
	if p.LLMDWeights != nil && len(p.LLMDWeights) != 3 {
		return fmt.Errorf("llmd_weights needs 3 values (prefix, queue, kv), got %d", len(p.LLMDWeights))
	}
	floats := append([]float64{p.TieSeconds, p.ImposedDelayWeight, p.DecodeWeight, p.EvictionWeight, p.SGLangCacheThreshold, p.SGLangBalanceAbs,
		p.SGLangBalanceRel, p.DynamoOverlapWeight}, p.LLMDWeights...)
	for _, v := range floats {
		if math.IsNaN(v) || math.IsInf(v, 0) {
			return fmt.Errorf("tuning values must be finite numbers, got %v", v)
		}
	}
	if p.ImposedDelayWeight > maxCostWeight || p.DecodeWeight > maxCostWeight || p.EvictionWeight > maxCostWeight {
		return fmt.Errorf("imposed_delay_weight, decode_weight and eviction_weight must be at most %v, got %v, %v and %v",
			maxCostWeight, p.ImposedDelayWeight, p.DecodeWeight, p.EvictionWeight)
	}
	if p.KVMarginTokens < 0 {
		// Negative headroom would let the fit filter pass what does not fit.
		return fmt.Errorf("kv_margin (kv_margin_tokens) must be 0 or more tokens, got %d", p.KVMarginTokens)
	}
	if p.ShedStatus < 400 || p.ShedStatus > 599 {
		return fmt.Errorf("shed_status must be a 4xx or 5xx code, got %d", p.ShedStatus)
	}
	if p.MetricsPath != "" && !strings.HasPrefix(p.MetricsPath, "/") {
		return fmt.Errorf("metrics_path must start with /, got %q", p.MetricsPath)
	}
	// A dial the proxy does not have (a typo, a scheme, another port)
	// would drain or describe nothing, silently.
	if len(p.parentDials) > 0 && !p.parentDynamic {
		for _, dial := range p.Drain {
			if !slices.Contains(p.parentDials, dial) {
				return fmt.Errorf("drain %s: not an upstream of this reverse_proxy (%s)", dial, strings.Join(p.parentDials, ", "))
			}
		}
		for dial := range p.Upstreams {
			if !slices.Contains(p.parentDials, dial) {
				return fmt.Errorf("upstream %s: not an upstream of this reverse_proxy (%s)", dial, strings.Join(p.parentDials, ", "))
			}
		}
	}
	for _, hp := range append([]*HardwareProfile{p.Hardware}, mapValues(p.Upstreams)...) {
		if hp == nil {
			continue
		}
		if hp.PrefillTokensPerSecond < 0 || hp.DecodeTokensPerSecond < 0 || hp.KVCapacityTokens < 0 {
			return fmt.Errorf("hardware profile values must not be negative")
		}
		// Under a token a second, a rate is a mistake (a unit, a
		// decimal point) that would make every estimate centuries long.
		for _, rate := range []float64{hp.PrefillTokensPerSecond, hp.DecodeTokensPerSecond} {
			if rate > 0 && rate < 1 {
				return fmt.Errorf("prefill_rate and decode_rate are tokens a second: %v is under 1", rate)
			}
		}
	}
	return nil
}

func mapValues[K comparable, V any](m map[K]V) []V {
	out := make([]V, 0, len(m))
	for _, v := range m {
		out = append(out, v)
	}
	return out
}

// hardware returns the hardware profile of dial: its own over the
// policy's default (unset values take the engine's defaults).
func (p *Policy) hardware(dial string) router.Hardware {
	var hw router.Hardware
	for _, src := range []*HardwareProfile{p.Hardware, p.Upstreams[dial]} {
		if src == nil {
			continue
		}
		if src.PrefillTokensPerSecond > 0 {
			hw.PrefillTokensPerSecond = src.PrefillTokensPerSecond
		}
		if src.DecodeTokensPerSecond > 0 {
			hw.DecodeTokensPerSecond = src.DecodeTokensPerSecond
		}
		if src.KVCapacityTokens > 0 {
			hw.KVCapacityTokens = src.KVCapacityTokens
		}
	}
	return hw
}

// Select implements reverseproxy.Selector. It runs once per attempt: a
// retry releases the previous attempt's charge and avoids the upstreams
// already tried.
func (p *Policy) Select(pool reverseproxy.UpstreamPool, r *http.Request, w http.ResponseWriter) *reverseproxy.Upstream {
	if p.started != nil {
		p.started.Do(p.start) // this config serves requests, so it runs
	}
	st := requestStateOf(r)
	if st == nil {
		return p.selectFallback(pool, r, w)
	}
	if st.listModels {
		return p.listModels(pool, r, w, st)
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	if st.shed != nil || r.Context().Err() != nil {
		// Answered already, or the client is gone: Caddy asks again
		// after a nil (lb_retries, lb_try_duration), and neither may be
		// routed, charged or held again.
		return p.answered()
	}
	// Caddy asks again after an attempt that found nothing listening (a
	// home that crashed, say): with lb_try_duration it would retry it
	// until that passes.
	ended := ""
	if a := st.current; a != nil {
		ended = a.charge.Dial()
		st.tried = append(st.tried, ended)
		st.current, st.cutTarget = nil, nil
		a.release()
	}
	st.conns.attemptEnded(ended)
	// Never read r.Body here: install a fresh reader of the bytes the
	// handler kept, so a retry resends the full body.
	r.Body = st.attemptBody()
	r.ContentLength = int64(len(st.body))
	return p.dispatch(pool, r, w, st)
}

// dispatch chooses the upstream of st's attempt (see Select), holding it
// at the gateway while none can take it. Caller holds st.mu. (Apart
// from Select, its deferred calls and Select's are few enough times
// their returns for the compiler to run them inline, not through the
// runtime's list of defers.)
func (p *Policy) dispatch(pool reverseproxy.UpstreamPool, r *http.Request, w http.ResponseWriter, st *requestState) *reverseproxy.Upstream {
	// The request may start within QueueTimeout of its arrival (or of its
	// move off a drained upstream; Caddy's retries share it): queued at
	// an engine until KV frees there, or held here until some upstream
	// can take it.
	held := time.Now()
	deadline := cmp.Or(st.waitSince, held).Add(time.Duration(p.QueueTimeout))
	defer p.unhold(st)
	var lookUntil time.Time // while the model lists are fetched anew
	var listed <-chan struct{}
	var lists uint64
	var d router.Decision
	for now := held; ; now = time.Now() {
		if p.scraper != nil { // before the decision reads the lists
			listed, lists = p.scraper.ModelsFetched(), p.scraper.ModelListsChanged()
		}
		up := p.decide(&d, p.stillNamed(pool), st, now, deadline)
		if up != nil {
			st.heldSince = time.Time{}
			p.sh.metrics.latencyOf(&st.decision).queueWait.Observe(now.Sub(held).Seconds()) // d's reason
			st.setDecisionPlaceholders(len(st.tried) + 1)
			p.explain(w, st, d.Decision)
			return up
		}
		// Waiting cannot help a model no upstream serves, or a prompt
		// larger than every upstream's KV cache; a 503 would tell the
		// client to retry.
		switch {
		case d.Unservable && !utf8.Valid(st.origBody):
			// vLLM refuses a body that is not UTF-8 before it reads the
			// model: its 400, not the router's 404, and at once (no model
			// lists fetched again for it).
			return p.refuse(st, d, &shedding{status: http.StatusBadRequest, code: http.StatusBadRequest,
				message: invalidUTF8Message, reason: "invalid_utf8", refused: true})
		case d.Unservable && p.scraper != nil && p.lookAgain(r, pool, st, now, deadline, &lookUntil, listed, lists):
			if r.Context().Err() != nil {
				// It left while the model lists were fetched again.
				st.setShedPlaceholders(canceledWhileHeld, "model", 0)
				return p.answered()
			}
			continue
		case d.Unservable:
			return p.refuse(st, d, &shedding{status: http.StatusNotFound, code: "model_not_found", param: "model",
				message: modelNotFound(st.req.Model), reason: "model", refused: true})
		case d.ModelRequired:
			return p.refuse(st, d, &shedding{status: http.StatusBadRequest, code: http.StatusBadRequest, param: "model",
				message: "you must provide a model parameter: the upstreams serve more than one model", reason: "model_required", refused: true})
		case d.TooLong:
			return p.refuse(st, d, &shedding{status: http.StatusBadRequest, code: "context_length_exceeded", param: st.req.promptParam(),
				message: st.req.tooLongMessage(d.PromptTokens), reason: "context_length", refused: true})
		case d.NotRunning:
			// The only upstreams that might serve the model are down: a
			// 503 at once rather than after queue_timeout (the model may
			// exist, on an engine still starting).
			return p.shed(st, d, notRunningReason, "no upstream that might serve the model is running")
		}
		wait := time.Until(deadline)
		if wait <= 0 {
			st.heldSince = held // observed as shed, also if it never waited
			reason := blockedReason(d.Decision)
			return p.shed(st, d, reason, reason)
		}
		if st.hold == nil {
			waiting := "requests wait"
			if p.opts.QueueLimitValue() == 1 {
				waiting = "request waits"
			}
			return p.shed(st, d, queueFullReason,
				fmt.Sprintf("%d %s already: queue_limit", p.opts.QueueLimitValue(), waiting))
		}
		if st.heldSince.IsZero() {
			st.heldSince = held
		}
		if !st.queued {
			st.queued = true
			p.sh.metrics.queued.Inc()
		}
		// The hold is readied, first come first served, when an upstream
		// this request may fit on releases work; what readies no hold is
		// caught by looking again every router.HoldPollInterval. The
		// state is not held meanwhile: a drain's cut or the handler must
		// not wait on a request that waits for capacity.
		timer := time.NewTimer(min(wait, router.HoldPollInterval))
		st.mu.Unlock()
		select {
		case <-st.hold.Ready():
		case <-timer.C:
		case <-r.Context().Done():
		}
		timer.Stop()
		st.mu.Lock()
		if r.Context().Err() != nil {
			p.endHeldWait(st, canceledWhileHeld)
			// The access log tells a client that left while it waited
			// from a request turned away, and says what it waited for.
			st.setShedPlaceholders(canceledWhileHeld, blockedReason(d.Decision), 0)
			return p.answered()
		}
	}
}

// canceledWhileHeld is the queue wait's reason for a held request whose
// client left.
const canceledWhileHeld = "canceled"

// endHeldWait observes the wait of st's attempt held at the gateway, if it
// was held, as ended for reason. Caller holds st.mu.
func (p *Policy) endHeldWait(st *requestState, reason string) {
	if !st.heldSince.IsZero() {
		p.sh.metrics.queueWaitOf(reason).Observe(time.Since(st.heldSince).Seconds())
		st.heldSince = time.Time{}
	}
}

// unhold ends st's wait at the gateway, if it waits. Caller holds st.mu.
func (p *Policy) unhold(st *requestState) {
	if st.hold != nil {
		p.sh.fleet.Unhold(st.hold, time.Now())
		st.hold = nil
	}
}

// queueFullReason is the shed reason of a request turned away because
// queue_limit requests wait already.
const queueFullReason = "queue_full"

// shed gives up on st for now, blocked by reason (explained by why): the
// handler answers with ShedStatus and a Retry-After of the queue timeout,
// at least a second.
func (p *Policy) shed(st *requestState, d router.Decision, reason, why string) *reverseproxy.Upstream {
	return p.refuse(st, d, &shedding{
		status: p.ShedStatus, typ: "service_unavailable", code: p.ShedStatus,
		message:           "no upstream can take this request now (" + why + "); retry later",
		retryAfterSeconds: int(math.Ceil(max(1, time.Duration(p.QueueTimeout).Seconds()))),
		reason:            reason,
	})
}

// refuse gives up on st with answer, which the handler writes, and counts
// it by its reason: as shed when waiting might let it through later, as
// refused when it can never succeed (a client's mistake, which an alert
// on sheds should not see).
func (p *Policy) refuse(st *requestState, d router.Decision, answer *shedding) *reverseproxy.Upstream {
	st.shed = answer
	outcome := answer.outcome()
	p.endHeldWait(st, outcome)
	if answer.refused {
		p.sh.metrics.refused.WithLabelValues(fmt.Sprint(answer.code)).Inc()
	} else {
		p.sh.metrics.shed.WithLabelValues(answer.reason).Inc()
	}
	// The prompt length the decision used, as the answer's message does.
	prompt := cmp.Or(d.PromptTokens, st.req.PromptTokens)
	st.setShedPlaceholders(outcome, answer.reason, prompt)
	if p.ExplainHeader {
		answer.explained = explainAnswer(answer, prompt, len(st.tried)+1)
	}
	p.sh.metrics.decision(outcome).Inc()
	if c := p.logger.Check(zapcore.DebugLevel, outcome); c != nil {
		c.Write(zap.String("blocked_by", answer.reason), zap.Int("status", answer.status),
			zap.Int("prompt_tokens", st.req.PromptTokens), zap.Int("eligible", d.Eligible))
	}
	return p.answered()
}

// listModels answers GET /v1/models for the whole pool: every model and
// adapter its engines list, each once, as the first engine listing it
// described it, where one engine's own answer would list only what that
// replica serves (adapters are loaded per replica). The request still
// goes to one engine, whose answer (its status: an engine behind an API
// key refuses a client without it; its headers: CORS, header_down) the
// client gets, a 200's body replaced by the list (see modelsWriter).
// Without an engine to take it, Caddy's 503 stands. Upstreams Caddy finds
// unhealthy, draining ones and engines nothing listens at are left out.
// When an engine that counts has no list (scraping is off, or its list
// has not come or is stale), the engine's answer goes as it is.
func (p *Policy) listModels(pool reverseproxy.UpstreamPool, r *http.Request, w http.ResponseWriter, st *requestState) *reverseproxy.Upstream {
	if st.modelList == nil && p.scraper != nil {
		st.modelList = p.modelList(pool)
	}
	return p.selectFallback(pool, r, w)
}

// preferring is pool without the upstreams avoid names, when one that is
// available is left; else pool.
func preferring(pool reverseproxy.UpstreamPool, avoid func(*reverseproxy.Upstream) bool) reverseproxy.UpstreamPool {
	if !slices.ContainsFunc(pool, avoid) || !slices.ContainsFunc(pool, func(u *reverseproxy.Upstream) bool { return u.Available() && !avoid(u) }) {
		return pool
	}
	return slices.DeleteFunc(slices.Clone(pool), avoid)
}

// modelsFailing says u's engine failed its last model list fetch: it
// would most likely fail a client's too (its 500, or a timeout).
func (p *Policy) modelsFailing(u *reverseproxy.Upstream) bool {
	st, ok := p.scraper.StatusOf(u.Dial)
	return ok && st.ModelsError != ""
}

// modelList is the pool's models list (see listModels), nil when an
// engine's list is missing.
func (p *Policy) modelList(pool reverseproxy.UpstreamPool) []byte {
	now := time.Now()
	data := []json.RawMessage{}
	var longest []int        // each entry's max_model_len
	seen := map[string]int{} // a model's entry in data
	listed := 0
	for _, u := range pool {
		// Full or not, an upstream serves what it serves.
		if !u.Healthy() || p.sh.drains.IsDraining(u.Dial) {
			continue
		}
		sig, _ := p.scraper.Latest(u.Dial, now, 0)
		if sig.Models == nil || now.Sub(sig.ModelsAt) > p.scraper.ModelsMaxAge() {
			if p.scraper.Down(u.Dial) {
				continue
			}
			return nil
		}
		listed++
		for _, m := range sig.Models {
			if at, ok := seen[m.ID]; ok {
				// The router sends a request to an engine whose context
				// holds it: the pool's is the longest.
				if m.MaxModelLen > longest[at] {
					longest[at], data[at] = m.MaxModelLen, withMaxModelLen(data[at], m.MaxModelLen)
				}
				continue
			}
			seen[m.ID] = len(data)
			data = append(data, m.Card)
			longest = append(longest, m.MaxModelLen)
		}
	}
	if listed == 0 {
		return nil
	}
	list, _ := json.Marshal(struct {
		Object string            `json:"object"`
		Data   []json.RawMessage `json:"data"`
	}{"list", data})
	return list
}

// withMaxModelLen is the model card with its max_model_len set to n.
func withMaxModelLen(card json.RawMessage, n int) json.RawMessage {
	var fields map[string]json.RawMessage
	if json.Unmarshal(card, &fields) != nil {
		return card
	}
	fields["max_model_len"] = json.RawMessage(strconv.Itoa(n))
	out, err := json.Marshal(fields)
	if err != nil {
		return card
	}
	return out
}

// answered ends Select for a request the router answers itself (st.shed)
// or whose client left. Caddy asks a policy that chose nothing again every
// lb_try_interval until lb_try_duration passes (or lb_retries are spent),
// which would hold the answer back that long (its wait watches the
// config, not the request): then the policy unwinds the proxy instead, with a panic
// the handler recovers (serveRecovering), as the proxy's own aborts
// unwind it. The handler, which put the request's state where Select
// found it, is always on the stack.
func (p *Policy) answered() *reverseproxy.Upstream {
	if p.parentTries {
		panic(policyAnswered{})
	}
	return nil
}

// policyAnswered is the panic value of answered.
type policyAnswered struct{}

func blockedReason(d scorer.Decision) string {
	if s := d.Blocked.String(); s != "" {
		return s
	}
	return "none"
}

// decisionScratch is the space a decision fills (see scratchSpace).
type decisionScratch struct {
	members []router.Member
	engines []scrape.Signals
}

// globalAddress returns dial with Caddy's global placeholders ({env.*},
// {system.*}) replaced, "" when some are unknown or empty (those of a
// request): the address Caddy's active health checks reach an upstream
// at, and the scraper too.
func globalAddress(dial string) string {
	addr, err := caddy.NewReplacer().ReplaceOrErr(dial, true, true)
	if err != nil {
		return ""
	}
	return addr
}

// decide asks the decision engine where st goes among pool at now, to
// start by deadline, and, when it chose, registers the attempt with the
// drain registry. Without a choice, a request that may wait is held
// (st.hold, nil when queue_limit requests wait already), to try again
// when its hold is ready. The decision goes to d, the caller's: a
// Decision returned is copied once more on its way.
func (p *Policy) decide(d *router.Decision, pool reverseproxy.UpstreamPool, st *requestState, now, deadline time.Time) *reverseproxy.Upstream {
	req := st.req
	if p.scraper != nil {
		for _, u := range pool {
			p.scraper.AddTargets(u.Dial) // cheap when known: dynamic upstreams
		}
	}
	if !req.seeded {
		req.seed(p.seedModel(req.Model))
	}
	scratch := &st.scratchSpace().decision
	// Read before Caddy's view of the members: a release after it, which
	// that view may not show, readies the request's hold at once.
	releasesBefore := p.sh.fleet.Releases()
	scratch.members, scratch.engines = p.members(scratch.members, scratch.engines, pool, st.tried, st.conns.unreached, now)
	// The full explanation (top candidates, filter reasons) costs
	// allocations, so it is built only when debug logs are on.
	var ex *scorer.Explanation
	if p.logger.Core().Enabled(zapcore.DebugLevel) {
		ex = new(scorer.Explanation)
	}
	rreq := router.Request{
		Hashes: req.Hashes, BlockTokens: req.BlockTokens, PromptTokens: req.PromptTokens,
		PromptBytes: req.PromptBytes, LongestPromptTokens: req.LongestPromptTokens,
		MaxTokens: req.MaxTokens, Sequences: req.Sequences, Model: req.Model, MaxWait: max(0, deadline.Sub(now)),
		Home:            p.sh.fleet.ResponseHome(req.PreviousResponseID),
		MaxTokensCapped: req.Endpoint == EndpointResponses,
		ReleasesBefore:  releasesBefore,
	}
	if st.sent == 0 {
		// The first attempt's charge lives in the state, as the attempt
		// does (see newAttempt): released by the time the state is
		// reused (see recycle).
		rreq.Charge = &st.firstCharge
	}
	*d = p.sh.fleet.Decide(now, rreq, scratch.members, &p.opts, p.rng, ex)
	st.explanation = ex
	if d.Charge == nil {
		if !d.Unservable && !d.TooLong && !d.NotRunning && !d.ModelRequired && now.Before(deadline) {
			st.hold = p.sh.fleet.Hold(st.hold, d, rreq, deadline, scratch.members, &p.opts)
		}
		return nil
	}
	dial := d.Charge.Dial()
	st.sh = p.sh
	a := st.newAttempt()
	*a = attempt{st: st, sh: p.sh, charge: d.Charge, scraper: p.scraper}
	a.flight = p.sh.drains.Enter(dial, a)
	st.current, st.cutTarget = a, a
	st.decision = decisionRecord{upstream: dial, reason: string(d.Reason), estimate: d.EstimatedTTFTSeconds, matched: d.MatchedTokens, prompt: d.PromptTokens}
	p.sh.metrics.resolveAt(p.series, d.Chosen, &st.decision)
	p.sh.metrics.observeDecision(&st.decision)
	return pool[d.Chosen]
}

// namesCache holds the model names of a scraper's lists, read again
// when they change.
type namesCache struct {
	mu      sync.Mutex // orders the reads
	current atomic.Pointer[modelNames]
}

// modelNames is a router.ModelNames and the scraper's ModelListsChanged
// count read before its lists.
type modelNames struct {
	changed uint64
	names   *router.ModelNames
}

// seedModel returns the name model's prefix hashes are seeded with (see
// router.ModelNames): one name for all the names of a base model, as the
// engines' lists give them. The names are read again only when a list
// changed, so a request costs a lookup in a small map. Without lists
// (scraping off, or none fetched yet), model itself.
func (p *Policy) seedModel(model string) string {
	if p.scraper == nil {
		return model
	}
	changed := p.scraper.ModelListsChanged()
	n := p.names.current.Load()
	if n == nil || n.changed != changed {
		n = p.names.read(p.scraper, changed)
	}
	return n.names.Seed(model)
}

// read reads the model names of s's lists, which changed count changes
// made.
func (c *namesCache) read(s *scrape.Scraper, changed uint64) *modelNames {
	c.mu.Lock()
	defer c.mu.Unlock()
	if n := c.current.Load(); n != nil && n.changed == changed {
		return n // another request read them meanwhile
	}
	n := &modelNames{changed: changed, names: router.NewModelNames(s.ModelLists()...)}
	c.current.Store(n)
	return n
}

// modelsAPIKey is models_api_key with its placeholders ({env.X})
// replaced; braces that are no placeholder stay. One given that comes out
// empty (an unset variable) is warned of: no key is sent.
func (p *Policy) modelsAPIKey() string {
	key := caddy.NewReplacer().ReplaceKnown(p.ModelsAPIKey, "")
	if p.ModelsAPIKey != "" && key == "" {
		p.logger.Warn("models_api_key is empty once its placeholders are replaced: the model lists are requested without a key",
			zap.String("models_api_key", p.ModelsAPIKey))
	}
	return key
}

// modelsRefetchWait is the longest a request for a model no engine lists
// waits for the lists fetched anew (see scrape.Scraper.AskModels).
const modelsRefetchWait = 2 * time.Second

// lookAgain, for a request whose model no engine lists, has the engines'
// lists fetched anew (those not fetched since it arrived) and waits,
// within modelsRefetchWait and the request's deadline (lookUntil keeps
// the end across calls), until one of them lists something new, and
// reports whether one did: then the request is decided again. listed and
// lists are the scraper's ModelsFetched channel and ModelListsChanged
// count taken before the decision, so a list that came during it is not
// missed. An adapter loaded on an engine directly, not through the
// router, is listed there before the next models_interval. A list that
// came back as it was wakes the wait but decides nothing: clients asking
// for a model that does not exist cost one decision each (two if the
// time runs out), not one for every engine's list, under the fleet's
// lock. It reports false, and the 404 goes, once every list the decision
// read is as new as the request and none changed, or the time is up.
// Caller holds st.mu, which is not held while it waits, as while waiting
// for capacity.
func (p *Policy) lookAgain(r *http.Request, pool reverseproxy.UpstreamPool, st *requestState, now, deadline time.Time, lookUntil *time.Time, listed <-chan struct{}, lists uint64) bool {
	if lookUntil.IsZero() {
		*lookUntil = now.Add(modelsRefetchWait)
		if deadline.Before(*lookUntil) {
			*lookUntil = deadline
		}
	}
	dials := make([]string, len(pool))
	for i, u := range pool {
		dials[i] = u.Dial
	}
	changed := func() bool { return p.scraper.ModelListsChanged() != lists }
	for {
		if changed() {
			return true
		}
		wait := time.Until(*lookUntil)
		if wait <= 0 {
			return false
		}
		if p.scraper.AskModels(dials, st.arrived) == 0 {
			return changed() // every list is as new as the request
		}
		timer := time.NewTimer(wait)
		st.mu.Unlock()
		timedOut := false
		select {
		case <-listed:
		case <-timer.C:
			timedOut = true
		case <-r.Context().Done():
		}
		timer.Stop()
		st.mu.Lock()
		if timedOut || r.Context().Err() != nil {
			return true // decided once more, or answered as gone
		}
		listed = p.scraper.ModelsFetched() // before changed() looks again
	}
}

// firstBody returns body as the request's body for its first attempt.
// A *bytes.Reader behind io.NopCloser is a body net/http knows is in
// memory: it sends it with the headers in one write, where any other
// reader makes the transport flush the headers first, a second system
// call a request. The closer wraps the state's own reader, so it stays
// with the state when it is reused (see recycle).
func (st *requestState) firstBody(body []byte) io.ReadCloser {
	st.firstReader.Reset(body)
	if st.firstReadCloser == nil {
		st.firstReadCloser = io.NopCloser(&st.firstReader)
	}
	return st.firstReadCloser
}

// attemptBody returns a reader of the whole body for an attempt: the
// first one's (rewound: nothing may have read it, but nothing relies on
// that) until an attempt took it, then a fresh one each time, as an
// attempt the proxy gave up on may still be reading its own.
func (st *requestState) attemptBody() io.ReadCloser {
	if st.sent == 0 && st.firstReadCloser != nil {
		st.firstReader.Reset(st.body)
		return st.firstReadCloser
	}
	return io.NopCloser(bytes.NewReader(st.body))
}

// newAttempt returns the attempt to fill for a decision: the first one
// kept in the state, or a new one (a drain may still hold an earlier).
// It counts the attempt, which marks the first attempt's body as taken.
func (st *requestState) newAttempt() *attempt {
	st.sent++
	if st.sent > 1 {
		return new(attempt)
	}
	return &st.firstAttempt
}

// attempt is one routing of a request to an upstream: the engine's charge
// there and the request's registration with the drain registry, which
// cuts the attempt (not the request) at the upstream's drain deadline.
type attempt struct {
	st     *requestState
	sh     *shared
	charge *router.Charge
	flight drain.Flight
	// scraper is the policy's, nil without scrape_interval: an engine's
	// 404 for the model makes it fetch that engine's list again.
	scraper *scrape.Scraper
}

// Cut is called at the drain deadline of the attempt's upstream: it
// cancels the attempt so the handler can move the request, if the
// attempt is still the one in progress. A cut that comes after the proxy
// left the attempt (it retried elsewhere, or the response ended) does
// nothing: it must not cut the request's next attempt.
func (a *attempt) Cut() {
	st := a.st
	st.mu.Lock()
	cancel, rec := st.cancel, st.rec
	if st.cutTarget != a || cancel == nil {
		st.mu.Unlock()
		return
	}
	st.cut = true
	// Under the lock, so that the handler's takeCut, which clears it
	// for the next attempt, cannot come between.
	if rec != nil && !rec.headerSent.Load() {
		rec.discard.Store(true)
	}
	st.mu.Unlock()
	cancel(errDrainCut)
}

// endFlight ends the attempt's registration with the drain registry,
// noting in the request's state a drain cut that may still come (see
// requestState.recycle).
func (a *attempt) endFlight() {
	if a.flight.EndPending() {
		a.st.cutPending.Store(true)
	}
}

// release gives back what the attempt holds, for a response that did not
// complete. Safe to call twice.
func (a *attempt) release() {
	a.endFlight()
	a.sh.fleet.Release(a.charge, time.Now())
}

// refused releases a for a request its upstream answered 404 (see
// router.Fleet.Refused). When the 404 says the engine does not serve
// model (notServed), whatever the list it last gave says (an adapter
// unloaded there by a call that did not pass the router, say), the model
// is taken off that list and the list fetched again at once, so the next
// requests go to an engine that serves it rather than to this one until
// models_interval passes.
func (a *attempt) refused(model string, notServed bool) {
	a.endFlight()
	a.sh.fleet.Refused(a.charge, time.Now())
	if a.scraper != nil && model != "" && notServed {
		a.scraper.ForgetModel(a.charge.Dial(), model)
		a.scraper.RefreshModels(a.charge.Dial())
	}
}

// explain logs the decision at debug level and, when enabled, sets the
// explanation header. Neither carries prompt text.
func (p *Policy) explain(w http.ResponseWriter, st *requestState, d scorer.Decision) {
	rec := st.decision
	st.explain = p.ExplainHeader
	if p.ExplainHeader {
		w.Header().Set(explainHeader, fmt.Sprintf("upstream=%s; reason=%s; matched=%d; prompt=%d; est_ttft=%.3fs; attempt=%d",
			rec.upstream, rec.reason, rec.matched, rec.prompt, rec.estimate, len(st.tried)+1))
	}
	if c := p.logger.Check(zapcore.DebugLevel, "routed"); c != nil {
		c.Write(zap.String("upstream", rec.upstream), zap.String("reason", rec.reason),
			zap.Int("matched_tokens", rec.matched), zap.Int("prompt_tokens", rec.prompt),
			zap.Int("blocks", len(st.req.Hashes)), zap.Float64("estimated_ttft_s", rec.estimate),
			zap.Int("eligible", d.Eligible), zap.Int("attempt", len(st.tried)+1),
			zap.Array("top", explainedCandidates{st.explanation}), zap.Array("filtered", excludedCandidates{st.explanation}))
	}
}

// explainedCandidates logs the best candidates' features (no prompt text).
type explainedCandidates struct{ ex *scorer.Explanation }

// MarshalLogArray implements zapcore.ArrayMarshaler.
func (e explainedCandidates) MarshalLogArray(enc zapcore.ArrayEncoder) error {
	if e.ex == nil {
		return nil
	}
	for _, c := range e.ex.Top {
		enc.AppendObject(zapcore.ObjectMarshalerFunc(func(o zapcore.ObjectEncoder) error {
			o.AddString("upstream", c.Name)
			o.AddFloat64("cost", c.Cost)
			o.AddFloat64("ttft_s", c.TTFTSeconds)
			o.AddInt("matched_tokens", c.MatchedTokens)
			o.AddInt("queued_tokens", c.QueuedTokens)
			o.AddString("adapter", c.Adapter.String())
			return nil
		}))
	}
	return nil
}

// excludedCandidates logs the filtered candidates and why.
type excludedCandidates struct{ ex *scorer.Explanation }

// MarshalLogArray implements zapcore.ArrayMarshaler.
func (e excludedCandidates) MarshalLogArray(enc zapcore.ArrayEncoder) error {
	if e.ex == nil {
		return nil
	}
	for _, c := range e.ex.Filtered {
		enc.AppendString(c.Name + ":" + c.Reason.String())
	}
	return nil
}

// selectFallback balances requests without parsed content, passed
// through or a models list, and registers each as in flight on the
// upstream chosen.
func (p *Policy) selectFallback(pool reverseproxy.UpstreamPool, r *http.Request, w http.ResponseWriter) *reverseproxy.Upstream {
	pt, _ := r.Context().Value(passThroughKey{}).(*passThrough) // the handler's, when it is in the route
	if pt != nil && pt.refusedBy != "" {
		// Refused at an earlier attempt: Caddy asks again after a nil
		// (lb_retries), and the answer stands, counted once.
		return p.answered()
	}
	if pt != nil {
		// Caddy asks again after an attempt that found nothing listening.
		pt.conns.attemptEnded(pt.lastDial)
	}
	up := p.chooseFallback(pool, r, w, pt)
	if up == nil {
		return nil // no decision: Caddy may ask again
	}
	p.sh.metrics.decision(fallbackReason).Inc()
	p.enterPassThrough(r, pt, up.Dial)
	if pt != nil && pt.unload && pt.loraName != "" && p.scraper != nil {
		dial, adapter := up.Dial, pt.loraName
		pt.mu.Lock()
		pt.unloaded = func() { p.scraper.ForgetModel(dial, adapter) }
		pt.mu.Unlock()
	}
	if pt != nil && !pt.unload && pt.loraName != "" {
		p.sh.fleet.AdapterLoading(up.Dial, pt.loraName)
	}
	if up != nil && p.scraper != nil && changesAdapters(r) {
		// The engine's model list changes with it: fetch it again once
		// the engine has answered (the request's context ends with the
		// response), not at the next models_interval, so that the
		// adapter just loaded is routed (and not refused as unknown).
		dial := up.Dial
		context.AfterFunc(r.Context(), func() { p.scraper.RefreshModels(dial) })
	}
	return up
}

// enterPassThrough registers a request the handler did not read with the
// drain registry, on dial, so that a drain of dial waits for it. Through
// the handler its drain deadline can cut it (see servePassThrough);
// without the handler in the route (pt nil) the drain only waits for its
// end.
func (p *Policy) enterPassThrough(r *http.Request, pt *passThrough, dial string) {
	if p.sh.drains.IsDraining(dial) {
		// A stored response's request goes to its home even so (only it
		// has the response): entered, it would open a drained upstream's
		// drain again, its deadline perhaps past, and be cut at once.
		// The attempt before ends all the same: a drain of its upstream
		// must neither wait for this one nor cut it.
		if pt != nil {
			pt.enter(nil, dial)
		}
		return
	}
	if pt != nil {
		pt.enter(p.sh.drains, dial)
		return
	}
	f := p.sh.drains.Enter(dial, drain.CutFunc(func() {}))
	context.AfterFunc(r.Context(), f.End)
}

// changesAdapters says r loads or unloads a LoRA adapter (vLLM's runtime
// adapter API).
func changesAdapters(r *http.Request) bool {
	return r.Method == http.MethodPost &&
		(strings.HasSuffix(r.URL.Path, "/load_lora_adapter") || strings.HasSuffix(r.URL.Path, "/unload_lora_adapter"))
}

// chooseFallback is selectFallback's choice; pt is the handler's record of
// a request it passed through, nil for none.
func (p *Policy) chooseFallback(pool reverseproxy.UpstreamPool, r *http.Request, w http.ResponseWriter, pt *passThrough) *reverseproxy.Upstream {
	// A request about a stored response (its retrieval, its input items,
	// its cancellation, its deletion) goes where the response is, as one
	// continuing it does.
	if dial := p.sh.fleet.ResponseHome(storedResponseID(r.URL.Path)); dial != "" {
		for _, u := range pool {
			if u.Dial == dial && u.Available() && (pt == nil || !pt.conns.isUnreached(dial)) && (p.scraper == nil || !p.scraper.Down(dial)) {
				return u
			}
		}
	}
	// A generation request the handler did not see (pt is nil): the
	// llm_affinity directive is missing from the route, or comes after
	// reverse_proxy. Affinity is then off for every request; say so once.
	// (One it saw and passed on, a body not declared JSON, says nothing
	// of the config.)
	if p.warnedUnparsed != nil && pt == nil && endpointOf(r.Method, r.URL.Path) != EndpointOther && p.warnedUnparsed.CompareAndSwap(false, true) {
		p.logger.Warn("a generation request reached lb_policy llm_affinity without the llm_affinity handler having read it: "+
			"routing such requests with the fallback policy, without affinity; put the llm_affinity directive in the route before reverse_proxy",
			zap.String("path", r.URL.Path))
	}
	// A drain closes an upstream to these requests too (the stored
	// response's above aside: only its home has it).
	pool = p.undrained(pool)
	// A request for a model (an embedding, a tokenization, a score) goes
	// where the model is served: to an upstream listing it, or, when none
	// that does can take it, whose list is unknown. When every list is
	// known and none has it, it is not served here.
	if pt != nil && pt.model != "" && p.scraper != nil {
		serving, known := p.servingModel(pool, pt.model)
		if len(serving) == 0 && known {
			// As on the routed path: vLLM refuses a body that is not
			// UTF-8 (400) before it reads the model.
			by, code, status := blockedByModel, "model_not_found", http.StatusNotFound
			if !utf8.Valid(pt.body) {
				by, code, status = blockedByUTF8, "400", http.StatusBadRequest
			}
			pt.mu.Lock()
			pt.refusedBy = by // the placeholders' refused and blocked_by
			pt.mu.Unlock()
			p.sh.metrics.decision(refusedReason).Inc()
			p.sh.metrics.refused.WithLabelValues(code).Inc()
			if c := p.logger.Check(zapcore.DebugLevel, refusedReason); c != nil {
				c.Write(zap.String("blocked_by", by), zap.Int("status", status), zap.Bool("passed_through", true))
			}
			return p.answered()
		}
		pool = serving
	}
	if pt != nil && pt.loraName != "" && p.scraper != nil {
		// An unload goes to an upstream listing the adapter, and so does
		// an in-place load (only an engine holding the adapter has weights
		// to replace), a first load to one not listing it yet, when there
		// is one; else the engine answers (404 for an adapter no engine
		// has, 400 for one every engine has loaded; an in-place load of an
		// adapter no engine lists is a first load).
		listing, lacking := p.listingModel(pool, pt.loraName)
		switch {
		case (pt.unload || pt.inplace) && len(listing) > 0:
			pool = listing
		case !pt.unload && len(lacking) > 0:
			// Of those, one holding the fewest adapters the router sent
			// it: the engine that loads it serves all its requests, and
			// one with GPU slots to spare evicts nothing for them.
			fewest := math.MaxInt
			for _, u := range lacking {
				fewest = min(fewest, p.sh.fleet.AdaptersHeld(u.Dial))
			}
			pool = preferring(lacking, func(u *reverseproxy.Upstream) bool { return p.sh.fleet.AdaptersHeld(u.Dial) > fewest })
		}
	}
	// Engines found with nothing listening, by an earlier attempt of this
	// request (another engine answers; for a stored response, 404: it is
	// gone with its engine) or by the last scrape (Caddy, without health
	// checks, may still count them available), come last, as for routed
	// requests; so does, for the models list, an engine whose last list
	// fetch failed (the others' lists make the answer).
	if pt != nil && len(pt.conns.unreached) > 0 {
		pool = preferring(pool, func(u *reverseproxy.Upstream) bool { return pt.conns.isUnreached(u.Dial) })
	}
	if p.scraper != nil {
		pool = preferring(pool, func(u *reverseproxy.Upstream) bool { return p.scraper.Down(u.Dial) })
		if pt != nil && pt.models != nil {
			pool = preferring(pool, p.modelsFailing)
		}
	}
	if p.fallback != nil {
		return p.fallback.Select(pool, r, w)
	}
	// Least queued work, then fewest requests, then random.
	var best *reverseproxy.Upstream
	bestWork, ties := math.MaxInt, 0
	for _, u := range pool {
		if !u.Available() {
			continue
		}
		work := u.NumRequests() + p.sh.fleet.QueuedTokens(u.Dial)
		switch {
		case work < bestWork:
			best, bestWork, ties = u, work, 1
		case work == bestWork:
			ties++
			if p.rng.IntN(ties) == 0 {
				best = u
			}
		}
	}
	return best
}

// modelNotFound is the OpenAI API's message for a model not served.
func modelNotFound(model string) string { return fmt.Sprintf("The model `%s` does not exist.", model) }

// stillNamed is pool for a decision: pool itself while this config is
// loaded. A request held since before a reload decides with the replaced
// config's pool, of which the static upstreams the new config dropped are
// gone: deciding with one would bring its state back, as a dynamic
// upstream's.
func (p *Policy) stillNamed(pool reverseproxy.UpstreamPool) reverseproxy.UpstreamPool {
	if p.parentDynamic || !p.replaced() {
		return pool
	}
	return slices.DeleteFunc(slices.Clone(pool), func(u *reverseproxy.Upstream) bool { return !p.sh.fleet.Routable(u.Dial) })
}

// replaced says this policy's config was unloaded: a reload replaced it,
// and only requests that arrived before still decide with it.
func (p *Policy) replaced() bool { return p.ctx.Context != nil && p.ctx.Err() != nil }

// servingModel is the upstreams of pool whose model lists (see
// listedModels) name model, when one of them can take a request now;
// else those and the ones whose lists are unknown (they may serve it: an
// engine still loading, one whose list went stale). known says some
// upstream had a list.
func (p *Policy) servingModel(pool reverseproxy.UpstreamPool, model string) (serving reverseproxy.UpstreamPool, known bool) {
	now := time.Now()
	var unknown reverseproxy.UpstreamPool
	live := false
	for _, u := range pool {
		listed, listKnown := p.lists(u, model, now)
		known = known || listKnown
		switch {
		case listed:
			serving = append(serving, u)
			// A dead engine keeps the list it last gave.
			live = live || u.Available() && !p.scraper.Down(u.Dial)
		case !listKnown:
			unknown = append(unknown, u)
		}
	}
	if live {
		return serving, known
	}
	return append(serving, unknown...), known
}

// listingModel splits pool into the upstreams whose model lists name
// model and the others (lists lacking it, or unknown).
func (p *Policy) listingModel(pool reverseproxy.UpstreamPool, model string) (listing, lacking reverseproxy.UpstreamPool) {
	now := time.Now()
	for _, u := range pool {
		if listed, _ := p.lists(u, model, now); listed {
			listing = append(listing, u)
		} else {
			lacking = append(lacking, u)
		}
	}
	return listing, lacking
}

// lists says u's model list (see listedModels) names model, and whether
// that list is known at all.
func (p *Policy) lists(u *reverseproxy.Upstream, model string, now time.Time) (listed, known bool) {
	sig, _, down := p.scraper.Current(u.Dial, now, 0)
	models := p.listedModels(sig, down, now)
	return slices.ContainsFunc(models, func(m scrape.ModelInfo) bool { return m.ID == model }), models != nil
}

// undrained is pool without its draining upstreams: pool itself when none
// drains.
func (p *Policy) undrained(pool reverseproxy.UpstreamPool) reverseproxy.UpstreamPool {
	for i, u := range pool {
		if p.sh.drains.IsDraining(u.Dial) {
			open := slices.Clone(pool[:i])
			for _, u := range pool[i+1:] {
				if !p.sh.drains.IsDraining(u.Dial) {
					open = append(open, u)
				}
			}
			return open
		}
	}
	return pool
}

// storedResponseID is the response id a path names below /responses/
// (/v1/responses/{id}, /v1/responses/{id}/cancel, ...), "" for none.
func storedResponseID(path string) string {
	i := strings.LastIndex(path, "/responses/")
	if i < 0 {
		return ""
	}
	id, _, _ := strings.Cut(path[i+len("/responses/"):], "/")
	if len(id) > maxResponseIDBytes {
		return ""
	}
	return id
}

// requestStateOf returns the state the handler stored, if any.
func requestStateOf(r *http.Request) *requestState {
	st, _ := r.Context().Value(stateKey{}).(*requestState)
	return st
}

// lockedRand is a random source safe for concurrent Selects.
type lockedRand struct {
	mu sync.Mutex
	r  *rand.Rand
}

func newLockedRand() *lockedRand {
	return &lockedRand{r: rand.New(rand.NewPCG(rand.Uint64(), rand.Uint64()))}
}

// IntN returns a random int in [0, n).
func (l *lockedRand) IntN(n int) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.r.IntN(n)
}

// Interface guards
var (
	_ caddy.Provisioner     = (*Policy)(nil)
	_ caddy.CleanerUpper    = (*Policy)(nil)
	_ caddy.Validator       = (*Policy)(nil)
	_ reverseproxy.Selector = (*Policy)(nil)
)
