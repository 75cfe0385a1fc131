package caddyllm

import (
	"bytes"
	"cmp"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"unicode/utf8"

	"github.com/llmaffinity/caddy-llm-affinity/prefixindex"
	"github.com/llmaffinity/caddy-llm-affinity/router"
	"github.com/llmaffinity/caddy-llm-affinity/scorer"
)

// Endpoint says which OpenAI API a request targets.
type Endpoint uint8

// Endpoints the handler parses.
const (
	EndpointOther Endpoint = iota
	EndpointCompletions
	EndpointChatCompletions
	// EndpointResponses is the Responses API (POST /v1/responses), which
	// vLLM serves too and agent frameworks use.
	EndpointResponses
)

func (e Endpoint) String() string {
	switch e {
	case EndpointCompletions:
		return "completions"
	case EndpointChatCompletions:
		return "chat"
	case EndpointResponses:
		return "responses"
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
	case strings.HasSuffix(path, "/responses"):
		return EndpointResponses
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
	// model's. (A base model's names seed as one, see seed.) The policy
	// works out whether it names an adapter.
	Model string
	// PromptTokens is the estimated prompt length in tokens (exact when
	// the prompt was given as token ids).
	PromptTokens int
	// PromptBytes is the length of the text PromptTokens was estimated
	// from (bytes_per_token), 0 when the prompt was token ids. A
	// message's content parts count their text only: the parts' keys and
	// punctuation are not the engine's text, and media parts (images,
	// audio, files) are hashed but not counted, their bytes saying
	// nothing of their tokens.
	PromptBytes int
	// Media says the prompt has media parts: the engine's count of its
	// tokens includes theirs, so its usage teaches no bytes per token.
	Media bool
	// LongestPromptTokens is, for a batch of completions prompts (an
	// array of strings or of token-id arrays), the longest one's tokens,
	// estimated as PromptTokens is: the engine runs each as a sequence of
	// its own. 0 for a single prompt.
	LongestPromptTokens int
	// MaxTokens is max_tokens or max_completion_tokens (max_output_tokens
	// for the Responses API), 0 when absent; maxCompletionTokens says it
	// was max_completion_tokens, for the messages that name it.
	MaxTokens           int
	maxCompletionTokens bool
	// Sequences is how many sequences the engine generates: a batch's
	// prompts times n, the choices asked for each (chat and completions);
	// 1 for one prompt and one choice. Each takes its own output's KV,
	// and usage counts all their output together.
	Sequences int
	// Stream is the request's stream flag.
	Stream bool
	// Hashes are the block hashes of the canonical prompt, chained from
	// the model's seed once seed is called (before that, each block's
	// own hash).
	Hashes []uint64
	// salt is what the chain's seed mixes in besides the model (the
	// handler's salt and the request's cache_salt); seeded says Hashes
	// are chained.
	salt   string
	seeded bool
	// seeds caches the seeds of salt, the parser's own (nil for a
	// request with a cache_salt).
	seeds *seedCache
	// BlockTokens is the number of tokens one hash covers.
	BlockTokens int
	// PreviousResponseID is the Responses API's previous_response_id:
	// the response, stored by the engine that answered it, whose
	// conversation this request continues. Empty when none.
	PreviousResponseID string
	// NoStore is the Responses API's store set to false: the engine
	// keeps no copy of the response for a later previous_response_id.
	NoStore bool
	// Background is the Responses API's background set to true: the
	// engine answers at once, queued, and generates after the answer, so
	// the answer says nothing of the time to its first token.
	Background bool
}

// maxResponseIDBytes bounds previous_response_id: ids are short ("resp_"
// and 32 hex digits in vLLM), and a longer one names nothing the fleet
// remembers.
const maxResponseIDBytes = router.MaxResponseIDBytes

// errBadRequest is returned for bodies that are not the API's shape;
// param names the field at fault, as the API's errors do (empty: none).
type errBadRequest struct{ msg, param string }

func (e errBadRequest) Error() string { return e.msg }

func badRequestf(param, format string, args ...any) error {
	return errBadRequest{msg: fmt.Sprintf(format, args...), param: param}
}

// maxSequences bounds Request.Sequences.
const maxSequences = scorer.MaxSequences

// maxModelNameBytes bounds the model name.
const maxModelNameBytes = 512

var errModelTooLong = badRequestf("model", "invalid request: model must be at most %d bytes", maxModelNameBytes)

// errEmptyCacheSalt is vLLM's answer to an empty cache_salt.
var errEmptyCacheSalt = badRequestf("cache_salt", "invalid request: cache_salt must be a non-empty string if provided")

// saltWith is the salt the prefix hashes of a request with vLLM's
// cache_salt are seeded with: the engine caches a salted prompt apart
// (its first block's hash takes the salt), so its prefix is another one
// here too, and an unsalted request's hashes are as they were.
func saltWith(configured, cacheSalt string) string {
	return configured + "\x00cache_salt\x00" + cacheSalt
}

// tooLongMessage explains the refusal of a request too long for every
// upstream, its prompt counted as prompt tokens (the decision's count).
func (r *Request) tooLongMessage(prompt int) string {
	if r.MaxTokens <= 0 {
		return fmt.Sprintf("The prompt is about %s, more than any upstream serving the model holds (its KV cache, or the model's context length there).", tokensText(prompt))
	}
	name := "max_tokens"
	switch {
	case r.Endpoint == EndpointResponses:
		name = "max_output_tokens"
	case r.maxCompletionTokens:
		name = "max_completion_tokens"
	}
	return fmt.Sprintf("The prompt is about %s and %s is %d, more in all than any upstream serving the model holds (its KV cache, or the model's context length there).", tokensText(prompt), name, r.MaxTokens)
}

// tokensText is n tokens in words.
func tokensText(n int) string {
	if n == 1 {
		return "1 token"
	}
	return fmt.Sprintf("%d tokens", n)
}

// promptParam names the field that holds the request's prompt.
func (r *Request) promptParam() string {
	switch r.Endpoint {
	case EndpointChatCompletions:
		return "messages"
	case EndpointResponses:
		return "input"
	}
	return "prompt"
}

// Separators keep the canonical form unambiguous: a role can never run
// into content, so turn n+1 of a chat extends turn n byte for byte.
const (
	sepField   = "\x1f"
	sepMessage = "\x1e"
)

// parser turns request bodies into Requests in one pass over the body: it
// validates the JSON as encoding/json would, picks out the fields routing
// needs and feeds the prompt's bytes to the block hasher as they are
// found, without copying them or decoding the body into Go values. The
// canonical prompt, and so every hash, is what the earlier
// encoding/json-based parser produced (request_ref_test.go keeps it as
// the reference).
type parser struct {
	hasher        prefixindex.Hasher
	bytesPerToken int
	salt          string

	// scratch pools what a parse needs beyond its result: the scanner's
	// nesting stack, the block buffer and the messages' ranges.
	scratch *sync.Pool
	// model is the last model name seen, so that the usual request, for
	// the same model as the one before, does not allocate its name.
	model *atomic.Pointer[string]
	// seeds are the chain seeds of the models requests named, with salt.
	seeds *seedCache
}

// seedCache keeps the chain seeds (prefixindex.Seed) of the last few
// models seeded with salt, a parser's: a seed is xxh3 over the model and
// the salt, and most requests name one of a few models. An entry, never
// changed once stored, replaces the oldest on a miss, which allocates
// it: requests alternating among up to len(entries) models allocate
// none.
type seedCache struct {
	salt    string
	entries [4]atomic.Pointer[seedEntry]
	next    atomic.Uint32
}

// seedEntry is the seed of model.
type seedEntry struct {
	model string
	seed  uint64
}

// of returns model's seed with c's salt.
func (c *seedCache) of(model string) uint64 {
	for i := range c.entries {
		if e := c.entries[i].Load(); e != nil && e.model == model {
			return e.seed
		}
	}
	seed := prefixindex.Seed(model, "", c.salt)
	c.entries[c.next.Add(1)%uint32(len(c.entries))].Store(&seedEntry{model: model, seed: seed})
	return seed
}

// newParser returns a parser hashing with hasher.
func newParser(hasher prefixindex.Hasher, bytesPerToken int, salt string) *parser {
	return &parser{
		hasher: hasher, bytesPerToken: bytesPerToken, salt: salt,
		scratch: &sync.Pool{New: func() any { return new(parseScratch) }},
		model:   new(atomic.Pointer[string]),
		seeds:   &seedCache{salt: salt},
	}
}

// The largest buffers a parse's scratch keeps for the next parse.
const (
	maxPooledMessages = 4096
	maxPooledDecode   = 1 << 20
)

// parseScratch is the reusable part of one parse.
type parseScratch struct {
	s      scanner
	depth  [maxDepth/64 + 1]uint64
	blocks prefixindex.Blocks
	msgs   []msgRange
	extras []msgExtra
	key    [64]byte
	dec    []byte
}

// trim drops a huge request's buffers, not kept for the next parse.
func (sc *parseScratch) trim() {
	if cap(sc.msgs) > maxPooledMessages || cap(sc.extras) > maxPooledMessages || cap(sc.dec) > maxPooledDecode {
		sc.msgs, sc.extras, sc.dec = nil, nil, nil
	}
}

// span is a range of the body.
type span struct{ start, end int }

// msgRange is where a chat message's role and content are in the body:
// the role's string contents, and the content's value (a string's
// contents, or the raw array or other value as sent). A Responses API
// input item without a role has its type as the role and the whole item
// as the content; the input given as a string, and the instructions, have
// an implied role instead of one in the body.
type msgRange struct {
	role        span
	roleEscaped bool
	// implied is the role when the body has none: impliedUser or
	// impliedSystem (a byte, so a range stays 40 bytes: a body of
	// millions of tiny messages keeps one each).
	implied uint8
	// extra is 1 + the index of the message's msgExtra in the scratch's
	// extras, 0 when it has none.
	extra   uint32
	content span
}

// msgExtra is what few messages have: a chat message's name,
// tool_call_id and tool_calls (a string's contents, or the value as
// sent; unset when absent or null), which the engine's chat template
// renders.
type msgExtra struct {
	name, toolCallID, toolCalls span
}

// Roles implied by the Responses API's input string and instructions.
const (
	impliedNone uint8 = iota
	impliedUser
	impliedSystem
)

// Fields of a request body, and of a chat message, that routing reads.
// Keys match exactly, as vLLM's request models (pydantic) match them: a
// "Model" beside "model" is another, unknown, field.
var (
	topFields  = [...]string{"model", "prompt", "messages", "tools", "max_tokens", "max_completion_tokens", "stream", "input", "instructions", "max_output_tokens", "previous_response_id", "store", "n", "cache_salt", "background"}
	msgFields  = [...]string{"role", "content", "type", "name", "tool_call_id", "tool_calls"}
	itemFields = [...]string{"role", "content", "type"}
	partFields = [...]string{"type", "text", "refusal"}
)

// textParts are the content part types that hold the prompt's text (a
// refusal in its "refusal", the others in their "text"); the others
// (images, audio, files) are media.
var textParts = [...]string{"text", "input_text", "output_text", "refusal", "reasoning_text", "summary_text"}

// Kinds of content part, by type.
const (
	partOther   = iota // no type, or not a string: not text the engine reads
	partText           // its "text" is text
	partRefusal        // its "refusal" is text
	partMedia          // an image, audio, a file: none of it is text
)

// partKind is the kind of a content part typed typ.
func partKind(typ []byte) int {
	switch {
	case string(typ) == "refusal":
		return partRefusal
	case slices.Contains(textParts[:], string(typ)):
		return partText
	}
	return partMedia
}

const (
	fieldModel = iota
	fieldPrompt
	fieldMessages
	fieldTools
	fieldMaxTokens
	fieldMaxCompletionTokens
	fieldStream
	fieldInput
	fieldInstructions
	fieldMaxOutputTokens
	fieldPreviousResponseID
	fieldStore
	fieldN
	fieldCacheSalt
	fieldBackground
	fieldOther = -1
	// fieldBody stands for the body itself, in a type error.
	fieldBody = len(topFields)
)

const (
	fieldRole = iota
	fieldContent
	fieldType
	fieldName
	fieldToolCallID
	fieldToolCalls
)

const (
	fieldPartType = iota
	fieldPartText
	fieldPartRefusal
)

// topField is the index of key in topFields, or fieldOther, for a
// request body's keys, every one of which is looked up: the compiler
// makes the switch a search by length and compares with constants, where
// a loop over the names calls memequal for each name of the key's length
// in turn (TestFieldSwitches keeps the switches and the names as one).
func topField(key []byte) int {
	switch string(key) {
	case "model":
		return fieldModel
	case "prompt":
		return fieldPrompt
	case "messages":
		return fieldMessages
	case "tools":
		return fieldTools
	case "max_tokens":
		return fieldMaxTokens
	case "max_completion_tokens":
		return fieldMaxCompletionTokens
	case "stream":
		return fieldStream
	case "input":
		return fieldInput
	case "instructions":
		return fieldInstructions
	case "max_output_tokens":
		return fieldMaxOutputTokens
	case "previous_response_id":
		return fieldPreviousResponseID
	case "store":
		return fieldStore
	case "n":
		return fieldN
	case "cache_salt":
		return fieldCacheSalt
	case "background":
		return fieldBackground
	}
	return fieldOther
}

// msgField is the index of key in msgFields, or fieldOther, for a chat
// message's keys and a Responses API input item's (itemFields, the first
// three), a switch as topField is: a long conversation has a few keys a
// message.
func msgField(key []byte) int {
	switch string(key) {
	case "role":
		return fieldRole
	case "content":
		return fieldContent
	case "type":
		return fieldType
	case "name":
		return fieldName
	case "tool_call_id":
		return fieldToolCallID
	case "tool_calls":
		return fieldToolCalls
	}
	return fieldOther
}

// partField is the index of key in partFields, or fieldOther, for a
// content part's keys, a switch as topField is.
func partField(key []byte) int {
	switch string(key) {
	case "type":
		return fieldPartType
	case "text":
		return fieldPartText
	case "refusal":
		return fieldPartRefusal
	}
	return fieldOther
}

// equalFold is bytes.EqualFold against a lower-case ASCII name, without
// converting it.
func equalFold(key []byte, name string) bool {
	if len(key) != len(name) {
		// Only non-ASCII keys (the Kelvin sign folds to k) can match at a
		// different length.
		for _, c := range key {
			if c >= utf8.RuneSelf {
				return bytes.EqualFold(key, []byte(name))
			}
		}
		return false
	}
	for i, c := range key {
		if 'A' <= c && c <= 'Z' {
			c += 'a' - 'A'
		}
		if c != name[i] {
			if c >= utf8.RuneSelf {
				return bytes.EqualFold(key, []byte(name))
			}
			return false
		}
	}
	return true
}

// optInt is an integer field that may be absent or null.
type optInt struct {
	v   int
	set bool
}

// reading is the state of one parse.
type reading struct {
	p        *parser
	endpoint Endpoint
	body     []byte
	s        *scanner
	sc       *parseScratch
	// typeErrs are the values of the wrong type, in the body's order,
	// each the first of its top-level field (fieldBody for the body
	// itself), reported unless the body is not JSON at all, as
	// encoding/json does. vLLM reads the body with Python's json.loads,
	// where a key's last value wins: a later value of the same field
	// takes the earlier one's error back. field is the top-level field
	// being read.
	typeErrs []fieldError
	field    int

	model        span
	modelEscaped bool
	modelSet     bool
	// cacheSalt is vLLM's cache_salt: the engine's prefix cache serves a
	// salted prompt only to requests with the same salt.
	cacheSalt        span
	cacheSaltEscaped bool
	cacheSaltSet     bool
	maxTokens        optInt
	maxCompletion    optInt
	n                optInt // choices a prompt (chat, completions)
	stream           bool

	// hashes is the result's slice, shared by every restart of the
	// blocks (a key given twice: the last one wins).
	hashes []uint64

	// Chat: the tools value (set unless absent or null), whether the
	// messages are an array, the messages' first semantic error, and
	// which tools the blocks hashed ahead of the messages.
	tools        span
	toolsSet     bool
	messagesSeen bool
	// toolsExtra and msgsExtra are the bytes of the tools and of the
	// messages kept (or the Responses input's items) that are hashed but
	// are not text as the engine reads it: the escapes' bytes beyond the
	// text (see scanner.escapeExtra) and, of the messages' arrays of
	// content parts, all but the parts' text. The prompt's size is its
	// text's. msgsMedia says a message kept has media parts.
	toolsExtra, msgsExtra int
	msgsMedia             bool
	messagesErr           error
	hashedTools           span
	hashedSet             bool

	// Responses: whether the input was given (a string or an array; its
	// items are in the scratch's msgs), its first error, the
	// instructions' string contents (set when not empty) and their error,
	// and max_output_tokens. The input's and instructions' errors are
	// the last value's: a key given again replaces them, as its value.
	inputSeen         bool
	inputErr          error
	instructions      span
	instructionsSet   bool
	instructionsErr   error
	instructionsExtra int
	maxOutput         optInt
	previous          span
	previousEscaped   bool
	previousSet       bool
	noStore           bool
	background        bool

	// Completions: the prompt's shape error, its size in tokens and, for
	// text, in bytes (0 for token ids).
	promptErr    error
	promptSet    bool
	promptTokens int
	promptBytes  int
	// prompts counts a batch's prompts, longest is the longest one's
	// tokens.
	prompts, longest int
}

// parseInto reads body for endpoint into req (the handler keeps it in
// the request's state, saving an allocation). Its hashes wait for their
// seed (see Request.seed): the model's name for the prefix cache is the
// policy's to tell, from the engines' model lists. It never panics;
// errors are errBadRequest.
func (p *parser) parseInto(req *Request, endpoint Endpoint, body []byte) error {
	sc := p.scratch.Get().(*parseScratch)
	defer p.scratch.Put(sc)
	return p.parseWith(sc, req, endpoint, body)
}

// parseWith is parseInto working in sc, the caller's scratch space (the
// handler's is the request state's: see scratchSpace), free again when it
// returns.
func (p *parser) parseWith(sc *parseScratch, req *Request, endpoint Endpoint, body []byte) error {
	// A UTF-8 byte order mark before the JSON: vLLM reads the body with
	// Python's json.loads, which skips it.
	body = bytes.TrimPrefix(body, utf8BOM)
	defer sc.trim()
	sc.s = scanner{buf: body, inObject: sc.depth[:]}
	sc.msgs, sc.extras = sc.msgs[:0], sc.extras[:0]
	// Declared, then set: a composite literal of its size is built apart
	// and copied in.
	var r reading
	r.p, r.endpoint, r.body, r.s, r.sc = p, endpoint, body, &sc.s, sc
	r.read()
	sc.s.buf = nil
	switch {
	case sc.s.err != nil:
		return errBadRequest{msg: sc.s.err.Error()}
	case len(r.typeErrs) > 0:
		return r.typeErrs[0].err
	}
	*req = Request{Endpoint: endpoint, Stream: r.stream, Sequences: 1}
	if r.n.set && r.n.v > 1 {
		// n below 1 the engine refuses; whatever it does with it, it
		// generates at most one sequence a prompt.
		req.Sequences = min(r.n.v, maxSequences)
	}
	// max_completion_tokens, the chat API's newer name, wins, as in vLLM.
	switch {
	case endpoint == EndpointResponses:
		if r.maxOutput.set {
			req.MaxTokens = max(0, r.maxOutput.v)
		}
	case r.maxCompletion.set:
		req.MaxTokens, req.maxCompletionTokens = max(0, r.maxCompletion.v), true
	case r.maxTokens.set:
		req.MaxTokens = max(0, r.maxTokens.v)
	}
	if r.modelSet {
		name := decodeString(sc.dec[:0], body[r.model.start:r.model.end], r.modelEscaped)
		if len(name) > maxModelNameBytes {
			// Model names are short; a long one would go into the access
			// log, the 404's message and the per-model table.
			return errModelTooLong
		}
		req.Model = p.modelName(name)
	}
	salt, seeds := p.salt, p.seeds
	if r.cacheSaltSet {
		cacheSalt := decodeString(sc.dec[:0], body[r.cacheSalt.start:r.cacheSalt.end], r.cacheSaltEscaped)
		if len(cacheSalt) == 0 {
			return errEmptyCacheSalt
		}
		salt, seeds = saltWith(p.salt, string(cacheSalt)), nil
	}
	req.salt, req.seeds = salt, seeds
	switch endpoint {
	case EndpointCompletions:
		if r.promptErr != nil {
			return r.promptErr
		}
		if r.promptSet {
			req.Hashes = sc.blocks.Hashes()
			req.PromptTokens, req.PromptBytes = r.promptTokens, r.promptBytes
			if r.prompts > 1 {
				req.LongestPromptTokens = r.longest
				req.Sequences = min(req.Sequences*r.prompts, maxSequences)
			}
		}
	case EndpointChatCompletions:
		switch {
		case r.messagesErr != nil:
			return r.messagesErr
		case !r.messagesSeen:
			return badRequestf("messages", "invalid request: messages is required")
		}
		if r.hashedTools != r.tools || r.hashedSet != r.toolsSet {
			// The tools came after the messages (as the OpenAI Python
			// client sends them): hash again in canonical order.
			r.startChat()
			for i := range sc.msgs {
				r.hashMessage(&sc.msgs[i])
			}
		}
		req.Hashes = sc.blocks.Hashes()
		r.countText(req)
	case EndpointResponses:
		switch {
		case r.inputErr != nil:
			return r.inputErr
		case r.instructionsErr != nil:
			return r.instructionsErr
		case !r.inputSeen:
			return badRequestf("input", "invalid request: input is required")
		}
		// Hashed once the whole body is read, in canonical order: the
		// tools, the instructions (the system message vLLM makes of
		// them), then the input, so a conversation sent again with its
		// new turns appended extends the same chain.
		r.startChat()
		if r.instructionsSet {
			r.hashMessage(&msgRange{implied: impliedSystem, content: r.instructions})
		}
		for i := range sc.msgs {
			r.hashMessage(&sc.msgs[i])
		}
		req.Hashes = sc.blocks.Hashes()
		r.countText(req)
		req.NoStore, req.Background = r.noStore, r.background
		if r.previousSet && r.previous.end-r.previous.start <= maxResponseIDBytes {
			req.PreviousResponseID = string(decodeString(sc.dec[:0], body[r.previous.start:r.previous.end], r.previousEscaped))
		}
	}
	return nil
}

// seed chains req's hashes from the seed of model, the name the engine's
// prefix cache knows the request's model by (router.ModelNames: the
// model as sent, or for a base model served under several names one of
// them), once: a later call keeps the chain, which a charge made with it
// holds.
func (req *Request) seed(model string) {
	if req.seeded {
		return
	}
	req.seeded = true
	var seed uint64
	if req.seeds != nil {
		seed = req.seeds.of(model)
	} else {
		seed = prefixindex.Seed(model, "", req.salt)
	}
	prefixindex.Chain(seed, req.Hashes)
}

// utf8BOM is the UTF-8 encoding of U+FEFF, the byte order mark.
var utf8BOM = []byte("\xef\xbb\xbf")

// countText sets req's prompt size from the canonical text hashed, less
// what of it is not text: escapes, and the content parts' keys and media.
func (r *reading) countText(req *Request) {
	notText := r.msgsExtra
	if r.toolsSet {
		notText += r.toolsExtra
	}
	if r.endpoint == EndpointResponses && r.instructionsSet {
		notText += r.instructionsExtra
	}
	req.PromptBytes = max(0, r.sc.blocks.Len()-notText)
	req.PromptTokens, req.Media = r.p.tokens(req.PromptBytes), r.msgsMedia
}

// modelName returns name as a string, the last one's when equal.
func (p *parser) modelName(name []byte) string {
	if last := p.model.Load(); last != nil && *last == string(name) {
		return *last
	}
	s := string(name)
	p.model.Store(&s)
	return s
}

// fieldError is a value of the wrong type in a top-level field.
type fieldError struct {
	field int
	err   error
}

// typeError records a value of the wrong type, in the API's words: the
// first in the top-level field being read.
func (r *reading) typeError(field, want string) {
	r.fieldError(field, "must be "+want)
}

// fieldError notes field's error, the first of the top-level field being
// read: "invalid request: " field problem.
func (r *reading) fieldError(field, problem string) {
	if slices.ContainsFunc(r.typeErrs, r.inField) {
		return
	}
	param := field
	if r.field == fieldBody {
		param = ""
	}
	r.typeErrs = append(r.typeErrs, fieldError{r.field, badRequestf(param, "invalid request: %s %s", field, problem)})
}

// inField says e is an error of the top-level field being read.
func (r *reading) inField(e fieldError) bool { return e.field == r.field }

// skip reads a value routing does not need.
func (r *reading) skip() {
	r.s.skip()
}

// read reads the whole body.
func (r *reading) read() {
	s := r.s
	switch s.ws() {
	case '{':
		r.object()
	case 'n':
		s.literal() // null: an empty request, as encoding/json has it
	default:
		if _, _, ok := s.skip(); ok {
			r.field = fieldBody
			r.typeError("the body", "an object")
		}
	}
	if s.err == nil {
		s.end()
	}
}

// object reads the request object.
func (r *reading) object() {
	s := r.s
	s.pos++
	if !s.push(true) {
		return
	}
	for first := true; ; first = false {
		key, more := s.member(first, r.sc.key[:0])
		if !more {
			return
		}
		field := topField(key)
		if !r.reads(field) {
			// Another API's field: the engine ignores it, and so do we.
			r.skip()
			continue
		}
		if field != fieldOther {
			r.field = field
			if len(r.typeErrs) > 0 {
				// Read again: its earlier value's error goes with it.
				r.typeErrs = slices.DeleteFunc(r.typeErrs, r.inField)
			}
		}
		switch field {
		case fieldModel:
			// A null given last takes the model back, as vLLM reads it.
			r.modelSet = r.optString(&r.model, &r.modelEscaped, "model")
		case fieldCacheSalt:
			// A null one given last takes the salt back, as vLLM reads it.
			r.cacheSaltSet = r.optString(&r.cacheSalt, &r.cacheSaltEscaped, "cache_salt")
		case fieldPrompt:
			r.prompt()
		case fieldMessages:
			r.messages()
		case fieldInput:
			r.input()
		case fieldInstructions:
			r.readInstructions()
		case fieldMaxOutputTokens:
			r.optInt(&r.maxOutput, "max_output_tokens")
		case fieldPreviousResponseID:
			r.previousSet = r.optString(&r.previous, &r.previousEscaped, "previous_response_id")
		case fieldStore:
			// The router only needs to know store is surely off, so it
			// refuses no value: the engine answers for a bad one.
			v, ok := r.laxFlag()
			r.noStore = ok && !v
		case fieldBackground:
			v, ok := r.laxFlag()
			r.background = ok && v
		case fieldTools:
			before := s.escapeExtra
			start, end, ok := s.skip()
			if ok {
				r.tools = span{start, end}
				r.toolsSet = string(r.body[start:end]) != "null"
				r.toolsExtra = s.escapeExtra - before
			}
		case fieldMaxTokens:
			r.optInt(&r.maxTokens, "max_tokens")
		case fieldMaxCompletionTokens:
			r.optInt(&r.maxCompletion, "max_completion_tokens")
		case fieldN:
			r.optInt(&r.n, "n")
		case fieldStream:
			// Read as vLLM reads it (pydantic, lax): also "true", 1.
			switch c := s.ws(); {
			case c == 't' || c == 'f':
				if s.literal() {
					r.stream = c == 't'
				}
			case c == 'n':
				if s.literal() {
					r.stream = false
				}
			case c == '"' || c == '-' || '0' <= c && c <= '9':
				text, ok := r.scalar(c)
				if !ok {
					break
				}
				if v, ok := laxBool(text, c == '"'); ok {
					r.stream = v
				} else {
					r.typeError("stream", "a boolean")
				}
			default:
				r.typeError("stream", "a boolean")
				r.skip()
			}
		default:
			r.skip()
		}
	}
}

// reads says whether the request's API has field.
func (r *reading) reads(field int) bool {
	switch field {
	case fieldPrompt:
		return r.endpoint == EndpointCompletions
	case fieldMessages, fieldMaxCompletionTokens:
		return r.endpoint == EndpointChatCompletions
	case fieldMaxTokens, fieldN:
		return r.endpoint != EndpointResponses
	case fieldInput, fieldInstructions, fieldMaxOutputTokens, fieldPreviousResponseID, fieldStore, fieldBackground:
		return r.endpoint == EndpointResponses
	}
	return true
}

// laxFlag reads a boolean as vLLM reads one (pydantic, lax: "false",
// "true", 0 and 1 too), and reports false for anything else, which it
// skips without refusing it (the engine answers for a bad value).
func (r *reading) laxFlag() (v, ok bool) {
	s := r.s
	switch c := s.ws(); {
	case c == 't' || c == 'f':
		if s.literal() {
			return c == 't', true
		}
	case c == '"' || c == '-' || '0' <= c && c <= '9':
		if text, scalar := r.scalar(c); scalar {
			return laxBool(text, c == '"')
		}
	default:
		r.skip()
	}
	return false, false
}

// optString reads a string field that may be null; it reports whether it
// read a string (a null leaves dst as it was: the caller's flag says the
// field is unset, as a null given last makes it in vLLM).
func (r *reading) optString(dst *span, escaped *bool, name string) bool {
	s := r.s
	switch s.ws() {
	case '"':
		start, end, esc, ok := s.str()
		if ok {
			*dst, *escaped = span{start, end}, esc
		}
		return ok
	case 'n':
		s.literal()
	default:
		r.typeError(name, "a string")
		r.skip()
	}
	return false
}

// optInt reads an integer field that may be null, as vLLM's request
// models (pydantic, in its lax mode) read one: a number without a
// fractional part (16, 16.0, 1e3), a string holding one ("16"), or a
// boolean (1 or 0).
// What vLLM takes the router must not refuse.
func (r *reading) optInt(dst *optInt, name string) {
	s := r.s
	switch c := s.ws(); {
	case c == 'n':
		if s.literal() {
			*dst = optInt{}
		}
	case c == 't' || c == 'f': // lax: true is 1, false 0
		if s.literal() {
			*dst = optInt{set: true}
			if c == 't' {
				dst.v = 1
			}
		}
	case c == '"' || c == '-' || '0' <= c && c <= '9':
		text, ok := r.scalar(c)
		if !ok {
			return
		}
		switch v, ok := laxInt(text, c == '"'); {
		case ok:
			*dst = optInt{v: v, set: true}
		case integral(text, c == '"'):
			// An integer all the same, past what any model's context
			// holds (or below zero): "must be an integer" misleads.
			r.fieldError(name, "is out of range")
		default:
			r.typeError(name, "an integer")
		}
	default:
		r.typeError(name, "an integer")
		r.skip()
	}
}

// scalar reads the string (c is its quote) or number at pos: a string's
// contents decoded, a number's literal.
func (r *reading) scalar(c byte) ([]byte, bool) {
	if c == '"' {
		start, end, esc, ok := r.s.str()
		return r.unquoted(start, end, esc), ok
	}
	start, end, ok := r.s.number()
	return r.body[start:end], ok
}

// unquoted is the body's bytes from start to end, decoded when escaped.
func (r *reading) unquoted(start, end int, escaped bool) []byte {
	if !escaped {
		return r.body[start:end]
	}
	return decodeInto(&r.sc.dec, r.body[start:end], true)
}

// laxInt reads p, a JSON number or a string's contents, as an integer the
// way pydantic's lax mode does: a number with no fractional part, in a
// string too. The router errs on the lenient side: what it takes and the
// engine does not, the engine answers for.
func laxInt(p []byte, quoted bool) (int, bool) {
	if quoted {
		p = bytes.TrimSpace(p)
	}
	if v, ok := parseInt(p); ok {
		return int(v), true
	}
	f, err := strconv.ParseFloat(string(p), 64)
	if err != nil || f != math.Trunc(f) || math.Abs(f) > 1<<53 {
		return 0, false
	}
	return int(f), true
}

// foldTokenID is the int32 a token id is hashed as: itself within int32's
// range, as prefix hashes always took it; beyond, its two halves xored.
// No real tokenizer's ids go beyond, and a folded id that meets another
// id only makes two prompts' blocks look alike to the router.
func foldTokenID(v int) int32 {
	if v >= math.MinInt32 && v <= math.MaxInt32 {
		return int32(v)
	}
	return int32(uint32(v) ^ uint32(uint64(v)>>32))
}

// integral says p, read as laxInt reads it, is a number with no
// fractional part, whatever its size.
func integral(p []byte, quoted bool) bool {
	if quoted {
		p = bytes.TrimSpace(p)
	}
	f, err := strconv.ParseFloat(string(p), 64)
	return (err == nil || errors.Is(err, strconv.ErrRange)) && f == math.Trunc(f)
}

// laxBool reads p, a string's contents or a number, as pydantic's lax mode
// reads a boolean: "true", "yes", "on", "1" and the like, 0 and 1.
func laxBool(p []byte, quoted bool) (v, ok bool) {
	if !quoted {
		n, ok := laxInt(p, false)
		return n == 1, ok && (n == 0 || n == 1)
	}
	switch strings.ToLower(string(p)) {
	case "1", "on", "t", "true", "y", "yes":
		return true, true
	case "0", "off", "f", "false", "n", "no":
		return false, true
	}
	return false, false
}

// messages reads the messages array. Each message is hashed when its
// object ends (its role may follow its content).
func (r *reading) messages() {
	s := r.s
	switch s.ws() {
	case 'n':
		if s.literal() {
			r.messagesSeen, r.messagesErr = false, nil
			r.sc.msgs, r.msgsExtra, r.msgsMedia = r.sc.msgs[:0], 0, false
		}
		return
	case '[':
	default:
		r.typeError("messages", "an array")
		r.skip()
		return
	}
	r.messagesSeen, r.messagesErr = true, nil
	r.sc.msgs, r.msgsExtra, r.msgsMedia = r.sc.msgs[:0], 0, false
	if r.endpoint == EndpointChatCompletions {
		r.startChat()
	}
	s.pos++
	if !s.push(false) {
		return
	}
	for i := 0; s.element(i == 0); i++ {
		r.message(i)
	}
}

// message reads messages[i].
func (r *reading) message(i int) {
	s := r.s
	var m msgRange
	switch s.ws() {
	case 'n':
		if s.literal() {
			r.addMessage(i, m, 0, false)
		}
		return
	case '{':
	default:
		r.typeError(fmt.Sprintf("messages[%d]", i), "an object")
		r.skip()
		return
	}
	s.pos++
	if !s.push(true) {
		return
	}
	var x msgExtra
	// The bytes hashed that are not text, of the content, name,
	// tool_call_id and tool_calls (the last value of each counts), and
	// whether the content has media parts.
	var notText [4]int
	media := false
	for first := true; ; first = false {
		key, more := s.member(first, r.sc.key[:0])
		if !more {
			if s.err == nil {
				r.keepExtra(&m, &x)
				r.addMessage(i, m, notText[0]+notText[1]+notText[2]+notText[3], media)
			}
			return
		}
		before := s.escapeExtra
		switch f := msgField(key); f {
		case fieldRole:
			if c := s.ws(); c != '"' && c != 'n' {
				// Named here, where the index is known (optString's
				// name would be formatted for every message).
				r.typeError(fmt.Sprintf("messages[%d].role", i), "a string")
				r.skip()
				break
			}
			r.optString(&m.role, &m.roleEscaped, "")
		case fieldContent:
			if s.ws() == '"' { // the usual content, read here: no call
				if start, end, _, ok := s.str(); ok {
					m.content = span{start, end}
				}
				notText[0], media = s.escapeExtra-before, false
			} else {
				notText[0], media = r.content(&m)
			}
		case fieldName, fieldToolCallID, fieldToolCalls:
			v := r.value()
			switch f {
			case fieldName:
				x.name, notText[1] = v, s.escapeExtra-before
			case fieldToolCallID:
				x.toolCallID, notText[2] = v, s.escapeExtra-before
			default:
				x.toolCalls, notText[3] = v, s.escapeExtra-before
			}
		default:
			r.skip()
		}
	}
}

// value reads a value hashed as the message's content is: a string's
// contents, or the value as sent; null (or an error) is the empty span.
func (r *reading) value() span {
	s := r.s
	switch s.ws() {
	case '"':
		if start, end, _, ok := s.str(); ok {
			return span{start, end}
		}
	case 'n':
		s.literal()
	default:
		if start, end, ok := s.skip(); ok {
			return span{start, end}
		}
	}
	return span{}
}

// content reads a message's (or input item's) content into m (a string's
// contents, or the value as sent) and returns how many of its bytes as
// sent are not text as the engine reads it, and whether it has media
// parts. Those of a string are its escapes' beyond its text; those of an
// array of parts are all but the parts' text: their keys, types and
// punctuation, and the media parts (images, audio, files) whole, whose
// bytes are hashed but tell nothing of their tokens. Another value counts
// as it is hashed, less its escapes.
func (r *reading) content(m *msgRange) (notText int, media bool) {
	s := r.s
	before := s.escapeExtra
	switch s.ws() {
	case '"':
		if start, end, _, ok := s.str(); ok {
			m.content = span{start, end}
		}
		return s.escapeExtra - before, false
	case '[':
	default:
		if start, end, ok := s.skip(); ok {
			m.content = span{start, end}
		}
		return s.escapeExtra - before, false
	}
	start := s.pos
	s.pos++
	if !s.push(false) {
		return 0, false
	}
	text := 0 // the parts' text, escapes decoded
	for i := 0; s.element(i == 0); i++ {
		switch s.ws() {
		case '"':
			// A string is a text part: vLLM reads it as one.
			e := s.escapeExtra
			if ts, te, _, ok := s.str(); ok {
				text += te - ts - (s.escapeExtra - e)
			}
		case '{':
			n, isMedia := r.part()
			text, media = text+n, media || isMedia
		default:
			r.skip()
		}
	}
	if s.err != nil {
		return 0, false
	}
	m.content = span{start, s.pos}
	return s.pos - start - text, media
}

// part reads a content part, the object at pos, and returns the bytes of
// its text as the engine reads it (a text part's "text", a refusal's
// "refusal"), and whether it is media: typed other than text. The last
// value given of a key counts, as for every key.
func (r *reading) part() (text int, media bool) {
	s := r.s
	s.pos++
	if !s.push(true) {
		return 0, false
	}
	kind := partOther
	var texts [2]int // the last "text" and "refusal" given, if strings
	for first := true; ; first = false {
		key, more := s.member(first, r.sc.key[:0])
		if !more {
			break
		}
		f := partField(key)
		if f == fieldOther {
			r.skip()
			continue
		}
		if s.ws() != '"' {
			if f == fieldPartType {
				kind = partOther
			} else {
				texts[f-fieldPartText] = 0
			}
			r.skip()
			continue
		}
		e := s.escapeExtra
		ts, te, esc, ok := s.str()
		switch {
		case !ok:
			return 0, false
		case f == fieldPartType:
			kind = partKind(r.unquoted(ts, te, esc))
		default:
			texts[f-fieldPartText] = te - ts - (s.escapeExtra - e)
		}
	}
	switch kind {
	case partText:
		return texts[0], false
	case partRefusal:
		return texts[1], false
	}
	return 0, kind == partMedia
}

// keepExtra stores x for m, unless it is empty.
func (r *reading) keepExtra(m *msgRange, x *msgExtra) {
	if *x == (msgExtra{}) {
		return
	}
	r.sc.extras = append(r.sc.extras, *x)
	m.extra = uint32(len(r.sc.extras))
}

// addMessage records and, for a chat, hashes messages[i], of whose
// hashed values notText bytes are not text; media says its content has
// media parts.
func (r *reading) addMessage(i int, m msgRange, notText int, media bool) {
	// Only a valid chat's messages are kept (to hash again if its tools
	// come after them): a body of empty or null elements must not cost
	// a record each.
	if r.endpoint != EndpointChatCompletions || r.messagesErr != nil || r.s.err != nil {
		return
	}
	if m.role.end == m.role.start {
		r.messagesErr = badRequestf(fmt.Sprintf("messages[%d].role", i), "invalid request: messages[%d].role is required", i)
		return
	}
	r.sc.msgs, r.msgsExtra, r.msgsMedia = append(r.sc.msgs, m), r.msgsExtra+notText, r.msgsMedia || media
	r.hashMessage(&m)
}

// startChat restarts the chat's blocks with the tools seen so far; when
// tools come later, parse hashes again.
func (r *reading) startChat() {
	b := &r.sc.blocks
	b.Reset(r.p.hasher, r.hashBuffer(r.p.hasher.BlockBytes()))
	r.hashedTools, r.hashedSet = r.tools, r.toolsSet
	if r.toolsSet {
		b.Write(r.body[r.tools.start:r.tools.end])
		b.WriteString(sepMessage)
	}
}

// hashMessage adds a message to the canonical prompt: role, content.
func (r *reading) hashMessage(m *msgRange) {
	b := &r.sc.blocks
	switch m.implied {
	case impliedUser:
		b.WriteString("user")
	case impliedSystem:
		b.WriteString("system")
	default:
		role := r.body[m.role.start:m.role.end]
		if m.roleEscaped || !isASCII(role) {
			role = decodeInto(&r.sc.dec, role, m.roleEscaped)
		}
		b.Write(role)
	}
	b.WriteString(sepField)
	b.Write(r.body[m.content.start:m.content.end])
	if m.extra != 0 {
		// What the chat template renders besides: after the content, in
		// a fixed order whatever the body's, so that a message without
		// them hashes as it always did.
		x := &r.sc.extras[m.extra-1]
		for _, f := range [...]struct {
			name string
			v    span
		}{{"name", x.name}, {"tool_call_id", x.toolCallID}, {"tool_calls", x.toolCalls}} {
			if f.v.end > f.v.start {
				b.WriteString(sepField)
				b.WriteString(f.name)
				b.WriteString(sepField)
				b.Write(r.body[f.v.start:f.v.end])
			}
		}
	}
	b.WriteString(sepMessage)
}

// readInstructions reads the Responses API's instructions: a string, or
// null for none (the last one given counts, as for every key).
func (r *reading) readInstructions() {
	s := r.s
	r.instructionsSet, r.instructionsErr = false, nil
	switch s.ws() {
	case '"':
		before := s.escapeExtra
		start, end, _, ok := s.str()
		// Empty instructions are none: vLLM adds no system message.
		r.instructions, r.instructionsSet = span{start, end}, ok && end > start
		r.instructionsExtra = s.escapeExtra - before
	case 'n':
		s.literal()
	default:
		r.instructionsErr = badRequestf("instructions", "invalid request: instructions must be a string")
		r.skip()
	}
}

// input reads the Responses API's input: a string (one user message) or
// an array of items, kept in the scratch's msgs and hashed when the body
// is read (see parse).
func (r *reading) input() {
	s := r.s
	r.inputSeen, r.inputErr = false, nil
	r.sc.msgs, r.msgsExtra, r.msgsMedia = r.sc.msgs[:0], 0, false
	switch s.ws() {
	case 'n':
		s.literal()
		return
	case '"':
		before := s.escapeExtra
		start, end, _, ok := s.str()
		if ok {
			r.inputSeen = true
			r.sc.msgs = append(r.sc.msgs, msgRange{implied: impliedUser, content: span{start, end}})
			r.msgsExtra = s.escapeExtra - before
		}
		return
	case '[':
	default:
		r.inputErr = badRequestf("input", "invalid request: input must be a string or an array")
		r.skip()
		return
	}
	r.inputSeen = true
	s.pos++
	if !s.push(false) {
		return
	}
	for i := 0; s.element(i == 0); i++ {
		r.item(i)
	}
}

// item reads input[i]: a message (role and content, hashed as a chat
// message is) or another item (a function call, its output, reasoning:
// hashed as its type and the item as sent).
func (r *reading) item(i int) {
	s := r.s
	if s.ws() != '{' {
		if r.inputErr == nil {
			r.inputErr = badRequestf(fmt.Sprintf("input[%d]", i), "invalid request: input[%d] must be an object", i)
		}
		r.skip()
		return
	}
	start, itemEscapes := s.pos, s.escapeExtra
	s.pos++
	if !s.push(true) {
		return
	}
	var m msgRange
	var typ span
	var typEscaped bool
	contentNotText, media := 0, false
	for first := true; ; first = false {
		key, more := s.member(first, r.sc.key[:0])
		if !more {
			break
		}
		// msgField's other fields (a message's name, tool_call_id and
		// tool_calls) are not an item's: skipped, as unknown keys are.
		switch msgField(key) {
		case fieldRole:
			r.itemString(i, &m.role, &m.roleEscaped)
		case fieldContent:
			contentNotText, media = r.content(&m)
		case fieldType:
			r.itemString(i, &typ, &typEscaped)
		default:
			r.skip()
		}
	}
	if s.err != nil || r.inputErr != nil {
		return
	}
	switch {
	case m.role.end > m.role.start:
		r.msgsExtra, r.msgsMedia = r.msgsExtra+contentNotText, r.msgsMedia || media
	case typ.end > typ.start:
		m = msgRange{role: typ, roleEscaped: typEscaped, content: span{start, s.pos}}
		r.msgsExtra += s.escapeExtra - itemEscapes
	default:
		r.inputErr = badRequestf(fmt.Sprintf("input[%d]", i), "invalid request: input[%d] must have a role or a type", i)
		return
	}
	r.sc.msgs = append(r.sc.msgs, m)
}

// itemString reads an input item's role or type: a string, or null
// (which leaves dst); anything else is input[i]'s error.
func (r *reading) itemString(i int, dst *span, escaped *bool) {
	s := r.s
	switch s.ws() {
	case '"':
		if start, end, esc, ok := s.str(); ok {
			*dst, *escaped = span{start, end}, esc
		}
	case 'n':
		s.literal()
	default:
		if r.inputErr == nil {
			r.inputErr = badRequestf(fmt.Sprintf("input[%d]", i), "invalid request: input[%d] must be an object with string role and type", i)
		}
		r.skip()
	}
}

// hashBuffer returns the slice the hashes go to, with room for every
// block the body could hold at blockBytes bytes a block.
func (r *reading) hashBuffer(blockBytes int) []uint64 {
	n := min(len(r.body)/blockBytes+1, r.p.maxBlocks())
	if cap(r.hashes) < n {
		r.hashes = make([]uint64, 0, n)
	}
	return r.hashes[:0]
}

// isASCII reports whether p has no byte of 0x80 or above, eight bytes at
// a time: p is most often a key, a role or a token's text.
func isASCII(p []byte) bool {
	var acc uint64
	for ; len(p) >= 8; p = p[8:] {
		acc |= binary.LittleEndian.Uint64(p)
	}
	for _, c := range p {
		acc |= uint64(c)
	}
	return acc&msb == 0
}

// The prompt forms of the completions API.
const (
	formTokens  = iota // [1, 2, 3]
	formStrings        // ["a", "b"]
	formBatch          // [[1, 2], [3]]
)

// errPromptShape is the completions prompt of no form the API has.
var errPromptShape = errBadRequest{param: "prompt", msg: "invalid request: prompt must be a string, an array of strings, an array of token ids or an array of such arrays"}

// prompt reads a completions prompt: a string, an array of strings
// (hashed as one text, separated), an array of token ids, or an array of
// such arrays (hashed as one sequence of tokens, in order). Token ids
// hash 4 bytes each, in blocks of BlockTokens.
func (r *reading) prompt() {
	s := r.s
	r.promptErr, r.promptSet, r.promptTokens, r.promptBytes, r.prompts, r.longest = nil, false, 0, 0, 0, 0
	b := &r.sc.blocks
	switch s.ws() {
	case 'n':
		s.literal()
		return
	case '"':
		before := s.escapeExtra
		start, end, _, ok := s.str()
		if ok {
			b.Reset(r.p.hasher, r.hashBuffer(r.p.hasher.BlockBytes()))
			b.Write(r.body[start:end])
			text := end - start - (s.escapeExtra - before)
			r.promptSet, r.promptTokens, r.promptBytes = true, r.p.tokens(text), text
		}
		return
	case '[':
	default:
		r.promptErr = errPromptShape
		r.skip()
		return
	}
	s.pos++
	if !s.push(false) {
		return
	}
	r.promptSet = true
	form := formTokens
	escapes := 0 // the strings' escapes' bytes beyond their text
	switch s.ws() {
	case ']':
		s.pos++
		s.depth--
		b.ResetTokens(r.p.hasher, nil)
		return
	case '"':
		form = formStrings
		b.Reset(r.p.hasher, r.hashBuffer(r.p.hasher.BlockBytes()))
	case '[':
		form = formBatch
	}
	if form != formStrings {
		// A token id takes at least two bytes of the body ("1,").
		b.ResetTokens(r.p.hasher, r.hashBuffer(2*r.p.blockTokens()))
	}
	for i := 0; s.element(i == 0); i++ {
		if r.promptErr != nil {
			r.skip()
		} else {
			switch form {
			case formTokens:
				r.token(i)
			case formStrings:
				if s.ws() != '"' {
					r.promptErr = badRequestf("prompt", "invalid request: prompt[%d] must be a string", i)
					r.skip()
					break
				}
				before := s.escapeExtra
				start, end, _, ok := s.str()
				if ok {
					if i > 0 {
						b.WriteString(sepMessage)
					}
					b.Write(r.body[start:end])
					extra := s.escapeExtra - before
					escapes += extra
					r.prompts, r.longest = r.prompts+1, max(r.longest, r.p.tokens(end-start-extra))
				}
			case formBatch:
				before := r.promptTokens
				r.tokenArray(i)
				r.prompts, r.longest = r.prompts+1, max(r.longest, r.promptTokens-before)
			}
		}
	}
	if s.err == nil && form == formStrings {
		text := b.Len() - escapes
		r.promptTokens, r.promptBytes = r.p.tokens(text), text
	}
}

// token reads prompt[i], a token id (null counts as 0, as encoding/json
// decodes it; a number with no fractional part, such as 1.0, is one, as
// pydantic's lax mode, and so vLLM, reads it). Any integer is taken, as
// vLLM's request model takes it: the engine, not the router, knows its
// vocabulary (kvsim's ids go past 2^31), and answers 400 for an id
// outside it. One outside int32's range is hashed folded into it (see
// foldTokenID).
func (r *reading) token(i int) {
	s := r.s
	switch c := s.ws(); {
	case c == 'n':
		if s.literal() {
			r.sc.blocks.WriteToken(0)
			r.promptTokens++
		}
	case c == '-' || '0' <= c && c <= '9':
		start, end, ok := s.number()
		if !ok {
			return
		}
		if v, ok := laxInt(r.body[start:end], false); ok {
			r.sc.blocks.WriteToken(foldTokenID(v))
			r.promptTokens++
			return
		}
		r.promptErr = badRequestf("prompt", "invalid request: prompt[%d] must be a token id", i)
	default:
		r.promptErr = badRequestf("prompt", "invalid request: prompt[%d] must be a token id", i)
		r.skip()
	}
}

// tokenArray reads prompt[i] of a batch: an array of token ids, or null.
func (r *reading) tokenArray(i int) {
	s := r.s
	switch s.ws() {
	case 'n':
		s.literal()
		return
	case '[':
	default:
		r.promptErr = badRequestf("prompt", "invalid request: prompt[%d] must be an array of token ids", i)
		r.skip()
		return
	}
	s.pos++
	if !s.push(false) {
		return
	}
	for j := 0; s.element(j == 0); j++ {
		if r.promptErr != nil {
			r.skip()
		} else {
			r.token(j)
			if r.promptErr != nil {
				r.promptErr = badRequestf("prompt", "invalid request: prompt[%d] must be an array of token ids", i)
			}
		}
	}
}

func (p *parser) blockTokens() int {
	return cmp.Or(max(p.hasher.BlockTokens, 0), prefixindex.DefaultBlockTokens)
}

func (p *parser) maxBlocks() int {
	return cmp.Or(max(p.hasher.MaxBlocks, 0), prefixindex.DefaultMaxBlocks)
}

func (p *parser) tokens(nbytes int) int {
	bpt := p.bytesPerToken
	if bpt <= 0 {
		bpt = prefixindex.DefaultBytesPerToken
	}
	return (nbytes + bpt - 1) / bpt
}
