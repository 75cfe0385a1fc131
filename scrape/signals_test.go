package scrape

import (
	"math"
	"strings"
	"testing"
	"time"
)

func TestSignalsCorrections(t *testing.T) {
	sig := Signals{Waiting: 2, KVKnown: true, KVUsage: 0.5, BlockSize: 16, NumGPUBlocks: 100}
	got := sig.PlusRouted(3, 400)
	if got.Waiting != 5 || !near(got.KVUsage, 0.75) || got.FreeKVTokens() != 400 {
		t.Fatalf("plusRouted: waiting %d usage %v free %d", got.Waiting, got.KVUsage, got.FreeKVTokens())
	}
	if full := sig.PlusRouted(0, 10_000); full.KVUsage != 1 || full.FreeKVTokens() != 0 {
		t.Fatalf("over capacity: usage %v free %d", full.KVUsage, full.FreeKVTokens())
	}
	unknown := Signals{Waiting: -1}
	if u := unknown.PlusRouted(3, 100); u.Waiting != -1 || u.KVKnown || u.FreeKVTokens() != -1 {
		t.Fatalf("unknown stays unknown: %+v", u)
	}
}

func TestSignalsChargeMark(t *testing.T) {
	old := Mark{Requests: 10, KVTokens: 5000}
	if r, kv := (Mark{Requests: 13, KVTokens: 6500}).Since(old); r != 3 || kv != 1500 {
		t.Fatalf("since: %d %d", r, kv)
	}
	// Counters that went backwards (a fresh fleet after a restart) give
	// no correction rather than a negative one.
	if r, kv := (Mark{Requests: 2, KVTokens: 100}).Since(old); r != 0 || kv != 0 {
		t.Fatalf("backwards: %d %d", r, kv)
	}
}

func TestScrapeHitRate(t *testing.T) {
	prev := Signals{PrefixQueries: 100, PrefixHits: 40, PrefixHitRate: 0.4}
	for _, tc := range []struct {
		q, h, want float64
	}{
		{300, 190, 0.75}, // 150 of 200 new tokens hit
		{100, 40, 0.4},   // nothing new: keep the previous rate
		{50, 10, -1},     // counters reset: unknown
		{-1, -1, -1},     // not reported
	} {
		if got := hitRateSince(prev, Signals{PrefixQueries: tc.q, PrefixHits: tc.h}); !near(got, tc.want) {
			t.Errorf("queries %v hits %v: rate %v, want %v", tc.q, tc.h, got, tc.want)
		}
	}
}

// TestExtremeSamplesStayUsable: finite samples that add up to nothing
// usable (a capacity-weighted mean of 1e306 and -1e306 is NaN) leave the
// figure unknown, and absurd counts are bounded.
func TestExtremeSamplesStayUsable(t *testing.T) {
	in := "vllm:cache_config_info{engine=\"0\",block_size=\"16\",num_gpu_blocks=\"1000\"} 1\n" +
		"vllm:cache_config_info{engine=\"1\",block_size=\"16\",num_gpu_blocks=\"1000\"} 1\n" +
		"vllm:kv_cache_usage_perc{engine=\"0\"} 1e306\nvllm:kv_cache_usage_perc{engine=\"1\"} -1e306\n" +
		"vllm:num_requests_running{engine=\"0\"} 1e300\nvllm:num_requests_waiting{engine=\"0\"} -5\n"
	sig, err := parseEngineMetrics(strings.NewReader(in), time.Now())
	if err != nil {
		t.Fatal(err)
	}
	if math.IsNaN(sig.KVUsage) || sig.KVKnown {
		t.Errorf("KV usage %v known %v, want unknown", sig.KVUsage, sig.KVKnown)
	}
	if sig.Running != maxCount || sig.Waiting != 0 {
		t.Errorf("running %d waiting %d, want %d and 0", sig.Running, sig.Waiting, maxCount)
	}
}
