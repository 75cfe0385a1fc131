package integration

import (
	"compress/gzip"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/llmaffinity/caddy-llm-affinity/kvsim"
)

// The engines behind these tests wrap kvsim as real deployments do: an API
// key, a connection that breaks, a compressing front. The router's
// scrapes pass (they would carry the key); a client's request is marked.
const clientMark = "X-Test-Client"

// wrappedFleet starts one kvsim replica per wrap, each behind its wrapper.
func wrappedFleet(t *testing.T, wraps ...func(http.Handler) http.Handler) []*replica {
	t.Helper()
	var fleet []*replica
	for i, wrap := range wraps {
		name := fmt.Sprintf("%s-%d", t.Name(), i)
		sim, err := kvsim.NewServer(kvsim.ServerConfig{Name: name, Speed: 1})
		if err != nil {
			t.Fatal(err)
		}
		hs := httptest.NewServer(wrap(sim))
		t.Cleanup(func() { hs.CloseClientConnections(); hs.Close(); sim.Close() })
		fleet = append(fleet, &replica{name: name, sim: sim, http: hs})
	}
	return fleet
}

func getModels(t *testing.T) (*http.Response, []byte) {
	t.Helper()
	req, _ := http.NewRequest("GET", routerURL+"/v1/models", nil)
	req.Header.Set(clientMark, "1")
	resp, err := http.DefaultClient.Do(req) // Go asks for gzip
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, b
}

// TestModelsKeepTheEnginesAnswer: the router replaces only the body of an
// engine's 200: an engine behind an API key refuses a client without it
// (401), whether it is free or Caddy counts it unavailable (then Caddy's
// 503: never the router's list without the key), and an engine that
// breaks the connection gives the proxy's 502.
func TestModelsKeepTheEnginesAnswer(t *testing.T) {
	release := make(chan struct{})
	keyed := func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path == "/v1/models" && r.Header.Get(clientMark) != "" && r.Header.Get("Authorization") != "Bearer k" {
				w.Header().Set("Content-Type", "application/json")
				w.WriteHeader(http.StatusUnauthorized)
				io.WriteString(w, `{"error":"Unauthorized"}`)
				return
			}
			if r.URL.Path == "/v1/chat/completions" {
				<-release
			}
			next.ServeHTTP(w, r)
		})
	}
	fleet := wrappedFleet(t, keyed)
	startCaddy(t, caddyfile(fleet, "", "scrape_interval 100ms\n\t\t\tmodels_interval 100ms", "unhealthy_request_count 1"))
	waitForModelLists(t, fleet)
	if resp, b := getModels(t); resp.StatusCode != 401 {
		t.Fatalf("free engine: %d %s, want its 401", resp.StatusCode, b)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		resp, err := http.Post(routerURL+"/v1/chat/completions", "application/json",
			strings.NewReader(fmt.Sprintf(`{"model":%q,"max_tokens":2,"messages":[{"role":"user","content":"hi"}]}`, kvsim.DefaultModel)))
		if err == nil {
			resp.Body.Close()
		}
	}()
	eventually(t, 5*time.Second, "a completion in flight", func() bool { return upstreams(t)[fleet[0].dial()].InFlight == 1 })
	resp, b := getModels(t)
	close(release)
	<-done
	if resp.StatusCode == http.StatusOK {
		t.Errorf("engine unavailable to Caddy: 200 %s without the key", b)
	}

	broken := wrappedFleet(t, func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path == "/v1/models" && r.Header.Get(clientMark) != "" {
				c, _, _ := http.NewResponseController(w).Hijack()
				c.Close()
				return
			}
			next.ServeHTTP(w, r)
		})
	})
	startCaddy(t, caddyfile(broken, "", "scrape_interval 100ms\n\t\t\tmodels_interval 100ms", ""))
	waitForModelLists(t, broken)
	if resp, b := getModels(t); resp.StatusCode != http.StatusBadGateway {
		t.Errorf("engine broke the connection: %d %s, want the proxy's 502", resp.StatusCode, b)
	}
}

// TestModelsListBehindACompressingEngine: a client that accepts gzip (Go,
// httpx, browsers) still gets the whole pool's list when an engine sits
// behind a compressing front: the engine is asked for identity.
func TestModelsListBehindACompressingEngine(t *testing.T) {
	gzipped := func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path != "/v1/models" || !strings.Contains(r.Header.Get("Accept-Encoding"), "gzip") {
				next.ServeHTTP(w, r)
				return
			}
			w.Header().Set("Content-Encoding", "gzip")
			z := gzip.NewWriter(w)
			defer z.Close()
			next.ServeHTTP(gzipWriter{w, z}, r)
		})
	}
	fleet := wrappedFleet(t, gzipped, gzipped)
	startCaddy(t, caddyfile(fleet, "", "scrape_interval 100ms\n\t\t\tmodels_interval 100ms", ""))
	loadTenantAdapters(t, fleet)
	want := []string{kvsim.DefaultModel, "tenant-0", "tenant-1"}
	for range 6 {
		resp, b := getModels(t)
		var list struct{ Data []struct{ ID string } }
		if resp.StatusCode != 200 || json.Unmarshal(b, &list) != nil {
			t.Fatalf("%d %q", resp.StatusCode, b)
		}
		var ids []string
		for _, m := range list.Data {
			ids = append(ids, m.ID)
		}
		slices.Sort(ids)
		if !slices.Equal(ids, want) {
			t.Fatalf("models %v, want %v", ids, want)
		}
	}
}

type gzipWriter struct {
	http.ResponseWriter
	z *gzip.Writer
}

func (g gzipWriter) Write(p []byte) (int, error) { return g.z.Write(p) }

// loadTenantAdapters loads adapter tenant-i on replica i directly (not
// through the router) and waits until the router's model lists show them.
func loadTenantAdapters(t *testing.T, fleet []*replica) {
	t.Helper()
	for i, r := range fleet {
		resp, err := http.Post(r.http.URL+"/v1/load_lora_adapter", "application/json",
			strings.NewReader(fmt.Sprintf(`{"lora_name":"tenant-%d","lora_path":"/adapters/tenant-%d"}`, i, i)))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
	}
	eventually(t, 10*time.Second, "every replica's adapter in the router's lists", func() bool {
		for i, r := range fleet {
			if v := listedEngine(t, r.dial()); v == nil || !slices.Contains(v.Models, fmt.Sprintf("tenant-%d", i)) {
				return false
			}
		}
		return true
	})
}
