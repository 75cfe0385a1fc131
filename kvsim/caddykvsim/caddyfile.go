package caddykvsim

import (
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/llmaffinity/caddy-llm-affinity/kvsim"
)

func init() {
	httpcaddyfile.RegisterHandlerDirective("kvsim", parseCaddyfile)
	// kvsim answers requests itself, like respond; ordering it before respond keeps it
	// after the request-shaping directives and usable at site level.
	httpcaddyfile.RegisterDirectiveOrder("kvsim", httpcaddyfile.Before, "respond")
}

func parseCaddyfile(h httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
	handler := new(Handler)
	err := handler.UnmarshalCaddyfile(h.Dispenser)
	return handler, err
}

// UnmarshalCaddyfile sets up the handler from Caddyfile tokens. Syntax:
//
//	kvsim [<name>] {
//	    name                   <name>
//	    speed                  <factor>
//	    model                  <model>
//	    max_model_len          <tokens>
//	    block_size             <tokens>
//	    num_gpu_blocks         <blocks>
//	    max_num_seqs           <sequences>
//	    max_num_batched_tokens <tokens>
//	    bytes_per_token        <bytes>
//	    default_output_tokens  <tokens>
//	    disable_prefix_caching
//	    step_overhead          <duration>
//	    per_prefill_token      <duration>
//	    per_decode_sequence    <duration>
//	    per_context_token      <duration>
//	    max_loras              <slots>
//	    max_cpu_loras          <adapters>
//	    lora_host_load         <duration>
//	    lora_storage_load      <duration>
//	    adapters               <name...>
//	    fault_unhealthy
//	    fault_error_rate       <probability>
//	    fault_stall
//	    fault_cut_after_tokens <tokens>
//	}
//
// The optional argument is the replica name. name and speed set the handler's fields of the
// same names. The engine options, model to adapters, set the kvsim.Config fields of the same
// JSON names, which document their meaning and defaults; adapters may be repeated, and
// appends. The fault_ options set the kvsim.Faults fields named after the prefix. The
// directive may appear once per route.
func (h *Handler) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // consume directive name
	if d.NextArg() {
		h.Name = d.Val()
	}
	if d.NextArg() {
		return d.ArgErr()
	}
	faults := new(kvsim.Faults)
	if h.Faults != nil {
		*faults = *h.Faults
	}
	options := map[string]any{"name": &h.Name, "speed": &h.Speed}
	for _, o := range h.Config.Options() {
		options[o.Name] = o.Field
	}
	for _, o := range faults.Options() {
		options[faultPrefix+o.Name] = o.Field
	}
	for d.NextBlock(0) {
		option := d.Val()
		field, ok := options[option]
		if !ok {
			return d.Errf("unrecognized kvsim option %q", option)
		}
		if err := parseOption(d, field); err != nil {
			return err
		}
		// Any fault option makes the handler set the faults at start, even to zero.
		if strings.HasPrefix(option, faultPrefix) {
			h.Faults = faults
		}
	}
	return nil
}

// faultPrefix prefixes the Caddyfile options that set kvsim.Faults fields.
const faultPrefix = "fault_"

// parseOption parses the arguments of the option under d's cursor into field: none for a
// *bool, which the option turns on; one or more for a *[]string, which they extend; exactly
// one for the other types. Integers must not be negative, and durations use Caddy's syntax.
func parseOption(d *caddyfile.Dispenser, field any) error {
	option := d.Val()
	switch p := field.(type) {
	case *bool:
		if d.NextArg() {
			return d.ArgErr()
		}
		*p = true
		return nil
	case *[]string:
		args := d.RemainingArgs()
		if len(args) == 0 {
			return d.ArgErr()
		}
		*p = append(*p, args...)
		return nil
	}
	var v string
	if !d.AllArgs(&v) {
		return d.ArgErr()
	}
	switch p := field.(type) {
	case *string:
		*p = v
	case *int:
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 {
			return d.Errf("bad %s %q: want a non-negative integer", option, v)
		}
		*p = n
	case *float64:
		f, err := strconv.ParseFloat(v, 64)
		if err != nil || math.IsNaN(f) || math.IsInf(f, 0) {
			return d.Errf("bad %s %q: want a finite number", option, v)
		}
		*p = f
	case *time.Duration:
		dur, err := caddy.ParseDuration(v)
		if err != nil {
			return d.Errf("bad %s %q: %v", option, v, err)
		}
		*p = dur
	default:
		return d.Errf("kvsim option %s has unsupported type %T", option, field)
	}
	return nil
}

// Interface guard
var _ caddyfile.Unmarshaler = (*Handler)(nil)
