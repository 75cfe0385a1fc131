package scrape

import (
	"bytes"
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/llmaffinity/caddy-llm-affinity/kvsim"
)

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
	waitFor(t, "signals", 10*time.Second, func() bool {
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
	waitFor(t, "prefix queries", 10*time.Second, func() bool {
		sig, _ = s.Latest(dial, time.Now(), time.Second)
		return sig.Seq > seq && sig.PrefixQueries > 0
	})
	if sig.PrefixHitRate < 0 || sig.PrefixHitRate > 1 {
		t.Fatalf("prefix hit rate %v", sig.PrefixHitRate)
	}
	// Scrapes between the slow ones skip cache_config_info and the prefix
	// counters, and carry them over.
	waitFor(t, "a scrape without the slow families", 10*time.Second, func() bool {
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
	kept, dropped, started := keepEngineLines([]byte("# TYPE up gauge\nup 1\nvllm:cache_config_info{block_size=\"16\"} 1\n"+
		"process_start_time_seconds 1.7e+09\nprocess_start_time_seconds_other 5\nvllm:num_requests_running 3\n"), true)
	if string(kept) != "vllm:num_requests_running 3\n" || dropped != 2 || started != 1.7e9 {
		t.Fatalf("kept %q, dropped %d lines when skipping slow families, process start %v", kept, dropped, started)
	}

	// The server goes away: the signals age and become stale, promptly.
	srv.CloseClientConnections()
	srv.Close()
	waitFor(t, "stale signals", 10*time.Second, func() bool {
		_, ok := s.Latest(dial, time.Now(), 300*time.Millisecond)
		return !ok
	})
	waitFor(t, "recorded errors", 10*time.Second, func() bool {
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

	waitFor(t, "healthy signals", 10*time.Second, func() bool {
		_, ok := s.Latest(hostOf(healthy), time.Now(), time.Hour)
		return ok
	})
	waitFor(t, "errors on every failing target", 10*time.Second, func() bool {
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
	// The errors say why, within the length kept; the fetch errors name
	// the URL without its long query.
	for d, why := range map[string]string{hostOf(broken): "status 500", refused: "refused", hostOf(garbage): "parsing"} {
		if st, _ := s.StatusOf(d); !strings.Contains(st.LastError, why) {
			t.Errorf("%s: last error %q, want %q in it", d, st.LastError, why)
		}
	}
	for _, d := range []string{hostOf(hung), hostOf(broken), refused} {
		if st, _ := s.StatusOf(d); !strings.HasPrefix(st.LastError, "GET http://"+d+"/metrics?…: ") {
			t.Errorf("%s: last error %q, want it to name the URL without its query", d, st.LastError)
		}
	}
	// Only the target where nothing listens is down: the others answer,
	// badly or late.
	for _, d := range dials {
		if s.Down(d) != (d == refused) {
			t.Errorf("%s: down %v", d, s.Down(d))
		}
	}
	// The models fetch failed, the metrics did not: signals without models.
	sig, _ := s.Latest(hostOf(healthy), time.Now(), time.Hour)
	st, _ := s.StatusOf(hostOf(healthy))
	if sig.Models != nil || st.ModelsError == "" || st.ConsecutiveErrors != 0 {
		t.Fatalf("models %v status %+v", sig.Models, st)
	}

	cancel()
	select {
	case <-s.Stopped():
	case <-time.After(10 * time.Second):
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
	waitFor(t, "first scrape of a new target", 10*time.Second, func() bool {
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
	waitFor(t, "first scrape of an added target", 10*time.Second, func() bool {
		_, ok := s.Latest(hostOf(srv), time.Now(), 0)
		return ok
	})
	var nilScraper *Scraper
	if _, ok := nilScraper.Latest("x", time.Now(), 0); ok || nilScraper.Statuses() != nil {
		t.Fatal("nil scraper")
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
	waitFor(t, "two vLLM scrapes", 10*time.Second, func() bool {
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
	waitFor(t, "SGLang's hit rate", 10*time.Second, func() bool {
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

// TestScrapeKeepsRankWeights: data parallel ranks of unequal capacity
// weigh KV usage by capacity on the scrapes that skip cache_config_info
// too, not only on the ones that read it.
func TestScrapeKeepsRankWeights(t *testing.T) {
	// Ranks of 1,000 and 3,000 blocks at 20% and 60%: vLLM's engines
	// repeat one figure, so the capacities are given per engine, in
	// kv_cache_size_tokens.
	body := readTestdata(t, "vllm_dp2.prom")
	for i, tokens := range []string{"16000", "48000"} {
		engine := fmt.Sprintf(`engine="%d"}`, i)
		body = bytes.Replace(body, []byte(`num_cpu_blocks="None",kv_sharing_fast_prefill="False",`+engine),
			[]byte(`num_cpu_blocks="None",kv_cache_size_tokens="`+tokens+`",kv_sharing_fast_prefill="False",`+engine), 1)
	}
	s, dial := scrapeServer(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { _, _ = w.Write(body) }),
		Config{Interval: 100 * time.Millisecond, SlowInterval: time.Hour, ModelsInterval: -1})
	for seq := uint64(1); seq <= 3; seq++ {
		var sig Signals
		waitFor(t, fmt.Sprint("scrape ", seq), 10*time.Second, func() bool {
			sig, _ = s.Latest(dial, time.Now(), time.Hour)
			return sig.Seq >= seq
		})
		if math.Abs(sig.KVUsage-0.5) > 1e-9 || sig.NumGPUBlocks != 4000 {
			t.Fatalf("scrape %d: KV usage %v over %d blocks, want 0.5 over 4000", sig.Seq, sig.KVUsage, sig.NumGPUBlocks)
		}
	}
}

// TestScrapePlainPortsOverHTTP: a scraper configured for https (a proxy
// whose transport uses TLS) reaches the ports in PlainPorts over plain
// http, as Caddy's tls_except_ports does, and the rest over https.
func TestScrapePlainPortsOverHTTP(t *testing.T) {
	var dials []string
	for _, newServer := range []func(http.Handler) *httptest.Server{httptest.NewTLSServer, httptest.NewServer} {
		sim, err := kvsim.NewServer(kvsim.ServerConfig{})
		if err != nil {
			t.Fatal(err)
		}
		srv := newServer(sim)
		t.Cleanup(func() { srv.Close(); sim.Close() })
		dials = append(dials, hostOf(srv))
	}
	tlsDial, plainDial := dials[0], dials[1]
	_, plainPort, _ := net.SplitHostPort(plainDial)
	transport := http.DefaultTransport.(*http.Transport).Clone()
	transport.TLSClientConfig = &tls.Config{InsecureSkipVerify: true}
	defer transport.CloseIdleConnections()

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	s := New(Config{Interval: 100 * time.Millisecond, Scheme: "https", PlainPorts: []string{plainPort},
		Client: &http.Client{Transport: transport}})
	s.SetTargets(dials)
	s.Start(ctx)
	for _, dial := range dials {
		waitFor(t, dial+"'s signals", 10*time.Second, func() bool {
			sig, ok := s.Latest(dial, time.Now(), time.Second)
			return ok && sig.NumGPUBlocks == 8192
		})
	}
	if got := s.schemeOf(tlsDial); got != "https" {
		t.Errorf("%s scraped over %s, want https", tlsDial, got)
	}
	if got := s.schemeOf(plainDial); got != "http" {
		t.Errorf("%s (port %s excepted) scraped over %s, want http", plainDial, plainPort, got)
	}
}

// TestOnlyARefusalIsARestart: a connection refused (nothing listening:
// the engine's process is gone) marks a restart when the engine answers
// again; a dial that times out or a name that does not resolve is the
// network's trouble, not the engine's.
func TestOnlyARefusalIsARestart(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closedPort := ln.Addr().String()
	ln.Close()
	var k keptConn
	_, _, err = k.take(context.Background(), closedPort, time.Now().Add(5*time.Second))
	if err == nil || !refused(err) {
		t.Errorf("a closed port: %v, refused %v", err, err != nil && refused(err))
	}
	// Also wrapped without Unwrap, as Caddy's transport wraps its dial
	// errors (engines behind TLS are scraped through it).
	if hidden := (opaqueError{err.Error()}); !refused(hidden) {
		t.Errorf("a refusal wrapped without Unwrap: %v not taken for one", hidden)
	}
	for _, c := range []struct {
		dial     string
		deadline time.Time
	}{
		{closedPort, time.Now().Add(-time.Second)}, // a dial that timed out
		{"no-such-host.invalid:9", time.Now().Add(5 * time.Second)},
	} {
		var k keptConn
		_, _, err := k.take(context.Background(), c.dial, c.deadline)
		if err == nil || refused(err) {
			t.Errorf("%s: %v taken for a refusal", c.dial, err)
		}
	}
}

// opaqueError is an error that hides its cause, as reverseproxy.DialError
// does.
type opaqueError struct{ msg string }

func (e opaqueError) Error() string { return e.msg }

// TestModelsWhileMetricsFail: the model list has a schedule of its own:
// while an engine's /metrics fails, its /v1/models is still fetched, and
// the (stale) signals carry the new list. A list frozen at the last good
// metrics filtered a replaced engine's models, or an adapter loaded
// meanwhile, for good.
func TestModelsWhileMetricsFail(t *testing.T) {
	var failing atomic.Bool
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/v1/models" {
			id := "m1"
			if failing.Load() {
				id = "m2"
			}
			fmt.Fprintf(w, `{"object":"list","data":[{"id":%q,"object":"model"}]}`, id)
			return
		}
		if failing.Load() {
			http.Error(w, "broken", http.StatusInternalServerError)
			return
		}
		_, _ = w.Write(readTestdata(t, "vllm.prom"))
	}))
	defer srv.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	s := New(Config{Interval: 100 * time.Millisecond, ModelsInterval: 100 * time.Millisecond})
	s.SetTargets([]string{hostOf(srv)})
	s.Start(ctx)
	modelsNow := func() string {
		sig, _ := s.Latest(hostOf(srv), time.Now(), time.Hour)
		return strings.Join(sig.ModelIDs(), ",")
	}
	waitFor(t, "m1 listed", 10*time.Second, func() bool { return modelsNow() == "m1" })
	failing.Store(true)
	waitFor(t, "m2 listed while the metrics fail", 10*time.Second, func() bool { return modelsNow() == "m2" })
	sig, _ := s.Latest(hostOf(srv), time.Now(), time.Hour)
	if st, _ := s.StatusOf(hostOf(srv)); st.ConsecutiveErrors == 0 || time.Since(sig.ModelsAt) > 10*time.Second {
		t.Fatalf("status %+v, models fetched at %v", st, sig.ModelsAt)
	}
	// The new list does not make the failing engine's signals fresh.
	waitFor(t, "the signals stale", 10*time.Second, func() bool {
		_, fresh := s.Latest(hostOf(srv), time.Now(), 150*time.Millisecond)
		return !fresh
	})
}

// TestPlaceholderDialIsNoTarget: an upstream address with a placeholder
// ({http.request.header.X-Up}, replaced per request) is not scraped: its
// host is known only per request, and asking the literal one failed at
// every interval.
func TestPlaceholderDialIsNoTarget(t *testing.T) {
	s := New(Config{Interval: time.Hour})
	s.SetTargets([]string{"{http.request.header.X-Up}", "engine:8000", "{http.request.host}:8000"})
	s.AddTargets("{http.vars.upstream}")
	if st := s.Statuses(); len(st) != 1 || st[0].Dial != "engine:8000" {
		t.Fatalf("targets %+v, want engine:8000 alone", st)
	}
}

// TestSecondMarkAfterTheAnswer: a scrape's MarkAfter is taken once the
// answer is read, so a request routed while the engine rendered it falls
// between the two marks.
func TestSecondMarkAfterTheAnswer(t *testing.T) {
	var routed atomic.Uint64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/v1/models" {
			fmt.Fprint(w, `{"object":"list","data":[{"id":"m1","object":"model"}]}`)
			return
		}
		routed.Add(1) // a request routed while this scrape is under way
		_, _ = w.Write(readTestdata(t, "vllm.prom"))
	}))
	defer srv.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	s := New(Config{Interval: 100 * time.Millisecond, Mark: func(string) Mark { return Mark{Requests: routed.Load()} }})
	s.SetTargets([]string{hostOf(srv)})
	s.Start(ctx)
	var sig Signals
	waitFor(t, "signals", 10*time.Second, func() bool {
		var ok bool
		sig, ok = s.Latest(hostOf(srv), time.Now(), time.Hour)
		return ok
	})
	if sig.MarkAfter.Requests != sig.Mark.Requests+1 {
		t.Fatalf("marks %+v and %+v: want the request routed during the scrape between them", sig.Mark, sig.MarkAfter)
	}
}

// TestFailedModelsFetchRetriedSoon: a model list whose fetch failed is
// fetched again a scrape interval later, not a whole models interval
// (an hour here), backing off while it keeps failing.
func TestFailedModelsFetchRetriedSoon(t *testing.T) {
	var listFails atomic.Bool
	var lists, scrapes atomic.Int64
	listFails.Store(true)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/v1/models" {
			lists.Add(1)
			if listFails.Load() {
				http.Error(w, "overloaded", http.StatusServiceUnavailable)
				return
			}
			fmt.Fprint(w, `{"object":"list","data":[{"id":"m1","object":"model"}]}`)
			return
		}
		scrapes.Add(1)
		_, _ = w.Write(readTestdata(t, "vllm.prom"))
	}))
	defer srv.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	s := New(Config{Interval: 100 * time.Millisecond, ModelsInterval: time.Hour})
	s.SetTargets([]string{hostOf(srv)})
	s.Start(ctx)
	// Failing: asked again, but not at every scrape.
	waitFor(t, "20 scrapes", 60*time.Second, func() bool { return scrapes.Load() >= 20 })
	if n, m := lists.Load(), scrapes.Load(); n < 2 || n > m/2 {
		t.Fatalf("%d list fetches over %d scrapes: want retries, backing off", n, m)
	}
	listFails.Store(false)
	waitFor(t, "m1 listed within the backoff", 60*time.Second, func() bool {
		sig, _ := s.Latest(hostOf(srv), time.Now(), time.Hour)
		return strings.Join(sig.ModelIDs(), ",") == "m1"
	})
}

// TestRestartFetchesModels: an engine answering again after refusing
// connections (a new process) has its model list fetched at once, not at
// the next models interval: the new process may serve other adapters.
func TestRestartFetchesModels(t *testing.T) {
	engine := func(model string) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path == "/v1/models" {
				fmt.Fprintf(w, `{"object":"list","data":[{"id":%q,"object":"model"}]}`, model)
				return
			}
			_, _ = w.Write(readTestdata(t, "vllm.prom"))
		})
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	first := &http.Server{Handler: engine("m1")}
	go first.Serve(ln)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	s := New(Config{Interval: 100 * time.Millisecond, ModelsInterval: time.Hour})
	s.SetTargets([]string{addr})
	s.Start(ctx)
	modelsNow := func() string {
		sig, _ := s.Latest(addr, time.Now(), time.Hour)
		return strings.Join(sig.ModelIDs(), ",")
	}
	waitFor(t, "m1 listed", 10*time.Second, func() bool { return modelsNow() == "m1" })
	first.Close()
	waitFor(t, "the engine down", 10*time.Second, func() bool { return s.Down(addr) })
	// Its last signals, however young, are not current: the engine they
	// describe is gone (Latest still gives them, for the admin view).
	if sig, fresh, down := s.Current(addr, time.Now(), time.Hour); fresh || !down || strings.Join(sig.ModelIDs(), ",") != "m1" {
		t.Errorf("engine down: Current fresh %v, down %v, models %v", fresh, down, sig.ModelIDs())
	}
	if _, fresh := s.Latest(addr, time.Now(), time.Hour); !fresh {
		t.Errorf("Latest of an engine down within its max age: not fresh")
	}
	ln, err = net.Listen("tcp", addr)
	if err != nil {
		t.Skipf("the port could not be listened on again: %v", err)
	}
	second := &http.Server{Handler: engine("m2")}
	go second.Serve(ln)
	defer second.Close()
	waitFor(t, "m2 listed after the restart", 10*time.Second, func() bool { return modelsNow() == "m2" })
}

// askModels asks s for the lists of dials fetched since since and waits
// until each was.
func askModels(t *testing.T, s *Scraper, dials []string, since time.Time) {
	t.Helper()
	for {
		fetched := s.ModelsFetched()
		n := s.AskModels(dials, since)
		if n == 0 {
			return
		}
		select {
		case <-fetched:
		case <-time.After(30 * time.Second):
			t.Fatalf("%d lists not fetched", n)
		}
	}
}

// TestAskModels: AskModels has a list fetched again whose last fetch was
// sent before the time given, alone (no metrics scrape), with what the
// engine lists now; callers at once share fetches, and fetches it asks
// for are modelsRefetchSpacing apart at least, however many callers ask.
// A list fetched since then, an engine where nothing listens and one
// whose scrapes fail (a hung engine) are not waited for.
func TestAskModels(t *testing.T) {
	var fetches, scrapes atomic.Int64
	var model atomic.Pointer[string]
	m1 := "m1"
	model.Store(&m1)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/v1/models" {
			fetches.Add(1)
			fmt.Fprintf(w, `{"object":"list","data":[{"id":%q,"object":"model"}]}`, *model.Load())
			return
		}
		scrapes.Add(1)
		_, _ = w.Write(readTestdata(t, "vllm.prom"))
	}))
	defer srv.Close()
	// A hung engine: its metrics fail, and its list, after the first,
	// never comes (until the test ends).
	var failingLists atomic.Int64
	hung := make(chan struct{})
	failing := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/v1/models" && failingLists.Add(1) > 1 {
			<-hung
		}
		http.Error(w, "broken", http.StatusInternalServerError)
	}))
	defer failing.Close()
	defer close(hung)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	down := ln.Addr().String()
	ln.Close() // nothing listens there
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	s := New(Config{Interval: time.Hour, ModelsInterval: time.Hour})
	all := []string{hostOf(srv), hostOf(failing), down}
	s.SetTargets(all)
	s.Start(ctx)
	modelsNow := func() string {
		sig, _ := s.Latest(hostOf(srv), time.Now(), time.Hour)
		return strings.Join(sig.ModelIDs(), ",")
	}
	waitFor(t, "m1 listed, the other engines failing and down", 10*time.Second, func() bool {
		st, _ := s.StatusOf(hostOf(failing))
		return modelsNow() == "m1" && s.Down(down) && st.ConsecutiveErrors > 0
	})

	m2 := "m2"
	model.Store(&m2)
	scrapesBefore := scrapes.Load()
	askModels(t, s, all, time.Now())
	if modelsNow() != "m2" {
		t.Fatalf("after AskModels the list is %q, want m2", modelsNow())
	}
	before := fetches.Load()
	if n := s.AskModels(all, time.Now().Add(-time.Minute)); n != 0 || fetches.Load() != before {
		t.Fatal("a list fetched since the time given is fetched again")
	}

	// Many callers at once, again and again: fetches stay apart.
	start := time.Now()
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for range 5 {
				askModels(t, s, []string{hostOf(srv)}, time.Now())
			}
		})
	}
	wg.Wait()
	n, most := fetches.Load()-before, int64(time.Since(start)/modelsRefetchSpacing)+1
	if n < 5 || n > most {
		t.Fatalf("%d fetches for 8 callers asking 5 times each in %v; want at least 5 (each caller's last one new) and %d at most",
			n, time.Since(start), most)
	}
	if got := scrapes.Load() - scrapesBefore; got != 0 {
		t.Fatalf("asking for lists scraped the metrics %d times", got)
	}
	if failingLists.Load() != 1 {
		t.Fatalf("the hung engine's list was asked for %d times, want once (its first scrape)", failingLists.Load())
	}
}

// listEngine is an engine whose list is model, and whose list requests
// block while hold is set until release is closed (entered tells when one
// did).
type listEngine struct {
	srv      *httptest.Server
	model    atomic.Pointer[string]
	lists    atomic.Int64
	hold     atomic.Bool
	entered  chan struct{}
	released chan struct{}
}

func newListEngine(t *testing.T) *listEngine {
	e := &listEngine{entered: make(chan struct{}, 16), released: make(chan struct{})}
	e.set("m1")
	e.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/v1/models" {
			_, _ = w.Write(readTestdata(t, "vllm.prom"))
			return
		}
		e.lists.Add(1)
		id := *e.model.Load() // the list as the request finds it
		if e.hold.Load() {
			e.entered <- struct{}{}
			<-e.released
		}
		fmt.Fprintf(w, `{"object":"list","data":[{"id":%q,"object":"model"}]}`, id)
	}))
	t.Cleanup(e.srv.Close)
	t.Cleanup(func() {
		if e.hold.Load() {
			close(e.released)
		}
	})
	return e
}

func (e *listEngine) set(m string) { e.model.Store(&m) }

// startListScraper scrapes e (metrics once, an hour apart) until the test
// ends, once its first list is in.
func startListScraper(t *testing.T, e *listEngine) (*Scraper, context.CancelFunc) {
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	s := New(Config{Interval: time.Hour, ModelsInterval: time.Hour})
	s.SetTargets([]string{hostOf(e.srv)})
	s.Start(ctx)
	waitFor(t, "the first list", 10*time.Second, func() bool {
		sig, _ := s.Latest(hostOf(e.srv), time.Now(), time.Hour)
		return strings.Join(sig.ModelIDs(), ",") == "m1"
	})
	return s, cancel
}

// TestRefreshDuringAnAskedFetch: an adapter loaded through the router
// (RefreshModels once the load is answered) while a fetch AskModels sent
// before the load is under way gets its list at once, not at the next
// round (here an hour later): the fetch under way, which found the old
// list, ends by sending the one asked for.
func TestRefreshDuringAnAskedFetch(t *testing.T) {
	e := newListEngine(t)
	s, _ := startListScraper(t, e)
	d := hostOf(e.srv)
	e.hold.Store(true)
	for s.AskModels([]string{d}, time.Now()) == 1 {
		select {
		case <-e.entered: // the asked fetch is at the engine
		case <-s.ModelsFetched(): // held back by the spacing: ask again
			continue
		}
		break
	}
	e.hold.Store(false)
	e.set("m2")        // the load is answered...
	s.RefreshModels(d) // ...and the router refreshes
	close(e.released)  // the fetch under way answers the old list
	waitFor(t, "the new list", 10*time.Second, func() bool {
		sig, _ := s.Latest(d, time.Now(), time.Hour)
		return strings.Join(sig.ModelIDs(), ",") == "m2"
	})
}

// TestScheduledFetchChecksItsTarget: a fetch AskModels held back for the
// spacing is not sent to a target removed meanwhile, nor once the scraper
// stopped (it would record the stop as the engine's error); its waiters
// are told, to decide without it.
func TestScheduledFetchChecksItsTarget(t *testing.T) {
	for _, c := range []string{"removed", "stopped"} {
		t.Run(c, func(t *testing.T) {
			e := newListEngine(t)
			s, stop := startListScraper(t, e)
			s.refetchSpacing = time.Hour // the fetch is surely held back
			d := hostOf(e.srv)
			fetched := s.ModelsFetched()
			if s.AskModels([]string{d}, time.Now()) != 1 {
				t.Fatal("the list was not asked for")
			}
			before := e.lists.Load()
			if c == "removed" {
				s.RemoveTargets(d)
			} else {
				stop()
				<-s.Stopped()
			}
			select {
			case <-fetched:
			case <-time.After(30 * time.Second):
				t.Fatal("the waiters were not told")
			}
			st, _ := s.StatusOf(d)
			if got := e.lists.Load() - before; got != 0 || st.ModelsError != "" {
				t.Fatalf("%d fetches sent after the target was %s; models error %q", got, c, st.ModelsError)
			}
		})
	}
}

// TestInheritStartsWhereTheOldScraperLeftOff: a reloaded config's scraper
// that inherits from the replaced one has, before its own first scrape,
// the engine's signals and model list, and knows the engine is down.
func TestInheritStartsWhereTheOldScraperLeftOff(t *testing.T) {
	sim, err := kvsim.NewServer(kvsim.ServerConfig{Speed: 50})
	if err != nil {
		t.Fatal(err)
	}
	defer sim.Close()
	srv := httptest.NewServer(sim)
	dial := hostOf(srv)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	cfg := Config{Interval: 50 * time.Millisecond, ModelsInterval: 50 * time.Millisecond}
	old := New(cfg)
	old.SetTargets([]string{dial})
	old.Start(ctx)
	waitFor(t, "the old scraper's list", 10*time.Second, func() bool {
		sig, ok := old.Latest(dial, time.Now(), time.Second)
		return ok && len(sig.Models) == 1
	})
	srv.CloseClientConnections()
	srv.Close() // the engine stops
	waitFor(t, "the old scraper finding it down", 10*time.Second, func() bool { return old.Down(dial) })

	reloaded := New(cfg)
	reloaded.SetTargets([]string{dial})
	reloaded.Inherit(old)
	sig, _ := reloaded.Latest(dial, time.Now(), time.Hour)
	if !reloaded.Down(dial) || len(sig.Models) != 1 || sig.Models[0].ID != kvsim.DefaultModel || sig.Seq != 0 {
		t.Fatalf("inherited: down %v, signals %+v", reloaded.Down(dial), sig)
	}
}

// TestInheritedCountersCatchARestart: an engine that restarts while a
// config reloads (its counters start over between the old scraper's last
// read and the new one's first) is seen restarting by the new scraper,
// which compares with the counters it inherited; one that started afresh
// would take the new process's counters for its first reading and keep
// believing the engine holds what it held before.
func TestInheritedCountersCatchARestart(t *testing.T) {
	newEngine := func() *kvsim.Server {
		sim, err := kvsim.NewServer(kvsim.ServerConfig{Speed: 100})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = sim.Close() })
		return sim
	}
	var engine atomic.Pointer[kvsim.Server]
	engine.Store(newEngine())
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		engine.Load().ServeHTTP(w, r)
	}))
	defer srv.Close()
	dial := hostOf(srv)
	resp, err := http.Post(srv.URL+"/v1/completions", "application/json",
		strings.NewReader(`{"model":"`+kvsim.DefaultModel+`","prompt":"some prompt to count","max_tokens":2}`))
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()

	cfg := Config{Interval: 50 * time.Millisecond, SlowInterval: 50 * time.Millisecond}
	oldCtx, stopOld := context.WithCancel(context.Background())
	defer stopOld()
	old := New(cfg)
	old.SetTargets([]string{dial})
	old.Start(oldCtx)
	waitFor(t, "the old scraper reading the prefix counters", 10*time.Second, func() bool {
		sig, ok := old.Latest(dial, time.Now(), time.Second)
		return ok && sig.PrefixQueries > 0
	})
	stopOld()
	<-old.Stopped()

	restarted := time.Now()
	engine.Store(newEngine()) // a new process on the same port: counters from 0

	for _, inherit := range []bool{true, false} {
		ctx, cancel := context.WithCancel(context.Background())
		told := make(chan time.Time, 4)
		cfg := cfg
		cfg.Restarted = func(d string, at time.Time) {
			if d == dial {
				told <- at
			}
		}
		reloaded := New(cfg)
		reloaded.SetTargets([]string{dial})
		if inherit {
			reloaded.Inherit(old)
		}
		reloaded.Start(ctx)
		var sig Signals
		waitFor(t, "the reloaded scraper's first reading", 10*time.Second, func() bool {
			var ok bool
			sig, ok = reloaded.Latest(dial, time.Now(), time.Second)
			return ok && sig.Seq > 0 && sig.PrefixQueries >= 0
		})
		cancel()
		<-reloaded.Stopped()
		if seen := !sig.LastRestart.Before(restarted); seen != inherit {
			t.Errorf("inherited %v: restart seen %v (last restart %v, engine restarted %v)", inherit, seen, sig.LastRestart, restarted)
		}
		// Restarted told of it, once, with the signals' time.
		select {
		case at := <-told:
			if !inherit || !at.Equal(sig.LastRestart) || len(told) > 0 {
				t.Errorf("inherited %v: told of a restart at %v (signals: %v), %d more", inherit, at, sig.LastRestart, len(told))
			}
		default:
			if inherit {
				t.Errorf("inherited: the restart seen was not told")
			}
		}
	}
}

// TestModelListsChanged counts the lists that differ from the engine's
// list before: its first, and one naming another model, not one whose
// entries differ only in what vLLM fills in anew for every answer
// ("created").
func TestModelListsChanged(t *testing.T) {
	var model atomic.Value
	model.Store("m1")
	var answers atomic.Int64
	srv := listingEngine(t, func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, `{"object":"list","data":[{"id":%q,"object":"model","created":%d,"max_model_len":4096}]}`,
			model.Load(), answers.Add(1))
	})
	s, dial := startAskedScraper(t, srv)
	fetched := func() { // one more fetch of the list, asked for and ended
		t.Helper()
		since, ended := time.Now(), s.ModelsFetched()
		if s.AskModels([]string{dial}, since) == 0 {
			t.Fatal("nothing fetched")
		}
		<-ended
		waitFor(t, "the list fetched", 10*time.Second, func() bool { return s.AskModels([]string{dial}, since) == 0 })
	}
	waitFor(t, "the first list", 10*time.Second, func() bool { return s.ModelListsChanged() == 1 })
	fetched()
	if n := s.ModelListsChanged(); n != 1 {
		t.Fatalf("the same list again (created %d): %d changes, want 1", answers.Load(), n)
	}
	model.Store("m2")
	fetched()
	if n := s.ModelListsChanged(); n != 2 {
		t.Fatalf("another model listed: %d changes, want 2", n)
	}
	if lists := s.ModelLists(); len(lists) != 1 || len(lists[0]) != 1 || lists[0][0].ID != "m2" {
		t.Fatalf("model lists %+v, want the engine's last", lists)
	}
}

// listingEngine is an engine serving testdata/vllm.prom as its metrics
// and, at /v1/models, what models writes; closed when the test ends.
func listingEngine(t *testing.T, models http.HandlerFunc) *httptest.Server {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/v1/models" {
			_, _ = w.Write(readTestdata(t, "vllm.prom"))
			return
		}
		models(w, r)
	}))
	t.Cleanup(srv.Close)
	return srv
}

// TestModelListsChangedWhenATargetGoes: a target dropped with its list
// (a dynamic upstream forgotten) changes ModelLists, so it moves
// ModelListsChanged: a caller reading the lists again only when the count
// moves (the policy's model names) would keep the dropped list for good.
func TestModelListsChangedWhenATargetGoes(t *testing.T) {
	srv := listingEngine(t, func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprint(w, `{"object":"list","data":[{"id":"m1","object":"model"}]}`)
	})
	s, dial := startAskedScraper(t, srv)
	waitFor(t, "the first list", 10*time.Second, func() bool { return s.ModelListsChanged() == 1 })
	s.RemoveTargets(dial)
	if lists := s.ModelLists(); len(lists) != 0 {
		t.Fatalf("lists %+v after the target went", lists)
	}
	if n := s.ModelListsChanged(); n != 2 {
		t.Fatalf("the target's list gone: %d changes, want 2", n)
	}
	s.RemoveTargets(dial) // gone already: no change
	if n := s.ModelListsChanged(); n != 2 {
		t.Fatalf("removed again: %d changes, want 2", n)
	}
}

// TestModelListsChangedWhenAModelIsForgotten: ForgetModel (an adapter
// its engine unloaded) changes a list that ModelLists returns, so it
// counts in ModelListsChanged; a reader waiting for the count to move
// kept the adapter. A model the list does not have changes nothing.
func TestModelListsChangedWhenAModelIsForgotten(t *testing.T) {
	srv := listingEngine(t, func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprint(w, `{"object":"list","data":[{"id":"base","object":"model"},{"id":"tenant","object":"model","parent":"base"}]}`)
	})
	s, dial := startAskedScraper(t, srv)
	waitFor(t, "the first list", 10*time.Second, func() bool { return s.ModelListsChanged() == 1 && len(s.ModelLists()) == 1 })
	s.ForgetModel(dial, "tenant")
	if n := s.ModelListsChanged(); n != 2 {
		t.Fatalf("an adapter forgotten: %d changes, want 2", n)
	}
	if lists := s.ModelLists(); len(lists) != 1 || len(lists[0]) != 1 || lists[0][0].ID != "base" {
		t.Fatalf("lists %+v, want base alone", lists)
	}
	s.ForgetModel(dial, "unlisted")
	if n := s.ModelListsChanged(); n != 2 {
		t.Fatalf("a model not listed forgotten: %d changes, want 2", n)
	}
}

// TestListCountedOnceSeen: a changed list is counted in ModelListsChanged
// only once decisions can read it. Counted before (while the fetch still
// held the target), a request reading the count then and the list not
// yet would see no change afterwards, and answer 404 for the adapter the
// engine lists. The fetch's steps are taken by hand, to stop between them.
func TestListCountedOnceSeen(t *testing.T) {
	srv := listingEngine(t, func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprint(w, `{"object":"list","data":[{"id":"base","object":"model"}]}`)
	})
	s, dial := startAskedScraper(t, srv)
	waitFor(t, "the first list", 10*time.Second, func() bool { return s.ModelListsChanged() == 1 && s.Seq(dial) > 0 })
	lists := func() []string {
		sig, _ := s.Latest(dial, time.Now(), time.Hour)
		return sig.ModelIDs()
	}

	tg := s.target(dial)
	tg.mu.Lock()
	s.noteModels(tg, &tg.status, []ModelInfo{{ID: "base"}, {ID: "lora", Parent: "base"}}, nil, time.Now())
	// A request decides here: it reads the count, then the lists.
	count, seen := s.ModelListsChanged(), lists()
	tg.publishModelsLocked()
	s.modelsFetchEnded(tg)
	tg.mu.Unlock()
	if slices.Contains(seen, "lora") {
		t.Fatalf("the list %v published before the fetch ended", seen)
	}
	if s.ModelListsChanged() == count {
		t.Fatalf("the request read the count (%d) and then a list without the adapter; the count did not move after: "+
			"it would see no change and answer 404 while the engine lists %v", count, lists())
	}
}

// startAskedScraper scrapes srv alone, its metrics and its model list at
// start and then only when asked (AskModels), until the test ends.
func startAskedScraper(t *testing.T, srv *httptest.Server) (*Scraper, string) {
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	s := New(Config{Interval: time.Hour, ModelsInterval: time.Hour})
	dial := hostOf(srv)
	s.SetTargets([]string{dial})
	s.Start(ctx)
	return s, dial
}

// TestForgottenModelStaysForgotten: an adapter ForgetModel took off a
// list (its engine said it unloaded it) is not brought back by a list
// fetch sent before the unload and answered after; a list fetched after
// has the last word.
func TestForgottenModelStaysForgotten(t *testing.T) {
	var loaded atomic.Bool
	loaded.Store(true)
	var gate atomic.Pointer[chan struct{}]
	entered := make(chan struct{}, 1)
	srv := listingEngine(t, func(w http.ResponseWriter, r *http.Request) {
		body := `{"object":"list","data":[{"id":"base","object":"model"}`
		if loaded.Load() {
			body += `,{"id":"lora","object":"model","parent":"base"}`
		}
		body += `]}`
		if g := gate.Load(); g != nil { // the answer built, then slow to come
			entered <- struct{}{}
			<-*g
		}
		fmt.Fprint(w, body)
	})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	s := New(Config{Interval: time.Hour, ModelsInterval: time.Hour})
	dial := hostOf(srv)
	s.SetTargets([]string{dial})
	s.Start(ctx)
	list := func() string {
		sig, _ := s.Latest(dial, time.Now(), time.Hour)
		return strings.Join(sig.ModelIDs(), ",")
	}
	waitFor(t, "listed", 10*time.Second, func() bool { return list() == "base,lora" })

	g := make(chan struct{})
	gate.Store(&g)
	s.RefreshModels(dial) // a fetch sent before the unload
	<-entered
	gate.Store(nil)
	loaded.Store(false)         // the engine unloads the adapter...
	s.ForgetModel(dial, "lora") // ...and the router hears its 200
	if got := list(); got != "base" {
		t.Fatalf("after ForgetModel: %q", got)
	}
	landed := s.ModelsFetched()
	close(g) // the fetch sent before the unload lands
	<-landed
	if got := list(); got != "base" {
		t.Fatalf("the fetch sent before the unload listed it again: %q", got)
	}
	// A list fetched after the unload has the last word: loaded again.
	loaded.Store(true)
	again := s.ModelsFetched()
	s.RefreshModels(dial)
	<-again
	if got := list(); got != "base,lora" {
		t.Fatalf("the adapter loaded again is not listed: %q", got)
	}
}

// TestModelsAPIKey: an engine behind vLLM's --api-key answers its model
// list only with the key (its /metrics without): with ModelsAPIKey the
// list comes; without, the failure is kept in the status (and the
// router's admin view) and logged once, saying what to set, also when
// another failure came first (the engine still loading its model).
func TestModelsAPIKey(t *testing.T) {
	var lists atomic.Int64
	srv := listingEngine(t, func(w http.ResponseWriter, r *http.Request) {
		if lists.Add(1) == 1 { // still loading its model: another failure first
			http.Error(w, "loading", http.StatusServiceUnavailable)
			return
		}
		if r.Header.Get("Authorization") != "Bearer k3y" {
			http.Error(w, `{"error":"Unauthorized"}`, http.StatusUnauthorized)
			return
		}
		fmt.Fprint(w, `{"object":"list","data":[{"id":"base","object":"model"}]}`)
	})
	dial := hostOf(srv)
	for _, key := range []string{"k3y", ""} {
		lists.Store(0)
		core, logs := observer.New(zapcore.WarnLevel)
		ctx, cancel := context.WithCancel(context.Background())
		s := New(Config{Interval: 20 * time.Millisecond, ModelsInterval: 20 * time.Millisecond, ModelsAPIKey: key, Logger: zap.New(core)})
		s.SetTargets([]string{dial})
		s.Start(ctx)
		status := func() Status {
			for _, st := range s.Statuses() {
				if st.Dial == dial {
					return st
				}
			}
			return Status{}
		}
		if key != "" {
			waitFor(t, "the list", 10*time.Second, func() bool {
				sig, _ := s.Latest(dial, time.Now(), time.Hour)
				return strings.Join(sig.ModelIDs(), ",") == "base"
			})
		} else {
			waitFor(t, "the refusal", 10*time.Second, func() bool { return strings.Contains(status().ModelsError, "401") && logs.Len() > 0 })
			for range 3 { // more refusals: one warning
				fetched := s.ModelsFetched()
				s.RefreshModels(dial)
				<-fetched
			}
			if n := logs.FilterMessageSnippet("models_api_key").Len(); n != 1 || !strings.Contains(status().ModelsError, "401") {
				t.Errorf("warned %d times (want once), models error %q", n, status().ModelsError)
			}
		}
		cancel()
		<-s.Stopped()
	}
}

// TestGlobalPlaceholderDialIsScraped: a dial whose placeholders the
// Address hook resolves ({env.*}, as Caddy's active health checks do) is
// scraped at that address and known by its dial; one it cannot resolve
// is no target, and is not asked about again with each request.
func TestGlobalPlaceholderDialIsScraped(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = w.Write(readTestdata(t, "vllm.prom"))
	}))
	defer srv.Close()
	const dial = "engine:{env.ENGINE_PORT}"
	asked := map[string]int{}
	var mu sync.Mutex
	s := New(Config{Interval: 100 * time.Millisecond, ModelsInterval: -1, Address: func(d string) string {
		mu.Lock()
		defer mu.Unlock()
		asked[d]++
		if d == dial {
			return hostOf(srv)
		}
		return ""
	}})
	s.resolveSpacing = time.Hour // the run loop's asking again is TestPlaceholderDialResolvedAgain's
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	s.SetTargets([]string{dial, "{http.request.header.X-Up}"})
	s.Start(ctx)
	waitFor(t, "the resolved dial's signals", 10*time.Second, func() bool {
		sig, ok := s.Latest(dial, time.Now(), time.Minute)
		return ok && sig.KVKnown
	})
	for range 3 {
		s.AddTargets(dial, "{http.request.header.X-Up}", "engine:8000")
	}
	mu.Lock()
	defer mu.Unlock()
	if asked[dial] != 1 || asked["{http.request.header.X-Up}"] != 1 || asked["engine:8000"] != 0 {
		t.Fatalf("addresses asked %v: want each dial with a placeholder once, none for a plain one", asked)
	}
	if st := s.Statuses(); len(st) != 2 || st[0].Dial != dial && st[1].Dial != dial {
		t.Fatalf("targets %+v, want %s and engine:8000", st, dial)
	}
}

// TestPlaceholderDialResolvedAgain: the global placeholders of a dial are
// replaced again now and then, as Caddy's proxy replaces them with each
// request: a dial whose placeholders gave no address when its config
// loaded (an {env.*} empty, a {file.*} not yet written) is scraped once
// they give one, and a target whose address changed (a {file.*}
// rewritten) is scraped at the new one. It stayed no target, or kept its
// first address, until the next config load.
func TestPlaceholderDialResolvedAgain(t *testing.T) {
	var hitsA, hitsB atomic.Int64
	serve := func(hits *atomic.Int64) *httptest.Server {
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			hits.Add(1)
			_, _ = w.Write(readTestdata(t, "vllm.prom"))
		}))
		t.Cleanup(srv.Close)
		return srv
	}
	a, b := serve(&hitsA), serve(&hitsB)
	const dial = "127.0.0.1:{file./run/engine.port}"
	var addr atomic.Pointer[string] // what the placeholder gives now
	none := ""
	addr.Store(&none)
	s := New(Config{Interval: 100 * time.Millisecond, ModelsInterval: -1, Address: func(string) string { return *addr.Load() }})
	s.resolveSpacing = 50 * time.Millisecond
	ctx, cancel := context.WithCancel(context.Background())
	defer func() { cancel(); <-s.Stopped() }()
	s.SetTargets([]string{dial})
	s.Start(ctx)
	if st := s.Statuses(); len(st) != 0 {
		t.Fatalf("targets %+v before the placeholder gives an address", st)
	}
	first := hostOf(a)
	addr.Store(&first)
	waitFor(t, "the dial scraped once its placeholder gives an address", 10*time.Second, func() bool {
		sig, ok := s.Latest(dial, time.Now(), time.Minute)
		return ok && sig.KVKnown && hitsA.Load() > 0
	})
	second := hostOf(b)
	addr.Store(&second)
	waitFor(t, "the dial scraped at its new address", 10*time.Second, func() bool { return hitsB.Load() > 0 })
	if st := s.Statuses(); len(st) != 1 || st[0].Dial != dial {
		t.Fatalf("targets %+v, want %s alone", st, dial)
	}
}

// TestProcessStartTellsARestart: an engine whose process start time
// (process_start_time_seconds) moves restarted, though no connection was
// refused and its counters were not read again: a restart quicker than a
// scrape interval (a supervisor's, or behind a proxy that keeps the port
// open) was seen only at the next full read, or, for the time it takes,
// not at all, and the router sent prompts as warm to an empty cache.
func TestProcessStartTellsARestart(t *testing.T) {
	var start atomic.Int64
	start.Store(1_700_000_000)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = w.Write(readTestdata(t, "vllm.prom"))
		fmt.Fprintf(w, "# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds %d.25\n", start.Load())
	}))
	defer srv.Close()
	dial := hostOf(srv)
	told := make(chan time.Time, 4)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// The counters are read once, at the first scrape, and not again.
	s := New(Config{Interval: 20 * time.Millisecond, SlowInterval: time.Hour,
		Restarted: func(d string, at time.Time) {
			if d == dial {
				told <- at
			}
		}})
	s.SetTargets([]string{dial})
	s.Start(ctx)
	latest := func() Signals {
		sig, _ := s.Latest(dial, time.Now(), time.Hour)
		return sig
	}
	for deadline := time.Now().Add(10 * time.Second); latest().Seq < 3; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("not scraped three times")
		}
	}
	if sig := latest(); sig.ProcessStart != 1_700_000_000.25 || !sig.LastRestart.IsZero() {
		t.Fatalf("before the restart: process start %v, last restart %v", sig.ProcessStart, sig.LastRestart)
	}
	start.Store(1_700_000_100)
	select {
	case at := <-told:
		if sig := latest(); !sig.LastRestart.Equal(at) || sig.ProcessStart != 1_700_000_100.25 {
			t.Fatalf("after the restart: told %v, signals' last restart %v, process start %v", at, sig.LastRestart, sig.ProcessStart)
		}
	case <-time.After(time.Minute):
		t.Fatal("the restart was never told")
	}
	seq := latest().Seq
	for deadline := time.Now().Add(10 * time.Second); latest().Seq < seq+3; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("not scraped again")
		}
	}
	if len(told) > 0 {
		t.Fatalf("a restart told again without the start time moving: %v", <-told)
	}
}
