package caddyllm

// The request parser as it was before the single-pass reader (issue 16):
// encoding/json into a struct, then hashing. It is the reference the new
// reader is checked against (TestParseMatchesReference,
// FuzzParseMatchesReference); only its names changed.

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"testing"
	"unicode/utf16"
	"unicode/utf8"

	"github.com/llmaffinity/caddy-llm-affinity/prefixindex"
)

// refRequest is the part of both endpoints' bodies routing reads.
// Strings stay raw so their escaped bytes are hashed without a copy.
type refRequest struct {
	Model               string          `json:"model"`
	Prompt              json.RawMessage `json:"prompt"`
	Messages            []refMessage    `json:"messages"`
	Tools               json.RawMessage `json:"tools"`
	MaxTokens           *refLaxInt      `json:"max_tokens"`
	MaxCompletionTokens *refLaxInt      `json:"max_completion_tokens"`
	N                   *refLaxInt      `json:"n"`
	Stream              refLaxBool      `json:"stream"`
	CacheSalt           *string         `json:"cache_salt"`
}

// refCompletionsRequest is the part of a completions body routing reads:
// the chat API's messages and max_completion_tokens are not its own.
type refCompletionsRequest struct {
	Model     string          `json:"model"`
	Prompt    json.RawMessage `json:"prompt"`
	MaxTokens *refLaxInt      `json:"max_tokens"`
	N         *refLaxInt      `json:"n"`
	Stream    refLaxBool      `json:"stream"`
	CacheSalt *string         `json:"cache_salt"`
}

// refResponsesRequest is the part of a Responses API body routing reads
// (added with it, not in the parser it replaced): the other APIs' fields
// are not its own, and the engine ignores them.
type refResponsesRequest struct {
	Model              string          `json:"model"`
	Tools              json.RawMessage `json:"tools"`
	Stream             refLaxBool      `json:"stream"`
	Input              json.RawMessage `json:"input"`
	Instructions       json.RawMessage `json:"instructions"`
	MaxOutputTokens    *refLaxInt      `json:"max_output_tokens"`
	PreviousResponseID string          `json:"previous_response_id"`
	Store              json.RawMessage `json:"store"`
	Background         json.RawMessage `json:"background"`
	CacheSalt          *string         `json:"cache_salt"`
}

// refItem is the part of a Responses API input item routing reads.
type refItem struct {
	Role    string          `json:"role"`
	Type    string          `json:"type"`
	Content json.RawMessage `json:"content"`
}

type refMessage struct {
	Role       string          `json:"role"`
	Content    json.RawMessage `json:"content"`
	Name       json.RawMessage `json:"name"`
	ToolCallID json.RawMessage `json:"tool_call_id"`
	ToolCalls  json.RawMessage `json:"tool_calls"`
}

// refParts reads content, a message's content as sent, for what of it is
// not text as the engine reads it, escapes decoded: of an array of parts,
// all but the parts' text (a string's, a text part's "text", a refusal's
// "refusal"), and whether it has media parts (content-part objects whose
// type is a string other than a text part's). Another value is all text.
func refParts(content json.RawMessage) (notText int, media bool) {
	content = bytes.TrimSpace(content)
	var parts []json.RawMessage
	if len(content) == 0 || content[0] != '[' || json.Unmarshal(content, &parts) != nil {
		return 0, false
	}
	text := 0
	for _, part := range parts {
		if len(part) > 0 && part[0] == '"' {
			text += refText(part)
			continue
		}
		// Keys match exactly, and the last value of one counts.
		var fields map[string]json.RawMessage
		if len(part) == 0 || part[0] != '{' || json.Unmarshal(part, &fields) != nil {
			continue
		}
		var typ string
		if t := fields["type"]; len(t) == 0 || t[0] != '"' || json.Unmarshal(t, &typ) != nil {
			continue
		}
		switch {
		case typ == "refusal":
			text += refText(fields["refusal"])
		case slices.Contains(textParts[:], typ):
			text += refText(fields["text"])
		default:
			media = true
		}
	}
	return len(content) - refEscapeExtra(content) - text, media
}

// refText is the bytes of v's text, escapes decoded, when it is a string;
// 0 otherwise.
func refText(v json.RawMessage) int {
	if len(v) < 2 || v[0] != '"' {
		return 0
	}
	return len(v) - 2 - refEscapeExtra(v)
}

// refEscapeExtra is the bytes the escapes in raw (valid JSON, or a
// string's contents) take beyond the UTF-8 they stand for: the prompt is
// counted as the engine reads its text.
func refEscapeExtra(raw []byte) int {
	extra := 0
	for i := 0; i < len(raw); i++ {
		if raw[i] != '\\' {
			continue
		}
		if raw[i+1] != 'u' {
			extra++
			i++
			continue
		}
		v, _ := strconv.ParseUint(string(raw[i+2:i+6]), 16, 32)
		switch r := rune(v); {
		case utf16.IsSurrogate(r):
			extra += 6 - 2 // a pair is 12 bytes for 4
		default:
			extra += 6 - utf8.RuneLen(r)
		}
		i += 5
	}
	return extra
}

// refRaw is a value as the canonical prompt has it: a string's contents
// (escaped as sent), or the value as sent; nil when absent or null.
func refRaw(v json.RawMessage) []byte {
	v = bytes.TrimSpace(v)
	if string(v) == "null" {
		return nil
	}
	if len(v) >= 2 && v[0] == '"' {
		return v[1 : len(v)-1]
	}
	return v
}

// refLaxInt is an integer read as pydantic's lax mode reads one (vLLM's
// request models), leniently: a JSON number without a fractional part,
// in a string too, or a boolean (1, 0).
type refLaxInt int

func (n *refLaxInt) UnmarshalJSON(raw []byte) error {
	var b bool
	if json.Unmarshal(raw, &b) == nil {
		*n = 0
		if b {
			*n = 1
		}
		return nil
	}
	var s string
	if json.Unmarshal(raw, &s) == nil {
		s = strings.TrimSpace(s)
		if v, err := strconv.ParseInt(s, 10, 64); err == nil {
			*n = refLaxInt(v)
			return nil
		}
		f, err := strconv.ParseFloat(s, 64)
		if err != nil || f != math.Trunc(f) || math.Abs(f) > 1<<53 {
			return errors.New("not an integer")
		}
		*n = refLaxInt(f)
		return nil
	}
	var i int64
	if json.Unmarshal(raw, &i) == nil {
		*n = refLaxInt(i)
		return nil
	}
	var f float64
	if err := json.Unmarshal(raw, &f); err != nil {
		return err
	}
	if f != math.Trunc(f) || math.Abs(f) > 1<<53 {
		return errors.New("not an integer")
	}
	*n = refLaxInt(f)
	return nil
}

// refLaxBool is a boolean read as pydantic's lax mode reads one. null
// leaves it as it was, as encoding/json leaves a bool.
type refLaxBool bool

func (b *refLaxBool) UnmarshalJSON(raw []byte) error {
	var v any
	if err := json.Unmarshal(raw, &v); err != nil {
		return err
	}
	switch v := v.(type) {
	case nil:
		return nil
	case bool:
		*b = refLaxBool(v)
		return nil
	case string:
		switch strings.ToLower(v) {
		case "1", "on", "t", "true", "y", "yes":
			*b = true
			return nil
		case "0", "off", "f", "false", "n", "no":
			*b = false
			return nil
		}
	case float64:
		var n refLaxInt
		if n.UnmarshalJSON(raw) == nil && (n == 0 || n == 1) {
			*b = n == 1
			return nil
		}
	}
	return errors.New("not a boolean")
}

// refAPIType names a Go type of refRequest in the API's words, for errors
// a client can act on ("messages must be an array", not a Go type).
func refAPIType(t reflect.Type) string {
	switch t.Kind() {
	case reflect.String:
		return "a string"
	case reflect.Int, reflect.Int32, reflect.Int64:
		return "an integer"
	case reflect.Bool:
		return "a boolean"
	case reflect.Slice, reflect.Array:
		return "an array"
	case reflect.Struct, reflect.Map:
		return "an object"
	case reflect.Pointer:
		return refAPIType(t.Elem())
	}
	return "a different type"
}

// parse reads body for endpoint. It never panics; errors are
// errBadRequest.
func (p *parser) refParse(endpoint Endpoint, body []byte) (*Request, error) {
	body = refLastValues(bytes.TrimPrefix(body, utf8BOM))
	if endpoint == EndpointResponses {
		return p.refParseResponses(body)
	}
	var raw refRequest
	var into any = &raw
	var completions refCompletionsRequest
	if endpoint == EndpointCompletions {
		into = &completions
	}
	if err := json.Unmarshal(body, into); err != nil {
		var syn *json.SyntaxError
		var typ *json.UnmarshalTypeError
		switch {
		case errors.As(err, &syn):
			return nil, badRequestf("", "invalid JSON body at byte %d: %v", syn.Offset, err)
		case errors.As(err, &typ):
			return nil, badRequestf("", "invalid request: %s must be %s", typ.Field, refAPIType(typ.Type))
		}
		return nil, badRequestf("", "invalid JSON body: %v", err)
	}
	if endpoint == EndpointCompletions {
		raw = refRequest{Model: completions.Model, Prompt: completions.Prompt, MaxTokens: completions.MaxTokens, N: completions.N, Stream: completions.Stream, CacheSalt: completions.CacheSalt}
	}
	if len(raw.Model) > maxModelNameBytes {
		return nil, errModelTooLong
	}
	req := &Request{Endpoint: endpoint, Model: raw.Model, Stream: bool(raw.Stream), Sequences: 1}
	if raw.N != nil && *raw.N > 1 {
		req.Sequences = min(int(*raw.N), maxSequences)
	}
	switch {
	case raw.MaxCompletionTokens != nil:
		req.MaxTokens = max(0, int(*raw.MaxCompletionTokens))
	case raw.MaxTokens != nil:
		req.MaxTokens = max(0, int(*raw.MaxTokens))
	}
	salt, err := p.refSalt(raw.CacheSalt)
	if err != nil {
		return nil, err
	}
	seed := prefixindex.Seed(req.Model, "", salt)
	switch endpoint {
	case EndpointCompletions:
		if err := p.refHashPrompt(req, seed, raw.Prompt); err != nil {
			return nil, err
		}
	case EndpointChatCompletions:
		if err := p.refHashChat(req, seed, &raw); err != nil {
			return nil, err
		}
	}
	return req, nil
}

// refLastValues is body, an object, with each key's last value only, in
// the place of its first, as Python's json.loads (vLLM's) reads it: where
// encoding/json decodes a struct field given twice, the first value's type
// error stands, and a null leaves a string as it was. The values keep
// their bytes (a Responses API item's are hashed as sent). A body without
// a key given twice, or that is no valid object, stays as it is.
func refLastValues(body []byte) []byte {
	if !json.Valid(body) {
		return body
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	if t, err := dec.Token(); err != nil || t != json.Delim('{') {
		return body
	}
	var keys []string
	values := map[string]json.RawMessage{}
	read := 0
	for dec.More() {
		t, err := dec.Token()
		key, ok := t.(string)
		var value json.RawMessage
		if err != nil || !ok || dec.Decode(&value) != nil {
			return body
		}
		if _, seen := values[key]; !seen {
			keys = append(keys, key)
		}
		values[key] = value
		read++
	}
	if read == len(keys) {
		return body
	}
	out := []byte{'{'}
	for i, key := range keys {
		if i > 0 {
			out = append(out, ',')
		}
		k, _ := json.Marshal(key)
		out = append(append(append(out, k...), ':'), values[key]...)
	}
	return append(out, '}')
}

// refParseResponses is refParse for the Responses API.
func (p *parser) refParseResponses(body []byte) (*Request, error) {
	var raw refResponsesRequest
	if err := json.Unmarshal(body, &raw); err != nil {
		return nil, badRequestf("", "invalid JSON body: %v", err)
	}
	if len(raw.Model) > maxModelNameBytes {
		return nil, errModelTooLong
	}
	req := &Request{Endpoint: EndpointResponses, Model: raw.Model, Stream: bool(raw.Stream), Sequences: 1}
	if raw.MaxOutputTokens != nil {
		req.MaxTokens = max(0, int(*raw.MaxOutputTokens))
	}
	salt, err := p.refSalt(raw.CacheSalt)
	if err != nil {
		return nil, err
	}
	if err := p.refHashResponses(req, prefixindex.Seed(req.Model, "", salt), &raw); err != nil {
		return nil, err
	}
	return req, nil
}

// refSalt is the salt a request's hashes are seeded with, given its
// cache_salt (nil: absent or null).
func (p *parser) refSalt(cacheSalt *string) (string, error) {
	switch {
	case cacheSalt == nil:
		return p.salt, nil
	case *cacheSalt == "":
		return "", errEmptyCacheSalt
	}
	return saltWith(p.salt, *cacheSalt), nil
}

// refHashResponses hashes a Responses API request as a chat: the tools,
// the instructions as a system message, then the input (a string as a
// user message; a message item by role and content; another item by its
// type and the item as sent).
func (p *parser) refHashResponses(req *Request, seed uint64, raw *refResponsesRequest) error {
	var c prefixindex.Blocks
	c.Reset(p.hasher, nil)
	escapes := 0
	if tools := bytes.TrimSpace(raw.Tools); len(tools) > 0 && string(tools) != "null" {
		c.Write(tools)
		c.WriteString(sepMessage)
		escapes += refEscapeExtra(tools)
	}
	message := func(role string, content []byte) {
		c.WriteString(role)
		c.WriteString(sepField)
		if len(content) >= 2 && content[0] == '"' {
			content = content[1 : len(content)-1]
		}
		c.Write(content)
		c.WriteString(sepMessage)
		escapes += refEscapeExtra(content)
	}
	parts, media := 0, false // the content parts' bytes that are not text
	var instructions *string
	if err := json.Unmarshal(raw.Instructions, &instructions); len(raw.Instructions) > 0 && err != nil {
		return badRequestf("", "invalid request: instructions must be a string")
	}
	if instructions != nil && *instructions != "" {
		message("system", bytes.TrimSpace(raw.Instructions))
	}
	in := bytes.TrimSpace(raw.Input)
	switch {
	case len(in) == 0 || string(in) == "null":
		return badRequestf("", "invalid request: input is required")
	case in[0] == '"':
		message("user", in)
	case in[0] == '[':
		var items []json.RawMessage
		if err := json.Unmarshal(in, &items); err != nil {
			return badRequestf("", "invalid request: input must be a string or an array")
		}
		for i, item := range items {
			var it refItem
			if len(item) == 0 || item[0] != '{' || json.Unmarshal(item, &it) != nil {
				return badRequestf("", "invalid request: input[%d] must be an object", i)
			}
			switch {
			case it.Role != "":
				message(it.Role, bytes.TrimSpace(it.Content))
				notText, hasMedia := refParts(it.Content)
				parts, media = parts+notText, media || hasMedia
			case it.Type != "":
				message(it.Type, item)
			default:
				return badRequestf("", "invalid request: input[%d] must have a role or a type", i)
			}
		}
	default:
		return badRequestf("", "invalid request: input must be a string or an array")
	}
	req.Hashes = c.Chain(seed)
	req.PromptBytes = c.Len() - escapes - parts
	req.PromptTokens, req.Media = p.tokens(req.PromptBytes), media
	var store refLaxBool = true
	req.NoStore = len(raw.Store) > 0 && store.UnmarshalJSON(raw.Store) == nil && !bool(store)
	var background refLaxBool
	req.Background = len(raw.Background) > 0 && background.UnmarshalJSON(raw.Background) == nil && bool(background)
	if len(raw.PreviousResponseID) <= maxResponseIDBytes {
		req.PreviousResponseID = raw.PreviousResponseID
	}
	return nil
}

// hashPrompt handles a completions prompt: a string, an array of strings
// (hashed as one canonical text), an array of token ids, or an array of
// such arrays.
func (p *parser) refHashPrompt(req *Request, seed uint64, prompt json.RawMessage) error {
	prompt = bytes.TrimSpace(prompt)
	if len(prompt) == 0 || string(prompt) == "null" {
		return nil
	}
	switch prompt[0] {
	case '"':
		s := prompt[1 : len(prompt)-1] // valid JSON: ends with the quote
		req.Hashes = p.hasher.HashBytes(nil, seed, s)
		text := len(s) - refEscapeExtra(s)
		req.PromptTokens, req.PromptBytes = p.tokens(text), text
		return nil
	case '[':
	default:
		return badRequestf("", "invalid request: prompt must be a string, an array of strings, an array of token ids or an array of such arrays")
	}
	if tokens, ok := refTokens(prompt); ok {
		req.Hashes = p.hasher.HashTokens(nil, seed, tokens)
		req.PromptTokens = len(tokens)
		return nil
	}
	var parts []json.RawMessage
	if err := json.Unmarshal(prompt, &parts); err != nil {
		return badRequestf("", "invalid request: prompt must be a string, an array of strings, an array of token ids or an array of such arrays")
	}
	if len(parts) > 0 && len(bytes.TrimSpace(parts[0])) > 0 && bytes.TrimSpace(parts[0])[0] == '[' {
		return p.refHashTokenBatch(req, seed, parts)
	}
	var c prefixindex.Blocks
	c.Reset(p.hasher, nil)
	longest, escapes := 0, 0
	for i, part := range parts {
		part = bytes.TrimSpace(part)
		if len(part) < 2 || part[0] != '"' {
			return badRequestf("", "invalid request: prompt[%d] must be a string", i)
		}
		if i > 0 {
			c.WriteString(sepMessage)
		}
		c.Write(part[1 : len(part)-1])
		extra := refEscapeExtra(part)
		escapes += extra
		longest = max(longest, p.tokens(len(part)-2-extra))
	}
	req.Hashes = c.Chain(seed)
	req.PromptTokens, req.PromptBytes = p.tokens(c.Len()-escapes), c.Len()-escapes
	if len(parts) > 1 {
		req.LongestPromptTokens = longest
		req.Sequences = min(req.Sequences*len(parts), maxSequences)
	}
	return nil
}

// hashTokenBatch handles a batch of prompts given as token ids
// ([[1,2,3],[4,5,6]], one completion each): the engine holds them all, so
// they are counted together and hashed as one sequence, in order, as an
// array of strings is.
func (p *parser) refHashTokenBatch(req *Request, seed uint64, parts []json.RawMessage) error {
	var all []int32
	longest := 0
	for i, part := range parts {
		tokens, ok := refTokens(part)
		if !ok {
			return badRequestf("", "invalid request: prompt[%d] must be an array of token ids", i)
		}
		all = append(all, tokens...)
		longest = max(longest, len(tokens))
	}
	req.Hashes = p.hasher.HashTokens(nil, seed, all)
	req.PromptTokens = len(all)
	if len(parts) > 1 {
		req.LongestPromptTokens = longest
		req.Sequences = min(req.Sequences*len(parts), maxSequences)
	}
	return nil
}

// hashChat hashes the tools, then each message's role and content in
// order. Content is hashed as its raw JSON (a string's escaped bytes
// without the quotes, or the content-part array as sent).
func (p *parser) refHashChat(req *Request, seed uint64, raw *refRequest) error {
	if raw.Messages == nil {
		return badRequestf("", "invalid request: messages is required")
	}
	var c prefixindex.Blocks
	c.Reset(p.hasher, nil)
	escapes := 0
	if tools := bytes.TrimSpace(raw.Tools); len(tools) > 0 && string(tools) != "null" {
		c.Write(tools)
		c.WriteString(sepMessage)
		escapes += refEscapeExtra(tools)
	}
	parts, media := 0, false // the content parts' bytes that are not text
	for i, m := range raw.Messages {
		if m.Role == "" {
			return badRequestf("", "invalid request: messages[%d].role is required", i)
		}
		c.WriteString(m.Role)
		c.WriteString(sepField)
		content := bytes.TrimSpace(m.Content)
		if len(content) >= 2 && content[0] == '"' {
			content = content[1 : len(content)-1]
		}
		c.Write(content)
		escapes += refEscapeExtra(content)
		for _, f := range []struct {
			name string
			v    json.RawMessage
		}{{"name", m.Name}, {"tool_call_id", m.ToolCallID}, {"tool_calls", m.ToolCalls}} {
			if v := refRaw(f.v); len(v) > 0 {
				c.WriteString(sepField)
				c.WriteString(f.name)
				c.WriteString(sepField)
				c.Write(v)
				escapes += refEscapeExtra(v)
			}
		}
		c.WriteString(sepMessage)
		notText, hasMedia := refParts(m.Content)
		parts, media = parts+notText, media || hasMedia
	}
	req.Hashes = c.Chain(seed)
	req.PromptBytes = c.Len() - escapes - parts
	req.PromptTokens, req.Media = p.tokens(req.PromptBytes), media
	return nil
}

// sameAsReference checks that the single-pass reader accepts what the
// reference accepts and finds the same fields and hashes.
func sameAsReference(t *testing.T, p *parser, ep Endpoint, body []byte) {
	t.Helper()
	if foldedKey(body) {
		return
	}
	got, err := p.parse(ep, body)
	want, refErr := p.refParse(ep, body)
	if (err == nil) != (refErr == nil) {
		t.Fatalf("%s %.300q:\n reader: %v\n reference: %v", ep, body, err, refErr)
	}
	if err != nil {
		var bad errBadRequest
		if !errors.As(err, &bad) {
			t.Fatalf("%.300q: error %T %v, want a bad request", body, err, err)
		}
		return
	}
	if got.Model != want.Model || got.PromptTokens != want.PromptTokens || got.MaxTokens != want.MaxTokens ||
		got.Stream != want.Stream || got.Endpoint != want.Endpoint || !slices.Equal(got.Hashes, want.Hashes) ||
		got.PreviousResponseID != want.PreviousResponseID || got.NoStore != want.NoStore || got.Background != want.Background ||
		got.Media != want.Media || got.LongestPromptTokens != want.LongestPromptTokens ||
		got.PromptBytes != want.PromptBytes || got.Sequences != want.Sequences {
		t.Fatalf("%s %.300q:\n reader    %+v\n reference %+v", ep, body, got, want)
	}
}

// referenceCorpus is bodies of both endpoints' shapes, valid and not.
func referenceCorpus() []string {
	long := strings.Repeat("The quick brown fox \\\"jumps\\\" over the lazy dog. ", 40)
	bodies := []string{
		`{"model":"m","prompt":"hello world, hello world"}`,
		`{"model":"m","prompt":"hello world, hello world","cache_salt":"tenant \u00e9"}`,
		`{"model":"m","messages":[{"role":"user","content":"hi"}],"cache_salt":""}`, `{"cache_salt":5,"prompt":"x"}`,
		`{"cache_salt":"a","cache_salt":null,"input":"x"}`, `{"cache_salt":null,"prompt":"x"}`,
		`{"input":"x","background":true}`, `{"input":"x","background":"true","store":0}`, `{"input":"x","background":"maybe"}`, `{"input":"x","background":1,"background":false}`,
		`{"model":"m","prompt":"` + long + `"}`,
		`{"model":"m","prompt":["` + long + `","b","` + long + `"]}`,
		`{"model":"m","prompt":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17]}`,
		`{"model":"m","prompt":[[1,2,3],[4,5,6,7,8],null,[],[9,10,11,12,13,14,15,16,17]]}`,
		`{"model":"m","prompt":[null,5,-0,-2147483648,2147483647]}`,
		`{"prompt":[2147483648]}`, `{"model":"m","prompt":[4311810303,2147483648,-2147483649,9223372036854775807,-9223372036854775808,1e15,9007199254740993.0,1,2,3,4,5,6,7,8,9,10]}`,
		`{"prompt":[[4294967296],[5]]}`, `{"prompt":[1e17]}`, `{"prompt":[9223372036854775808]}`, `{"prompt":[1.5]}`, `{"prompt":[1e2]}`, `{"prompt":[[1],[2.0]]}`,
		`{"prompt":[1,"a"]}`, `{"prompt":["a",1]}`, `{"prompt":[[1],"a"]}`, `{"prompt":[null,[1]]}`, `{"prompt":[["a"]]}`,
		`{"prompt":[]}`, `{"prompt":[[]]}`, `{"prompt":[""]}`, `{"prompt":""}`, `{"prompt":null}`, `{"prompt":{}}`, `{"prompt":true}`,
		`{"prompt":[{}]}`, `{"prompt":[true]}`, `{"prompt":3,"prompt":"x"}`, `{"prompt":"x","prompt":3}`,
		`{"prompt":"x","max_tokens":"abc","max_tokens":2}`, `{"prompt":"x","max_tokens":2,"max_tokens":"abc"}`,
		`{"model":5,"prompt":"x","model":"m"}`, `{"prompt":"x","stream":2,"stream":false}`, `{"prompt":"x","n":2.5,"n":1}`,
		`{"prompt":"x","cache_salt":5,"cache_salt":"s"}`, `{"prompt":"x","max_tokens":"a","n":"b","max_tokens":null}`,
		`{"messages":5,"messages":[{"role":"user","content":"x"}]}`, `{"messages":[{"role":5}],"messages":[{"role":"user","content":"x"}]}`,
		`{"messages":[{"role":"user","content":"x"}],"messages":[{"role":5}]}`, `7`, `{"model":5,"model":null,"prompt":"x"}`,
		`{"prompt":"\u00e9\"\\\/\b\f\n\r\t\ud83d\ude00 \ud800 \udc00x"}`,
		`{"model":"m","messages":[{"role":"user","content":"hi"}],"tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object","properties":{"a":{"type":["string","null"]}}}}}]}`,
		`{"messages":[{"role":"user","content":"hi"}],"model":"m","tools":[{"type":"function"}],"stream":true}`,
		`{"messages":[{"role":"user","content":"hi"}],"tools":[1],"tools":null}`,
		`{"tools":null,"messages":[{"role":"user","content":"hi"}],"tools":[2]}`,
		`{"tools":[ 1 , 2 ],"messages":[{"role":"user","content":"hi"}],"tools":[ 1 , 2 ]}`,
		`{"messages":[{"role":"user","content":[{"type":"text","text":"x"},{"type":"image_url","image_url":{"url":"data:..."}}]}]}`,
		// Tool calls, their ids and names: what the chat template renders besides the content.
		`{"messages":[{"role":"user","content":"weather?"},{"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function","function":{"name":"get_weather","arguments":"{\"city\":\"Paris\"}"}}]},{"role":"tool","tool_call_id":"call_1","content":"sunny"}]}`,
		`{"messages":[{"tool_calls":[],"name":"bob","TOOL_CALL_ID":"c\u0031","role":"user","content":"x"}]}`,
		`{"messages":[{"role":"user","name":"a","name":null,"tool_calls":null,"tool_call_id":"","content":"x"}]}`,
		`{"messages":[{"role":"user","name":5,"tool_calls":{"a":1},"content":"x"},{"role":"user","name":"\u00e9"}]}`,
		// Media parts: bytes hashed, not counted.
		`{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:image/png;base64,` + strings.Repeat("QUJD", 300) + `"}},{"type":"text","text":"what is it?"}]}]}`,
		`{"messages":[{"role":"user","content":[{"type":"input_audio","input_audio":{"data":"AAAA","format":"wav"}},{"type":"\u0074ext","text":"x"},{"TYPE":"file","file":{}},{"type":"image_url","type":"text"},{"type":"text","type":"image_url"},{"type":5},{"type":"image_url","type":null},"s",1,null,{}]}]}`,
		`{"messages":[{"role":"user","content":[]}],"messages":[{"role":"user","content":[{"type":"refusal","refusal":"no"},{"type":"video_url"}]}]}`,
		// Text parts: their text counts, not their keys nor the whitespace between them.
		"{\"messages\":[{\"role\":\"user\",\"content\":[ {\"type\":\"text\",\"text\":\"\"} ,\n\t{\"text\":\"caf\\u00e9 \\\"q\\\"\",\"type\":\"text\"}, \"plain \\n\" ]}]}",
		`{"messages":[{"role":"user","content":[{"type":"text","text":"a","text":"bb"},{"type":"text","text":"a","text":5},{"type":"text","text":null},{"type":"text"}]}]}`,
		`{"messages":[{"role":"assistant","content":[{"type":"refusal","text":"not this","refusal":"this"},{"type":"text","refusal":"not this"},{"type":"refusal","refusal":["x"]}]}]}`,
		`{"messages":[{"role":"user","content":[{"text":"untyped"},{"type":null,"text":"x"},{"type":["text"],"text":"x"},{"type":"\u0074ext","\u0074ext":"esc\u0061ped key"},[{"type":"text","text":"nested"}],7,true,null,{}]}]}`,
		`{"messages":[{"role":"user","content":[{"type":"text","text":"x","type":"image_url"},{"type":"image_url","text":"y","type":"input_text"}]}]}`,
		`{"messages":[{"role":"user","content":[{"type":"text","text":"bad \ud800 surrogate \ud83d\ude00"},"\u4e2d\u6587"]},{"role":"user","content":{"type":"text","text":"an object"}},{"role":"user","content":5}]}`,
		`{"messages":[{"role":"user","content":[{"type":"text","text":"first"}],"content":"then a string"},{"role":"user","content":"a string","content":[{"type":"text","text":"then parts"}]}]}`,
		`{"input":[{"role":"assistant","content":[{"type":"output_text","text":"said","annotations":[]},{"type":"refusal","refusal":"no"},{"type":"reasoning_text","text":"r"},{"type":"summary_text","text":"s"}]},{"role":"user","content":[ {"type":"input_text","text":""} , {"type":"input_text","text":"\u00e9"} ]}],"instructions":"i"}`,
		`{"input":[{"role":"user","content":[{"type":"input_text","text":"a"}],"content":[{"type":"input_image","image_url":"data:"}]},{"type":"message","content":[{"type":"input_text","text":"no role: hashed and counted as sent"}]}]}`,
		`{"model":"m","input":[{"role":"user","content":[{"type":"input_text","text":"x"},{"type":"input_image","image_url":"data:image/jpeg;base64,` + strings.Repeat("QUJD", 100) + `"},{"type":"input_file","file_data":"AAAA"}]},{"type":"function_call_output","call_id":"c","output":"[{\"type\":\"image\"}]"}]}`,
		`{"messages":[{"content":"first","role":"system"},{"role":"user"},{"role":"user","content":null}]}`,
		`{"messages":[{"role":"a","role":null,"content":"x","content":null}]}`,
		`{"messages":[{"role":"a","role":"","content":"x"}]}`,
		`{"messages":[null]}`, `{"messages":[{}]}`, `{"messages":[]}`, `{"messages":null}`, `{"messages":"x"}`, `{"messages":["x"]}`,
		`{"messages":[{"role":7}]}`, `{"messages":[{"role":"u"}],"messages":null}`, `{"messages":null,"messages":[{"role":"u"}]}`,
		`{"messages":[{"role":"\u0075ser","content":"\ud83d\ude00 caf\u00e9 \"quoted\" \\ back"}]}`,
		"{\"messages\":[{\"role\":\"us\xffer\",\"content\":\"bad \xfe utf8\"}],\"model\":\"m\xc3\"}",
		`{"messages":[{"role":"\ud800","content":"x"}],"model":"\udbff\udfff\ud83d"}`,
		`{"MODEL":"up","Model":"b","mode\u006c":"c","moDEL":"d","Messages":[{"ROLE":"user","Content":"x"}]}`,
		"{\"model\":\"m\",\"max_to\u212aens\":5,\"\u017ftream\":true}", // Kelvin sign, long s
		`{"model":"a","model":null,"stream":true,"stream":null,"max_tokens":3,"max_tokens":null,"max_completion_tokens":9}`,
		`{"max_tokens":-0}`, `{"max_tokens":-5}`, `{"max_tokens":1e2}`, `{"max_tokens":1.0}`, `{"max_tokens":"1"}`,
		`{"max_tokens":9223372036854775807}`, `{"max_tokens":9223372036854775808}`, `{"max_tokens":-9223372036854775808}`,
		`{"stream":"yes"}`, `{"stream":1}`, `{"model":3}`, `{"model":["m"]}`,
		`[]`, `null`, `"x"`, ``, ` `, `{`, `{"model":"m"`, `{"model":"m",}`, `{"model":"m"}x`, `{"model":"m"} `,
		`{"a":[1,2,{"b":[]}],"model":"m","prompt":"x"}`, `{"a":{"b":[1,{"c":"d"}]}}`, `{"a":tru}`, `{"a":nul}`, `{"a":01}`,
		`{"a":-}`, `{"a":1.}`, `{"a":1e}`, `{"a":"\x"}`, `{"a":"\u12"}`, "{\"a\":\"\x01\"}", `{"a" "b"}`, `{"a":1 "b":2}`,
		`{"a":[1 2]}`, `{"a":[1,]}`, `{,}`, `{"a":}`, `{"a":"b",}`, "\ufeff{}", `{"model":"m"}{}`,
		"{\"messages\":[{\"role\":\"user\",\"content\":\"tab\there\"}]}",
		"{ \"model\" : \"m\" ,\n\t\"messages\" : [ { \"role\" : \"user\" , \"content\" : \"x\" } ] }",
		`{"model":"meta-llama/Llama-3.1-8B-Instruct","temperature":0.7,"stop":["\n"],"logit_bias":{"50256":-100},"messages":[{"role":"user","content":"x"}],"stream_options":{"include_usage":true}}`,
	}
	// Responses API bodies.
	bodies = append(bodies,
		`{"model":"m","input":"hello"}`,
		`{"model":"m","input":"hello","instructions":"be brief","max_output_tokens":7,"stream":true}`,
		`{"instructions":"be brief","input":[{"role":"user","content":"hi"}],"instructions":null}`,
		`{"input":[{"role":"user","content":"hi"}],"instructions":"a","instructions":"b"}`,
		`{"input":[{"type":"message","role":"user","content":[{"type":"input_text","text":"hi \"q\""}]},`+
			`{"type":"message","role":"assistant","id":"msg_1","status":"completed","content":[{"type":"output_text","text":"x","annotations":[]}]},`+
			`{"type":"function_call","call_id":"c1","name":"f","arguments":"{\"a\":1}"},`+
			`{"type":"function_call_output","call_id":"c1","output":"42"},{"role":"user","content":"and?"}],`+
			`"tools":[{"type":"function","name":"f","parameters":{}}],"model":"m"}`,
		`{"input":[{"type":"reasoning","id":"r1","summary":[]},{ "type" : "item_reference" , "id" : "x" }]}`,
		`{"input":[{"role":"","type":"message","content":"x"}]}`, `{"input":[{"role":null,"type":"t"}]}`,
		`{"input":[{"type":"\u0074ype\ud800"}]}`, `{"input":[{"role":"us\u00e9r","content":null}]}`,
		`{"input":[{}]}`, `{"input":[null]}`, `{"input":["x"]}`, `{"input":[1]}`, `{"input":[[]]}`, `{"input":[]}`,
		`{"input":null}`, `{"input":5}`, `{"input":{}}`, `{"input":true}`, `{"model":"m"}`,
		`{"input":"a","input":[{"role":"user","content":"b"}]}`, `{"input":[{"role":"user","content":"b"}],"input":null}`,
		`{"input":[{"role":5}]}`, `{"input":[{"type":5}]}`, `{"input":[{"role":"u","role":"v","type":"t","type":null}]}`,
		`{"input":"x","instructions":5}`, `{"input":"x","instructions":["a"]}`, `{"input":"x","max_output_tokens":"5"}`,
		`{"input":"x","max_output_tokens":-3,"max_tokens":9}`, `{"INPUT":"x","Instructions":"y","Max_Output_Tokens":2}`,
		`{"messages":[{"role":"user","content":"hi"}],"input":"x","prompt":"y"}`,
		`{"input":"x","previous_response_id":"resp_1","store":false}`, `{"input":"x","previous_response_id":"resp_\u0031","store":true}`,
		`{"input":"x","previous_response_id":"a","previous_response_id":null,"store":false,"store":null}`,
		`{"input":"x","previous_response_id":"a","previous_response_id":""}`, `{"input":"x","previous_response_id":5}`,
		`{"input":"x","messages":5}`, `{"input":"x","messages":[{"role":5}]}`, `{"input":5,"input":"x"}`,
		`{"input":[{"role":5}],"input":"x"}`, `{"instructions":5,"instructions":"x","input":"y"}`, `{"instructions":"","input":"y"}`,
		`{"input":[{"type":"message","role":"user","content":"a"}],"input":[{"role":5}],"input":"z"}`,
		`{"input":"x","max_tokens":"many","max_completion_tokens":1.5,"prompt":7}`, `{"messages":[{"role":"u"}],"max_output_tokens":1.5,"store":"x"}`,
		`{"input":[{"role":"user","type":7}]}`, `{"input":[{"role":null,"type":null}]}`,
		`{"prompt":["p","q"],"n":3}`, `{"messages":[{"role":"user","content":"x"}],"n":"2"}`, `{"prompt":[[1],[2,3]],"n":true}`,
		`{"messages":[{"role":"user","content":"x"}],"n":[2]}`, `{"prompt":"p","n":-4}`, `{"prompt":"p","n":2.5}`,
		`{"prompt":"p","max_tokens":5,"max_completion_tokens":100000}`, `{"prompt":"p","messages":42,"max_completion_tokens":"x"}`,
		`{"input":"x","store":"no"}`, `{"input":"x","store":0}`, `{"input":"x","store":false,"store":{}}`, `{"input":"x","previous_response_id":"`+strings.Repeat("r", 300)+`"}`,
		"{\"input\":\"x\",\"previous_response_id\":\"bad \xff utf8\"}",
	)
	for i := range 12 {
		var items []map[string]any
		for j := range i {
			switch j % 4 {
			case 0:
				items = append(items, map[string]any{"role": "user", "content": strings.Repeat(fmt.Sprintf("ask %d ünï \"q\" \\ \n", j), j*5+1)})
			case 1:
				items = append(items, map[string]any{"type": "message", "role": "assistant", "content": []map[string]any{{"type": "output_text", "text": strings.Repeat("answer ", j*9+1)}}})
			case 2:
				items = append(items, map[string]any{"type": "function_call", "call_id": fmt.Sprint("c", j), "name": "f", "arguments": `{"x":1}`})
			case 3:
				items = append(items, map[string]any{"type": "function_call_output", "call_id": fmt.Sprint("c", j-1), "output": strings.Repeat("out ", j*11)})
			}
		}
		b, _ := json.Marshal(map[string]any{"model": "m", "input": items, "instructions": "sys", "max_output_tokens": i})
		bodies = append(bodies, string(b))
		ib, _ := json.Marshal(items)
		bodies = append(bodies, `{"input":`+string(ib)+`,"model":"m","tools":[{"type":"function","name":"f"}]}`)
	}
	nest := func(n int) string {
		return `{"x":` + strings.Repeat("[", n-1) + strings.Repeat("]", n-1) + `,"prompt":"p"}`
	}
	bodies = append(bodies, nest(maxDepth-1), nest(maxDepth), nest(maxDepth+1))
	// Generated chats, with the fields in both orders.
	for i := range 20 {
		var msgs []map[string]any
		for j := range i {
			content := any(strings.Repeat(fmt.Sprintf("turn %d of %d, ünïcødé \"q\" \\ \n ", j, i), j*7+1))
			if j%3 == 2 {
				content = []map[string]any{{"type": "text", "text": content}}
			}
			msgs = append(msgs, map[string]any{"role": []string{"system", "user", "assistant"}[j%3], "content": content})
		}
		tools := []map[string]any{{"type": "function", "function": map[string]any{"name": "f", "parameters": map[string]any{"n": []any{1, "two", nil, true}}}}}
		b, _ := json.Marshal(map[string]any{"model": "m", "messages": msgs, "tools": tools, "max_completion_tokens": i})
		bodies = append(bodies, string(b))
		b, _ = json.Marshal(map[string]any{"model": "m", "messages": msgs})
		bodies = append(bodies, string(b))
		// Encoded in key order messages, model, tools as the OpenAI Python client sends.
		mb, _ := json.Marshal(msgs)
		tb, _ := json.Marshal(tools)
		bodies = append(bodies, `{"messages":`+string(mb)+`,"model":"m","tools":`+string(tb)+`}`)
	}
	return bodies
}

// TestParseMatchesReference: on every body of the corpus, at block sizes
// small and default, the single-pass reader and the encoding/json parser
// it replaced agree: both reject, or both accept with the same model,
// counts, flags and block hashes.
func TestParseMatchesReference(t *testing.T) {
	for _, p := range []*parser{
		testParser(),
		newParser(prefixindex.Hasher{}, 4, "salt"),
		newParser(prefixindex.Hasher{BlockTokens: 2, BytesPerToken: 3, MaxBlocks: 3}, 3, ""),
	} {
		for _, body := range referenceCorpus() {
			for _, ep := range []Endpoint{EndpointCompletions, EndpointChatCompletions, EndpointResponses} {
				sameAsReference(t, p, ep, []byte(body))
			}
		}
	}
}

// FuzzParseMatchesReference is the differential fuzz target: whatever
// the body, the single-pass reader agrees with the reference.
func FuzzParseMatchesReference(f *testing.F) {
	for _, body := range referenceCorpus() {
		if len(body) < 4096 {
			f.Add([]byte(body), false)
			f.Add([]byte(body), true)
		}
	}
	p := testParser()
	f.Fuzz(func(t *testing.T, body []byte, chat bool) {
		ep := EndpointCompletions
		if chat {
			ep = EndpointChatCompletions
		}
		sameAsReference(t, p, ep, body)
		sameAsReference(t, p, EndpointResponses, body)
	})
}

// refTokens decodes an array of token ids as vLLM's request model reads
// it: integers (int64's), numbers with no fractional part (1.0) up to
// 2^53, null as 0 (as encoding/json decodes it into an int64); each as
// the int32 it is hashed as, its halves xored beyond int32's range.
func refTokens(raw []byte) ([]int32, bool) {
	var items []json.RawMessage
	if json.Unmarshal(raw, &items) != nil {
		return nil, false
	}
	tokens := make([]int32, len(items))
	for i, item := range items {
		var v int64
		if json.Unmarshal(item, &v) != nil {
			var f float64
			if json.Unmarshal(item, &f) != nil || f != math.Trunc(f) || math.Abs(f) > 1<<53 {
				return nil, false
			}
			v = int64(f)
		}
		tokens[i] = int32(v)
		if v < math.MinInt32 || v > math.MaxInt32 {
			tokens[i] = int32(uint32(v) ^ uint32(uint64(v)>>32))
		}
	}
	return tokens, true
}

// refFields are the keys the reference decodes into its structs.
var refFields = []string{"background", "cache_salt", "content", "input", "instructions", "max_completion_tokens", "max_output_tokens", "max_tokens",
	"messages", "model", "n", "name", "previous_response_id", "prompt", "role", "store", "stream", "tool_call_id", "tool_calls", "tools", "type"}

// foldedKey says body has a key that differs from a field's name but
// matches it as encoding/json matches keys, without regard to case
// ("Model", or "\u212a" for k): the reader, as vLLM, takes such a key for
// another, unknown, field; the reference cannot (TestKeysMatchExactly
// checks those bodies).
func foldedKey(body []byte) bool {
	dec := json.NewDecoder(bytes.NewReader(body))
	type frame struct{ object, key bool } // key: the next string is a key
	var stack []frame
	valueRead := func() {
		if n := len(stack); n > 0 && stack[n-1].object {
			stack[n-1].key = true
		}
	}
	for {
		tok, err := dec.Token()
		if err != nil {
			return false
		}
		switch v := tok.(type) {
		case json.Delim:
			if v == '{' || v == '[' {
				valueRead()
				stack = append(stack, frame{object: v == '{', key: true})
			} else {
				stack = stack[:len(stack)-1]
			}
		case string:
			if n := len(stack); n > 0 && stack[n-1].object && stack[n-1].key {
				stack[n-1].key = false
				for _, f := range refFields {
					if v != f && strings.EqualFold(v, f) {
						return true
					}
				}
				continue
			}
			valueRead()
		default:
			valueRead()
		}
	}
}
