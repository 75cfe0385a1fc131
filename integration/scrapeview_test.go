package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	"github.com/llmaffinity/caddy-llm-affinity/caddyllm"
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
		v := listedEngine(t, r.dial())
		return v != nil && v.Errors > 0 && strings.Contains(v.LastError, "500")
	})
	failing.Store(false)
	eventually(t, 10*time.Second, "a successful scrape clearing the error", func() bool {
		v := listedEngine(t, r.dial())
		return v != nil && v.LastError == "" && v.KVCapacity > 0
	})
	if v := engineView(t, r.dial()); v.Errors == 0 {
		t.Errorf("the failures' count was lost: %+v", v)
	}
}

// TestLastTTFTNonStreaming: a non-streaming completion's first token is
// taken to come with its response headers, so the admin view's
// last_ttft_seconds is set by it (it was 0 for such requests once).
func TestLastTTFTNonStreaming(t *testing.T) {
	fleet := startFleet(t, 1, 1, kvsim.Config{})
	startCaddy(t, caddyfile(fleet, "", "", ""))
	if c := post(t, "/v1/completions", map[string]any{"model": kvsim.DefaultModel, "prompt": text("ttft", 4000), "max_tokens": 8}); c.status != 200 {
		t.Fatalf("completion: %d %s", c.status, c.body)
	}
	eventually(t, 5*time.Second, "the request's end in the admin view", func() bool {
		u, ok := upstreams(t)[fleet[0].dial()]
		return ok && u.Completed == 1
	})
	if u := upstream(t, fleet[0].dial()); u.LastTTFTSeconds <= 0 {
		t.Fatalf("last_ttft_seconds = %v after a non-streaming completion", u.LastTTFTSeconds)
	}
}

// listedEngine is dial's engine view in the admin API, nil while the API
// does not list dial (a config just loaded) or has no engine view of it.
func listedEngine(t *testing.T, dial string) *caddyllm.EngineView {
	t.Helper()
	if u, ok := upstreams(t)[dial]; ok {
		return u.Engine
	}
	return nil
}

// waitForModelLists waits until the admin view shows each engine's model
// list.
func waitForModelLists(t *testing.T, fleet []*replica) {
	t.Helper()
	eventually(t, 10*time.Second, "the engines' model lists", func() bool {
		for _, r := range fleet {
			if v := listedEngine(t, r.dial()); v == nil || len(v.Models) == 0 {
				return false
			}
		}
		return true
	})
}

// TestLoadedAdapterRoutedAtOnce: an adapter loaded through the router
// (vLLM's POST /v1/load_lora_adapter) makes the router fetch that
// engine's model list again once the load is answered, so the adapter's
// requests are routed at once; they got the router's 404
// model_not_found until the next models_interval (here an hour).
func TestLoadedAdapterRoutedAtOnce(t *testing.T) {
	fleet := startFleet(t, 2, 1, kvsim.Config{})
	startCaddy(t, caddyfile(fleet, "", "scrape_interval 100ms\n\t\t\tmodels_interval 1h", ""))
	waitForModelLists(t, fleet)
	resp, err := http.Post(routerURL+"/v1/load_lora_adapter", "application/json",
		strings.NewReader(`{"lora_name":"tenant-new","lora_path":"/adapters/tenant-new"}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	loadedOn := resp.Header.Get(kvsim.ReplicaHeader)
	if resp.StatusCode != http.StatusOK || loadedOn == "" {
		t.Fatalf("load: %d on %q", resp.StatusCode, loadedOn)
	}
	eventually(t, 10*time.Second, "the adapter routed to the engine that loaded it", func() bool {
		c := post(t, "/v1/completions", map[string]any{"model": "tenant-new", "prompt": "hi", "max_tokens": 2})
		return c.status == http.StatusOK && c.replica == loadedOn
	})
}

// TestAdapterLoadTakesTheEmptiestEngine: a runtime load through the
// router goes, among the engines not listing the adapter, to one holding
// the fewest adapters the router sent it: the engine that loads it serves
// all its requests, and one with a GPU slot to spare evicts nothing.
func TestAdapterLoadTakesTheEmptiestEngine(t *testing.T) {
	fleet := startFleet(t, 3, 20, kvsim.Config{Adapters: []string{"tenant-a", "tenant-b"}, MaxLoRAs: 1})
	startCaddy(t, caddyfile(fleet, "", "scrape_interval 100ms\n\t\t\tmodels_interval 1h", ""))
	waitForModelLists(t, fleet)
	used := map[string]bool{}
	for _, a := range []string{"tenant-a", "tenant-b"} {
		c := post(t, "/v1/completions", map[string]any{"model": a, "prompt": "hi", "max_tokens": 2})
		if c.status != 200 {
			t.Fatalf("%s: %d %s", a, c.status, c.body)
		}
		used[c.replica] = true
	}
	if len(used) != 2 {
		t.Fatalf("two adapters on %d engines, want 2 (free slots first)", len(used))
	}
	resp, err := http.Post(routerURL+"/v1/load_lora_adapter", "application/json",
		strings.NewReader(`{"lora_name":"tenant-c","lora_path":"/adapters/tenant-c"}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if on := resp.Header.Get(kvsim.ReplicaHeader); resp.StatusCode != 200 || used[on] {
		t.Fatalf("load: %d on %s, which holds an adapter already (used: %v)", resp.StatusCode, on, used)
	}
}

// TestAdapterCallsGoWhereTheyCount: vLLM's runtime adapter API names the
// adapter in lora_name. Through the router, a load goes to an engine whose
// list lacks the adapter (the second load of one name to the other
// engine, not to the one that has it, which would refuse it), and an
// unload to the engine listing it (it went anywhere, and most unloads got
// the engines' 404); once that engine has unloaded it, the adapter's next
// request, sent at once, does not go back there.
func TestAdapterCallsGoWhereTheyCount(t *testing.T) {
	fleet := startFleet(t, 3, 1, kvsim.Config{})
	startCaddy(t, caddyfile(fleet, "", "scrape_interval 100ms\n\t\t\tmodels_interval 1h", ""))
	waitForModelLists(t, fleet)
	call := func(path, name string) (int, string) {
		t.Helper()
		resp, err := http.Post(routerURL+path, "application/json",
			strings.NewReader(`{"lora_name":"`+name+`","lora_path":"/adapters/`+name+`"}`))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode, resp.Header.Get(kvsim.ReplicaHeader)
	}
	for round := range 4 {
		name := fmt.Sprintf("tenant-%d", round)
		loaded := map[string]bool{}
		for range 2 {
			status, on := call("/v1/load_lora_adapter", name)
			if status != http.StatusOK || loaded[on] {
				t.Fatalf("%s: load answered %d on %s, loaded before on %v", name, status, on, loaded)
			}
			loaded[on] = true
			// The next load must see this one in the engine's list.
			eventually(t, 10*time.Second, "the load in the list", func() bool {
				c := post(t, "/v1/completions", map[string]any{"model": name, "prompt": "hi", "max_tokens": 1})
				return c.status == http.StatusOK
			})
		}
		for range 2 {
			status, on := call("/v1/unload_lora_adapter", name)
			if status != http.StatusOK || !loaded[on] {
				t.Fatalf("%s: unload answered %d on %s, loaded on %v", name, status, on, loaded)
			}
			delete(loaded, on)
			c := post(t, "/v1/completions", map[string]any{"model": name, "prompt": "hi", "max_tokens": 1})
			if len(loaded) > 0 && (c.status != http.StatusOK || c.replica == on) ||
				len(loaded) == 0 && (c.status != http.StatusNotFound || !strings.Contains(c.body, "model_not_found")) {
				t.Fatalf("%s right after its unload on %s: %d from %s: %s", name, on, c.status, c.replica, c.body)
			}
		}
	}
}

// TestInplaceLoadReachesAHolder: a load with load_inplace (vLLM's hot swap
// of an adapter's weights) goes to an engine whose list has the adapter,
// where a load goes to one lacking it: there it was a first load, the
// holders kept the old weights and the fleet served two versions. It
// reaches one holder only; the other keeps its path. An in-place load of an
// adapter no engine lists is a first load.
func TestInplaceLoadReachesAHolder(t *testing.T) {
	fleet := startFleet(t, 3, 1, kvsim.Config{})
	for _, r := range fleet[1:] {
		resp, err := http.Post(r.http.URL+"/v1/load_lora_adapter", "application/json",
			strings.NewReader(`{"lora_name":"tenant","lora_path":"/adapters/tenant-v1"}`))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
	}
	startCaddy(t, caddyfile(fleet, "", "scrape_interval 100ms\n\t\t\tmodels_interval 1h", ""))
	eventually(t, 10*time.Second, "the adapter on its holders' lists and the other's list known", func() bool {
		for _, r := range fleet {
			v := listedEngine(t, r.dial())
			if v == nil || len(v.Models) == 0 || slices.Contains(v.Models, "tenant") != (r != fleet[0]) {
				return false
			}
		}
		return true
	})
	root := func(r *replica) string {
		t.Helper()
		resp, err := http.Get(r.http.URL + "/v1/models")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var models struct{ Data []struct{ ID, Root string } }
		if err := json.NewDecoder(resp.Body).Decode(&models); err != nil {
			t.Fatal(err)
		}
		for _, m := range models.Data {
			if m.ID == "tenant" {
				return m.Root
			}
		}
		return ""
	}
	for i := range 4 {
		path := fmt.Sprintf("/adapters/tenant-v%d", i+2)
		c := post(t, "/v1/load_lora_adapter", map[string]any{"lora_name": "tenant", "lora_path": path, "load_inplace": true})
		if c.status != http.StatusOK || c.replica == fleet[0].name {
			t.Fatalf("in-place load %d: %d from %s, want 200 from a holder (%s or %s): %s",
				i, c.status, c.replica, fleet[1].name, fleet[2].name, c.body)
		}
		if got := root(named(fleet, c.replica)); got != path {
			t.Fatalf("in-place load %d answered by %s, whose adapter's path is %q, want %q", i, c.replica, got, path)
		}
		other := fleet[1]
		if other.name == c.replica {
			other = fleet[2]
		}
		if got := root(other); got == path {
			t.Fatalf("in-place load %d reached %s too", i, other.name)
		}
	}
	if got := root(fleet[0]); got != "" {
		t.Fatalf("%s, which lacked the adapter, has it now (%q)", fleet[0].name, got)
	}
	c := post(t, "/v1/load_lora_adapter", map[string]any{"lora_name": "fresh", "lora_path": "/adapters/fresh", "load_inplace": true})
	if c.status != http.StatusOK || !strings.Contains(c.body, "added successfully") {
		t.Fatalf("in-place load of an adapter no engine has: %d %s", c.status, c.body)
	}
}

// TestDirectlyLoadedAdapterFound: an adapter loaded on an engine directly,
// not through the router, is routed there on its first request: before
// answering that no engine serves a model, the router fetches the
// engines' model lists again (those not fetched since the request
// arrived) and decides again as each comes. It answered 404
// model_not_found until the next models_interval (here an hour). A model
// no engine lists still gets the 404.
func TestDirectlyLoadedAdapterFound(t *testing.T) {
	fleet := startFleet(t, 2, 1, kvsim.Config{})
	startCaddy(t, caddyfile(fleet, "", "scrape_interval 100ms\n\t\t\tmodels_interval 1h", ""))
	waitForModelLists(t, fleet)
	resp, err := http.Post(fleet[1].http.URL+"/v1/load_lora_adapter", "application/json",
		strings.NewReader(`{"lora_name":"tenant-direct","lora_path":"/adapters/tenant-direct"}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("load on the engine: %d", resp.StatusCode)
	}
	if c := post(t, "/v1/completions", map[string]any{"model": "tenant-direct", "prompt": "hi", "max_tokens": 2}); c.status != http.StatusOK || c.replica != fleet[1].name {
		t.Fatalf("the directly loaded adapter's first request: %d from %q, want 200 from %s: %s", c.status, c.replica, fleet[1].name, c.body)
	}
	if c := post(t, "/v1/completions", map[string]any{"model": "no-such-model", "prompt": "hi", "max_tokens": 2}); c.status != http.StatusNotFound || !strings.Contains(c.body, "model_not_found") {
		t.Fatalf("a model no engine lists: %d %s", c.status, c.body)
	}
}

// TestModelsListTheWholeFleet: GET /v1/models through the router lists
// every model and adapter its engines serve, each once and as the engine
// described it, whichever replica would have answered: with an adapter
// loaded on each replica directly, one engine's own list (what the request
// got before) lacks the other's. A drained replica's adapter leaves the
// list. Read with the official OpenAI client.
func TestModelsListTheWholeFleet(t *testing.T) {
	fleet := startFleet(t, 2, 1, kvsim.Config{})
	startCaddy(t, caddyfile(fleet, "", "scrape_interval 100ms\n\t\t\tmodels_interval 1s", "header_down X-Proxy-Header kept"))
	loadTenantAdapters(t, fleet)
	client := openai.NewClient(option.WithBaseURL(routerURL+"/v1/"), option.WithAPIKey("unused"), option.WithMaxRetries(0))
	list := func() []string {
		t.Helper()
		page, err := client.Models.List(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		var ids []string
		for _, m := range page.Data {
			ids = append(ids, m.ID)
			if m.ID == kvsim.DefaultModel && !strings.Contains(m.RawJSON(), `"max_model_len"`) {
				t.Errorf("the base model's entry lost the engine's fields: %s", m.RawJSON())
			}
		}
		slices.Sort(ids)
		return ids
	}
	// The answer is an engine's, its body replaced: its headers and the
	// proxy's header_down stay.
	resp, err := http.Get(routerURL + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 || resp.Header.Get(kvsim.ReplicaHeader) == "" || resp.Header.Get("X-Proxy-Header") != "kept" {
		t.Fatalf("%d, headers %v: want the engine's and header_down's", resp.StatusCode, resp.Header)
	}
	want := []string{kvsim.DefaultModel, "tenant-0", "tenant-1"}
	for range 6 { // two replicas: one engine's answer would show within a few
		if got := list(); !slices.Equal(got, want) {
			t.Fatalf("models %v, want %v", got, want)
		}
	}
	drainURL := adminURL + "/llm_affinity/upstreams/" + fleet[1].dial() + "/drain"
	if resp, err := http.Post(drainURL, "application/json", nil); err != nil || resp.StatusCode/100 != 2 {
		t.Fatalf("drain: %v %v", resp, err)
	}
	if got := list(); !slices.Equal(got, want[:2]) {
		t.Fatalf("with replica 1 drained: models %v, want %v", got, want[:2])
	}
}

// TestConfiguredCapacityShownAtOnce: the admin view shows an upstream's
// configured kv_capacity before any request was routed there; it showed
// 0 until the first decision.
func TestConfiguredCapacityShownAtOnce(t *testing.T) {
	fleet := startFleet(t, 2, 1, kvsim.Config{})
	startCaddy(t, caddyfile(fleet, "", "kv_capacity 65536", ""))
	for _, r := range fleet {
		if u, ok := upstreams(t)[r.dial()]; !ok || u.KVCapacityTokens != 65536 || u.InFlight != 0 || u.Completed != 0 {
			t.Fatalf("%s before any request: listed %v, %+v", r.dial(), ok, u)
		}
	}
}

// TestEnvPlaceholderUpstreamIsScraped: an upstream named with an
// environment placeholder ("127.0.0.1:{env.…}", which Caddy replaces in
// every request and its active health checks replace too) is one fixed
// engine, and the router scrapes it: its model list and KV capacity show
// in the admin view under the name the config gives it. It was skipped
// as if its address were known only per request.
func TestEnvPlaceholderUpstreamIsScraped(t *testing.T) {
	fleet := startFleet(t, 1, 1, kvsim.Config{})
	host, port, err := net.SplitHostPort(fleet[0].dial())
	if err != nil {
		t.Fatal(err)
	}
	t.Setenv("LLM_AFFINITY_TEST_ENGINE_PORT", port)
	dial := host + ":{env.LLM_AFFINITY_TEST_ENGINE_PORT}"
	config := strings.Replace(caddyfile(fleet, "", "scrape_interval 100ms", ""), fleet[0].dial(), dial, 1)
	startCaddy(t, config)
	eventually(t, 10*time.Second, "the engine's scraped state under its configured name", func() bool {
		v := listedEngine(t, dial)
		return v != nil && v.KVCapacity > 0 && len(v.Models) > 0
	})
	if c := post(t, "/v1/completions", map[string]any{"model": kvsim.DefaultModel, "prompt": "hello", "max_tokens": 2}); c.status != http.StatusOK {
		t.Fatalf("completion through %s: %d %s", dial, c.status, c.body)
	}
}
