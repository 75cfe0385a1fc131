package integration

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/llmaffinity/caddy-llm-affinity/kvsim"
)

// answersQueueTimeout is the router's queue_timeout in TestAnswers: long,
// so that a request wrongly held until it runs out cannot pass.
const answersQueueTimeout = 30 * time.Second

// answerDeadline bounds every answer in TestAnswers, well below
// answersQueueTimeout: a row whose request the router holds for its
// queue_timeout gets no answer in time and fails.
const answerDeadline = answersQueueTimeout / 2

// answerRow is one row of issue 14's table: a request and the answer it
// must get, at once.
type answerRow struct {
	name string
	// head is the raw request without its body (request line and
	// headers, ending in a blank line); body follows. When short is set
	// the client closes its side after the body, which is shorter than
	// its Content-Length.
	head, body string
	short      bool
	// status is the answer's status; typ and code the error body's type
	// and code (code as JSON: a string in quotes, or a number), both
	// empty for a success.
	status    int
	typ, code string
	// message, when set, must appear in the error's message; param, when
	// set, is the error's param as JSON (a field name in quotes, or null).
	message, param string
	// closes says the router closes the connection with the answer (the
	// rest of the body is never read).
	closes bool
	// engine says the answer is the engine's, passed through (it names
	// the kvsim replica); otherwise an error must be the router's own.
	engine bool
}

// post builds a row's head and body: a POST of body to path with the
// given extra header lines.
func (r answerRow) post(path, body string, extra ...string) answerRow {
	r.head = fmt.Sprintf("POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n",
		path, routerHost, len(body), strings.Join(extra, ""))
	r.body = body
	return r
}

// send sends row on a new connection and reads the answer, waiting at most
// answerDeadline.
func (row answerRow) send() (*http.Response, []byte, error) {
	c, err := net.Dial("tcp", routerHost)
	if err != nil {
		return nil, nil, err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(answerDeadline))
	if _, err := io.WriteString(c, row.head+row.body); err != nil {
		return nil, nil, err
	}
	if row.short {
		c.(*net.TCPConn).CloseWrite()
	}
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		return nil, nil, fmt.Errorf("no answer within %v (held for queue_timeout?): %w", answerDeadline, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp, b, err
}

// check asserts that the answer to row, resp and its body b, is what row
// expects.
func (row answerRow) check(t *testing.T, resp *http.Response, b []byte, err error) {
	t.Helper()
	if err != nil {
		t.Errorf("%s: %v", row.name, err)
		return
	}
	if resp.StatusCode != row.status {
		t.Errorf("%s: status %d, want %d: %s", row.name, resp.StatusCode, row.status, b)
		return
	}
	if row.closes && !resp.Close {
		t.Errorf("%s: the connection stays open", row.name)
	}
	if fromEngine := resp.Header.Get(kvsim.ReplicaHeader) != ""; fromEngine != (row.engine || row.typ == "") {
		t.Errorf("%s: answered by the engine %v, want %v", row.name, fromEngine, row.engine || row.typ == "")
	}
	if row.typ == "" {
		return
	}
	var e struct {
		Error struct {
			Message string          `json:"message"`
			Type    string          `json:"type"`
			Code    json.RawMessage `json:"code"`
			Param   json.RawMessage `json:"param"`
		} `json:"error"`
	}
	if err := json.Unmarshal(b, &e); err != nil {
		t.Errorf("%s: not an OpenAI error body: %v: %s", row.name, err, b)
		return
	}
	if e.Error.Type != row.typ || string(e.Error.Code) != row.code || !strings.Contains(e.Error.Message, row.message) {
		t.Errorf("%s: type %q code %s message %q, want type %q code %s message with %q",
			row.name, e.Error.Type, e.Error.Code, e.Error.Message, row.typ, row.code, row.message)
	}
	if row.param != "" && string(e.Error.Param) != row.param {
		t.Errorf("%s: param %s, want %s", row.name, e.Error.Param, row.param)
	}
	if ct := resp.Header.Get("Content-Type"); ct != "application/json" {
		t.Errorf("%s: Content-Type %q", row.name, ct)
	}
	// Only a shed request may be retried; these never succeed as sent.
	if ra := resp.Header.Get("Retry-After"); ra != "" {
		t.Errorf("%s: Retry-After %q on an answer that retrying cannot change", row.name, ra)
	}
}

// TestAnswers is issue 14's table: every request gets an answer the client
// can act on, with its exact status, error type and code, at once (within
// answerDeadline, half the router's queue_timeout).
//
// Two rows of the issue are not requests with an answer of their own: the
// parser's memory on a large body of tiny messages is measured by
// caddyllm's BenchmarkHandlerParse (the row here checks that such a body is
// parsed and answered at once), and the bounded table of model names by
// router.TestModelTableIsBounded.
func TestAnswers(t *testing.T) {
	// One replica with 16,384 tokens of KV.
	fleet := startFleet(t, 1, 1, kvsim.Config{NumGPUBlocks: 1024})
	r := fleet[0]
	startCaddy(t, caddyfile(fleet, "max_body 1MiB", fmt.Sprintf(`scrape_interval 100ms
			models_interval 1s
			output_estimate max_tokens
			queue_timeout %s`, answersQueueTimeout),
		// Caddy asks a policy that chose nothing again until this passes:
		// the router's own answers must come at once all the same.
		"lb_try_duration 1h"))
	eventually(t, 10*time.Second, "the engine's model list and KV scraped", func() bool {
		v := listedEngine(t, r.dial())
		return v != nil && len(v.Models) > 0 && v.KVCapacity == 16_384
	})
	model := kvsim.DefaultModel
	completion := func(prompt string, maxTokens int) string {
		b, _ := json.Marshal(map[string]any{"model": model, "prompt": prompt, "max_tokens": maxTokens})
		return string(b)
	}
	var tiny bytes.Buffer
	tiny.WriteString(`{"model":"` + model + `","max_tokens":4,"messages":[`)
	for i := 0; tiny.Len() < 1000_000; i++ {
		if i > 0 {
			tiny.WriteByte(',')
		}
		tiny.WriteString(`{"role":"user","content":"hi"}`)
	}
	tiny.WriteString(`]}`)
	bodyHeldBack := "POST /v1/completions HTTP/1.1\r\nHost: " + routerHost + "\r\nContent-Type: application/json\r\nContent-Length: 2000000\r\n"
	rows := []answerRow{
		answerRow{name: "a model no upstream serves", status: 404, typ: "invalid_request_error", code: `"model_not_found"`, param: `"model"`}.
			post("/v1/chat/completions", `{"model":"gpt-4","max_tokens":4,"messages":[{"role":"user","content":"hi"}]}`),
		// vLLM refuses a body that is not UTF-8 before it reads the model.
		answerRow{name: "a body not UTF-8 naming a model no upstream serves", status: 400, typ: "invalid_request_error", code: `400`,
			message: "not valid UTF-8"}.
			post("/v1/chat/completions", "{\"model\":\"gpt-4\",\"max_tokens\":4,\"messages\":[{\"role\":\"user\",\"content\":\"h\xffi\"}]}"),
		// Text is refused here only when it is too long even at 16 bytes
		// a token; nearer, the engine counts it and answers, at once.
		answerRow{name: "a prompt longer than any upstream's KV capacity at 16 bytes a token", status: 400, typ: "invalid_request_error", code: `"context_length_exceeded"`, param: `"prompt"`}.
			post("/v1/completions", completion(text("huge", 300_000), 4)), // 75,000 tokens
		answerRow{name: "a prompt longer than any upstream's KV capacity", status: 400, typ: "BadRequestError", code: `400`,
			message:                                                       "exceeds the KV cache capacity", engine: true}.
			post("/v1/completions", completion(text("long", 120_000), 4)), // 30,000 tokens
		// About 16,000 CJK characters sent as Python's json.dumps sends them
		// (ensure_ascii: six bytes each) are 48,000 bytes of text, 12,000
		// tokens to kvsim: counted as sent, they looked 24,000 and were
		// refused.
		answerRow{name: "CJK text escaped as Python sends it, within the KV capacity", status: 200}.
			post("/v1/completions", `{"model":"`+model+`","max_tokens":4,"prompt":`+strconv.QuoteToASCII(strings.Repeat("路由器把请求发给最快的副本。", 16_000/14)+"路由器")+`}`),
		// vLLM reads the body with Python's json.loads: a key's last value
		// wins, and the earlier one, of the wrong type, is not seen.
		answerRow{name: "a key given twice, the first value of the wrong type", status: 200}.
			post("/v1/completions", `{"model":"`+model+`","prompt":"hello","max_tokens":"many","max_tokens":2}`),
		answerRow{name: "a short prompt whose max_tokens exceeds the KV capacity", status: 400, typ: "invalid_request_error", code: `"context_length_exceeded"`,
			param: `"prompt"`, message: "max_tokens is 20000"}.
			post("/v1/completions", completion("hello", 20_000)),
		// Its expected output (256 tokens) would not fit beside it, but
		// an engine stops a sequence at its context: it is the engine's
		// to run (kvsim, as vLLM, gives a completion 16 tokens).
		// vLLM cuts the Responses API's max_output_tokens to what the
		// context leaves, where chat and completions refuse max_tokens.
		answerRow{name: "a Responses request whose max_output_tokens exceeds the KV capacity", status: 200}.
			post("/v1/responses", `{"model":"`+model+`","max_output_tokens":20000,"input":"`+text("tight", 16_200*4)+`"}`),
		answerRow{name: "a prompt just under the KV capacity, without max_tokens", status: 200}.
			post("/v1/completions", `{"model":"`+model+`","prompt":"`+text("near", 16_200*4)+`"}`),
		// The router accepts and hashes a batch of token-id arrays and
		// passes it on; kvsim, as vLLM, runs each as a sequence.
		answerRow{name: "a completions prompt as a batch of one token-id array", status: 200}.
			post("/v1/completions", `{"model":"`+model+`","prompt":[[1,2,3]],"max_tokens":2}`),
		answerRow{name: "a completions prompt as a batch of token-id arrays", status: 200}.
			post("/v1/completions", `{"model":"`+model+`","prompt":[[1,2,3],[4,5,6]],"max_tokens":2}`),
		{name: "Content-Length over max_body, body held back", head: bodyHeldBack + "\r\n",
			status: 413, typ: "invalid_request_error", code: `413`, closes: true},
		{name: "Content-Length over max_body, Expect: 100-continue", head: bodyHeldBack + "Expect: 100-continue\r\n\r\n",
			status: 413, typ: "invalid_request_error", code: `413`, closes: true},
		answerRow{name: "a gzip body", status: 415, typ: "invalid_request_error", code: `415`, message: "gzip"}.
			post("/v1/completions", "\x1f\x8b\x08\x00", "Content-Encoding: gzip\r\n"),
		answerRow{name: "a deflate body", status: 415, typ: "invalid_request_error", code: `415`, message: "deflate"}.
			post("/v1/completions", "x\x9c", "Content-Encoding: deflate\r\n"),
		answerRow{name: "a zstd body", status: 415, typ: "invalid_request_error", code: `415`, message: "zstd"}.
			post("/v1/completions", "(\xb5/\xfd", "Content-Encoding: zstd\r\n"),
		answerRow{name: "a gzip body whose first Content-Encoding line says identity", status: 415, typ: "invalid_request_error", code: `415`, message: "identity, gzip"}.
			post("/v1/completions", "\x1f\x8b\x08\x00", "Content-Encoding: identity\r\nContent-Encoding: gzip\r\n"),
		{name: "a body shorter than its Content-Length",
			head:   "POST /v1/completions HTTP/1.1\r\nHost: " + routerHost + "\r\nContent-Type: application/json\r\nContent-Length: 500\r\n\r\n",
			body:   `{"model":"m","prompt":"short"}`,
			short:  true,
			status: 400, typ: "invalid_request_error", code: `400`, closes: true},
		answerRow{name: "a body that is not JSON", status: 400, typ: "invalid_request_error", code: `400`, param: `null`}.
			post("/v1/completions", `{"model": "x", "prompt": `),
		answerRow{name: "a field of the wrong type", status: 400, typ: "invalid_request_error", code: `400`, message: "messages must be an array", param: `"messages"`}.
			post("/v1/chat/completions", `{"model":"`+model+`","messages":"nope"}`),
		answerRow{name: "a model name longer than any model's", status: 400, typ: "invalid_request_error", code: `400`, message: "model must be at most", param: `"model"`}.
			post("/v1/completions", `{"model":"`+strings.Repeat("m", 100_000)+`","prompt":"hi","max_tokens":2}`),
		answerRow{name: "a chat without messages", status: 400, typ: "invalid_request_error", code: `400`, message: "messages is required", param: `"messages"`}.
			post("/v1/chat/completions", `{"model":"`+model+`","max_tokens":4}`),
		answerRow{name: "a 1 MB body of tiny messages (about 250,000 tokens)", status: 400, typ: "BadRequestError", code: `400`,
			message: "maximum context length", engine: true}.
			post("/v1/chat/completions", tiny.String()),
	}
	for _, row := range rows {
		resp, b, err := row.send()
		row.check(t, resp, b, err)
	}
	// The answers that no wait can cure are counted as refused, by their
	// code, not as sheds: an alert on sheds must not fire on clients'
	// mistakes.
	mfs := metricFamilies(t, adminURL+"/metrics")
	for code, least := range map[string]float64{"model_not_found": 1, "context_length_exceeded": 2} {
		if n := counterValue(mfs, "caddy_llm_affinity_refused_total", "code", code); n < least {
			t.Errorf("caddy_llm_affinity_refused_total{code=%q} = %v, want at least %v", code, n, least)
		}
	}
	for _, blockedBy := range []string{"model", "context_length"} {
		if n := counterValue(mfs, "caddy_llm_affinity_shed_total", "blocked_by", blockedBy); n != 0 {
			t.Errorf("caddy_llm_affinity_shed_total{blocked_by=%q} = %v: refusals counted as sheds", blockedBy, n)
		}
	}

	// A prompt that fits the upstream's KV capacity but not its free KV
	// now is routed there at once, queued by the engine until its KV
	// frees, not held at the gateway (nor shed). A 12,000-token prompt
	// generating 2,000 tokens holds 14,000 of the 16,384 tokens for many
	// seconds; a 4,000-token prompt does not fit beside it.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	occupier := make(chan error, 1)
	go func() {
		req, _ := http.NewRequestWithContext(ctx, "POST", routerURL+"/v1/completions", strings.NewReader(completion(text("occupy", 48_000), 2000)))
		req.Header.Set("Content-Type", "application/json")
		resp, err := http.DefaultClient.Do(req)
		if err == nil {
			resp.Body.Close()
			err = fmt.Errorf("the occupying request ended (%d) before it was cancelled", resp.StatusCode)
		}
		occupier <- err
	}()
	eventually(t, 10*time.Second, "the occupying request running on the engine", func() bool { return engineRunning(t, r) == 1 })
	row := answerRow{name: "a prompt that fits the KV capacity but not the free KV now", status: 200}.
		post("/v1/completions", completion(text("queued", 16_000), 4))
	type answer struct {
		resp *http.Response
		body []byte
		err  error
	}
	answered := make(chan answer, 1)
	go func() {
		resp, b, err := row.send()
		answered <- answer{resp, b, err}
	}()
	eventually(t, 10*time.Second, "the request routed beside the occupying one", func() bool {
		u, ok := upstreams(t)[r.dial()]
		return ok && u.InFlight == 2
	})
	select {
	case err := <-occupier:
		t.Fatalf("the occupying request was not running any more when the other was routed: %v", err)
	default:
	}
	cancel() // the engine frees the occupier's KV and starts the queued request
	a := <-answered
	row.check(t, a.resp, a.body, a.err)
}

// TestOwnAnswerUnderRetryInterval: with lb_retries and an lb_try_interval,
// Caddy waits the interval before asking a policy that chose nothing again;
// the router's own answer (here the 404 for a model no engine lists) comes
// at once all the same.
func TestOwnAnswerUnderRetryInterval(t *testing.T) {
	fleet := startFleet(t, 1, 1, kvsim.Config{})
	startCaddy(t, caddyfile(fleet, "", "scrape_interval 100ms\n\t\t\tmodels_interval 1s", "lb_retries 2\n\t\tlb_try_interval 1h"))
	waitForModelLists(t, fleet)
	row := answerRow{name: "a model no upstream serves", status: 404, typ: "invalid_request_error", code: `"model_not_found"`, param: `"model"`}.
		post("/v1/chat/completions", `{"model":"gpt-4","max_tokens":4,"messages":[{"role":"user","content":"hi"}]}`)
	resp, b, err := row.send() // within answerDeadline
	row.check(t, resp, b, err)
}

// TestUnknownModelWithAnUpstreamDown: a model no engine lists, while the
// one upstream whose models are unknown is down (nothing listens there),
// gets a 503 at once: it used to wait queue_timeout, holding a place at
// the gateway. Not a 404: the model may be that engine's, still starting.
func TestUnknownModelWithAnUpstreamDown(t *testing.T) {
	fleet := startFleet(t, 2, 1, kvsim.Config{})
	dead := fmt.Sprintf("127.0.0.1:%d", freePort(t)) // nothing listens
	startCaddy(t, globalOptions+fmt.Sprintf(`http://%s {
	llm_affinity
	reverse_proxy %s %s {
		lb_policy llm_affinity {
			scrape_interval 100ms
			models_interval 1s
			queue_timeout %s
		}
		lb_retries 2
	}
}
`, routerHost, dials(fleet), dead, answersQueueTimeout))
	eventually(t, 10*time.Second, "both engines' models listed and the dead one's scrape refused", func() bool {
		for _, r := range fleet {
			if v := listedEngine(t, r.dial()); v == nil || len(v.Models) == 0 {
				return false
			}
		}
		v := listedEngine(t, dead)
		return v != nil && strings.Contains(v.LastError, "refused")
	})
	row := answerRow{}.post("/v1/chat/completions", `{"model":"no-such-model","messages":[{"role":"user","content":"hi"}]}`)
	resp, b, err := row.send() // within answerDeadline, half the queue_timeout
	if err != nil {
		t.Fatal(err)
	}
	if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") == "" ||
		!strings.Contains(string(b), "no upstream that might serve the model is running") || resp.Header.Get(kvsim.ReplicaHeader) != "" {
		t.Fatalf("%d %v %s", resp.StatusCode, resp.Header, b)
	}
}
