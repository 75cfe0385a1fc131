package integration

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/llmaffinity/caddy-llm-affinity/caddyllm"
	"github.com/llmaffinity/caddy-llm-affinity/kvsim"
)

// promptMarker is sent in prompts; no log line or placeholder may carry it.
const promptMarker = "PROMPT-MARKER-5e1d7c"

// testModel is the model kvsim serves by default.
const testModel = kvsim.DefaultModel

// placeholderLog is the README's access log example: every llm_affinity
// placeholder as a field of the access log (log_append), and the reason
// as a response header.
const placeholderLog = `
	log {
		output file %s
		format json
	}
	log_append llm_upstream {http.llm_affinity.upstream}
	log_append llm_reason {http.llm_affinity.reason}
	log_append llm_matched_tokens {http.llm_affinity.matched_tokens}
	log_append llm_prompt_tokens {http.llm_affinity.prompt_tokens}
	log_append llm_estimated_ttft {http.llm_affinity.estimated_ttft}
	log_append llm_ttft {http.llm_affinity.ttft}
	log_append llm_model {http.llm_affinity.model}
	log_append llm_attempt {http.llm_affinity.attempt}
	log_append llm_stream {http.llm_affinity.stream}
	log_append llm_blocked_by {http.llm_affinity.blocked_by}
	header >X-LLM-Reason {http.llm_affinity.reason}
`

// router is a Caddy process on free ports: its admin API and its site.
type router struct {
	admin, site string // http://localhost:port
}

// startObserved runs the built Caddy with globals (extra global options) and
// site (the site block's body) on free ports; its admin API and site
// answer when it returns. Tests of this file run their own processes
// rather than caddytest's fixed ports, which other test runs on the same
// machine may hold.
func startObserved(t *testing.T, name, globals, site string) router {
	t.Helper()
	adminAddr := fmt.Sprintf("localhost:%d", freePort(t))
	r := router{admin: "http://" + adminAddr, site: fmt.Sprintf("http://localhost:%d", freePort(t))}
	config := fmt.Sprintf(`{
	admin %s
	persist_config off
	skip_install_trust
	grace_period 1ns
	%s
}
%s {
	%s
}
`, adminAddr, globals, r.site, site)
	runCaddy(t, buildCaddy(t), name, config, adminAddr)
	eventually(t, 30*time.Second, "the site answering", func() bool {
		resp, err := http.Get(r.site + "/llm_affinity/upstreams")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return true
	})
	return r
}

// phase is dial's drain phase in r's admin API.
func (r router) phase(t *testing.T, dial string) string {
	t.Helper()
	var list []caddyllm.UpstreamSnapshot
	getJSON(t, r.admin+"/llm_affinity/upstreams", &list)
	for _, u := range list {
		if u.Dial == dial {
			return u.Drain
		}
	}
	return "active"
}

// observedSite is the router's site with the placeholders in its access
// log and the status page.
func observedSite(fleet []*replica, dir string) string {
	return fmt.Sprintf(`%s
	# What used to print the request's state, prompt included.
	log_append vars_state {http.vars.llm_affinity}
	log_append vars_key llm_affinity
	header >X-LLM-Vars "{http.vars.llm_affinity}"
	handle /llm_affinity/* {
		llm_affinity_status
	}
	llm_affinity
	reverse_proxy %s {
		lb_policy llm_affinity {
			explain_header
		}
	}`, fmt.Sprintf(placeholderLog, filepath.Join(dir, "access.log")), dials(fleet))
}

// debugLog is the global option that writes Caddy's log, debug level,
// to dir/caddy.log.
func debugLog(dir string) string {
	return fmt.Sprintf(`log {
		output file %s
		format json
		level DEBUG
	}`, filepath.Join(dir, "caddy.log"))
}

// postTo posts body as JSON to url.
func postTo(t *testing.T, url string, body any) (int, http.Header, string) {
	t.Helper()
	raw, _ := json.Marshal(body)
	resp, err := http.Post(url, "application/json", bytes.NewReader(raw))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header, string(b)
}

// accessLogOf waits until the JSON access log file has at least n lines
// for requests to uri (it is written once the handlers return), and
// returns those lines and their entries.
func accessLogOf(t *testing.T, file, uri string, n int) (lines []string, entries []map[string]any) {
	t.Helper()
	eventually(t, 10*time.Second, fmt.Sprintf("%d requests to %s in the access log", n, uri), func() bool {
		all, allEntries := readJSONLines(t, file)
		lines, entries = nil, nil
		for i, e := range allEntries {
			if req, _ := e["request"].(map[string]any); req["uri"] == uri {
				lines, entries = append(lines, all[i]), append(entries, e)
			}
		}
		return len(entries) >= n
	})
	return lines, entries
}

// readJSONLines reads a JSON log file.
func readJSONLines(t *testing.T, file string) (lines []string, entries []map[string]any) {
	t.Helper()
	f, err := os.Open(file)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		var e map[string]any
		if err := json.Unmarshal(sc.Bytes(), &e); err != nil {
			t.Fatalf("%s: %v: %s", file, err, sc.Text())
		}
		lines = append(lines, sc.Text())
		entries = append(entries, e)
	}
	return lines, entries
}

// TestPlaceholdersCarryNoPrompt sends prompts holding a marker, streaming
// and not: the access log has every placeholder with the decision's
// values, and neither it, Caddy's debug log nor any header carries the
// marker (the request's state is no longer a request variable).
func TestPlaceholdersCarryNoPrompt(t *testing.T) {
	fleet := startFleet(t, 2, 1, kvsim.Config{})
	dir := t.TempDir()
	r := startObserved(t, "placeholders", debugLog(dir), observedSite(fleet, dir))

	system := strings.Repeat("You are the "+promptMarker+" assistant. ", 100)
	first := []msg{{"system", system}, {"user", "Where is my order " + promptMarker + "?"}}
	status, h1, body := postTo(t, r.site+"/v1/chat/completions", map[string]any{"model": testModel, "max_tokens": 4, "messages": first})
	if status != 200 || h1.Get("X-LLM-Reason") != "cold" {
		t.Fatalf("status %d reason %q: %s", status, h1.Get("X-LLM-Reason"), body)
	}
	status, h2, body := postTo(t, r.site+"/v1/chat/completions", map[string]any{"model": testModel, "max_tokens": 4, "stream": true,
		"messages": append(first, msg{"assistant", "Looking."}, msg{"user", "Order " + promptMarker})})
	if status != 200 || h2.Get("X-LLM-Reason") != "warm" {
		t.Fatalf("streamed turn: status %d reason %q: %.300s", status, h2.Get("X-LLM-Reason"), body)
	}
	// A request the handler does not route by its prompt has the
	// policy's reason, fallback; one it answers itself has the
	// placeholders without values: the header empty, not the
	// placeholder's own text.
	for _, c := range []struct{ method, path, body, reason string }{
		{"GET", "/v1/models", "", "fallback"},
		{"POST", "/v1/completions", `{"model": `, ""},
	} {
		req, _ := http.NewRequest(c.method, r.site+c.path, strings.NewReader(c.body))
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if v := strings.Join(resp.Header["X-Llm-Reason"], ""); v != c.reason {
			t.Errorf("%s %s (%d): X-LLM-Reason %q, want %q", c.method, c.path, resp.StatusCode, v, c.reason)
		}
	}
	if v := h1.Get("X-LLM-Vars"); v != "" {
		t.Errorf("{http.vars.llm_affinity} = %q, want nothing", v)
	}
	for _, h := range []http.Header{h1, h2} {
		for name, v := range h {
			if strings.Contains(strings.Join(v, " "), promptMarker) {
				t.Errorf("header %s carries the prompt's marker", name)
			}
		}
	}

	lines, entries := accessLogOf(t, filepath.Join(dir, "access.log"), "/v1/chat/completions", 2)
	for i, e := range entries[:2] {
		if !slices.Contains([]string{fleet[0].dial(), fleet[1].dial()}, fmt.Sprint(e["llm_upstream"])) ||
			e["llm_reason"] != []string{"cold", "warm"}[i] || e["llm_model"] != testModel || e["llm_attempt"] != float64(1) ||
			e["llm_stream"] != (i == 1) {
			t.Errorf("access log %d: %s", i, lines[i])
		}
		for _, f := range []string{"llm_prompt_tokens", "llm_estimated_ttft", "llm_ttft"} {
			if v, ok := e[f].(float64); !ok || v <= 0 {
				t.Errorf("access log %d: %s = %v", i, f, e[f])
			}
		}
		if m, ok := e["llm_matched_tokens"].(float64); !ok || (i == 1) != (m > 0) {
			t.Errorf("access log %d: matched tokens %v", i, e["llm_matched_tokens"])
		}
		if e["vars_state"] != nil || e["vars_key"] != "llm_affinity" {
			t.Errorf("access log %d: the request vars hold %v / %v", i, e["vars_state"], e["vars_key"])
		}
	}
	all, _ := readJSONLines(t, filepath.Join(dir, "caddy.log"))
	if !slices.ContainsFunc(all, func(l string) bool { return strings.Contains(l, `"msg":"routed"`) }) {
		t.Fatalf("the debug log has no decision: is it captured?")
	}
	for _, l := range append(lines, all...) {
		if strings.Contains(l, promptMarker) {
			t.Errorf("a log line carries the prompt's marker: %s", l)
		}
	}
}

// TestPassThroughRefusalsInTheAccessLog: embeddings for a model no
// engine lists get the router's 404 model_not_found, and their access log
// lines say so as a routed refusal's do (reason refused, blocked_by model,
// the model, upstream empty): as many lines as refused_total rose by.
// One the router sends on has reason fallback, its upstream, attempt and
// model. No line carries the input. (They used to have every
// llm_affinity field null: the access log counted no refusal.)
func TestPassThroughRefusalsInTheAccessLog(t *testing.T) {
	fleet := startFleetServing(t, 1, 20, kvsim.Config{}, func(name string, sim http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path != "/v1/embeddings" {
				sim.ServeHTTP(w, r)
				return
			}
			fmt.Fprint(w, `{"object":"list","data":[{"object":"embedding","index":0,"embedding":[0.5]}]}`)
		})
	})
	dir := t.TempDir()
	r := startObserved(t, "passthrough", "", fmt.Sprintf(`%s
	llm_affinity
	reverse_proxy %s {
		lb_policy llm_affinity {
			scrape_interval 100ms
			models_interval 1s
		}
		lb_retries 2
	}`, fmt.Sprintf(placeholderLog, filepath.Join(dir, "access.log")), dials(fleet)))
	eventually(t, 10*time.Second, "the engine's model list scraped", func() bool {
		var list []caddyllm.UpstreamSnapshot
		getJSON(t, r.admin+"/llm_affinity/upstreams", &list)
		return len(list) == 1 && list[0].Engine != nil && len(list[0].Engine.Models) > 0
	})
	refusedTotal := func() float64 {
		return counterValue(metricFamilies(t, r.admin+"/metrics"), "caddy_llm_affinity_refused_total", "code", "model_not_found")
	}
	before := refusedTotal()
	models := []string{"no-such-model", "nor-this-one", "nor-that-one", testModel, testModel}
	for _, model := range models {
		status, _, body := postTo(t, r.site+"/v1/embeddings", map[string]any{"model": model, "input": promptMarker})
		if want := map[bool]int{true: 200, false: 404}[model == testModel]; status != want {
			t.Fatalf("%s: %d, want %d: %s", model, status, want, body)
		}
	}
	refused := refusedTotal() - before
	if refused != 3 {
		t.Errorf("refused_total{code=model_not_found} rose by %v, want 3", refused)
	}

	lines, entries := accessLogOf(t, filepath.Join(dir, "access.log"), "/v1/embeddings", len(models))
	var refusedLines int
	for i, e := range entries {
		switch e["llm_reason"] {
		case "refused":
			refusedLines++
			if e["status"] != float64(404) || e["llm_blocked_by"] != "model" || e["llm_upstream"] != "" || e["llm_attempt"] != nil ||
				!slices.Contains(models[:3], fmt.Sprint(e["llm_model"])) {
				t.Errorf("access log %d: %s", i, lines[i])
			}
		case "fallback":
			if e["status"] != float64(200) || e["llm_blocked_by"] != nil || e["llm_upstream"] != fleet[0].dial() || e["llm_attempt"] != float64(1) ||
				e["llm_model"] != testModel {
				t.Errorf("access log %d: %s", i, lines[i])
			}
		default:
			t.Errorf("access log %d: reason %v: %s", i, e["llm_reason"], lines[i])
		}
		for _, f := range []string{"llm_prompt_tokens", "llm_matched_tokens", "llm_estimated_ttft", "llm_ttft", "llm_stream"} {
			if e[f] != nil {
				t.Errorf("access log %d: %s = %v, want null: the router does not read the input", i, f, e[f])
			}
		}
		if strings.Contains(lines[i], promptMarker) {
			t.Errorf("access log %d carries the input: %s", i, lines[i])
		}
	}
	if float64(refusedLines) != refused {
		t.Errorf("%d access log lines refused, refused_total rose by %v", refusedLines, refused)
	}
}

// do sends a request with browser-like headers and returns its status and
// body.
func do(t *testing.T, method, url string, header map[string]string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(method, url, nil)
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range header {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// TestStatusPageOrigins: the status page is served on the admin API and on
// a site; a drain from the page (Origin: the page's own origin) passes
// Caddy's default admin checks and the site's, one from another origin
// passes neither. A browser's typed-URL navigation to the admin API
// (Sec-Fetch-Mode without Origin) is refused by Caddy itself: hence the
// site handler.
func TestStatusPageOrigins(t *testing.T) {
	fleet := startFleet(t, 2, 1, kvsim.Config{})
	r := startObserved(t, "origins", "", observedSite(fleet, t.TempDir()))
	dial := fleet[0].dial()
	fromPage := func(origin string) map[string]string {
		return map[string]string{"Origin": origin, "Sec-Fetch-Mode": "cors", "Sec-Fetch-Site": "same-origin"}
	}
	for _, base := range []string{r.admin, r.site} {
		// One document, its script inline: Caddy's admin API refuses the
		// no-cors requests of <script src>.
		if code, body := do(t, "GET", base+"/llm_affinity/", nil); code != 200 || !strings.Contains(body, `fetch("upstreams"`) {
			t.Fatalf("GET %s/llm_affinity/: %d %.200s", base, code, body)
		}
		if code, _ := do(t, "GET", base+"/llm_affinity/index.html", nil); code != 404 {
			t.Fatalf("GET %s/llm_affinity/index.html: %d, want 404", base, code)
		}
		drainURL := base + "/llm_affinity/upstreams/" + dial + "/drain"
		if code, body := do(t, "POST", drainURL, fromPage("http://evil.example")); code != 403 {
			t.Fatalf("%s: a drain from another origin got %d %s", base, code, body)
		}
		if phase := r.phase(t, dial); phase != "active" {
			t.Fatalf("%s: a refused drain changed the phase to %s", base, phase)
		}
		origin := base
		if code, body := do(t, "POST", drainURL, fromPage(origin)); code != 200 || r.phase(t, dial) == "active" {
			t.Fatalf("%s: the page's drain got %d %s", base, code, body)
		}
		if code, body := do(t, "DELETE", drainURL, fromPage(origin)); code != 200 || r.phase(t, dial) != "active" {
			t.Fatalf("%s: the page's undrain got %d %s", base, code, body)
		}
	}
	navigate := map[string]string{"Sec-Fetch-Mode": "navigate", "Sec-Fetch-Site": "none", "Sec-Fetch-User": "?1"}
	if code, _ := do(t, "GET", r.site+"/llm_affinity/", navigate); code != 200 {
		t.Fatalf("a browser navigation to the site's page got %d", code)
	}
	if code, _ := do(t, "GET", r.admin+"/llm_affinity/", navigate); code != 403 {
		t.Logf("Caddy's admin API now lets a browser navigate to it (%d): the README's advice to use the site handler can be relaxed", code)
	}
}

// TestMissingHandlerIsLogged: lb_policy llm_affinity without the
// llm_affinity handler in the route routes every request without affinity;
// the router says so in its log, once.
func TestMissingHandlerIsLogged(t *testing.T) {
	fleet := startFleet(t, 2, 20, kvsim.Config{})
	adminAddr := fmt.Sprintf("localhost:%d", freePort(t))
	site := fmt.Sprintf("http://localhost:%d", freePort(t))
	proc := runCaddy(t, buildCaddy(t), "nohandler", fmt.Sprintf(`{
	admin %s
	persist_config off
	skip_install_trust
}
%s {
	reverse_proxy %s {
		lb_policy llm_affinity
	}
}
`, adminAddr, site, dials(fleet)), adminAddr)
	for range 3 {
		eventually(t, 30*time.Second, "a completion through the site", func() bool {
			resp, err := http.Post(site+"/v1/completions", "application/json",
				strings.NewReader(`{"model":"`+kvsim.DefaultModel+`","prompt":"hello","max_tokens":2}`))
			if err != nil {
				return false
			}
			resp.Body.Close()
			return resp.StatusCode == 200
		})
	}
	const warning = "without the llm_affinity handler having read it"
	eventually(t, 10*time.Second, "the missing handler in the log", func() bool {
		log, _ := os.ReadFile(proc.log)
		return strings.Contains(string(log), warning)
	})
	if log, _ := os.ReadFile(proc.log); strings.Count(string(log), warning) != 1 {
		t.Fatalf("the warning is logged %d times", strings.Count(string(log), warning))
	}
}

// TestCanceledWaitsInTheAccessLog: a client that leaves while its request
// waits at the gateway (its only upstream drained) or while the router
// fetches the engines' model lists again (a model none listed) is logged
// as 499 with reason canceled and what it waited for, not with nulls.
func TestCanceledWaitsInTheAccessLog(t *testing.T) {
	var slow atomic.Bool
	asked := make(chan struct{}, 1)
	release := make(chan struct{})
	fleet := startFleetServing(t, 1, 20, kvsim.Config{}, func(name string, sim http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path == "/v1/models" && slow.Load() {
				select {
				case asked <- struct{}{}:
				default:
				}
				select { // a list fetch that hangs until the test ends
				case <-release:
				case <-r.Context().Done():
				}
			}
			sim.ServeHTTP(w, r)
		})
	})
	t.Cleanup(func() { close(release) }) // before the fleet stops
	dir := t.TempDir()
	file := filepath.Join(dir, "access.log")
	r := startObserved(t, "canceled", "", fmt.Sprintf(placeholderLog, file)+fmt.Sprintf(`
	llm_affinity
	reverse_proxy %s {
		lb_policy llm_affinity {
			scrape_interval 100ms
			models_interval 1h
			queue_timeout 1m
		}
	}`, dials(fleet)))
	if status, _, body := postTo(t, r.site+"/v1/completions", map[string]any{"model": testModel, "prompt": "hi", "max_tokens": 2}); status != 200 {
		t.Fatalf("first request: %d %s", status, body)
	}
	// leave sends a request and cancels it once waiting says it waits.
	leave := func(model string, waiting func() bool) {
		t.Helper()
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		raw, _ := json.Marshal(map[string]any{"model": model, "prompt": "hi", "max_tokens": 2})
		req, _ := http.NewRequestWithContext(ctx, "POST", r.site+"/v1/completions", bytes.NewReader(raw))
		req.Header.Set("Content-Type", "application/json")
		done := make(chan error, 1)
		go func() {
			resp, err := http.DefaultClient.Do(req)
			if err == nil {
				resp.Body.Close()
				err = fmt.Errorf("answered %d", resp.StatusCode)
			}
			done <- err
		}()
		eventually(t, 10*time.Second, model+" waiting", waiting)
		cancel()
		if err := <-done; !errors.Is(err, context.Canceled) {
			t.Fatalf("%s: %v, want the client's cancellation", model, err)
		}
	}
	dial := fleet[0].dial()
	drain := func(method string) {
		req, _ := http.NewRequest(method, r.admin+"/llm_affinity/upstreams/"+dial+"/drain", nil)
		resp, err := http.DefaultClient.Do(req)
		if err != nil || resp.StatusCode != 200 {
			t.Fatalf("%s drain: %v %v", method, err, resp)
		}
		resp.Body.Close()
	}
	drain("POST")
	leave(testModel, func() bool {
		var v struct{ Held int }
		getJSON(t, r.admin+"/llm_affinity/gateway", &v)
		return v.Held == 1
	})
	drain("DELETE")
	slow.Store(true)
	leave("no-such-model", func() bool {
		select {
		case <-asked:
			return true
		default:
			return false
		}
	})
	_, entries := accessLogOf(t, file, "/v1/completions", 3)
	for i, want := range []map[string]any{
		1: {"status": 499.0, "llm_reason": "canceled", "llm_blocked_by": "draining", "llm_upstream": ""},
		2: {"status": 499.0, "llm_reason": "canceled", "llm_blocked_by": "model", "llm_upstream": ""},
	} {
		if want == nil {
			continue
		}
		for k, v := range want {
			if entries[i][k] != v {
				t.Errorf("request %d: %s = %v, want %v", i, k, entries[i][k], v)
			}
		}
	}
}
