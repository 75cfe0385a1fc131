package caddyllm

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"
	"unicode/utf16"
	"unicode/utf8"

	"github.com/zeebo/xxh3"

	"github.com/llmaffinity/caddy-llm-affinity/internal/cputime"
	"github.com/llmaffinity/caddy-llm-affinity/prefixindex"
	"github.com/llmaffinity/caddy-llm-affinity/router"
)

func testParser() *parser {
	return newParser(prefixindex.Hasher{BlockTokens: 4, BytesPerToken: 4}, 4, "")
}

// parse reads body for endpoint, its hashes seeded with the model as
// sent: as a policy seeds them for a model served under one name, or
// before the engines' lists came.
func (p *parser) parse(endpoint Endpoint, body []byte) (*Request, error) {
	req := new(Request)
	if err := p.parseInto(req, endpoint, body); err != nil {
		return nil, err
	}
	req.seed(req.Model)
	return req, nil
}

func chatBody(t testing.TB, msgs ...[2]string) []byte {
	var m []map[string]string
	for _, x := range msgs {
		m = append(m, map[string]string{"role": x[0], "content": x[1]})
	}
	b, err := json.Marshal(map[string]any{"model": "m", "messages": m, "max_tokens": 7})
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestChatTurnsExtendEachOther(t *testing.T) {
	p := testParser()
	sys := strings.Repeat("system prompt text ", 20)
	turn1, err := p.parse(EndpointChatCompletions, chatBody(t, [2]string{"system", sys}, [2]string{"user", "hi"}))
	if err != nil {
		t.Fatal(err)
	}
	turn2, err := p.parse(EndpointChatCompletions, chatBody(t, [2]string{"system", sys}, [2]string{"user", "hi"},
		[2]string{"assistant", "hello"}, [2]string{"user", "more please"}))
	if err != nil {
		t.Fatal(err)
	}
	if len(turn1.Hashes) == 0 || len(turn2.Hashes) <= len(turn1.Hashes) {
		t.Fatalf("blocks: turn1 %d turn2 %d", len(turn1.Hashes), len(turn2.Hashes))
	}
	for i, h := range turn1.Hashes {
		if turn2.Hashes[i] != h {
			t.Fatalf("turn 2 diverges from turn 1 at block %d", i)
		}
	}
	if turn1.MaxTokens != 7 || turn1.PromptTokens < len(sys)/4 {
		t.Fatalf("turn1 %+v", turn1)
	}
	// A different role for the same text is a different prefix.
	other, _ := p.parse(EndpointChatCompletions, chatBody(t, [2]string{"user", sys}))
	if other.Hashes[0] == turn1.Hashes[0] {
		t.Fatal("role not part of the prefix")
	}
}

// TestResponsesTurnsExtendEachOther: a Responses API conversation sent
// again with its output and new items appended extends the same chain,
// and it hashes as the same conversation through the chat API does (vLLM
// renders both with the chat template, so the engine's cache is shared).
func TestResponsesTurnsExtendEachOther(t *testing.T) {
	p := testParser()
	sys := strings.Repeat("system prompt text ", 20)
	body := func(items ...any) []byte {
		b, err := json.Marshal(map[string]any{"model": "m", "instructions": sys, "input": items, "max_output_tokens": 9})
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	user := map[string]any{"role": "user", "content": "hi"}
	turn1, err := p.parse(EndpointResponses, body(user))
	if err != nil {
		t.Fatal(err)
	}
	turn2, err := p.parse(EndpointResponses, body(user,
		map[string]any{"type": "message", "role": "assistant", "id": "msg_1", "content": []any{map[string]any{"type": "output_text", "text": "calling f"}}},
		map[string]any{"type": "function_call", "call_id": "c1", "name": "f", "arguments": `{"x":1}`},
		map[string]any{"type": "function_call_output", "call_id": "c1", "output": "42"},
		map[string]any{"role": "user", "content": "thanks"}))
	if err != nil {
		t.Fatal(err)
	}
	if len(turn1.Hashes) == 0 || len(turn2.Hashes) <= len(turn1.Hashes) {
		t.Fatalf("blocks: turn1 %d turn2 %d", len(turn1.Hashes), len(turn2.Hashes))
	}
	for i, h := range turn1.Hashes {
		if turn2.Hashes[i] != h {
			t.Fatalf("turn 2 diverges from turn 1 at block %d", i)
		}
	}
	if turn1.MaxTokens != 9 || turn1.PromptTokens < len(sys)/4 || turn1.Endpoint != EndpointResponses {
		t.Fatalf("turn1 %+v", turn1)
	}
	asString, err := p.parse(EndpointResponses, []byte(`{"model":"m","instructions":"`+sys+`","input":"hi"}`))
	if err != nil {
		t.Fatal(err)
	}
	chat, err := p.parse(EndpointChatCompletions, chatBody(t, [2]string{"system", sys}, [2]string{"user", "hi"}))
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(asString.Hashes, turn1.Hashes) || !slices.Equal(chat.Hashes, turn1.Hashes) {
		t.Fatal("the same conversation hashes differently as an input string, an input item or a chat")
	}
}

func TestCompletionPromptForms(t *testing.T) {
	p := testParser()
	for _, tc := range []struct {
		body   string
		tokens int
		blocks int
	}{
		{`{"model":"m","prompt":"` + strings.Repeat("a", 64) + `"}`, 16, 4},
		{`{"model":"m","prompt":["` + strings.Repeat("a", 32) + `","` + strings.Repeat("b", 32) + `"]}`, 17, 4},
		{`{"model":"m","prompt":[1,2,3,4,5,6,7,8,9]}`, 9, 2},
		{`{"model":"m","prompt":[[1,2,3,4],[5,6,7,8,9]]}`, 9, 2},
		{`{"model":"m"}`, 0, 0},
	} {
		req, err := p.parse(EndpointCompletions, []byte(tc.body))
		if err != nil {
			t.Fatalf("%s: %v", tc.body, err)
		}
		if req.PromptTokens != tc.tokens || len(req.Hashes) != tc.blocks {
			t.Errorf("%s: %d tokens %d blocks, want %d %d", tc.body, req.PromptTokens, len(req.Hashes), tc.tokens, tc.blocks)
		}
	}
	// Token ids as whole-number floats (numpy arrays' tolist()) are the
	// same tokens, as vLLM reads them.
	ints, err := p.parse(EndpointCompletions, []byte(`{"model":"m","prompt":[1,2,3,4,5,6,7,8]}`))
	floats, err2 := p.parse(EndpointCompletions, []byte(`{"model":"m","prompt":[1.0,2,3e0,4,5.0,6,7,8]}`))
	if err != nil || err2 != nil || !slices.Equal(ints.Hashes, floats.Hashes) {
		t.Fatalf("token ids as floats: %v %v, hashes %x and %x", err, err2, ints.Hashes, floats.Hashes)
	}
}

func TestParseRejectsBadShapes(t *testing.T) {
	p := testParser()
	for _, tc := range []struct {
		ep   Endpoint
		body string
	}{
		{EndpointCompletions, `{`},
		{EndpointCompletions, `[]`},
		{EndpointCompletions, `{"prompt": 3}`},
		{EndpointCompletions, `{"prompt": [1, "a"]}`},
		{EndpointCompletions, `{"prompt": [1.5]}`},
		{EndpointCompletions, `{"prompt": [1e300]}`},
		{EndpointCompletions, `{"prompt": [9223372036854775808]}`},
		{EndpointCompletions, `{"prompt": [{}]}`},
		{EndpointCompletions, `{"prompt": [[1,2],["a"]]}`},
		{EndpointCompletions, `{"prompt": [[1,2],"a"]}`},
		{EndpointCompletions, `{"max_tokens": "x"}`},
		{EndpointChatCompletions, `{"model":"m"}`},
		{EndpointChatCompletions, `{"messages": "x"}`},
		{EndpointChatCompletions, `{"messages": [{"content": "no role"}]}`},
		{EndpointResponses, `{"model":"m"}`},
		{EndpointResponses, `{"input": 3}`},
		{EndpointResponses, `{"input": ["x"]}`},
		{EndpointResponses, `{"input": [{"content": "neither role nor type"}]}`},
		{EndpointResponses, `{"input": "x", "instructions": 1}`},
		{EndpointResponses, `{"input": "x", "max_output_tokens": 1.5}`},
	} {
		_, err := p.parse(tc.ep, []byte(tc.body))
		var bad errBadRequest
		if !errors.As(err, &bad) {
			t.Errorf("%s: error %v, want a bad request", tc.body, err)
		}
	}
}

func TestEndpointOf(t *testing.T) {
	for _, tc := range []struct {
		method, path string
		want         Endpoint
	}{
		{"POST", "/v1/completions", EndpointCompletions},
		{"POST", "/v1/chat/completions", EndpointChatCompletions},
		{"POST", "/openai/v1/chat/completions", EndpointChatCompletions},
		{"GET", "/v1/completions", EndpointOther},
		{"POST", "/v1/embeddings", EndpointOther},
		{"POST", "/v1/responses", EndpointResponses},
		{"GET", "/v1/responses/resp_1", EndpointOther},
		{"POST", "/v1/responses/resp_1/cancel", EndpointOther},
	} {
		if got := endpointOf(tc.method, tc.path); got != tc.want {
			t.Errorf("%s %s = %v, want %v", tc.method, tc.path, got, tc.want)
		}
	}
}

// FuzzParse: no body makes the parser panic, and what it accepts has
// consistent counts.
func FuzzParse(f *testing.F) {
	f.Add([]byte(`{"model":"m","prompt":"hello world, hello world"}`), false)
	f.Add([]byte(`{"model":"m","prompt":[1,2,3,4,5]}`), false)
	f.Add([]byte(`{"model":"m","prompt":["a","b"]}`), false)
	f.Add([]byte(`{"model":"m","prompt":[[1,2,3],[4,5,6]]}`), false)
	f.Add([]byte(`{"model":"m","messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function"}]}`), true)
	f.Add([]byte(`{"messages":[{"role":"user","content":[{"type":"text","text":"x"}]}]}`), true)
	f.Add([]byte(`{"prompt":"\u00e9\"\\"}`), false)
	p := testParser()
	f.Fuzz(func(t *testing.T, body []byte, chat bool) {
		ep := EndpointCompletions
		if chat {
			ep = EndpointChatCompletions
		}
		req, err := p.parse(ep, body)
		if err != nil {
			var bad errBadRequest
			if !errors.As(err, &bad) {
				t.Fatalf("unexpected error type %T", err)
			}
			return
		}
		// What is counted is hashed: the count is the text's, escapes
		// decoded. Content-part arrays are hashed as sent but count only
		// their parts' text, so the blocks bound the count from above
		// only where the body has none (at most the messages' bracket).
		if req.PromptTokens < 0 || req.PromptBytes < 0 || len(req.Hashes) < min(req.PromptBytes/16, prefixindex.DefaultMaxBlocks) {
			t.Fatalf("%d bytes counted but %d blocks", req.PromptBytes, len(req.Hashes))
		}
		if ep == EndpointCompletions || bytes.Count(body, []byte("[")) <= 1 {
			if len(req.Hashes) > req.PromptTokens/4+1 {
				t.Fatalf("%d tokens but %d blocks", req.PromptTokens, len(req.Hashes))
			}
		}
		if req.Sequences < 1 || req.Sequences > maxSequences {
			t.Fatalf("%d sequences", req.Sequences)
		}
	})
}

// benchChat is a chat body of about size bytes: turns of a user's 1 KiB
// and an assistant's reply (short, or with escapes a 1 KiB line of code
// with escaped quotes and newlines), and with tools a list of function definitions sent
// after the messages (the OpenAI Python client's key order, which makes
// the reader hash the messages again behind the tools).
func benchChat(tb testing.TB, size int, tools, escapes bool) []byte {
	turn := strings.Repeat("lorem ipsum dolor sit amet ", 38)
	reply := "ok"
	if escapes {
		reply = strings.Repeat("if x == \"y\" {\n\treturn \"z\"\n}\n", 32)
	}
	m := map[string]any{"model": "meta-llama/Llama-3.1-8B-Instruct", "max_tokens": 256, "stream": true}
	if tools {
		m["tools"] = []map[string]any{{"type": "function", "function": map[string]any{
			"name": "search", "description": strings.Repeat("search the web ", 20),
			"parameters": map[string]any{"type": "object", "properties": map[string]any{"q": map[string]string{"type": "string"}}},
		}}}
	}
	b, msgs := growMessages(tb, m, size, turn, reply)
	if tools { // messages first, tools last
		mb, _ := json.Marshal(msgs)
		delete(m, "messages")
		rest, _ := json.Marshal(m)
		b = append(append(append([]byte(`{"messages":`), mb...), ','), rest[1:]...)
	}
	return b
}

// benchChatParts is a chat body of about size bytes whose user turns are
// arrays of content parts, as clients of vision models send every
// message: the turn's text in two text parts, the assistant's reply a
// string.
func benchChatParts(tb testing.TB, size int) []byte {
	turn := strings.Repeat("lorem ipsum dolor sit amet ", 19)
	parts := []map[string]string{{"type": "text", "text": turn}, {"type": "text", "text": turn}}
	m := map[string]any{"model": "meta-llama/Llama-3.1-8B-Instruct", "max_tokens": 256, "stream": true}
	b, _ := growMessages(tb, m, size, parts, "ok")
	return b
}

// growMessages sets m's messages to as many user and assistant turns
// (user's content, then assistant's) as keep m's JSON within about size
// bytes, and returns that JSON and the messages. It grows by doubling,
// then trims: marshalling once per turn is quadratic.
func growMessages(tb testing.TB, m map[string]any, size int, user, assistant any) ([]byte, []map[string]any) {
	var msgs []map[string]any
	for n := 1; ; n *= 2 {
		for len(msgs) < n {
			msgs = append(msgs, map[string]any{"role": "user", "content": user}, map[string]any{"role": "assistant", "content": assistant})
		}
		m["messages"] = msgs
		b, err := json.Marshal(m)
		if err != nil {
			tb.Fatal(err)
		}
		if len(b) < size {
			continue
		}
		// About len(b)/n bytes a turn: keep as many as fit.
		msgs = msgs[:max(1, n*size/len(b))]
		m["messages"] = msgs
		b, _ = json.Marshal(m)
		return b, msgs
	}
}

// BenchmarkHandlerParse is the handler's parse of a chat body: read,
// validate, pick out the fields, hash the prompt. reference is the
// encoding/json parser it replaced (request_ref_test.go); xxh3 is plain
// xxh3 over the same bytes, the floor to compare with in the same run.
func BenchmarkHandlerParse(b *testing.B) {
	p := newParser(prefixindex.Hasher{}, 4, "")
	for _, bc := range []struct {
		name string
		body []byte
	}{
		{"chat-64KiB", benchChat(b, 64<<10, false, false)},
		{"chat-escapes-64KiB", benchChat(b, 64<<10, false, true)},
		{"chat-tools-last-64KiB", benchChat(b, 64<<10, true, false)},
		{"chat-parts-64KiB", benchChatParts(b, 64<<10)},
	} {
		b.Run(bc.name, func(b *testing.B) {
			b.SetBytes(int64(len(bc.body)))
			b.ReportAllocs()
			cpu := cputime.Start()
			for b.Loop() {
				if _, err := p.parse(EndpointChatCompletions, bc.body); err != nil {
					b.Fatal(err)
				}
			}
			cputime.Report(b, cpu)
		})
		b.Run(bc.name+"/reference", func(b *testing.B) {
			b.SetBytes(int64(len(bc.body)))
			b.ReportAllocs()
			cpu := cputime.Start()
			for b.Loop() {
				if _, err := p.refParse(EndpointChatCompletions, bc.body); err != nil {
					b.Fatal(err)
				}
			}
			cputime.Report(b, cpu)
		})
		b.Run(bc.name+"/xxh3", func(b *testing.B) {
			b.SetBytes(int64(len(bc.body)))
			cpu := cputime.Start()
			for b.Loop() {
				benchSink = xxh3.Hash(bc.body)
			}
			cputime.Report(b, cpu)
		})
	}
}

// BenchmarkHandlerParseMaxBody is the parse of a body at the handler's
// default limit (32 MiB of chat): its memory is the hashes of the first
// max_prefix_tokens and the pooled scratch, not the body.
func BenchmarkHandlerParseMaxBody(b *testing.B) {
	p := newParser(prefixindex.Hasher{MaxBlocks: defaultMaxPrefixTokens / prefixindex.DefaultBlockTokens}, 4, "")
	body := benchChat(b, defaultMaxBodyBytes-64<<10, false, false)
	if len(body) > defaultMaxBodyBytes {
		b.Fatalf("body %d bytes", len(body))
	}
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	cpu := cputime.Start()
	for b.Loop() {
		if _, err := p.parse(EndpointChatCompletions, body); err != nil {
			b.Fatal(err)
		}
	}
	cputime.Report(b, cpu)
}

var benchSink uint64

// TestTypeErrorsInTheAPIsWords: a wrong field type is named as the API
// documents it, never as a Go type.
func TestTypeErrorsInTheAPIsWords(t *testing.T) {
	p := testParser()
	for _, tc := range []struct {
		ep         Endpoint
		body, want string
	}{
		{EndpointChatCompletions, `{"messages":"x"}`, "messages must be an array"},
		{EndpointChatCompletions, `{"messages":["x"]}`, "messages[0] must be an object"},
		{EndpointChatCompletions, `{"messages":[{"role":"user"},{"role":7}]}`, "messages[1].role must be a string"},
		{EndpointCompletions, `{"model":3}`, "model must be a string"},
		{EndpointCompletions, `{"max_tokens":"x"}`, "max_tokens must be an integer"},
		{EndpointCompletions, `{"max_tokens":1.5}`, "max_tokens must be an integer"},
		{EndpointCompletions, `{"stream":"maybe"}`, "stream must be a boolean"},
	} {
		_, err := p.parse(tc.ep, []byte(tc.body))
		if err == nil || !strings.Contains(err.Error(), tc.want) || strings.Contains(err.Error(), "caddyllm") || strings.Contains(err.Error(), "int") && !strings.Contains(tc.want, "int") {
			t.Errorf("%s: %v, want %q", tc.body, err, tc.want)
		}
		// param names the same field as the message.
		var bad errBadRequest
		if errors.As(err, &bad) && !strings.HasPrefix(tc.want, bad.param+" ") {
			t.Errorf("%s: param %q, the message says %q", tc.body, bad.param, tc.want)
		}
	}
	// The too-long message names the field the client set.
	for _, tc := range []struct {
		body, want string
	}{
		{`{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":7}`, "max_tokens is 7"},
		{`{"model":"m","messages":[{"role":"user","content":"hi"}],"max_completion_tokens":7}`, "max_completion_tokens is 7"},
	} {
		req, err := p.parse(EndpointChatCompletions, []byte(tc.body))
		if err != nil {
			t.Fatal(err)
		}
		if msg := req.tooLongMessage(100); !strings.Contains(msg, tc.want) {
			t.Errorf("%s: %q, want %q", tc.body, msg, tc.want)
		}
	}
}

// BenchmarkDecision is the whole decision for a 64 KiB chat body at 64
// upstreams, as the handler and the policy make it: parse and hash the
// body, match its blocks in the index (each upstream holding the
// conversation's prefix to a different depth), cost and choose, charge;
// then release. xxh3 is plain xxh3 over the same bytes.
func BenchmarkDecision(b *testing.B) {
	body := benchChat(b, 64<<10, false, false)
	p := newParser(prefixindex.Hasher{}, 4, "")
	req, err := p.parse(EndpointChatCompletions, body)
	if err != nil {
		b.Fatal(err)
	}
	f := router.New()
	opts := router.Options{}.WithDefaults()
	rng := newLockedRand()
	var members []router.Member
	now := time.Now()
	for i := range 64 {
		members = append(members, router.Member{Dial: fmt.Sprintf("10.0.0.%d:8000", i), Available: true})
		// Upstream i holds the first i*4 blocks of the conversation.
		d := f.Decide(now, router.Request{Hashes: req.Hashes[:min(i*4, len(req.Hashes))], BlockTokens: 64,
			PromptTokens: 64 * i * 4, Model: req.Model}, members[i:i+1], &opts, rng, nil)
		f.Release(d.Charge, now)
	}
	b.Run("chat-64KiB/upstreams=64", func(b *testing.B) {
		b.SetBytes(int64(len(body)))
		b.ReportAllocs()
		cpu := cputime.Start()
		for b.Loop() {
			req, err := p.parse(EndpointChatCompletions, body)
			if err != nil {
				b.Fatal(err)
			}
			d := f.Decide(now, router.Request{Hashes: req.Hashes, BlockTokens: 64, PromptTokens: req.PromptTokens,
				MaxTokens: req.MaxTokens, Model: req.Model}, members, &opts, rng, nil)
			if d.Charge == nil {
				b.Fatal("nothing chosen")
			}
			f.Release(d.Charge, now)
		}
		cputime.Report(b, cpu)
	})
	b.Run("chat-64KiB/xxh3", func(b *testing.B) {
		b.SetBytes(int64(len(body)))
		cpu := cputime.Start()
		for b.Loop() {
			benchSink = xxh3.Hash(body)
		}
		cputime.Report(b, cpu)
	})
}

// TestInvalidMessagesCostNoRecords: a body of many empty or null messages
// (each invalid: no role) is refused without a record per element, so it
// costs at most about its own size to parse.
func TestInvalidMessagesCostNoRecords(t *testing.T) {
	for _, elem := range []string{"{}", "null", `{"content":"x"}`} {
		var b strings.Builder
		b.WriteString(`{"model":"m","messages":[`)
		for i := range 400_000 {
			if i > 0 {
				b.WriteByte(',')
			}
			b.WriteString(elem)
		}
		b.WriteString("]}")
		body := []byte(b.String())
		p := testParser()
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		_, err := p.parse(EndpointChatCompletions, body)
		runtime.ReadMemStats(&after)
		if err == nil {
			t.Fatalf("%s: accepted", elem)
		}
		if n := after.TotalAlloc - before.TotalAlloc; n > uint64(len(body)) {
			t.Errorf("%s × 400,000 (%d bytes): %d bytes allocated", elem, len(body), n)
		}
	}
}

// TestEachAPIReadsItsOwnFields: a field of another API is ignored, as the
// engine ignores it: max_completion_tokens and messages in a completion,
// max_output_tokens in a chat, max_tokens in a Responses request.
func TestEachAPIReadsItsOwnFields(t *testing.T) {
	p := testParser()
	for _, tc := range []struct {
		ep        Endpoint
		body      string
		maxTokens int
	}{
		{EndpointCompletions, `{"prompt":"p","max_tokens":5,"max_completion_tokens":100000,"messages":42}`, 5},
		{EndpointChatCompletions, `{"messages":[{"role":"user","content":"hi"}],"max_tokens":5,"max_output_tokens":"x","input":3}`, 5},
		{EndpointResponses, `{"input":"hi","max_tokens":"x","max_completion_tokens":9,"max_output_tokens":7,"messages":1}`, 7},
	} {
		req, err := p.parse(tc.ep, []byte(tc.body))
		if err != nil || req.MaxTokens != tc.maxTokens {
			t.Errorf("%s %s: %v, max tokens %v", tc.ep, tc.body, err, req)
		}
	}
}

func TestStoredResponseID(t *testing.T) {
	for path, want := range map[string]string{
		"/v1/responses/resp_1":                      "resp_1",
		"/v1/responses/resp_1/cancel":               "resp_1",
		"/v1/responses/resp_1/input_items":          "resp_1",
		"/openai/v1/responses/resp_2":               "resp_2",
		"/v1/responses":                             "",
		"/v1/responses/":                            "",
		"/v1/chat/completions":                      "",
		"/v1/responses/" + strings.Repeat("r", 300): "",
	} {
		if got := storedResponseID(path); got != want {
			t.Errorf("%s: %q, want %q", path, got, want)
		}
	}
}

// TestToolCallsAreThePrompt: an agent's turns carry their tool calls,
// their ids and names outside the content; the chat template renders
// them, so they are hashed and counted. Two conversations that differ
// only in their tool calls are different prefixes, and a message without
// them hashes as it always did (its role and content).
func TestToolCallsAreThePrompt(t *testing.T) {
	p := testParser()
	call := func(city string) string {
		return `{"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function","function":{"name":"get_weather","arguments":"{\"city\":\"` + city + `\"}"}}]}`
	}
	body := func(city string) []byte {
		return []byte(`{"model":"m","messages":[{"role":"user","content":"What is the weather?"},` + call(city) +
			`,{"role":"tool","tool_call_id":"call_1","content":"sunny"}]}`)
	}
	paris, err := p.parse(EndpointChatCompletions, body("Paris"))
	if err != nil {
		t.Fatal(err)
	}
	rome, _ := p.parse(EndpointChatCompletions, body("Rome"))
	if slices.Equal(paris.Hashes, rome.Hashes) {
		t.Fatal("conversations differing in their tool calls hash alike")
	}
	if want := len(call("Paris")) - len(`{"role":"assistant","content":null,}`); paris.PromptBytes < want {
		t.Fatalf("counted %d bytes, less than the tool call's %d", paris.PromptBytes, want)
	}
	// Without the extra fields: the canonical role and content alone.
	plain, _ := p.parse(EndpointChatCompletions, []byte(`{"model":"m","messages":[{"role":"user","content":"`+strings.Repeat("abcd", 20)+`"}]}`))
	var c prefixindex.Blocks
	c.Reset(p.hasher, nil)
	c.WriteString("user" + sepField + strings.Repeat("abcd", 20) + sepMessage)
	if !slices.Equal(plain.Hashes, c.Chain(prefixindex.Seed("m", "", ""))) {
		t.Fatal("a plain message no longer hashes as its role and content")
	}
}

// TestMediaIsNotText: an image's bytes (base64 in a data URL) are hashed,
// so the same image is the same prefix, but not counted as prompt text:
// a photo must not make a request look too long, nor teach the model's
// bytes per token (the engine's count includes the image's tokens).
func TestMediaIsNotText(t *testing.T) {
	p := testParser()
	image := func(data string) []byte {
		return []byte(`{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"What is in the picture?"},` +
			`{"type":"image_url","image_url":{"url":"data:image/jpeg;base64,` + data + `"}}]}]}`)
	}
	a, err := p.parse(EndpointChatCompletions, image(strings.Repeat("QUJD", 125_000)))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := p.parse(EndpointChatCompletions, image(strings.Repeat("QUJE", 125_000)))
	if !a.Media || a.PromptBytes > 200 || a.PromptTokens > 50 {
		t.Fatalf("a 500 KB image counted: %+v", a)
	}
	if slices.Equal(a.Hashes, b.Hashes) {
		t.Fatal("two images hash alike")
	}
	resp, err := p.parse(EndpointResponses, []byte(`{"model":"m","input":[{"role":"user","content":[{"type":"input_text","text":"x"},`+
		`{"type":"input_image","image_url":"data:image/png;base64,`+strings.Repeat("QUJD", 50_000)+`"}]}]}`))
	if err != nil || !resp.Media || resp.PromptBytes > 100 {
		t.Fatalf("Responses input_image: %+v, %v", resp, err)
	}
	text, _ := p.parse(EndpointChatCompletions, []byte(`{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"`+strings.Repeat("x", 400)+`"}]}]}`))
	if text.Media || text.PromptBytes < 400 {
		t.Fatalf("text parts: %+v", text)
	}
}

// TestPartsCountTheirText: a content-part array counts as the text in
// its parts, escapes decoded, as the same text sent as a string does: the
// parts' keys, types and punctuation and the whitespace between them are
// not the engine's text (100,000 empty parts were 2.6 MB of text).
func TestPartsCountTheirText(t *testing.T) {
	p := testParser()
	for _, c := range []struct {
		endpoint      Endpoint
		parts, string string
	}{
		{EndpointChatCompletions, `[{"type":"text","text":"Hello, "} , "w\u00f6rld",` + "\n" + `{"type":"refusal","refusal":"!"}]`, `"Hello, w\u00f6rld!"`},
		{EndpointChatCompletions, `[` + strings.Repeat(`{"type":"text","text":""},`, 99_999) + `{"type":"text","text":""}]`, `""`},
		{EndpointResponses, `[{"type":"input_text","text":"Hello, "},{"type":"output_text","text":"world","annotations":[]}]`, `"Hello, world"`},
	} {
		body := map[Endpoint]string{
			EndpointChatCompletions: `{"model":"m","messages":[{"role":"user","content":%s}]}`,
			EndpointResponses:       `{"model":"m","input":[{"role":"user","content":%s}]}`,
		}[c.endpoint]
		parts, err := p.parse(c.endpoint, []byte(fmt.Sprintf(body, c.parts)))
		if err != nil {
			t.Fatal(err)
		}
		text, err := p.parse(c.endpoint, []byte(fmt.Sprintf(body, c.string)))
		if err != nil {
			t.Fatal(err)
		}
		if parts.PromptBytes != text.PromptBytes || parts.PromptTokens != text.PromptTokens || parts.Media {
			t.Errorf("%s %.80s: %d bytes, %d tokens (media %v); as a string %d, %d", c.endpoint, c.parts, parts.PromptBytes, parts.PromptTokens, parts.Media, text.PromptBytes, text.PromptTokens)
		}
	}
}

// TestBatchLongestPrompt: a batch of completions prompts runs as one
// sequence each: the longest is what must fit.
func TestBatchLongestPrompt(t *testing.T) {
	p := testParser()
	for body, want := range map[string]int{
		`{"prompt":[[1,2,3],[4,5,6,7,8],[9]]}`: 5,
		`{"prompt":["aaaa","aaaaaaaaaaaa"]}`:   3,
		`{"prompt":[[1,2,3]]}`:                 0,
		`{"prompt":"aaaaaaaa"}`:                0,
	} {
		req, err := p.parse(EndpointCompletions, []byte(body))
		if err != nil || req.LongestPromptTokens != want {
			t.Errorf("%s: longest %d, want %d (%v)", body, req.LongestPromptTokens, want, err)
		}
	}
}

// TestSequences: the engine generates n choices for each prompt of a
// batch (chat and completions; the Responses API has no n), each with
// output of its own.
func TestSequences(t *testing.T) {
	p := testParser()
	for _, c := range []struct {
		endpoint Endpoint
		body     string
		want     int
	}{
		{EndpointChatCompletions, `{"messages":[{"role":"user","content":"x"}]}`, 1},
		{EndpointChatCompletions, `{"messages":[{"role":"user","content":"x"}],"n":4}`, 4},
		{EndpointChatCompletions, `{"messages":[{"role":"user","content":"x"}],"n":"3"}`, 3},
		{EndpointChatCompletions, `{"messages":[{"role":"user","content":"x"}],"n":null}`, 1},
		{EndpointChatCompletions, `{"messages":[{"role":"user","content":"x"}],"n":0}`, 1},
		{EndpointCompletions, `{"prompt":["a","b","c"],"n":2}`, 6},
		{EndpointCompletions, `{"prompt":[[1],[2]]}`, 2},
		{EndpointCompletions, `{"prompt":"a","n":1e9}`, maxSequences},
		{EndpointResponses, `{"input":"x","n":4}`, 1},
	} {
		req, err := p.parse(c.endpoint, []byte(c.body))
		if err != nil || req.Sequences != c.want {
			t.Errorf("%s: sequences %v, want %d (%v)", c.body, req, c.want, err)
		}
	}
	if _, err := p.parse(EndpointChatCompletions, []byte(`{"messages":[{"role":"user","content":"x"}],"n":"many"}`)); err == nil ||
		err.Error() != "invalid request: n must be an integer" {
		t.Errorf("n not a number: %v", err)
	}
	// An integer past int64 (or, written with an exponent, past 2^53) is
	// one all the same: out of range, not "must be an integer".
	for _, v := range []string{`99999999999999999999999`, `"99999999999999999999999"`, `1e300`, `-1e400`} {
		if _, err := p.parse(EndpointCompletions, []byte(`{"prompt":"x","max_tokens":`+v+`}`)); err == nil ||
			err.Error() != "invalid request: max_tokens is out of range" {
			t.Errorf("max_tokens %s: %v", v, err)
		}
	}
}

// TestLaxNumbersAsVLLMReadsThem: vLLM's request models (pydantic, lax
// mode) take an integral float or an integer string for max_tokens and
// "true" or 1 for stream; a Python client sending max_tokens=1e3 or
// 2048.0 works against vLLM, so the router takes them too (leniently:
// the engine has the last word), and a UTF-8 byte order mark before the
// body, which Python's json.loads skips. A fraction or a word is refused.
func TestLaxNumbersAsVLLMReadsThem(t *testing.T) {
	p := testParser()
	for body, want := range map[string]int{
		`{"prompt":"x","max_tokens":16.0}`: 16, `{"prompt":"x","max_tokens":1e3}`: 1000, `{"prompt":"x","max_tokens":"16"}`: 16,
		`{"prompt":"x","max_tokens":"\u0031\u0036"}`: 16, `{"prompt":"x","max_tokens":-0.0}`: 0, `{"prompt":"x","max_tokens":" 16.0 "}`: 16, `{"prompt":"x","max_tokens":true}`: 1,
	} {
		req, err := p.parse(EndpointCompletions, []byte(body))
		if err != nil || req.MaxTokens != want {
			t.Errorf("%s: %+v, %v; want max_tokens %d", body, req, err, want)
		}
	}
	for body, want := range map[string]bool{
		`{"prompt":"x","stream":"true"}`: true, `{"prompt":"x","stream":"Yes"}`: true, `{"prompt":"x","stream":1}`: true,
		`{"prompt":"x","stream":"off"}`: false, `{"prompt":"x","stream":0}`: false, `{"prompt":"x","stream":true,"stream":null}`: false, // the last value, as Python's json.loads has it
	} {
		req, err := p.parse(EndpointCompletions, []byte(body))
		if err != nil || req.Stream != want {
			t.Errorf("%s: %+v, %v; want stream %v", body, req, err, want)
		}
	}
	// store is read as leniently, and a value vLLM refuses is no error
	// here: only a surely-off store keeps a home from being remembered.
	for body, want := range map[string]bool{
		`{"input":"x","store":false}`: true, `{"input":"x","store":"false"}`: true, `{"input":"x","store":"Off"}`: true,
		`{"input":"x","store":0}`: true, `{"input":"x","store":"no","store":null}`: false, `{"input":"x","store":"maybe"}`: false,
		`{"input":"x","store":1}`: false, `{"input":"x","store":2}`: false, `{"input":"x","store":"true"}`: false,
	} {
		req, err := p.parse(EndpointResponses, []byte(body))
		if err != nil || req.NoStore != want {
			t.Errorf("%s: %+v, %v; want NoStore %v", body, req, err, want)
		}
	}
	if req, err := p.parse(EndpointCompletions, []byte("\xef\xbb\xbf"+`{"prompt":"x","max_tokens":3}`)); err != nil || req.MaxTokens != 3 {
		t.Errorf("a body after a byte order mark: %+v, %v", req, err)
	}
	for _, body := range []string{
		`{"prompt":"x","max_tokens":16.5}`, `{"prompt":"x","max_tokens":"16.5"}`, `{"prompt":"x","max_tokens":"sixteen"}`,
		`{"prompt":"x","max_tokens":1e30}`, `{"prompt":"x","stream":"maybe"}`, `{"prompt":"x","stream":2}`,
	} {
		if _, err := p.parse(EndpointCompletions, []byte(body)); err == nil {
			t.Errorf("%s accepted", body)
		}
	}
}

// TestKeysMatchExactly: keys match fields exactly, as vLLM's request
// models (pydantic) match them: a key that differs in case (or folds to
// a field's name, as encoding/json would take it) is another, unknown,
// field, whatever its value.
func TestKeysMatchExactly(t *testing.T) {
	p := testParser()
	chat := `{"model":"m","messages":[{"role":"user","content":"hi"}]`
	plain, err := p.parse(EndpointChatCompletions, []byte(chat+`}`))
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		ep   Endpoint
		body string
		want func(*Request) bool
	}{
		{EndpointCompletions, `{"model":"m","prompt":"hi","Model":"gpt-4o"}`, func(r *Request) bool { return r.Model == "m" }},
		{EndpointCompletions, `{"model":"m","prompt":"hi","max_tokens":2,"Max_Tokens":999999}`, func(r *Request) bool { return r.MaxTokens == 2 }},
		{EndpointCompletions, `{"model":"m","prompt":"hi","max_to\u212aens":5}`, func(r *Request) bool { return r.MaxTokens == 0 }},
		{EndpointChatCompletions, chat + `,"Messages":{"a":1}}`, func(r *Request) bool { return slices.Equal(r.Hashes, plain.Hashes) }},
		{EndpointChatCompletions, `{"model":"m","messages":[{"role":"user","content":"hi","Content":5}]}`, func(r *Request) bool { return slices.Equal(r.Hashes, plain.Hashes) }},
	} {
		req, err := p.parse(tc.ep, []byte(tc.body))
		if err != nil || !tc.want(req) {
			t.Errorf("%s: %+v %v", tc.body, req, err)
		}
	}
	if _, err := p.parse(EndpointChatCompletions, []byte(`{"Model":"m","Messages":[{"role":"user","content":"hi"}]}`)); err == nil {
		t.Error("Messages taken for messages")
	}
}

// TestCacheSaltIsAnotherPrefix: vLLM's cache_salt keeps a salted prompt's
// prefix cache apart (the engine's first block takes the salt): the router
// hashes it as another prefix, the same for the same salt, and an
// unsalted prompt as it always did. An empty salt is vLLM's 400, and one
// that is not a string the API's.
func TestCacheSaltIsAnotherPrefix(t *testing.T) {
	p := testParser()
	hashesOf := func(ep Endpoint, body string) []uint64 {
		t.Helper()
		req, err := p.parse(ep, []byte(body))
		if err != nil {
			t.Fatalf("%s: %v", body, err)
		}
		return req.Hashes
	}
	prompt := strings.Repeat("a shared system prompt ", 100)
	for _, ep := range []Endpoint{EndpointCompletions, EndpointChatCompletions, EndpointResponses} {
		body := func(salt string) string {
			var b string
			switch ep {
			case EndpointCompletions:
				b = `{"model":"m","prompt":"` + prompt + `"`
			case EndpointChatCompletions:
				b = `{"model":"m","messages":[{"role":"user","content":"` + prompt + `"}]`
			default:
				b = `{"model":"m","input":"` + prompt + `"`
			}
			if salt != "" {
				b += `,"cache_salt":` + salt
			}
			return b + "}"
		}
		plain, nulled := hashesOf(ep, body("")), hashesOf(ep, body("null"))
		a, a2, b := hashesOf(ep, body(`"tenant-a"`)), hashesOf(ep, body(`"tenant-a"`)), hashesOf(ep, body(`"tenant-b"`))
		if len(plain) == 0 || !slices.Equal(plain, nulled) || !slices.Equal(a, a2) ||
			a[0] == plain[0] || b[0] == plain[0] || a[0] == b[0] {
			t.Fatalf("%v: the salted and unsalted prompts' first blocks: plain %x, null %x, a %x, a again %x, b %x", ep, plain[0], nulled[0], a[0], a2[0], b[0])
		}
		for _, bad := range []string{`""`, `5`} {
			_, err := p.parse(ep, []byte(body(bad)))
			var br errBadRequest
			if !errors.As(err, &br) || br.param != "cache_salt" && !strings.Contains(err.Error(), "cache_salt") {
				t.Fatalf("%v: cache_salt %s: %v", ep, bad, err)
			}
		}
	}
}

// asciiJSON is s as a JSON string the way Python's json.dumps writes it
// by default (ensure_ascii: every non-ASCII character escaped, a pair of
// escapes beyond the BMP), as the requests library and the OpenAI Python
// client before httpx 0.28 send it.
func asciiJSON(s string) string {
	var b strings.Builder
	b.WriteByte('"')
	for _, r := range s {
		switch {
		case r == '"' || r == '\\':
			b.WriteByte('\\')
			b.WriteRune(r)
		case r == '\n':
			b.WriteString(`\n`)
		case r < 0x20:
			fmt.Fprintf(&b, `\u%04x`, r)
		case r < utf8.RuneSelf:
			b.WriteRune(r)
		default:
			r1, r2 := utf16.EncodeRune(r)
			if r1 == utf8.RuneError {
				r1 = r
			} else {
				fmt.Fprintf(&b, `\u%04x`, r1)
				r1 = r2
			}
			fmt.Fprintf(&b, `\u%04x`, r1)
		}
	}
	b.WriteByte('"')
	return b.String()
}

// TestPromptCountsTextNotEscapes: the prompt's size is its text's, as
// the engine reads it, however the client escaped it: Python's default
// escapes every non-ASCII character (six bytes for one CJK character, of
// three), Go's encoding/json escapes <, > and & (six bytes for one),
// every encoder a newline or a quote (two for one). Counted as sent, CJK
// text from a Python client looked twice its length, and a prompt within
// the context was refused as too long.
func TestPromptCountsTextNotEscapes(t *testing.T) {
	p := testParser()
	text := strings.Repeat("路由器把请求发给最快的副本。<b>\"quoted\" & done</b>\n\tnext 😀 é\\\n", 40)
	plain, err := json.Marshal(text)
	if err != nil {
		t.Fatal(err)
	}
	var unescaped bytes.Buffer
	enc := json.NewEncoder(&unescaped)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(text); err != nil {
		t.Fatal(err)
	}
	forms := map[string]string{
		"Python's ensure_ascii": asciiJSON(text),
		"Go's HTML escapes":     string(plain),
		"only what JSON needs":  strings.TrimSpace(unescaped.String()),
	}
	// The size of each shape's text, alike whatever the escapes: the
	// role and the separators the canonical prompt adds are counted too.
	bodies := []struct {
		endpoint Endpoint
		body     func(s string) string
		want     int
	}{
		{EndpointChatCompletions, func(s string) string { return `{"model":"m","messages":[{"role":"user","content":` + s + `}]}` }, 0},
		{EndpointChatCompletions, func(s string) string {
			return `{"model":"m","messages":[{"role":"tool","tool_call_id":` + s + `,"content":[{"type":"text","text":` + s + `}]}],"tools":[{"d":` + s + `}]}`
		}, 0},
		{EndpointCompletions, func(s string) string { return `{"model":"m","prompt":` + s + `}` }, len(text)},
		{EndpointCompletions, func(s string) string { return `{"model":"m","prompt":[` + s + `,` + s + `]}` }, 0},
		{EndpointResponses, func(s string) string { return `{"model":"m","instructions":` + s + `,"input":` + s + `}` }, 0},
		{EndpointResponses, func(s string) string {
			return `{"model":"m","input":[{"role":"user","content":` + s + `},{"type":"function_call_output","output":` + s + `}]}`
		}, 0},
	}
	for i, b := range bodies {
		var sizes []string
		want := b.want
		for name, s := range forms {
			req, err := p.parse(b.endpoint, []byte(b.body(s)))
			if err != nil {
				t.Fatalf("shape %d, %s: %v", i, name, err)
			}
			if want == 0 {
				want = req.PromptBytes
			}
			if req.PromptBytes != want || req.PromptTokens != p.tokens(want) {
				sizes = append(sizes, fmt.Sprintf("%s: %d bytes, %d tokens", name, req.PromptBytes, req.PromptTokens))
			}
		}
		if len(sizes) > 0 {
			t.Errorf("shape %d: want %d bytes, got %s", i, want, strings.Join(sizes, "; "))
		}
		if want < len(text) {
			t.Errorf("shape %d: %d bytes, less than the text's %d", i, want, len(text))
		}
	}
	// The longest prompt of a batch is counted as text too.
	req, err := p.parse(EndpointCompletions, []byte(`{"model":"m","prompt":["a",`+asciiJSON(text)+`]}`))
	if err != nil || req.LongestPromptTokens != p.tokens(len(text)) {
		t.Fatalf("batch: longest %d, want %d (%v)", req.LongestPromptTokens, p.tokens(len(text)), err)
	}
	// A media part's escapes are not taken from the text twice.
	image := func(url string) []byte {
		return []byte(`{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"abc"},` +
			`{"type":"image_url","image_url":{"url":"` + url + strings.Repeat("QUJD", 100) + `"}}]}]}`)
	}
	a, err := p.parse(EndpointChatCompletions, image(`data:image\/png;base64,`))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := p.parse(EndpointChatCompletions, image(`data:image/png;base64,`))
	if !a.Media || a.PromptBytes != b.PromptBytes {
		t.Fatalf("with an escaped image URL: %d bytes, unescaped %d", a.PromptBytes, b.PromptBytes)
	}
}

// TestFieldSwitches: the switches that look up the keys of a body, of a
// chat message or input item, and of a content part find the fields of
// topFields, msgFields (and itemFields) and partFields by their names,
// exactly, and no other key.
func TestFieldSwitches(t *testing.T) {
	for _, tc := range []struct {
		field func([]byte) int
		names []string
	}{
		{topField, topFields[:]},
		{msgField, msgFields[:]},
		{msgField, itemFields[:]},
		{partField, partFields[:]},
	} {
		for i, name := range tc.names {
			if got := tc.field([]byte(name)); got != i {
				t.Errorf("%q: field %d, want %d", name, got, i)
			}
		}
	}
	for _, key := range []string{"", "Model", "modell", "mode", "N", "nn", "max_token", "max_tokens ", "user", "tool", "background\x00"} {
		if got := topField([]byte(key)); got != fieldOther {
			t.Errorf("topField(%q) = %d, want fieldOther", key, got)
		}
	}
	for _, key := range []string{"", "Role", "roles", "rol", "Content", "tool_call", "tool_calls ", "text", "refusal"} {
		if got := msgField([]byte(key)); got != fieldOther {
			t.Errorf("msgField(%q) = %d, want fieldOther", key, got)
		}
	}
	for _, key := range []string{"", "Type", "types", "texts", "Text", "role", "content", "refusal\x00"} {
		if got := partField([]byte(key)); got != fieldOther {
			t.Errorf("partField(%q) = %d, want fieldOther", key, got)
		}
	}
}

// TestSeedCache: a parser's cached seeds are prefixindex.Seed's, for models
// alternating and more than it keeps, and a request with a cache_salt is
// seeded with its own salt; alternating among a few models allocates
// nothing.
func TestSeedCache(t *testing.T) {
	p := newParser(prefixindex.Hasher{BlockTokens: 4, BytesPerToken: 4}, 4, "tenant")
	models := []string{"a", "b", "a", "c", "d", "e", "f", "a", "b", "g", "a"}
	for _, m := range models {
		if got, want := p.seeds.of(m), prefixindex.Seed(m, "", "tenant"); got != want {
			t.Fatalf("seed of %q = %x, want %x", m, got, want)
		}
	}
	for _, tc := range []struct{ body, salt string }{
		{`{"model":"a","prompt":"abcdabcd"}`, "tenant"},
		{`{"model":"a","prompt":"abcdabcd","cache_salt":"x"}`, saltWith("tenant", "x")},
	} {
		req := new(Request)
		if err := p.parseInto(req, EndpointCompletions, []byte(tc.body)); err != nil {
			t.Fatal(err)
		}
		want := slices.Clone(req.Hashes)
		prefixindex.Chain(prefixindex.Seed("a", "", tc.salt), want)
		req.seed("a")
		if !slices.Equal(req.Hashes, want) {
			t.Errorf("%s: hashes %x, want %x", tc.body, req.Hashes, want)
		}
	}
	alternate := []string{"a", "b", "c"}
	for _, m := range alternate {
		p.seeds.of(m)
	}
	i := 0
	if n := testing.AllocsPerRun(100, func() { p.seeds.of(alternate[i%len(alternate)]); i++ }); n != 0 {
		t.Errorf("alternating models: %v allocations a seed, want 0", n)
	}
}
