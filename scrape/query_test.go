package scrape

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

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
			var marks atomic.Uint64 // charge marks taken
			var unmarked atomic.Int32
			srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				mu.Lock()
				requests = append(requests, request{r.URL.Path, r.URL.Query()["name[]"]})
				if marks.Load() < uint64(2*len(requests)-1) {
					unmarked.Add(1) // sent before its mark was taken (two an attempt)
				}
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
			s := New(Config{Interval: 100 * time.Millisecond, SlowInterval: 500 * time.Millisecond, ModelsInterval: -1,
				Mark: func(string) Mark { return Mark{Requests: marks.Add(1)} }})
			s.SetTargets([]string{dial})
			s.Start(ctx)
			// Six scrapes and, when the families are named, a later one
			// that reads the slow families and one that does not. (The
			// first two scrapes take at most four requests.)
			waitFor(t, "six scrapes, reading the slow families now and then", 20*time.Second, func() bool {
				st, _ := s.StatusOf(dial)
				if st.Scrapes+st.Errors < 6 {
					return false
				}
				if !tc.wantNames {
					return true
				}
				mu.Lock()
				defer mu.Unlock()
				slow, fast := false, false
				for _, r := range requests[min(4, len(requests)):] {
					if slices.Contains(r.names, vllmCacheConfig) {
						slow = true
					} else {
						fast = true
					}
				}
				return slow && fast
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
			// Every attempt, the second of a scrape too, takes its own
			// mark before it is sent and another once it has its answer
			// (two more may have been taken by an attempt the stop cut
			// off).
			if n := marks.Load(); n < uint64(2*len(requests)) || n > uint64(2*len(requests))+2 || unmarked.Load() != 0 {
				t.Fatalf("%d marks for %d requests, %d sent before their mark", n, len(requests), unmarked.Load())
			}
			if tc.engine && sig.Mark.Requests == 0 {
				t.Fatalf("signals without their mark: %+v", sig)
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
			if tc.wantNames && (full == len(later) || full == 0) {
				t.Fatalf("%d of %d later requests read the slow families: %v", full, len(later), later)
			}
		})
	}
}

// TestScrapeModeChanges: how the way metrics are asked for follows the
// engine's answers, and does not follow failures that say nothing about
// the query. Each case's script moves the server from phase to phase
// once the scraper has seen the previous one, by its mode and counters.
func TestScrapeModeChanges(t *testing.T) {
	var phase atomic.Int32 // advanced by each case's script
	for _, tc := range []struct {
		name string
		// serve answers in the current phase.
		serve func(w http.ResponseWriter, r *http.Request, phase int32)
		// script moves through the phases, waiting for the scraper.
		script func(w modeWatch)
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
		}, func(w modeWatch) {
			w.mode(modeNamedBelow)
			phase.Store(1)
			w.errors(3)
			w.check(modeNamedBelow)
			phase.Store(2)
			w.successes(2)
		}, modeNamedBelow},
		{"a redirect from /metrics asks below", func(w http.ResponseWriter, r *http.Request, _ int32) {
			if r.URL.Path == "/metrics" {
				http.Redirect(w, r, "/metrics/?"+r.URL.RawQuery, http.StatusTemporaryRedirect)
				return
			}
			_, _ = io.WriteString(w, filteredExposition(r.URL.Query()))
		}, func(w modeWatch) {
			w.mode(modeNamedBelow)
			w.successes(2)
			w.noErrors()
		}, modeNamedBelow},
		{"early hints are skipped", func(w http.ResponseWriter, r *http.Request, _ int32) {
			w.Header().Set("Link", "</style.css>; rel=preload")
			w.WriteHeader(http.StatusEarlyHints)
			_, _ = io.WriteString(w, filteredExposition(r.URL.Query()))
		}, func(w modeWatch) {
			w.successes(3)
			w.noErrors()
		}, modeNamed},
		{"an engine that learns to filter is asked for less again", func(w http.ResponseWriter, r *http.Request, phase int32) {
			if q := r.URL.Query(); len(q["name[]"]) > 0 {
				if phase == 1 {
					_, _ = io.WriteString(w, filteredExposition(q))
				}
				return // phase 0: an empty answer, as SGLang gives
			}
			_, _ = io.WriteString(w, modeTestExposition)
		}, func(w modeWatch) {
			w.mode(modeWhole)
			phase.Store(1)
			w.mode(modeNamed) // after wholeProbeIntervals slow intervals
			w.successes(2)
		}, modeNamed},
	} {
		t.Run(tc.name, func(t *testing.T) {
			phase.Store(0)
			s, dial := scrapeServer(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				tc.serve(w, r, phase.Load())
			}), Config{Interval: 100 * time.Millisecond, Timeout: time.Minute, SlowInterval: 100 * time.Millisecond, ModelsInterval: -1})
			w := modeWatch{t, s, dial}
			tc.script(w)
			w.check(tc.want)
			if sig, ok := s.Latest(dial, time.Now(), time.Hour); !ok || sig.Waiting != 2 {
				t.Fatalf("signals %v %+v", ok, sig)
			}
		})
	}
}

// modeWatch waits for a scraper with one target to reach a state.
type modeWatch struct {
	t    *testing.T
	s    *Scraper
	dial string
}

// modeOf returns the target's current metricsMode.
func (w modeWatch) modeOf() metricsMode {
	w.s.mu.RLock()
	target := w.s.targets[w.dial]
	w.s.mu.RUnlock()
	target.mu.Lock()
	defer target.mu.Unlock()
	return target.mode
}

// status returns the target's status.
func (w modeWatch) status() Status {
	st, _ := w.s.StatusOf(w.dial)
	return st
}

// mode waits until the target is asked for its metrics in mode and a
// scrape has succeeded in it: a scrape sets the mode it tries (a probe)
// before its outcome can set another, so seeing the mode alone is not
// enough.
func (w modeWatch) mode(mode metricsMode) {
	w.t.Helper()
	seen, since := false, uint64(0)
	waitFor(w.t, fmt.Sprint("mode ", mode), 10*time.Second, func() bool {
		scrapes := w.status().Scrapes // before the mode: a change of mode precedes the count
		if w.modeOf() != mode {
			seen = false
			return false
		}
		if !seen {
			seen, since = true, scrapes
			return false
		}
		return scrapes > since
	})
}

// successes waits for n more successful scrapes.
func (w modeWatch) successes(n uint64) {
	w.t.Helper()
	want := w.status().Scrapes + n
	waitFor(w.t, fmt.Sprint(n, " more successful scrapes"), 10*time.Second, func() bool { return w.status().Scrapes >= want })
}

// errors waits for n more failed scrapes.
func (w modeWatch) errors(n uint64) {
	w.t.Helper()
	want := w.status().Errors + n
	waitFor(w.t, fmt.Sprint(n, " more failed scrapes"), 10*time.Second, func() bool { return w.status().Errors >= want })
}

// check fails the test unless the target is in mode now.
func (w modeWatch) check(mode metricsMode) {
	w.t.Helper()
	if got := w.modeOf(); got != mode {
		w.t.Fatalf("mode %d, want %d; status %+v", got, mode, w.status())
	}
}

// noErrors fails the test if any scrape failed.
func (w modeWatch) noErrors() {
	w.t.Helper()
	if st := w.status(); st.Errors != 0 {
		w.t.Fatalf("status %+v", st)
	}
}

// TestNextMode is the query mode state machine, answer by answer.
func TestNextMode(t *testing.T) {
	status := func(code int) error { return &statusError{"http://e/metrics?…", code} }
	wrapped := func(err error) error { return fmt.Errorf("reading: %w", err) }
	for _, tc := range []struct {
		mode    metricsMode
		dropped int
		err     error
		want    metricsMode
	}{
		{modeNamed, 0, nil, modeNamed},
		{modeNamed, 3, nil, modeNamedBelow}, // the query was ignored
		{modeNamedBelow, 3, nil, modeWhole},
		{modeWhole, 3, nil, modeWhole},
		{modeNamed, 0, status(307), modeNamedBelow},
		{modeNamed, 0, status(404), modeNamed},
		{modeNamed, 0, status(503), modeNamed},
		{modeNamedBelow, 0, status(404), modeWhole},
		{modeNamedBelow, 0, status(301), modeWhole},
		{modeNamedBelow, 0, status(503), modeNamedBelow},
		{modeNamed, 0, wrapped(errNoEngineMetrics), modeWhole},
		{modeNamedBelow, 0, wrapped(errMalformedExposition), modeWhole},
		{modeNamed, 0, errors.New("connection refused"), modeNamed},
		{modeNamed, 0, wrapped(errExpositionTooLarge), modeNamed},
		{modeWhole, 0, wrapped(errNoEngineMetrics), modeWhole},
	} {
		if got := nextMode(tc.mode, tc.dropped, tc.err); got != tc.want {
			t.Errorf("mode %d, %d dropped, %v: next %d, want %d", tc.mode, tc.dropped, tc.err, got, tc.want)
		}
	}
}
