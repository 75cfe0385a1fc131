package caddyllm

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"strings"

	"github.com/llmaffinity/caddy-llm-affinity/prefixindex"
)

// Endpoint says which OpenAI API a request targets.
type Endpoint uint8

// Endpoints the handler parses.
const (
	EndpointOther Endpoint = iota
	EndpointCompletions
	EndpointChatCompletions
)

func (e Endpoint) String() string {
	switch e {
	case EndpointCompletions:
		return "completions"
	case EndpointChatCompletions:
		return "chat"
	}
	return "other"
}

// endpointOf classifies a request path; only POSTs are parsed.
func endpointOf(method, path string) Endpoint {
	if method != "POST" {
		return EndpointOther
	}
	switch {
	case strings.HasSuffix(path, "/chat/completions"):
		return EndpointChatCompletions
	case strings.HasSuffix(path, "/completions"):
		return EndpointCompletions
	}
	return EndpointOther
}

// Request is what routing needs of an OpenAI-style request, parsed once
// by the handler. It holds hashes and counts, never prompt text.
type Request struct {
	Endpoint Endpoint
	// Model is the requested model name as sent; with an adapter this is
	// the adapter's name (vLLM serves adapters as models), so it alone
	// seeds the hash chain: an adapter's blocks never match its base
	// model's. The policy works out whether it names an adapter.
	Model string
	// PromptTokens is the estimated prompt length in tokens (exact when
	// the prompt was given as token ids).
	PromptTokens int
	// PromptBytes is the length of the text PromptTokens was estimated
	// from (bytes_per_token), 0 when the prompt was token ids.
	PromptBytes int
	// MaxTokens is max_tokens or max_completion_tokens, 0 when absent.
	MaxTokens int
	// Stream is the request's stream flag.
	Stream bool
	// Hashes are the chained block hashes of the canonical prompt.
	Hashes []uint64
	// BlockTokens is the number of tokens one hash covers.
	BlockTokens int
}

// openAIRequest is the part of both endpoints' bodies routing reads.
// Strings stay raw so their escaped bytes are hashed without a copy.
type openAIRequest struct {
	Model               string          `json:"model"`
	Prompt              json.RawMessage `json:"prompt"`
	Messages            []chatMessage   `json:"messages"`
	Tools               json.RawMessage `json:"tools"`
	MaxTokens           *int            `json:"max_tokens"`
	MaxCompletionTokens *int            `json:"max_completion_tokens"`
	Stream              bool            `json:"stream"`
}

type chatMessage struct {
	Role    string          `json:"role"`
	Content json.RawMessage `json:"content"`
}

// errBadRequest is returned for bodies that are not the API's shape.
type errBadRequest struct{ msg string }

func (e errBadRequest) Error() string { return e.msg }

func badRequestf(format string, args ...any) error {
	return errBadRequest{fmt.Sprintf(format, args...)}
}

// apiType names a Go type of openAIRequest in the API's words, for errors
// a client can act on ("messages must be an array", not a Go type).
func apiType(t reflect.Type) string {
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
		return apiType(t.Elem())
	}
	return "a different type"
}

// Separators keep the canonical form unambiguous: a role can never run
// into content, so turn n+1 of a chat extends turn n byte for byte.
const (
	sepField   = "\x1f"
	sepMessage = "\x1e"
)

// parser turns request bodies into Requests.
type parser struct {
	hasher        prefixindex.Hasher
	bytesPerToken int
	salt          string
}

// parse reads body for endpoint. It never panics; errors are
// errBadRequest.
func (p *parser) parse(endpoint Endpoint, body []byte) (*Request, error) {
	var raw openAIRequest
	if err := json.Unmarshal(body, &raw); err != nil {
		var syn *json.SyntaxError
		var typ *json.UnmarshalTypeError
		switch {
		case errors.As(err, &syn):
			return nil, badRequestf("invalid JSON body at byte %d: %v", syn.Offset, err)
		case errors.As(err, &typ):
			return nil, badRequestf("invalid request: %s must be %s", typ.Field, apiType(typ.Type))
		}
		return nil, badRequestf("invalid JSON body: %v", err)
	}
	req := &Request{Endpoint: endpoint, Model: raw.Model, Stream: raw.Stream}
	switch {
	case raw.MaxTokens != nil:
		req.MaxTokens = max(0, *raw.MaxTokens)
	case raw.MaxCompletionTokens != nil:
		req.MaxTokens = max(0, *raw.MaxCompletionTokens)
	}
	seed := prefixindex.Seed(req.Model, "", p.salt)
	switch endpoint {
	case EndpointCompletions:
		if err := p.hashPrompt(req, seed, raw.Prompt); err != nil {
			return nil, err
		}
	case EndpointChatCompletions:
		if err := p.hashChat(req, seed, &raw); err != nil {
			return nil, err
		}
	}
	return req, nil
}

// hashPrompt handles a completions prompt: a string, an array of strings
// (hashed as one canonical text), an array of token ids, or an array of
// such arrays.
func (p *parser) hashPrompt(req *Request, seed uint64, prompt json.RawMessage) error {
	prompt = bytes.TrimSpace(prompt)
	if len(prompt) == 0 || string(prompt) == "null" {
		return nil
	}
	switch prompt[0] {
	case '"':
		s := prompt[1 : len(prompt)-1] // valid JSON: ends with the quote
		req.Hashes = p.hasher.HashBytes(nil, seed, s)
		req.PromptTokens, req.PromptBytes = p.tokens(len(s)), len(s)
		return nil
	case '[':
	default:
		return badRequestf("invalid request: prompt must be a string, an array of strings, an array of token ids or an array of such arrays")
	}
	var tokens []int32
	if err := json.Unmarshal(prompt, &tokens); err == nil {
		req.Hashes = p.hasher.HashTokens(nil, seed, tokens)
		req.PromptTokens = len(tokens)
		return nil
	}
	var parts []json.RawMessage
	if err := json.Unmarshal(prompt, &parts); err != nil {
		return badRequestf("invalid request: prompt must be a string, an array of strings, an array of token ids or an array of such arrays")
	}
	if len(parts) > 0 && len(bytes.TrimSpace(parts[0])) > 0 && bytes.TrimSpace(parts[0])[0] == '[' {
		return p.hashTokenBatch(req, seed, parts)
	}
	c := p.hasher.NewChain(seed, nil)
	for i, part := range parts {
		part = bytes.TrimSpace(part)
		if len(part) < 2 || part[0] != '"' {
			return badRequestf("invalid request: prompt[%d] must be a string", i)
		}
		if i > 0 {
			c.WriteString(sepMessage)
		}
		c.Write(part[1 : len(part)-1])
	}
	req.Hashes = c.Hashes()
	req.PromptTokens, req.PromptBytes = p.tokens(c.Len()), c.Len()
	return nil
}

// hashTokenBatch handles a batch of prompts given as token ids
// ([[1,2,3],[4,5,6]], one completion each): the engine holds them all, so
// they are counted together and hashed as one sequence, in order, as an
// array of strings is.
func (p *parser) hashTokenBatch(req *Request, seed uint64, parts []json.RawMessage) error {
	var all []int32
	for i, part := range parts {
		var tokens []int32
		if err := json.Unmarshal(part, &tokens); err != nil {
			return badRequestf("invalid request: prompt[%d] must be an array of token ids", i)
		}
		all = append(all, tokens...)
	}
	req.Hashes = p.hasher.HashTokens(nil, seed, all)
	req.PromptTokens = len(all)
	return nil
}

// hashChat hashes the tools, then each message's role and content in
// order. Content is hashed as its raw JSON (a string's escaped bytes
// without the quotes, or the content-part array as sent).
func (p *parser) hashChat(req *Request, seed uint64, raw *openAIRequest) error {
	if raw.Messages == nil {
		return badRequestf("invalid request: messages is required")
	}
	c := p.hasher.NewChain(seed, nil)
	if tools := bytes.TrimSpace(raw.Tools); len(tools) > 0 && string(tools) != "null" {
		c.Write(tools)
		c.WriteString(sepMessage)
	}
	for i, m := range raw.Messages {
		if m.Role == "" {
			return badRequestf("invalid request: messages[%d].role is required", i)
		}
		c.WriteString(m.Role)
		c.WriteString(sepField)
		content := bytes.TrimSpace(m.Content)
		if len(content) >= 2 && content[0] == '"' {
			content = content[1 : len(content)-1]
		}
		c.Write(content)
		c.WriteString(sepMessage)
	}
	req.Hashes = c.Hashes()
	req.PromptTokens, req.PromptBytes = p.tokens(c.Len()), c.Len()
	return nil
}

func (p *parser) tokens(nbytes int) int {
	bpt := p.bytesPerToken
	if bpt <= 0 {
		bpt = prefixindex.DefaultBytesPerToken
	}
	return (nbytes + bpt - 1) / bpt
}
