package kvsim

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"math"
	"strings"
	"unicode/utf8"

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

// Token ids. kvsim's ids encode their token's bytes, so that /detokenize
// inverts /tokenize exactly on any replica of the same bytes_per_token B,
// with no vocabulary to share or keep (a per-server vocabulary, built as
// texts are tokenized, would give another replica's ids another meaning,
// and a router sends a tokenize to one replica and its detokenize to
// another):
//
//   - a whole token, B bytes, is the little-endian integer of its bytes:
//     id < 256^B. This is how kvsim always read a prompt of token ids, so
//     a tokenized text sent back as token ids is the same context, the
//     same count and the same prefix-cache blocks;
//   - a text's last token, L < B bytes, is 256^B + (256 + … + 256^(L-1))
//     + the little-endian integer of its L bytes: each length its own
//     range, after the whole tokens, with no gap between them.
//
// The vocabulary is then every id below 256 + 256² + … + 256^B (B = 4:
// 4,311,810,304), or Llama 3.1's 128,256 ids when that is more (B of 1
// or 2; an id between the two is its low B bytes). With B of 8 or more a
// token's id would not fit in the 63 bits vLLM allows an id, so such a
// tokenizer has none (see [Tokenizer.HasTokenIDs]) and renders a prompt's
// id as its 8 little-endian bytes and zeros.

// maxExactBytesPerToken is the longest token whose id fits in 63 bits.
const maxExactBytesPerToken = 7

// HasTokenIDs reports whether texts have token ids: bytes_per_token at
// most 7.
func (t *Tokenizer) HasTokenIDs() bool { return t.BytesPerToken <= maxExactBytesPerToken }

// wholeTokenIDs is 256^B, the first id of a partial token.
func (t *Tokenizer) wholeTokenIDs() int64 { return 1 << (8 * t.BytesPerToken) }

// vocabulary is the number of ids of the tokenizer's own tokens (with
// HasTokenIDs): 256 + 256² + … + 256^B.
func (t *Tokenizer) vocabulary() int64 {
	var n, p int64 = 0, 1
	for range t.BytesPerToken {
		p <<= 8
		n += p
	}
	return n
}

// MaxTokenID is the largest token id a prompt may hold: its tokenizer's
// own ids, or Llama 3.1's (VocabSize) when they are more, as vLLM
// refuses an id above both its tokenizer's largest and the model's
// vocabulary.
func (t *Tokenizer) MaxTokenID() int64 {
	if !t.HasTokenIDs() {
		return math.MaxInt64
	}
	return max(t.vocabulary(), VocabSize) - 1
}

// TokenIDs returns the ids of text's tokens; HasTokenIDs must hold.
func (t *Tokenizer) TokenIDs(text []byte) []int64 {
	ids := make([]int64, 0, t.CountTokens(len(text)))
	for len(text) > 0 {
		n := min(len(text), t.BytesPerToken)
		ids = append(ids, t.tokenID(text[:n]))
		text = text[n:]
	}
	return ids
}

// tokenID is the id of one token of 1..BytesPerToken bytes.
func (t *Tokenizer) tokenID(token []byte) int64 {
	var v int64
	for i := len(token) - 1; i >= 0; i-- {
		v = v<<8 | int64(token[i])
	}
	if len(token) == t.BytesPerToken {
		return v
	}
	first := t.wholeTokenIDs()
	for l := 1; l < len(token); l++ {
		first += 1 << (8 * l)
	}
	return first + v
}

// appendToken appends the text of token id to out: its bytes, padded
// with zeros to a whole token unless last (a partial token is a text's
// last, and elsewhere must still count one token). ok is false for an id
// outside the vocabulary (see MaxTokenID).
func (t *Tokenizer) appendToken(out []byte, id int64, last bool) ([]byte, bool) {
	b := t.BytesPerToken
	if id < 0 || id > t.MaxTokenID() {
		return out, false
	}
	var le [16]byte
	if !t.HasTokenIDs() || id < t.wholeTokenIDs() || id >= t.vocabulary() {
		// A whole token; past the vocabulary, below Llama's, the id's
		// low bytes.
		binary.LittleEndian.PutUint64(le[:8], uint64(id))
		return append(out, le[:b]...), true
	}
	rest := id - t.wholeTokenIDs()
	l := 1
	for ; rest >= 1<<(8*l); l++ {
		rest -= 1 << (8 * l)
	}
	binary.LittleEndian.PutUint64(le[:8], uint64(rest))
	if last {
		return append(out, le[:l]...), true
	}
	return append(out, le[:b]...), true
}

// TokenIDsToText renders token ids as text, each id one token (see
// appendToken), so that it tokenizes back to exactly len(ids) tokens and,
// for ids TokenIDs gave, is the text they came from. An id outside the
// vocabulary renders as nothing, as Hugging Face tokenizers decode an id
// they do not know; a prompt is checked against MaxTokenID first.
func (t *Tokenizer) TokenIDsToText(ids []int64) []byte {
	last := len(ids) - 1 // the last id in the vocabulary
	for last >= 0 && (ids[last] < 0 || ids[last] > t.MaxTokenID()) {
		last--
	}
	out := make([]byte, 0, len(ids)*t.BytesPerToken)
	for i, id := range ids {
		out, _ = t.appendToken(out, id, i == last)
	}
	return out
}

// TokenStrings returns each token of text as a byte-level BPE
// tokenizer's token string (Llama 3's, GPT-2's): a byte as a printable
// character, a space as "Ġ" and a line break as "Ċ", so that a token
// splitting a character is still a string, and each is exact.
func (t *Tokenizer) TokenStrings(text []byte) []string {
	strs := make([]string, 0, t.CountTokens(len(text)))
	for len(text) > 0 {
		n := min(len(text), t.BytesPerToken)
		var sb strings.Builder
		for _, c := range text[:n] {
			sb.WriteRune(byteRunes[c])
		}
		strs = append(strs, sb.String())
		text = text[n:]
	}
	return strs
}

// byteRunes is GPT-2's bytes_to_unicode: the printable bytes of Latin-1
// stand for themselves, the others for U+0100 on, in order.
var byteRunes = func() (r [256]rune) {
	next := rune(256)
	for b := range 256 {
		if '!' <= b && b <= '~' || '¡' <= b && b <= '¬' || '®' <= b && b <= 'ÿ' {
			r[b] = rune(b)
			continue
		}
		r[b] = next
		next++
	}
	return r
}()

// pyDecodeUTF8 is Python's bytes.decode("utf-8", errors="replace"), how
// a byte-level tokenizer turns decoded bytes into text: each maximal
// subpart of an invalid sequence (Unicode's recommended practice) is one
// U+FFFD, where Go's conversion would give one a byte.
func pyDecodeUTF8(b []byte) string {
	if utf8.Valid(b) {
		return string(b)
	}
	var sb strings.Builder
	for len(b) > 0 {
		r, n := utf8.DecodeRune(b)
		if r != utf8.RuneError || n > 1 {
			sb.Write(b[:n])
			b = b[n:]
			continue
		}
		sb.WriteRune(utf8.RuneError)
		b = b[invalidPrefix(b):]
	}
	return sb.String()
}

// invalidPrefix is the length of the maximal subpart at the start of b,
// which does not begin a valid UTF-8 sequence: a lead byte and the
// continuation bytes that may follow it, however many there are before
// one that may not.
func invalidPrefix(b []byte) int {
	var need int
	lo, hi := byte(0x80), byte(0xBF) // the second byte's range
	switch c := b[0]; {
	case 0xC2 <= c && c <= 0xDF:
		need = 1
	case c == 0xE0:
		need, lo = 2, 0xA0
	case c == 0xED:
		need, hi = 2, 0x9F
	case 0xE1 <= c && c <= 0xEF:
		need = 2
	case c == 0xF0:
		need, lo = 3, 0x90
	case c == 0xF4:
		need, hi = 3, 0x8F
	case 0xF1 <= c && c <= 0xF3:
		need = 3
	default:
		return 1
	}
	n := 1
	for ; n <= need && n < len(b); n++ {
		if b[n] < lo || b[n] > hi {
			break
		}
		lo, hi = 0x80, 0xBF
	}
	return n
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
