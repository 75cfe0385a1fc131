package caddykvsim

import (
	"strconv"

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
//	    model                  <model>
//	    speed                  <factor>
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
// The optional argument is the replica name. The directive may appear once per route.
func (h *Handler) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // consume directive name
	if d.NextArg() {
		h.Name = d.Val()
	}
	if d.NextArg() {
		return d.ArgErr()
	}
	faults := func() *kvsim.Faults {
		if h.Faults == nil {
			h.Faults = new(kvsim.Faults)
		}
		return h.Faults
	}
	for d.NextBlock(0) {
		option := d.Val()
		switch option {
		case "name", "model":
			var v string
			if !d.AllArgs(&v) {
				return d.ArgErr()
			}
			if option == "name" {
				h.Name = v
			} else {
				h.Model = v
			}
		case "speed", "fault_error_rate":
			var v string
			if !d.AllArgs(&v) {
				return d.ArgErr()
			}
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				return d.Errf("bad %s %q: %v", option, v, err)
			}
			if option == "speed" {
				h.Speed = f
			} else {
				faults().ErrorRate = f
			}
		case "max_model_len", "block_size", "num_gpu_blocks", "max_num_seqs", "max_num_batched_tokens",
			"bytes_per_token", "default_output_tokens", "max_loras", "max_cpu_loras", "fault_cut_after_tokens":
			var v string
			if !d.AllArgs(&v) {
				return d.ArgErr()
			}
			n, err := strconv.Atoi(v)
			if err != nil || n < 0 {
				return d.Errf("bad %s %q: want a non-negative integer", option, v)
			}
			*map[string]*int{
				"max_model_len":          &h.MaxModelLen,
				"block_size":             &h.BlockSize,
				"num_gpu_blocks":         &h.NumGPUBlocks,
				"max_num_seqs":           &h.MaxNumSeqs,
				"max_num_batched_tokens": &h.MaxNumBatchedTokens,
				"bytes_per_token":        &h.BytesPerToken,
				"default_output_tokens":  &h.DefaultOutputTokens,
				"max_loras":              &h.MaxLoRAs,
				"max_cpu_loras":          &h.MaxCPULoRAs,
				"fault_cut_after_tokens": &faults().CutAfterTokens,
			}[option] = n
		case "step_overhead", "per_prefill_token", "per_decode_sequence", "per_context_token",
			"lora_host_load", "lora_storage_load":
			var v string
			if !d.AllArgs(&v) {
				return d.ArgErr()
			}
			dur, err := caddy.ParseDuration(v)
			if err != nil {
				return d.Errf("bad %s %q: %v", option, v, err)
			}
			*map[string]*caddy.Duration{
				"step_overhead":       &h.StepOverhead,
				"per_prefill_token":   &h.PerPrefillToken,
				"per_decode_sequence": &h.PerDecodeSequence,
				"per_context_token":   &h.PerContextToken,
				"lora_host_load":      &h.LoRAHostLoad,
				"lora_storage_load":   &h.LoRAStorageLoad,
			}[option] = caddy.Duration(dur)
		case "adapters":
			args := d.RemainingArgs()
			if len(args) == 0 {
				return d.ArgErr()
			}
			h.Adapters = append(h.Adapters, args...)
		case "disable_prefix_caching", "fault_unhealthy", "fault_stall":
			if d.NextArg() {
				return d.ArgErr()
			}
			switch option {
			case "disable_prefix_caching":
				h.DisablePrefixCaching = true
			case "fault_unhealthy":
				faults().Unhealthy = true
			default:
				faults().Stall = true
			}
		default:
			return d.Errf("unrecognized kvsim option %q", option)
		}
	}
	return nil
}

// Interface guard
var _ caddyfile.Unmarshaler = (*Handler)(nil)
