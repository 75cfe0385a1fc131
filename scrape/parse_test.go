package scrape

import (
	"bytes"
	"errors"
	"math"
	"slices"
	"strings"
	"testing"
	"time"
)

// parseFile parses a testdata exposition, failing the test on error.
func parseFile(t *testing.T, name string) Signals {
	t.Helper()
	now := time.Unix(1_700_000_000, 0)
	sig, err := parseEngineMetrics(bytes.NewReader(readTestdata(t, name)), now)
	if err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	if !sig.ScrapedAt.Equal(now) {
		t.Fatalf("%s: ScrapedAt %v, want %v", name, sig.ScrapedAt, now)
	}
	return sig
}

func TestParseVLLM(t *testing.T) {
	sig := parseFile(t, "vllm.prom")
	if sig.Engine != engineVLLM || sig.Running != 7 || sig.Waiting != 3 {
		t.Fatalf("engine %q running %d waiting %d", sig.Engine, sig.Running, sig.Waiting)
	}
	if !sig.KVKnown || !near(sig.KVUsage, 0.42) {
		t.Fatalf("kv usage %v known %v", sig.KVUsage, sig.KVKnown)
	}
	if sig.BlockSize != 16 || sig.NumGPUBlocks != 27153 || sig.KVCapacityTokens() != 16*27153 {
		t.Fatalf("block size %d blocks %d capacity %d", sig.BlockSize, sig.NumGPUBlocks, sig.KVCapacityTokens())
	}
	if got, want := sig.FreeKVTokens(), int(math.Floor(0.58*16*27153)); got != want {
		t.Fatalf("free kv %d, want %d", got, want)
	}
	if sig.PrefixQueries != 123456 || sig.PrefixHits != 98765 || sig.PrefixHitRate != -1 {
		t.Fatalf("prefix queries %v hits %v rate %v", sig.PrefixQueries, sig.PrefixHits, sig.PrefixHitRate)
	}
	// Three lora_requests_info series: the one with the newest timestamp
	// wins, although it is not listed last.
	if !sig.AdaptersKnown || sig.MaxLoRAs != 4 ||
		!slices.Equal(sig.RunningAdapters, []string{"sql-lora", "chat-lora"}) ||
		!slices.Equal(sig.WaitingAdapters, []string{"tool-lora"}) {
		t.Fatalf("lora: known %v max %d running %q waiting %q", sig.AdaptersKnown, sig.MaxLoRAs, sig.RunningAdapters, sig.WaitingAdapters)
	}
	if sig.Models != nil || sig.ModelIDs() != nil {
		t.Fatalf("models should be unknown after a metrics parse: %v", sig.Models)
	}
}

func TestParseVLLMDataParallel(t *testing.T) {
	sig := parseFile(t, "vllm_dp2.prom")
	if sig.Running != 14 || sig.Waiting != 4 {
		t.Fatalf("running %d waiting %d, want the sums 14 and 4", sig.Running, sig.Waiting)
	}
	// Both engines' cache_config_info say num_gpu_blocks="4000", the API
	// server's total: 4,000 blocks in all, not 8,000.
	if sig.BlockSize != 16 || sig.NumGPUBlocks != 4000 {
		t.Fatalf("block size %d blocks %d, want 16 and 4000 (2000 an engine)", sig.BlockSize, sig.NumGPUBlocks)
	}
	if !near(sig.KVUsage, 0.4) || sig.FreeKVTokens() != int(math.Floor(0.6*16*4000)) {
		t.Fatalf("kv usage %v free %d, want the mean 0.4 of equal engines", sig.KVUsage, sig.FreeKVTokens())
	}
	if sig.PrefixQueries != 4000 || sig.PrefixHits != 2000 {
		t.Fatalf("prefix queries %v hits %v", sig.PrefixQueries, sig.PrefixHits)
	}
	if sig.AdaptersKnown || sig.MaxLoRAs != 0 || sig.RunningAdapters != nil {
		t.Fatalf("no lora_requests_info, yet adapters %v %d %v", sig.AdaptersKnown, sig.MaxLoRAs, sig.RunningAdapters)
	}
}

// TestParseVLLMGroupAwareCapacity: from vLLM 0.24 cache_config_info's
// kv_cache_size_tokens is each engine's capacity, read in preference to
// num_gpu_blocks × block_size, which for a hybrid model is not the
// capacity (and num_gpu_blocks is the engines' sum).
func TestParseVLLMGroupAwareCapacity(t *testing.T) {
	sig := parseFile(t, "vllm_hybrid_dp2.prom")
	if got, want := sig.KVCapacityTokens(), 2*524288; got != want {
		t.Fatalf("capacity %d tokens (%d×%d), want kv_cache_size_tokens × 2 engines = %d", got, sig.BlockSize, sig.NumGPUBlocks, want)
	}
	if sig.BlockSize != 4 || !near(sig.KVUsage, 0.375) || sig.FreeKVTokens() != 655360 {
		t.Fatalf("block size %d usage %v free %d", sig.BlockSize, sig.KVUsage, sig.FreeKVTokens())
	}
}

func TestParseVLLMLegacy(t *testing.T) {
	sig := parseFile(t, "vllm_legacy.prom")
	if !sig.KVKnown || !near(sig.KVUsage, 0.75) {
		t.Fatalf("legacy gpu_cache_usage_perc not read: %v %v", sig.KVUsage, sig.KVKnown)
	}
	// num_gpu_blocks="None": capacity unknown, so free KV is unknown.
	if sig.BlockSize != 0 || sig.NumGPUBlocks != 0 || sig.KVCapacityTokens() != 0 || sig.FreeKVTokens() != -1 {
		t.Fatalf("capacity %d×%d free %d, want unknown", sig.BlockSize, sig.NumGPUBlocks, sig.FreeKVTokens())
	}
	if sig.PrefixQueries != -1 || sig.PrefixHits != -1 {
		t.Fatalf("missing counters should be -1, got %v %v", sig.PrefixQueries, sig.PrefixHits)
	}
}

func TestParseVLLM08(t *testing.T) {
	sig := parseFile(t, "vllm_0_8.prom")
	if sig.Engine != engineVLLM || sig.PrefixQueries != 3000 || sig.PrefixHits != 1200 || !near(sig.KVUsage, 0.25) {
		t.Fatalf("vLLM 0.8's gpu_prefix_cache counters not read: %+v", sig)
	}
}

func TestParseSGLang(t *testing.T) {
	sig := parseFile(t, "sglang.prom")
	if sig.Engine != engineSGLang {
		t.Fatalf("engine %q", sig.Engine)
	}
	// dp_rank 0 is reported by TP ranks 0 and 1 with the same figures:
	// counted once.
	if sig.Running != 16 || sig.Waiting != 3 {
		t.Fatalf("running %d waiting %d, want 10+6 and 2+1", sig.Running, sig.Waiting)
	}
	if sig.BlockSize != 1 || sig.KVCapacityTokens() != 200_000 {
		t.Fatalf("block size %d capacity %d, want 1 and 2×100000", sig.BlockSize, sig.KVCapacityTokens())
	}
	if !sig.KVKnown || !near(sig.KVUsage, 0.25) || sig.FreeKVTokens() != 150_000 {
		t.Fatalf("kv usage %v free %d", sig.KVUsage, sig.FreeKVTokens())
	}
	if !near(sig.PrefixHitRate, 0.375) || sig.PrefixQueries != -1 {
		t.Fatalf("hit rate %v queries %v", sig.PrefixHitRate, sig.PrefixQueries)
	}
	if sig.MaxLoRAs != 8 || sig.AdaptersKnown {
		t.Fatalf("max loras %d adapters known %v", sig.MaxLoRAs, sig.AdaptersKnown)
	}
}

func TestParseSGLangPages(t *testing.T) {
	sig := parseFile(t, "sglang_pages.prom")
	if sig.KVCapacityTokens() != 65536 || !near(sig.KVUsage, 0.5) || sig.Running != 3 || sig.Waiting != 0 {
		t.Fatalf("%+v", sig)
	}
	// Without max_total_num_tokens, cache_config_info's pages give it.
	var kept []string
	for _, line := range strings.Split(string(readTestdata(t, "sglang_pages.prom")), "\n") {
		if !strings.Contains(line, "sglang:max_total_num_tokens") {
			kept = append(kept, line)
		}
	}
	sig, err := parseEngineMetrics(strings.NewReader(strings.Join(kept, "\n")), time.Now())
	if err != nil || sig.BlockSize != 32 || sig.NumGPUBlocks != 2048 || !near(sig.KVUsage, 0.5) {
		t.Fatalf("pages alone: %+v, %v", sig, err)
	}
}

// TestParseSGLangDataParallelPages: cache_config_info has no rank label,
// so with data parallelism its pages are one rank's pool; the ranks'
// max_total_num_tokens are summed instead.
func TestParseSGLangDataParallelPages(t *testing.T) {
	sig := parseFile(t, "sglang_dp2_pages.prom")
	if sig.KVCapacityTokens() != 2*65536 || !near(sig.KVUsage, 0.375) || sig.Running != 6 || sig.Waiting != 1 {
		t.Fatalf("capacity %d (%d×%d) usage %v running %d waiting %d, want 131072 tokens over the two ranks",
			sig.KVCapacityTokens(), sig.BlockSize, sig.NumGPUBlocks, sig.KVUsage, sig.Running, sig.Waiting)
	}
}

// TestParseSGLangCurrent: current SGLang writes each queue count's total
// under priority="" next to its per-priority breakdown; the counts are the
// totals, not their sum with the breakdown, and the capacity is
// max_total_num_tokens where cache_config_info is gone.
func TestParseSGLangCurrent(t *testing.T) {
	sig := parseFile(t, "sglang_current.prom")
	if sig.Engine != engineSGLang || sig.Running != 5 || sig.Waiting != 4 {
		t.Fatalf("engine %q running %d waiting %d, want sglang 5 and 4", sig.Engine, sig.Running, sig.Waiting)
	}
	if sig.KVCapacityTokens() != 409600 || !near(sig.KVUsage, 0.25) || !near(sig.PrefixHitRate, 0.6) {
		t.Fatalf("capacity %d usage %v hit rate %v", sig.KVCapacityTokens(), sig.KVUsage, sig.PrefixHitRate)
	}
}

func TestParseLoRANewestWins(t *testing.T) {
	const head = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{engine=\"0\",model_name=\"m\"} 1\n" +
		"# TYPE vllm:lora_requests_info gauge\n"
	for name, tc := range map[string]struct {
		series           string
		running, waiting []string
		max              int
	}{
		"newest first": {
			series: `vllm:lora_requests_info{max_lora="2",running_lora_adapters="b",waiting_lora_adapters="c,d"} 300.5` + "\n" +
				`vllm:lora_requests_info{max_lora="2",running_lora_adapters="a",waiting_lora_adapters=""} 300.25` + "\n",
			running: []string{"b"}, waiting: []string{"c", "d"}, max: 2,
		},
		"newest last, idle": {
			series: `vllm:lora_requests_info{max_lora="8",running_lora_adapters="a",waiting_lora_adapters=""} 10` + "\n" +
				`vllm:lora_requests_info{max_lora="8",running_lora_adapters="",waiting_lora_adapters=""} 20` + "\n",
			running: []string{}, waiting: []string{}, max: 8,
		},
		"stray commas and spaces": {
			series:  `vllm:lora_requests_info{max_lora="4",running_lora_adapters="a, b,,",waiting_lora_adapters=","} 1` + "\n",
			running: []string{"a", "b"}, waiting: []string{}, max: 4,
		},
	} {
		t.Run(name, func(t *testing.T) {
			sig, err := parseEngineMetrics(strings.NewReader(head+tc.series), time.Now())
			if err != nil {
				t.Fatal(err)
			}
			if !sig.AdaptersKnown || sig.MaxLoRAs != tc.max || !slices.Equal(sig.RunningAdapters, tc.running) ||
				!slices.Equal(sig.WaitingAdapters, tc.waiting) {
				t.Fatalf("max %d running %q waiting %q", sig.MaxLoRAs, sig.RunningAdapters, sig.WaitingAdapters)
			}
		})
	}
}

func TestParseMalformed(t *testing.T) {
	for name, text := range map[string]string{
		"empty":             "",
		"no engine metrics": "# TYPE up gauge\nup 1\n",
		"garbage":           "this is not an exposition\n",
		"unclosed labels":   "vllm:num_requests_running{engine=\"0\" 1\n",
		"bad value":         "vllm:num_requests_waiting{engine=\"0\"} many\n",
		"binary":            "\x00\x01\x02\xff\xfe{{{}}}\n",
		"truncated":         "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{engine=\"0\",model_na",
		"two values":        "vllm:num_requests_waiting{engine=\"0\"} 1 2 3\n",
		"json":              `{"object":"list","data":[]}`,
	} {
		t.Run(name, func(t *testing.T) {
			sig, err := parseEngineMetrics(strings.NewReader(text), time.Now())
			if err == nil {
				t.Fatalf("no error; got %+v", sig)
			}
			if name == "empty" || name == "no engine metrics" {
				if !errors.Is(err, errNoEngineMetrics) {
					t.Fatalf("err %v, want errNoEngineMetrics", err)
				}
			}
		})
	}
	// Comments are not read, so a family's declared type does not matter:
	// the families read are gauges and counters, both plain values.
	sig, err := parseEngineMetrics(strings.NewReader(
		"# TYPE vllm:num_requests_waiting histogram\n# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 4\n"), time.Now())
	if err != nil || sig.Waiting != 4 {
		t.Fatalf("declared types: %+v, %v", sig, err)
	}
	// Values that parse but are not finite are ignored, not trusted.
	sig, err = parseEngineMetrics(strings.NewReader(
		"vllm:num_requests_waiting{engine=\"0\"} NaN\nvllm:kv_cache_usage_perc{engine=\"0\"} +Inf\nvllm:num_requests_running 2\n"), time.Now())
	if err != nil || sig.Waiting != -1 || sig.KVKnown || sig.Running != 2 {
		t.Fatalf("non-finite values: %+v, %v", sig, err)
	}
}

func FuzzParseEngineMetrics(f *testing.F) {
	for _, name := range []string{"vllm.prom", "vllm_dp2.prom", "vllm_hybrid_dp2.prom", "vllm_legacy.prom", "sglang.prom", "sglang_pages.prom", "sglang_current.prom", "sglang_dp2_pages.prom"} {
		f.Add(readTestdata(f, name))
	}
	f.Add([]byte("vllm:num_requests_running{engine=\"0\"} -5\nvllm:kv_cache_usage_perc 7\n"))
	f.Add([]byte("vllm:num_requests_running 1\nprocess_start_time_seconds 1.7e+09 1700000000000\nprocess_start_time_seconds{a=\"b\"} -1\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		sig, err := parseEngineMetrics(bytes.NewReader(data), time.Now())
		if err != nil {
			return
		}
		if sig.Engine != engineVLLM && sig.Engine != engineSGLang {
			t.Fatalf("engine %q", sig.Engine)
		}
		if sig.KVUsage < 0 || sig.KVUsage > 1 || sig.FreeKVTokens() < -1 {
			t.Fatalf("kv usage %v free %d", sig.KVUsage, sig.FreeKVTokens())
		}
		if !(sig.ProcessStart >= 0) || math.IsInf(sig.ProcessStart, 0) {
			t.Fatalf("process start %v", sig.ProcessStart)
		}
	})
}

func TestParseModels(t *testing.T) {
	models, err := parseModels(strings.NewReader(`{"object":"list","data":[
		{"id":"base","object":"model","root":"base","parent":null,"max_model_len":8192},
		{"id":"sql-lora","object":"model","root":"/adapters/sql","parent":"base"}]}`))
	if err != nil {
		t.Fatal(err)
	}
	want := []ModelInfo{{ID: "base", Root: "base", MaxModelLen: 8192}, {ID: "sql-lora", Parent: "base", Root: "/adapters/sql"}}
	if !slices.EqualFunc(models, want, func(a, b ModelInfo) bool {
		return a.ID == b.ID && a.Parent == b.Parent && a.Root == b.Root && a.MaxModelLen == b.MaxModelLen
	}) {
		t.Fatalf("models %+v", models)
	}
	// The entry as the engine sent it, for the gateway's own list.
	if !strings.Contains(string(models[0].Card), `"max_model_len":8192`) || !strings.HasPrefix(string(models[1].Card), `{"id":"sql-lora"`) {
		t.Fatalf("cards %s, %s", models[0].Card, models[1].Card)
	}
	// An adapter is listed without a context length: its base model's.
	if got := ContextTokens(models, "sql-lora"); got != 8192 {
		t.Fatalf("the adapter's context: %d", got)
	}
	if _, err := parseModels(strings.NewReader("not json")); err == nil {
		t.Fatal("bad json parsed")
	}
	if models, err := parseModels(strings.NewReader(`{}`)); err != nil || models == nil || len(models) != 0 {
		t.Fatalf("empty list: %v %v", models, err)
	}
}

func TestParseKvsimExposition(t *testing.T) {
	sig, err := parseEngineMetrics(bytes.NewReader(kvsimExposition(t)), time.Now())
	if err != nil {
		t.Fatal(err)
	}
	if sig.Engine != engineVLLM || sig.KVCapacityTokens() != 8192*16 || sig.MaxLoRAs != 4 || sig.PrefixQueries <= 0 {
		t.Fatalf("%+v", sig)
	}
}

// TestEngineTables checks what the extraction assumes of the tables.
func TestEngineTables(t *testing.T) {
	owner := map[string]string{}
	for _, e := range engines {
		capacityAt, usageAt := -1, -1
		for i, m := range e.metrics {
			// engineLine keeps only lines with an engine's prefix.
			if !strings.HasPrefix(m.family, e.prefix) {
				t.Errorf("%s: %s lacks the prefix %q", e.name, m.family, e.prefix)
			}
			if o, ok := owner[m.family]; ok {
				t.Errorf("%s is read by %s and %s", m.family, o, e.name)
			}
			owner[m.family] = e.name
			switch {
			case m.into == kvCapacity && capacityAt < 0:
				capacityAt = i
			case m.into == kvUsage && usageAt < 0:
				usageAt = i
			}
			if m.by == byRankTokens && m.into != kvCapacity {
				t.Errorf("%s: %s feeds figure %d by rank tokens", e.name, m.family, m.into)
			}
		}
		// The KV usage is weighed by the capacity read before it.
		if usageAt >= 0 && capacityAt > usageAt {
			t.Errorf("%s: KV usage (row %d) before capacity (row %d)", e.name, usageAt, capacityAt)
		}
		if engineNamed(e.name) != e {
			t.Errorf("engineNamed(%q)", e.name)
		}
	}
}
