package integration

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync/atomic"
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
		fleet = append(fleet, startReplica(t, fmt.Sprintf("%s-%d", t.Name(), i), 1, kvsim.Config{},
			func(_ string, sim http.Handler) http.Handler { return wrap(sim) }))
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
	startCaddy(t, caddyfile(fleet, "", "scrape_interval 100ms\n\t\t\tmodels_interval 1s", "unhealthy_request_count 1"))
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
	startCaddy(t, caddyfile(broken, "", "scrape_interval 100ms\n\t\t\tmodels_interval 1s", ""))
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
	startCaddy(t, caddyfile(fleet, "", "scrape_interval 100ms\n\t\t\tmodels_interval 1s", ""))
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

// TestHeadModelsAsGet: HEAD /v1/models has the headers of GET's answer,
// the whole pool's list (RFC 9110: the same headers), not one engine's.
func TestHeadModelsAsGet(t *testing.T) {
	fleet := startFleet(t, 2, 1, kvsim.Config{})
	startCaddy(t, caddyfile(fleet, "", "scrape_interval 100ms\n\t\t\tmodels_interval 1s", ""))
	loadTenantAdapters(t, fleet) // each engine's list differs from the pool's
	resp, list := getModels(t)
	if resp.StatusCode != 200 || !strings.Contains(string(list), "tenant-0") || !strings.Contains(string(list), "tenant-1") {
		t.Fatalf("GET: %d %s", resp.StatusCode, list)
	}
	for range 4 { // on both engines
		resp, err := http.Head(routerURL + "/v1/models")
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || resp.ContentLength != int64(len(list)) || len(b) != 0 {
			t.Fatalf("HEAD: %d, Content-Length %d, %d bytes of body; GET's list is %d bytes", resp.StatusCode, resp.ContentLength, len(b), len(list))
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

// modelsScraped waits until the router has every replica's model list.
func modelsScraped(t *testing.T, fleet []*replica) {
	t.Helper()
	eventually(t, 10*time.Second, "every model list scraped", func() bool {
		ups := upstreams(t)
		for _, r := range fleet {
			if e := ups[r.dial()].Engine; e == nil || len(e.Models) == 0 {
				return false
			}
		}
		return true
	})
}

// TestContextLengthPerReplica: replicas whose engines serve the model with
// different context lengths (max_model_len): a request longer than one's
// goes to the other, never to the engine that would refuse it; one longer
// than every context gets 400 context_length_exceeded from the router at
// once. The pool's models list gives the longest context.
func TestContextLengthPerReplica(t *testing.T) {
	short := startReplica(t, t.Name()+"-short", 20, kvsim.Config{MaxModelLen: 4096}, nil)
	long := startReplica(t, t.Name()+"-long", 20, kvsim.Config{}, nil) // 131,072
	fleet := []*replica{short, long}
	startCaddy(t, caddyfile(fleet, "", "scrape_interval 100ms\n\t\t\tmodels_interval 1s", ""))
	modelsScraped(t, fleet)
	for i := range 6 {
		// About 5,000 tokens with max_tokens: over short's context.
		c := post(t, "/v1/completions", map[string]any{"model": kvsim.DefaultModel, "prompt": text(fmt.Sprint("ctx", i), 20_000), "max_tokens": 8})
		if c.status != 200 || c.replica != long.name {
			t.Fatalf("request %d: %d from %q: %s", i, c.status, c.replica, c.body)
		}
		// Short ones go anywhere.
		if c := post(t, "/v1/completions", map[string]any{"model": kvsim.DefaultModel, "prompt": fmt.Sprint("short ", i), "max_tokens": 8}); c.status != 200 {
			t.Fatalf("short request %d: %d: %s", i, c.status, c.body)
		}
	}
	c := post(t, "/v1/completions", map[string]any{"model": kvsim.DefaultModel, "prompt": "hi", "max_tokens": 200_000})
	if c.status != 400 || !strings.Contains(c.body, `"code":"context_length_exceeded"`) || !strings.Contains(c.explain, "blocked_by=context_length") {
		t.Fatalf("max_tokens over every context: %d %s (%s)", c.status, c.body, c.explain)
	}
	_, body := getModels(t)
	var list struct {
		Data []struct {
			ID          string `json:"id"`
			MaxModelLen int    `json:"max_model_len"`
		} `json:"data"`
	}
	if err := json.Unmarshal(body, &list); err != nil || len(list.Data) != 1 || list.Data[0].MaxModelLen != 131072 {
		t.Fatalf("models list %s (%v)", body, err)
	}
}

// TestDownReplicaKeepsItsModels: a replica whose engine stopped keeps the
// model list it last gave, also across a reload: a model no replica ever
// listed gets the router's 404 (it got a 503 saying the model might be
// on the engine that is down).
func TestDownReplicaKeepsItsModels(t *testing.T) {
	fleet := startFleet(t, 2, 20, kvsim.Config{})
	config := func(deadline string) string {
		return caddyfile(fleet, "", "scrape_interval 100ms\n\t\t\tmodels_interval 1s\n\t\t\tdrain_deadline "+deadline, "")
	}
	tester := startCaddy(t, config("30s"))
	down := fleet[1]
	modelsScraped(t, fleet)
	down.http.CloseClientConnections()
	down.http.Close()
	// Its list is older than three models intervals: it used to lapse.
	eventually(t, 10*time.Second, "the stopped replica's list is old", func() bool {
		e := upstream(t, down.dial()).Engine
		return e != nil && strings.Contains(e.LastError, "refused") && e.AgeSeconds > 1
	})
	unknown := func(when string) {
		t.Helper()
		c := post(t, "/v1/completions", map[string]any{"model": "no-such-model", "prompt": "hi", "max_tokens": 2})
		if c.status != 404 || !strings.Contains(c.body, `"code":"model_not_found"`) || c.header.Get("Retry-After") != "" {
			t.Fatalf("%s: %d %s (%s)", when, c.status, c.body, c.explain)
		}
	}
	unknown("with a replica down")
	reload(t, tester, config("20s"))
	unknown("after a reload")
}

// TestWholeFleetDownAnswers503: with every engine stopped, a request gets
// the router's 503 not_running with Retry-After, after one attempt when
// the scrapes found nothing listening (an engine may have started since),
// and after one at each engine without scraping; before, it was sent to
// engines in turn five times and got the proxy's empty 502.
func TestWholeFleetDownAnswers503(t *testing.T) {
	for _, tc := range []struct {
		name, policy, proxy string
		attempts            int
	}{
		{"scraped", "scrape_interval 100ms", "", 1},
		// Caddy's own retry does not say how its attempt failed: a down
		// engine tried is taken as refused.
		{"scraped, Caddy retries", "scrape_interval 100ms", "lb_retries 2", 1},
		{"not scraped", "", "", 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fleet := startFleet(t, 3, 20, kvsim.Config{})
			startCaddy(t, caddyfile(fleet, "", tc.policy, tc.proxy))
			// No connection kept alive from the first request: one the
			// proxy reused after the engine closed it would be sent again
			// once more (a dropped connection, not a refused one).
			for _, r := range fleet {
				r.http.Config.SetKeepAlivesEnabled(false)
			}
			body := map[string]any{"model": kvsim.DefaultModel, "prompt": "hi", "max_tokens": 2}
			if c := post(t, "/v1/completions", body); c.status != 200 {
				t.Fatalf("fleet up: %d %s", c.status, c.body)
			}
			for _, r := range fleet {
				r.http.CloseClientConnections()
				r.http.Close()
			}
			if tc.policy != "" {
				eventually(t, 10*time.Second, "every engine's scrape refused", func() bool {
					for _, r := range fleet {
						if e := upstream(t, r.dial()).Engine; e == nil || !strings.Contains(e.LastError, "refused") {
							return false
						}
					}
					return true
				})
			}
			c := post(t, "/v1/completions", body)
			want := fmt.Sprintf("attempt=%d", tc.attempts+1)
			if c.status != 503 || c.header.Get("Retry-After") == "" || !strings.Contains(c.body, `"service_unavailable"`) ||
				!strings.Contains(c.explain, "blocked_by=not_running") || !strings.Contains(c.explain, want) {
				t.Fatalf("whole fleet down: %d %s (%s), want 503 not_running with Retry-After, %s", c.status, c.body, c.explain, want)
			}
		})
	}
}

// TestModelRequiredInAMixedPool: replicas serving different models: a
// request that names none gets 400 from the router (an engine would serve
// its own, so the model would depend on the replica); one that names a
// model goes to the replica serving it.
func TestModelRequiredInAMixedPool(t *testing.T) {
	llama := startReplica(t, t.Name()+"-llama", 20, kvsim.Config{}, nil)
	qwen := startReplica(t, t.Name()+"-qwen", 20, kvsim.Config{Model: "Qwen/Qwen2.5-7B-Instruct"}, nil)
	fleet := []*replica{llama, qwen}
	startCaddy(t, caddyfile(fleet, "", "scrape_interval 100ms\n\t\t\tmodels_interval 1s", ""))
	modelsScraped(t, fleet)
	for _, body := range []string{`{"prompt":"hi","max_tokens":2}`, `{"model":"","prompt":"hi","max_tokens":2}`} {
		c := postRaw(t, "/v1/completions", []byte(body))
		if c.status != 400 || !strings.Contains(c.body, `"param":"model"`) || !strings.Contains(c.body, "must provide a model") {
			t.Fatalf("%s: %d %s", body, c.status, c.body)
		}
	}
	for range 4 {
		if c := post(t, "/v1/completions", map[string]any{"model": "Qwen/Qwen2.5-7B-Instruct", "prompt": "hi", "max_tokens": 2}); c.status != 200 || c.replica != qwen.name {
			t.Fatalf("qwen: %d from %q", c.status, c.replica)
		}
	}
}

// TestPassThroughGoesWhereTheModelIs: requests the router does not route
// by their prompt but that name a model (here embeddings, which kvsim
// does not serve: a stub answers them, as vLLM does, only for its own
// model) go to an upstream serving that model; a model no upstream lists
// gets the router's 404.
func TestPassThroughGoesWhereTheModelIs(t *testing.T) {
	embeddings := func(model string) func(string, http.Handler) http.Handler {
		return func(name string, sim http.Handler) http.Handler {
			return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				if r.URL.Path != "/v1/embeddings" {
					sim.ServeHTTP(w, r)
					return
				}
				var body struct{ Model string }
				if json.NewDecoder(r.Body).Decode(&body) != nil || body.Model != model && body.Model != "" {
					w.WriteHeader(http.StatusNotFound)
					fmt.Fprintf(w, `{"error":{"message":"The model %q does not exist.","type":"NotFoundError","param":null,"code":404}}`, body.Model)
					return
				}
				w.Header().Set(kvsim.ReplicaHeader, name)
				fmt.Fprint(w, `{"object":"list","data":[{"object":"embedding","index":0,"embedding":[0.5]}]}`)
			})
		}
	}
	const qwenModel = "Qwen/Qwen2.5-7B-Instruct"
	llama := startReplica(t, t.Name()+"-llama", 20, kvsim.Config{}, embeddings(kvsim.DefaultModel))
	qwen := startReplica(t, t.Name()+"-qwen", 20, kvsim.Config{Model: qwenModel}, embeddings(qwenModel))
	fleet := []*replica{llama, qwen}
	// Lists refreshed every second stay known for three: a 2 MiB body
	// on a busy machine must not outlast them.
	startCaddy(t, caddyfile(fleet, "", "scrape_interval 100ms\n\t\t\tmodels_interval 1s", "lb_retries 2"))
	modelsScraped(t, fleet)
	for i := range 8 {
		for _, want := range fleet {
			model := kvsim.DefaultModel
			if want == qwen {
				model = qwenModel
			}
			c := postRaw(t, "/v1/embeddings", []byte(`{"model":"`+model+`","input":"hello `+fmt.Sprint(i)+`"}`))
			if c.status != 200 || c.replica != want.name {
				t.Fatalf("%s: %d from %q: %s", model, c.status, c.replica, c.body)
			}
		}
	}
	counts := func() [3]float64 {
		mfs := metricFamilies(t, adminURL+"/metrics")
		return [3]float64{
			counterValue(mfs, "caddy_llm_affinity_refused_total", "code", "model_not_found"),
			counterValue(mfs, "caddy_llm_affinity_decisions_total", "reason", "refused"),
			counterValue(mfs, "caddy_llm_affinity_decisions_total", "reason", "fallback"),
		}
	}
	before := counts()
	c := postRaw(t, "/v1/embeddings", []byte(`{"model":"no-such-model","input":"hello"}`))
	if c.status != 404 || !strings.Contains(c.body, `"code":"model_not_found"`) || !strings.Contains(c.body, "no-such-model") {
		t.Fatalf("an unknown model: %d %s", c.status, c.body)
	}
	// Counted once as refused, although Caddy asks the policy again after
	// it chose nothing (lb_retries 2).
	if after := counts(); after != [3]float64{before[0] + 1, before[1] + 1, before[2]} {
		t.Errorf("refused_total{model_not_found}, decisions_total{refused}, decisions_total{fallback}: %v, then %v", before, after)
	}
	// A batch of 2 MiB, the model after the input (the OpenAI Python
	// client's order), of a declared length and chunked: read whole, it
	// goes where the model is, and arrives whole.
	big := []byte(`{"input":["` + strings.Repeat("a passage to embed ", 2<<20/19) + `"],"model":"` + qwenModel + `"}`)
	for _, chunked := range []bool{false, true} {
		for range 4 {
			var body io.Reader = bytes.NewReader(big)
			if chunked {
				body = struct{ io.Reader }{body} // no length: sent chunked
			}
			resp, err := http.Post(routerURL+"/v1/embeddings", "application/json", body)
			if err != nil {
				t.Fatal(err)
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != 200 || resp.Header.Get(kvsim.ReplicaHeader) != qwen.name {
				t.Fatalf("2 MiB, chunked %v: %d from %q: %s", chunked, resp.StatusCode, resp.Header.Get(kvsim.ReplicaHeader), b)
			}
		}
	}
}

// TestPassThroughPrefersAListingEngine: one engine's model list is
// unknown (its /v1/models fails, as while vLLM loads the model, or a list
// gone stale); a request for the model the other engine lists goes to
// that one, never to the engine whose list is unknown, which answers 404
// for a model it does not serve.
func TestPassThroughPrefersAListingEngine(t *testing.T) {
	const qwenModel = "Qwen/Qwen2.5-7B-Instruct"
	llama := startReplica(t, t.Name()+"-llama", 20, kvsim.Config{}, func(name string, sim http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			switch r.URL.Path {
			case "/v1/models":
				http.Error(w, "loading", http.StatusServiceUnavailable)
			case "/v1/embeddings":
				w.WriteHeader(http.StatusNotFound)
				fmt.Fprint(w, `{"error":{"message":"not served here","type":"NotFoundError","param":null,"code":404}}`)
			default:
				sim.ServeHTTP(w, r)
			}
		})
	})
	qwen := startReplica(t, t.Name()+"-qwen", 20, kvsim.Config{Model: qwenModel}, func(name string, sim http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path == "/v1/embeddings" {
				w.Header().Set(kvsim.ReplicaHeader, name)
				fmt.Fprint(w, `{"object":"list","data":[{"object":"embedding","index":0,"embedding":[0.5]}]}`)
				return
			}
			sim.ServeHTTP(w, r)
		})
	})
	// Lists refreshed every second stay known for three.
	startCaddy(t, caddyfile([]*replica{llama, qwen}, "", "scrape_interval 100ms\n\t\t\tmodels_interval 1s", ""))
	modelsScraped(t, []*replica{qwen})
	for i := range 16 {
		c := postRaw(t, "/v1/embeddings", []byte(`{"model":"`+qwenModel+`","input":"hello `+fmt.Sprint(i)+`"}`))
		if c.status != 200 || c.replica != qwen.name {
			t.Fatalf("request %d for the model qwen lists: %d from %q: %s", i, c.status, c.replica, c.body)
		}
	}
}

// TestCORSForTheRoutersOwnAnswers: engines allow every origin (vLLM's
// default, and kvsim's); the router's own answers (a 404 for a model no
// engine lists) carry what Caddy's header directive adds, and
// `header ?Access-Control-Allow-Origin *`, the README's line, leaves an
// engine's answer with its own single value: a browser rejects two.
func TestCORSForTheRoutersOwnAnswers(t *testing.T) {
	fleet := startFleet(t, 2, 20, kvsim.Config{})
	startCaddy(t, globalOptions+fmt.Sprintf(`http://%s {
	header ?Access-Control-Allow-Origin *
	llm_affinity
	reverse_proxy %s {
		lb_policy llm_affinity {
			scrape_interval 100ms
			models_interval 1s
		}
	}
}
`, routerHost, dials(fleet)))
	modelsScraped(t, fleet)
	for _, c := range []struct {
		method, path, body string
		status             int
	}{
		{"POST", "/v1/completions", `{"model":"` + kvsim.DefaultModel + `","prompt":"hi","max_tokens":1}`, 200},
		{"POST", "/v1/completions", `{"model":"no-such-model","prompt":"hi"}`, 404},
		{"POST", "/v1/completions", `{"model":`, 400},
		{"OPTIONS", "/v1/completions", "", 200}, // the engine's answer to the preflight
	} {
		req, _ := http.NewRequest(c.method, routerURL+c.path, strings.NewReader(c.body))
		req.Header.Set("Origin", "https://app.example")
		req.Header.Set("Content-Type", "application/json")
		if c.method == "OPTIONS" {
			req.Header.Set("Access-Control-Request-Method", "POST")
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if got := resp.Header.Values("Access-Control-Allow-Origin"); resp.StatusCode != c.status || len(got) != 1 || got[0] != "*" {
			t.Errorf("%s %s: %d, Access-Control-Allow-Origin %q; want %d and one *", c.method, c.body, resp.StatusCode, got, c.status)
		}
	}
}

// TestOneContinue: a client that waits for 100 Continue gets one: the
// router reads the body (Caddy's server sends the 100), and does not ask
// the engine again, whose own 100 Caddy's proxy would pass on as a second
// one. Routed and pass-through requests alike.
func TestOneContinue(t *testing.T) {
	fleet := startFleet(t, 1, 20, kvsim.Config{})
	startCaddy(t, caddyfile(fleet, "max_body 256", "", ""))
	for _, c := range []struct {
		path, body string
		chunked    bool
	}{
		{"/v1/completions", `{"model":"` + kvsim.DefaultModel + `","prompt":"hi","max_tokens":1}`, false},
		{"/v1/load_lora_adapter", `{"lora_name":"continued","lora_path":"/adapters/continued"}`, false},
		// Chunked, over max_body: read in part, then streamed on.
		{"/v1/load_lora_adapter", `{"lora_name":"continued-in-part","lora_path":"/adapters/` + strings.Repeat("x", 300) + `"}`, true},
	} {
		conn, err := net.Dial("tcp", routerHost)
		if err != nil {
			t.Fatal(err)
		}
		framing := fmt.Sprintf("Content-Length: %d", len(c.body))
		if c.chunked {
			framing = "Transfer-Encoding: chunked"
		}
		fmt.Fprintf(conn, "POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n%s\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n",
			c.path, routerHost, framing)
		br := bufio.NewReader(conn)
		line, err := br.ReadString('\n')
		if err != nil || !strings.HasPrefix(line, "HTTP/1.1 100") {
			t.Fatalf("%s: before the body: %q %v", c.path, line, err)
		}
		if c.chunked {
			fmt.Fprintf(conn, "%x\r\n%s\r\n0\r\n\r\n", len(c.body), c.body)
		} else {
			fmt.Fprint(conn, c.body)
		}
		rest, _ := io.ReadAll(br)
		conn.Close()
		if n := strings.Count(string(rest), "HTTP/1.1 100"); n != 0 || !strings.Contains(string(rest), "HTTP/1.1 200") {
			t.Errorf("%s: %d more 100 Continue after the body; answer:\n%s", c.path, n, rest)
		}
	}
}

// TestAdapterUnloadedOnAnEngineLeavesItsList: an adapter unloaded on an
// engine by a call that did not pass the router (an operator's, straight
// to the engine) is still on the list the router last fetched; the
// engine's 404 for it takes it off that list at once and has the list
// fetched again, so the next requests go to the replica that still serves
// it, where before they went on to the warm replica, 404 after 404, until
// models_interval (here an hour) passed.
func TestAdapterUnloadedOnAnEngineLeavesItsList(t *testing.T) {
	fleet := startFleet(t, 2, 20, kvsim.Config{})
	for _, r := range fleet {
		resp, err := http.Post(r.http.URL+"/v1/load_lora_adapter", "application/json",
			strings.NewReader(`{"lora_name":"tenant","lora_path":"/adapters/tenant"}`))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
	}
	startCaddy(t, caddyfile(fleet, "", "scrape_interval 100ms\n\t\t\tmodels_interval 1h", ""))
	eventually(t, 10*time.Second, "the adapter on both replicas' lists", func() bool {
		for _, r := range fleet {
			if v := listedEngine(t, r.dial()); v == nil || !slices.Contains(v.Models, "tenant") {
				return false
			}
		}
		return true
	})
	body := chat([]msg{{"user", text("a tenant's long question", 2_000)}}, 2)
	body["model"] = "tenant"
	first := post(t, "/v1/chat/completions", body)
	if first.status != 200 {
		t.Fatalf("first request: %d %s", first.status, first.body)
	}
	home := named(fleet, first.replica)
	resp, err := http.Post(home.http.URL+"/v1/unload_lora_adapter", "application/json", strings.NewReader(`{"lora_name":"tenant"}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	// The warm replica is chosen once more and answers 404: it is how
	// the router learns of the unload. The body is current vLLM's (param
	// "model"), which the router recognises as a model not served.
	if c := post(t, "/v1/chat/completions", body); c.status != http.StatusNotFound || c.replica != home.name ||
		!strings.Contains(c.body, `"param":"model"`) {
		t.Fatalf("after the unload on %s: %d from %s (%s), want its 404", home.name, c.status, c.replica, c.body)
	}
	eventually(t, 10*time.Second, "the adapter off the list of "+home.name, func() bool {
		v := listedEngine(t, home.dial())
		return v != nil && !slices.Contains(v.Models, "tenant")
	})
	for i := range 5 {
		if c := post(t, "/v1/chat/completions", body); c.status != 200 || c.replica == home.name {
			t.Fatalf("request %d after the 404: %d from %s (%s)", i, c.status, c.replica, c.explain)
		}
	}
}

// TestModelsListAvoidsAFailingEngine: GET /v1/models goes to one engine,
// whose answer the router replaces with every engine's list; an engine
// whose last list fetch failed is not that one while another can answer,
// where one request in two got its 500.
func TestModelsListAvoidsAFailingEngine(t *testing.T) {
	fleet := startFleetServing(t, 2, 20, kvsim.Config{}, func(name string, sim http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if strings.HasSuffix(name, "-0") && r.URL.Path == "/v1/models" {
				http.Error(w, "model list broken", http.StatusInternalServerError)
				return
			}
			sim.ServeHTTP(w, r)
		})
	})
	startCaddy(t, caddyfile(fleet, "", "scrape_interval 100ms\n\t\t\tmodels_interval 1s", ""))
	eventually(t, 10*time.Second, "the failing list fetch seen", func() bool {
		v := listedEngine(t, fleet[0].dial())
		return v != nil && v.ModelsError != ""
	})
	for i := range 20 {
		resp, err := http.Get(routerURL + "/v1/models")
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK || !strings.Contains(string(b), kvsim.DefaultModel) {
			t.Fatalf("request %d: %d %s", i, resp.StatusCode, b)
		}
	}
}

// TestModelsListCutsAnEndlessEngineAnswer: the proxy reads an engine's
// answer to GET /v1/models to its end, dropping it for the pool's list;
// one that never ends is cut off once it outgrows any list the router
// reads, and the client, which has the whole pool's list, keeps its
// connection. Before, the request never ended: the client's next
// request on that connection waited behind it for ever.
func TestModelsListCutsAnEndlessEngineAnswer(t *testing.T) {
	endless := func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path != "/v1/models" || r.Header.Get(clientMark) == "" {
				next.ServeHTTP(w, r)
				return
			}
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusOK)
			io.WriteString(w, `{"object":"list","data":[],"padding":"`)
			pad := bytes.Repeat([]byte("a"), 64<<10)
			for r.Context().Err() == nil {
				if _, err := w.Write(pad); err != nil {
					return
				}
			}
		})
	}
	fleet := wrappedFleet(t, endless)
	startCaddy(t, caddyfile(fleet, "", "scrape_interval 100ms", ""))
	waitForModelLists(t, fleet)
	// One connection for every request; the timeout only keeps a hung
	// request from hanging the test.
	var dials atomic.Int32
	tr := &http.Transport{MaxConnsPerHost: 1, DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
		dials.Add(1)
		return (&net.Dialer{}).DialContext(ctx, network, addr)
	}}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr, Timeout: 20 * time.Second}
	for i := range 3 {
		req, _ := http.NewRequest("GET", routerURL+"/v1/models", nil)
		req.Header.Set(clientMark, "1")
		resp, err := client.Do(req)
		if err != nil {
			t.Fatalf("request %d on the connection: %v", i+1, err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		var list struct{ Data []struct{ ID string } }
		if resp.StatusCode != http.StatusOK || json.Unmarshal(b, &list) != nil || len(list.Data) != 1 || list.Data[0].ID != kvsim.DefaultModel {
			t.Fatalf("request %d: %d %.200q, want the pool's list", i+1, resp.StatusCode, b)
		}
	}
	if n := dials.Load(); n != 1 {
		t.Errorf("%d connections for three requests, want one", n)
	}
}
