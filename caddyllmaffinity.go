// Package caddyllmaffinity plugs the llm_affinity router into Caddy. It has no code of its
// own: it exists so that the module path itself is an importable package, which is what
// xcaddy imports for `--with github.com/llmaffinity/caddy-llm-affinity` (and for the plugin
// entry in xcaddy.json). It registers http.handlers.llm_affinity and
// http.reverse_proxy.selection_policies.llm_affinity (package caddyllm), with the Caddyfile
// directive llm_affinity and lb_policy llm_affinity.
//
// It does not register kvsim, the simulated engine used by the quickstart and the tests: a
// production build has no use for it. A build that wants it imports its Caddy module,
// github.com/llmaffinity/caddy-llm-affinity/kvsim/caddykvsim, as cmd/caddy does (with xcaddy,
// one more --with for that package path).
package caddyllmaffinity

import (
	_ "github.com/llmaffinity/caddy-llm-affinity/caddyllm"
)
