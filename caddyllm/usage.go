package caddyllm

// Reading what the router needs of a response without decoding it: the
// usage object of a completion body, and the text, identity and usage of
// a streamed chunk. Both read with the request's scanner and give up on
// anything unusual (a key in other case, a key given twice, a number of
// the wrong kind, nesting deeper than chunks have), leaving it to
// encoding/json, so that what they return is what encoding/json would.

import (
	"bytes"
	"encoding/json"
)

// chunkDepth bounds the nesting the chunk reader follows; deeper chunks
// go to encoding/json.
const chunkDepth = 127

// chunkFields is what the recorder reads of a streamed chunk: byte
// ranges of its strings (still escaped), created, the first choice's text
// and the usage.
type chunkFields struct {
	id, object, model span
	created           int64
	text              span
	usage             usage
	cached            int
	hasUsage          bool
	hasCached         bool
}

// Keys of a chunk, a choice, a delta, a usage.
var (
	chunkKeys   = [...]string{"id", "object", "created", "model", "choices", "usage"}
	choiceKeys  = [...]string{"text", "delta"}
	deltaKeys   = [...]string{"role", "content"}
	usageKeys   = [...]string{"prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"}
	detailsKeys = [...]string{"cached_tokens"}
	// responsesUsageKeys are the Responses API's names for the same
	// counts, in the same order.
	responsesUsageKeys = [...]string{"input_tokens", "output_tokens", "total_tokens", "input_tokens_details"}
)

// keyOf returns the index of key among names for an exact match, and
// false when key matches a name only as encoding/json folds case (the
// caller then gives up), or appears again (seen has a bit per name).
func keyOf(key []byte, names []string, seen *uint8) (int, bool) {
	for i, name := range names {
		if string(key) == name {
			if *seen&(1<<i) != 0 {
				return 0, false
			}
			*seen |= 1 << i
			return i, true
		}
	}
	// An ASCII key folds only to a name of its length.
	ascii := isASCII(key)
	for _, name := range names {
		if (!ascii || len(key) == len(name)) && equalFold(key, name) {
			return 0, false
		}
	}
	return fieldOther, true
}

// fields reads the object at the scanner, calling field with each
// member's index among names (fieldOther for other keys) with the
// scanner at its value, which field must read. It gives up (false) on a
// key keyOf refuses or when field does.
func (s *scanner) fields(names []string, field func(i int) bool) bool {
	if !s.open() {
		return false
	}
	var buf [32]byte
	var seen uint8
	for first := true; ; first = false {
		key, more := s.member(first, buf[:0])
		if !more {
			return s.err == nil
		}
		i, ok := keyOf(key, names, &seen)
		if !ok || !field(i) {
			return false
		}
	}
}

// optString reads a string or null into dst (null leaves it).
func (s *scanner) optString(dst *span) bool {
	switch s.ws() {
	case 'n':
		return s.literal()
	case '"':
		start, end, _, ok := s.str()
		*dst = span{start, end}
		return ok
	}
	return false
}

// optInt reads an integer or null into dst (null leaves it).
func (s *scanner) optInt(dst *int64) bool {
	switch c := s.ws(); {
	case c == 'n':
		return s.literal()
	case c == '-' || '0' <= c && c <= '9':
		start, end, ok := s.number()
		if !ok {
			return false
		}
		v, ok := parseInt(s.buf[start:end])
		*dst = v
		return ok
	}
	return false
}

// readUsage reads a usage object (or null) at pos into u, its members
// named by keys: usageKeys, or responsesUsageKeys (the Responses API's
// input_tokens for the prompt, output_tokens for the completion).
func (s *scanner) readUsage(keys []string, u *usage, cached *int, hasCached *bool) bool {
	if s.ws() == 'n' {
		return s.literal()
	}
	return s.fields(keys, func(i int) bool {
		switch i {
		case 0:
			return s.optIntField(&u.PromptTokens)
		case 1:
			return s.optIntField(&u.CompletionTokens)
		case 2:
			return s.optIntField(&u.TotalTokens)
		case 3:
			return s.readDetails(cached, hasCached)
		}
		_, _, ok := s.skip()
		return ok
	})
}

// optIntField is optInt for an int.
func (s *scanner) optIntField(dst *int) bool {
	v := int64(*dst)
	ok := s.optInt(&v)
	*dst = int(v)
	return ok
}

// readDetails reads prompt_tokens_details (or null).
func (s *scanner) readDetails(cached *int, hasCached *bool) bool {
	if s.ws() == 'n' {
		*hasCached = false
		return s.literal()
	}
	*hasCached = true
	return s.fields(detailsKeys[:], func(i int) bool {
		if i == 0 {
			return s.optIntField(cached)
		}
		_, _, ok := s.skip()
		return ok
	})
}

// responseEventKeys are what the recorder reads of a Responses API
// stream event, and responseKeys of the response an event carries.
var (
	responseEventKeys = [...]string{"type", "delta", "response", "sequence_number"}
	responseKeys      = [...]string{"usage", "id"}
)

// responseEvent is what readResponseEvent finds in an event's data.
type responseEvent struct {
	typ    span
	id     span // the response's id (response.created has it)
	seq    int64
	hasSeq bool
	delta  bool // a non-empty delta: a generated token
	// deltaText is the delta's contents when it is a string, and
	// seqNumber the sequence number's literal (for a Responses shape).
	deltaText, seqNumber span
	usage                usage
	cached               int
	hasUsage             bool
	hasCached            bool
}

// readResponseEvent reads a Responses API stream event's data: its type,
// whether it carries a delta, and the usage of the response it carries
// (response.completed has it). It reports false when the event is for
// encoding/json to read.
func readResponseEvent(data []byte, ev *responseEvent) bool {
	var depth [chunkDepth/64 + 1]uint64
	s := scanner{buf: data, inObject: depth[:]}
	return s.fields(responseEventKeys[:], func(i int) bool {
		switch i {
		case 0:
			return s.optString(&ev.typ)
		case 1:
			if s.ws() == '"' {
				start, end, _, ok := s.str()
				ev.delta, ev.deltaText = end > start, span{start, end}
				return ok
			}
		case 2:
			if s.ws() == 'n' {
				return s.literal()
			}
			return s.fields(responseKeys[:], func(i int) bool {
				switch i {
				case 0:
					ev.hasUsage = s.ws() != 'n'
					if !ev.hasUsage {
						return s.literal()
					}
					return s.readUsage(responsesUsageKeys[:], &ev.usage, &ev.cached, &ev.hasCached)
				case 1:
					return s.optString(&ev.id)
				}
				_, _, ok := s.skip()
				return ok
			})
		case 3:
			ev.hasSeq = s.ws() != 'n'
			start := s.pos
			ok := s.optInt(&ev.seq)
			ev.seqNumber = span{start, s.pos}
			return ok
		}
		_, _, ok := s.skip()
		return ok
	}) && s.end()
}

// idKeys is what responseIDOfBody reads of a response object.
var idKeys = [...]string{"id"}

// responseIDOfBody returns the id of a Responses API response body, ""
// when it has none. The id comes first in a response (vLLM's and
// OpenAI's), so a body kept only in part (one over maxUsageBody) gives it
// too: the first top-level id is taken.
func responseIDOfBody(body []byte) string {
	if id, ok := scanResponseID(body); ok {
		return id
	}
	var r struct {
		ID string `json:"id"`
	}
	if json.Unmarshal(body, &r) != nil {
		return ""
	}
	return r.ID
}

// scanResponseID reads the first top-level id of a response body, which
// may be only its start. It reports false when the scan cannot tell: the
// body is not yet read as far as an id, or is for encoding/json to read.
func scanResponseID(body []byte) (string, bool) {
	var depth [chunkDepth/64 + 1]uint64
	s := scanner{buf: body, inObject: depth[:]}
	var id span
	found := false
	complete := s.fields(idKeys[:], func(i int) bool {
		if i == 0 {
			found = s.optString(&id) && id.end > id.start
			return !found // stop at it
		}
		_, _, ok := s.skip()
		return ok
	}) && s.end()
	if !found && !complete {
		return "", false
	}
	raw := body[id.start:id.end]
	return string(decodeString(nil, raw, bytes.IndexByte(raw, '\\') >= 0)), true
}

// modelKeys and adapterCallKeys are the members modelOfBody and
// adapterCallOfBody read.
var (
	modelKeys       = [...]string{"model"}
	adapterCallKeys = [...]string{"lora_name", "load_inplace"}
)

// modelOfBody reads the top-level model of a request body, "" when it has
// none or the body is not an object the scanner reads whole (malformed,
// nested too deep, a key given twice): the engine then answers for it.
func modelOfBody(body []byte) string { return stringOfBody(body, modelKeys[:]) }

// adapterCallOfBody reads a request to vLLM's runtime adapter API
// (load_lora_adapter, unload_lora_adapter): the adapter it names
// (lora_name), "" as modelOfBody, and whether it sets load_inplace, read as
// vLLM's request model reads a boolean (true, "yes", 1).
func adapterCallOfBody(body []byte) (name string, inplace bool) {
	var depth [chunkDepth/64 + 1]uint64
	s := scanner{buf: body, inObject: depth[:]}
	var value span
	ok := s.fields(adapterCallKeys[:], func(i int) bool {
		if i == 0 {
			return s.optString(&value)
		}
		start, end, ok := s.skip()
		if ok && i == 1 {
			inplace, _ = rawLaxBool(body[start:end])
		}
		return ok
	}) && s.end()
	if !ok || value.end <= value.start {
		return "", false
	}
	raw := body[value.start:value.end]
	return string(decodeString(nil, raw, bytes.IndexByte(raw, '\\') >= 0)), inplace
}

// stringOfBody reads the top-level string member key (a one-element
// slice) of a request body, as modelOfBody.
func stringOfBody(body []byte, key []string) string {
	var depth [chunkDepth/64 + 1]uint64
	s := scanner{buf: body, inObject: depth[:]}
	var value span
	ok := s.fields(key, func(i int) bool {
		if i == 0 {
			return s.optString(&value)
		}
		_, _, ok := s.skip()
		return ok
	}) && s.end()
	if !ok || value.end <= value.start {
		return ""
	}
	raw := body[value.start:value.end]
	return string(decodeString(nil, raw, bytes.IndexByte(raw, '\\') >= 0))
}

// readChunk reads a streamed chunk's data. It reports false when the
// chunk is for encoding/json to read.
func readChunk(data []byte, f *chunkFields) bool {
	var depth [chunkDepth/64 + 1]uint64
	s := scanner{buf: data, inObject: depth[:]}
	return s.fields(chunkKeys[:], func(i int) bool {
		switch i {
		case 0:
			return s.optString(&f.id)
		case 1:
			return s.optString(&f.object)
		case 2:
			return s.optInt(&f.created)
		case 3:
			return s.optString(&f.model)
		case 4:
			return s.readChoices(f)
		case 5:
			f.hasUsage = s.ws() != 'n'
			if !f.hasUsage {
				return s.literal()
			}
			return s.readUsage(usageKeys[:], &f.usage, &f.cached, &f.hasCached)
		}
		_, _, ok := s.skip()
		return ok
	}) && s.end()
}

// readChoices reads a chunk's choices and keeps the first one's text: its
// text, else its delta's content.
func (s *scanner) readChoices(f *chunkFields) bool {
	switch s.ws() {
	case 'n':
		return s.literal()
	case '[':
	default:
		return false
	}
	s.pos++
	if !s.push(false) {
		return false
	}
	for i := 0; s.element(i == 0); i++ {
		var text, content span
		var hasText, hasContent bool
		if s.ws() == 'n' {
			if !s.literal() {
				return false
			}
		} else if !s.readChoice(&text, &hasText, &content, &hasContent) {
			return false
		}
		if i == 0 {
			switch {
			case hasText:
				f.text = text
			case hasContent:
				f.text = content
			}
		}
	}
	return s.err == nil
}

// readChoice reads one choice: its text and its delta's content.
func (s *scanner) readChoice(text *span, hasText *bool, content *span, hasContent *bool) bool {
	return s.fields(choiceKeys[:], func(i int) bool {
		switch {
		case i == 0 && s.ws() == 'n':
			*hasText = false
			return s.literal()
		case i == 0:
			*hasText = true
			return s.optString(text)
		case i == 1 && s.ws() == 'n':
			*hasContent = false
			return s.literal()
		case i == 1:
			return s.readDelta(content, hasContent)
		}
		_, _, ok := s.skip()
		return ok
	})
}

// readDelta reads a chat choice's delta: its content.
func (s *scanner) readDelta(content *span, hasContent *bool) bool {
	var role span
	return s.fields(deltaKeys[:], func(i int) bool {
		switch {
		case i == 0:
			return s.optString(&role)
		case i == 1 && s.ws() == 'n':
			*hasContent = false
			return s.literal()
		case i == 1:
			*hasContent = true
			return s.optString(content)
		}
		_, _, ok := s.skip()
		return ok
	})
}
