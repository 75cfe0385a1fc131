package integration

import (
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/llmaffinity/caddy-llm-affinity/kvsim"
)

// TestAdminShowsLatestScrape: an engine whose metrics fail from the
// router's start shows the failure in the admin view; once a later scrape
// succeeds, the view shows no error (the count of failures stays).
func TestAdminShowsLatestScrape(t *testing.T) {
	sim, err := kvsim.NewServer(kvsim.ServerConfig{Name: "flaky"})
	if err != nil {
		t.Fatal(err)
	}
	var failing atomic.Bool
	failing.Store(true)
	hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if failing.Load() && strings.HasPrefix(r.URL.Path, "/metrics") {
			http.Error(w, "metrics not ready", http.StatusInternalServerError)
			return
		}
		sim.ServeHTTP(w, r)
	}))
	t.Cleanup(func() { hs.CloseClientConnections(); hs.Close(); sim.Close() })
	r := &replica{name: "flaky", sim: sim, http: hs}
	startCaddy(t, caddyfile([]*replica{r}, "", "scrape_interval 100ms", ""))

	eventually(t, 10*time.Second, "the failing scrape in the admin view", func() bool {
		v := engineView(t, r.dial())
		return v != nil && v.Errors > 0 && strings.Contains(v.LastError, "500")
	})
	failing.Store(false)
	eventually(t, 10*time.Second, "a successful scrape clearing the error", func() bool {
		v := engineView(t, r.dial())
		return v != nil && v.LastError == "" && v.KVCapacity > 0
	})
	if v := engineView(t, r.dial()); v.Errors == 0 {
		t.Errorf("the failures' count was lost: %+v", v)
	}
}
