package kvsim

import (
	"bytes"
	"encoding/json"
	"errors"
	"math"
	"strconv"
	"strings"
	"unicode/utf8"
)

// Endpoint says which OpenAI API a request body belongs to.
type Endpoint uint8

// The generation endpoints kvsim serves.
const (
	EndpointCompletions Endpoint = iota + 1
	EndpointChatCompletions
	// EndpointResponses is the Responses API (POST /v1/responses).
	EndpointResponses
)

// ParsedRequest is what kvsim needs of a generation request.
type ParsedRequest struct {
	Endpoint Endpoint
	// Model is the requested model: the base model, an adapter, or empty (the base model).
	Model string
	// Context is the rendered prompt text (chat template applied for chat):
	// a completions batch's first prompt, whose others are MorePrompts.
	Context     []byte
	MorePrompts [][]byte
	// MaxTokens is max_completion_tokens or else max_tokens (16 for a
	// completions request with neither, as vLLM), 0 when absent.
	MaxTokens int
	// OutputTokens is the number of tokens to generate: the smallest of max_tokens and
	// kvsim_output_tokens, or the engine default when both are absent (a chat request
	// without max_tokens: the model stops when it is done).
	OutputTokens int
	// LengthLimited reports that max_tokens set OutputTokens (finish reason "length").
	LengthLimited bool
	Stream        bool
	IncludeUsage  bool
	// ContinuousUsage is stream_options.continuous_usage_stats (with
	// include_usage): every chunk carries the usage so far.
	ContinuousUsage bool
	// N is the number of choices to generate (1 when absent): n
	// sequences of the same prompt, each with its own output, as vLLM's
	// parallel sampling.
	N int
	// The Responses API's: the conversation as chat messages (the input,
	// without the instructions), the instructions and tools to render it
	// with, the stored response it continues, and whether to store this
	// one (store defaults to true). With a previous response the server
	// renders Context once it has looked the response up.
	Messages           []ChatMessage
	Instructions       *string
	Tools              json.RawMessage
	PreviousResponseID string
	Store              bool
	// Background: the answer is the response queued (or, streamed, its
	// events as they come), generated after it and retrieved by its id
	// (store must be on).
	Background bool
	// CacheSalt is vLLM's cache_salt (see Request.CacheSalt).
	CacheSalt string
	// Echo is a completion's echo: each choice's text begins with its
	// prompt (streamed, in the choice's first chunk), as vLLM sends it.
	Echo bool
	// CapsMaxTokens says the output is cut to what the context leaves
	// after the prompt rather than refused beyond it: vLLM's Responses
	// API's max_output_tokens, and a chat request without max_tokens
	// (vLLM then lets it run to the context's end).
	CapsMaxTokens bool
}

// requestBody is the JSON of both endpoints; unknown fields are ignored, as vLLM ignores
// sampling parameters a simulator does not need.
type requestBody struct {
	Model    string          `json:"model"`
	Prompt   json.RawMessage `json:"prompt"`
	Messages []ChatMessage   `json:"messages"`
	Tools    json.RawMessage `json:"tools"`
	// ToolChoice is kept raw: only checked against tools, as vLLM's
	// request model does.
	ToolChoice json.RawMessage `json:"tool_choice"`
	// CacheSalt is vLLM's cache_salt, a non-empty string when given.
	CacheSalt *string `json:"cache_salt"`
	// The numbers and stream are read as vLLM's pydantic models read them,
	// in lax mode: 16.0 and "16" are 16, "true" and 1 are true.
	MaxTokens           *laxInt `json:"max_tokens"`
	MaxCompletionTokens *laxInt `json:"max_completion_tokens"`
	// KvsimOutputTokens is kvsim's own field: the number of tokens the simulated model
	// "wants" to generate before stopping, so trace replays reproduce recorded lengths.
	KvsimOutputTokens    *laxInt `json:"kvsim_output_tokens"`
	N                    *laxInt `json:"n"`
	Stream               laxBool `json:"stream"`
	AddGenerationPrompt  *bool   `json:"add_generation_prompt"`
	ContinueFinalMessage bool    `json:"continue_final_message"`
	// StreamOptions is kept raw: vLLM refuses a non-empty one without
	// stream, and include_usage defaults to true in it.
	StreamOptions map[string]json.RawMessage `json:"stream_options"`
	// The Responses API's: the input (a string or an array of items),
	// the instructions (a system message) and max_output_tokens.
	// Raw, as the chat and completions APIs ignore them whatever they
	// hold.
	Input              json.RawMessage `json:"input"`
	Instructions       json.RawMessage `json:"instructions"`
	MaxOutputTokens    json.RawMessage `json:"max_output_tokens"`
	PreviousResponseID json.RawMessage `json:"previous_response_id"`
	Store              json.RawMessage `json:"store"`
	Background         json.RawMessage `json:"background"`
	// Suffix is the completions API's; vLLM refuses any.
	Suffix json.RawMessage `json:"suffix"`
	// Echo is read for completions only (a chat's echo repeats its final
	// message, which kvsim does not model).
	Echo laxBool `json:"echo"`
}

// foreignFields are, for each API, the fields of the others that kvsim
// reads.
var foreignFields = map[Endpoint]map[string]bool{
	EndpointCompletions: {"messages": true, "max_completion_tokens": true, "add_generation_prompt": true, "continue_final_message": true,
		"input": true, "instructions": true, "max_output_tokens": true, "previous_response_id": true, "store": true, "background": true},
	EndpointChatCompletions: {"prompt": true, "input": true, "instructions": true, "max_output_tokens": true, "previous_response_id": true,
		"store": true, "background": true},
	EndpointResponses: {"prompt": true, "messages": true, "max_tokens": true, "max_completion_tokens": true, "n": true,
		"add_generation_prompt": true, "continue_final_message": true, "stream_options": true},
}

// decodeRequestBody decodes body for endpoint. Another API's fields are
// extra fields to this one, which vLLM ignores whatever they hold: a body
// that does not decode is decoded again without them (the other APIs'
// fields it holds are otherwise not read for this endpoint).
func decodeRequestBody(endpoint Endpoint, body []byte) (*requestBody, error) {
	body, err := jsonText(body)
	if err != nil {
		return nil, err
	}
	var rb requestBody
	if json.Unmarshal(body, &rb) == nil {
		return &rb, nil
	}
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(body, &fields); err != nil {
		return nil, errBadRequestf("Invalid JSON body: %v", err)
	}
	for key := range fields {
		if foreignFields[endpoint][strings.ToLower(key)] {
			delete(fields, key)
		}
	}
	body, _ = json.Marshal(fields)
	rb = requestBody{}
	if err := json.Unmarshal(body, &rb); err != nil {
		return nil, errBadRequestf("Invalid JSON body: %v", err)
	}
	return &rb, nil
}

// jsonText is a request body as vLLM's server reads it before parsing
// its JSON: a UTF-8 byte order mark skipped (Python's json.loads skips
// one), and a body that is not UTF-8 refused with FastAPI's 400 (Python
// decodes the body first, where Go's parser would put U+FFFD in).
func jsonText(body []byte) ([]byte, error) {
	body = bytes.TrimPrefix(body, []byte("\xef\xbb\xbf"))
	if !utf8.Valid(body) {
		return nil, errBadRequest("There was an error parsing the body")
	}
	return body, nil
}

// responsesFields are the Responses API's own fields of a request.
type responsesFields struct {
	Instructions       *string `json:"instructions"`
	MaxOutputTokens    *laxInt `json:"max_output_tokens"`
	PreviousResponseID *string `json:"previous_response_id"`
	// Store is read as pydantic's lax mode reads a boolean: false, 0 and
	// "false" (and the like) are false; "maybe" or 2 are no boolean.
	// StoreSet says the request has the field (null included).
	Store    *laxBool `json:"store"`
	StoreSet bool     `json:"-"`
	// Background asks for the response to be generated after the answer
	// (vLLM's background mode).
	Background *laxBool `json:"background"`
}

// decode reads the Responses API's fields of rb.
func (rb *requestBody) responsesFields() (responsesFields, error) {
	var f responsesFields
	for _, field := range []struct {
		raw  json.RawMessage
		dst  any
		name string
	}{
		{rb.Instructions, &f.Instructions, "instructions"},
		{rb.MaxOutputTokens, &f.MaxOutputTokens, "max_output_tokens"},
		{rb.PreviousResponseID, &f.PreviousResponseID, "previous_response_id"},
		{rb.Store, &f.Store, "store"},
		{rb.Background, &f.Background, "background"},
	} {
		if len(field.raw) > 0 {
			if err := json.Unmarshal(field.raw, field.dst); err != nil {
				return f, errBadRequestf("%s: %v", field.name, err)
			}
		}
	}
	f.StoreSet = len(rb.Store) > 0
	return f, nil
}

// maxChoices bounds n: each choice is a sequence in the engine.
const maxChoices = 128

// completionsDefaultMaxTokens is vLLM's max_tokens for a completions request
// without one (CompletionRequest's default, as OpenAI's legacy API had).
const completionsDefaultMaxTokens = 16

// ParseRequest parses and validates a generation request body. defaultOutput is the length
// when neither max_tokens nor kvsim_output_tokens is set. Errors are 400 *APIErrors.
func ParseRequest(endpoint Endpoint, body []byte, tok *Tokenizer, defaultOutput int) (*ParsedRequest, error) {
	rb, err := decodeRequestBody(endpoint, body)
	if err != nil {
		return nil, err
	}
	p := &ParsedRequest{Endpoint: endpoint, Model: rb.Model, Stream: bool(rb.Stream)}
	if rb.CacheSalt != nil {
		if *rb.CacheSalt == "" {
			return nil, errBadRequest("Parameter 'cache_salt' must be a non-empty string if provided.")
		}
		p.CacheSalt = *rb.CacheSalt
	}
	if endpoint == EndpointResponses {
		// n and stream_options are not its own: ignored, as other APIs'
		// fields are.
		rb.N, rb.StreamOptions = nil, nil
	}
	if len(rb.StreamOptions) > 0 {
		if !rb.Stream {
			return nil, errBadRequest("Stream options can only be defined when `stream=True`.")
		}
		p.IncludeUsage = true // vLLM's StreamOptions default
		if raw, ok := rb.StreamOptions["include_usage"]; ok {
			// null is None there, which includes none.
			var include laxBool
			if err := json.Unmarshal(raw, &include); err != nil {
				return nil, errBadRequestf("stream_options.include_usage must be a boolean: %v", err)
			}
			p.IncludeUsage = bool(include)
		}
		if raw, ok := rb.StreamOptions["continuous_usage_stats"]; ok {
			var continuous laxBool
			if err := json.Unmarshal(raw, &continuous); err != nil {
				return nil, errBadRequestf("stream_options.continuous_usage_stats must be a boolean: %v", err)
			}
			// Only with include_usage, as vLLM's should_include_usage.
			p.ContinuousUsage = p.IncludeUsage && bool(continuous)
		}
	} else if rb.StreamOptions != nil && rb.Stream {
		p.IncludeUsage = true // {}: every option at its default
	}
	p.N = 1
	if rb.N != nil {
		if p.N = int(*rb.N); p.N < 1 {
			return nil, errBadRequestf("n must be at least 1, got %d.", p.N)
		}
		if p.N > maxChoices {
			return nil, errBadRequestf("n must be at most %d in kvsim", maxChoices)
		}
	}
	// vLLM takes max_completion_tokens over max_tokens (the chat API's
	// newer name), and gives a completions request without either 16.
	// max_completion_tokens is the chat API's alone.
	maxTokens := intOf(rb.MaxCompletionTokens)
	if maxTokens == nil || endpoint != EndpointChatCompletions {
		maxTokens = intOf(rb.MaxTokens)
	}
	var rf responsesFields
	p.Store = true
	if endpoint == EndpointResponses {
		var err error
		if rf, err = rb.responsesFields(); err != nil {
			return nil, err
		}
		maxTokens = intOf(rf.MaxOutputTokens)
		p.CapsMaxTokens = true
	}
	if maxTokens == nil && endpoint == EndpointCompletions {
		n := completionsDefaultMaxTokens
		maxTokens = &n
	}
	if maxTokens == nil {
		p.CapsMaxTokens = true
	}
	p.OutputTokens = defaultOutput
	if maxTokens != nil {
		if *maxTokens < 1 {
			return nil, errBadRequestf("max_tokens must be at least 1, got %d.", *maxTokens)
		}
		p.MaxTokens = *maxTokens
		p.OutputTokens = *maxTokens
		p.LengthLimited = true
	}
	if want := intOf(rb.KvsimOutputTokens); want != nil {
		if *want < 1 {
			return nil, errBadRequestf("kvsim_output_tokens must be at least 1, got %d.", *want)
		}
		if maxTokens == nil || *want < *maxTokens {
			p.OutputTokens = *want
			p.LengthLimited = false
		}
	}

	switch endpoint {
	case EndpointCompletions:
		if suffix := bytes.TrimSpace(rb.Suffix); len(suffix) > 0 && string(suffix) != "null" {
			// vLLM's serving code refuses it (request.suffix is not None).
			if suffix[0] != '"' {
				return nil, errBadRequest("suffix: Input should be a valid string")
			}
			return nil, errBadRequest("suffix is not currently supported")
		}
		p.Echo = bool(rb.Echo)
		var prompts [][]byte
		if prompts, err = parsePrompt(rb.Prompt, tok); err == nil {
			p.Context, p.MorePrompts = prompts[0], prompts[1:]
			if (1+len(p.MorePrompts))*p.N > maxChoices {
				err = errBadRequestf("a batch of %d prompts with n %d: at most %d sequences in kvsim", 1+len(p.MorePrompts), p.N, maxChoices)
			}
		}
	case EndpointChatCompletions:
		if len(rb.Messages) == 0 {
			return nil, errBadRequest("messages must be a non-empty list")
		}
		if p.Context, err = chatPrompt(rb.Messages, rb.Tools, rb.ToolChoice, rb.AddGenerationPrompt, rb.ContinueFinalMessage); err != nil {
			return nil, err
		}
		if rb.ContinueFinalMessage && maxTokens == nil && rb.KvsimOutputTokens == nil {
			// The simulated model's own length is its answer's: a final
			// message it continues has that much of it already, so an
			// answer cut and continued elsewhere stops where the whole
			// one would (a real model stops on what it has written).
			var final bytes.Buffer
			if err := renderContent(&final, rb.Messages[len(rb.Messages)-1].Content); err != nil {
				return nil, errBadRequestf("messages: %v", err)
			}
			p.OutputTokens = max(1, p.OutputTokens-tok.CountTokens(final.Len()))
		}
	case EndpointResponses:
		p.Tools = rb.Tools
		if rf.StoreSet { // null is None in vLLM's request: not stored
			p.Store = rf.Store != nil && bool(*rf.Store)
		}
		if p.Background = rf.Background != nil && bool(*rf.Background); p.Background && !p.Store {
			return nil, errBadRequest("background can only be used when `store` is true")
		}
		if rf.Instructions != nil && *rf.Instructions != "" { // empty: none, as in vLLM
			p.Instructions = rf.Instructions
		}
		if rf.PreviousResponseID != nil {
			p.PreviousResponseID = *rf.PreviousResponseID
		}
		p.Messages, err = responsesMessages(rb.Input)
		if err == nil && rf.PreviousResponseID != nil && p.PreviousResponseID == "" {
			// vLLM looks up any id that is not None, once the request
			// is valid: "" is none it holds.
			return nil, errResponseNotFound("")
		}
		if err == nil && p.PreviousResponseID == "" {
			p.Context, err = p.RenderResponses(nil)
		}
		if err == nil && p.PreviousResponseID != "" {
			return p, nil // rendered once the previous response is found
		}
	default:
		return nil, errBadRequest("unknown endpoint")
	}
	if err != nil {
		return nil, err
	}
	if len(p.Context) == 0 {
		return nil, errBadRequest("The prompt must not be empty.")
	}
	return p, nil
}

// chatPrompt checks a chat's messages, tools and template options and
// renders the prompt: what a chat completion generates from and what
// /tokenize counts for the same fields, one code for both so that a
// tokenization's count is the usage.prompt_tokens of the generation.
// addGenerationPrompt nil is its default, true.
func chatPrompt(messages []ChatMessage, tools, toolChoice json.RawMessage, addGenerationPrompt *bool, continueFinalMessage bool) ([]byte, error) {
	addGen := addGenerationPrompt == nil || *addGenerationPrompt
	if addGen && continueFinalMessage {
		return nil, errBadRequest("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
	}
	if continueFinalMessage && (len(messages) == 0 || messages[len(messages)-1].Role != "assistant") {
		return nil, errBadRequest("continue_final_message requires the last message to be an assistant message")
	}
	if err := checkToolUse(tools, toolChoice); err != nil {
		return nil, err
	}
	return RenderChat(messages, tools, addGen, continueFinalMessage)
}

// checkToolUse refuses, with vLLM's 400s, chat tools that are not a list,
// and a tool_choice that names no tool given: one other than "none"
// without tools, a string other than "auto" and "required", and an object
// whose function is not among the tools (vLLM's
// ChatCompletionRequest.check_tool_usage). It does not force the named
// tool's call, as vLLM's guided decoding would: kvsim's output is text.
func checkToolUse(tools, toolChoice json.RawMessage) error {
	var list []struct {
		Function struct {
			Name string `json:"name"`
		} `json:"function"`
	}
	isNull := func(raw json.RawMessage) bool {
		raw = bytes.TrimSpace(raw)
		return len(raw) == 0 || bytes.Equal(raw, []byte("null"))
	}
	if !isNull(tools) {
		if err := json.Unmarshal(tools, &list); err != nil {
			return errBadRequest("tools: Input should be a valid list")
		}
	}
	if isNull(toolChoice) {
		return nil
	}
	var choice string
	if json.Unmarshal(toolChoice, &choice) == nil && choice == "none" {
		return nil
	}
	if isNull(tools) {
		return errBadRequest("When using `tool_choice`, `tools` must be set.")
	}
	if json.Unmarshal(toolChoice, &choice) == nil {
		if choice != "auto" && choice != "required" {
			return errBadRequestf(`Invalid value for `+"`tool_choice`"+`: %s! Only named tools, "none", "auto" or "required" are supported.`, choice)
		}
		return nil
	}
	var named struct {
		Function *struct {
			Name *string `json:"name"`
		} `json:"function"`
	}
	if json.Unmarshal(toolChoice, &named) != nil || named.Function == nil || named.Function.Name == nil || *named.Function.Name == "" {
		return errBadRequest("Invalid value for `tool_choice`: a named tool choice must be {\"type\": \"function\", \"function\": {\"name\": \"my_function\"}}.")
	}
	for _, tool := range list {
		if tool.Function.Name == *named.Function.Name {
			return nil
		}
	}
	return errBadRequest("The tool specified in `tool_choice` does not match any of the specified `tools`")
}

// parsePrompt accepts a string, a token-id array, or a batch of either
// (one sequence each, as vLLM runs them), and returns the prompts' texts.
func parsePrompt(raw json.RawMessage, tok *Tokenizer) ([][]byte, error) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || bytes.Equal(raw, []byte("null")) {
		return nil, errBadRequest("prompt is required")
	}
	if raw[0] == '[' {
		var items []json.RawMessage
		if err := json.Unmarshal(raw, &items); err != nil {
			return nil, errBadRequestf("prompt: %v", err)
		}
		if len(items) == 0 {
			return nil, errBadRequest("The prompt must not be empty.")
		}
		if first := bytes.TrimSpace(items[0]); len(first) > 0 && (first[0] == '"' || first[0] == '[') {
			prompts := make([][]byte, 0, len(items))
			for i, item := range items {
				if item = bytes.TrimSpace(item); len(item) == 0 || item[0] != first[0] {
					return nil, errBadRequestf("prompt[%d] must be of the batch's first prompt's kind", i)
				}
				text, err := parseOnePrompt(item, tok)
				if err != nil {
					return nil, err
				}
				if len(text) == 0 {
					return nil, errBadRequest("The prompt must not be empty.")
				}
				prompts = append(prompts, text)
			}
			return prompts, nil
		}
	}
	text, err := parseOnePrompt(raw, tok)
	if err != nil {
		return nil, err
	}
	return [][]byte{text}, nil
}

// VocabSize is the number of token ids of the simulated model's
// embeddings: Llama 3.1's vocabulary. A prompt's token id above both it
// and its tokenizer's largest ([Tokenizer.MaxTokenID]) is refused, as
// vLLM refuses one.
const VocabSize = 128_256

// promptTokenID reads one token id of a prompt: a JSON number without a
// fractional part, within the vocabulary.
func promptTokenID(num json.RawMessage, tok *Tokenizer) (int64, error) {
	if len(num) == 0 || num[0] != '-' && (num[0] < '0' || num[0] > '9') {
		return 0, errBadRequest("prompt must be a string, an array of token ids, or a batch of either")
	}
	id, err := strconv.ParseInt(string(num), 10, 64)
	if err != nil {
		f, err := strconv.ParseFloat(string(num), 64)
		if err != nil && !errors.Is(err, strconv.ErrRange) || f != math.Trunc(f) {
			return 0, errBadRequest("prompt must be a string, an array of token ids, or a batch of either")
		}
		if f < 0 || f > float64(tok.MaxTokenID()) {
			return 0, errBadRequestf("Token id %.0f is out of vocabulary", f)
		}
		id = int64(f)
	}
	if id < 0 || id > tok.MaxTokenID() {
		return 0, errBadRequestf("Token id %d is out of vocabulary", id)
	}
	return id, nil
}

// parseOnePrompt reads one prompt: a string or an array of token ids.
func parseOnePrompt(raw json.RawMessage, tok *Tokenizer) ([]byte, error) {
	switch raw[0] {
	case '"':
		var s string
		if err := json.Unmarshal(raw, &s); err != nil {
			return nil, errBadRequestf("prompt: %v", err)
		}
		return []byte(s), nil
	case '[':
		// vLLM's request model reads token ids in pydantic's lax mode, so
		// 2.0 is token 2; its engine then refuses an id outside the
		// model's vocabulary. Read as integers: ids reach 2^56.
		var nums []json.RawMessage
		if err := json.Unmarshal(raw, &nums); err != nil {
			return nil, errBadRequest("prompt must be a string, an array of token ids, or a batch of either")
		}
		ids := make([]int64, len(nums))
		for i, num := range nums {
			id, err := promptTokenID(num, tok)
			if err != nil {
				return nil, err
			}
			ids[i] = id
		}
		return tok.TokenIDsToText(ids), nil
	}
	return nil, errBadRequest("prompt must be a string, an array of token ids, or a batch of either")
}
