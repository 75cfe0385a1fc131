package httprun

import (
	"context"
	"encoding/json"
	"slices"
	"testing"

	"github.com/llmaffinity/caddy-llm-affinity/caddyllm"
	"github.com/llmaffinity/caddy-llm-affinity/llmbench"
	"github.com/llmaffinity/caddy-llm-affinity/scorer"
)

// replayHTTP replays w under policy and checks that every request completed.
func replayHTTP(t *testing.T, r *Runner, w *llmbench.Workload, policy string) llmbench.Summary {
	t.Helper()
	res, err := r.Replay(context.Background(), w, policy)
	if err != nil {
		t.Fatalf("%s: %v", policy, err)
	}
	s := llmbench.Summarize(res)
	if s.Completed != len(w.Requests) || s.Shed != 0 || s.Errors != 0 {
		for _, q := range res.Requests {
			if q.Err != "" {
				t.Logf("request %d: %s", q.Index, q.Err)
				break
			}
		}
		t.Fatalf("%s: %d completed, %d shed, %d errors of %d", policy, s.Completed, s.Shed, s.Errors, len(w.Requests))
	}
	sent := 0
	var queries uint64
	for _, rep := range res.Replicas {
		sent += rep.Requests
		queries += rep.PrefixQueries
	}
	if sent != len(w.Requests) || queries == 0 {
		t.Errorf("%s: replicas saw %d of %d requests, %d prefix queries", policy, sent, len(w.Requests), queries)
	}
	for _, q := range res.Requests {
		if q.Replica < 0 || q.TTFT <= 0 || q.E2E < q.TTFT || q.OutputTokens != w.Requests[q.Index].OutputTokens {
			t.Fatalf("%s: implausible request %+v", policy, q)
		}
	}
	if policy == "header" {
		// Caddy's header policy hashes the X-Session-Id the client sets:
		// every key stays on one replica (without the header it would
		// pick at random).
		where := map[string]int{}
		for _, q := range res.Requests {
			key := llmbench.HeaderKey(&w.Requests[q.Index])
			if prev, ok := where[key]; ok && prev != q.Replica {
				t.Fatalf("header split key %s over replicas %d and %d", key, prev, q.Replica)
			}
			where[key] = q.Replica
		}
	}
	return s
}

func TestHTTPAffinityBeatsRoundRobinOnGSP(t *testing.T) {
	if testing.Short() {
		t.Skip("starts Caddy and kvsim servers")
	}
	w, err := llmbench.Generate("gsp", llmbench.GeneratorOptions{Seed: 1, Rate: 40, GSP: llmbench.GSPParams{
		Groups: 5, PromptsPerGroup: 8, SystemTokens: 1024, QuestionTokens: 64, OutputTokens: 16,
	}})
	if err != nil {
		t.Fatal(err)
	}
	var calls, last int
	settings := &llmbench.Sim{Config: llmbench.Config{Replicas: 2, Seed: 1, Progress: func(done, total int) {
		calls++
		last = done
		if total != len(w.Requests) {
			t.Errorf("progress total %d", total)
		}
	}}}
	r, err := New(settings, 4)
	if err != nil {
		t.Fatal(err)
	}
	ttft := replayHTTP(t, r, w, "llm_affinity/ttft")
	if calls != len(w.Requests) || last != len(w.Requests) {
		t.Errorf("progress called %d times, last done %d, want %d", calls, last, len(w.Requests))
	}
	rr := replayHTTP(t, r, w, "round_robin")
	t.Logf("hit rate: llm_affinity/ttft %.3f, round_robin %.3f; TTFT p50 %.3fs, %.3fs",
		ttft.HitRate, rr.HitRate, ttft.TTFTP50, rr.TTFTP50)
	if ttft.HitRate < rr.HitRate {
		t.Errorf("llm_affinity/ttft hit rate %.3f is below round_robin's %.3f", ttft.HitRate, rr.HitRate)
	}
}

// TestHTTPAdaptersAndHeader runs a LoRA workload, whose adapter names are renamed per pass,
// under the plugin and under Caddy's header policy (session header set by the client).
func TestHTTPAdaptersAndHeader(t *testing.T) {
	if testing.Short() {
		t.Skip("starts Caddy and kvsim servers")
	}
	w, err := llmbench.Generate("lora", llmbench.GeneratorOptions{Seed: 3, Rate: 30, LoRA: llmbench.LoRAParams{
		Adapters: 4, Requests: 24, SystemTokens: 256, QuestionTokens: 64, OutputTokens: 8, ZipfExponent: 1,
	}})
	if err != nil {
		t.Fatal(err)
	}
	r, err := New(&llmbench.Sim{Config: llmbench.Config{Replicas: 2, Seed: 1}}, 4)
	if err != nil {
		t.Fatal(err)
	}
	replayHTTP(t, r, w, "llm_affinity/llmd")
	replayHTTP(t, r, w, "header")
}

func TestNewRejectsBadSettings(t *testing.T) {
	for _, tc := range []struct {
		settings  *llmbench.Sim
		timeScale float64
	}{
		{nil, 1},
		{&llmbench.Sim{Config: llmbench.Config{Replicas: 1}}, -1},
		{&llmbench.Sim{Config: llmbench.Config{Replicas: 0}}, 1},
		{&llmbench.Sim{Config: llmbench.Config{Replicas: 1}, OutputEstimate: "guess"}, 1},
	} {
		if _, err := New(tc.settings, tc.timeScale); err == nil {
			t.Errorf("New(%+v, %v) accepted", tc.settings, tc.timeScale)
		}
	}
}

// TestEveryScorerSettingReachesThePlugin: each decision setting llmbench
// takes reaches the plugin's policy in http mode, as it reaches the
// simulator's (--eviction-weight was silently dropped).
func TestEveryScorerSettingReachesThePlugin(t *testing.T) {
	o := scorer.Options{
		TieSeconds: 0.004, KVMarginTokens: 7, ImposedDelayWeight: 0.2, DecodeWeight: 0.3, EvictionWeight: -1,
		SGLang: scorer.SGLangOptions{CacheThreshold: 0.3, BalanceAbsThreshold: 64, BalanceRelThreshold: 1.5},
		LLMD:   scorer.LLMDOptions{PrefixWeight: 3, QueueWeight: 2, KVWeight: 1},
		Dynamo: scorer.DynamoOptions{OverlapWeight: 2},
	}
	p := &pass{r: &Runner{settings: llmbench.Sim{Scorer: o, DecodeTokensPerSecond: 1000}}, policy: "llm_affinity/ttft", timeScale: 1}
	raw, err := json.Marshal(p.selectionPolicy())
	if err != nil {
		t.Fatal(err)
	}
	// Caddy takes the module's name ("policy") out before it decodes the
	// rest, strictly, into the module.
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(raw, &fields); err != nil {
		t.Fatal(err)
	}
	if string(fields["policy"]) != `"llm_affinity"` {
		t.Fatalf("the selection policy names %s", fields["policy"])
	}
	delete(fields, "policy")
	if raw, err = json.Marshal(fields); err != nil {
		t.Fatal(err)
	}
	var got caddyllm.Policy
	if err := json.Unmarshal(raw, &got); err != nil {
		t.Fatal(err)
	}
	want := caddyllm.Policy{
		TieSeconds: o.TieSeconds, KVMarginTokens: o.KVMarginTokens, ImposedDelayWeight: o.ImposedDelayWeight,
		DecodeWeight: o.DecodeWeight, EvictionWeight: o.EvictionWeight,
		SGLangCacheThreshold: 0.3, SGLangBalanceAbs: 64, SGLangBalanceRel: 1.5,
		LLMDWeights: []float64{3, 2, 1}, DynamoOverlapWeight: 2,
	}
	if got.TieSeconds != want.TieSeconds || got.KVMarginTokens != want.KVMarginTokens || got.ImposedDelayWeight != want.ImposedDelayWeight ||
		got.DecodeWeight != want.DecodeWeight || got.EvictionWeight != want.EvictionWeight ||
		got.SGLangCacheThreshold != want.SGLangCacheThreshold || got.SGLangBalanceAbs != want.SGLangBalanceAbs ||
		got.SGLangBalanceRel != want.SGLangBalanceRel || !slices.Equal(got.LLMDWeights, want.LLMDWeights) ||
		got.DynamoOverlapWeight != want.DynamoOverlapWeight {
		t.Fatalf("the plugin's policy %s", raw)
	}
}
