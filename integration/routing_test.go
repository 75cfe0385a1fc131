package integration

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	"github.com/llmaffinity/caddy-llm-affinity/caddyllm"
	"github.com/llmaffinity/caddy-llm-affinity/kvsim"
)

func chat(messages []msg, maxTokens int) map[string]any {
	return map[string]any{"model": kvsim.DefaultModel, "messages": messages, "max_tokens": maxTokens}
}

// TestConversationStaysWarm: turn 2 of a conversation lands where turn 1
// did and the engine reports cache hits; after a reload through the admin
// API, turn 3 still lands warm.
func TestConversationStaysWarm(t *testing.T) {
	fleet := startFleet(t, 4, 20, kvsim.Config{})
	tester := startCaddy(t, caddyfile(fleet, "", "", ""))

	convo := []msg{
		{"system", text("You are a meticulous assistant", 12_000)},
		{"user", "Summarise the plan."},
	}
	first := post(t, "/v1/chat/completions", chat(convo, 16))
	if first.status != 200 || first.replica == "" {
		t.Fatalf("turn 1: %d %s", first.status, first.body)
	}
	// Other conversations spread load meanwhile.
	for i := 0; i < 6; i++ {
		other := []msg{{"system", text("other"+string(rune('a'+i)), 8_000)}, {"user", "hi"}}
		if c := post(t, "/v1/chat/completions", chat(other, 8)); c.status != 200 {
			t.Fatalf("other conversation: %d %s", c.status, c.body)
		}
	}
	convo = append(convo, msg{"assistant", "Here is the plan."}, msg{"user", "Now the details."})
	second := post(t, "/v1/chat/completions", chat(convo, 16))
	if second.replica != first.replica {
		t.Fatalf("turn 2 went to %s, turn 1 to %s (%s)", second.replica, first.replica, second.explain)
	}
	if second.cached < 2000 || !strings.Contains(second.explain, "reason=warm") {
		t.Fatalf("turn 2: engine reports %d cached tokens, explanation %q", second.cached, second.explain)
	}

	// Reload with a changed config through the admin API.
	cfg := caddyfile(fleet, "", "queue_timeout 3s", "")
	reload(t, tester, cfg)

	convo = append(convo, msg{"assistant", "Details follow."}, msg{"user", "And the risks?"})
	third := post(t, "/v1/chat/completions", chat(convo, 16))
	if third.replica != first.replica || third.cached < 2000 {
		t.Fatalf("after reload turn 3 went to %s (turn 1 %s), %d cached", third.replica, first.replica, third.cached)
	}
}

// TestModelNamesShareAffinity: engines serving their base model under
// two names (vLLM's --served-model-name), where a request may also name
// none, keep one prefix cache for all of them; the router seeds the
// names alike from the engines' lists, so a conversation begun under one
// name stays warm under the other and under none, and the router counts
// the hit. An adapter has a cache of its own: the same prompt for it
// matches nothing.
func TestModelNamesShareAffinity(t *testing.T) {
	cfg := kvsim.Config{Model: "/models/llama", ServedModelName: []string{"llama", "llama-3.1-8b"}, Adapters: []string{"sql-lora"}}
	fleet := startFleet(t, 4, 20, cfg)
	startCaddy(t, caddyfile(fleet, "", "scrape_interval 100ms\n\t\t\tmodels_interval 1h", ""))
	waitForModelLists(t, fleet)
	turn := func(model string, messages []msg) completion {
		t.Helper()
		body := map[string]any{"messages": messages, "max_tokens": 8}
		if model != "" {
			body["model"] = model
		}
		c := post(t, "/v1/chat/completions", body)
		if c.status != 200 || c.replica == "" {
			t.Fatalf("model %q: %d %s", model, c.status, c.body)
		}
		return c
	}
	matched := func(explain string) int {
		_, after, _ := strings.Cut(explain, "matched=")
		n, _ := strconv.Atoi(strings.TrimSpace(strings.SplitN(after, ";", 2)[0]))
		return n
	}

	convo := []msg{{"system", text("You are a meticulous assistant", 12_000)}, {"user", "Summarise the plan."}}
	first := turn("llama-3.1-8b", convo)
	for i := range 6 { // other conversations spread load meanwhile
		turn("llama", []msg{{"system", text("other"+string(rune('a'+i)), 8_000)}, {"user", "hi"}})
	}
	for i, model := range []string{"llama", ""} {
		convo = append(convo, msg{"assistant", "Here it is."}, msg{"user", fmt.Sprintf("And then %d?", i)})
		next := turn(model, convo)
		if next.replica != first.replica || !strings.Contains(next.explain, "reason=warm") || matched(next.explain) < 2000 || next.cached < 2000 {
			t.Errorf("model %q after llama-3.1-8b: %s (first on %s), engine cached %d tokens", model, next.explain, first.replica, next.cached)
		}
	}
	if c := turn("sql-lora", convo[:2]); matched(c.explain) != 0 || c.cached != 0 {
		t.Errorf("the adapter matched the base model's prefix: %s, engine cached %d tokens", c.explain, c.cached)
	}
}

// TestAdaptersTakeFreeSlots: lora.Caddyfile's setup with two GPU slots a
// replica: six adapters asked for in turn, twice, through Caddy. Each
// replica loads exactly two from storage, whatever the router's random
// draw, and the second round finds every adapter resident (no reload
// from host memory anywhere). Before the router counted what a load
// evicts, the draw could leave one replica with more adapters than slots,
// every request there reloading its adapter.
func TestAdaptersTakeFreeSlots(t *testing.T) {
	adapters := []string{"tenant-a", "tenant-b", "tenant-c", "tenant-d", "tenant-e", "tenant-f"}
	fleet := startFleet(t, 3, 50, kvsim.Config{Adapters: adapters, MaxLoRAs: 2})
	startCaddy(t, caddyfile(fleet, "", "adapters "+strings.Join(adapters, " ")+"\n\t\t\tmax_loras 2", ""))
	for round := range 2 {
		for _, a := range adapters {
			c := post(t, "/v1/completions", map[string]any{"model": a, "prompt": "Hello there, how are you", "max_tokens": 4})
			if c.status != 200 {
				t.Fatalf("%s: %d %s", a, c.status, c.body)
			}
			if round > 0 && strings.Contains(c.explain, "reason=adapter") {
				t.Errorf("round 2: %s loaded again: %s", a, c.explain)
			}
		}
	}
	for _, r := range fleet {
		if st := r.sim.State(); st.AdapterStorageLoads != 2 || st.AdapterHostLoads != 0 {
			t.Errorf("%s loaded %d adapters from storage and %d from host (GPU: %v), want 2 and 0",
				r.name, st.AdapterStorageLoads, st.AdapterHostLoads, st.GPUAdapters)
		}
	}
}

// TestUnloadedAdapterGoesElsewhere: without scraping, an adapter
// unloaded on the engine that held it (a call that did not pass the
// router) gets one 404 there and then goes to the other engines, which
// serve it; before, the engine's freed slot made it the cheapest place
// to load the adapter, and every request went back there for a 404.
func TestUnloadedAdapterGoesElsewhere(t *testing.T) {
	adapters := []string{"tenant-a", "tenant-b", "tenant-c"}
	fleet := startFleet(t, 3, 50, kvsim.Config{Adapters: adapters, MaxLoRAs: 1})
	startCaddy(t, caddyfile(fleet, "", "adapters "+strings.Join(adapters, " ")+"\n\t\t\tmax_loras 1", ""))
	// One adapter in each engine's one slot (new adapters take free
	// slots first): the others' slots are full when tenant-c's holder
	// frees its own.
	var first completion
	for _, a := range adapters {
		if first = post(t, "/v1/completions", map[string]any{"model": a, "prompt": "Hello there", "max_tokens": 2}); first.status != 200 {
			t.Fatalf("%s: %d %s", a, first.status, first.body)
		}
	}
	body := map[string]any{"model": "tenant-c", "prompt": "Hello there", "max_tokens": 2}
	holder := named(fleet, first.replica)
	resp, err := http.Post(holder.http.URL+"/v1/unload_lora_adapter", "application/json", strings.NewReader(`{"lora_name":"tenant-c"}`))
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("unload on %s: %v %v", holder.name, err, resp)
	}
	resp.Body.Close()
	refused := 0
	for i := range 8 {
		c := post(t, "/v1/completions", body)
		switch {
		case c.status == 404 && c.replica == holder.name:
			refused++
		case c.status != 200:
			t.Fatalf("request %d: %d from %s: %s", i, c.status, c.replica, c.body)
		}
	}
	if refused > 1 {
		t.Errorf("%d of 8 requests went back to %s, which unloaded tenant-c, for its 404; want at most 1", refused, holder.name)
	}
}

// TestHotPrefixSpills: many concurrent requests sharing a long prefix
// stay on the warm replica until its queue outweighs the prefill it
// saves, then spill to a second one.
func TestHotPrefixSpills(t *testing.T) {
	fleet := startFleet(t, 4, 1, kvsim.Config{})
	startCaddy(t, caddyfile(fleet, "", "output_estimate max_tokens", ""))
	prefix := text("shared system prompt", 64_000) // 16k tokens: 1.3 s of prefill saved
	// Warm one replica first.
	warm := post(t, "/v1/completions", map[string]any{"model": kvsim.DefaultModel, "prompt": prefix + " q0", "max_tokens": 4})
	if warm.status != 200 {
		t.Fatalf("warm-up: %d %s", warm.status, warm.body)
	}
	const n = 40
	var mu sync.Mutex
	count := map[string]int{}
	reasons := map[string]int{}
	var wg sync.WaitGroup
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			c := post(t, "/v1/completions", map[string]any{
				// Each brings 2k tokens of its own: the warm replica's
				// queue grows by 0.13 s a request against 1.07 s saved.
				"model": kvsim.DefaultModel, "prompt": prefix + text(fmt.Sprint(" question ", i), 8000), "max_tokens": 200,
			})
			mu.Lock()
			defer mu.Unlock()
			count[c.replica]++
			for _, r := range []string{"warm", "spill", "cold"} {
				if strings.Contains(c.explain, "reason="+r) {
					reasons[r]++
				}
			}
		}(i)
	}
	wg.Wait()
	t.Logf("replicas %v reasons %v", count, reasons)
	if count[warm.replica] < 6 {
		t.Fatalf("warm replica %s took only %d of %d", warm.replica, count[warm.replica], n)
	}
	if len(count) < 2 || reasons["spill"] == 0 {
		t.Fatalf("no spill: %v %v", count, reasons)
	}
}

// TestGatewayViewShowsHeldRequests: a request that no replica can take
// (all are drained) waits at the gateway, and the admin API (GET
// /llm_affinity/gateway) and the caddy_llm_affinity_gateway_held gauge say
// so; once its client gives up, it waits no more, and Caddy's access log
// has it as 499 (client closed request), as the proxy logs a client gone,
// not as a server's 503.
func TestGatewayViewShowsHeldRequests(t *testing.T) {
	fleet := startFleet(t, 2, 1, kvsim.Config{})
	accessLog := filepath.Join(t.TempDir(), "access.log")
	startCaddy(t, withAccessLog(caddyfile(fleet, "", "queue_timeout 10m", ""), accessLog))
	held := func() int {
		var v caddyllm.GatewayView
		getJSON(t, adminURL+"/llm_affinity/gateway", &v)
		return v.Held
	}
	if n := held(); n != 0 {
		t.Fatalf("%d held before any request", n)
	}
	for _, r := range fleet {
		adminDo(t, "POST", "/llm_affinity/upstreams/"+r.dial()+"/drain?deadline=1h")
	}
	ctx, giveUp := context.WithCancel(context.Background())
	defer giveUp()
	done := make(chan struct{})
	go func() {
		defer close(done)
		body, _ := json.Marshal(map[string]any{"model": kvsim.DefaultModel, "prompt": "held", "max_tokens": 4})
		req, _ := http.NewRequestWithContext(ctx, "POST", routerURL+"/v1/completions", strings.NewReader(string(body)))
		req.Header.Set("Content-Type", "application/json")
		if resp, err := http.DefaultClient.Do(req); err == nil {
			resp.Body.Close()
		}
	}()
	eventually(t, 10*time.Second, "the request held", func() bool { return held() == 1 })
	if v := gaugeOf(metricFamilies(t, adminURL+"/metrics"), "caddy_llm_affinity_gateway_held"); v != 1 {
		t.Errorf("caddy_llm_affinity_gateway_held = %v, want 1", v)
	}
	giveUp()
	<-done
	eventually(t, 10*time.Second, "the request gone from the gateway", func() bool { return held() == 0 })
	var statuses []int
	eventually(t, 10*time.Second, "the request in the access log", func() bool {
		statuses = accessLogStatuses(t, accessLog, "/v1/completions")
		return len(statuses) > 0
	})
	if len(statuses) != 1 || statuses[0] != 499 {
		t.Errorf("access log statuses %v for the request whose client left, want [499]", statuses)
	}
	for _, r := range fleet {
		adminDo(t, "DELETE", "/llm_affinity/upstreams/"+r.dial()+"/drain")
	}
}

// withAccessLog adds to config's site an access log in JSON, written to
// path.
func withAccessLog(config, path string) string {
	site := "http://" + routerHost + " {\n"
	return strings.Replace(config, site, site+"\tlog {\n\t\toutput file "+path+"\n\t\tformat json\n\t}\n", 1)
}

// accessLogStatuses returns the statuses the access log at path has for
// requests to uri, in order.
func accessLogStatuses(t *testing.T, path, uri string) []int {
	t.Helper()
	raw, err := os.ReadFile(path)
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	var statuses []int
	for line := range strings.SplitSeq(strings.TrimSpace(string(raw)), "\n") {
		var entry struct {
			Request struct {
				URI string `json:"uri"`
			} `json:"request"`
			Status int `json:"status"`
		}
		if json.Unmarshal([]byte(line), &entry) == nil && entry.Request.URI == uri {
			statuses = append(statuses, entry.Status)
		}
	}
	return statuses
}

// TestShedWhenNothingFits: with every replica's KV full of stalled
// requests that will not free it within queue_timeout (at 1,000 prefill
// tokens/s, their queued prefill alone takes 18 s), a new one waits at the
// gateway, then gets 503 with Retry-After; nothing is parked on a replica
// that cannot start it in time.
func TestShedWhenNothingFits(t *testing.T) {
	fleet := startFleet(t, 2, 1, kvsim.Config{})
	for _, r := range fleet {
		r.sim.SetFaults(kvsim.Faults{Stall: true})
	}
	startCaddy(t, caddyfile(fleet, "", "kv_capacity 20000\n\t\t\tprefill_rate 1000\n\t\t\tqueue_timeout 1s\n\t\t\toutput_estimate max_tokens", ""))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// Two 9k-token requests per replica fill its 20k tokens.
	var wg sync.WaitGroup
	for i := 0; i < 4; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			body, _ := json.Marshal(map[string]any{"model": kvsim.DefaultModel, "prompt": text("filler"+string(rune('a'+i)), 36_000), "max_tokens": 100})
			req, _ := http.NewRequestWithContext(ctx, "POST", routerURL+"/v1/completions", strings.NewReader(string(body)))
			req.Header.Set("Content-Type", "application/json")
			if resp, err := http.DefaultClient.Do(req); err == nil {
				resp.Body.Close()
			}
		}(i)
	}
	eventually(t, 5*time.Second, "four requests in flight", func() bool {
		n := 0
		for _, u := range upstreams(t) {
			if strings.Contains(dials(fleet), u.Dial) {
				n += u.InFlight
			}
		}
		return n == 4
	})
	start := time.Now()
	c := post(t, "/v1/completions", map[string]any{"model": kvsim.DefaultModel, "prompt": text("late", 20_000), "max_tokens": 100})
	waited := time.Since(start)
	if c.status != 503 || c.header.Get("Retry-After") == "" || !strings.Contains(c.body, `"error"`) {
		t.Fatalf("got %d Retry-After=%q body %s", c.status, c.header.Get("Retry-After"), c.body)
	}
	if waited < 900*time.Millisecond {
		t.Fatalf("shed after %v, want a wait of the 1s queue timeout", waited)
	}
	// The fillers reach the engines through the proxy after they were
	// charged: wait for them, on a busy machine.
	for _, r := range fleet {
		eventually(t, 10*time.Second, r.name+" holding two fillers", func() bool {
			var st struct {
				InFlight int `json:"in_flight"`
			}
			resp, err := http.Get(r.http.URL + "/kvsim/state")
			if err != nil {
				return false
			}
			defer resp.Body.Close()
			json.NewDecoder(resp.Body).Decode(&st)
			return st.InFlight == 2
		})
	}
	cancel()
	wg.Wait()
}

// TestBadInput: malformed JSON gets a 400 JSON error and the server keeps
// serving; an oversized body gets 413.
func TestBadInput(t *testing.T) {
	fleet := startFleet(t, 2, 20, kvsim.Config{})
	startCaddy(t, caddyfile(fleet, "max_body 64KiB", "", ""))
	for _, raw := range []string{`{"model": "x", "prompt": `, `not json`, `{"messages": "nope"}`, `{"prompt": 42}`} {
		c := postRaw(t, "/v1/completions", []byte(raw))
		if raw == `{"messages": "nope"}` {
			c = postRaw(t, "/v1/chat/completions", []byte(raw))
		}
		var e struct {
			Error struct {
				Message string `json:"message"`
			} `json:"error"`
		}
		if c.status != 400 || json.Unmarshal([]byte(c.body), &e) != nil || e.Error.Message == "" {
			t.Errorf("%q: got %d %s", raw, c.status, c.body)
		}
	}
	big := post(t, "/v1/completions", map[string]any{"model": kvsim.DefaultModel, "prompt": text("big", 100_000)})
	if big.status != 413 {
		t.Errorf("oversized body: got %d %s", big.status, big.body)
	}
	ok := post(t, "/v1/completions", map[string]any{"model": kvsim.DefaultModel, "prompt": "still serving", "max_tokens": 4})
	if ok.status != 200 {
		t.Fatalf("after bad input: %d %s", ok.status, ok.body)
	}
	// Content-less requests pass through and are balanced.
	resp, err := http.Get(routerURL + "/v1/models")
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("GET /v1/models: %v %v", err, resp)
	}
	resp.Body.Close()
}

// TestRetryResendsFullBody: when the chosen (warm) upstream dies, the
// retry reaches another one with the full body.
func TestRetryResendsFullBody(t *testing.T) {
	fleet := startFleet(t, 3, 20, kvsim.Config{})
	// A POST may fail after the connection was made (a pooled connection
	// to the dead upstream): lb_retry_match allows retrying it, which is
	// safe because the handler resends the whole body.
	startCaddy(t, caddyfile(fleet, "", "", "lb_retries 2\n\t\tlb_retry_match {\n\t\t\tmethod POST\n\t\t}"))
	prompt := text("retry me", 20_000)
	first := post(t, "/v1/completions", map[string]any{"model": kvsim.DefaultModel, "prompt": prompt, "max_tokens": 4})
	dead := named(fleet, first.replica)
	if dead == nil {
		t.Fatalf("turn 1 served by unknown replica %q", first.replica)
	}
	dead.http.CloseClientConnections()
	dead.http.Close()
	again := post(t, "/v1/completions", map[string]any{"model": kvsim.DefaultModel, "prompt": prompt + " more", "max_tokens": 4})
	if again.status != 200 || again.replica == "" || again.replica == dead.name {
		t.Fatalf("after the warm upstream died: %d from %q (%s) %s", again.status, again.replica, again.explain, again.body)
	}
	if !strings.Contains(again.explain, "attempt=2") {
		t.Errorf("explanation %q does not show a second attempt", again.explain)
	}
	var usage struct {
		Usage struct {
			PromptTokens int `json:"prompt_tokens"`
		} `json:"usage"`
	}
	json.Unmarshal([]byte(again.body), &usage)
	if usage.Usage.PromptTokens < 5000 {
		t.Fatalf("retry delivered a prompt of %d tokens: body not resent in full", usage.Usage.PromptTokens)
	}
}

// TestClientAbortReleasesQueue: a client that goes away in the middle of
// a stream leaves no queued tokens behind.
func TestClientAbortReleasesQueue(t *testing.T) {
	fleet := startFleet(t, 1, 1, kvsim.Config{})
	startCaddy(t, caddyfile(fleet, "", "", ""))
	ctx, cancel := context.WithCancel(context.Background())
	body := `{"model":"` + kvsim.DefaultModel + `","prompt":"` + text("abort", 4000) + `","max_tokens":2000,"stream":true}`
	req, _ := http.NewRequestWithContext(ctx, "POST", routerURL+"/v1/completions", strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 512)
	if _, err := resp.Body.Read(buf); err != nil {
		t.Fatal(err)
	}
	dial := fleet[0].dial()
	if u := upstream(t, dial); u.InFlight != 1 || u.QueuedDecodeTokens == 0 {
		t.Fatalf("mid-stream state %+v, want one in flight with decode queued", u)
	}
	cancel()
	resp.Body.Close()
	eventually(t, 5*time.Second, "queued tokens return to zero", func() bool {
		u := upstream(t, dial)
		return u.InFlight == 0 && u.QueuedPrefillTokens == 0 && u.QueuedDecodeTokens == 0 && u.KVTokensInFlight == 0
	})
}

// TestOpenAIClientStreamsThroughRouter uses the official OpenAI Go
// client for a streamed chat completion.
func TestOpenAIClientStreamsThroughRouter(t *testing.T) {
	fleet := startFleet(t, 2, 20, kvsim.Config{})
	startCaddy(t, caddyfile(fleet, "", "", ""))
	client := openai.NewClient(option.WithBaseURL(routerURL+"/v1/"), option.WithAPIKey("unused"))
	stream := client.Chat.Completions.NewStreaming(context.Background(), openai.ChatCompletionNewParams{
		Model:         kvsim.DefaultModel,
		Messages:      []openai.ChatCompletionMessageParamUnion{openai.SystemMessage(text("be brief", 2000)), openai.UserMessage("Hello")},
		MaxTokens:     openai.Int(24),
		StreamOptions: openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)},
	})
	var acc openai.ChatCompletionAccumulator
	chunks := 0
	for stream.Next() {
		acc.AddChunk(stream.Current())
		chunks++
	}
	if err := stream.Err(); err != nil {
		t.Fatal(err)
	}
	if len(acc.Choices) == 0 || acc.Choices[0].Message.Content == "" || acc.Usage.CompletionTokens != 24 {
		t.Fatalf("accumulated %+v after %d chunks", acc.ChatCompletion, chunks)
	}
	eventually(t, 10*time.Second, "the stream's charge is released", func() bool {
		for _, r := range fleet {
			if u := upstream(t, r.dial()); u.InFlight != 0 || u.QueuedDecodeTokens != 0 {
				return false
			}
		}
		return true
	})
}

// TestUnknownModelAnswersAtOnce: with the engines' model lists scraped, a
// model no upstream serves gets the OpenAI API's 404 (model_not_found) at
// once, not a 503 after waiting; without model lists the engine's own 404
// comes back.
func TestUnknownModelAnswersAtOnce(t *testing.T) {
	fleet := startFleet(t, 2, 20, kvsim.Config{})
	// A wait for capacity would last the client's whole timeout.
	startCaddy(t, caddyfile(fleet, "", "scrape_interval 100ms\n\t\t\tmodels_interval 1s\n\t\t\tqueue_timeout 10m", ""))
	eventually(t, 10*time.Second, "both model lists scraped", func() bool {
		for _, r := range fleet {
			if v := engineView(t, r.dial()); v == nil || len(v.Models) == 0 {
				return false
			}
		}
		return true
	})
	client := &http.Client{Timeout: 20 * time.Second}
	for _, path := range []string{"/v1/completions", "/v1/chat/completions"} {
		body := `{"model":"gpt-4","prompt":"hi","messages":[{"role":"user","content":"hi"}],"max_tokens":4}`
		resp, err := client.Post(routerURL+path, "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatalf("%s: %v (held instead of answered?)", path, err)
		}
		var e struct {
			Error struct {
				Type  string `json:"type"`
				Code  string `json:"code"`
				Param string `json:"param"`
			} `json:"error"`
		}
		json.NewDecoder(resp.Body).Decode(&e)
		resp.Body.Close()
		if resp.StatusCode != http.StatusNotFound || e.Error.Code != "model_not_found" || e.Error.Type != "invalid_request_error" ||
			e.Error.Param != "model" || resp.Header.Get("Retry-After") != "" {
			t.Fatalf("%s: %d %+v Retry-After %q", path, resp.StatusCode, e, resp.Header.Get("Retry-After"))
		}
	}
	if c := post(t, "/v1/completions", map[string]any{"model": kvsim.DefaultModel, "prompt": "hi", "max_tokens": 2}); c.status != 200 {
		t.Fatalf("a served model got %d", c.status)
	}
}

// TestBodyNotDeclaredJSONGetsTheEnginesAnswer: vLLM refuses a body whose
// Content-Type is not application/json (400, "Unsupported Media Type")
// before it reads the model; the router passes such a request on rather
// than answer for its model (404) or its JSON (400), which would send the
// client after another mistake first. application/json with parameters is
// routed as any.
func TestBodyNotDeclaredJSONGetsTheEnginesAnswer(t *testing.T) {
	fleet := startFleet(t, 2, 20, kvsim.Config{})
	startCaddy(t, caddyfile(fleet, "", "scrape_interval 100ms\n\t\t\tmodels_interval 1s", ""))
	modelsScraped(t, fleet)
	send := func(contentType, body string) (int, string, http.Header) {
		t.Helper()
		req, _ := http.NewRequest("POST", routerURL+"/v1/chat/completions", strings.NewReader(body))
		if contentType != "" {
			req.Header.Set("Content-Type", contentType)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b), resp.Header
	}
	unknown := `{"model":"gpt-4","messages":[{"role":"user","content":"hi"}],"max_tokens":4}`
	for _, tc := range []struct{ contentType, body string }{
		{"text/plain", unknown},
		{"application/x-www-form-urlencoded", unknown}, // curl -d without -H
		{"application/vnd.api+json", unknown},
		{"text/plain", `{"model":"` + kvsim.DefaultModel + `","messages":[{"role":"user","content":"hi"}],"max_tokens":4}`},
		{"text/plain", `not json`},
	} {
		status, body, header := send(tc.contentType, tc.body)
		if status != 400 || !strings.Contains(body, "Unsupported Media Type") || header.Get("X-LLM-Affinity") != "" {
			t.Errorf("Content-Type %q, %s: %d %s (explained %q), want the engine's 400", tc.contentType, tc.body, status, body, header.Get("X-LLM-Affinity"))
		}
	}
	// Passed through unread too (kvsim has no embeddings: its own 404).
	req, _ := http.NewRequest("POST", routerURL+"/v1/embeddings", strings.NewReader(`{"model":"gpt-4","input":"hi"}`))
	req.Header.Set("Content-Type", "text/plain")
	if resp, err := http.DefaultClient.Do(req); err != nil {
		t.Fatal(err)
	} else {
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if strings.Contains(string(b), "model_not_found") {
			t.Errorf("embeddings as text/plain: %d %s, want the engine's answer", resp.StatusCode, b)
		}
	}
	// A body without a Content-Type is read as JSON, as SGLang reads it
	// (vLLM, here kvsim, refuses it after routing).
	if status, body, header := send("", `{"model":"`+kvsim.DefaultModel+`","messages":[{"role":"user","content":"hi"}],"max_tokens":4}`); status != 400 ||
		!strings.Contains(body, "Unsupported Media Type") || header.Get("X-LLM-Affinity") == "" {
		t.Errorf("no Content-Type: %d %s (explained %q), want routed, then the engine's 400", status, body, header.Get("X-LLM-Affinity"))
	}
	if status, body, _ := send("Application/JSON; charset=utf-8", unknown); status != 404 || !strings.Contains(body, "model_not_found") {
		t.Errorf("application/json with a charset: %d %s, want the router's 404", status, body)
	}
	if status, body, header := send("application/json; charset=utf-8", `{"model":"`+kvsim.DefaultModel+`","messages":[{"role":"user","content":"hi"}],"max_tokens":4}`); status != 200 || header.Get("X-LLM-Affinity") == "" {
		t.Errorf("application/json with a charset: %d %s, not routed by the router", status, body)
	}
}

// TestUnknownModelWithoutModelLists: without scraping the router cannot
// know, so the request goes to an engine, whose 404 comes back.
func TestUnknownModelWithoutModelLists(t *testing.T) {
	fleet := startFleet(t, 2, 20, kvsim.Config{})
	startCaddy(t, caddyfile(fleet, "", "", ""))
	if c := post(t, "/v1/completions", map[string]any{"model": "gpt-4", "prompt": "hi", "max_tokens": 2}); c.status != http.StatusNotFound {
		t.Fatalf("status %d: %s", c.status, c.body)
	}
}

// TestOversizedBodyAnsweredAtOnce: a Content-Length over max_body gets 413
// with an OpenAI error body at once, and the connection closes, also when
// the client holds the body back for a 100 Continue; a body shorter than
// its Content-Length gets a 400 with an OpenAI error body.
func TestOversizedBodyAnsweredAtOnce(t *testing.T) {
	fleet := startFleet(t, 1, 20, kvsim.Config{})
	startCaddy(t, caddyfile(fleet, "max_body 1MiB", "", ""))
	send := func(head, body string) (*http.Response, string) {
		t.Helper()
		c, err := net.Dial("tcp", routerHost)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		c.Write([]byte(head + body))
		if body != "" {
			c.(*net.TCPConn).CloseWrite() // the body ends short of its length
		}
		// Bounds a failure only: an answer held for the body never comes.
		c.SetReadDeadline(time.Now().Add(20 * time.Second))
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			t.Fatalf("no answer: %v", err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		return resp, string(b)
	}
	head := "POST /v1/completions HTTP/1.1\r\nHost: " + routerHost + "\r\nContent-Type: application/json\r\nContent-Length: 2000000\r\n"
	for _, expect := range []string{"", "Expect: 100-continue\r\n"} {
		resp, body := send(head+expect+"\r\n", "")
		var e struct {
			Error struct{ Type, Message string } `json:"error"`
		}
		if resp.StatusCode != http.StatusRequestEntityTooLarge || json.Unmarshal([]byte(body), &e) != nil ||
			e.Error.Type != "invalid_request_error" || !resp.Close {
			t.Fatalf("%q: %d close=%v %s", expect, resp.StatusCode, resp.Close, body)
		}
	}
	resp, body := send("POST /v1/completions HTTP/1.1\r\nHost: "+routerHost+"\r\nContent-Type: application/json\r\nContent-Length: 500\r\n\r\n", `{"model":"m","prompt":"short"}`)
	if resp.StatusCode != http.StatusBadRequest || !strings.Contains(body, `"invalid_request_error"`) {
		t.Fatalf("short body: %d %s", resp.StatusCode, body)
	}
}

// TestImpossibleRequestsAnsweredAtOnce: a prompt larger than every
// upstream's KV cache (text even at 16 bytes a token) gets 400
// context_length_exceeded, and a compressed body 415, at once (a wait for
// capacity would last the client's timeout); a prompt that fits is
// served.
func TestImpossibleRequestsAnsweredAtOnce(t *testing.T) {
	fleet := startFleet(t, 2, 20, kvsim.Config{})
	startCaddy(t, caddyfile(fleet, "", "kv_capacity 4096\n\t\t\tqueue_timeout 10m", ""))
	client := &http.Client{Timeout: 20 * time.Second}
	do := func(body, encoding string) (int, string) {
		t.Helper()
		req, _ := http.NewRequest("POST", routerURL+"/v1/completions", strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		if encoding != "" {
			req.Header.Set("Content-Encoding", encoding)
		}
		resp, err := client.Do(req)
		if err != nil {
			t.Fatalf("no answer: %v", err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	long, _ := json.Marshal(map[string]any{"model": kvsim.DefaultModel, "prompt": text("long", 80_000), "max_tokens": 4})
	if code, body := do(string(long), ""); code != http.StatusBadRequest || !strings.Contains(body, `"code":"context_length_exceeded"`) {
		t.Fatalf("prompt over every KV cache: %d %s", code, body)
	}
	for _, enc := range []string{"gzip", "deflate", "zstd"} {
		if code, body := do(`{"model":"m","prompt":"x"}`, enc); code != http.StatusUnsupportedMediaType || !strings.Contains(body, enc) {
			t.Fatalf("Content-Encoding %s: %d %s", enc, code, body)
		}
	}
	short, _ := json.Marshal(map[string]any{"model": kvsim.DefaultModel, "prompt": text("short", 4000), "max_tokens": 4})
	if code, body := do(string(short), ""); code != 200 {
		t.Fatalf("a prompt that fits: %d %s", code, body)
	}
}

// TestParallelChoicesChargedAndLearned: a request for n choices (or a
// batch of prompts) is charged each sequence's expected output while the
// engine generates them, and the output the router learns from its usage
// (which counts every choice) is one choice's: the next request's charge
// shows it.
func TestParallelChoicesChargedAndLearned(t *testing.T) {
	// A model of its own (an adapter), which nothing has taught the
	// router yet: the per-model estimates outlive a config.
	model := fmt.Sprintf("choices-%d", time.Now().UnixNano())
	fleet := startFleet(t, 1, 4, kvsim.Config{Adapters: []string{model}})
	startCaddy(t, caddyfile(fleet, "", "", ""))
	dial := fleet[0].dial()
	inFlight := func(body string) int {
		t.Helper()
		path := "/v1/chat/completions"
		if strings.Contains(body, `"prompt"`) {
			path = "/v1/completions"
		}
		done := make(chan completion, 1)
		go func() { done <- postRaw(t, path, []byte(body)) }()
		var queued int
		eventually(t, 30*time.Second, "the request in flight", func() bool {
			u := upstream(t, dial)
			queued = u.QueuedDecodeTokens
			return u.InFlight == 1
		})
		if c := <-done; c.status != 200 {
			t.Fatalf("%d %s", c.status, c.body)
		}
		return queued
	}
	chat := func(n, maxTokens int) string {
		return fmt.Sprintf(`{"model":%q,"messages":[{"role":"user","content":"name %d things"}],"max_tokens":%d,"n":%d}`,
			model, n, maxTokens, n)
	}
	// Nothing learned yet: each of 3 choices is charged the default
	// expected output, 256 tokens (under max_tokens).
	if q := inFlight(chat(3, 300)); q != 3*256 {
		t.Errorf("3 choices charged %d decode tokens, want 3 × 256 (output_tokens' default)", q)
	}
	// They generated 300 each (usage: 900): one choice's is 300.
	if q := inFlight(chat(1, 400)); q != 300 {
		t.Errorf("after 3 choices of 300 tokens, one choice is expected to take %d, want 300", q)
	}
	// A batch of 2 prompts with n=2: 4 sequences, each charged its
	// expected output (at most its max_tokens, 300).
	batch := fmt.Sprintf(`{"model":%q,"prompt":["list some things","list other things"],"max_tokens":300,"n":2}`, model)
	if q := inFlight(batch); q != 4*300 {
		t.Errorf("2 prompts × 2 choices charged %d decode tokens, want 4 × 300", q)
	}
}
