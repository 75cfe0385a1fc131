package caddyllm

import (
	"testing"
	"time"

	"github.com/llmaffinity/caddy-llm-affinity/router"
)

// TestDynamicUpstreamsTakeTheLoadedFigure: an upstream no config names (a
// dynamic one) takes the kv_capacity of the running sites with dynamic
// upstreams, as a named one takes its sites' figures: once a reload's
// site runs, and again once the replaced site is removed (a figure the
// reload lowered), in the index and for a request still deciding under
// the replaced config (configuredKVOf).
func TestDynamicUpstreamsTakeTheLoadedFigure(t *testing.T) {
	sh := newShared()
	t.Cleanup(func() { sh.Destruct() })
	const dial = "dynamic:1"
	now := time.Now()
	opts := router.Options{}.WithDefaults()
	ms := []router.Member{{Dial: dial, Available: true, Healthy: true, Hardware: router.Hardware{KVCapacityTokens: 131_072}}}
	hashes := make([]uint64, 8)
	for i := range hashes {
		hashes[i] = uint64(i + 1)
	}
	d := sh.fleet.Decide(now, router.Request{Hashes: hashes, BlockTokens: 64, PromptTokens: 512, MaxTokens: 1, Model: "m"}, ms, &opts, newLockedRand(), nil)
	if d.Charge == nil {
		t.Fatal("not routed")
	}
	sh.fleet.Release(d.Charge, now)
	check := func(when string, tokens int) {
		t.Helper()
		for _, u := range sh.fleet.Snapshot(time.Now()) {
			if u.Dial == dial {
				if u.KVCapacityTokens != tokens || u.IndexCapacityBlocks != tokens/64 {
					t.Fatalf("%s: index sized for %d tokens, %d blocks; want %d, %d", when, u.KVCapacityTokens, u.IndexCapacityBlocks, tokens, tokens/64)
				}
				return
			}
		}
		t.Fatalf("%s: %s unknown", when, dial)
	}
	check("routed", 131_072)

	old := sh.addSite(&site{drainDeadline: time.Minute, dynamic: true, defaultKV: 131_072}, nil)
	sh.startSites(old)
	// A reload lowers it: the new site runs, then the old one goes.
	reloaded := sh.addSite(&site{drainDeadline: time.Minute, dynamic: true, defaultKV: 8192}, nil)
	sh.startSites(reloaded)
	check("both sites running", 131_072)
	sh.removeSite(old)
	check("the replaced site removed", 8192)
	if kv, named := sh.configuredKVOf(dial); kv != 8192 || !named {
		t.Fatalf("a request under the replaced config takes %d (named %v), want 8192", kv, named)
	}
	if n := sh.pendingSites.Load(); n != 0 {
		t.Fatalf("%d sites pending", n)
	}
}
