// Package caddyllmaffinity plugs the llm_affinity router and the kvsim simulated engine into
// Caddy. It has no code of its own: it exists so that the module path itself is an importable
// package, which is what xcaddy imports for `--with github.com/llmaffinity/caddy-llm-affinity`
// (and for the plugin entry in xcaddy.json). It registers
//
//   - http.handlers.llm_affinity and http.reverse_proxy.selection_policies.llm_affinity
//     (package caddyllm), with the Caddyfile directive llm_affinity and lb_policy llm_affinity;
//   - http.handlers.kvsim (package kvsim/caddykvsim), the simulated vLLM engine used by the
//     quickstart, with the Caddyfile directive kvsim.
package caddyllmaffinity

import (
	_ "github.com/llmaffinity/caddy-llm-affinity/caddyllm"
	_ "github.com/llmaffinity/caddy-llm-affinity/kvsim/caddykvsim"
)
