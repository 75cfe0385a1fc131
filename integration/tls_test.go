package integration

import (
	"fmt"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/llmaffinity/caddy-llm-affinity/kvsim"
)

// TestScrapesEnginesOverHTTPS: engines served over TLS (a certificate no
// one trusts, as Caddy's internal CA's would be to the router) behind
// reverse_proxy https://… with tls_insecure_skip_verify are scraped the way
// the proxy reaches them, and the admin view shows their KV capacity.
func TestScrapesEnginesOverHTTPS(t *testing.T) {
	var dials []string
	for i := range 2 {
		sim, err := kvsim.NewServer(kvsim.ServerConfig{Name: fmt.Sprintf("tls-%d", i), Engine: kvsim.Config{NumGPUBlocks: 1024 * (i + 1)}})
		if err != nil {
			t.Fatal(err)
		}
		hs := httptest.NewTLSServer(sim)
		t.Cleanup(func() { hs.CloseClientConnections(); hs.Close(); sim.Close() })
		dials = append(dials, strings.TrimPrefix(hs.URL, "https://"))
	}
	startCaddy(t, globalOptions+fmt.Sprintf(`http://localhost:9080 {
	llm_affinity
	reverse_proxy https://%s https://%s {
		lb_policy llm_affinity {
			scrape_interval 100ms
		}
		transport http {
			tls_insecure_skip_verify
		}
	}
}
`, dials[0], dials[1]))
	for i, dial := range dials {
		want := 1024 * (i + 1) * 16 // blocks of 16 tokens
		eventually(t, 10*time.Second, dial+"'s KV capacity in the admin view", func() bool {
			v := listedEngine(t, dial)
			return v != nil && v.KVCapacity == want
		})
		if v := engineView(t, dial); v.LastError != "" {
			t.Errorf("%s: last scrape error %q after a successful scrape", dial, v.LastError)
		}
	}
	// And requests still go through the proxy over TLS.
	if c := post(t, "/v1/completions", map[string]any{"model": kvsim.DefaultModel, "prompt": "hello", "max_tokens": 4}); c.status != 200 {
		t.Fatalf("completion over TLS: %d %s", c.status, c.body)
	}
}
