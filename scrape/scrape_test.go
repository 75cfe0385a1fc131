package scrape

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/llmaffinity/caddy-llm-affinity/kvsim"
)

// readTestdata returns a file of testdata/.
func readTestdata(t testing.TB, name string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", name))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

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

func near(a, b float64) bool { return math.Abs(a-b) < 1e-9 }

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
	if sig.BlockSize != 16 || sig.NumGPUBlocks != 4000 {
		t.Fatalf("block size %d blocks %d, want 16 and 1000+3000", sig.BlockSize, sig.NumGPUBlocks)
	}
	// Usage weighted by each engine's capacity: (0.2·1000 + 0.6·3000)/4000.
	if !near(sig.KVUsage, 0.5) {
		t.Fatalf("kv usage %v, want 0.5", sig.KVUsage)
	}
	if sig.PrefixQueries != 4000 || sig.PrefixHits != 2000 {
		t.Fatalf("prefix queries %v hits %v", sig.PrefixQueries, sig.PrefixHits)
	}
	if sig.AdaptersKnown || sig.MaxLoRAs != 0 || sig.RunningAdapters != nil {
		t.Fatalf("no lora_requests_info, yet adapters %v %d %v", sig.AdaptersKnown, sig.MaxLoRAs, sig.RunningAdapters)
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
	if sig.BlockSize != 32 || sig.NumGPUBlocks != 2048 || !near(sig.KVUsage, 0.5) || sig.Running != 3 || sig.Waiting != 0 {
		t.Fatalf("%+v", sig)
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
	for _, name := range []string{"vllm.prom", "vllm_dp2.prom", "vllm_legacy.prom", "sglang.prom", "sglang_pages.prom"} {
		f.Add(readTestdata(f, name))
	}
	f.Add([]byte("vllm:num_requests_running{engine=\"0\"} -5\nvllm:kv_cache_usage_perc 7\n"))
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
	})
}

func TestParseModels(t *testing.T) {
	models, err := parseModels(strings.NewReader(`{"object":"list","data":[
		{"id":"base","object":"model","root":"base","parent":null,"max_model_len":8192},
		{"id":"sql-lora","object":"model","root":"/adapters/sql","parent":"base"}]}`))
	if err != nil {
		t.Fatal(err)
	}
	want := []ModelInfo{{ID: "base", Root: "base"}, {ID: "sql-lora", Parent: "base", Root: "/adapters/sql"}}
	if !slices.Equal(models, want) {
		t.Fatalf("models %+v", models)
	}
	if _, err := parseModels(strings.NewReader("not json")); err == nil {
		t.Fatal("bad json parsed")
	}
	if models, err := parseModels(strings.NewReader(`{}`)); err != nil || models == nil || len(models) != 0 {
		t.Fatalf("empty list: %v %v", models, err)
	}
}

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

func TestScrapeConfigDefaults(t *testing.T) {
	c := Config{Interval: time.Millisecond}.withDefaults()
	if c.Interval != MinInterval || c.Timeout != MinInterval || c.ModelsInterval != defaultModelsInterval ||
		c.MetricsPath != "/metrics" || c.ModelsPath != "/v1/models" || c.Workers != defaultScrapeWorkers {
		t.Fatalf("%+v", c)
	}
	if c := (Config{}).withDefaults(); c.Interval != time.Second || c.Timeout != time.Second {
		t.Fatalf("%+v", c)
	}
}

// hostOf returns the host:port of a test server, the form of a dial.
func hostOf(srv *httptest.Server) string { return srv.Listener.Addr().String() }

// waitFor polls cond until it holds or the deadline passes.
func waitFor(t *testing.T, what string, d time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestScrapeKvsim(t *testing.T) {
	sim, err := kvsim.NewServer(kvsim.ServerConfig{Engine: kvsim.Config{Adapters: []string{"sql-lora"}}, Speed: 50})
	if err != nil {
		t.Fatal(err)
	}
	defer sim.Close()
	srv := httptest.NewServer(sim)
	defer srv.Close()
	dial := hostOf(srv)

	var marks atomic.Uint64
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	s := New(Config{Interval: 100 * time.Millisecond, ModelsInterval: 200 * time.Millisecond, SlowInterval: 300 * time.Millisecond,
		Mark: func(string) Mark { n := marks.Add(1); return Mark{Requests: n, KVTokens: 10 * n} }})
	s.SetTargets([]string{dial, "unix//tmp/not-scraped.sock"})
	s.Start(ctx)

	var sig Signals
	waitFor(t, "signals", 5*time.Second, func() bool {
		var ok bool
		sig, ok = s.Latest(dial, time.Now(), time.Second)
		return ok
	})
	if sig.Engine != engineVLLM || sig.BlockSize != 16 || sig.NumGPUBlocks != 8192 || sig.MaxLoRAs != 4 ||
		!sig.AdaptersKnown || !sig.KVKnown || sig.Running != 0 || sig.Waiting != 0 || sig.Seq < 1 || sig.Mark.Requests < 1 || sig.Mark.KVTokens != 10*sig.Mark.Requests {
		t.Fatalf("signals from kvsim: %+v", sig)
	}
	if !slices.Equal(sig.ModelIDs(), []string{kvsim.DefaultModel, "sql-lora"}) || sig.Models[1].Parent != kvsim.DefaultModel {
		t.Fatalf("models %+v", sig.Models)
	}
	if st, _ := s.StatusOf(dial); st.Scrapes < 1 || st.ConsecutiveErrors != 0 {
		t.Fatalf("status %+v", st)
	}

	// Work on the engine shows up in the next scrapes.
	seq := s.Seq(dial)
	resp, err := http.Post(srv.URL+"/v1/completions", "application/json",
		strings.NewReader(`{"model":"`+kvsim.DefaultModel+`","prompt":"`+strings.Repeat("shared prefix ", 100)+`","max_tokens":2}`))
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	waitFor(t, "prefix queries", 5*time.Second, func() bool {
		sig, _ = s.Latest(dial, time.Now(), time.Second)
		return sig.Seq > seq && sig.PrefixQueries > 0
	})
	if sig.PrefixHitRate < 0 || sig.PrefixHitRate > 1 {
		t.Fatalf("prefix hit rate %v", sig.PrefixHitRate)
	}
	// Scrapes between the slow ones skip cache_config_info and the prefix
	// counters, and carry them over.
	waitFor(t, "a scrape without the slow families", 5*time.Second, func() bool {
		s.mu.RLock()
		t := s.targets[dial]
		s.mu.RUnlock()
		t.mu.Lock()
		defer t.mu.Unlock()
		latest := t.latest.Load()
		return latest != nil && latest.Seq > sig.Seq && latest.ScrapedAt.After(t.slow.ScrapedAt)
	})
	sig, _ = s.Latest(dial, time.Now(), time.Second)
	if sig.BlockSize != 16 || sig.NumGPUBlocks != 8192 || sig.PrefixQueries <= 0 {
		t.Fatalf("slow figures not carried over: block size %d, blocks %d, prefix queries %v", sig.BlockSize, sig.NumGPUBlocks, sig.PrefixQueries)
	}
	kept, dropped := keepEngineLines([]byte("# TYPE up gauge\nup 1\nvllm:cache_config_info{block_size=\"16\"} 1\nvllm:num_requests_running 3\n"), true)
	if string(kept) != "vllm:num_requests_running 3\n" || dropped != 2 {
		t.Fatalf("kept %q, dropped %d lines when skipping slow families", kept, dropped)
	}

	// The server goes away: the signals age and become stale, promptly.
	srv.CloseClientConnections()
	srv.Close()
	stoppedAt := time.Now()
	waitFor(t, "stale signals", 5*time.Second, func() bool {
		_, ok := s.Latest(dial, time.Now(), 300*time.Millisecond)
		return !ok
	})
	if waited := time.Since(stoppedAt); waited > 2*time.Second {
		t.Fatalf("signals stayed fresh %v after the server stopped", waited)
	}
	waitFor(t, "recorded errors", 5*time.Second, func() bool {
		st, _ := s.StatusOf(dial)
		return st.Errors > 0 && st.ConsecutiveErrors > 0 && st.LastError != ""
	})
	if _, ok := s.Latest("unix//tmp/not-scraped.sock", time.Now(), time.Hour); ok {
		t.Fatal("a unix socket dial has signals")
	}
	if len(s.Statuses()) != 1 {
		t.Fatalf("statuses %+v", s.Statuses())
	}

	cancel()
	select {
	case <-s.Stopped():
	case <-time.After(5 * time.Second):
		t.Fatal("scraper did not stop with its context")
	}
}

func TestScrapeFailuresDoNotBlock(t *testing.T) {
	release := make(chan struct{})
	hung := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-release:
		case <-r.Context().Done():
		}
	}))
	defer hung.Close()
	defer close(release)
	broken := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, "nope", http.StatusInternalServerError)
	}))
	defer broken.Close()
	garbage := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, "vllm:num_requests_running{{{\n")
	}))
	defer garbage.Close()
	healthy := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/v1/models" {
			http.NotFound(w, r)
			return
		}
		_, _ = w.Write(readTestdata(t, "vllm.prom"))
	}))
	defer healthy.Close()
	// A port nothing listens on.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	refused := ln.Addr().String()
	ln.Close()

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// One worker: the hung target holds it for a whole timeout each round,
	// and the others must still be served between.
	s := New(Config{Interval: 100 * time.Millisecond, Workers: 1})
	dials := []string{hostOf(hung), hostOf(broken), hostOf(garbage), refused, hostOf(healthy)}
	s.SetTargets(dials)
	s.Start(ctx)

	// Reads never wait for fetches.
	start := time.Now()
	for range 1000 {
		for _, d := range dials[:4] {
			if _, ok := s.Latest(d, time.Now(), 0); ok {
				t.Fatalf("%s has signals", d)
			}
		}
	}
	if el := time.Since(start); el > 100*time.Millisecond {
		t.Fatalf("4000 signals calls took %v", el)
	}

	waitFor(t, "healthy signals", 5*time.Second, func() bool {
		_, ok := s.Latest(hostOf(healthy), time.Now(), 0)
		return ok
	})
	waitFor(t, "errors on every failing target", 5*time.Second, func() bool {
		for _, d := range dials[:4] {
			if st, _ := s.StatusOf(d); st.Errors == 0 {
				return false
			}
		}
		return true
	})
	for _, d := range dials[:4] {
		if _, ok := s.Latest(d, time.Now(), time.Hour); ok {
			t.Fatalf("failing target %s has signals", d)
		}
	}
	// The models fetch failed, the metrics did not: signals without models.
	sig, _ := s.Latest(hostOf(healthy), time.Now(), 0)
	st, _ := s.StatusOf(hostOf(healthy))
	if sig.Models != nil || st.ModelsError == "" || st.ConsecutiveErrors != 0 {
		t.Fatalf("models %v status %+v", sig.Models, st)
	}

	// Stopping does not wait for the hung fetch's timeout to pass... it
	// cancels it.
	cancel()
	select {
	case <-s.Stopped():
	case <-time.After(2 * time.Second):
		t.Fatal("scraper did not stop")
	}
}

func TestScrapeSetTargets(t *testing.T) {
	body := readTestdata(t, "vllm.prom")
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { _, _ = w.Write(body) }))
	defer srv.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// A long interval: the first scrape of a new target must not wait for it.
	s := New(Config{Interval: time.Hour, ModelsInterval: -1})
	s.Start(ctx)
	s.SetTargets([]string{hostOf(srv)})
	waitFor(t, "first scrape of a new target", 2*time.Second, func() bool {
		_, ok := s.Latest(hostOf(srv), time.Now(), 0)
		return ok
	})
	// addTargets leaves existing targets (and their signals) alone.
	s.AddTargets(hostOf(srv), "unix//x.sock", "")
	if _, ok := s.Latest(hostOf(srv), time.Now(), 0); !ok || len(s.Statuses()) != 1 {
		t.Fatalf("addTargets disturbed the targets: %+v", s.Statuses())
	}
	s.SetTargets(nil)
	if _, ok := s.Latest(hostOf(srv), time.Now(), 0); ok {
		t.Fatal("a dropped target still has signals")
	}
	if s.Seq(hostOf(srv)) != 0 {
		t.Fatal("a dropped target still has a sequence")
	}
	// A dial added from a pool is scraped at once too.
	s.AddTargets(hostOf(srv))
	waitFor(t, "first scrape of an added target", 2*time.Second, func() bool {
		_, ok := s.Latest(hostOf(srv), time.Now(), 0)
		return ok
	})
	var nilScraper *Scraper
	if _, ok := nilScraper.Latest("x", time.Now(), 0); ok || nilScraper.Statuses() != nil {
		t.Fatal("nil scraper")
	}
}

func TestScrapeRejectsOversizedBody(t *testing.T) {
	c := &capReader{r: strings.NewReader("abcdef"), left: 3}
	if _, err := io.ReadAll(c); !errors.Is(err, errExpositionTooLarge) {
		t.Fatalf("err %v", err)
	}
	c = &capReader{r: strings.NewReader("abc"), left: 3}
	if b, err := io.ReadAll(c); err != nil || string(b) != "abc" {
		t.Fatalf("exactly at the limit: %q %v", b, err)
	}
}

// startKvsim starts a kvsim replica with an adapter and sends it some
// traffic, so its histograms have series too. It returns the replica's
// base URL.
func startKvsim(tb testing.TB) string {
	tb.Helper()
	sim, err := kvsim.NewServer(kvsim.ServerConfig{Engine: kvsim.Config{Adapters: []string{"sql-lora"}}, Speed: 100})
	if err != nil {
		tb.Fatal(err)
	}
	srv := httptest.NewServer(sim)
	tb.Cleanup(func() { srv.Close(); sim.Close() })
	for i := range 3 {
		resp, err := http.Post(srv.URL+"/v1/completions", "application/json",
			strings.NewReader(`{"model":"`+kvsim.DefaultModel+`","prompt":"request `+string(rune('a'+i))+`","max_tokens":2}`))
		if err != nil {
			tb.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	return srv.URL
}

// kvsimExposition returns what a kvsim replica serves on /metrics after
// some traffic.
func kvsimExposition(tb testing.TB) []byte {
	tb.Helper()
	return getBody(tb, startKvsim(tb)+"/metrics")
}

// getBody GETs url and returns the body of a 200 response.
func getBody(tb testing.TB, url string) []byte {
	tb.Helper()
	resp, err := http.Get(url)
	if err != nil {
		tb.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		tb.Fatal(err)
	}
	if resp.StatusCode != http.StatusOK {
		tb.Fatalf("GET %s: %s: %s", url, resp.Status, b)
	}
	return b
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

func BenchmarkParseEngineMetrics(b *testing.B) {
	body := kvsimExposition(b)
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	cpu0 := cpuTime(b)
	for b.Loop() {
		if _, err := parseEngineMetrics(bytes.NewReader(body), time.Now()); err != nil {
			b.Fatal(err)
		}
	}
	// CPU time per parse is steadier than wall time on a busy machine.
	b.ReportMetric(float64((cpuTime(b)-cpu0).Nanoseconds())/float64(b.N), "cpu-ns/op")
}

// cpuTime returns the process's user plus system CPU time.
func cpuTime(tb testing.TB) time.Duration {
	user, sys := cpuTimes(tb)
	return user + sys
}

// cpuTimes returns the process's user and system CPU time.
func cpuTimes(tb testing.TB) (user, sys time.Duration) {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		tb.Skip("getrusage:", err)
	}
	return time.Duration(ru.Utime.Nano()), time.Duration(ru.Stime.Nano())
}

// helperEnvCount, in the environment of the upstreams helper process,
// is the number of replicas it starts.
const helperEnvCount = "CADDYLLM_SCRAPE_HELPER_COUNT"

// TestScrapeHelperUpstreams is not a test: run by BenchmarkScrape64 in a
// child process, it starts $CADDYLLM_SCRAPE_HELPER_COUNT listeners that
// serve what one kvsim replica answers to each path and query (fetched
// once, then replayed), prints "ADDR host:port" for each, and exits when
// its stdin closes. Serving from another process keeps the upstreams'
// CPU out of the benchmark's measurement; replaying keeps it small, as
// it would be on a machine of their own.
func TestScrapeHelperUpstreams(t *testing.T) {
	count := os.Getenv(helperEnvCount)
	if count == "" {
		t.Skip("helper process for BenchmarkScrape64")
	}
	n, err := strconv.Atoi(count)
	if err != nil {
		t.Fatal(err)
	}
	replica := startKvsim(t)
	var mu sync.Mutex
	answers := map[string][]byte{}
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		body, ok := answers[r.URL.RequestURI()]
		if !ok {
			body = getBody(t, replica+r.URL.RequestURI())
			answers[r.URL.RequestURI()] = body
		}
		mu.Unlock()
		if r.URL.Path == defaultMetricsPath {
			w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
		}
		_, _ = w.Write(body)
	})
	for range n {
		srv := httptest.NewServer(handler)
		defer srv.Close()
		fmt.Println("ADDR", hostOf(srv))
	}
	_, _ = io.Copy(io.Discard, os.Stdin)
}

// startUpstreams starts n replayed kvsim replicas in a child process and
// returns their dial addresses.
func startUpstreams(b *testing.B, n int) []string {
	b.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestScrapeHelperUpstreams$", "-test.count=1")
	cmd.Env = append(os.Environ(), helperEnvCount+"="+strconv.Itoa(n))
	stdin, err := cmd.StdinPipe()
	if err != nil {
		b.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		b.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		_ = stdin.Close() // the helper exits when its stdin closes
		done := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
	})
	var dials []string
	sc := bufio.NewScanner(stdout)
	for len(dials) < n && sc.Scan() {
		if addr, ok := strings.CutPrefix(sc.Text(), "ADDR "); ok {
			dials = append(dials, addr)
		}
	}
	if len(dials) != n {
		b.Fatalf("helper started %d of %d upstreams: %v", len(dials), n, sc.Err())
	}
	go func() { _, _ = io.Copy(io.Discard, stdout) }()
	return dials
}

// BenchmarkScrape64 measures the CPU the scraper costs the router: 64
// upstreams answering as kvsim does (from a child process, so their CPU
// is not counted), scraped for 3 s every 100 ms (10× the default
// rate) and, for comparison, every second (the default). Reported as a
// percentage of one core, of which system time, and CPU per scrape; and
// every 100 ms again with the whole exposition asked for. Run with
// -benchtime=1x.
func BenchmarkScrape64(b *testing.B) {
	const upstreams = 64
	dials := startUpstreams(b, upstreams)
	whole := getBody(b, "http://"+dials[0]+defaultMetricsPath)
	asked := getBody(b, "http://"+dials[0]+metricsQuery{modeNamedBelow, true}.path(defaultMetricsPath))
	for _, interval := range []time.Duration{100 * time.Millisecond, time.Second} {
		b.Run("every_"+interval.String(), func(b *testing.B) {
			benchmarkScrape(b, dials, interval, 3*time.Second, false)
			b.ReportMetric(float64(len(whole)), "exposition_bytes")
			b.ReportMetric(float64(len(asked)), "scraped_bytes")
		})
	}
	// Engines that ignore the name[] query send their whole exposition.
	b.Run("every_100ms_whole_exposition", func(b *testing.B) {
		benchmarkScrape(b, dials, 100*time.Millisecond, 3*time.Second, true)
		b.ReportMetric(float64(len(whole)), "scraped_bytes")
	})
}

// benchmarkScrape scrapes dials every interval for window, b.N times,
// and reports the CPU it took.
// With whole, it asks for the whole exposition, as from engines that
// ignore the name[] query.
func benchmarkScrape(b *testing.B, dials []string, interval, window time.Duration, whole bool) {
	var pct, sysPct, perScrape, rate, failures float64
	for range b.N {
		ctx, cancel := context.WithCancel(context.Background())
		s := New(Config{Interval: interval})
		s.SetTargets(dials)
		if whole {
			for _, t := range s.targets {
				t.mode, t.probeDue = modeWhole, time.Now().Add(time.Hour) // and no re-probe
			}
		}
		s.Start(ctx)
		// Warm up: connections open, every target scraped once.
		deadline := time.Now().Add(5 * time.Second)
		for time.Now().Before(deadline) && slices.ContainsFunc(dials, func(d string) bool { return s.Seq(d) == 0 }) {
			time.Sleep(5 * time.Millisecond)
		}
		seq0 := scrapeTotal(s, dials)
		user0, sys0 := cpuTimes(b)
		wall0 := time.Now()
		time.Sleep(window)
		user1, sys1 := cpuTimes(b)
		wall := time.Since(wall0)
		scrapes := scrapeTotal(s, dials) - seq0
		cancel()
		<-s.Stopped()
		// A timeout now and then on a busy machine is fine; mostly
		// failing scrapes would make the figure meaningless.
		for _, st := range s.Statuses() {
			failures += float64(st.Errors)
			if st.Errors > st.Scrapes/10 {
				b.Fatalf("%s: %d scrape errors in %d, last %s", st.Dial, st.Errors, st.Scrapes, st.LastError)
			}
		}
		if whole {
			for _, t := range s.targets {
				if t.mode != modeWhole {
					b.Fatalf("%s left the whole exposition for mode %d", t.dial, t.mode)
				}
			}
		}
		cpu, sys := (user1-user0)+(sys1-sys0), sys1-sys0
		pct += 100 * cpu.Seconds() / wall.Seconds()
		sysPct += 100 * sys.Seconds() / wall.Seconds()
		perScrape += float64(cpu.Microseconds()) / float64(max(1, scrapes))
		rate += float64(scrapes) / wall.Seconds()
	}
	n := float64(b.N)
	b.ReportMetric(pct/n, "%core")
	b.ReportMetric(sysPct/n, "%core-sys")
	b.ReportMetric(perScrape/n, "cpu-µs/scrape")
	b.ReportMetric(rate/n, "scrapes/s")
	b.ReportMetric(failures/n, "failed_scrapes")
}

// scrapeTotal sums the successful scrapes of dials.
func scrapeTotal(s *Scraper, dials []string) uint64 {
	var n uint64
	for _, d := range dials {
		n += s.Seq(d)
	}
	return n
}

// modeTestExposition is what the servers of the mode tests expose: one
// foreign family and two engine ones.
const modeTestExposition = "# TYPE up gauge\nup 1\n" +
	"vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 2\n" +
	"vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"100\",engine=\"0\"} 1\n"

// filteredExposition answers a name[] query on modeTestExposition as the
// Prometheus client does: only the series named.
func filteredExposition(q url.Values) string {
	var b strings.Builder
	for _, line := range strings.SplitAfter(modeTestExposition, "\n") {
		if name, _, _ := strings.Cut(line, "{"); name != "" && slices.Contains(q["name[]"], name) {
			b.WriteString(line)
		}
	}
	return b.String()
}

// scrapeServer serves handler and scrapes it with cfg until the test
// ends.
func scrapeServer(t *testing.T, handler http.Handler, cfg Config) (s *Scraper, dial string) {
	t.Helper()
	srv := httptest.NewServer(handler)
	t.Cleanup(srv.Close)
	ctx, cancel := context.WithCancel(context.Background())
	s = New(cfg)
	dial = hostOf(srv)
	s.SetTargets([]string{dial})
	s.Start(ctx)
	t.Cleanup(func() { cancel(); <-s.Stopped() })
	return s, dial
}

// TestScrapeAsksForEngineFamilies checks how the metrics are asked for,
// against servers that honour a name[] query at /metrics (Go's
// promhttp), only below it (vLLM), nowhere, or answer it with nothing
// (SGLang), and one with no engine metrics at all.
func TestScrapeAsksForEngineFamilies(t *testing.T) {
	type request struct {
		path  string
		names []string
	}
	for _, tc := range []struct {
		name  string
		serve func(w http.ResponseWriter, r *http.Request)
		// wantPath is the path asked from the third scrape on; wantNames
		// whether those requests name families.
		wantPath  string
		wantNames bool
		engine    bool
	}{
		{"honours at /metrics", func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path != "/metrics" {
				http.NotFound(w, r)
				return
			}
			if q := r.URL.Query(); len(q["name[]"]) > 0 {
				_, _ = io.WriteString(w, filteredExposition(q))
				return
			}
			_, _ = io.WriteString(w, modeTestExposition)
		}, "/metrics", true, true},
		{"honours below /metrics, like vLLM", func(w http.ResponseWriter, r *http.Request) {
			if q := r.URL.Query(); r.URL.Path == "/metrics/" && len(q["name[]"]) > 0 {
				_, _ = io.WriteString(w, filteredExposition(q))
				return
			}
			_, _ = io.WriteString(w, modeTestExposition) // /metrics ignores the query
		}, "/metrics/", true, true},
		{"ignores the query", func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path != "/metrics" {
				http.NotFound(w, r)
				return
			}
			_, _ = io.WriteString(w, modeTestExposition)
		}, "/metrics", false, true},
		{"answers the query with nothing, like SGLang", func(w http.ResponseWriter, r *http.Request) {
			if len(r.URL.Query()["name[]"]) > 0 {
				return
			}
			_, _ = io.WriteString(w, modeTestExposition)
		}, "/metrics", false, true},
		{"no engine metrics", func(w http.ResponseWriter, r *http.Request) {
			_, _ = io.WriteString(w, "# TYPE up gauge\nup 1\n")
		}, "/metrics", false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var mu sync.Mutex
			var requests []request
			var conns atomic.Int32
			srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				mu.Lock()
				requests = append(requests, request{r.URL.Path, r.URL.Query()["name[]"]})
				mu.Unlock()
				tc.serve(w, r)
			}))
			srv.Config.ConnState = func(_ net.Conn, state http.ConnState) {
				if state == http.StateNew {
					conns.Add(1)
				}
			}
			srv.Start()
			defer srv.Close()
			dial := hostOf(srv)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			s := New(Config{Interval: 100 * time.Millisecond, SlowInterval: 350 * time.Millisecond, ModelsInterval: -1})
			s.SetTargets([]string{dial})
			s.Start(ctx)
			waitFor(t, "six scrapes", 5*time.Second, func() bool {
				st, _ := s.StatusOf(dial)
				return st.Scrapes+st.Errors >= 6
			})
			cancel()
			<-s.Stopped()
			st, _ := s.StatusOf(dial)
			sig, ok := s.Latest(dial, time.Now(), time.Hour)
			if tc.engine && (!ok || sig.Waiting != 2 || sig.NumGPUBlocks != 100 || sig.BlockSize != 16 || st.Errors != 0) {
				t.Fatalf("signals %+v, status %+v", sig, st)
			}
			if !tc.engine && (ok || st.Scrapes != 0) {
				t.Fatalf("signals %+v from a server without engine metrics", sig)
			}
			mu.Lock()
			defer mu.Unlock()
			// The first two scrapes settle the mode, with at most one
			// extra request each; every later scrape is one request, on
			// the same connection.
			scrapes := int(st.Scrapes + st.Errors)
			if len(requests) > scrapes+2 {
				t.Fatalf("%d requests for %d scrapes: %v", len(requests), scrapes, requests)
			}
			if n := conns.Load(); n != 1 {
				t.Fatalf("%d connections for %d scrapes", n, scrapes)
			}
			later := requests[len(requests)-(scrapes-2):]
			full := 0
			for i, r := range later {
				if r.path != tc.wantPath || (len(r.names) > 0) != tc.wantNames {
					t.Fatalf("later request %d: %s %v, want %s named=%v (all: %v)", i, r.path, r.names, tc.wantPath, tc.wantNames, requests)
				}
				if !tc.wantNames {
					continue
				}
				if !slices.Contains(r.names, vllmWaiting) || !slices.Contains(r.names, sglangRunning) || !slices.Contains(r.names, vllmLoRAInfo) {
					t.Fatalf("request %d asks for %v", i, r.names)
				}
				if slices.Contains(r.names, vllmCacheConfig) {
					full++
					if !slices.Contains(r.names, vllmPrefixQueries) {
						t.Fatalf("request %d reads the configuration without the prefix counters: %v", i, r.names)
					}
				} else if slices.Contains(r.names, vllmPrefixQueries) || slices.Contains(r.names, sglangHitRate) {
					t.Fatalf("request %d asks for some slow families: %v", i, r.names)
				}
			}
			if tc.wantNames && full == len(later) {
				t.Fatalf("every later request read the slow families: %v", later)
			}
		})
	}
}

// TestScrapeEngineSwapCarriesNothing: when another engine starts
// answering on a dial, nothing read from the old one (capacity, prefix
// counters, hit rate) is carried into the new one's signals.
func TestScrapeEngineSwapCarriesNothing(t *testing.T) {
	vllm, sglang := readTestdata(t, "vllm.prom"), readTestdata(t, "sglang.prom")
	var swapped atomic.Bool
	// A long slow interval: after the first scrape every one skips the
	// slow families, as long as the engine stays the same.
	s, dial := scrapeServer(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if swapped.Load() {
			_, _ = w.Write(sglang)
			return
		}
		_, _ = w.Write(vllm)
	}), Config{Interval: 100 * time.Millisecond, SlowInterval: time.Hour, ModelsInterval: -1})
	var sig Signals
	waitFor(t, "two vLLM scrapes", 5*time.Second, func() bool {
		var ok bool
		sig, ok = s.Latest(dial, time.Now(), time.Hour)
		return ok && sig.Seq >= 2
	})
	vllmCapacity := sig.KVCapacityTokens()
	if sig.Engine != engineVLLM || vllmCapacity <= 0 || sig.PrefixQueries <= 0 {
		t.Fatalf("vLLM signals %+v", sig)
	}
	swapped.Store(true)
	seq := sig.Seq
	var seen []Signals
	waitFor(t, "SGLang's hit rate", 5*time.Second, func() bool {
		sig, _ = s.Latest(dial, time.Now(), time.Hour)
		if sig.Seq > seq && sig.Engine == engineSGLang {
			seen = append(seen, sig)
		}
		return sig.Engine == engineSGLang && sig.PrefixHitRate >= 0
	})
	for _, sg := range seen {
		if sg.KVCapacityTokens() != 200_000 || sg.BlockSize != 1 || sg.PrefixQueries != -1 || sg.PrefixHits != -1 {
			t.Fatalf("SGLang signals with vLLM's figures: %+v", sg)
		}
		if sg.PrefixHitRate != -1 && (sg.PrefixHitRate < 0.37 || sg.PrefixHitRate > 0.38) {
			t.Fatalf("SGLang hit rate %v, want the mean of 0.5 and 0.25", sg.PrefixHitRate)
		}
	}
}

// TestScrapeModeChanges: how the way metrics are asked for follows the
// engine's answers, and does not follow failures that say nothing about
// the query.
func TestScrapeModeChanges(t *testing.T) {
	var phase atomic.Int32 // advanced by each case's script
	for _, tc := range []struct {
		name string
		// serve answers in the current phase.
		serve func(w http.ResponseWriter, r *http.Request, phase int32)
		// phases are how long each phase lasts.
		phases []time.Duration
		// want is the mode at the end.
		want metricsMode
	}{
		{"a 503 below /metrics changes nothing", func(w http.ResponseWriter, r *http.Request, phase int32) {
			switch {
			case phase == 1:
				http.Error(w, "busy", http.StatusServiceUnavailable)
			case r.URL.Path == "/metrics/":
				_, _ = io.WriteString(w, filteredExposition(r.URL.Query()))
			default:
				_, _ = io.WriteString(w, modeTestExposition)
			}
		}, []time.Duration{500 * time.Millisecond, 300 * time.Millisecond, 500 * time.Millisecond}, modeNamedBelow},
		{"a redirect from /metrics asks below", func(w http.ResponseWriter, r *http.Request, _ int32) {
			if r.URL.Path == "/metrics" {
				http.Redirect(w, r, "/metrics/?"+r.URL.RawQuery, http.StatusTemporaryRedirect)
				return
			}
			_, _ = io.WriteString(w, filteredExposition(r.URL.Query()))
		}, []time.Duration{time.Second}, modeNamedBelow},
		{"early hints are skipped", func(w http.ResponseWriter, r *http.Request, _ int32) {
			w.Header().Set("Link", "</style.css>; rel=preload")
			w.WriteHeader(http.StatusEarlyHints)
			_, _ = io.WriteString(w, filteredExposition(r.URL.Query()))
		}, []time.Duration{time.Second}, modeNamed},
		{"an engine that learns to filter is asked for less again", func(w http.ResponseWriter, r *http.Request, phase int32) {
			if q := r.URL.Query(); len(q["name[]"]) > 0 {
				if phase == 1 {
					_, _ = io.WriteString(w, filteredExposition(q))
				}
				return // phase 0: an empty answer, as SGLang gives
			}
			_, _ = io.WriteString(w, modeTestExposition)
		}, []time.Duration{500 * time.Millisecond, 1500 * time.Millisecond}, modeNamed},
	} {
		t.Run(tc.name, func(t *testing.T) {
			phase.Store(0)
			s, dial := scrapeServer(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				tc.serve(w, r, phase.Load())
			}), Config{Interval: 100 * time.Millisecond, SlowInterval: 100 * time.Millisecond, ModelsInterval: -1})
			for i, d := range tc.phases {
				phase.Store(int32(i))
				time.Sleep(d)
			}
			s.mu.RLock()
			target := s.targets[dial]
			s.mu.RUnlock()
			target.mu.Lock()
			mode := target.mode
			target.mu.Unlock()
			sig, ok := s.Latest(dial, time.Now(), 300*time.Millisecond)
			if mode != tc.want || !ok || sig.Waiting != 2 {
				st, _ := s.StatusOf(dial)
				t.Fatalf("mode %d (want %d), fresh signals %v %+v, status %+v", mode, tc.want, ok, sig, st)
			}
		})
	}
}

// TestScrapeKeepsRankWeights: data parallel ranks of unequal capacity
// weigh KV usage by capacity on the scrapes that skip cache_config_info
// too, not only on the ones that read it.
func TestScrapeKeepsRankWeights(t *testing.T) {
	body := readTestdata(t, "vllm_dp2.prom") // ranks of 1,000 and 3,000 blocks at 20% and 60%
	s, dial := scrapeServer(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { _, _ = w.Write(body) }),
		Config{Interval: 100 * time.Millisecond, SlowInterval: time.Hour, ModelsInterval: -1})
	for seq := uint64(1); seq <= 3; seq++ {
		var sig Signals
		waitFor(t, fmt.Sprint("scrape ", seq), 5*time.Second, func() bool {
			sig, _ = s.Latest(dial, time.Now(), time.Hour)
			return sig.Seq >= seq
		})
		if math.Abs(sig.KVUsage-0.5) > 1e-9 || sig.NumGPUBlocks != 4000 {
			t.Fatalf("scrape %d: KV usage %v over %d blocks, want 0.5 over 4000", sig.Seq, sig.KVUsage, sig.NumGPUBlocks)
		}
	}
}
