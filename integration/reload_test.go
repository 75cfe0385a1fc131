package integration

import (
	"fmt"
	"testing"

	"github.com/llmaffinity/caddy-llm-affinity/kvsim"
)

// TestReloadShowsNewCapacityAtOnce: a reload that changes kv_capacity
// shows in the admin view, the capacity and the index's size, as soon as
// the reload returns (it showed the old ones until the next decision, or,
// lowered, for a minute), up and down.
func TestReloadShowsNewCapacityAtOnce(t *testing.T) {
	fleet := startFleet(t, 1, 20, kvsim.Config{})
	dial := fleet[0].dial()
	config := func(kv int) string { return caddyfile(fleet, "", fmt.Sprintf("kv_capacity %d", kv), "") }
	tester := startCaddy(t, config(65536))
	// A routed request gives the index its block size.
	if c := post(t, "/v1/completions", map[string]any{"model": kvsim.DefaultModel, "prompt": text("sized", 2000), "max_tokens": 2}); c.status != 200 {
		t.Fatalf("%d %s", c.status, c.body)
	}
	u := upstream(t, dial)
	if u.KVCapacityTokens != 65536 || u.IndexCapacity == 0 {
		t.Fatalf("before the reloads: kv_capacity_tokens %d, index_capacity_blocks %d", u.KVCapacityTokens, u.IndexCapacity)
	}
	blockTokens := 65536 / u.IndexCapacity
	for _, kv := range []int{131072, 32768} {
		reload(t, tester, config(kv))
		if u := upstream(t, dial); u.KVCapacityTokens != kv || u.IndexCapacity != kv/blockTokens {
			t.Errorf("right after the reload to kv_capacity %d: kv_capacity_tokens %d, index_capacity_blocks %d (want %d)",
				kv, u.KVCapacityTokens, u.IndexCapacity, kv/blockTokens)
		}
	}
}
