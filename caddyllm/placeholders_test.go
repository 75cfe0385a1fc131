package caddyllm

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// TestPassThroughPlaceholders: a request passed through reports what the
// router knows of it, as a routed one does: the body's model when it was
// read, and the policy's choice (reason fallback, the upstream, the
// attempt) or its refusal (reason refused, blocked_by model, the upstream
// empty), which refused_total counts; nothing of the prompt. A refused
// embedding used to report every placeholder null, so an access log
// counted no refusal where the metrics counted one.
func TestPassThroughPlaceholders(t *testing.T) {
	var noDelay atomic.Int64
	engine := listingEngine(t, func() string { return "emb" }, &noDelay)
	p, pool := scrapedPolicy(t, engine)
	h := moveHandler()
	next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		if p.Select(pool, r, w) == nil {
			return caddyhttp.Error(http.StatusBadGateway, fmt.Errorf("no upstreams available"))
		}
		w.WriteHeader(http.StatusOK)
		return nil
	})
	const secret = "SECRET-INPUT-7c1f"
	// want holds each placeholder's value; one not named is null.
	for _, c := range []struct {
		name, method, path, contentType, body string
		status                                int
		want                                  map[string]any
	}{
		{"refused", "POST", "/v1/embeddings", "application/json", `{"model":"nope","input":"` + secret + `"}`, http.StatusNotFound,
			map[string]any{"model": "nope", "reason": "refused", "blocked_by": "model", "upstream": ""}},
		// vLLM refuses a body that is not UTF-8 (400) before it reads the
		// model, as the routed path answers; it got the router's 404.
		{"not UTF-8", "POST", "/v1/embeddings", "application/json", `{"model":"nope","input":"` + secret + "\xff\xfe" + `"}`, http.StatusBadRequest,
			map[string]any{"model": "nope", "reason": "refused", "blocked_by": "invalid_utf8", "upstream": ""}},
		{"listed", "POST", "/v1/embeddings", "application/json", `{"input":"` + secret + `","model":"emb"}`, http.StatusOK,
			map[string]any{"model": "emb", "reason": "fallback", "upstream": pool[0].Dial, "attempt": 1}},
		{"body not read", "POST", "/v1/embeddings", "text/plain", `{"model":"nope","input":"` + secret + `"}`, http.StatusOK,
			map[string]any{"reason": "fallback", "upstream": pool[0].Dial, "attempt": 1}},
		{"models list", "GET", "/v1/models", "", "", http.StatusOK,
			map[string]any{"reason": "fallback", "upstream": pool[0].Dial, "attempt": 1}},
	} {
		code := "model_not_found"
		if c.status == http.StatusBadRequest {
			code = "400"
		}
		refusedBefore := testutil.ToFloat64(p.sh.metrics.refused.WithLabelValues(code))
		repl := caddy.NewEmptyReplacer()
		r := httptest.NewRequest(c.method, c.path, strings.NewReader(c.body))
		if c.contentType != "" {
			r.Header.Set("Content-Type", c.contentType)
		}
		r = r.WithContext(context.WithValue(context.Background(), caddy.ReplacerCtxKey, repl))
		rr := httptest.NewRecorder()
		if err := h.ServeHTTP(rr, r, next); err != nil || rr.Code != c.status {
			t.Errorf("%s: %d, %v: %s", c.name, rr.Code, err, rr.Body)
			continue
		}
		for _, name := range placeholderNames {
			got, known := repl.Get(placeholderPrefix + name)
			if !known || got != c.want[name] {
				t.Errorf("%s: {%s%s} = %#v (known %v), want %#v", c.name, placeholderPrefix, name, got, known, c.want[name])
			}
			if s, ok := got.(string); ok && strings.Contains(s, secret) {
				t.Errorf("%s: {%s%s} carries the input", c.name, placeholderPrefix, name)
			}
		}
		refused := testutil.ToFloat64(p.sh.metrics.refused.WithLabelValues(code)) - refusedBefore
		if (refused == 1) != (c.want["reason"] == "refused") || refused > 1 {
			t.Errorf("%s: refused_total{code=%s} rose by %v; reason %v", c.name, code, refused, c.want["reason"])
		}
		if c.status == http.StatusBadRequest && !strings.Contains(rr.Body.String(), `"code":400`) {
			t.Errorf("%s: %s, want vLLM's error with code 400", c.name, rr.Body)
		}
	}
}
