package scrape

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

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

// countingServer serves handler until the test ends and counts the
// connections made to it.
func countingServer(t *testing.T, handler http.Handler) (srv *httptest.Server, conns *atomic.Int32) {
	t.Helper()
	conns = new(atomic.Int32)
	srv = httptest.NewUnstartedServer(handler)
	srv.Config.ConnState = func(_ net.Conn, state http.ConnState) {
		if state == http.StateNew {
			conns.Add(1)
		}
	}
	srv.Start()
	t.Cleanup(srv.Close)
	return srv, conns
}

// TestScrapeConnectionReuse: short error answers leave the connection
// to the next scrape; an oversized body or header is refused, and its
// connection closed rather than read to its end.
func TestScrapeConnectionReuse(t *testing.T) {
	const (
		answerOK = iota
		answerBusy
		answerHuge       // once
		answerHugeHeader // once
	)
	var answer atomic.Int32
	huge := strings.Repeat("# a comment line to pad the exposition out\n", maxExpositionBytes/40)
	srv, conns := countingServer(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch {
		case answer.Load() == answerBusy:
			http.Error(w, "busy", http.StatusServiceUnavailable)
		case answer.CompareAndSwap(answerHuge, answerOK):
			_, _ = io.WriteString(w, modeTestExposition+huge)
		case answer.CompareAndSwap(answerHugeHeader, answerOK):
			w.Header().Set("X-Pad", strings.Repeat("a", 4*maxHeaderBytes))
			_, _ = io.WriteString(w, filteredExposition(r.URL.Query()))
		default:
			_, _ = io.WriteString(w, filteredExposition(r.URL.Query()))
		}
	}))
	dial := hostOf(srv)
	ctx, cancel := context.WithCancel(context.Background())
	// A timeout the huge answer's 8 MiB arrive within, even under -race.
	s := New(Config{Interval: 100 * time.Millisecond, Timeout: time.Minute, ModelsInterval: -1})
	s.SetTargets([]string{dial})
	s.Start(ctx)
	defer func() { cancel(); <-s.Stopped() }()
	w := modeWatch{t, s, dial}

	w.successes(2)
	answer.Store(answerBusy)
	w.errors(3)
	answer.Store(answerOK)
	w.successes(2)
	if n := conns.Load(); n != 1 {
		t.Fatalf("%d connections for scrapes with 503s between", n)
	}
	answer.Store(answerHuge)
	waitFor(t, "the huge answer refused", 10*time.Second, func() bool {
		return strings.Contains(w.status().LastError, errExpositionTooLarge.Error())
	})
	w.successes(2)
	if n := conns.Load(); n != 2 {
		t.Fatalf("%d connections, want a second one after the huge answer", n)
	}
	answer.Store(answerHugeHeader)
	waitFor(t, "the huge header refused", 10*time.Second, func() bool {
		return strings.Contains(w.status().LastError, errHeaderTooLarge.Error())
	})
	w.successes(2)
	if n := conns.Load(); n != 3 {
		t.Fatalf("%d connections, want a third one after the huge header", n)
	}
	w.check(modeNamed)
}

// TestScrapeHungFetch: while a fetch hangs, reading the scraper does not
// wait for it, and stopping the scraper cancels it rather than waiting
// for its timeout, on the scraper's kept connection as with a caller's
// client.
func TestScrapeHungFetch(t *testing.T) {
	for _, tc := range []struct {
		name   string
		client *http.Client
	}{
		{"own client", nil},
		{"caller's client", &http.Client{}},
	} {
		t.Run(tc.name, func(t *testing.T) { testScrapeHungFetch(t, tc.client) })
	}
}

func testScrapeHungFetch(t *testing.T, client *http.Client) {
	entered, gone := make(chan struct{}, 1), make(chan struct{}, 1)
	release := make(chan struct{}) // a failed test's server can close
	srv, _ := countingServer(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case entered <- struct{}{}:
		default:
		}
		select {
		case <-r.Context().Done(): // the client went
		case <-release:
			return
		}
		select {
		case gone <- struct{}{}:
		default:
		}
	}))
	t.Cleanup(func() { close(release) }) // before srv.Close
	dial := hostOf(srv)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// A timeout no test waits for: only the scraper's stop ends the fetch.
	s := New(Config{Interval: 100 * time.Millisecond, Timeout: time.Hour, ModelsInterval: -1, Client: client})
	s.SetTargets([]string{dial})
	s.Start(ctx)
	select {
	case <-entered:
	case <-time.After(10 * time.Second):
		t.Fatal("no request")
	}

	// The fetch is in flight: its handler returns only once the client
	// has gone.
	for range 1000 {
		if _, ok := s.Latest(dial, time.Now(), time.Hour); ok || s.Seq(dial) != 0 {
			t.Fatal("signals without a scrape")
		}
		if st, ok := s.StatusOf(dial); !ok || st.Scrapes+st.Errors != 0 || len(s.Statuses()) != 1 {
			t.Fatalf("status %+v", st)
		}
		s.AddTargets(dial)
	}
	select {
	case <-gone:
		t.Fatal("the fetch ended before the scraper stopped")
	default:
	}

	cancel()
	select {
	case <-s.Stopped():
	case <-time.After(10 * time.Second):
		t.Fatal("the scraper waits for its hung fetch")
	}
	select {
	case <-gone:
	case <-time.After(10 * time.Second):
		t.Fatal("the hung request was not cancelled")
	}
}

// TestScrapeNetHTTP: https targets, like any with a caller's client, are
// fetched with net/http, which does not follow a metrics redirect (it
// moves the query mode) and names the URL without its query in errors.
func TestScrapeNetHTTP(t *testing.T) {
	var busy atomic.Bool
	srv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch {
		case busy.Load():
			http.Error(w, "busy", http.StatusServiceUnavailable)
		case r.URL.Path == "/metrics":
			http.Redirect(w, r, "/metrics/?"+r.URL.RawQuery, http.StatusTemporaryRedirect)
		default:
			_, _ = io.WriteString(w, filteredExposition(r.URL.Query()))
		}
	}))
	defer srv.Close()
	dial := hostOf(srv)
	ctx, cancel := context.WithCancel(context.Background())
	// A minute's timeout: the errors counted are the engine's, not a
	// starved machine's slow handshakes.
	s := New(Config{Interval: 100 * time.Millisecond, Timeout: time.Minute, Scheme: "https", Client: srv.Client(), ModelsInterval: -1})
	s.SetTargets([]string{dial})
	s.Start(ctx)
	defer func() { cancel(); <-s.Stopped() }()
	w := modeWatch{t, s, dial}

	w.mode(modeNamedBelow)
	w.successes(2)
	w.noErrors()
	busy.Store(true)
	w.errors(1)
	if st, want := w.status(), "GET https://"+dial+"/metrics/?…: status 503"; st.LastError != want {
		t.Fatalf("last error %q, want %q", st.LastError, want)
	}
	w.check(modeNamedBelow)
}
