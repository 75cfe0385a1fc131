package main

import (
	"testing"

	"github.com/caddyserver/caddy/v2"
)

// TestModulesRegistered checks that this binary has what the quickstart's Caddyfile uses:
// the router from the module root and kvsim, which the root package no longer registers.
func TestModulesRegistered(t *testing.T) {
	for _, id := range []string{
		"http.handlers.llm_affinity",
		"http.reverse_proxy.selection_policies.llm_affinity",
		"http.handlers.kvsim",
	} {
		if _, err := caddy.GetModule(id); err != nil {
			t.Errorf("module %s: %v", id, err)
		}
	}
}
