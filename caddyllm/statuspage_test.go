package caddyllm

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// TestCheckSameOrigin: the site handler lets reads through, and changes
// only from its own origin or from clients that are not browsers.
func TestCheckSameOrigin(t *testing.T) {
	for _, c := range []struct {
		method, origin, fetchMode string
		ok                        bool
	}{
		{"GET", "http://evil.example", "cors", true}, // reads: the browser keeps the answer from other origins
		{"POST", "http://localhost:2020", "cors", true},
		{"DELETE", "http://LOCALHOST:2020", "cors", true},
		{"POST", "http://evil.example", "cors", false},
		{"POST", "http://localhost:2021", "cors", false},
		{"POST", "null", "cors", false},
		{"POST", "", "no-cors", false}, // a browser, without Origin
		{"POST", "", "", true},         // curl
	} {
		r := httptest.NewRequest(c.method, "http://localhost:2020/llm_affinity/upstreams/a:1/drain", nil)
		if c.origin != "" {
			r.Header.Set("Origin", c.origin)
		}
		if c.fetchMode != "" {
			r.Header.Set("Sec-Fetch-Mode", c.fetchMode)
		}
		if err := checkSameOrigin(r); (err == nil) != c.ok {
			t.Errorf("%s from %q (%s): error %v, want ok=%v", c.method, c.origin, c.fetchMode, err, c.ok)
		}
	}
	// A site on a server listening on loopback only: a page on a
	// rebinding DNS name has an Origin matching its Host, and is refused;
	// loopback names are not. A server listening elsewhere too is reached
	// by other names (a local proxy or tunnel on loopback as well).
	loopbackOnly := &caddyhttp.Server{Listen: []string{"127.0.0.1:2020", "tcp/[::1]:2020", "localhost:2021"}}
	everywhere := &caddyhttp.Server{Listen: []string{":2020"}}
	for host, ok := range map[string]bool{
		"attacker.example:2020": false, "localhost:2020": true, "127.0.0.1:2020": true, "[::1]:2020": true, "LOCALHOST": true,
	} {
		r := httptest.NewRequest("POST", "http://"+host+"/llm_affinity/upstreams/a:1/drain", nil)
		r.Host = host
		r.Header.Set("Origin", "http://"+host)
		for _, method := range []string{"POST", "GET"} {
			for _, origin := range []string{"http://" + host, ""} { // a browser's, curl's
				r.Method = method
				r.Header.Set("Origin", origin)
				w := httptest.NewRecorder()
				_ = StatusHandler{}.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), caddyhttp.ServerCtxKey, loopbackOnly)), nil)
				if (w.Code != http.StatusForbidden) != ok {
					t.Errorf("%s with Host %s, Origin %q on a loopback-only server: %d, want refused %v", method, host, origin, w.Code, !ok)
				}
				if err := checkHost(r.WithContext(context.WithValue(r.Context(), caddyhttp.ServerCtxKey, everywhere))); err != nil {
					t.Errorf("Host %s on a server listening everywhere: %v", host, err)
				}
			}
		}
	}
}

// TestStatusPageInline: the page is one document whose style and script
// are inline and allowed by its CSP, and nothing else is served.
func TestStatusPageInline(t *testing.T) {
	w := httptest.NewRecorder()
	if err := handleStatusPage(w, httptest.NewRequest("GET", "/llm_affinity/", nil)); err != nil {
		t.Fatal(err)
	}
	body := w.Body.String()
	if strings.Contains(body, "{{") || strings.Contains(body, " src=") || strings.Contains(body, "stylesheet") ||
		!strings.Contains(body, `fetch("upstreams"`) {
		t.Fatalf("the page is not self-contained:\n%.400s", body)
	}
	if csp := w.Header().Get("Content-Security-Policy"); strings.Count(csp, "'sha256-") != 2 || strings.Contains(csp, "unsafe") {
		t.Fatalf("CSP %q", csp)
	}
	for _, p := range []string{"/llm_affinity/index.html", "/llm_affinity/static/status.js", "/llm_affinity/x"} {
		if err := handleStatusPage(httptest.NewRecorder(), httptest.NewRequest("GET", p, nil)); err == nil {
			t.Errorf("%s is served", p)
		}
	}
}

// TestStatusHandlerErrorsInJSON: on a site, the handler answers a refused
// request as the admin API does: the status and a JSON error saying why.
func TestStatusHandlerErrorsInJSON(t *testing.T) {
	r := httptest.NewRequest("POST", "http://localhost:2020/llm_affinity/upstreams/a:1/drain", nil)
	r.Header.Set("Origin", "http://evil.example")
	r.Header.Set("Sec-Fetch-Mode", "cors")
	w := httptest.NewRecorder()
	if err := (StatusHandler{}).ServeHTTP(w, r, nil); err != nil {
		t.Fatal(err)
	}
	var body struct{ Error string }
	if err := json.Unmarshal(w.Body.Bytes(), &body); err != nil || w.Code != http.StatusForbidden ||
		w.Header().Get("Content-Type") != "application/json" || body.Error == "" {
		t.Fatalf("status %d, Content-Type %q, body %q (%v)", w.Code, w.Header().Get("Content-Type"), w.Body, err)
	}
}

// TestDrainAUnixSocketUpstream: a dial holding slashes (a unix socket) is
// drained and undrained with its slashes escaped in the path, as the
// status page's buttons send it.
func TestDrainAUnixSocketUpstream(t *testing.T) {
	sh := acquireShared()
	defer releaseShared()
	const dial = "unix//run/engine-7.sock"
	sh.fleet.Name(dial, time.Now())
	defer sh.fleet.Forget(dial)
	path := "/llm_affinity/upstreams/" + url.PathEscape(dial) + "/drain"
	for _, c := range []struct{ method, phase string }{{"POST", "drained"}, {"DELETE", "active"}} {
		w := httptest.NewRecorder()
		if err := handleDrain(w, httptest.NewRequest(c.method, path, nil)); err != nil {
			t.Fatalf("%s %s: %v", c.method, path, err)
		}
		if got := sh.drains.Phase(dial).String(); got != c.phase {
			t.Fatalf("after %s: %s, want %s", c.method, got, c.phase)
		}
	}
	// Unescaped, the slashes make it another path.
	if err := handleDrain(httptest.NewRecorder(), httptest.NewRequest("POST", "/llm_affinity/upstreams/"+dial+"/drain", nil)); err == nil {
		t.Fatal("an unescaped dial with slashes was taken")
	}
}

// TestDrainRequestsAsked: a 405 names the methods the endpoint takes in
// Allow, and a drain request the endpoint does not fully understand (a
// misspelt deadline in the query or the body, one given twice or in both,
// a body that is not one object) is refused rather than drained with
// another deadline.
func TestDrainRequestsAsked(t *testing.T) {
	sh := acquireShared()
	defer releaseShared()
	const dial = "asked:1"
	sh.fleet.Name(dial, time.Now())
	defer sh.fleet.Forget(dial)
	path := "/llm_affinity/upstreams/" + dial + "/drain"
	w := httptest.NewRecorder()
	var apiErr caddy.APIError
	if err := handleDrain(w, httptest.NewRequest("GET", path, nil)); !errors.As(err, &apiErr) ||
		apiErr.HTTPStatus != http.StatusMethodNotAllowed || w.Header().Get("Allow") != "POST, DELETE" {
		t.Fatalf("GET: %v, Allow %q", err, w.Header().Get("Allow"))
	}
	w = httptest.NewRecorder()
	if err := handleUpstreams(w, httptest.NewRequest("DELETE", "/llm_affinity/upstreams", nil)); err == nil || w.Header().Get("Allow") != "GET" {
		t.Fatalf("DELETE upstreams: %v, Allow %q", err, w.Header().Get("Allow"))
	}
	w = httptest.NewRecorder()
	if err := handleSync(w, httptest.NewRequest("POST", "/llm_affinity/sync", nil)); err == nil || w.Header().Get("Allow") != "GET" {
		t.Fatalf("POST sync: %v, Allow %q", err, w.Header().Get("Allow"))
	}
	for _, tc := range []struct{ query, body string }{
		{"", `{"dedline":"5s"}`}, {"", `{"deadline":"5s"} trailing`}, {"", `{"deadline":"5s"}{"deadline":"1h"}`},
		{"", `null`}, {"", `["5s"]`}, {"", `[1]`}, {"", `{"deadline":5}`}, {"", `{"deadline":""}`},
		{"?deadlin=5s", ""}, {"?deadline=1s&deadline=1h", ""}, {"?deadline=", ""}, {"?deadline=-1s", ""},
		{"?deadline=10s", `{"deadline":"1h"}`},
		// A deadline given twice, or named otherwise (encoding/json would
		// take the last, and "Deadline" for it); null is no string.
		{"", `{"deadline":"5s","deadline":"9s"}`}, {"", `{"Deadline":"3s"}`}, {"", `{"deadline":null}`},
		{"", `{"deadline":"5s"`}, {"", `{}{}`},
	} {
		var body io.Reader
		if tc.body != "" {
			body = strings.NewReader(tc.body)
		}
		if err := handleDrain(httptest.NewRecorder(), httptest.NewRequest("POST", path+tc.query, body)); !errors.As(err, &apiErr) ||
			apiErr.HTTPStatus != http.StatusBadRequest || strings.Contains(err.Error(), "Go ") || strings.Contains(err.Error(), "*string") {
			t.Fatalf("%s %s: %v", tc.query, tc.body, err)
		}
	}
	if got := sh.drains.Phase(dial).String(); got != "active" {
		t.Fatalf("after a refused drain: %s", got)
	}
	if err := handleDrain(httptest.NewRecorder(), httptest.NewRequest("POST", path, strings.NewReader(`{"deadline":"5s"}`))); err != nil {
		t.Fatal(err)
	}
	if got := sh.drains.Phase(dial).String(); got != "drained" {
		t.Fatalf("after a drain: %s", got)
	}
}

// FuzzDrainBodyDeadline: a drain body the reader takes is one JSON
// object, and its deadline is what encoding/json reads from it; one it
// refuses gets an error that names no Go type.
func FuzzDrainBodyDeadline(f *testing.F) {
	for _, b := range []string{`{"deadline":"5s"}`, `{}`, `{"deadline":"5s","deadline":"9s"}`, `{"Deadline":"1s"}`,
		`{"deadline":null}`, `{"deadline":5}`, ` { "deadline" : "1m" } `, `{"deadline":"\u0035s"}`, `[]`, `{"deadline":"5s"}{}`, `1E1000`, `{"deadline":1e1000}`} {
		f.Add([]byte(b))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		deadline, given, err := drainBodyDeadline(strings.NewReader(string(body)), false)
		if err != nil {
			if strings.Contains(err.Error(), "Go ") || strings.Contains(err.Error(), "*string") {
				t.Fatalf("%q: %v", body, err)
			}
			return
		}
		var ref struct {
			Deadline *string `json:"deadline"`
		}
		if json.Unmarshal(body, &ref) != nil {
			t.Fatalf("took %q, which encoding/json refuses", body)
		}
		if given != (ref.Deadline != nil) || given && deadline != *ref.Deadline {
			t.Fatalf("%q: deadline %q (given %v), encoding/json reads %v", body, deadline, given, ref.Deadline)
		}
	})
}
