package kvsim

import (
	"bytes"
	"encoding/binary"
	"encoding/json"

	"github.com/zeebo/xxh3"
)

// Chat template markers. Each message renders as
//
//	<|start|>ROLE\nCONTENT<|end|>\n
//
// with tools (when present) first as a message of role "tools" holding their compact JSON,
// and the generation prompt "<|start|>assistant\n" appended when add_generation_prompt is true.
// Turn n+1 of a conversation therefore extends turn n (with its generation prompt and the
// assistant's reply) byte for byte.
const (
	templateStart    = "<|start|>"
	templateEnd      = "<|end|>\n"
	generationPrompt = templateStart + "assistant\n"
	// fillerAlphabet is the letters of filler words: mostly lower case,
	// with a line break and a double quote, which a real model's output
	// (prose in paragraphs, code, JSON) has and which JSON escapes, so
	// that what reads the answers (the router's recorder, a client) meets
	// escapes as it would behind a real engine.
	fillerAlphabet     = "abcdefghijklmnop\nrstuvw\"yz"
	maxFillerWordCount = 4096
)

// fillerDigit is each filler letter's place in fillerAlphabet, -1 for
// other bytes.
var fillerDigit = func() (d [256]int8) {
	for i := range d {
		d[i] = -1
	}
	for i := 0; i < len(fillerAlphabet); i++ {
		d[fillerAlphabet[i]] = int8(i)
	}
	return d
}()

// Tokenizer is the deterministic pseudo-tokenizer: token i of a text is its bytes
// [i*BytesPerToken, (i+1)*BytesPerToken), the last one possibly shorter.
type Tokenizer struct {
	// BytesPerToken is the length of one token in bytes.
	BytesPerToken int

	words [][]byte
}

// NewTokenizer returns a tokenizer of bytesPerToken bytes a token (1..16) and its filler
// vocabulary: words of exactly bytesPerToken bytes, " aaa", " aab", ... (a letter alone, with
// no space, when bytesPerToken is 1), whose letters include a line break and a double quote
// (see fillerAlphabet): with 1 or 2 bytes a token, a word may be `"`, "\n", ` "` or " \n".
func NewTokenizer(bytesPerToken int) *Tokenizer {
	if bytesPerToken < 1 {
		bytesPerToken = 1
	}
	t := &Tokenizer{BytesPerToken: bytesPerToken}
	letters := bytesPerToken - 1
	prefix := " "
	if letters == 0 {
		letters, prefix = 1, ""
	}
	count := 1
	for i := 0; i < letters && count < maxFillerWordCount; i++ {
		count *= len(fillerAlphabet)
	}
	count = min(count, maxFillerWordCount)
	for i := range count {
		w := make([]byte, 0, bytesPerToken)
		w = append(w, prefix...)
		digits := make([]byte, letters)
		n := i
		for j := letters - 1; j >= 0; j-- {
			digits[j] = fillerAlphabet[n%len(fillerAlphabet)]
			n /= len(fillerAlphabet)
		}
		w = append(w, digits...)
		t.words = append(t.words, w)
	}
	return t
}

// CountTokens returns the number of tokens of a text of n bytes.
func (t *Tokenizer) CountTokens(n int) int {
	return (n + t.BytesPerToken - 1) / t.BytesPerToken
}

// NextToken returns the text of the token generated after context. It depends only on the
// last BytesPerToken bytes of the context: a filler word continues the word cycle, anything
// else picks a start by hash. The returned slice must not be modified.
func (t *Tokenizer) NextToken(context []byte) []byte {
	tail := context[max(0, len(context)-t.BytesPerToken):]
	if i, ok := t.wordIndex(tail); ok {
		return t.words[(i+1)%len(t.words)]
	}
	return t.words[xxh3.Hash(tail)%uint64(len(t.words))]
}

// wordIndex returns the index of a filler word, decoding its letters arithmetically (the
// hot path of generation; a map lookup costs several times more).
func (t *Tokenizer) wordIndex(tail []byte) (int, bool) {
	if len(tail) != t.BytesPerToken {
		return 0, false
	}
	letters := tail
	if t.BytesPerToken > 1 {
		if tail[0] != ' ' {
			return 0, false
		}
		letters = tail[1:]
	}
	n := 0
	for _, c := range letters {
		d := fillerDigit[c]
		if d < 0 {
			return 0, false
		}
		n = n*len(fillerAlphabet) + int(d)
		if n >= len(t.words) {
			return 0, false
		}
	}
	return n, true
}

// Generate appends n generated tokens to context and returns the extended slice.
func (t *Tokenizer) Generate(context []byte, n int) []byte {
	for range n {
		context = append(context, t.NextToken(context)...)
	}
	return context
}

// TokenIDsToText renders a token-id prompt as text, each id as BytesPerToken bytes
// (little-endian, zero padded), so that it tokenizes back to exactly len(ids) tokens.
func (t *Tokenizer) TokenIDsToText(ids []int64) []byte {
	out := make([]byte, 0, len(ids)*t.BytesPerToken)
	var buf [16]byte
	for _, id := range ids {
		clear(buf[:])
		binary.LittleEndian.PutUint64(buf[:8], uint64(id))
		out = append(out, buf[:t.BytesPerToken]...)
	}
	return out
}

// ChatMessage is one message of a chat request.
type ChatMessage struct {
	Role string `json:"role"`
	// Content is a JSON string, an array of content parts, or null.
	Content    json.RawMessage `json:"content,omitempty"`
	Name       string          `json:"name,omitempty"`
	ToolCalls  json.RawMessage `json:"tool_calls,omitempty"`
	ToolCallID string          `json:"tool_call_id,omitempty"`
}

// contentPart is one element of an array content.
type contentPart struct {
	Type string `json:"type"`
	Text string `json:"text"`
}

// RenderChat renders tools and messages with the chat template. With
// continueFinalMessage the last message is left open (no end marker) so generation continues
// it; with addGenerationPrompt an assistant header is appended. ParseRequest rejects a
// request asking for both; this function does not check.
func RenderChat(messages []ChatMessage, tools json.RawMessage, addGenerationPrompt, continueFinalMessage bool) ([]byte, error) {
	var out bytes.Buffer
	if len(bytes.TrimSpace(tools)) > 0 && !bytes.Equal(bytes.TrimSpace(tools), []byte("null")) {
		out.WriteString(templateStart + "tools\n")
		if err := json.Compact(&out, tools); err != nil {
			return nil, errBadRequest("tools is not valid JSON")
		}
		out.WriteString(templateEnd)
	}
	for i, m := range messages {
		if m.Role == "" {
			return nil, errBadRequestf("messages[%d].role is required", i)
		}
		out.WriteString(templateStart)
		out.WriteString(m.Role)
		if m.Name != "" {
			out.WriteString(" name=")
			out.WriteString(m.Name)
		}
		if m.ToolCallID != "" {
			out.WriteString(" tool_call_id=")
			out.WriteString(m.ToolCallID)
		}
		out.WriteByte('\n')
		if err := renderContent(&out, m.Content); err != nil {
			return nil, errBadRequestf("messages[%d].content: %v", i, err)
		}
		if len(m.ToolCalls) > 0 && !bytes.Equal(bytes.TrimSpace(m.ToolCalls), []byte("null")) {
			out.WriteString("<|tool_calls|>")
			if err := json.Compact(&out, m.ToolCalls); err != nil {
				return nil, errBadRequestf("messages[%d].tool_calls is not valid JSON", i)
			}
		}
		if continueFinalMessage && i == len(messages)-1 {
			break
		}
		out.WriteString(templateEnd)
	}
	if addGenerationPrompt {
		out.WriteString(generationPrompt)
	}
	return out.Bytes(), nil
}

// renderContent writes a message's content: a string as is, text parts concatenated, other
// parts as a "<|type|>" placeholder.
func renderContent(out *bytes.Buffer, raw json.RawMessage) error {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || bytes.Equal(raw, []byte("null")) {
		return nil
	}
	switch raw[0] {
	case '"':
		var s string
		if err := json.Unmarshal(raw, &s); err != nil {
			return err
		}
		out.WriteString(s)
		return nil
	case '[':
		var parts []contentPart
		if err := json.Unmarshal(raw, &parts); err != nil {
			return err
		}
		for _, p := range parts {
			// input_text and output_text are the Responses API's.
			if p.Type == "text" || p.Type == "input_text" || p.Type == "output_text" || (p.Type == "" && p.Text != "") {
				out.WriteString(p.Text)
				continue
			}
			out.WriteString("<|" + p.Type + "|>")
		}
		return nil
	}
	return errBadRequest("content must be a string, an array of content parts or null")
}
