package scrape

import (
	"context"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
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

func near(a, b float64) bool { return math.Abs(a-b) < 1e-9 }

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
