package integration

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"

	"github.com/llmaffinity/caddy-llm-affinity/kvsim"
)

// streamResult is what a client saw of one SSE stream.
type streamResult struct {
	status     int
	text       string
	ids        map[string]bool
	completion int
	prompt     int
	done       bool
	errEvent   bool
	errText    string // the error event's data
	replica    string
}

// stream posts body and reads the SSE stream to the end.
func stream(ctx context.Context, path string, body map[string]any) (streamResult, error) {
	body["stream"] = true
	body["stream_options"] = map[string]any{"include_usage": true}
	raw, _ := json.Marshal(body)
	req, _ := http.NewRequestWithContext(ctx, "POST", routerURL+path, strings.NewReader(string(raw)))
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return streamResult{}, err
	}
	defer resp.Body.Close()
	res := streamResult{status: resp.StatusCode, ids: map[string]bool{}, replica: resp.Header.Get(kvsim.ReplicaHeader)}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		if data == "[DONE]" {
			res.done = true
			continue
		}
		var chunk struct {
			ID      string `json:"id"`
			Error   any    `json:"error"`
			Choices []struct {
				Text  string `json:"text"`
				Delta struct {
					Content string `json:"content"`
				} `json:"delta"`
			} `json:"choices"`
			Usage *struct {
				Prompt     int `json:"prompt_tokens"`
				Completion int `json:"completion_tokens"`
			} `json:"usage"`
		}
		if err := json.Unmarshal([]byte(data), &chunk); err != nil {
			return res, fmt.Errorf("bad chunk %q: %v", data, err)
		}
		if chunk.Error != nil {
			res.errEvent, res.errText = true, data
		}
		if chunk.ID != "" {
			res.ids[chunk.ID] = true
		}
		for _, c := range chunk.Choices {
			res.text += c.Text + c.Delta.Content
		}
		if chunk.Usage != nil {
			res.prompt, res.completion = chunk.Usage.Prompt, chunk.Usage.Completion
		}
	}
	return res, sc.Err()
}

// reference asks a replica directly for the same generation, unstreamed.
func reference(t *testing.T, r *replica, path string, body map[string]any) (string, int) {
	t.Helper()
	b := map[string]any{}
	for k, v := range body {
		if k != "stream" && k != "stream_options" {
			b[k] = v
		}
	}
	raw, _ := json.Marshal(b)
	resp, err := http.Post(r.http.URL+path, "application/json", strings.NewReader(string(raw)))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var out struct {
		Choices []struct {
			Text    string `json:"text"`
			Message struct {
				Content string `json:"content"`
			} `json:"message"`
		} `json:"choices"`
		Usage struct {
			Prompt int `json:"prompt_tokens"`
		} `json:"usage"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil || len(out.Choices) == 0 {
		t.Fatalf("reference: %v %+v", err, out)
	}
	return out.Choices[0].Text + out.Choices[0].Message.Content, out.Usage.Prompt
}

func adminDo(t *testing.T, method, path string) {
	t.Helper()
	req, _ := http.NewRequest(method, adminURL+path, nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("%s %s: %d", method, path, resp.StatusCode)
	}
}

func drainPhase(t *testing.T, dial string) string {
	t.Helper()
	if u, ok := upstreams(t)[dial]; ok {
		return u.Drain
	}
	return "active"
}

// apiRequest is a request body and the path it goes to.
type apiRequest struct {
	path string
	body map[string]any
}

// requestBodies returns n requests of 120 output tokens, alternating
// completions and chat.
func requestBodies(n int, tag string) []apiRequest {
	var out []apiRequest
	for i := 0; i < n; i++ {
		if i%2 == 0 {
			out = append(out, apiRequest{"/v1/completions", map[string]any{"model": kvsim.DefaultModel,
				"prompt": text(fmt.Sprintf("%s completion %d", tag, i), 3000), "max_tokens": 120}})
		} else {
			out = append(out, apiRequest{"/v1/chat/completions", map[string]any{"model": kvsim.DefaultModel, "max_tokens": 120,
				"messages": []msg{{"system", text(fmt.Sprintf("%s chat %d", tag, i), 3000)}, {"user", "go on"}}}})
		}
	}
	return out
}

// streamAll starts every request's stream; wait returns when all ended.
func streamAll(reqs []apiRequest) (results []streamResult, errs []error, wait func()) {
	var wg sync.WaitGroup
	results, errs = make([]streamResult, len(reqs)), make([]error, len(reqs))
	for i, rq := range reqs {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			results[i], errs[i] = stream(context.Background(), rq.path, rq.body)
		}(i)
	}
	return results, errs, wg.Wait
}

// TestDrainLongDeadline: every in-flight request completes, no client
// sees an error, and no new request reaches the draining upstream.
func TestDrainLongDeadline(t *testing.T) {
	fleet := startFleet(t, 2, 1, kvsim.Config{})
	startCaddy(t, caddyfile(fleet, "", "drain_deadline 30s", ""))
	a, b := fleet[0], fleet[1]
	adminDo(t, "POST", "/llm_affinity/upstreams/"+b.dial()+"/drain") // everything to A first
	reqs := requestBodies(4, "long")
	results, errs, wait := streamAll(reqs)
	eventually(t, 5*time.Second, "four streams in flight on A", func() bool { return upstreams(t)[a.dial()].InFlight == 4 })
	adminDo(t, "DELETE", "/llm_affinity/upstreams/"+b.dial()+"/drain")
	adminDo(t, "POST", "/llm_affinity/upstreams/"+a.dial()+"/drain?deadline=30s")
	if p := drainPhase(t, a.dial()); p != "draining" {
		t.Fatalf("A is %s, want draining", p)
	}
	for i := 0; i < 4; i++ {
		c := post(t, "/v1/completions", map[string]any{"model": kvsim.DefaultModel, "prompt": text("new", 400), "max_tokens": 4})
		if c.status != 200 || c.replica != b.name {
			t.Fatalf("new request while A drains went to %q (%d)", c.replica, c.status)
		}
	}
	wait()
	for i, res := range results {
		if errs[i] != nil || res.status != 200 || !res.done || res.errEvent || res.completion != 120 || res.replica != a.name {
			t.Fatalf("stream %d: %v %+v", i, errs[i], res)
		}
	}
	eventually(t, 10*time.Second, "A drained", func() bool { return drainPhase(t, a.dial()) == "drained" })
	adminDo(t, "DELETE", "/llm_affinity/upstreams/"+a.dial()+"/drain")
}

// TestDrainShortDeadlineMovesRequests: at the deadline, requests not yet
// started are re-dispatched and started streams are continued on the
// other upstream; every client's text is byte for byte what one
// uninterrupted generation gives.
func TestDrainShortDeadlineMovesRequests(t *testing.T) {
	// Two sequences at a time: of four requests two start, two wait.
	fleet := startFleet(t, 2, 1, kvsim.Config{MaxNumSeqs: 2})
	startCaddy(t, caddyfile(fleet, "", "drain_deadline 30s", ""))
	a, b := fleet[0], fleet[1]
	adminDo(t, "POST", "/llm_affinity/upstreams/"+b.dial()+"/drain")
	reqs := requestBodies(4, "short")
	results, errs, wait := streamAll(reqs)
	eventually(t, 5*time.Second, "four requests on A", func() bool { return upstreams(t)[a.dial()].InFlight == 4 })
	// The running two have streamed some tokens: A's decode charge (4 ×
	// 120 expected) went down.
	eventually(t, 5*time.Second, "tokens streaming from A", func() bool {
		return upstreams(t)[a.dial()].QueuedDecodeTokens <= 4*120-10
	})
	adminDo(t, "DELETE", "/llm_affinity/upstreams/"+b.dial()+"/drain")
	adminDo(t, "POST", "/llm_affinity/upstreams/"+a.dial()+"/drain?deadline=100ms")
	wait()
	for i, res := range results {
		want, wantPrompt := reference(t, b, reqs[i].path, reqs[i].body)
		if errs[i] != nil || res.status != 200 || !res.done || res.errEvent {
			t.Fatalf("stream %d: %v %+v", i, errs[i], res)
		}
		if res.text != want {
			t.Fatalf("stream %d text differs from an uninterrupted generation:\n got %q\nwant %q", i, res.text, want)
		}
		if len(res.ids) != 1 || res.completion != 120 || res.prompt != wantPrompt {
			t.Fatalf("stream %d: ids %v, usage prompt %d completion %d (want %d, 120)", i, res.ids, res.prompt, res.completion, wantPrompt)
		}
	}
	metrics := scrapeMetrics(t)
	for _, outcome := range []string{"continued", "redispatched"} {
		if !strings.Contains(metrics, `caddy_llm_affinity_moved_requests_total{cause="drain",outcome="`+outcome+`"}`) {
			t.Errorf("no %s requests counted", outcome)
		}
	}
	eventually(t, 10*time.Second, "A drained", func() bool { return drainPhase(t, a.dial()) == "drained" })
	adminDo(t, "DELETE", "/llm_affinity/upstreams/"+a.dial()+"/drain")
}

// TestDrainWaitsForPassThrough: a request the router does not read (here
// an embeddings request) counts as in flight on its upstream: a drain
// waits for it, and at the deadline cuts it, and its client gets a 503 it
// may retry at once.
func TestDrainWaitsForPassThrough(t *testing.T) {
	release := make(chan struct{})
	arrived := make(chan string, 4)
	// POST /v1/embeddings answers at once, or for the input "hold" when
	// released, or for "cut" never (until the router cancels it).
	fleet := startFleetServing(t, 2, 1, kvsim.Config{}, func(name string, sim http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path == "/v1/models" && r.Header.Get("X-Test-Hold") != "" {
				arrived <- name // a client's models list, held until cut
				<-r.Context().Done()
				return
			}
			if r.URL.Path != "/v1/embeddings" {
				sim.ServeHTTP(w, r)
				return
			}
			var body struct{ Input string }
			if err := json.NewDecoder(r.Body).Decode(&body); err != nil {
				http.Error(w, err.Error(), http.StatusBadRequest)
				return
			}
			arrived <- name
			hold := release
			if body.Input == "cut" {
				hold = nil
			}
			if body.Input != "now" {
				select {
				case <-hold:
				case <-r.Context().Done():
					return
				}
			}
			w.Header().Set(kvsim.ReplicaHeader, name)
			fmt.Fprint(w, `{"object":"list","data":[{"object":"embedding","index":0,"embedding":[0.5]}]}`)
		})
	})
	startCaddy(t, caddyfile(fleet, "", "drain_deadline 30s", ""))
	a, b := fleet[0], fleet[1]
	embed := func(input string) chan completion {
		done := make(chan completion, 1)
		go func() {
			resp, err := http.Post(routerURL+"/v1/embeddings", "application/json", strings.NewReader(`{"model":"m","input":"`+input+`"}`))
			if err != nil {
				done <- completion{body: err.Error()}
				return
			}
			defer resp.Body.Close()
			raw, _ := io.ReadAll(resp.Body)
			done <- completion{status: resp.StatusCode, replica: resp.Header.Get(kvsim.ReplicaHeader), body: string(raw), header: resp.Header}
		}()
		return done
	}
	onA := func(input string) chan completion {
		t.Helper()
		done := embed(input)
		if got := <-arrived; got != a.name {
			t.Fatalf("%s went to %s with B drained", input, got)
		}
		return done
	}

	adminDo(t, "POST", "/llm_affinity/upstreams/"+b.dial()+"/drain") // everything to A
	held := onA("hold")
	adminDo(t, "DELETE", "/llm_affinity/upstreams/"+b.dial()+"/drain")
	adminDo(t, "POST", "/llm_affinity/upstreams/"+a.dial()+"/drain?deadline=30s")
	if p := drainPhase(t, a.dial()); p != "draining" {
		t.Fatalf("A is %s with an embeddings request in flight, want draining", p)
	}
	if c := <-embed("now"); c.status != 200 || c.replica != b.name {
		t.Fatalf("a new request while A drains: %d from %q", c.status, c.replica)
	}
	<-arrived
	close(release)
	if c := <-held; c.status != 200 || c.replica != a.name {
		t.Fatalf("the held request: %d from %q: %s", c.status, c.replica, c.body)
	}
	eventually(t, 10*time.Second, "A drained", func() bool { return drainPhase(t, a.dial()) == "drained" })

	// At the deadline the request is cut; its client may retry at once.
	adminDo(t, "DELETE", "/llm_affinity/upstreams/"+a.dial()+"/drain")
	adminDo(t, "POST", "/llm_affinity/upstreams/"+b.dial()+"/drain")
	cut := onA("cut")
	adminDo(t, "DELETE", "/llm_affinity/upstreams/"+b.dial()+"/drain")
	adminDo(t, "POST", "/llm_affinity/upstreams/"+a.dial()+"/drain?deadline=100ms")
	if c := <-cut; c.status != http.StatusServiceUnavailable || c.header.Get("Retry-After") != "1" || !strings.Contains(c.body, "drain deadline") {
		t.Fatalf("the cut request: %d, Retry-After %q: %s", c.status, c.header.Get("Retry-After"), c.body)
	}
	eventually(t, 10*time.Second, "A drained", func() bool { return drainPhase(t, a.dial()) == "drained" })
	adminDo(t, "DELETE", "/llm_affinity/upstreams/"+a.dial()+"/drain")

	// A models list is passed through as well: a drain waits for it and
	// its deadline cuts it.
	adminDo(t, "POST", "/llm_affinity/upstreams/"+b.dial()+"/drain")
	models := make(chan completion, 1)
	go func() {
		req, _ := http.NewRequest("GET", routerURL+"/v1/models", nil)
		req.Header.Set("X-Test-Hold", "cut")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			models <- completion{body: err.Error()}
			return
		}
		defer resp.Body.Close()
		raw, _ := io.ReadAll(resp.Body)
		models <- completion{status: resp.StatusCode, body: string(raw), header: resp.Header}
	}()
	if got := <-arrived; got != a.name {
		t.Fatalf("the models list went to %s with B drained", got)
	}
	adminDo(t, "DELETE", "/llm_affinity/upstreams/"+b.dial()+"/drain")
	adminDo(t, "POST", "/llm_affinity/upstreams/"+a.dial()+"/drain?deadline=30s")
	if u := upstreams(t)[a.dial()]; u.Drain != "draining" || u.ThisRouterInFlight != 1 || u.InFlight != 0 {
		t.Fatalf("A with a models list in flight: %s, this router's in flight %d, routed %d; want draining, 1, 0", u.Drain, u.ThisRouterInFlight, u.InFlight)
	}
	adminDo(t, "POST", "/llm_affinity/upstreams/"+a.dial()+"/drain?deadline=100ms") // the earlier deadline wins
	select {
	case c := <-models:
		if c.status != http.StatusServiceUnavailable || c.header.Get("Retry-After") != "1" {
			t.Fatalf("the cut models list: %d, Retry-After %q: %s", c.status, c.header.Get("Retry-After"), c.body)
		}
	case <-time.After(30 * time.Second): // the deadline was 100 ms
		t.Fatal("the models list was not cut at the drain's deadline")
	}
	eventually(t, 10*time.Second, "A drained", func() bool { return drainPhase(t, a.dial()) == "drained" })
	adminDo(t, "DELETE", "/llm_affinity/upstreams/"+a.dial()+"/drain")
}

func scrapeMetrics(t *testing.T) string {
	t.Helper()
	resp, err := http.Get(adminURL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var sb strings.Builder
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		sb.WriteString(sc.Text() + "\n")
	}
	return sb.String()
}

// TestHealthDrainsAndUndrains: kvsim's health turned off drains the
// upstream; turned on again, it is undrained. No request comes first: an
// idle router's view follows the health checks too.
func TestHealthDrainsAndUndrains(t *testing.T) {
	fleet := startFleet(t, 2, 20, kvsim.Config{})
	startCaddy(t, caddyfile(fleet, "", "drain_deadline 5s", "health_uri /health\n\t\thealth_interval 100ms"))
	a := fleet[0]
	a.sim.SetFaults(kvsim.Faults{Unhealthy: true})
	eventually(t, 5*time.Second, "A drained by health", func() bool { return drainPhase(t, a.dial()) != "active" })
	// The admin view's verdict follows the health checks, not the last
	// decision (none has been made since).
	if h := upstream(t, a.dial()).Healthy; h == nil || *h {
		t.Fatalf("A drained by health shows healthy %v", h)
	}
	for i := 0; i < 3; i++ {
		if c := post(t, "/v1/completions", map[string]any{"model": kvsim.DefaultModel, "prompt": text("h", 500), "max_tokens": 2}); c.replica == a.name {
			t.Fatal("a request reached the unhealthy, draining upstream")
		}
	}
	a.sim.SetFaults(kvsim.Faults{})
	eventually(t, 5*time.Second, "A undrained", func() bool { return drainPhase(t, a.dial()) == "active" })
	eventually(t, 5*time.Second, "A shown healthy", func() bool {
		h := upstream(t, a.dial()).Healthy
		return h != nil && *h
	})
}

// TestHealthDrainSurvivesReload: an upstream the health checks drained
// stays drained through a reload, although the new config's checks start
// by calling it healthy (here, with two failures needed and an hour
// between checks, for an hour); it is undrained once they find it healthy.
func TestHealthDrainSurvivesReload(t *testing.T) {
	fleet := startFleet(t, 2, 20, kvsim.Config{})
	health := func(interval string) string {
		return "health_uri /health\n\t\thealth_interval " + interval + "\n\t\thealth_timeout 200ms\n\t\thealth_fails 2"
	}
	tester := startCaddy(t, caddyfile(fleet, "", "drain_deadline 5s", health("100ms")))
	a := fleet[0]
	a.sim.SetFaults(kvsim.Faults{Unhealthy: true})
	eventually(t, 5*time.Second, "A drained by health", func() bool { return drainPhase(t, a.dial()) != "active" })
	reload(t, tester, caddyfile(fleet, "", "drain_deadline 6s", health("1h")))
	// The new config's health poll has run once it shows A healthy, as
	// Caddy's new checks have it.
	eventually(t, 5*time.Second, "A shown healthy by the new config", func() bool {
		h := upstream(t, a.dial()).Healthy
		return h != nil && *h
	})
	if p := drainPhase(t, a.dial()); p == "active" {
		t.Fatal("the health drain lapsed in the reload")
	}
	for i := 0; i < 4; i++ {
		if c := post(t, "/v1/completions", map[string]any{"model": kvsim.DefaultModel, "prompt": text(fmt.Sprint("sick", i), 500), "max_tokens": 2}); c.replica == a.name || c.status != 200 {
			t.Fatalf("after the reload a request went to %q (%d)", c.replica, c.status)
		}
	}
	a.sim.SetFaults(kvsim.Faults{})
	reload(t, tester, caddyfile(fleet, "", "drain_deadline 6s", health("100ms")))
	eventually(t, 15*time.Second, "A undrained once the checks find it healthy", func() bool { return drainPhase(t, a.dial()) == "active" })
}

// TestDrainSurvivesReload: a drain set through the admin API holds after
// the config is reloaded.
func TestDrainSurvivesReload(t *testing.T) {
	fleet := startFleet(t, 2, 20, kvsim.Config{})
	tester := startCaddy(t, caddyfile(fleet, "", "", ""))
	a := fleet[0]
	adminDo(t, "POST", "/llm_affinity/upstreams/"+a.dial()+"/drain")
	reload(t, tester, caddyfile(fleet, "", "queue_timeout 2s", ""))
	if p := drainPhase(t, a.dial()); p == "active" {
		t.Fatal("drain lost in reload")
	}
	for i := 0; i < 4; i++ {
		if c := post(t, "/v1/completions", map[string]any{"model": kvsim.DefaultModel, "prompt": text(fmt.Sprint(i), 500), "max_tokens": 2}); c.replica == a.name || c.status != 200 {
			t.Fatalf("after reload a request went to %q (%d)", c.replica, c.status)
		}
	}
	adminDo(t, "DELETE", "/llm_affinity/upstreams/"+a.dial()+"/drain")
}

// TestBrokenStreamContinues: an upstream that breaks a stream off in the
// middle (it died) does not cut the client's stream: the rest is
// generated elsewhere and spliced in, byte for byte.
func TestBrokenStreamContinues(t *testing.T) {
	fleet := startFleet(t, 2, 20, kvsim.Config{})
	a, b := fleet[0], fleet[1]
	// A is the faster replica, so every first attempt goes there; it
	// closes each stream after 7 tokens.
	startCaddy(t, caddyfile(fleet, "", fmt.Sprintf("upstream %s {\n\t\t\t\tprefill_rate 100000\n\t\t\t}", a.dial()), ""))
	a.sim.SetFaults(kvsim.Faults{CutAfterTokens: 7})
	for i, rq := range requestBodies(2, "broken") {
		res, err := stream(context.Background(), rq.path, rq.body)
		want, _ := reference(t, b, rq.path, rq.body)
		if err != nil || res.status != 200 || !res.done || res.errEvent || res.text != want || res.completion != 120 || len(res.ids) != 1 {
			t.Fatalf("request %d: %v %+v\nwant text %q", i, err, res, want)
		}
		if res.replica != a.name {
			t.Fatalf("request %d started on %q, want A", i, res.replica)
		}
	}
	if m := scrapeMetrics(t); !strings.Contains(m, `caddy_llm_affinity_moved_requests_total{cause="upstream_error",outcome="continued"}`) {
		t.Error("no continued stream counted")
	}
}

// TestEchoedStreamContinues: a completion stream that echoes its prompt
// (vLLM sends the prompt before the first token's text) and breaks off in
// the middle is continued without the echo: the client gets the prompt
// once, then the whole generation, byte for byte as uninterrupted.
func TestEchoedStreamContinues(t *testing.T) {
	fleet := startFleet(t, 2, 20, kvsim.Config{})
	a, b := fleet[0], fleet[1]
	startCaddy(t, caddyfile(fleet, "", fmt.Sprintf("upstream %s {\n\t\t\t\tprefill_rate 100000\n\t\t\t}", a.dial()), ""))
	a.sim.SetFaults(kvsim.Faults{CutAfterTokens: 7})
	prompt := text("echoed completion", 3000)
	body := map[string]any{"model": kvsim.DefaultModel, "prompt": prompt, "max_tokens": 120, "echo": true}
	want, _ := reference(t, b, "/v1/completions", body)
	if !strings.HasPrefix(want, prompt) || len(want) == len(prompt) {
		t.Fatalf("the engine's answer with echo is %d bytes, not the prompt's %d then text", len(want), len(prompt))
	}
	res, err := stream(context.Background(), "/v1/completions", body)
	if err != nil || res.status != 200 || !res.done || res.errEvent || res.text != want || res.completion != 120 || res.replica != a.name {
		t.Fatalf("%v status %d done %v error event %v completion %d replica %q; text %d bytes, want %d",
			err, res.status, res.done, res.errEvent, res.completion, res.replica, len(res.text), len(want))
	}
}

// TestLostUpstreamSendsAgain: an engine that goes away under a request
// before answering it (its connection closed with nothing written, as a
// crashed engine's, or a kept-alive connection that was dead) does not
// cost the client a 502: the request is sent again, to another replica
// while one is untried. Caddy itself retries no POST after a connection
// it began to use. It is sent again once only: a request that crashes
// engines itself must not take down the fleet. Here the fleet drops the
// first request it gets, then drops every request's first attempt.
func TestLostUpstreamSendsAgain(t *testing.T) {
	var dropped atomic.Int32
	var once sync.Once
	dropAll := atomic.Bool{}
	dropFirst := func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			drop := false
			if r.Method == http.MethodPost {
				once.Do(func() { drop = true })
				drop = drop || dropAll.Load()
			}
			if !drop {
				next.ServeHTTP(w, r)
				return
			}
			dropped.Add(1)
			if c, _, err := http.NewResponseController(w).Hijack(); err == nil {
				c.Close()
			}
		})
	}
	fleet := wrappedFleet(t, dropFirst, dropFirst)
	startCaddy(t, caddyfile(fleet, "", "", ""))
	for i := range 2 {
		c := post(t, "/v1/chat/completions", chat([]msg{{"user", text(fmt.Sprint("lost ", i), 400)}}, 4))
		if c.status != 200 || c.replica == "" {
			t.Fatalf("request %d: %d %s", i, c.status, c.body)
		}
	}
	if n := dropped.Load(); n != 1 {
		t.Fatalf("%d requests dropped, want the first", n)
	}
	dropAll.Store(true)
	if c := post(t, "/v1/chat/completions", chat([]msg{{"user", text("lost again", 400)}}, 4)); c.status != http.StatusBadGateway {
		t.Fatalf("every attempt dropped: %d %s, want the proxy's 502", c.status, c.body)
	}
	if n := dropped.Load(); n != 3 {
		t.Fatalf("%d requests dropped, want the first, then one request sent twice", n)
	}
	if m := scrapeMetrics(t); !strings.Contains(m, `caddy_llm_affinity_moved_requests_total{cause="upstream_error",outcome="redispatched"} 2`) {
		for _, line := range strings.Split(m, "\n") {
			if strings.Contains(line, "moved_requests_total{") {
				t.Log(line)
			}
		}
		t.Error("the two lost attempts not counted as moved")
	}
}

// TestContinuationAfterAnEscapedToken: a stream cut just after a token
// holding a line break or a quote (escaped in its event) is continued from
// the text the client got, decoded: the continuation's prompt ends with
// that token's bytes, which decide kvsim's next token, so text kept
// escaped, or decoded wrongly, would continue otherwise than the
// uninterrupted answer.
func TestContinuationAfterAnEscapedToken(t *testing.T) {
	const bpt = 4 // kvsim's bytes a token, set: its tokens are its text's runs of bpt bytes
	fleet := startFleet(t, 2, 20, kvsim.Config{BytesPerToken: bpt})
	a, b := fleet[0], fleet[1]
	startCaddy(t, caddyfile(fleet, "", fmt.Sprintf("upstream %s {\n\t\t\t\tprefill_rate 100000\n\t\t\t}", a.dial()), ""))
	for i, rq := range requestBodies(2, "escaped") {
		want, _ := reference(t, b, rq.path, rq.body)
		// Cut after the first token with a byte JSON escapes.
		cut := 0
		for k := 0; (k+1)*bpt <= len(want) && cut == 0; k++ {
			if strings.ContainsAny(want[k*bpt:(k+1)*bpt], "\n\"") {
				cut = k + 1
			}
		}
		if cut == 0 || cut >= 120 {
			t.Fatalf("request %d: no token to cut after in %q", i, want)
		}
		a.sim.SetFaults(kvsim.Faults{CutAfterTokens: cut})
		res, err := stream(context.Background(), rq.path, rq.body)
		if err != nil || res.status != 200 || !res.done || res.errEvent || res.text != want || res.replica != a.name {
			t.Fatalf("request %d cut after token %d (%q): %v %+v\nwant text %q", i, cut, want[(cut-1)*bpt:cut*bpt], err, res, want)
		}
	}
}

// TestConfigDrainList: an upstream listed under drain takes no requests;
// a reload that no longer lists it puts it back in service.
func TestConfigDrainList(t *testing.T) {
	fleet := startFleet(t, 2, 20, kvsim.Config{})
	a, b := fleet[0], fleet[1]
	tester := startCaddy(t, caddyfile(fleet, "", "drain "+a.dial(), ""))
	for i := 0; i < 4; i++ {
		if c := post(t, "/v1/completions", map[string]any{"model": kvsim.DefaultModel, "prompt": text(fmt.Sprint("cfg", i), 400), "max_tokens": 2}); c.replica != b.name {
			t.Fatalf("request %d went to %q while A is drained by config", i, c.replica)
		}
	}
	reload(t, tester, caddyfile(fleet, "", "", ""))
	if p := drainPhase(t, a.dial()); p != "active" {
		t.Fatalf("A is %s after the config stopped listing it", p)
	}
}

// TestRejectedConfigDrainsNothing: a config Caddy rejects (here one of its
// policies fails validation after another was provisioned with a drain)
// changes nothing in the running one: no upstream drains, even for a
// moment. A config drain takes effect once its config runs.
func TestRejectedConfigDrainsNothing(t *testing.T) {
	fleet := startFleet(t, 2, 20, kvsim.Config{})
	a := fleet[0]
	tester := startCaddy(t, caddyfile(fleet, "", "", ""))
	draining := func() float64 {
		return counterValue(metricFamilies(t, adminURL+"/metrics"), "caddy_llm_affinity_drain_transitions_total", "to", "draining")
	}
	before := draining()

	// The new config, as JSON: its first policy drains A with a 1 ms
	// deadline; a second site's policy has a shed status Validate refuses.
	adapt := func(config string) map[string]any {
		req, _ := http.NewRequest("POST", adminURL+"/adapt", strings.NewReader(config))
		req.Header.Set("Content-Type", "text/caddyfile")
		resp, err := tester.Client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var out struct{ Result map[string]any }
		if err := json.NewDecoder(resp.Body).Decode(&out); err != nil || resp.StatusCode != 200 {
			t.Fatalf("adapt: %d %v", resp.StatusCode, err)
		}
		return out.Result
	}
	cfg := adapt(caddyfile(fleet, "", "drain "+a.dial()+"\n\t\t\tdrain_deadline 1ms", "") + fmt.Sprintf(`
http://127.0.0.1:%d {
	llm_affinity
	reverse_proxy %s {
		lb_policy llm_affinity {
			shed_status 503
		}
	}
}
`, httpPort, dials(fleet)))
	raw, _ := json.Marshal(cfg)
	bad := strings.Replace(string(raw), `"shed_status":503`, `"shed_status":200`, 1)
	if bad == string(raw) {
		t.Fatalf("no shed_status to change in %s", raw)
	}
	status, body := load(t, tester, "application/json", bad)
	if status == 200 {
		t.Fatalf("a config with shed_status 200 was accepted")
	}
	if !strings.Contains(body, "shed_status") {
		t.Logf("the load failed for another reason: %s", body)
	}
	if p := drainPhase(t, a.dial()); p != "active" {
		t.Fatalf("after the rejected config A is %s", p)
	}
	if n := draining(); n != before {
		t.Fatalf("the rejected config drained an upstream for a moment (%v drain transitions, %v before)", n, before)
	}
}

// TestRejectedConfigKeepsRouterMetrics: Caddy's admin API serves the
// metrics registry of the last config it tried to load, also one it
// rejected. A config rejected by the router's own modules (a policy's
// Provision, the handler's Validate) leaves the running config's router
// metrics there all the same; they were all gone before.
func TestRejectedConfigKeepsRouterMetrics(t *testing.T) {
	fleet := startFleet(t, 2, 20, kvsim.Config{})
	tester := startCaddy(t, caddyfile(fleet, "", "", ""))
	if c := post(t, "/v1/completions", map[string]any{"model": kvsim.DefaultModel, "prompt": "hello", "max_tokens": 2}); c.status != 200 {
		t.Fatalf("status %d: %s", c.status, c.body)
	}
	for _, bad := range []struct{ name, handlerOpts, policyOpts string }{
		{"policy", "", "strategy no_such_strategy"},
		{"handler", "max_body 2GiB", ""},
	} {
		status, body := load(t, tester, "text/caddyfile", caddyfile(fleet, bad.handlerOpts, bad.policyOpts, ""))
		if status == 200 {
			t.Fatalf("%s: a bad config was accepted", bad.name)
		}
		mfs := metricFamilies(t, adminURL+"/metrics")
		if n := counterValue(mfs, "caddy_llm_affinity_decisions_total", "reason", "cold") +
			counterValue(mfs, "caddy_llm_affinity_decisions_total", "reason", "warm"); n < 1 {
			t.Fatalf("%s rejected (%s): the router's decisions are gone from /metrics (%d router families)",
				bad.name, strings.TrimSpace(body), routerFamilies(mfs))
		}
	}
}

// routerFamilies counts the router's metric families in mfs.
func routerFamilies(mfs map[string]*dto.MetricFamily) int {
	n := 0
	for name := range mfs {
		if strings.HasPrefix(name, "caddy_llm_affinity_") {
			n++
		}
	}
	return n
}

// TestConfigNamesOnlyItsUpstreams: drain and upstream name the proxy's
// upstreams by dial; one it does not have (a typo, a scheme) is an error
// naming it, and the running config stays.
func TestConfigNamesOnlyItsUpstreams(t *testing.T) {
	fleet := startFleet(t, 2, 20, kvsim.Config{})
	tester := startCaddy(t, caddyfile(fleet, "", "", ""))
	for _, opts := range []string{
		"drain 10.9.9.9:1",
		"drain http://" + fleet[0].dial(),
		"upstream 10.9.9.9:1 {\n\t\t\t\tkv_capacity 1000\n\t\t\t}",
	} {
		if status, body := load(t, tester, "text/caddyfile", caddyfile(fleet, "", opts, "")); status == 200 ||
			!strings.Contains(body, "not an upstream of this reverse_proxy") {
			t.Errorf("%q: %d %s", opts, status, body)
		}
	}
	if c := post(t, "/v1/completions", map[string]any{"model": kvsim.DefaultModel, "prompt": "hello", "max_tokens": 2}); c.status != 200 {
		t.Fatalf("the running config after the refused ones: %d %s", c.status, c.body)
	}
}

// TestDrainCutIsNoUpstreamFailure: with Caddy's retries and passive health
// checks on (as in the quickstart), a drain deadline that cuts requests
// not yet answered moves them to the other upstreams and counts against
// none: Caddy takes the cut for the client's cancellation, so it neither
// retries the dead attempt elsewhere nor strikes the upstreams it would
// have retried on (which then drained as unhealthy for fail_duration, and
// their requests got 503s).
func TestDrainCutIsNoUpstreamFailure(t *testing.T) {
	// One sequence at a time: of three requests on A two wait there.
	fleet := startFleet(t, 3, 1, kvsim.Config{MaxNumSeqs: 1})
	startCaddy(t, caddyfile(fleet, "", "drain_deadline 30s", `lb_retries 2
		lb_retry_match {
			method POST
		}
		fail_duration 10s`))
	a, b, c := fleet[0], fleet[1], fleet[2]
	adminDo(t, "POST", "/llm_affinity/upstreams/"+b.dial()+"/drain")
	adminDo(t, "POST", "/llm_affinity/upstreams/"+c.dial()+"/drain")
	var wg sync.WaitGroup
	results := make([]completion, 3)
	for i := range results {
		wg.Add(1)
		go func() {
			defer wg.Done()
			results[i] = post(t, "/v1/chat/completions", chat([]msg{{"user", text(fmt.Sprint("cut ", i), 2000)}}, 60))
		}()
	}
	eventually(t, 5*time.Second, "three requests on A", func() bool { return upstreams(t)[a.dial()].InFlight == 3 })
	adminDo(t, "DELETE", "/llm_affinity/upstreams/"+b.dial()+"/drain")
	adminDo(t, "DELETE", "/llm_affinity/upstreams/"+c.dial()+"/drain")
	adminDo(t, "POST", "/llm_affinity/upstreams/"+a.dial()+"/drain?deadline=100ms")
	wg.Wait()
	for i, r := range results {
		if r.status != 200 || r.replica == a.name {
			t.Errorf("request %d: %d from %s: %s", i, r.status, r.replica, r.body)
		}
	}
	for _, r := range []*replica{b, c} {
		if u := upstreams(t)[r.dial()]; u.Drain != "active" || u.DrainCause != "" || (u.Healthy != nil && !*u.Healthy) {
			t.Errorf("%s after the cut: drain %q, cause %q, healthy %v", r.name, u.Drain, u.DrainCause, u.Healthy)
		}
	}
	adminDo(t, "DELETE", "/llm_affinity/upstreams/"+a.dial()+"/drain")
}

// TestFailedContinuationCountsAsCut: a stream cut at its upstream's drain
// deadline whose continuation finds no upstream (the only one drains) ends
// with an error event, and counts as cut, not continued.
func TestFailedContinuationCountsAsCut(t *testing.T) {
	fleet := startFleet(t, 1, 1, kvsim.Config{})
	startCaddy(t, caddyfile(fleet, "", "queue_timeout 2s", ""))
	a := fleet[0]
	moved := func(outcome string) float64 {
		prefix := `caddy_llm_affinity_moved_requests_total{cause="drain",outcome="` + outcome + `"} `
		for _, line := range strings.Split(scrapeMetrics(t), "\n") {
			if v, ok := strings.CutPrefix(line, prefix); ok {
				n, _ := strconv.ParseFloat(v, 64)
				return n
			}
		}
		return 0
	}
	cut, continued := moved("cut"), moved("continued")
	results, errs, wait := streamAll(requestBodies(1, "alone"))
	eventually(t, 5*time.Second, "tokens streaming from A", func() bool {
		u := upstreams(t)[a.dial()]
		return u.InFlight == 1 && u.QueuedDecodeTokens <= 120-10
	})
	adminDo(t, "POST", "/llm_affinity/upstreams/"+a.dial()+"/drain?deadline=100ms")
	wait()
	if errs[0] != nil || !results[0].errEvent {
		t.Fatalf("the stream: %v %+v, want it ended with an error event", errs[0], results[0])
	}
	if !strings.Contains(results[0].errText, "no upstream could take its continuation") {
		t.Errorf("the error event says %q, not why", results[0].errText)
	}
	if d := moved("cut") - cut; d != 1 || moved("continued") != continued {
		t.Errorf("moved: cut +%v, continued +%v; want +1 and +0", d, moved("continued")-continued)
	}
	adminDo(t, "DELETE", "/llm_affinity/upstreams/"+a.dial()+"/drain")
}

// TestContinuationAnsweredWithoutAStream: a broken stream's continuation
// that its upstream answers with a body that is not an event stream (a
// misbehaving engine ignoring stream, its JSON never ending) is a failed
// continuation at once: the client's stream ends with an error event and
// [DONE], the engine's answer is hung up on rather than read, and nothing
// stays charged. The router read and dropped such a body for as long as
// it came, and the client's stream never ended.
func TestContinuationAnsweredWithoutAStream(t *testing.T) {
	const event = `data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"Hi"}}]}` + "\n\n"
	hungUp := make(chan struct{}, 1)
	// Each engine breaks a stream off after its first event (it died),
	// and answers a continuation (vLLM's continue_final_message) with
	// JSON it never ends, a few bytes at a time, until the router hangs up.
	engine := func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		if !strings.Contains(string(body), `"continue_final_message":true`) {
			w.Header().Set("Content-Type", "text/event-stream")
			w.WriteHeader(http.StatusOK)
			io.WriteString(w, event)
			w.(http.Flusher).Flush()
			panic(http.ErrAbortHandler)
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusOK)
		io.WriteString(w, `{"id":"chatcmpl-2","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"`)
		tick := time.NewTicker(10 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-r.Context().Done():
				select {
				case hungUp <- struct{}{}:
				default:
				}
				return
			case <-tick.C:
				io.WriteString(w, "more ")
				w.(http.Flusher).Flush()
			}
		}
	}
	engines := startScriptedCaddy(t, 2, engine)
	before := metricFamilies(t, adminURL+"/metrics")

	// Bounded, so that a stream that never ends fails the test rather
	// than hanging it.
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	res, err := stream(ctx, "/v1/chat/completions", map[string]any{"model": "m", "messages": []msg{{"user", "hi"}}, "max_tokens": 50})
	if err != nil || ctx.Err() != nil {
		t.Fatalf("the client's stream did not end: %v %+v", err, res)
	}
	if res.status != 200 || res.text != "Hi" || !res.errEvent || !res.done || !strings.Contains(res.errText, "the continuation's upstream answered 200") {
		t.Fatalf("the client got %+v; want the first event, an error event saying why and [DONE]", res)
	}
	select {
	case <-hungUp:
	case <-ctx.Done():
		t.Fatal("the router never hung up on the continuation's endless answer")
	}
	released(t, engines, "after the failed continuation")
	const moved = "caddy_llm_affinity_moved_requests_total"
	mfs := metricFamilies(t, adminURL+"/metrics")
	if cut, continued := counterValue(mfs, moved, "outcome", "cut")-counterValue(before, moved, "outcome", "cut"),
		counterValue(mfs, moved, "outcome", "continued")-counterValue(before, moved, "outcome", "continued"); cut != 1 || continued != 0 {
		t.Errorf("moved: cut +%v, continued +%v; want +1 and +0", cut, continued)
	}
}

// TestStoredResponseAtItsDrainedHome: a stored response's retrieval goes
// to its home even while the home is drained (only it has the response),
// and is answered: it neither reopens the drain nor is cut by its
// deadline, long past.
func TestStoredResponseAtItsDrainedHome(t *testing.T) {
	fleet := startFleet(t, 2, 20, kvsim.Config{})
	startCaddy(t, caddyfile(fleet, "", "", ""))
	c := post(t, "/v1/responses", map[string]any{"model": kvsim.DefaultModel, "input": text("stored", 400), "max_output_tokens": 4})
	var out struct{ ID string }
	if json.Unmarshal([]byte(c.body), &out); c.status != 200 || out.ID == "" {
		t.Fatalf("create: %d %s", c.status, c.body)
	}
	home := named(fleet, c.replica).dial()
	adminDo(t, "POST", "/llm_affinity/upstreams/"+home+"/drain?deadline=0s")
	eventually(t, 5*time.Second, "the home drained", func() bool { return drainPhase(t, home) == "drained" })
	for i := range 5 {
		resp, err := http.Get(routerURL + "/v1/responses/" + out.ID)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || !strings.Contains(string(body), out.ID) {
			t.Fatalf("retrieval %d: %d %s", i, resp.StatusCode, body)
		}
	}
	if p := drainPhase(t, home); p != "drained" {
		t.Fatalf("the home is %s after the retrievals", p)
	}
}
