package kvsim

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// tokenized is a /tokenize answer.
type tokenized struct {
	Count       int       `json:"count"`
	MaxModelLen int       `json:"max_model_len"`
	Tokens      []int64   `json:"tokens"`
	TokenStrs   *[]string `json:"token_strs"`
}

// tokenize POSTs body to url's /tokenize, which must answer 200.
func tokenize(t *testing.T, url, body string) tokenized {
	t.Helper()
	resp, out := post(t, url+"/tokenize", body)
	var tk tokenized
	if resp.StatusCode != 200 || json.Unmarshal([]byte(out), &tk) != nil {
		t.Fatalf("tokenize %s: %d %s", body, resp.StatusCode, out)
	}
	return tk
}

// detokenize POSTs ids to url's /detokenize, which must answer 200, and
// returns the prompt.
func detokenize(t *testing.T, url string, ids []int64) string {
	t.Helper()
	body, _ := json.Marshal(map[string]any{"tokens": ids})
	resp, out := post(t, url+"/detokenize", string(body))
	var d struct{ Prompt *string }
	if resp.StatusCode != 200 || json.Unmarshal([]byte(out), &d) != nil || d.Prompt == nil {
		t.Fatalf("detokenize %s: %d %s", body, resp.StatusCode, out)
	}
	return *d.Prompt
}

// generated is a generation's text and usage.
type generated struct {
	text string
	u    usage
}

// generate POSTs body (a JSON object, as text) to path with max_tokens 4
// added, which must answer 200.
func generate(t *testing.T, url, path, body string) generated {
	t.Helper()
	resp, out := post(t, url+path, strings.TrimSuffix(body, "}")+`,"max_tokens":4}`)
	var r struct {
		Choices []struct {
			Text    string
			Message struct{ Content string }
		}
		Usage usage
	}
	if resp.StatusCode != 200 || json.Unmarshal([]byte(out), &r) != nil || len(r.Choices) != 1 {
		t.Fatalf("%s %s: %d %s", path, body, resp.StatusCode, out)
	}
	return generated{r.Choices[0].Text + r.Choices[0].Message.Content, r.Usage}
}

// TestTokenizeCountsWhatGenerationDoes: /tokenize's count, in both forms,
// is the usage.prompt_tokens of a generation of the same body (the chat
// form rendered by the chat completion's own code: tools, names, content
// parts, add_generation_prompt, continue_final_message); its tokens are
// count many, max_model_len is the configuration's, and token_strs null
// unless asked for.
func TestTokenizeCountsWhatGenerationDoes(t *testing.T) {
	for _, bpt := range []int{1, 3, 4, 7} {
		_, srv := newTestServer(t, Config{BytesPerToken: bpt, MaxModelLen: 4096})
		for _, tc := range []struct{ path, body string }{
			{"/v1/completions", `{"prompt":"Hello there, how are you doing today?"}`},
			{"/v1/completions", `{"model":"` + DefaultModel + `","prompt":"héllo ✓ 🙂 \"quoted\"\nline","add_special_tokens":true}`},
			{"/v1/chat/completions", `{"messages":[{"role":"user","content":"hi"}]}`},
			{"/v1/chat/completions", `{"messages":[{"role":"system","content":"Be brief."},{"role":"user","name":"ann","content":[{"type":"text","text":"look"},{"type":"image_url","image_url":{"url":"x"}}]}],` +
				`"tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object"}}}]}`},
			{"/v1/chat/completions", `{"messages":[{"role":"user","content":"hi"}],"add_generation_prompt":false}`},
			{"/v1/chat/completions", `{"messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"Hello, I"}],"add_generation_prompt":false,"continue_final_message":true}`},
			{"/v1/chat/completions", `{"messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{}"}}]},{"role":"tool","tool_call_id":"c1","content":"42"}]}`},
		} {
			tk := tokenize(t, srv.URL, tc.body)
			g := generate(t, srv.URL, tc.path, tc.body)
			if tk.Count != g.u.PromptTokens || len(tk.Tokens) != tk.Count || tk.Count == 0 {
				t.Errorf("%d bytes a token, %s: count %d, %d tokens; the generation's prompt_tokens %d",
					bpt, tc.body, tk.Count, len(tk.Tokens), g.u.PromptTokens)
			}
			if tk.MaxModelLen != 4096 || tk.TokenStrs != nil {
				t.Errorf("%s: max_model_len %d, token_strs %v", tc.body, tk.MaxModelLen, tk.TokenStrs)
			}
		}
	}
}

// TestTokenizeAnswersAsVLLM: the answer's fields in vLLM's order, and
// token_strs when asked for, one per token, byte-level.
func TestTokenizeAnswersAsVLLM(t *testing.T) {
	_, srv := newTestServer(t, Config{MaxModelLen: 2048})
	resp, out := post(t, srv.URL+"/tokenize", `{"prompt":"Hello world","return_token_strs":true}`)
	// "rld", a last token of 3 bytes, is 2^32 + 256 + 256^2 + its bytes.
	want := `{"count":3,"max_model_len":2048,"tokens":[1819043144,1870078063,4301614450],"token_strs":["Hell","oĠwo","rld"]}` + "\n"
	if resp.StatusCode != 200 || out != want || resp.Header.Get("Content-Type") != "application/json" {
		t.Fatalf("%d %q, want %q", resp.StatusCode, out, want)
	}
	resp, out = post(t, srv.URL+"/tokenize", `{"prompt":""}`)
	if want := `{"count":0,"max_model_len":2048,"tokens":[],"token_strs":null}` + "\n"; resp.StatusCode != 200 || out != want {
		t.Fatalf("an empty prompt: %d %q, want %q", resp.StatusCode, out, want)
	}
}

// TestDetokenizeInvertsTokenize: a text tokenized on one replica is
// detokenized to itself on another of the same bytes_per_token (the ids
// encode the tokens: nothing is shared); a chat's ids to its rendered
// template.
func TestDetokenizeInvertsTokenize(t *testing.T) {
	texts := []string{"Hello there", "héllo wörld ✓ 🙂, a text whose length is no multiple of any token's", "x", "\u0000 nul and \"quotes\"\n"}
	for _, bpt := range []int{1, 2, 4, 5, 7} {
		_, a := newTestServer(t, Config{BytesPerToken: bpt})
		_, b := newTestServer(t, Config{BytesPerToken: bpt})
		for _, text := range texts {
			body, _ := json.Marshal(map[string]string{"prompt": text})
			if got := detokenize(t, b.URL, tokenize(t, a.URL, string(body)).Tokens); got != text {
				t.Errorf("%d bytes a token: %q detokenized as %q", bpt, text, got)
			}
		}
		chat := tokenize(t, a.URL, `{"messages":[{"role":"user","content":"hi"}]}`)
		if got, want := detokenize(t, b.URL, chat.Tokens), "<|start|>user\nhi<|end|>\n<|start|>assistant\n"; got != want {
			t.Errorf("%d bytes a token: the chat detokenized as %q, want %q", bpt, got, want)
		}
	}
}

// TestTokenizedIDsAreTheTextsPrompt: a text's ids sent back as a prompt
// are the same context: the same count, the same prefix-cache blocks, the
// same generated text.
func TestTokenizedIDsAreTheTextsPrompt(t *testing.T) {
	_, srv := newTestServer(t, Config{BlockSize: 4})
	text := strings.Repeat("A long shared prefix, é included. ", 8) + "tail"
	body, _ := json.Marshal(map[string]string{"prompt": text})
	ids, _ := json.Marshal(map[string]any{"prompt": tokenize(t, srv.URL, string(body)).Tokens})
	generate(t, srv.URL, "/v1/completions", string(body)) // fills the cache
	fromText := generate(t, srv.URL, "/v1/completions", string(body))
	fromIDs := generate(t, srv.URL, "/v1/completions", string(ids))
	if fromIDs != fromText || fromText.u.PromptTokensDetails.CachedTokens == 0 {
		t.Fatalf("from the ids %+v, from the text %+v", fromIDs, fromText)
	}
}

// TestTokenizeBeyondMaxModelLen: as vLLM, /tokenize counts a text longer
// than max_model_len, which a generation refuses.
func TestTokenizeBeyondMaxModelLen(t *testing.T) {
	_, srv := newTestServer(t, Config{MaxModelLen: 16})
	body := `{"prompt":"` + strings.Repeat("abcd", 40) + `"}`
	if tk := tokenize(t, srv.URL, body); tk.Count != 40 || tk.MaxModelLen != 16 {
		t.Fatalf("count %d, max_model_len %d", tk.Count, tk.MaxModelLen)
	}
	if resp, out := post(t, srv.URL+"/v1/completions", body); resp.StatusCode != 400 {
		t.Fatalf("the generation: %d %s", resp.StatusCode, out)
	}
}

// TestTokenizeFormAsPydantic: vLLM's union of the two forms, validated
// as pydantic's smart mode does: the form the body is valid as; valid as
// both, the one with more of its fields given, the completion on a tie.
func TestTokenizeFormAsPydantic(t *testing.T) {
	_, srv := newTestServer(t, Config{})
	chat := tokenize(t, srv.URL, `{"messages":[{"role":"user","content":"hi"}]}`).Count
	for body, want := range map[string]int{
		`{"prompt":"abcdefgh","messages":[{"role":"user","content":"hi"}]}`:                                 2,
		`{"prompt":5,"messages":[{"role":"user","content":"hi"}]}`:                                          chat,
		`{"prompt":"abcdefgh","messages":{}}`:                                                               2,
		`{"prompt":"abcdefgh","messages":[{"role":"user","content":"hi"}],"add_generation_prompt":true}`:    chat,
		`{"prompt":"abcdefgh","messages":[{"role":"user","content":"hi"}],"return_token_strs":"yes"}`:       2,
		`{"prompt":"abcdefgh","return_token_strs":null,"add_special_tokens":false,"max_tokens":"nonsense"}`: 2,
	} {
		if got := tokenize(t, srv.URL, body).Count; got != want {
			t.Errorf("%s: count %d, want %d", body, got, want)
		}
	}
}

// TestTokenizationErrorsAsVLLM: an unknown model is 404 with the body a
// generation gets; a body neither form, malformed or with bad fields
// 400; another media type and a body too large as generation answers
// them (a generation request too, checked here against the same cap); a
// known adapter is served; bytes_per_token 8 has no ids (501).
func TestTokenizationErrorsAsVLLM(t *testing.T) {
	sim, err := NewServer(ServerConfig{Engine: Config{Adapters: []string{"sql-lora"}}})
	if err != nil {
		t.Fatal(err)
	}
	sim.maxBody = 1 << 10 // maxBodyBytes, 64 MB, takes seconds to send under -race
	srv := httptest.NewServer(sim)
	t.Cleanup(func() {
		srv.Close()
		_ = sim.Close()
	})
	_, genErr := post(t, srv.URL+"/v1/completions", `{"model":"nope","prompt":"x"}`)
	for _, path := range []string{"/tokenize", "/detokenize"} {
		resp, out := post(t, srv.URL+path, `{"model":"nope","prompt":"x","tokens":[1]}`)
		if resp.StatusCode != 404 || out != genErr {
			t.Errorf("%s, unknown model: %d %s, want the generation's %s", path, resp.StatusCode, out, genErr)
		}
		if resp, out := post(t, srv.URL+path, `{"model":"sql-lora","prompt":"x","tokens":[1]}`); resp.StatusCode != 200 {
			t.Errorf("%s, an adapter: %d %s", path, resp.StatusCode, out)
		}
	}
	bad := map[string][]string{
		"/tokenize": {`{`, `[]`, `null`, `{}`, `{"prompt":5}`, `{"prompt":["a"]}`, `{"prompt":null}`, `{"messages":null}`,
			`{"prompt":"x","add_special_tokens":null}`, `{"prompt":"x","return_token_strs":"maybe"}`, "{\"prompt\":\"x \xff\"}",
			`{"messages":[{"role":"user","content":"hi"}],"add_generation_prompt":true,"continue_final_message":true}`,
			`{"messages":[{"role":"user","content":"hi"}],"continue_final_message":true}`,
			`{"messages":[{"role":"","content":"hi"}]}`, `{"messages":[{"role":"user","content":5}]}`,
			`{"messages":[{"role":"user","content":"hi"}],"tools":{"type":"function"}}`},
		"/detokenize": {`{`, `{}`, `{"tokens":null}`, `{"tokens":[-1]}`, `{"tokens":[1.5]}`, `{"tokens":["a"]}`,
			`{"tokens":[9223372036854775808]}`, `{"tokens":1}`},
	}
	for path, bodies := range bad {
		for _, b := range bodies {
			resp, out := post(t, srv.URL+path, b)
			var e APIError
			if resp.StatusCode != 400 || json.Unmarshal([]byte(out), &e) != nil || e.Code != 400 || e.Type != "BadRequestError" || e.Message == "" {
				t.Errorf("%s %s: %d %s", path, b, resp.StatusCode, out)
			}
		}
	}
	for _, path := range []string{"/v1/completions", "/tokenize", "/detokenize"} {
		resp, err := http.Post(srv.URL+path, "application/x-www-form-urlencoded", strings.NewReader(`{"prompt":"x","tokens":[1]}`))
		if err != nil {
			t.Fatal(err)
		}
		out, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 400 || !strings.Contains(string(out), "Only 'application/json' is allowed") {
			t.Errorf("%s, curl's -d media type: %d %s", path, resp.StatusCode, out)
		}
		huge := append(bytes.Repeat([]byte{' '}, int(sim.maxBody)), `{"prompt":"x","tokens":[1]}`...)
		resp, err = http.Post(srv.URL+path, "application/json", bytes.NewReader(huge))
		if err != nil {
			t.Fatal(err)
		}
		out, _ = io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 400 || !strings.Contains(string(out), "request body too large") {
			t.Errorf("%s, a body over %d bytes: %d %s", path, sim.maxBody, resp.StatusCode, out)
		}
	}

	_, wide := newTestServer(t, Config{BytesPerToken: 8})
	resp, out := post(t, wide.URL+"/tokenize", `{"prompt":"abcdefgh"}`)
	var e APIError
	if resp.StatusCode != 501 || json.Unmarshal([]byte(out), &e) != nil || e.Type != "NotImplementedError" {
		t.Errorf("8 bytes a token: %d %s", resp.StatusCode, out)
	}
	if got := detokenize(t, wide.URL, []int64{0x6867666564636261}); got != "abcdefgh" {
		t.Errorf("8 bytes a token, an id detokenized as %q", got)
	}
}

// TestDetokenizeEdges: an id outside the vocabulary is dropped, a partial
// token before the last is a whole one (as in a prompt), and bytes that
// are not UTF-8 come back as Python decodes them.
func TestDetokenizeEdges(t *testing.T) {
	_, srv := newTestServer(t, Config{})
	tok := NewTokenizer(4)
	partial := tok.tokenID([]byte("ab"))
	for _, tc := range []struct {
		ids  []int64
		want string
	}{
		{[]int64{}, ""},
		{[]int64{partial}, "ab"},
		{[]int64{partial, partial}, "ab\x00\x00ab"},
		{[]int64{partial, 1 << 40}, "ab"},
		{[]int64{0x82e2}, "\ufffd\x00\x00"},
	} {
		if got := detokenize(t, srv.URL, tc.ids); got != tc.want {
			t.Errorf("%v: %q, want %q", tc.ids, got, tc.want)
		}
	}
	if resp, out := post(t, srv.URL+"/detokenize", `{"tokens":[1.0,"2",true]}`); resp.StatusCode != 200 {
		t.Errorf("lax integers: %d %s", resp.StatusCode, out)
	}
}

// TestPingAsHealth: /ping answers GET and POST as /health does, 503 with
// the unhealthy fault.
func TestPingAsHealth(t *testing.T) {
	sim, srv := newTestServer(t, Config{})
	for _, unhealthy := range []bool{false, true} {
		sim.SetFaults(Faults{Unhealthy: unhealthy})
		want := 200
		if unhealthy {
			want = 503
		}
		for _, method := range []string{"GET", "POST"} {
			req, _ := http.NewRequest(method, srv.URL+"/ping", nil)
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != want {
				t.Errorf("%s /ping, unhealthy %v: %d, want %d", method, unhealthy, resp.StatusCode, want)
			}
		}
	}
}

func FuzzParseTokenize(f *testing.F) {
	for _, s := range []string{
		`{"prompt":"hello"}`, `{"prompt":"héllo ✓","return_token_strs":true,"add_special_tokens":false}`,
		`{"messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function"}]}`,
		`{"messages":[{"role":"assistant","content":[{"type":"text","text":"a"}]}],"continue_final_message":true,"add_generation_prompt":false}`,
		`{"prompt":"x","messages":[]}`, `{"prompt":5,"messages":[{"role":"u"}]}`, `{`, `null`, `[]`, `{"tokens":[1,2.0,"3"]}`,
	} {
		f.Add([]byte(s))
	}
	toks := []*Tokenizer{NewTokenizer(1), NewTokenizer(4), NewTokenizer(7)}
	is400 := func(t *testing.T, err error) {
		if ae, ok := err.(*APIError); !ok || ae.Code != 400 {
			t.Fatalf("error %v is not a 400 APIError", err)
		}
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		if _, ids, err := ParseDetokenize(body); err != nil {
			is400(t, err)
		} else {
			for _, tok := range toks {
				_ = pyDecodeUTF8(tok.TokenIDsToText(ids))
			}
		}
		req, err := ParseTokenize(body)
		if err != nil {
			is400(t, err)
			return
		}
		text, err := req.Text()
		if err != nil {
			is400(t, err)
			return
		}
		for _, tok := range toks {
			ids := tok.TokenIDs(text)
			if len(ids) != tok.CountTokens(len(text)) || !bytes.Equal(tok.TokenIDsToText(ids), text) {
				t.Fatalf("%d bytes a token: %q tokenized as %v", tok.BytesPerToken, text, ids)
			}
			if strs := tok.TokenStrings(text); len(strs) != len(ids) {
				t.Fatalf("%d token strings, %d ids", len(strs), len(ids))
			}
		}
	})
}
