package integration

import (
	"encoding/pem"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/llmaffinity/caddy-llm-affinity/kvsim"
)

// TestScrapesEnginesOverHTTPS: engines served over TLS (a certificate the
// system does not trust, as Caddy's internal CA's would not be) behind
// reverse_proxy https://… are scraped the way the proxy reaches them, with
// its TLS settings (tls_insecure_skip_verify, or the certificate as a
// trust pool), and the admin view shows their KV capacity.
func TestScrapesEnginesOverHTTPS(t *testing.T) {
	for _, tc := range []struct {
		name string
		tls  func(*httptest.Server) string // the transport's TLS settings
	}{
		{"insecure skip verify", func(*httptest.Server) string { return "tls_insecure_skip_verify" }},
		{"trust pool", func(hs *httptest.Server) string {
			path := filepath.Join(t.TempDir(), "engines.pem")
			block := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: hs.Certificate().Raw})
			if err := os.WriteFile(path, block, 0o600); err != nil {
				t.Fatal(err)
			}
			return "tls_trust_pool file " + path
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var dials []string
			var first *httptest.Server
			for i := range 2 {
				sim, err := kvsim.NewServer(kvsim.ServerConfig{Name: fmt.Sprintf("tls-%d", i), Engine: kvsim.Config{NumGPUBlocks: 1024 * (i + 1)}})
				if err != nil {
					t.Fatal(err)
				}
				hs := httptest.NewTLSServer(sim) // every one serves httptest's one certificate
				t.Cleanup(func() { hs.CloseClientConnections(); hs.Close(); sim.Close() })
				dials = append(dials, strings.TrimPrefix(hs.URL, "https://"))
				if first == nil {
					first = hs
				}
			}
			startCaddy(t, globalOptions+fmt.Sprintf(`http://%s {
	llm_affinity
	reverse_proxy https://%s https://%s {
		lb_policy llm_affinity {
			scrape_interval 100ms
		}
		transport http {
			%s
		}
	}
}
`, routerHost, dials[0], dials[1], tc.tls(first)))
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
		})
	}
}

// TestScrapesExceptedPortsOverHTTP: with a transport that uses TLS but
// lists an engine's port in tls_except_ports, the proxy reaches that
// engine over plain HTTP, and so does the scraper; the TLS engine is
// still scraped over https.
func TestScrapesExceptedPortsOverHTTP(t *testing.T) {
	var dials []string
	for i, newServer := range []func(http.Handler) *httptest.Server{httptest.NewTLSServer, httptest.NewServer} {
		sim, err := kvsim.NewServer(kvsim.ServerConfig{Name: fmt.Sprintf("except-%d", i), Engine: kvsim.Config{NumGPUBlocks: 1024 * (i + 1)}})
		if err != nil {
			t.Fatal(err)
		}
		hs := newServer(sim)
		t.Cleanup(func() { hs.CloseClientConnections(); hs.Close(); sim.Close() })
		dials = append(dials, hs.Listener.Addr().String())
	}
	_, plainPort, _ := net.SplitHostPort(dials[1])
	startCaddy(t, globalOptions+fmt.Sprintf(`http://%s {
	llm_affinity
	reverse_proxy %s %s {
		lb_policy llm_affinity {
			scrape_interval 100ms
		}
		transport http {
			tls
			tls_insecure_skip_verify
			tls_except_ports %s
		}
	}
}
`, routerHost, dials[0], dials[1], plainPort))
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
	// Both engines answer through the proxy, each over its own scheme.
	for range 4 {
		if c := post(t, "/v1/completions", map[string]any{"model": kvsim.DefaultModel, "prompt": "hello", "max_tokens": 4}); c.status != 200 {
			t.Fatalf("completion: %d %s", c.status, c.body)
		}
	}
}
