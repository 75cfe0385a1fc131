package kvsim

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"math"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// newTestServer starts a kvsim server 50x faster than real time.
func newTestServer(t *testing.T, cfg Config) (*Server, *httptest.Server) {
	t.Helper()
	sim, err := NewServer(ServerConfig{Name: "replica-t", Engine: cfg, Speed: 50})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(sim)
	t.Cleanup(func() {
		srv.Close()
		_ = sim.Close()
	})
	return sim, srv
}

func post(t *testing.T, url, body string) (*http.Response, string) {
	t.Helper()
	resp, err := http.Post(url, "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, string(b)
}

// metricFamilies GETs url and parses the exposition.
func metricFamilies(t *testing.T, url string) map[string]*dto.MetricFamily {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	parser := expfmt.NewTextParser(model.UTF8Validation)
	families, err := parser.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return families
}

// scrape returns the value of a metric (first series) from /metrics.
func scrape(t *testing.T, url, name string) float64 {
	t.Helper()
	mf, ok := metricFamilies(t, url+"/metrics")[name]
	if !ok || len(mf.GetMetric()) == 0 {
		t.Fatalf("metric %s missing", name)
	}
	m := mf.GetMetric()[0]
	switch {
	case m.GetCounter() != nil:
		return m.GetCounter().GetValue()
	case m.GetGauge() != nil:
		return m.GetGauge().GetValue()
	}
	return m.GetHistogram().GetSampleSum()
}

// waitFor polls cond, which reads state the server exposes, until it holds; it fails the test
// if that takes more than five seconds.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(5 * time.Second); !cond(); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

func TestOpenAIClientStreams(t *testing.T) {
	_, srv := newTestServer(t, Config{})
	client := openai.NewClient(option.WithBaseURL(srv.URL+"/v1/"), option.WithAPIKey("none"))
	ctx := context.Background()

	stream := client.Completions.NewStreaming(ctx, openai.CompletionNewParams{
		Model:         DefaultModel,
		Prompt:        openai.CompletionNewParamsPromptUnion{OfString: openai.String("Once upon a time")},
		MaxTokens:     openai.Int(12),
		StreamOptions: openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)},
	})
	var text strings.Builder
	var completionTokens int64
	finish := ""
	for stream.Next() {
		c := stream.Current()
		if !strings.HasPrefix(c.ID, "cmpl-") || c.Model != DefaultModel {
			t.Fatalf("chunk id %q model %q", c.ID, c.Model)
		}
		for _, ch := range c.Choices {
			text.WriteString(ch.Text)
			if ch.FinishReason != "" {
				finish = string(ch.FinishReason)
			}
		}
		if c.Usage.CompletionTokens > 0 {
			completionTokens = c.Usage.CompletionTokens
		}
	}
	if err := stream.Err(); err != nil {
		t.Fatal(err)
	}
	want := string(NewTokenizer(4).Generate([]byte("Once upon a time"), 12)[len("Once upon a time"):])
	if text.String() != want || completionTokens != 12 || finish != "length" {
		t.Fatalf("text %q (want %q), completion tokens %d, finish %q", text.String(), want, completionTokens, finish)
	}

	chat := client.Chat.Completions.NewStreaming(ctx, openai.ChatCompletionNewParams{
		Model:     DefaultModel,
		Messages:  []openai.ChatCompletionMessageParamUnion{openai.SystemMessage("Be brief."), openai.UserMessage("Hello")},
		MaxTokens: openai.Int(7),
	})
	acc := openai.ChatCompletionAccumulator{}
	for chat.Next() {
		acc.AddChunk(chat.Current())
	}
	if err := chat.Err(); err != nil {
		t.Fatal(err)
	}
	if len(acc.Choices) != 1 || len(acc.Choices[0].Message.Content) != 7*4 || !strings.HasPrefix(acc.ID, "chatcmpl-") {
		t.Fatalf("chat accumulated %+v", acc.ChatCompletion)
	}

	// Non-streaming responses parse too and report cached tokens.
	prompt := strings.Repeat("A long shared system prompt. ", 100)
	for i := range 2 {
		c, err := client.Completions.New(ctx, openai.CompletionNewParams{
			Model: DefaultModel, Prompt: openai.CompletionNewParamsPromptUnion{OfString: openai.String(prompt + fmt.Sprint(i))},
			MaxTokens: openai.Int(3),
		})
		if err != nil {
			t.Fatal(err)
		}
		cached := c.Usage.PromptTokensDetails.CachedTokens
		if (i == 0) != (cached == 0) {
			t.Fatalf("request %d cached tokens %d", i, cached)
		}
	}
}

// TestPrefixCacheHitsOverHTTP sends two prompts that share a long prefix. The second one
// must be served from the prefix cache: its usage reports every full block of the shared
// prefix as cached, the prefix-cache counters grow by exactly its cached and queried tokens,
// and its time to first token, measured in simulated time (the engine's clock, which a
// loaded machine cannot skew), is shorter than the cold one.
func TestPrefixCacheHitsOverHTTP(t *testing.T) {
	cfg := Config{}.WithDefaults()
	_, srv := newTestServer(t, cfg)
	prompt := strings.Repeat("You are a helpful assistant with a long system prompt. ", 300)
	type result struct {
		promptTokens, cachedTokens int
		hits, queries, ttft        float64 // growth of the counters and of the TTFT sum
	}
	// ttftSum is the sum of the TTFT histogram, which has no series before the first token.
	ttftSum := func() float64 {
		mf := metricFamilies(t, srv.URL+"/metrics")["vllm:time_to_first_token_seconds"]
		if mf == nil || len(mf.GetMetric()) == 0 {
			return 0
		}
		return mf.GetMetric()[0].GetHistogram().GetSampleSum()
	}
	complete := func(suffix string) result {
		t.Helper()
		before := []float64{
			scrape(t, srv.URL, "vllm:prefix_cache_hits_total"),
			scrape(t, srv.URL, "vllm:prefix_cache_queries_total"),
			ttftSum(),
		}
		body, _ := json.Marshal(map[string]any{"prompt": prompt + suffix, "max_tokens": 1})
		resp, out := post(t, srv.URL+"/v1/completions", string(body))
		if resp.StatusCode != 200 || resp.Header.Get(ReplicaHeader) != "replica-t" {
			t.Fatalf("status %d replica %q: %s", resp.StatusCode, resp.Header.Get(ReplicaHeader), out)
		}
		var r struct {
			Usage usage `json:"usage"`
		}
		if err := json.Unmarshal([]byte(out), &r); err != nil {
			t.Fatal(err)
		}
		return result{
			promptTokens: r.Usage.PromptTokens,
			cachedTokens: r.Usage.PromptTokensDetails.CachedTokens,
			hits:         scrape(t, srv.URL, "vllm:prefix_cache_hits_total") - before[0],
			queries:      scrape(t, srv.URL, "vllm:prefix_cache_queries_total") - before[1],
			ttft:         ttftSum() - before[2],
		}
	}
	cold := complete("first question")
	warm := complete("second question")

	// The suffixes differ in their first byte, so the shared tokens are the prompt's whole
	// tokens, and the cache holds their full blocks.
	sharedBlocks := len(prompt) / cfg.BytesPerToken / cfg.BlockSize
	if cold.cachedTokens != 0 || cold.hits != 0 {
		t.Errorf("cold request: %d cached tokens, %v prefix cache hits", cold.cachedTokens, cold.hits)
	}
	if want := sharedBlocks * cfg.BlockSize; warm.cachedTokens != want {
		t.Errorf("warm request: %d cached tokens, want %d (%d shared blocks)", warm.cachedTokens, want, sharedBlocks)
	}
	for _, r := range []result{cold, warm} {
		if r.hits != float64(r.cachedTokens) || r.queries != float64(r.promptTokens) {
			t.Errorf("prefix cache counters grew by %v hits and %v queries for %d cached of %d prompt tokens",
				r.hits, r.queries, r.cachedTokens, r.promptTokens)
		}
	}
	if !(warm.ttft > 0 && warm.ttft < cold.ttft) {
		t.Errorf("simulated time to first token: warm %vs, cold %vs", warm.ttft, cold.ttft)
	}
}

func TestClientDisconnectFreesBlocks(t *testing.T) {
	sim, srv := newTestServer(t, Config{})
	ctx, cancel := context.WithCancel(context.Background())
	body := `{"prompt":"` + strings.Repeat("abcd", 2000) + `","max_tokens":100000,"stream":true}`
	req, _ := http.NewRequestWithContext(ctx, "POST", srv.URL+"/v1/completions", strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	r := bufio.NewReader(resp.Body)
	if _, err := r.ReadString('\n'); err != nil { // the first token arrived
		t.Fatal(err)
	}
	if st := sim.State(); st.Running != 1 || st.UsedBlocks == 0 {
		t.Fatalf("while streaming: %+v", st)
	}
	cancel()
	resp.Body.Close()
	waitFor(t, "the blocks to be freed after the disconnect", func() bool {
		st := sim.State()
		return st.Running == 0 && st.UsedBlocks == 0 && st.ReservedBlocks == 0 && st.InFlight == 0
	})
	if st := sim.State(); st.Aborted != 1 {
		t.Fatalf("aborted = %d", st.Aborted)
	}
}

func TestChatContinuationOverHTTP(t *testing.T) {
	_, srv := newTestServer(t, Config{})
	content := func(body string) string {
		resp, out := post(t, srv.URL+"/v1/chat/completions", body)
		if resp.StatusCode != 200 {
			t.Fatalf("status %d: %s", resp.StatusCode, out)
		}
		var r struct {
			Choices []struct{ Message struct{ Content string } }
		}
		_ = json.Unmarshal([]byte(out), &r)
		return r.Choices[0].Message.Content
	}
	msgs := `[{"role":"user","content":"Tell me about caches."}]`
	full := content(`{"messages":` + msgs + `,"max_tokens":30}`)
	partial := full[:10*4]
	partialJSON, _ := json.Marshal(partial)
	rest := content(`{"messages":[{"role":"user","content":"Tell me about caches."},{"role":"assistant","content":` +
		string(partialJSON) + `}],"continue_final_message":true,"add_generation_prompt":false,"max_tokens":20}`)
	if partial+rest != full {
		t.Fatalf("continued %q + %q != %q", partial, rest, full)
	}
}

// TestChatWithoutMaxTokensRunsToTheContext: a chat request without
// max_tokens is refused only when its prompt fills the context; its output
// is cut to what the context leaves (finish_reason "length"), as vLLM
// does. kvsim refused it when its default output did not fit.
func TestChatWithoutMaxTokensRunsToTheContext(t *testing.T) {
	_, srv := newTestServer(t, Config{NumGPUBlocks: 64, MaxModelLen: 1000, DefaultOutputTokens: 128})
	chat := func(chars int) string {
		return `{"messages":[{"role":"user","content":"` + strings.Repeat("a", chars) + `"}]}`
	}
	resp, out := post(t, srv.URL+"/v1/chat/completions", chat(3900)) // ~980 tokens with the template
	var c struct {
		Choices []struct {
			FinishReason string `json:"finish_reason"`
		}
		Usage struct {
			PromptTokens     int `json:"prompt_tokens"`
			CompletionTokens int `json:"completion_tokens"`
		} `json:"usage"`
	}
	if resp.StatusCode != 200 || json.Unmarshal([]byte(out), &c) != nil || len(c.Choices) != 1 {
		t.Fatalf("%d %s", resp.StatusCode, out)
	}
	if c.Usage.PromptTokens+c.Usage.CompletionTokens != 1000 || c.Usage.CompletionTokens >= 128 || c.Choices[0].FinishReason != "length" {
		t.Errorf("usage %+v, finish %q: want the output cut to the context's end", c.Usage, c.Choices[0].FinishReason)
	}
	if resp, out := post(t, srv.URL+"/v1/chat/completions", chat(4100)); resp.StatusCode != 400 ||
		!strings.Contains(out, "maximum context length is 1000") {
		t.Errorf("a prompt over the context: %d %s", resp.StatusCode, out)
	}
}

// TestNoRouteAnswersAsFastAPI: a path no route takes gets vLLM's 404 (a
// route's path in another form too: an empty or dot segment), and a
// route's path with another method its 405 with Allow, both as JSON
// {"detail": ...} (FastAPI's), not Go's plain text or redirect.
func TestNoRouteAnswersAsFastAPI(t *testing.T) {
	_, srv := newTestServer(t, Config{})
	for _, tc := range []struct {
		method, path, detail string
		status               int
	}{
		{"GET", "/v1/nope", "Not Found", 404},
		{"GET", "/v1/chat/completions", "Method Not Allowed", 405},
		// Starlette matches the path as sent, where Go's mux redirects
		// one not in its clean form to that.
		{"POST", "/v1//chat/completions", "Not Found", 404},
		{"GET", "/v1/./models", "Not Found", 404},
		{"GET", "//v1/models/", "Not Found", 404},
	} {
		req, _ := http.NewRequest(tc.method, srv.URL+tc.path, nil)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		var body struct{ Detail string }
		err = json.NewDecoder(resp.Body).Decode(&body)
		resp.Body.Close()
		if err != nil || resp.StatusCode != tc.status || body.Detail != tc.detail || resp.Header.Get("Content-Type") != "application/json" {
			t.Errorf("%s %s: %d %q %v, want %d %q", tc.method, tc.path, resp.StatusCode, body.Detail, err, tc.status, tc.detail)
		}
		if tc.status == 405 && !strings.Contains(resp.Header.Get("Allow"), "POST") {
			t.Errorf("405 without Allow: POST: %v", resp.Header)
		}
	}
}

// TestTrailingSlashRedirects: a route's path with a trailing slash (or a
// route's without one it lacks) is redirected as FastAPI does, 307 to the
// other path with the query kept, and a client that follows it is served.
func TestTrailingSlashRedirects(t *testing.T) {
	_, srv := newTestServer(t, Config{})
	noFollow := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	for _, tc := range []struct{ method, path, location string }{
		{"POST", "/v1/chat/completions/", "/v1/chat/completions"},
		{"GET", "/v1/models/?x=1", "/v1/models?x=1"},
		{"GET", "/v1/chat/completions/", "/v1/chat/completions"}, // another method: still redirected
	} {
		req, _ := http.NewRequest(tc.method, srv.URL+tc.path, nil)
		resp, err := noFollow.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusTemporaryRedirect || resp.Header.Get("Location") != srv.URL+tc.location {
			t.Errorf("%s %s: %d to %q, want 307 to %s", tc.method, tc.path, resp.StatusCode, resp.Header.Get("Location"), srv.URL+tc.location)
		}
	}
	body := `{"model":"` + DefaultModel + `","messages":[{"role":"user","content":"hi"}],"max_tokens":2}`
	resp, err := http.Post(srv.URL+"/v1/chat/completions/", "application/json", strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("followed: %d", resp.StatusCode)
	}
	resp, err = http.Get(srv.URL + "/v1/nope/")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusNotFound {
		t.Errorf("a path no route takes either way: %d", resp.StatusCode)
	}
}

// TestCORSAsVLLM: vLLM's CORS middleware (every origin, method and header
// allowed by default) answers a browser's preflight itself, and every
// response to a request with an Origin allows it, errors included.
func TestCORSAsVLLM(t *testing.T) {
	_, srv := newTestServer(t, Config{})
	do := func(method, path, body string, h map[string]string) (*http.Response, string) {
		t.Helper()
		req, _ := http.NewRequest(method, srv.URL+path, strings.NewReader(body))
		for k, v := range h {
			req.Header.Set(k, v)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp, string(b)
	}
	resp, body := do("OPTIONS", "/v1/chat/completions", "", map[string]string{
		"Origin": "https://app.example", "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"})
	if resp.StatusCode != 200 || body != "OK" || resp.Header.Get("Access-Control-Allow-Origin") != "*" ||
		!strings.Contains(resp.Header.Get("Access-Control-Allow-Methods"), "POST") ||
		resp.Header.Get("Access-Control-Allow-Headers") != "authorization,content-type" || resp.Header.Get("Access-Control-Max-Age") != "600" {
		t.Errorf("preflight: %d %q %v", resp.StatusCode, body, resp.Header)
	}
	for _, c := range []struct{ method, path, body string }{
		{"POST", "/v1/completions", `{"model":"` + DefaultModel + `","prompt":"hi","max_tokens":1}`},
		{"POST", "/v1/completions", `{"model":"no-such-model","prompt":"hi"}`},
		{"GET", "/v1/nope", ""},
	} {
		resp, body := do(c.method, c.path, c.body, map[string]string{"Origin": "https://app.example", "Content-Type": "application/json"})
		if resp.Header.Get("Access-Control-Allow-Origin") != "*" {
			t.Errorf("%s %s: %d without Access-Control-Allow-Origin: %v %s", c.method, c.path, resp.StatusCode, resp.Header, body)
		}
	}
	if resp, _ := do("GET", "/v1/models", "", nil); resp.Header.Get("Access-Control-Allow-Origin") != "" {
		t.Errorf("no Origin, yet CORS headers: %v", resp.Header)
	}
	// A method Starlette does not list, or one in lower case, or none.
	for _, m := range []string{"CONNECT", "post", ""} {
		resp, body := do("OPTIONS", "/v1/chat/completions", "", map[string]string{"Origin": "https://app.example", "Access-Control-Request-Method": m})
		if resp.StatusCode != 400 || body != "Disallowed CORS method" || resp.Header.Get("Access-Control-Allow-Origin") != "*" {
			t.Errorf("preflight for %q: %d %q %v", m, resp.StatusCode, body, resp.Header)
		}
	}
	// An OPTIONS that is no preflight goes to the routes, as in vLLM.
	if resp, _ := do("OPTIONS", "/v1/chat/completions", "", map[string]string{"Origin": "https://app.example"}); resp.StatusCode != 405 {
		t.Errorf("OPTIONS without Access-Control-Request-Method: %d, want the routes' 405", resp.StatusCode)
	}
}

// TestToolUseChecked: a chat's tools must be a list, and its tool_choice
// must name a tool it was given, as vLLM's request model checks: "none"
// needs no tools, "auto" and "required" need tools, a named function must
// be one of them.
func TestToolUseChecked(t *testing.T) {
	_, srv := newTestServer(t, Config{})
	tool := `{"type":"function","function":{"name":"get_weather","parameters":{"type":"object"}}}`
	for _, tc := range []struct {
		fields, want string // want: "" for 200, else part of the 400's message
	}{
		{`"tool_choice":"none"`, ""},
		{`"tool_choice":null`, ""},
		{`"tools":[` + tool + `]`, ""},
		{`"tools":[` + tool + `],"tool_choice":"required"`, ""},
		{`"tools":[` + tool + `],"tool_choice":{"type":"function","function":{"name":"get_weather"}}`, ""},
		{`"tool_choice":"auto"`, "`tools` must be set"},
		{`"tool_choice":"required","tools":null`, "`tools` must be set"},
		{`"tools":[` + tool + `],"tool_choice":"sometimes"`, "Invalid value for `tool_choice`"},
		{`"tools":[` + tool + `],"tool_choice":{"type":"function","function":{"name":"get_time"}}`, "does not match any of the specified `tools`"},
		{`"tools":[` + tool + `],"tool_choice":{"type":"function"}`, "Invalid value for `tool_choice`"},
		{`"tools":{"a":1}`, "valid list"},
	} {
		body := `{"model":"` + DefaultModel + `","messages":[{"role":"user","content":"hi"}],"max_tokens":2,` + tc.fields + `}`
		resp, out := post(t, srv.URL+"/v1/chat/completions", body)
		if tc.want == "" && resp.StatusCode != 200 || tc.want != "" && (resp.StatusCode != 400 || !strings.Contains(out, tc.want)) {
			t.Errorf("%s: %d %s, want %q", tc.fields, resp.StatusCode, out, tc.want)
		}
	}
}

func TestBadRequests(t *testing.T) {
	_, srv := newTestServer(t, Config{NumGPUBlocks: 64, MaxModelLen: 100000})
	cases := map[string]string{
		"/v1/completions":      `{not json`,
		"/v1/chat/completions": `{"messages":[]}`,
	}
	bad := []string{`{`, `[]`, `null`, `{"prompt":5}`, "{\"prompt\":\"x \xff y\"}", // not UTF-8 `{"prompt":["a","b"]}`, `{"prompt":[-1]}`, `{"prompt":"x","max_tokens":0}`,
		`{"prompt":"x","stream_options":{"include_usage":true}}`, `{"prompt":""}`, `{"prompt":"` + strings.Repeat("x", 5000) + `"}`}
	for _, b := range bad {
		resp, out := post(t, srv.URL+"/v1/completions", b)
		// vLLM's shape since 0.10.1: the OpenAI API's, fields inside "error".
		var e struct {
			Error struct {
				Message, Type string
				Code          int
			}
		}
		if resp.StatusCode != 400 || json.Unmarshal([]byte(out), &e) != nil ||
			e.Error.Code != 400 || e.Error.Type != "BadRequestError" || e.Error.Message == "" {
			t.Errorf("%.40s: status %d body %s", b, resp.StatusCode, out)
		}
	}
	for path, b := range cases {
		if resp, out := post(t, srv.URL+path, b); resp.StatusCode != 400 {
			t.Errorf("%s %s: %d %s", path, b, resp.StatusCode, out)
		}
	}
	resp, out := post(t, srv.URL+"/v1/completions", `{"model":"nope","prompt":"x"}`)
	if resp.StatusCode != 404 || !strings.Contains(out, "The model `nope` does not exist.") {
		t.Errorf("unknown model: %d %s", resp.StatusCode, out)
	}
	// The body's media type, as vLLM's validate_json_request checks it:
	// curl's -d default and a missing one are refused.
	for contentType, want := range map[string]int{
		"application/json": 200, "Application/JSON; charset=utf-8": 200, "text/plain": 400,
		"application/x-www-form-urlencoded": 400, "": 400, "application/jsonl": 400,
	} {
		req, _ := http.NewRequest("POST", srv.URL+"/v1/completions", strings.NewReader(`{"prompt":"x","max_tokens":1}`))
		if contentType != "" {
			req.Header.Set("Content-Type", contentType)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != want || want == 400 && !strings.Contains(string(b), "Only 'application/json' is allowed") {
			t.Errorf("Content-Type %q: %d %s, want %d", contentType, resp.StatusCode, b, want)
		}
	}
}

func TestLoRAAdaptersOverHTTP(t *testing.T) {
	_, srv := newTestServer(t, Config{Adapters: []string{"sql-lora"}})
	if resp, out := post(t, srv.URL+"/v1/load_lora_adapter", `{"lora_name":"chat-lora","lora_path":"/adapters/chat"}`); resp.StatusCode != 200 {
		t.Fatalf("load: %d %s", resp.StatusCode, out)
	}
	if resp, _ := post(t, srv.URL+"/v1/load_lora_adapter", `{"lora_name":"chat-lora","lora_path":"/adapters/chat"}`); resp.StatusCode != 400 {
		t.Fatalf("second load: %d", resp.StatusCode)
	}
	_, cards := getModels(t, srv.URL)
	if len(cards) != 3 || cards[0].ID != DefaultModel || cards[0].Parent != nil ||
		cards[1].ID != "chat-lora" || *cards[1].Parent != DefaultModel || cards[1].Root != "/adapters/chat" {
		t.Fatalf("models: %+v", cards)
	}
	if resp, out := post(t, srv.URL+"/v1/completions", `{"model":"sql-lora","prompt":"select","max_tokens":2}`); resp.StatusCode != 200 {
		t.Fatalf("adapter request: %d %s", resp.StatusCode, out)
	}
	if resp, _ := post(t, srv.URL+"/v1/unload_lora_adapter", `{"lora_name":"chat-lora"}`); resp.StatusCode != 200 {
		t.Fatalf("unload: %d", resp.StatusCode)
	}
	if resp, _ := post(t, srv.URL+"/v1/completions", `{"model":"chat-lora","prompt":"x"}`); resp.StatusCode != 404 {
		t.Fatalf("unloaded adapter: %d", resp.StatusCode)
	}
}

// TestLoadInplaceAsVLLM: /v1/load_lora_adapter answers as vLLM's
// OpenAIServingModels (load_lora_adapter, _check_load_lora_adapter_request):
// loading an adapter already loaded is a 400 InvalidUserInput that points at
// load_inplace; with load_inplace (pydantic's lax booleans too) the new path
// replaces the old and the answer is the usual success; load_inplace for an
// adapter not loaded is a first load. The other refusals have vLLM's bodies.
func TestLoadInplaceAsVLLM(t *testing.T) {
	_, srv := newTestServer(t, Config{})
	load := srv.URL + "/v1/load_lora_adapter"
	expect := func(what string, status int, body string, wantStatus int, want string) {
		t.Helper()
		if status != wantStatus || strings.TrimSpace(body) != want {
			t.Errorf("%s: %d %s\nwant %d %s", what, status, body, wantStatus, want)
		}
	}
	roots := func() map[string]string {
		t.Helper()
		_, cards := getModels(t, srv.URL)
		out := map[string]string{}
		for _, m := range cards {
			out[m.ID] = m.Root
		}
		return out
	}
	added := "Success: LoRA adapter 'chat-lora' added successfully."
	resp, out := post(t, load, `{"lora_name":"chat-lora","lora_path":"/adapters/v1"}`)
	expect("first load", resp.StatusCode, out, 200, added)
	resp, out = post(t, load, `{"lora_name":"chat-lora","lora_path":"/adapters/v2"}`)
	expect("second load without load_inplace", resp.StatusCode, out, 400,
		`{"error":{"message":"The lora adapter 'chat-lora' has already been loaded. If you want to load the adapter in place, set 'load_inplace' to True.","type":"InvalidUserInput","param":null,"code":400}}`)
	if got := roots()["chat-lora"]; got != "/adapters/v1" {
		t.Errorf("a refused load changed the adapter's path to %q", got)
	}
	resp, out = post(t, load, `{"lora_name":"chat-lora","lora_path":"/adapters/v2","load_inplace":true}`)
	expect("load_inplace", resp.StatusCode, out, 200, added)
	if got := roots()["chat-lora"]; got != "/adapters/v2" {
		t.Errorf("after load_inplace the adapter's root is %q, want /adapters/v2", got)
	}
	resp, out = post(t, load, `{"lora_name":"chat-lora","lora_path":"/adapters/v3","load_inplace":"yes"}`)
	expect(`load_inplace "yes"`, resp.StatusCode, out, 200, added)
	if got := roots()["chat-lora"]; got != "/adapters/v3" {
		t.Errorf(`after load_inplace "yes" the adapter's root is %q, want /adapters/v3`, got)
	}
	resp, out = post(t, load, `{"lora_name":"new-lora","lora_path":"/adapters/new","load_inplace":true}`)
	expect("load_inplace of an adapter not loaded", resp.StatusCode, out, 200, "Success: LoRA adapter 'new-lora' added successfully.")
	if got, ok := roots()["new-lora"]; !ok || got != "/adapters/new" {
		t.Errorf("load_inplace of a new adapter: listed %v, root %q", ok, got)
	}
	resp, out = post(t, load, `{"lora_name":"chat-lora","lora_path":"/adapters/v4","load_inplace":null}`)
	if resp.StatusCode != 400 || !strings.Contains(out, "valid boolean") {
		t.Errorf("load_inplace null: %d %s, want 400 as pydantic refuses null for a bool", resp.StatusCode, out)
	}
	if got := roots()["chat-lora"]; got != "/adapters/v3" {
		t.Errorf("a refused load_inplace null changed the adapter's root to %q", got)
	}
	resp, out = post(t, load, `{"lora_name":"x","lora_path":""}`)
	expect("empty path", resp.StatusCode, out, 400,
		`{"error":{"message":"Both 'lora_name' and 'lora_path' must be provided.","type":"InvalidUserInput","param":null,"code":400}}`)
	resp, out = post(t, srv.URL+"/v1/unload_lora_adapter", `{"lora_name":""}`)
	expect("unload without a name", resp.StatusCode, out, 400,
		`{"error":{"message":"'lora_name' needs to be provided to unload a LoRA adapter.","type":"InvalidUserInput","param":null,"code":400}}`)
	resp, out = post(t, srv.URL+"/v1/unload_lora_adapter", `{"lora_name":"nope"}`)
	expect("unload of an adapter not loaded", resp.StatusCode, out, 404,
		`{"error":{"message":"The lora adapter 'nope' cannot be found.","type":"NotFoundError","param":null,"code":404}}`)
}

// TestServedModelNames: as vLLM with --served-model-name, the base model
// answers to each of its names and to none, all sharing its prefix cache
// and answering under the first name; /v1/models lists one card per name,
// each with the model's path as root, and an adapter's parent is the
// first name. A name not served is an adapter's, unknown: 404.
func TestServedModelNames(t *testing.T) {
	cfg := Config{Model: "/models/llama", ServedModelName: []string{"llama", "llama-3.1-8b"}, Adapters: []string{"sql-lora"}}.WithDefaults()
	_, srv := newTestServer(t, cfg)
	_, cards := getModels(t, srv.URL)
	if len(cards) != 3 {
		t.Fatalf("models: %+v", cards)
	}
	for i, name := range []string{"llama", "llama-3.1-8b"} {
		if m := cards[i]; m.ID != name || m.Root != "/models/llama" || m.Parent != nil || m.MaxModelLen == nil || *m.MaxModelLen != cfg.MaxModelLen {
			t.Errorf("card %d: %+v, want %s with root /models/llama", i, m, name)
		}
	}
	if m := cards[2]; m.ID != "sql-lora" || m.Parent == nil || *m.Parent != "llama" {
		t.Errorf("adapter card: %+v, want parent llama", m)
	}

	prompt := strings.Repeat("One system prompt under several names. ", 200)
	complete := func(model any) (string, int) {
		t.Helper()
		fields := map[string]any{"prompt": prompt + fmt.Sprint(model), "max_tokens": 1}
		if model != nil {
			fields["model"] = model
		}
		body, _ := json.Marshal(fields)
		resp, out := post(t, srv.URL+"/v1/completions", string(body))
		if resp.StatusCode != 200 {
			t.Fatalf("model %v: %d %s", model, resp.StatusCode, out)
		}
		var r struct {
			Model string `json:"model"`
			Usage usage  `json:"usage"`
		}
		if err := json.Unmarshal([]byte(out), &r); err != nil {
			t.Fatal(err)
		}
		return r.Model, r.Usage.PromptTokensDetails.CachedTokens
	}
	shared := len(prompt) / cfg.BytesPerToken / cfg.BlockSize * cfg.BlockSize
	for i, model := range []any{"llama-3.1-8b", "llama", nil, ""} {
		answered, cached := complete(model)
		if answered != "llama" {
			t.Errorf("model %v: answered as %q, want the first name", model, answered)
		}
		if want := min(i, 1) * shared; cached < want || i == 0 && cached != 0 {
			t.Errorf("model %v: %d cached tokens, want %d", model, cached, want)
		}
	}
	if _, cached := complete("sql-lora"); cached != 0 {
		t.Errorf("the adapter shares the base model's cache: %d cached tokens", cached)
	}
	if resp, out := post(t, srv.URL+"/v1/completions", `{"model":"/models/llama","prompt":"x","max_tokens":1}`); resp.StatusCode != 404 {
		t.Errorf("the model's path, not served: %d %s", resp.StatusCode, out)
	}
	if resp, _ := post(t, srv.URL+"/v1/load_lora_adapter", `{"lora_name":"llama-3.1-8b","lora_path":"/adapters/x"}`); resp.StatusCode != 400 {
		t.Errorf("an adapter under a served name: %d, want 400", resp.StatusCode)
	}
	if err := (Config{ServedModelName: []string{"a", ""}}).WithDefaults().Validate(); err == nil {
		t.Error("an empty served name validated")
	}
	if err := (Config{ServedModelName: []string{"a"}, Adapters: []string{"a"}}).WithDefaults().Validate(); err == nil {
		t.Error("an adapter named as the base model validated")
	}
}

func TestFaults(t *testing.T) {
	sim, srv := newTestServer(t, Config{})
	setFaults := func(body string) {
		if resp, out := post(t, srv.URL+"/kvsim/faults", body); resp.StatusCode != 200 {
			t.Fatalf("faults %s: %d %s", body, resp.StatusCode, out)
		}
	}
	// A misspelt fault is refused, and changes nothing.
	if resp, out := post(t, srv.URL+"/kvsim/faults", `{"unhealthy":true,"eror_rate":1}`); resp.StatusCode != 400 || !strings.Contains(string(out), "eror_rate") {
		t.Fatalf("an unknown fault: %d %s", resp.StatusCode, out)
	}
	if f := sim.Faults(); f.Unhealthy {
		t.Fatalf("a refused fault was applied: %+v", f)
	}
	setFaults(`{"unhealthy":true}`)
	if resp, _ := http.Get(srv.URL + "/health"); resp.StatusCode != 503 {
		t.Fatalf("health %d", resp.StatusCode)
	}
	setFaults(`{"unhealthy":false,"error_rate":1}`)
	if resp, _ := http.Get(srv.URL + "/health"); resp.StatusCode != 200 || resp.Header.Get(ReplicaHeader) != "replica-t" {
		t.Fatalf("health %d", resp.StatusCode)
	}
	if resp, _ := post(t, srv.URL+"/v1/completions", `{"prompt":"x"}`); resp.StatusCode != 500 {
		t.Fatalf("error fault: %d", resp.StatusCode)
	}
	setFaults(`{"error_rate":0,"cut_after_tokens":3}`)
	resp, err := http.Post(srv.URL+"/v1/completions", "application/json", strings.NewReader(`{"prompt":"x","max_tokens":10,"stream":true}`))
	if err != nil {
		t.Fatal(err)
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err == nil || strings.Count(string(body), "data: ") != 3 || strings.Contains(string(body), "[DONE]") {
		t.Fatalf("cut stream: err %v body %q", err, body)
	}

	waitFor(t, "the cut request to end", func() bool { return sim.State().InFlight == 0 })
	setFaults(`{"cut_after_tokens":0,"stall":true}`)
	// A failed check below must not leave the request stalled, or closing the server hangs.
	t.Cleanup(func() { sim.SetFaults(Faults{}) })
	done := make(chan string, 1)
	go func() {
		_, out := post(t, srv.URL+"/v1/completions", `{"prompt":"x","max_tokens":2}`)
		done <- out
	}()
	// Once the engine holds the request, a stalled replica's simulated clock stands still, so
	// it generates nothing however long the test waits. The wait only gives a broken stall
	// time to show: a slow machine lengthens it and cannot make the test fail.
	waitFor(t, "the stalled replica to accept the request", func() bool { return sim.State().InFlight == 1 || len(done) > 0 })
	stalled := sim.State()
	time.Sleep(20 * time.Millisecond) // a simulated second at speed 50, were the clock running
	select {
	case <-done:
		t.Fatal("stalled replica answered")
	default:
	}
	if st := sim.State(); st.SimulatedSeconds != stalled.SimulatedSeconds || st.GenerationTokens != stalled.GenerationTokens ||
		st.InFlight != 1 || !st.Faults.Stall {
		t.Fatalf("state moved while stalled: %+v, then %+v", stalled, st)
	}
	setFaults(`{"stall":false}`)
	select {
	case out := <-done:
		if !strings.Contains(out, `"completion_tokens":2`) {
			t.Fatalf("after unstall: %s", out)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("request did not finish after unstall")
	}
}

func FuzzParseRequest(f *testing.F) {
	seeds := []string{
		`{"prompt":"hello","max_tokens":5}`,
		`{"prompt":[1,2,3],"stream":true,"stream_options":{"include_usage":true}}`,
		`{"prompt":[[1,2]]}`,
		`{"prompt":["a"],"kvsim_output_tokens":3}`,
		`{"messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function"}]}`,
		`{"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url"}]},{"role":"assistant","content":"b"}],"continue_final_message":true,"add_generation_prompt":false}`,
		`{"messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"x"}]}]}`,
		`{`, `null`, `[]`, `{"prompt":{}}`, `{"messages":[{"role":""}]}`,
	}
	for _, s := range seeds {
		f.Add([]byte(s))
	}
	tok := NewTokenizer(4)
	f.Fuzz(func(t *testing.T, body []byte) {
		for _, ep := range []Endpoint{EndpointCompletions, EndpointChatCompletions} {
			p, err := ParseRequest(ep, body, tok, 16)
			if err != nil {
				ae, ok := err.(*APIError)
				if !ok || ae.Code != 400 {
					t.Fatalf("error %v is not a 400 APIError", err)
				}
				continue
			}
			if len(p.Context) == 0 || p.OutputTokens < 1 {
				t.Fatalf("accepted empty context or no output: %+v", p)
			}
		}
	})
}

func TestConcurrentRequestsAndCancels(t *testing.T) {
	sim, srv := newTestServer(t, Config{NumGPUBlocks: 2048, MaxNumSeqs: 8})
	var wg sync.WaitGroup
	for i := range 32 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			if i%4 == 0 {
				cancel() // some clients give up at once
			} else if i%4 == 1 {
				ctx, cancel = context.WithTimeout(context.Background(), 30*time.Millisecond)
			}
			defer cancel()
			body := fmt.Sprintf(`{"prompt":"%s %d","max_tokens":%d,"stream":%v}`, strings.Repeat("shared ", 200), i, 20+i, i%2 == 0)
			req, _ := http.NewRequestWithContext(ctx, "POST", srv.URL+"/v1/completions", strings.NewReader(body))
			req.Header.Set("Content-Type", "application/json")
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				return
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}()
	}
	wg.Wait()
	waitFor(t, "the engine to be idle after all clients left", func() bool {
		st := sim.State()
		return st.InFlight == 0 && st.Running == 0 && st.Waiting == 0 && st.UsedBlocks == 0 && st.ReservedBlocks == 0
	})
	if st := sim.State(); st.Finished+st.Aborted == 0 || st.PrefixHits == 0 {
		t.Fatalf("state %+v", st)
	}
}

// TestMetricsNameFilter checks that /metrics/ answers name[] queries, as
// vLLM's does, with only the families named, and that /metrics ignores
// them, as vLLM's does too.
func TestMetricsNameFilter(t *testing.T) {
	_, srv := newTestServer(t, Config{})
	families := func(pathAndQuery string) []string {
		t.Helper()
		return slices.Sorted(maps.Keys(metricFamilies(t, srv.URL+pathAndQuery)))
	}
	all := families("/metrics")
	if len(all) < 20 || !slices.Contains(all, "go_goroutines") || !slices.Contains(all, "vllm:num_requests_running") {
		t.Fatalf("exposition has %d families: %v", len(all), all)
	}
	const query = "?name[]=vllm:num_requests_running&name%5B%5D=vllm%3Aprefix_cache_hits_total&name[]=no_such_metric"
	if got := families("/metrics" + query); !slices.Equal(got, all) {
		t.Fatalf("/metrics with a name[] query: %v", got)
	}
	if got, want := families("/metrics/"+query), []string{"vllm:num_requests_running", "vllm:prefix_cache_hits_total"}; !slices.Equal(got, want) {
		t.Fatalf("filtered families %v, want %v", got, want)
	}
	if got := families("/metrics/?name[]=no_such_metric"); len(got) != 0 {
		t.Fatalf("families %v for an unknown name", got)
	}
}

// TestStreamFinishInLaterBatch: when the last token and the Finished
// event reach the responder in different batches, the finish reason
// still goes out, in a chunk of its own (as vLLM sends one), before the
// usage chunk and [DONE].
func TestStreamFinishInLaterBatch(t *testing.T) {
	sim, err := NewServer(ServerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	defer sim.Close()
	for _, endpoint := range []Endpoint{EndpointCompletions, EndpointChatCompletions} {
		stream := &Stream{notify: make(chan struct{}, 1)}
		rec := httptest.NewRecorder()
		rs := &responder{s: sim, w: rec, r: httptest.NewRequest("POST", "/v1/completions", nil),
			p: &ParsedRequest{Endpoint: endpoint, Stream: true, IncludeUsage: true}, req: &Request{ID: "r1"},
			model: DefaultModel, stream: stream, created: 1}
		done := make(chan struct{})
		go func() { rs.streamSSE(); close(done) }()
		stream.push(Event{Kind: EventFirstToken, Text: []byte(" a"), PromptTokens: 3, GeneratedTokens: 1})
		stream.push(Event{Kind: EventToken, Text: []byte(" b"), PromptTokens: 3, GeneratedTokens: 2})
		// Finished only once the responder took the tokens.
		waitFor(t, "the responder to take the tokens", func() bool {
			stream.mu.Lock()
			defer stream.mu.Unlock()
			return len(stream.events) == 0
		})
		stream.push(Event{Kind: EventFinished, PromptTokens: 3, GeneratedTokens: 2, FinishReason: "length"})
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			t.Fatal("stream never ended")
		}
		var finishes []string
		var sawUsage, sawDone bool
		for _, line := range strings.Split(rec.Body.String(), "\n") {
			data, ok := strings.CutPrefix(line, "data: ")
			if !ok {
				continue
			}
			if data == "[DONE]" {
				sawDone = true
				continue
			}
			var chunk struct {
				Choices []struct {
					FinishReason *string `json:"finish_reason"`
				} `json:"choices"`
				Usage *struct {
					CompletionTokens int `json:"completion_tokens"`
				} `json:"usage"`
			}
			if err := json.Unmarshal([]byte(data), &chunk); err != nil {
				t.Fatalf("%v: bad chunk %q: %v", endpoint, data, err)
			}
			if sawUsage {
				t.Fatalf("%v: chunk after the usage chunk: %q", endpoint, data)
			}
			for _, c := range chunk.Choices {
				if c.FinishReason != nil {
					finishes = append(finishes, *c.FinishReason)
				}
			}
			if chunk.Usage != nil {
				sawUsage = chunk.Usage.CompletionTokens == 2
			}
		}
		if !slices.Equal(finishes, []string{"length"}) || !sawUsage || !sawDone {
			t.Fatalf("%v: finish reasons %q, usage %v, [DONE] %v in:\n%s", endpoint, finishes, sawUsage, sawDone, rec.Body.String())
		}
	}
}

// TestLatencyHistograms: one request of 4 tokens is counted once by vLLM's
// TTFT, e2e and queue-time histograms and three times (the gaps after the
// first token) by the inter-token one, whose sum, in simulated time, is
// the time from the first token to the last.
func TestLatencyHistograms(t *testing.T) {
	cfg := Config{}.WithDefaults()
	_, srv := newTestServer(t, cfg)
	body, _ := json.Marshal(map[string]any{"prompt": strings.Repeat("hello ", 200), "max_tokens": 4})
	if resp, out := post(t, srv.URL+"/v1/completions", string(body)); resp.StatusCode != 200 {
		t.Fatalf("status %d: %s", resp.StatusCode, out)
	}
	mfs := metricFamilies(t, srv.URL+"/metrics")
	hist := func(name string) (count uint64, sum float64) {
		mf := mfs[name]
		if mf == nil || len(mf.GetMetric()) != 1 {
			t.Fatalf("%s: want one series, got %v", name, mf)
		}
		m := mf.GetMetric()[0]
		labels := map[string]string{}
		for _, l := range m.GetLabel() {
			labels[l.GetName()] = l.GetValue()
		}
		if labels["model_name"] != cfg.Model || labels["engine"] != "0" {
			t.Fatalf("%s labels %v", name, labels)
		}
		return m.GetHistogram().GetSampleCount(), m.GetHistogram().GetSampleSum()
	}
	ttftN, ttft := hist("vllm:time_to_first_token_seconds")
	e2eN, e2e := hist("vllm:e2e_request_latency_seconds")
	queueN, queue := hist("vllm:request_queue_time_seconds")
	itlN, itl := hist("vllm:inter_token_latency_seconds")
	if ttftN != 1 || e2eN != 1 || queueN != 1 || itlN != 3 {
		t.Fatalf("counts: ttft %d e2e %d queue %d itl %d", ttftN, e2eN, queueN, itlN)
	}
	if queue < 0 || queue > ttft || math.Abs(itl-(e2e-ttft)) > 1e-9 {
		t.Fatalf("queue %v ttft %v e2e %v itl sum %v", queue, ttft, e2e, itl)
	}
}

// TestVLLMRequestDefaults: the defaults vLLM's server gives where a request
// leaves things out: 16 tokens for a completions request without
// max_tokens; max_completion_tokens over max_tokens; include_usage true
// in stream_options; an empty stream_options without stream is no error;
// a model no one serves is 404 with param "model", as current vLLM answers
// (OpenAIServing._check_model in vllm/entrypoints/openai/engine/serving.py
// passes param="model" to create_error_response; the older
// vllm/entrypoints/openai/serving_engine.py passed none, so null).
func TestVLLMRequestDefaults(t *testing.T) {
	_, srv := newTestServer(t, Config{DefaultOutputTokens: 100})
	usage := func(out string) (completion int, finish string) {
		var r struct {
			Choices []struct {
				FinishReason string `json:"finish_reason"`
			}
			Usage struct {
				CompletionTokens int `json:"completion_tokens"`
			}
		}
		if err := json.Unmarshal([]byte(out), &r); err != nil || len(r.Choices) != 1 {
			t.Fatalf("%v: %s", err, out)
		}
		return r.Usage.CompletionTokens, r.Choices[0].FinishReason
	}
	if n, finish := usage(mustPost(t, srv.URL+"/v1/completions", `{"prompt":"hello"}`)); n != 16 || finish != "length" {
		t.Errorf("completions without max_tokens: %d tokens, %q; want 16, length", n, finish)
	}
	if n, _ := usage(mustPost(t, srv.URL+"/v1/chat/completions", `{"messages":[{"role":"user","content":"hi"}],"max_tokens":5,"max_completion_tokens":2}`)); n != 2 {
		t.Errorf("chat with max_tokens 5 and max_completion_tokens 2: %d tokens", n)
	}
	if n, _ := usage(mustPost(t, srv.URL+"/v1/chat/completions", `{"messages":[{"role":"user","content":"hi"}]}`)); n != 100 {
		t.Errorf("chat without max_tokens: %d tokens, want the model's own length", n)
	}
	mustPost(t, srv.URL+"/v1/completions", `{"prompt":"hello","max_tokens":2,"stream_options":{}}`)
	stream := mustPost(t, srv.URL+"/v1/completions", `{"prompt":"hello","max_tokens":2,"stream":true,"stream_options":{}}`)
	if !strings.Contains(stream, `"usage":{"prompt_tokens"`) {
		t.Errorf("stream_options {} without include_usage sent no usage chunk:\n%s", stream)
	}
	resp, out := post(t, srv.URL+"/v1/completions", `{"model":"nobody","prompt":"hello"}`)
	want := "{\"error\":{\"message\":\"The model `nobody` does not exist.\",\"type\":\"NotFoundError\",\"param\":\"model\",\"code\":404}}"
	if resp.StatusCode != 404 || strings.TrimSpace(out) != want {
		t.Errorf("unknown model: %d %s\nwant 404 %s", resp.StatusCode, out, want)
	}
}

func mustPost(t *testing.T, url, body string) string {
	t.Helper()
	resp, out := post(t, url, body)
	if resp.StatusCode != 200 {
		t.Fatalf("%s %s: %d %s", url, body, resp.StatusCode, out)
	}
	return out
}

// TestLaxFieldsAsVLLM: vLLM's request models are pydantic's, in lax mode:
// max_tokens 16.0, 1e3 or "16" is an integer, stream "true" or 1 a
// boolean, and a body may start with a UTF-8 byte order mark (Python's
// json.loads skips it). A fraction or a word is still a 400.
func TestLaxFieldsAsVLLM(t *testing.T) {
	tok := NewTokenizer(4)
	for body, want := range map[string]ParsedRequest{
		`{"prompt":"hi","max_tokens":16.0}`:                       {MaxTokens: 16},
		`{"prompt":"hi","max_tokens":1e3}`:                        {MaxTokens: 1000},
		`{"prompt":"hi","max_tokens":"16","stream":"true"}`:       {MaxTokens: 16, Stream: true},
		`{"prompt":"hi","max_tokens":2,"stream":1}`:               {MaxTokens: 2, Stream: true},
		"\xef\xbb\xbf" + `{"prompt":"hi","max_tokens":3}`:         {MaxTokens: 3},
		`{"input":"hi","max_output_tokens":"5","stream":"false"}`: {MaxTokens: 5},
	} {
		ep := EndpointCompletions
		if strings.Contains(body, "input") {
			ep = EndpointResponses
		}
		p, err := ParseRequest(ep, []byte(body), tok, 16)
		if err != nil || p.MaxTokens != want.MaxTokens || p.Stream != want.Stream {
			t.Errorf("%q: %+v, %v; want max_tokens %d, stream %v", body, p, err, want.MaxTokens, want.Stream)
		}
	}
	for _, body := range []string{`{"prompt":"hi","max_tokens":16.5}`, `{"prompt":"hi","max_tokens":"many"}`, `{"prompt":"hi","stream":"maybe"}`} {
		if _, err := ParseRequest(EndpointCompletions, []byte(body), tok, 16); err == nil {
			t.Errorf("%s accepted", body)
		}
	}
}

// TestParallelChoices: n > 1 generates a sequence of the prompt for each
// choice, as vLLM's parallel sampling: the answer has n choices, indexed,
// streamed or not, and its usage counts the prompt once and every
// choice's output; n below 1 is refused as vLLM refuses it.
func TestParallelChoices(t *testing.T) {
	_, srv := newTestServer(t, Config{})
	for _, c := range []struct{ path, body string }{
		{"/v1/chat/completions", `{"model":"` + DefaultModel + `","messages":[{"role":"user","content":"pick a name"}],"max_tokens":5,"n":3}`},
		{"/v1/completions", `{"model":"` + DefaultModel + `","prompt":"pick a name","max_tokens":5,"n":3}`},
	} {
		resp, body := post(t, srv.URL+c.path, c.body)
		var out struct {
			Choices []struct {
				Index   int
				Text    string
				Message struct{ Content string }
			}
			Usage struct {
				PromptTokens     int `json:"prompt_tokens"`
				CompletionTokens int `json:"completion_tokens"`
				TotalTokens      int `json:"total_tokens"`
			}
		}
		if resp.StatusCode != 200 || json.Unmarshal([]byte(body), &out) != nil || len(out.Choices) != 3 {
			t.Fatalf("%s n=3: %d %s", c.path, resp.StatusCode, body)
		}
		for i, ch := range out.Choices {
			if ch.Index != i || ch.Text+ch.Message.Content == "" {
				t.Errorf("%s choice %d: %+v", c.path, i, ch)
			}
		}
		u := out.Usage
		if u.CompletionTokens != 3*5 || u.PromptTokens == 0 || u.TotalTokens != u.PromptTokens+u.CompletionTokens {
			t.Errorf("%s usage %+v: want the prompt once and 3 × 5 output tokens", c.path, u)
		}
	}
	if resp, out := post(t, srv.URL+"/v1/completions", `{"model":"`+DefaultModel+`","prompt":"x","n":0}`); resp.StatusCode != 400 ||
		!strings.Contains(out, "n must be at least 1, got 0.") {
		t.Errorf("n=0: %d %s", resp.StatusCode, out)
	}
	// Streamed: each choice's chunks under its index, interleaved as they
	// come, then one usage for all and one [DONE].
	for _, path := range []string{"/v1/chat/completions", "/v1/completions"} {
		body := `{"model":"` + DefaultModel + `","prompt":"pick a name","messages":[{"role":"user","content":"pick a name"}],` +
			`"max_tokens":6,"n":3,"stream":true,"stream_options":{"include_usage":true}}`
		if path == "/v1/completions" {
			body = strings.Replace(body, `"messages":[{"role":"user","content":"pick a name"}],`, "", 1)
		} else {
			body = strings.Replace(body, `"prompt":"pick a name",`, "", 1)
		}
		resp, out := post(t, srv.URL+path, body)
		tokens, finished := map[int]int{}, map[int]int{}
		var usage struct {
			CompletionTokens int `json:"completion_tokens"`
		}
		dones := strings.Count(out, "data: [DONE]")
		for _, line := range strings.Split(out, "\n") {
			data, ok := strings.CutPrefix(line, "data: ")
			if !ok || data == "[DONE]" {
				continue
			}
			var c struct {
				Choices []struct {
					Index        int
					Text         string
					Delta        struct{ Content string }
					FinishReason *string `json:"finish_reason"`
				}
				Usage *struct {
					CompletionTokens int `json:"completion_tokens"`
				}
			}
			if err := json.Unmarshal([]byte(data), &c); err != nil {
				t.Fatalf("%s: %v in %q", path, err, data)
			}
			for _, ch := range c.Choices {
				if ch.Text+ch.Delta.Content != "" {
					tokens[ch.Index]++
				}
				if ch.FinishReason != nil {
					finished[ch.Index]++
				}
			}
			if c.Usage != nil {
				usage.CompletionTokens = c.Usage.CompletionTokens
			}
		}
		if resp.StatusCode != 200 || dones != 1 || len(tokens) != 3 || len(finished) != 3 || usage.CompletionTokens != 3*6 {
			t.Errorf("%s streamed n=3: %d, [DONE] %d times, tokens by choice %v, finished %v, usage %d",
				path, resp.StatusCode, dones, tokens, finished, usage.CompletionTokens)
		}
	}
}

// TestBatchPrompts: a completions batch runs one sequence a prompt (times
// n), as vLLM does: choice i*n+j is prompt i's j-th, and the usage counts
// each prompt once and every choice's output.
func TestBatchPrompts(t *testing.T) {
	_, srv := newTestServer(t, Config{})
	resp, body := post(t, srv.URL+"/v1/completions",
		`{"model":"`+DefaultModel+`","prompt":["one short prompt","another, somewhat longer prompt"],"max_tokens":4,"n":2}`)
	var out struct {
		Choices []struct {
			Index int
			Text  string
		}
		Usage struct {
			PromptTokens     int `json:"prompt_tokens"`
			CompletionTokens int `json:"completion_tokens"`
		}
	}
	if resp.StatusCode != 200 || json.Unmarshal([]byte(body), &out) != nil || len(out.Choices) != 4 {
		t.Fatalf("2 prompts × n=2: %d %s", resp.StatusCode, body)
	}
	_, one := post(t, srv.URL+"/v1/completions", `{"model":"`+DefaultModel+`","prompt":"one short prompt","max_tokens":4}`)
	_, other := post(t, srv.URL+"/v1/completions", `{"model":"`+DefaultModel+`","prompt":"another, somewhat longer prompt","max_tokens":4}`)
	promptTokens := func(body string) int {
		var r struct {
			Usage struct {
				PromptTokens int `json:"prompt_tokens"`
			}
		}
		_ = json.Unmarshal([]byte(body), &r)
		return r.Usage.PromptTokens
	}
	if want := promptTokens(one) + promptTokens(other); out.Usage.PromptTokens != want || out.Usage.CompletionTokens != 4*4 {
		t.Errorf("usage %+v: want each prompt once (%d tokens) and 4 × 4 output tokens", out.Usage, want)
	}
	for i, ch := range out.Choices {
		if ch.Index != i || ch.Text == "" {
			t.Errorf("choice %d: %+v", i, ch)
		}
	}
	for bodyText, want := range map[string]string{
		`["a",[1,2]]`: "must be of the batch's first prompt's kind",
		`["a",""]`:    "must not be empty",
	} {
		if resp, out := post(t, srv.URL+"/v1/completions", `{"model":"`+DefaultModel+`","prompt":`+bodyText+`}`); resp.StatusCode != 400 || !strings.Contains(out, want) {
			t.Errorf("%s: %d %s", bodyText, resp.StatusCode, out)
		}
	}
}

// TestCacheSaltKeepsPrefixesApart: as vLLM's, kvsim's prefix cache serves
// a salted prompt only to requests with the same cache_salt; an empty one
// is refused.
func TestCacheSaltKeepsPrefixesApart(t *testing.T) {
	_, srv := newTestServer(t, Config{})
	prompt := strings.Repeat("a long shared system prompt ", 200)
	cached := func(salt string) int {
		t.Helper()
		body := `{"model":"` + DefaultModel + `","prompt":"` + prompt + `","max_tokens":1` + salt + `}`
		resp, out := post(t, srv.URL+"/v1/completions", body)
		var r struct {
			Usage struct {
				PromptTokensDetails struct {
					CachedTokens int `json:"cached_tokens"`
				} `json:"prompt_tokens_details"`
			}
		}
		if resp.StatusCode != 200 || json.Unmarshal([]byte(out), &r) != nil {
			t.Fatalf("%s: %d %s", salt, resp.StatusCode, out)
		}
		return r.Usage.PromptTokensDetails.CachedTokens
	}
	if cached(`,"cache_salt":"a"`) != 0 || cached(`,"cache_salt":"a"`) == 0 {
		t.Fatal("the same salt's prompt sent again found nothing cached")
	}
	if n := cached(`,"cache_salt":"b"`); n != 0 {
		t.Fatalf("another salt's prompt found %d tokens cached", n)
	}
	if n := cached(""); n != 0 {
		t.Fatalf("the unsalted prompt found %d tokens of the salted ones cached", n)
	}
	if resp, out := post(t, srv.URL+"/v1/completions", `{"model":"`+DefaultModel+`","prompt":"x","cache_salt":""}`); resp.StatusCode != 400 || !strings.Contains(out, "cache_salt") {
		t.Fatalf("an empty salt: %d %s", resp.StatusCode, out)
	}
}

// TestTokenIDsAsVLLMReadsThem: a prompt of token ids takes integral
// numbers written as floats (pydantic's lax mode) and refuses an id
// outside the model's vocabulary with 400, as vLLM does: above both its
// pseudo-tokenizer's ids (4 bytes a token: 256 + … + 256⁴ of them) and
// Llama 3.1's 128,256, the larger with 1 byte a token.
func TestTokenIDsAsVLLMReadsThem(t *testing.T) {
	for _, tc := range []struct {
		bytesPerToken int
		prompts       map[string]int
	}{
		{4, map[string]int{
			`[1, 2.0, 128255]`:       http.StatusOK,
			`[[1.0], [7]]`:           http.StatusOK,
			`[128256, 4294967296]`:   http.StatusOK,
			`[4311810303]`:           http.StatusOK,
			`[4311810304]`:           http.StatusBadRequest,
			`[9223372036854775807]`:  http.StatusBadRequest,
			`[99999999999999999999]`: http.StatusBadRequest,
			`[1e20]`:                 http.StatusBadRequest,
			`[-1]`:                   http.StatusBadRequest,
			`[1.5]`:                  http.StatusBadRequest,
		}},
		{1, map[string]int{`[128255]`: http.StatusOK, `[128256]`: http.StatusBadRequest}},
	} {
		_, srv := newTestServer(t, Config{BytesPerToken: tc.bytesPerToken})
		for prompt, want := range tc.prompts {
			resp, out := post(t, srv.URL+"/v1/completions", `{"model":"`+DefaultModel+`","max_tokens":1,"prompt":`+prompt+`}`)
			if resp.StatusCode != want || want == 400 && prompt != `[1.5]` && !strings.Contains(out, "is out of vocabulary") {
				t.Errorf("%d bytes a token, prompt %s: status %d, want %d: %s", tc.bytesPerToken, prompt, resp.StatusCode, want, out)
			}
		}
	}
}

// TestCutAnswerNotStreamedSendsNothing: cut_after_tokens closes the
// connection of an answer not streamed with nothing written, as a vLLM
// that crashed mid-generation would (its answer comes whole at the end);
// a 200 with a truncated body, as before, was another failure than the
// one the fault stands for.
func TestCutAnswerNotStreamedSendsNothing(t *testing.T) {
	sim, srv := newTestServer(t, Config{})
	sim.SetFaults(Faults{CutAfterTokens: 3})
	resp, err := http.Post(srv.URL+"/v1/completions", "application/json",
		strings.NewReader(`{"model":"`+DefaultModel+`","prompt":"x y","max_tokens":40}`))
	if err == nil {
		resp.Body.Close()
		t.Fatalf("got %d, want the connection closed with nothing written", resp.StatusCode)
	}
}

// TestContinuousUsageStats: with stream_options.continuous_usage_stats
// (and include_usage, on by default there), vLLM puts a usage object in
// every chunk of a stream: its prompt tokens and the choice's tokens so
// far, 0 on a chat's role chunk; the last chunk is the whole usage, as
// without it. include_usage null is None in vLLM's request model, so no
// usage at all; the booleans are read as pydantic reads them ("true").
func TestContinuousUsageStats(t *testing.T) {
	_, srv := newTestServer(t, Config{})
	type chunk struct {
		Choices []struct {
			Text  string
			Delta struct{ Content *string }
		}
		Usage *struct {
			PromptTokens     int `json:"prompt_tokens"`
			CompletionTokens int `json:"completion_tokens"`
			TotalTokens      int `json:"total_tokens"`
		}
	}
	chunks := func(path, body string) []chunk {
		t.Helper()
		resp, out := post(t, srv.URL+path, body)
		if resp.StatusCode != 200 {
			t.Fatalf("%s: %d %s", body, resp.StatusCode, out)
		}
		return streamedChunks[chunk](t, out)
	}
	for _, tc := range []struct{ path, body string }{
		{"/v1/completions", `{"prompt":"hello there","max_tokens":4,"stream":true,"stream_options":{"continuous_usage_stats":true}}`},
		{"/v1/chat/completions", `{"messages":[{"role":"user","content":"hi"}],"max_tokens":4,"stream":true,"stream_options":{"include_usage":"true","continuous_usage_stats":"true"}}`},
	} {
		cs := chunks(tc.path, tc.body)
		last := cs[len(cs)-1]
		if len(last.Choices) != 0 || last.Usage == nil || last.Usage.CompletionTokens != 4 {
			t.Fatalf("%s: the last chunk is not the whole usage: %+v", tc.body, last)
		}
		prompt, tokens := last.Usage.PromptTokens, 0
		for _, c := range cs[:len(cs)-1] {
			if c.Usage == nil {
				t.Fatalf("%s: a chunk without usage: %+v", tc.body, c)
			}
			if c.Choices[0].Text != "" || c.Choices[0].Delta.Content != nil && *c.Choices[0].Delta.Content != "" {
				tokens++
			}
			if u := *c.Usage; u.PromptTokens != prompt || u.CompletionTokens != tokens || u.TotalTokens != prompt+tokens {
				t.Errorf("%s: chunk usage %+v after %d tokens of a %d-token prompt", tc.body, u, tokens, prompt)
			}
		}
		if tokens != 4 {
			t.Errorf("%s: %d tokens streamed", tc.body, tokens)
		}
	}
	for _, body := range []string{
		`{"prompt":"hello","max_tokens":2,"stream":true,"stream_options":{"include_usage":null,"continuous_usage_stats":true}}`,
		`{"prompt":"hello","max_tokens":2,"stream":true,"stream_options":{"include_usage":false,"continuous_usage_stats":true}}`,
	} {
		for _, c := range chunks("/v1/completions", body) {
			if c.Usage != nil {
				t.Errorf("%s: a chunk with usage: %+v", body, c)
			}
		}
	}
}

// TestSuffixRefused: vLLM refuses a completion's suffix, any but null,
// with 400 "suffix is not currently supported" (its serving code checks
// request.suffix is not None), which fill-in-the-middle clients detect to
// fall back to the prefix alone; the chat API has no suffix and ignores
// one, as any field not its own.
func TestSuffixRefused(t *testing.T) {
	_, srv := newTestServer(t, Config{})
	for _, suffix := range []string{`"x"`, `""`, `5`} {
		resp, out := post(t, srv.URL+"/v1/completions", `{"prompt":"def f(","max_tokens":2,"suffix":`+suffix+`}`)
		want := `{"error":{"message":"suffix is not currently supported","type":"BadRequestError","param":null,"code":400}}`
		if suffix == `5` {
			want = `{"error":{"message":"suffix: Input should be a valid string","type":"BadRequestError","param":null,"code":400}}`
		}
		if resp.StatusCode != 400 || strings.TrimSpace(out) != want {
			t.Errorf("suffix %s: %d %s", suffix, resp.StatusCode, out)
		}
	}
	for _, tc := range []struct{ path, body string }{
		{"/v1/completions", `{"prompt":"def f(","max_tokens":2,"suffix":null}`},
		{"/v1/chat/completions", `{"messages":[{"role":"user","content":"hi"}],"max_tokens":2,"suffix":"x"}`},
	} {
		if resp, out := post(t, srv.URL+tc.path, tc.body); resp.StatusCode != 200 {
			t.Errorf("%s: %d %s", tc.body, resp.StatusCode, out)
		}
	}
}

// TestEchoAsVLLM: a completion with echo begins each choice's text with
// its prompt, as vLLM's serving_completion does: the whole answer's text,
// and a stream's first chunk of each choice (the prompt, then the first
// token's text); the usage is that of the same request without echo.
func TestEchoAsVLLM(t *testing.T) {
	_, srv := newTestServer(t, Config{})
	type answer struct {
		Choices []struct {
			Index int
			Text  string
		}
		Usage *struct {
			CompletionTokens int `json:"completion_tokens"`
		}
	}
	plain, echoed := mustPost(t, srv.URL+"/v1/completions", `{"prompt":"Once upon","max_tokens":5}`),
		mustPost(t, srv.URL+"/v1/completions", `{"prompt":"Once upon","max_tokens":5,"echo":true}`)
	var a, b answer
	if json.Unmarshal([]byte(plain), &a) != nil || json.Unmarshal([]byte(echoed), &b) != nil || len(a.Choices) != 1 || len(b.Choices) != 1 {
		t.Fatalf("answers: %s / %s", plain, echoed)
	}
	if b.Choices[0].Text != "Once upon"+a.Choices[0].Text {
		t.Errorf("echoed text %q, want the prompt then %q", b.Choices[0].Text, a.Choices[0].Text)
	}
	// Streamed, a batch of two prompts with two choices each: every
	// choice's first chunk begins with its own prompt, and no other does.
	resp, out := post(t, srv.URL+"/v1/completions", `{"prompt":["Alpha","Beta"],"n":2,"max_tokens":3,"stream":true,"echo":"true"}`)
	if resp.StatusCode != 200 {
		t.Fatalf("stream: %d %s", resp.StatusCode, out)
	}
	texts := map[int]string{}
	for _, c := range streamedChunks[answer](t, out) {
		for _, ch := range c.Choices {
			texts[ch.Index] += ch.Text
		}
	}
	for i, prompt := range []string{"Alpha", "Alpha", "Beta", "Beta"} {
		rest, ok := strings.CutPrefix(texts[i], prompt)
		if !ok || strings.Contains(rest, prompt) || len(rest) != 3*4 {
			t.Errorf("choice %d streamed %q, want %q then 3 tokens", i, texts[i], prompt)
		}
	}
	// A chat's echo (its final message again) is not modelled: ignored.
	if out := mustPost(t, srv.URL+"/v1/chat/completions", `{"messages":[{"role":"user","content":"hi"}],"max_tokens":2,"echo":true}`); strings.Contains(out, `"content":"hi`) {
		t.Errorf("chat with echo: %s", out)
	}
}

// TestContinuedChatStopsWhereTheWholeOneDoes: a chat without max_tokens
// generates the simulated model's own length (default_output_tokens); an
// answer cut and continued with continue_final_message (as the router
// continues a broken stream) stops where the whole answer stops, not that
// length again after the part already written.
func TestContinuedChatStopsWhereTheWholeOneDoes(t *testing.T) {
	_, srv := newTestServer(t, Config{DefaultOutputTokens: 30})
	answer := func(body string) (string, string) {
		var r struct {
			Choices []struct {
				FinishReason string `json:"finish_reason"`
				Message      struct{ Content string }
			}
		}
		if out := mustPost(t, srv.URL+"/v1/chat/completions", body); json.Unmarshal([]byte(out), &r) != nil || len(r.Choices) != 1 {
			t.Fatalf("answer: %s", out)
		}
		return r.Choices[0].Message.Content, r.Choices[0].FinishReason
	}
	full, finish := answer(`{"messages":[{"role":"user","content":"Tell me about caches."}]}`)
	if len(full) != 30*4 || finish != "stop" {
		t.Fatalf("whole answer %d bytes, %s", len(full), finish)
	}
	partial := full[:10*4]
	partialJSON, _ := json.Marshal(partial)
	rest, finish := answer(`{"messages":[{"role":"user","content":"Tell me about caches."},{"role":"assistant","content":` +
		string(partialJSON) + `}],"continue_final_message":true,"add_generation_prompt":false}`)
	if partial+rest != full || finish != "stop" {
		t.Fatalf("continued %q + %q (%s), want %q", partial, rest, finish, full)
	}
}

// streamedChunks decodes the chunks of an SSE stream's body into T, the
// data of each event but [DONE].
func streamedChunks[T any](t *testing.T, body string) []T {
	t.Helper()
	var chunks []T
	for _, line := range strings.Split(body, "\n") {
		data, ok := strings.CutPrefix(line, "data: ")
		if !ok || data == "[DONE]" {
			continue
		}
		var c T
		if err := json.Unmarshal([]byte(data), &c); err != nil {
			t.Fatalf("%v: %s", err, data)
		}
		chunks = append(chunks, c)
	}
	return chunks
}
