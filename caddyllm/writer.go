package caddyllm

import (
	"bytes"
	"cmp"
	"encoding/json"
	"io"
	"math"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// maxUsageBody bounds how much of a non-streaming response is kept to
// read its usage; longer bodies are passed through uncounted.
const maxUsageBody = 1 << 20

// maxSSELine bounds a buffered SSE line; a longer one is skipped.
const maxSSELine = 1 << 20

// tokenRecorder wraps the response writer to watch an OpenAI-style
// response come back: each SSE chunk with text is one generated token,
// and the final usage (streamed with stream_options.include_usage, or in
// a plain JSON body) gives exact counts. It keeps the text streamed so far
// and the stream's identity, so that a stream cut at a drain deadline can
// be continued on another upstream and spliced in (see splice).
//
// Writes pass through unchanged and unbuffered, except while splicing a
// continuation, when each event is rewritten to the original stream's id.
type tokenRecorder struct {
	caddyhttp.ResponseWriterWrapper
	st *requestState

	wroteHeader bool
	status      int
	sse         bool
	// encoded: the engine compressed the body anyway (the handler asks
	// for identity), so it passes on unread: no tokens, usage or
	// continuation, and the first write stands for the first token.
	encoded bool
	// responses: the stream is the Responses API's, whose events say
	// what they are in their type and which ends with response.completed
	// instead of [DONE].
	responses bool
	// responseID is the Responses API response's id, once seen, and
	// lastSeq the last event's sequence_number.
	responseID string
	lastSeq    int64
	seenSeq    bool
	// outputStarted says a Responses stream sent more than its
	// response's creation (response.created, response.in_progress):
	// until then its events are held back, so that a stream cut before
	// its output is sent again elsewhere unseen.
	outputStarted bool
	// pendingEvent is the type of the Responses event being read, which
	// counts when its end (a blank line) comes.
	pendingEvent string
	done         bool // saw data: [DONE] (or the Responses API's end)
	failed       bool // saw an error event
	line         []byte
	skipLine     bool
	tokens       int // text-bearing chunks sent to the client
	// untold says the stream carried output generated does not keep (a
	// reasoning model's thoughts, a tool call's arguments): it cannot be
	// continued from its text.
	untold bool
	// maxText bounds generated (0: defaultMaxBodyBytes); overlong says
	// the stream's text went past it and is no longer kept, so it cannot
	// be continued either. An engine streaming without end (or text far
	// beyond any context) grew the router's memory with every event.
	maxText  int
	overlong bool
	// unreported counts the tokens of the Write being scanned, reported
	// to the fleet once per Write: the fleet lock is the one decisions
	// take, and one acquisition per streamed token contended with them.
	unreported int
	// body is an unstreamed response, up to maxUsageBody, read for its
	// usage at the end. Up to maxKeptBuffer it is in ownBody, the
	// recorder's buffer, kept with its state (see keepBuffers): a pooled
	// buffer cost a sync.Pool's Get and Put a request. A larger one comes
	// from bodyPool (bodyBuf) and goes back with releaseBody.
	body    []byte
	bodyBuf *pooledBody
	ownBody []byte
	// usage is the response's reported usage, when hasUsage.
	usage    reportedUsage
	hasUsage bool

	// Identity and text of the stream, for continuing it elsewhere.
	streamID      string
	streamObject  string
	streamCreated int64
	streamModel   string
	// generated is the text so far, decoded. It and the other buffers
	// below (scratch, shape, line, held) stay with the request's state
	// when it is reused, emptied (see keepBuffers): none is handed on
	// beyond the request, whatever reads them copies.
	generated []byte
	// scratch holds a decoded string on its way into generated.
	scratch []byte
	// shape is the last token chunk read whole, its text left out, as
	// its event: "data: ", the bytes before the text up to
	// shape[shapeText], those after it and the blank line that ends the
	// event. Engines send every token of a stream in the same chunk with
	// another text; a chunk with the same bytes around a valid string is
	// that chunk, read without scanning it again (see sameShape and
	// tokenEvents, which compares a whole event's bytes at once).
	shape     []byte
	shapeText int
	// shapeSeq is, for a Responses stream's shape (a delta event, from
	// its event line on), where its sequence number goes: it changes at
	// every event, as the text does.
	shapeSeq int
	// readWhole keeps every chunk read whole, as before shapes: the tests
	// compare what the shapes record with it.
	readWhole bool
	// sentText and sentTokens are generated's length and tokens at the
	// end of the last whole event, which writeEvents passes on: text read
	// from an event held back, cut before its end, never reached the
	// client (see dropUnsent).
	sentText, sentTokens int

	// headerSent mirrors wroteHeader for the drain timer's goroutine.
	headerSent atomic.Bool
	// discard drops what the proxy writes after a cut of a response that
	// had not started (it writes a 499 for the cancelled attempt).
	discard atomic.Bool
	// splice is set while a continuation's stream is spliced in.
	splice *spliceState
	// held is the start of an event whose end has not come yet (and,
	// for a Responses stream, the events held back before its output);
	// heldEvents is how much of it is whole events.
	held       []byte
	heldEvents int
}

// usage is the OpenAI usage object (the Responses API's input_tokens and
// output_tokens are read into its prompt and completion counts).
type usage struct {
	PromptTokens        int `json:"prompt_tokens"`
	CompletionTokens    int `json:"completion_tokens"`
	TotalTokens         int `json:"total_tokens"`
	PromptTokensDetails *struct {
		CachedTokens int `json:"cached_tokens"`
	} `json:"prompt_tokens_details,omitempty"`
}

// streamChunk is the part of a streamed chunk the recorder reads.
type streamChunk struct {
	ID      string `json:"id"`
	Object  string `json:"object"`
	Created int64  `json:"created"`
	Model   string `json:"model"`
	Choices []struct {
		Text  *string `json:"text"`
		Delta *struct {
			Role    string  `json:"role"`
			Content *string `json:"content"`
		} `json:"delta"`
	} `json:"choices"`
	Usage *usage `json:"usage"`
}

// text returns the chunk's generated text and whether it is a role-only
// chat chunk.
func (c *streamChunk) text() (string, bool) {
	if len(c.Choices) == 0 {
		return "", false
	}
	ch := c.Choices[0]
	switch {
	case ch.Text != nil:
		return *ch.Text, false
	case ch.Delta != nil && ch.Delta.Content != nil:
		return *ch.Delta.Content, ch.Delta.Role != "" && *ch.Delta.Content == ""
	case ch.Delta != nil:
		return "", ch.Delta.Role != ""
	}
	return "", false
}

func newTokenRecorder(w http.ResponseWriter, st *requestState) *tokenRecorder {
	t := new(tokenRecorder)
	t.init(w, st)
	return t
}

// recorderBuffers are a recorder's buffers, emptied, for the next
// request that uses its state (see requestState.putBack).
type recorderBuffers struct{ generated, scratch, shape, line, held, body []byte }

// maxKeptBuffer is the largest buffer a pooled state keeps, so that one
// long answer does not hold its memory for good.
const maxKeptBuffer = 16 << 10

// keepBuffers returns t's buffers, emptied, but for those over
// maxKeptBuffer.
func (t *tokenRecorder) keepBuffers() recorderBuffers {
	keep := func(b []byte) []byte {
		if cap(b) > maxKeptBuffer {
			return nil
		}
		return b[:0]
	}
	return recorderBuffers{keep(t.generated), keep(t.scratch), keep(t.shape), keep(t.line), keep(t.held), keep(t.ownBody)}
}

// reuseBuffers gives t the buffers keepBuffers kept.
func (t *tokenRecorder) reuseBuffers(b recorderBuffers) {
	t.generated, t.scratch, t.shape, t.line, t.held, t.ownBody = b.generated, b.scratch, b.shape, b.line, b.held, b.body
}

// init sets up a zero recorder to wrap w for st.
func (t *tokenRecorder) init(w http.ResponseWriter, st *requestState) {
	t.ResponseWriter, t.st = w, st
	t.responses = st != nil && st.req != nil && st.req.Endpoint == EndpointResponses
}

// WriteHeader notes the status and whether the response is a stream.
func (t *tokenRecorder) WriteHeader(status int) {
	if t.discard.Load() {
		return
	}
	if t.splice != nil {
		// The client has the stream's headers already. A continuation
		// answered otherwise than with a stream (a 400 for a prompt now
		// too long, a 500) is not spliced in; the handler ends the
		// stream with an error event.
		// The proxy adds the new answer's headers to those of the first
		// (Add, not Set): its Content-Type is the last one.
		// A compressed one cannot join a stream the client reads
		// uncompressed either. Its body is of no use and is not read:
		// the attempt is cut at once. (The proxy read it to its end, and
		// an engine that ignored stream and never ended its JSON held the
		// client's stream open for as long as it wrote.)
		types := t.Header().Values("Content-Type")
		if status >= 200 && (status != http.StatusOK || len(types) == 0 || !strings.HasPrefix(types[len(types)-1], "text/event-stream") ||
			encodedBody(t.Header())) {
			t.splice.refused = status
			if t.st != nil {
				t.st.cancelAttempt(errSpliceRefused)
			}
		}
		return
	}
	if t.wroteHeader {
		return
	}
	if status >= 200 {
		t.wroteHeader = true
		t.status = status
		t.encoded = encodedBody(t.Header())
		ct := t.Header()["Content-Type"] // canonical: no Get's canonicalization
		t.sse = !t.encoded && len(ct) > 0 && strings.HasPrefix(ct[0], "text/event-stream")
		t.headerSent.Store(true)
		if status == http.StatusOK && !t.sse && !t.encoded {
			// A non-streaming completion's headers come once the whole
			// generation is done: its first token is here, its prefill
			// long over (and peer routers learn so before the client can
			// send its next turn elsewhere).
			t.st.progress(1)
		}
	}
	t.ResponseWriterWrapper.WriteHeader(status)
}

// ReadFrom copies through Write, so that what is copied is counted: the
// embedded wrapper's would write to the client directly.
func (t *tokenRecorder) ReadFrom(r io.Reader) (int64, error) {
	return io.Copy(writerOnly{t}, r)
}

// Write counts tokens in p and passes it on.
func (t *tokenRecorder) Write(p []byte) (int, error) {
	if t.discard.Load() {
		return len(p), nil
	}
	if t.splice != nil {
		if t.splice.refused != 0 {
			return len(p), nil
		}
		if !t.splice.restart {
			_, err := t.scan(p, true)
			return len(p), err
		}
		// A request sent again from the start: its stream is the
		// client's, passed on as it comes.
	}
	if !t.wroteHeader {
		t.WriteHeader(http.StatusOK)
	}
	if t.encoded {
		if t.status == http.StatusOK && t.tokens == 0 && len(p) > 0 && t.st != nil {
			t.tokens = 1
			t.st.progress(1)
		}
		return t.ResponseWriterWrapper.Write(p)
	}
	if t.status == http.StatusOK {
		if t.sse {
			end, _ := t.scan(p, false)
			if t.responses && !t.outputStarted {
				if len(t.held)+len(p) <= maxSSELine {
					if end >= 0 {
						t.heldEvents = len(t.held) + end
					}
					t.held = append(t.held, p...)
					return len(p), nil
				}
				// Too large to hold: the client sees it, so the request
				// can no longer be sent again unseen.
				t.outputStarted = true
			}
			return t.writeEvents(p, end)
		}
		if len(t.body)+len(p) <= maxUsageBody {
			t.appendBody(p)
		}
		if t.responses && t.responseID == "" && t.st != nil && len(t.body)-len(p) < maxIDScan {
			// The id comes first: the peers learn the response's home
			// before the client has read the body. Only the body's start
			// is scanned, however large the write that brought it.
			if id, ok := scanResponseID(t.body[:min(len(t.body), maxIDScan)]); ok && id != "" {
				t.responseID = id
				t.st.rememberResponse(id)
			}
		}
	} else if t.status == http.StatusNotFound && len(t.body) < maxNotFoundBody {
		// An engine's 404 says what it did not find (see modelNotServed).
		t.appendBody(p[:min(len(p), maxNotFoundBody-len(t.body))])
	}
	return t.ResponseWriterWrapper.Write(p)
}

// appendBody adds p to the body kept: in ownBody while the body fits in
// maxKeptBuffer, in a buffer from bodyPool from then on.
func (t *tokenRecorder) appendBody(p []byte) {
	if t.bodyBuf == nil {
		if len(t.body)+len(p) <= maxKeptBuffer {
			if t.body == nil {
				t.body = t.ownBody[:0]
			}
			t.body = append(t.body, p...)
			t.ownBody = t.body // grown, maybe
			return
		}
		t.bodyBuf = newPooledBody()
		t.body = append(t.bodyBuf.b[:0], t.body...)
	}
	t.body = append(t.body, p...)
}

// maxNotFoundBody is how much of an engine's 404 is kept: its message.
const maxNotFoundBody = 1 << 10

// maxIDScan is how much of a Responses body is scanned for its id while it
// arrives, at each write: the id comes first, within a few hundred bytes.
const maxIDScan = 4 << 10

// writeEvents passes on what was held back and the whole events in p,
// whose last ends at end (-1: none ends in p), and holds back the start
// of an event until its end arrives: a stream cut in the middle of an
// event must leave the client only whole events, so that a continuation
// can follow them. An event longer than maxSSELine is passed on as it
// comes.
func (t *tokenRecorder) writeEvents(p []byte, end int) (int, error) {
	if end < 0 && len(t.held)+len(p) <= maxSSELine {
		t.held = append(t.held, p...)
		return len(p), nil
	}
	if end < 0 {
		end = len(p)
		t.markSent() // too long to hold: it goes as it comes
	}
	if len(t.held) > 0 {
		if _, err := t.ResponseWriterWrapper.Write(t.held); err != nil {
			return 0, err
		}
	}
	if _, err := t.ResponseWriterWrapper.Write(p[:end]); err != nil {
		return 0, err
	}
	t.held, t.heldEvents = t.held[:0], 0
	if end < len(p) {
		t.held = append(t.held, p[end:]...)
	}
	return len(p), nil
}

// flushHeld passes on what writeEvents held back: the attempt ended
// normally, so it is all the stream has.
func (t *tokenRecorder) flushHeld() {
	t.markSent()
	if len(t.held) > 0 {
		t.ResponseWriterWrapper.Write(t.held)
		t.held, t.heldEvents = t.held[:0], 0
		http.NewResponseController(&t.ResponseWriterWrapper).Flush()
	}
}

// scan splits p into SSE lines and handles each; when rewrite is set it
// writes the (rewritten) lines itself. It returns the offset in p just
// after the last blank line (the end of an event), -1 when none is in p.
func (t *tokenRecorder) scan(p []byte, rewrite bool) (end int, err error) {
	defer t.reportTokens()
	end = -1
	for off := 0; off < len(p); {
		if !rewrite && len(t.line) == 0 && !t.skipLine {
			// The usual token events, read whole, without lines.
			if n := t.tokenEvents(p[off:]); n > 0 {
				off += n
				end = off
				t.markSent()
				continue
			}
		}
		i := bytes.IndexByte(p[off:], '\n')
		if i < 0 {
			if len(t.line)+len(p)-off > maxSSELine {
				t.skipLine, t.line = true, t.line[:0]
			} else if !t.skipLine {
				t.line = append(t.line, p[off:]...)
			}
			return end, nil
		}
		line := p[off : off+i]
		if len(t.line) > 0 {
			t.line = append(t.line, line...)
			line = t.line
		}
		if !t.skipLine {
			line = bytes.TrimSuffix(line, []byte{'\r'})
			if len(line) == 0 {
				end = off + i + 1
				t.markSent()
			}
			out := t.event(line, rewrite)
			if rewrite && out != nil {
				if _, err := t.ResponseWriterWrapper.Write(append(out, '\n')); err != nil {
					return end, err
				}
			}
		}
		t.line, t.skipLine = t.line[:0], false
		off += i + 1
	}
	if rewrite {
		return end, http.NewResponseController(&t.ResponseWriterWrapper).Flush()
	}
	return end, nil
}

// event handles one SSE line: it records tokens, text, identity and
// usage. When rewriting it returns the line to send, or nil to drop it.
func (t *tokenRecorder) event(line []byte, rewrite bool) []byte {
	if t.responses {
		// The event's name, on its own line before its data, counts once
		// the event ends (a blank line): the end is seen even when the
		// data (response.completed carries the whole response) is too
		// long to read, and not before the event has all come.
		if name, ok := bytes.CutPrefix(line, []byte("event:")); ok {
			t.pendingEvent = string(bytes.TrimSpace(name))
			return line
		}
		if len(line) == 0 && t.pendingEvent != "" {
			t.responseEventName(t.pendingEvent)
			t.pendingEvent = ""
		}
	}
	data, ok := bytes.CutPrefix(line, []byte("data:"))
	if !ok {
		if rewrite && len(line) > 0 {
			return nil // comments and other fields of the continuation
		}
		return line
	}
	data = bytes.TrimSpace(data)
	if string(data) == "[DONE]" {
		t.done = true
		return line
	}
	if bytes.HasPrefix(data, []byte(`{"error"`)) {
		// vLLM ends a failed stream with an error event, then [DONE]:
		// the stream did not complete, whatever follows.
		t.failed = true
		return line
	}
	if t.responses {
		t.responseEvent(data)
		return line
	}
	if !rewrite {
		// The usual chunk is read without decoding it, and most often
		// without reading it again.
		if t.sameShape(data) {
			return line
		}
		var f chunkFields
		if readChunk(data, &f) {
			t.recordChunk(data, &f)
			return line
		}
	}
	var chunk streamChunk
	if json.Unmarshal(data, &chunk) != nil {
		return line
	}
	if t.streamID == "" && chunk.ID != "" {
		t.streamID, t.streamObject, t.streamCreated, t.streamModel = chunk.ID, chunk.Object, chunk.Created, chunk.Model
	}
	text, roleOnly := chunk.text()
	if rewrite {
		if roleOnly {
			return nil // the client already had the assistant role
		}
		data = t.splice.rewrite(data, &chunk, t)
		line = append([]byte("data: "), data...)
	}
	if chunk.Usage != nil {
		t.usage, t.hasUsage = chunk.Usage.reported(), true
	}
	if text != "" {
		t.countToken()
		keepText(t, text)
		// An event of several tokens can end a reasoning model's
		// thoughts and begin its answer.
		t.untold = t.untold || thinks(data)
	} else if generatesOtherwise(data) {
		t.countToken()
		t.untold = true
	}
	if chunk.Usage != nil {
		t.countReported()
	}
	return line
}

// markSent notes that what was read so far reaches the client.
func (t *tokenRecorder) markSent() {
	t.sentText, t.sentTokens = len(t.generated), t.tokens
}

// dropUnsent forgets the text and tokens read from an event held back
// when its attempt was cut before the event's end: the client never got
// them, and a continuation must follow what the client has.
func (t *tokenRecorder) dropUnsent() {
	t.generated = t.generated[:min(len(t.generated), t.sentText)]
	t.tokens = t.sentTokens
}

// addText counts a chunk's text, raw as in the chunk (escaped when it has
// escapes), as a token and keeps it.
func (t *tokenRecorder) addText(raw []byte, escaped bool) {
	t.countToken()
	if !escaped && isASCII(raw) {
		// Most tokens: their text as it is.
		keepText(t, raw)
		return
	}
	keepText(t, decodeInto(&t.scratch, raw, escaped))
}

// keepText adds text to what t's stream generated, while that stays
// within maxText; past it, nothing more is kept and the stream is
// overlong. A continuation would send the text back as its prompt, in a
// body larger than the handler's max_body, which no client may send.
func keepText[S string | []byte](t *tokenRecorder, text S) {
	if t.overlong || len(t.generated)+len(text) > cmp.Or(t.maxText, defaultMaxBodyBytes) {
		t.overlong = true
		return
	}
	t.generated = append(t.generated, text...)
}

// countToken counts a generated token, reported to the fleet at the end
// of the Write (see unreported).
func (t *tokenRecorder) countToken() {
	t.tokens++
	t.unreported++
}

// countReported raises the count of tokens generated to what the stream's
// usage says (a continuation's, rewritten to cover the whole generation):
// an engine that puts several tokens in a chunk (vLLM's stream_interval,
// speculative decoding, or its output collector merging deltas when the
// API server falls behind) makes the count of chunks short, and one that
// reports its usage in every chunk (stream_options.continuous_usage_stats)
// gives the exact figure, so that a continuation asks for what is left of
// max_tokens. The engine's figure is not trusted beyond the bytes of text
// generated (a token has at least one).
func (t *tokenRecorder) countReported() {
	if n := min(t.usage.completionTokens, len(t.generated)); n > t.tokens {
		t.unreported += n - t.tokens
		t.tokens = n
	}
}

// sameShape records data, a chunk, and reports true when it is the last
// token chunk read whole (shape) with another text: the same bytes before
// and after a string that is valid and not empty. Such a chunk is what
// readChunk would read as that one with this text (the JSON around is
// byte for byte one it read), so recordChunk would record only the text.
func (t *tokenRecorder) sameShape(data []byte) bool {
	if len(t.shape) == 0 {
		return false
	}
	head, tail := t.shape[len(eventData):t.shapeText], t.shape[t.shapeText:len(t.shape)-len(eventEnd)]
	start, end, after, escaped, ok := shapedText(data, head, tail)
	if !ok || after != len(data) {
		return false
	}
	t.addText(data[start:end], escaped)
	return true
}

// The bytes around a token chunk's data in its event, as tokenEvents reads
// it.
const (
	eventData = "data: "
	eventEnd  = "\n\n"
)

// shapedText finds head, a valid, non-empty string and tail at the start
// of data: a token chunk or event of the last one's shape, head ending
// with the quote opening its text. It returns the text's range, whether
// it has escapes and where tail ends; ok is false when data does not
// start so.
func shapedText(data, head, tail []byte) (start, end, after int, escaped, ok bool) {
	if !bytes.HasPrefix(data, head) {
		return 0, 0, 0, false, false
	}
	start = len(head)
	end, escaped, ok = stringAt(data, start)
	if !ok || end == start || !bytes.HasPrefix(data[end:], tail) {
		return 0, 0, 0, false, false
	}
	return start, end, end + len(tail), escaped, true
}

// tokenEvents records the whole token events at the start of p (at the
// start of a line), each a single data line whose chunk has the last
// token chunk's shape (see sameShape), and returns their length: what an
// engine sends for each token is read without splitting it into lines.
// Such a line holds no line break (the shape's bytes come from one line,
// a valid string has none), so it is read as scan would read it.
func (t *tokenRecorder) tokenEvents(p []byte) int {
	if len(t.shape) == 0 {
		return 0
	}
	if t.responses {
		return t.responseTokenEvents(p)
	}
	// The event's bytes around its text, each compared at once.
	head, tail := t.shape[:t.shapeText], t.shape[t.shapeText:]
	n := 0
	for {
		start, end, after, escaped, ok := shapedText(p[n:], head, tail)
		if !ok {
			return n
		}
		t.addText(p[n+start:n+end], escaped)
		n += after
	}
}

// learnResponseShape keeps the shape of a Responses delta event read
// whole (data, with ev and typ as read): its event line, named typ as
// pendingEvent says, its data but for the delta's text and the sequence
// number after it, and the blank line that ends it. Only plain ones: no
// usage or response id, a number of digits alone.
func (t *tokenRecorder) learnResponseShape(data []byte, ev *responseEvent, typ string) {
	delta, seq := ev.deltaText, ev.seqNumber
	if t.readWhole || t.pendingEvent != typ || ev.hasUsage || ev.id.end > ev.id.start || !ev.hasSeq ||
		seq.start < delta.end || plainDigits(data[seq.start:seq.end]) < 0 {
		return
	}
	t.shape = append(append(append(t.shape[:0], "event: "...), typ...), "\ndata: "...)
	lead := len(t.shape)
	t.shape = append(append(append(append(t.shape, data[:delta.start]...), data[delta.end:seq.start]...), data[seq.end:]...), eventEnd...)
	t.shapeText, t.shapeSeq = lead+delta.start, lead+seq.start-(delta.end-delta.start)
}

// plainDigits returns the value of p, a JSON integer of at most 18
// digits with no sign, fraction or leading zero, and -1 for anything else.
func plainDigits(p []byte) int64 {
	if len(p) == 0 || len(p) > 18 || len(p) > 1 && p[0] == '0' {
		return -1
	}
	var n int64
	for _, c := range p {
		if c < '0' || c > '9' {
			return -1
		}
		n = n*10 + int64(c-'0')
	}
	return n
}

// responseTokenEvents is tokenEvents for a Responses stream: whole delta
// events of the shape, their text and sequence number aside, each
// recorded as responseEvent records it (a token, the sequence number,
// the output begun) and as its end does (the event's name, counted).
func (t *tokenRecorder) responseTokenEvents(p []byte) int {
	head, mid, tail := t.shape[:t.shapeText], t.shape[t.shapeText:t.shapeSeq], t.shape[t.shapeSeq:]
	n := 0
	for {
		event := p[n:]
		if !bytes.HasPrefix(event, head) {
			return n
		}
		start := len(head)
		end, _, ok := stringAt(event, start)
		if !ok || end == start {
			return n
		}
		rest, ok := bytes.CutPrefix(event[end:], mid)
		if !ok {
			return n
		}
		digits := 0
		for digits < len(rest) && '0' <= rest[digits] && rest[digits] <= '9' {
			digits++
		}
		seq := plainDigits(rest[:digits])
		rest, ok = bytes.CutPrefix(rest[digits:], tail) // with the blank line
		if seq < 0 || !ok {
			return n
		}
		t.countToken()
		t.outputStarted = true
		t.lastSeq, t.seenSeq = seq, true
		t.pendingEvent = ""
		n += len(event) - len(rest)
	}
}

// recordChunk records what readChunk found in a chunk: as event does
// with the decoded chunk.
func (t *tokenRecorder) recordChunk(data []byte, f *chunkFields) {
	if t.streamID == "" && f.id.end > f.id.start {
		t.streamID = t.decode(data, f.id)
		t.streamObject = t.decode(data, f.object)
		t.streamModel = t.decode(data, f.model)
		t.streamCreated = f.created
	}
	if f.hasUsage {
		t.usage, t.hasUsage = withCached(f.usage, f.cached, f.hasCached), true
	}
	if raw := data[f.text.start:f.text.end]; len(raw) > 0 {
		t.addText(raw, bytes.IndexByte(raw, '\\') >= 0)
		// An event of several tokens can end a reasoning model's
		// thoughts and begin its answer. (Read whole only: a chunk of
		// the shape, text and nothing else, has none.)
		t.untold = t.untold || thinks(data)
		if !f.hasUsage && !t.readWhole {
			t.shape = slices.Grow(t.shape[:0], len(eventData)+len(data)-len(raw)+len(eventEnd))
			t.shape = append(append(append(append(t.shape, eventData...), data[:f.text.start]...), data[f.text.end:]...), eventEnd...)
			t.shapeText = len(eventData) + f.text.start
		}
	} else if generatesOtherwise(data) {
		// A tool call's arguments or a reasoning model's thoughts are
		// generated tokens too: the first one ends the prefill.
		t.countToken()
		t.untold = true
	}
	if f.hasUsage {
		t.countReported()
	}
}

// responseEvent records a Responses API stream event: each delta (of the
// output text, a tool call's arguments, reasoning) is a generated token;
// response.completed, or response.incomplete (stopped at
// max_output_tokens), ends the stream with the usage; response.failed
// and error end it failed.
func (t *tokenRecorder) responseEvent(data []byte) {
	known := t.responseID != ""
	var ev responseEvent
	var typ string
	scanned := readResponseEvent(data, &ev)
	if scanned {
		typ = string(data[ev.typ.start:ev.typ.end])
	} else {
		var e struct {
			Type           string          `json:"type"`
			Delta          json.RawMessage `json:"delta"`
			SequenceNumber *int64          `json:"sequence_number"`
			Response       *struct {
				ID    string          `json:"id"`
				Usage *responsesUsage `json:"usage"`
			} `json:"response"`
		}
		if json.Unmarshal(data, &e) != nil {
			return
		}
		typ = e.Type
		var delta string
		ev.delta = json.Unmarshal(e.Delta, &delta) == nil && delta != ""
		if e.Response != nil && e.Response.Usage != nil {
			ev.usage, ev.hasUsage = e.Response.Usage.usage(), true
		}
		if e.Response != nil && t.responseID == "" {
			t.responseID = e.Response.ID
		}
		if e.SequenceNumber != nil {
			ev.seq, ev.hasSeq = *e.SequenceNumber, true
		}
	}
	if ev.hasSeq {
		t.lastSeq, t.seenSeq = ev.seq, true
	}
	if t.responseID == "" && ev.id.end > ev.id.start {
		t.responseID = t.decode(data, ev.id)
	}
	if !known && t.responseID != "" && t.st != nil {
		// Its first event names it: the peers learn its home while it
		// runs, well before the client's next turn.
		t.st.rememberResponse(t.responseID)
	}
	if ev.delta && strings.HasSuffix(typ, ".delta") {
		t.countToken()
		t.outputStarted = true
		if scanned { // the spans are only whole when the scanner read it all
			t.learnResponseShape(data, &ev, typ)
		}
	} else if typ != "" {
		t.pendingEvent = typ // counts when the event ends
	}
	if ev.hasUsage {
		t.usage, t.hasUsage = withCached(ev.usage, ev.cached, ev.hasCached), true
	}
}

// responseEventName records a Responses API event that ends the stream:
// response.completed or response.incomplete (stopped at
// max_output_tokens) completes it, response.failed and error fail it.
func (t *tokenRecorder) responseEventName(typ string) {
	switch typ {
	case "response.completed", "response.incomplete":
		t.done = true
	case "response.failed", "error":
		t.failed = true
	case "", "response.created", "response.in_progress", "response.queued":
		return // the response's creation: no output yet
	}
	t.outputStarted = true
}

// restart readies the recorder for its request, sent again from the start
// after its Responses stream was cut before any output: what was held
// back goes, and the new attempt's stream is passed on as the client's.
func (t *tokenRecorder) restart() {
	t.held, t.heldEvents, t.line, t.skipLine, t.pendingEvent = t.held[:0], 0, t.line[:0], false, ""
	t.done, t.failed, t.responseID, t.lastSeq, t.seenSeq = false, false, "", 0, false
	t.shape, t.shapeText, t.shapeSeq = t.shape[:0], 0, 0 // the new attempt's stream is read whole first
	t.splice = &spliceState{restart: true}
}

// responsesUsage is the Responses API's usage object, for encoding/json.
type responsesUsage struct {
	InputTokens        int `json:"input_tokens"`
	OutputTokens       int `json:"output_tokens"`
	TotalTokens        int `json:"total_tokens"`
	InputTokensDetails *struct {
		CachedTokens int `json:"cached_tokens"`
	} `json:"input_tokens_details"`
}

// usage returns u in the chat API's names.
func (u *responsesUsage) usage() usage {
	return usage{PromptTokens: u.InputTokens, CompletionTokens: u.OutputTokens, TotalTokens: u.TotalTokens,
		PromptTokensDetails: u.InputTokensDetails}
}

// reportedUsage is the part of a response's usage the router reads, kept
// by value (see usage.reported).
type reportedUsage struct {
	promptTokens, completionTokens int
	// cachedTokens is the prompt's tokens found in the prefix cache, -1
	// when not reported.
	cachedTokens int
}

// reported returns what the router reads of u.
func (u *usage) reported() reportedUsage {
	r := reportedUsage{promptTokens: u.PromptTokens, completionTokens: u.CompletionTokens, cachedTokens: -1}
	if u.PromptTokensDetails != nil {
		r.cachedTokens = u.PromptTokensDetails.CachedTokens
	}
	return r
}

// withCached returns what the router reads of u with its prompt's cached
// tokens, when reported.
func withCached(u usage, cached int, hasCached bool) reportedUsage {
	r := u.reported()
	if hasCached {
		r.cachedTokens = cached
	}
	return r
}

// generatesOtherwise reports whether a chunk without text carries a tool
// call or reasoning (vLLM's reasoning_content, or reasoning).
func generatesOtherwise(data []byte) bool {
	return indexByRare(data, `"tool_calls":[{`, '[') >= 0 || thinks(data)
}

// thinks reports whether a chunk carries a reasoning model's thoughts
// (reasoning_content, or reasoning, not empty): one search for both
// keys, as most chunks have neither. For a chunk with text it is all
// generatesOtherwise asks (tool calls come only to a request that offers
// tools, which is not continued anyway).
func thinks(data []byte) bool {
	i := indexByRare(data, `"reasoning`, 'g')
	if i < 0 {
		return false
	}
	return nonEmptyString(data[i:], `"reasoning_content":"`) || nonEmptyString(data[i:], `"reasoning":"`)
}

// nonEmptyString reports whether key (a JSON key and the quote opening its
// value) appears in data with a value that is not empty.
func nonEmptyString(data []byte, key string) bool {
	i := indexByRare(data, key, 'g')
	return i >= 0 && i+len(key) < len(data) && data[i+len(key)] != '"'
}

// indexByRare is bytes.Index(data, key), searched for from the first
// occurrence in key of rare (which key must have), a byte chunks have few
// of: bytes.Index looks for the first byte first, and stops at every
// quote, JSON's most frequent byte, or every t or r after it (an empty
// chunk cost a thousand instructions a search).
func indexByRare(data []byte, key string, rare byte) int {
	at := strings.IndexByte(key, rare)
	for off := at; off < len(data); {
		i := bytes.IndexByte(data[off:], rare)
		if i < 0 {
			return -1
		}
		if start := off + i - at; start+len(key) <= len(data) && string(data[start:start+len(key)]) == key {
			return start
		}
		off += i + 1
	}
	return -1
}

// decode returns the string at sp of data, decoded.
func (t *tokenRecorder) decode(data []byte, sp span) string {
	raw := data[sp.start:sp.end]
	return string(decodeString(t.scratch[:0], raw, bytes.IndexByte(raw, '\\') >= 0))
}

// reportTokens passes the tokens scanned so far to the fleet's accounting.
func (t *tokenRecorder) reportTokens() {
	if t.unreported > 0 {
		t.st.progress(t.unreported)
		t.unreported = 0
	}
}

// releaseBody puts the buffer of the response kept for its usage back in
// bodyPool, or leaves it in ownBody, once complete has read it: only the
// recorder reads it.
func (t *tokenRecorder) releaseBody() {
	if t.bodyBuf != nil {
		t.bodyBuf.b = t.body
		t.bodyBuf.release()
		t.bodyBuf = nil
	}
	t.body = nil
}

// complete reports whether the response ended normally.
func (t *tokenRecorder) complete() bool {
	if t.encoded {
		return false // its usage cannot be read: nothing to learn
	}
	if t.sse {
		return t.done && !t.failed
	}
	rest, ok := usageValue(t.body)
	if ok {
		t.usage, ok = usageOfValue(rest, t.responses)
		t.hasUsage = ok
	}
	if t.responses {
		// Its id, also for a response not done (see below), which its
		// engine has stored all the same; Write read it already from
		// the body's start unless it lay further in.
		if t.responseID == "" {
			t.responseID = responseIDOfBody(t.body)
		}
		if ok && bytes.HasPrefix(bytes.TrimSpace(rest), []byte("null")) {
			// A response not done yet (background: true answers at once,
			// queued): its engine still works on it.
			return false
		}
	}
	return ok
}

// usageOfBody reads the usage object of a complete JSON completion body.
// Decoding the whole body (the generated text) to reach it was the most
// expensive thing the router did per request, so only the object after
// the last "usage" key is read, with the request's scanner (encoding/json
// only for what it does not handle); the body must still end its object.
func usageOfBody(body []byte, responses bool) (reportedUsage, bool) {
	rest, ok := usageValue(body)
	if !ok {
		return reportedUsage{}, false
	}
	return usageOfValue(rest, responses)
}

// usageOfValue reads the usage object at the start of rest (what
// usageValue found).
func usageOfValue(rest []byte, responses bool) (reportedUsage, bool) {
	var u usage
	var depth [1]uint64
	s := scanner{buf: rest, inObject: depth[:]}
	var cached int
	var hasCached bool
	keys := usageKeys[:]
	if responses {
		keys = responsesUsageKeys[:]
	}
	if s.readUsage(keys, &u, &cached, &hasCached) {
		return withCached(u, cached, hasCached), true
	}
	// Anything unusual is for encoding/json to read.
	decoded, ok := decodeUsage(rest, responses)
	if !ok {
		return reportedUsage{}, false
	}
	return decoded.reported(), true
}

// decodeUsage decodes the usage object at the start of rest with
// encoding/json, in the Responses API's names when responses is set.
func decodeUsage(rest []byte, responses bool) (*usage, bool) {
	dec := json.NewDecoder(bytes.NewReader(rest))
	if responses {
		var r *responsesUsage
		if dec.Decode(&r) != nil {
			return nil, false
		}
		if r == nil {
			return &usage{}, true // null, as encoding/json leaves a usage
		}
		u := r.usage()
		return &u, true
	}
	var u usage
	if dec.Decode(&u) != nil {
		return nil, false
	}
	return &u, true
}

// usageValue returns what follows the colon of the last "usage" key of a
// complete JSON object body.
func usageValue(body []byte) ([]byte, bool) {
	body = bytes.TrimSpace(body)
	// The last occurrence, found by forward searches: bytes.Index is
	// vectorized and LastIndex is not, and the usage comes near the end.
	// The search is for usage" and the quote before it checked after: a
	// search starting with a quote stops at every quote of the body.
	key := []byte(`usage"`)
	i := -1
	for from := 1; from < len(body); {
		at := bytes.Index(body[from:], key)
		if at < 0 {
			break
		}
		if at += from; body[at-1] == '"' {
			i = at - 1
		}
		from = at + 1
	}
	return valueAfterUsageKey(body, i)
}

// valueAfterUsageKey returns what follows the colon of the "usage" key at
// i (-1: none) of body, a JSON object with its space trimmed.
func valueAfterUsageKey(body []byte, i int) ([]byte, bool) {
	if i < 0 || len(body) == 0 || body[0] != '{' || body[len(body)-1] != '}' {
		return nil, false
	}
	// JSON's whitespace skipped in a loop: bytes.TrimLeft builds a set of
	// its four bytes on every call, and a scanner to call ws on (its
	// whitespace, the same four) cost 33 instructions a request more.
	for i += len(`"usage"`); i < len(body); i++ {
		switch body[i] {
		case ' ', '\t', '\r', '\n':
			continue
		case ':':
			return body[i+1:], true
		}
		break
	}
	return nil, false
}

// completionTokens is the output length: the usage's when reported, else
// the tokens counted.
func (t *tokenRecorder) completionTokens() int {
	if t.hasUsage {
		return t.usage.completionTokens
	}
	return t.tokens
}

// cachedTokens is the engine's reported prefix-cache hit, or -1.
func (t *tokenRecorder) cachedTokens() int {
	if !t.hasUsage {
		return -1
	}
	return t.usage.cachedTokens
}

// spliceState rewrites a continuation's chunks into the original stream.
type spliceState struct {
	// priorTokens were generated before the continuation began; the
	// continuation counts them as prompt.
	priorTokens int
	// refused is the status of a continuation the upstream did not
	// answer with an event stream (0: it did): its body is not spliced,
	// nor read (its attempt is cancelled), and the stream ends there.
	refused int
	// restart says the request was sent again from the start (a
	// Responses stream cut before its output): its stream is not
	// rewritten but passed on as it comes.
	restart bool
}

// addTokens is a + b for b ≥ 0, saturating at math.MaxInt.
func addTokens(a, b int) int {
	if a > math.MaxInt-b {
		return math.MaxInt
	}
	return a + b
}

// rewriteUsage sets the counts of u in raw, a usage object (u decoded
// from it), keeping its other members (completion_tokens_details, and
// the like).
func rewriteUsage(raw json.RawMessage, u *usage) json.RawMessage {
	var m map[string]json.RawMessage
	if json.Unmarshal(raw, &m) != nil {
		return raw // not so: u came from it
	}
	set := func(m map[string]json.RawMessage, k string, v int) {
		m[k] = json.RawMessage(strconv.Itoa(v))
	}
	set(m, "prompt_tokens", u.PromptTokens)
	set(m, "completion_tokens", u.CompletionTokens)
	set(m, "total_tokens", u.TotalTokens)
	if d := u.PromptTokensDetails; d != nil {
		var details map[string]json.RawMessage
		if json.Unmarshal(m["prompt_tokens_details"], &details) == nil && details != nil {
			set(details, "cached_tokens", d.CachedTokens)
			if b, err := json.Marshal(details); err == nil {
				m["prompt_tokens_details"] = b
			}
		}
	}
	b, err := json.Marshal(m)
	if err != nil {
		return raw
	}
	return b
}

// rewrite gives a continuation chunk the original stream's identity and
// fixes its usage to cover the whole generation.
func (s *spliceState) rewrite(data []byte, chunk *streamChunk, t *tokenRecorder) []byte {
	var m map[string]json.RawMessage
	if json.Unmarshal(data, &m) != nil {
		return data
	}
	set := func(k string, v any) {
		if b, err := json.Marshal(v); err == nil {
			m[k] = b
		}
	}
	set("id", t.streamID)
	set("created", t.streamCreated)
	set("model", t.streamModel)
	if u := chunk.Usage; u != nil {
		// The engine's counts are not trusted (see observeCompletion):
		// a count near the int's range saturates there rather than
		// wrapping round to a negative figure the client gets, and stays
		// beyond router.MaxTokens, which the router does not learn from.
		if u.PromptTokens > s.priorTokens {
			u.PromptTokens -= s.priorTokens
		} else {
			u.PromptTokens = 0
		}
		u.CompletionTokens = addTokens(u.CompletionTokens, s.priorTokens)
		u.TotalTokens = addTokens(u.CompletionTokens, u.PromptTokens)
		if d := u.PromptTokensDetails; d != nil {
			// The continuation's cache may hold some of the text it
			// was given as prompt, which the client's prompt is not.
			d.CachedTokens = min(d.CachedTokens, u.PromptTokens)
		}
		m["usage"] = rewriteUsage(m["usage"], u)
	}
	out, err := json.Marshal(m)
	if err != nil {
		return data
	}
	return out
}
