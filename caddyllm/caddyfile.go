package caddyllm

import (
	"math"
	"strconv"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"github.com/dustin/go-humanize"
)

func init() {
	httpcaddyfile.RegisterHandlerDirective("llm_affinity", parseHandlerCaddyfile)
	// Before invoke, so that a site-level llm_affinity runs ahead of
	// handle and route blocks (and after encode, so the writer wrapper
	// sees uncompressed bytes). It may also go inside a handle block.
	httpcaddyfile.RegisterDirectiveOrder("llm_affinity", httpcaddyfile.Before, "invoke")
}

func parseHandlerCaddyfile(h httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
	m := new(Handler)
	err := m.UnmarshalCaddyfile(h.Dispenser)
	return m, err
}

// UnmarshalCaddyfile sets up the handler from Caddyfile tokens. Syntax:
//
//	llm_affinity {
//		block_tokens      <n>
//		bytes_per_token   <n>
//		max_body          <size>
//		max_prefix_tokens <n>
//		salt              <string>
//	}
func (h *Handler) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // consume directive name
	if d.NextArg() {
		return d.ArgErr()
	}
	seen := make(map[string]bool)
	for d.NextBlock(0) {
		opt := d.Val()
		if seen[opt] {
			// Given twice, one of them is a mistake: say so rather than
			// let the later win silently.
			return d.Errf("%s already specified", opt)
		}
		seen[opt] = true
		switch opt {
		case "block_tokens":
			if err := intArg(d, &h.BlockTokens); err != nil {
				return err
			}
		case "bytes_per_token":
			if err := intArg(d, &h.BytesPerToken); err != nil {
				return err
			}
		case "max_prefix_tokens":
			if err := intArg(d, &h.MaxPrefixTokens); err != nil {
				return err
			}
		case "max_body":
			if !d.NextArg() {
				return d.ArgErr()
			}
			size, err := humanize.ParseBytes(d.Val())
			if err != nil {
				// humanize's own error names a part of the value.
				return d.Errf("parsing max_body %q: want a size such as 32MiB or 1MB", d.Val())
			}
			if size > maxMaxBodyBytes {
				// Beyond int64 it would wrap negative, which means the
				// default.
				return d.Errf("max_body %s is larger than 1GiB: the router holds a request's whole body", d.Val())
			}
			h.MaxBodyBytes = int64(size)
		case "salt":
			if !d.NextArg() {
				return d.ArgErr()
			}
			h.Salt = d.Val()
		default:
			return d.Errf("unrecognized llm_affinity option '%s'", opt)
		}
		if d.NextArg() {
			return d.ArgErr()
		}
	}
	return nil
}

// UnmarshalCaddyfile sets up the policy from Caddyfile tokens. Syntax:
//
//	lb_policy llm_affinity {
//		strategy        ttft|sglang|llmd|dynamo|least_work
//		output_estimate average|max_tokens|fixed
//		output_tokens   <n>
//		prefill_rate    <tokens/s>
//		decode_rate     <tokens/s>
//		kv_capacity     <tokens>
//		upstream <dial> {
//			prefill_rate <tokens/s>
//			decode_rate  <tokens/s>
//			kv_capacity  <tokens>
//		}
//		adapters            <name...>
//		max_loras           <n>
//		adapter_load_host   <duration>
//		adapter_load_remote <duration>
//		scrape_interval     <duration>
//		scrape_max_age      <duration>
//		models_interval     <duration>
//		metrics_path        <path>
//		models_api_key      <key>
//		queue_timeout       <duration>
//		shed_status         <code>
//		queue_limit         <n>
//		kv_margin           <tokens>
//		tie                 <seconds>
//		imposed_delay_weight <w>
//		decode_weight       <w>
//		eviction_weight     <w>
//		sglang              <cache_threshold> <balance_abs> <balance_rel>
//		llmd_weights        <prefix> <queue> <kv>
//		dynamo_overlap_weight <w>
//		drain_deadline      <duration>
//		drain               <dial...>
//		explain_header
//		fallback <policy> [<args...>]
//		sync <nats-url...> {
//			subject <subject>
//			name    <router name>
//			creds   <file>
//			tls_ca  <file>
//		}
//	}
func (p *Policy) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // consume policy name
	if d.NextArg() {
		return d.ArgErr()
	}
	// Options that take one duration or one number, by name.
	durations := map[string]*caddy.Duration{
		"adapter_load_host": &p.AdapterLoadHost, "adapter_load_remote": &p.AdapterLoadRemote,
		"queue_timeout": &p.QueueTimeout, "drain_deadline": &p.DrainDeadline,
		"scrape_interval": &p.ScrapeInterval, "scrape_max_age": &p.ScrapeMaxAge,
		"models_interval": &p.ModelsInterval,
	}
	numbers := map[string]*float64{
		"tie": &p.TieSeconds, "dynamo_overlap_weight": &p.DynamoOverlapWeight,
		"imposed_delay_weight": &p.ImposedDelayWeight, "decode_weight": &p.DecodeWeight,
		"eviction_weight": &p.EvictionWeight,
	}
	seen := make(map[string]bool)
	for d.NextBlock(0) {
		opt := d.Val()
		// Given twice, one of them is a mistake: say so rather than let
		// the later win silently. Lists (adapters, drain) and upstream
		// blocks (one per dial) may come in several lines.
		if repeatable := opt == "adapters" || opt == "drain" || opt == "upstream"; seen[opt] && !repeatable {
			return d.Errf("%s already specified", opt)
		}
		seen[opt] = true
		if dst, ok := durations[opt]; ok {
			if !d.NextArg() {
				return d.ArgErr()
			}
			dur, err := caddy.ParseDuration(d.Val())
			if err != nil {
				return d.Errf("parsing %s: %v", opt, err)
			}
			*dst = caddy.Duration(dur)
			if d.NextArg() {
				return d.ArgErr()
			}
			continue
		}
		if dst, ok := numbers[opt]; ok {
			if err := floatArg(d, dst); err != nil {
				return err
			}
			if d.NextArg() {
				return d.ArgErr()
			}
			continue
		}
		switch opt {
		case "strategy", "output_estimate":
			if !d.NextArg() {
				return d.ArgErr()
			}
			dst := &p.OutputEstimate
			if opt == "strategy" {
				dst = &p.Strategy
			}
			*dst = d.Val()
		case "output_tokens":
			if err := intArg(d, &p.OutputTokens); err != nil {
				return err
			}
		case "prefill_rate", "decode_rate", "kv_capacity":
			if p.Hardware == nil {
				p.Hardware = new(HardwareProfile)
			}
			if err := hardwareArg(d, opt, p.Hardware); err != nil {
				return err
			}
		case "upstream":
			if !d.NextArg() {
				return d.ArgErr()
			}
			dial := d.Val()
			// A profile's options go in the block: on the upstream's own
			// line they would read as pool-wide defaults.
			if d.NextArg() {
				return d.ArgErr()
			}
			hp := new(HardwareProfile)
			given := make(map[string]bool)
			for nesting := d.Nesting(); d.NextBlock(nesting); {
				if given[d.Val()] {
					return d.Errf("%s already specified for upstream %s", d.Val(), dial)
				}
				given[d.Val()] = true
				if err := hardwareArg(d, d.Val(), hp); err != nil {
					return err
				}
				if d.NextArg() {
					return d.ArgErr()
				}
			}
			if p.Upstreams == nil {
				p.Upstreams = make(map[string]*HardwareProfile)
			}
			if p.Upstreams[dial] != nil {
				return d.Errf("upstream %s already specified", dial)
			}
			p.Upstreams[dial] = hp
			continue
		case "adapters":
			names := d.RemainingArgs()
			if len(names) == 0 {
				return d.ArgErr()
			}
			p.Adapters = append(p.Adapters, names...)
			continue
		case "max_loras":
			if err := intArg(d, &p.MaxLoras); err != nil {
				return err
			}
		case "kv_margin":
			if err := intArg(d, &p.KVMarginTokens); err != nil {
				return err
			}
		case "shed_status":
			if err := intArg(d, &p.ShedStatus); err != nil {
				return err
			}
		case "queue_limit":
			if err := intArg(d, &p.QueueLimit); err != nil {
				return err
			}
		case "drain":
			dials := d.RemainingArgs()
			if len(dials) == 0 {
				return d.ArgErr()
			}
			p.Drain = append(p.Drain, dials...)
			continue
		case "metrics_path":
			if !d.NextArg() {
				return d.ArgErr()
			}
			p.MetricsPath = d.Val()
		case "models_api_key":
			if !d.NextArg() {
				return d.ArgErr()
			}
			p.ModelsAPIKey = d.Val()
		case "sglang", "llmd_weights":
			var v [3]float64
			for i := range v {
				if err := floatArg(d, &v[i]); err != nil {
					return err
				}
			}
			if opt == "sglang" {
				p.SGLangCacheThreshold, p.SGLangBalanceAbs, p.SGLangBalanceRel = v[0], v[1], v[2]
			} else {
				p.LLMDWeights = v[:]
			}
		case "explain_header":
			p.ExplainHeader = true
		case "sync":
			p.Sync = &SyncConfig{URLs: d.RemainingArgs()}
			if len(p.Sync.URLs) == 0 {
				return d.ArgErr()
			}
			fields := map[string]*string{"subject": &p.Sync.Subject, "name": &p.Sync.Name, "creds": &p.Sync.Creds, "tls_ca": &p.Sync.TLSCA}
			for nesting := d.Nesting(); d.NextBlock(nesting); {
				dst, ok := fields[d.Val()]
				if !ok {
					return d.Errf("unrecognized sync option '%s'", d.Val())
				}
				if *dst != "" {
					return d.Errf("sync %s already specified", d.Val())
				}
				if !d.NextArg() {
					return d.ArgErr()
				}
				*dst = d.Val()
				if d.NextArg() {
					return d.ArgErr()
				}
			}
			continue
		case "fallback":
			if !d.NextArg() {
				return d.ArgErr()
			}
			name := d.Val()
			modID := "http.reverse_proxy.selection_policies." + name
			unm, err := caddyfile.UnmarshalModule(d, modID)
			if err != nil {
				return err
			}
			sel, ok := unm.(reverseproxy.Selector)
			if !ok {
				return d.Errf("module %s is not a selection policy", modID)
			}
			p.FallbackRaw = caddyconfig.JSONModuleObject(sel, "policy", name, nil)
			continue
		default:
			return d.Errf("unrecognized llm_affinity policy option '%s'", opt)
		}
		if d.NextArg() {
			return d.ArgErr()
		}
	}
	return nil
}

func hardwareArg(d *caddyfile.Dispenser, opt string, hp *HardwareProfile) error {
	switch opt {
	case "prefill_rate":
		return floatArg(d, &hp.PrefillTokensPerSecond)
	case "decode_rate":
		return floatArg(d, &hp.DecodeTokensPerSecond)
	case "kv_capacity":
		return intArg(d, &hp.KVCapacityTokens)
	}
	return d.Errf("unrecognized hardware option '%s'", opt)
}

// intArg reads the current option's one integer argument into dst; its
// errors name the option (the dispenser's current token).
func intArg(d *caddyfile.Dispenser, dst *int) error {
	opt := d.Val()
	if !d.NextArg() {
		return d.ArgErr()
	}
	v, err := strconv.Atoi(d.Val())
	if err != nil {
		return d.Errf("%s: not an integer: %q", opt, d.Val())
	}
	*dst = v
	return nil
}

// floatArg reads the current option's one finite number into dst; its
// errors name the option.
func floatArg(d *caddyfile.Dispenser, dst *float64) error {
	opt := d.Val()
	if !d.NextArg() {
		return d.ArgErr()
	}
	v, err := strconv.ParseFloat(d.Val(), 64)
	if err != nil || math.IsNaN(v) || math.IsInf(v, 0) {
		return d.Errf("%s: not a finite number: %q", opt, d.Val())
	}
	*dst = v
	return nil
}

// Interface guards
var (
	_ caddyfile.Unmarshaler = (*Handler)(nil)
	_ caddyfile.Unmarshaler = (*Policy)(nil)
)
