package caddyllm

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/llmaffinity/caddy-llm-affinity/prefixindex"
)

func testParser() *parser {
	return &parser{hasher: prefixindex.Hasher{BlockTokens: 4, BytesPerToken: 4}, bytesPerToken: 4}
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
		{EndpointCompletions, `{"prompt": [{}]}`},
		{EndpointCompletions, `{"prompt": [[1,2],["a"]]}`},
		{EndpointCompletions, `{"prompt": [[1,2],"a"]}`},
		{EndpointCompletions, `{"max_tokens": "x"}`},
		{EndpointChatCompletions, `{"model":"m"}`},
		{EndpointChatCompletions, `{"messages": "x"}`},
		{EndpointChatCompletions, `{"messages": [{"content": "no role"}]}`},
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
		if req.PromptTokens < 0 || len(req.Hashes) > req.PromptTokens/4+1 {
			t.Fatalf("%d tokens but %d blocks", req.PromptTokens, len(req.Hashes))
		}
	})
}

func BenchmarkHandlerParse(b *testing.B) {
	p := &parser{hasher: prefixindex.Hasher{}, bytesPerToken: 4}
	var msgs [][2]string
	for len(msgs) < 64 {
		msgs = append(msgs, [2]string{"user", strings.Repeat("lorem ipsum dolor sit amet ", 38)}, [2]string{"assistant", "ok"})
	}
	body := chatBody(b, msgs...)
	b.Run("chat-64KiB", func(b *testing.B) {
		b.SetBytes(int64(len(body)))
		b.ReportAllocs()
		for b.Loop() {
			if _, err := p.parse(EndpointChatCompletions, body); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// TestTypeErrorsInTheAPIsWords: a wrong field type is named as the API
// documents it, never as a Go type.
func TestTypeErrorsInTheAPIsWords(t *testing.T) {
	p := testParser()
	for _, tc := range []struct {
		ep         Endpoint
		body, want string
	}{
		{EndpointChatCompletions, `{"messages":"x"}`, "messages must be an array"},
		{EndpointChatCompletions, `{"messages":["x"]}`, "messages must be an object"},
		{EndpointChatCompletions, `{"messages":[{"role":7}]}`, "messages.role must be a string"},
		{EndpointCompletions, `{"model":3}`, "model must be a string"},
		{EndpointCompletions, `{"max_tokens":"x"}`, "max_tokens must be an integer"},
		{EndpointCompletions, `{"max_tokens":1.5}`, "max_tokens must be an integer"},
		{EndpointCompletions, `{"stream":"yes"}`, "stream must be a boolean"},
	} {
		_, err := p.parse(tc.ep, []byte(tc.body))
		if err == nil || !strings.Contains(err.Error(), tc.want) || strings.Contains(err.Error(), "caddyllm") || strings.Contains(err.Error(), "int") && !strings.Contains(tc.want, "int") {
			t.Errorf("%s: %v, want %q", tc.body, err, tc.want)
		}
	}
}
