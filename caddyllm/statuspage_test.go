package caddyllm

import (
	"net/http/httptest"
	"strings"
	"testing"
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
