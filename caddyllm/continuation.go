package caddyllm

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"strings"
	"syscall"
	"time"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"go.uber.org/zap"
)

// errDrainCut is the cause of cancelling an attempt at a drain deadline.
// It is a context.Canceled: net/http's transport fails the round trip
// with the cause, and Caddy's reverse_proxy takes a canceled request for
// the client's doing, so it neither retries the dead attempt on other
// upstreams (each retry failing at once) nor counts the failure against
// them in its passive health checks, which then drained healthy
// upstreams for fail_duration. The handler moves the request itself.
var errDrainCut = fmt.Errorf("llm_affinity: upstream drain deadline passed: %w", context.Canceled)

// errSpliceRefused is the cause of cancelling a continuation (or a
// request sent again) that its upstream answered otherwise than with an
// event stream the client's stream can take: its body is not read. The
// proxy's read of it fails with this cause, which its WARN log
// ("aborting with incomplete response") then names; like errDrainCut it
// is a context.Canceled, a cut of the router's own, not the upstream's
// failure.
var errSpliceRefused = fmt.Errorf("llm_affinity: the upstream did not answer with an event stream to splice: %w", context.Canceled)

// statusClientClosedRequest is the status Caddy's proxy logs for a
// request whose client left (nginx's 499).
const statusClientClosedRequest = 499

// maxRedispatch bounds how often one request moves because of drains or
// lost upstreams.
const maxRedispatch = 4

// maxDroppedResends bounds how often one request is sent again because
// its upstream closed the connection before answering. Once covers an
// engine that crashed under it, or a kept-alive connection the engine had
// closed; a request that itself crashes engines (a query of death) takes
// down at most two (or two rounds of Caddy's retries, where lb_retry_match
// retries transport errors). A refused connection does not count: the
// request reached no engine.
const maxDroppedResends = 1

// upstreamLoss says how err, the proxy's, lost the request's upstream
// before any answer: refused, its connection never opened (nothing
// listens there, and Caddy's own retries of that, if any, are spent);
// dropped, its connection closed or reset (an engine that crashed, or a
// kept-alive connection it had closed). Neither for a timeout: a slow
// engine may still be generating behind it.
func upstreamLoss(err error) (refused, dropped bool) {
	var he caddyhttp.HandlerError
	if !errors.As(err, &he) || he.StatusCode != http.StatusBadGateway {
		return false, false
	}
	var dial reverseproxy.DialError
	if errors.As(err, &dial) || errors.Is(err, syscall.ECONNREFUSED) {
		return true, false
	}
	return false, errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, syscall.ECONNRESET)
}

// serve runs the rest of the chain for one request and moves it when its
// attempt is cut off: by a drain deadline, by an upstream that breaks a
// stream off (it died mid-generation), or by one that went away before
// answering (upstreamLoss). A response that has not started is
// re-dispatched with its full body, invisibly to the client; a started
// stream is continued on another upstream (the prompt plus the text so
// far, the remaining max_tokens) and spliced into the same SSE stream;
// anything else ends with an SSE error event, never a hang.
func (h *Handler) serve(rec *tokenRecorder, r *http.Request, next caddyhttp.Handler, st *requestState) error {
	clientCtx := r.Context()
	// The causes of the continuations under way: each counts as continued
	// once the client has the stream's end, and as cut otherwise (the
	// continuation's upstream refused it, none could take it, the client
	// left).
	var continuing []string
	endedClean := false // the stream was ended here with nothing left to generate
	droppedResends := 0 // the times it was sent again after a dropped connection
	defer func() {
		outcome := "cut"
		if rec.done && !rec.failed || endedClean {
			outcome = "continued"
		}
		for _, cause := range continuing {
			st.countMove(cause, outcome)
		}
	}()
	for moves := 0; ; moves++ {
		ctx, cancel := context.WithCancelCause(clientCtx)
		since := st.arrived // queue_timeout counts from the arrival, and anew after a move
		if moves > 0 {
			since = time.Now()
			ctx = ownVars(ctx)
		}
		st.setCancel(cancel, since)
		var actx context.Context = &attemptContext{Context: ctx, st: st}
		if st.req != nil && st.req.PreviousResponseID != "" {
			actx = st.conns.traced(actx)
		}
		ar := &st.firstRequest
		if moves == 0 {
			*ar = *r.WithContext(actx) // not escaping: copied on the stack
		} else {
			// A later attempt's own: the first one's transport may
			// still read the first's (see firstRequest).
			ar = r.WithContext(actx)
		}
		err, aborted := serveRecovering(rec, ar, next)
		cut := st.takeCut() // also ends the discarding of a cut attempt's output
		cancel(nil)

		finished := rec.wroteHeader && !aborted && (rec.done || !rec.sse)
		// refused: the attempt's upstream answered a continuation
		// otherwise than with a stream, and its answer was cut as it came
		// (see tokenRecorder.WriteHeader): the proxy's abort of it is no
		// break of the client's stream, which ends here.
		refused := rec.splice != nil && rec.splice.refused != 0 && clientCtx.Err() == nil
		broken := aborted && rec.sse && !rec.done && !refused
		// lost: the upstream went away before answering (an engine that
		// crashed under its request, or a kept-alive connection it had
		// closed; or nothing listens there). Caddy retries no POST after
		// a connection it had begun to use; the request is sent again
		// here instead: no engine kept it, and the client has nothing yet.
		lost := false
		if !rec.wroteHeader && !aborted && !cut && moves < maxRedispatch && st.shedInfo() == nil {
			switch refused, dropped := upstreamLoss(err); {
			case refused:
				st.markUnreached()
				lost = true
			case dropped && droppedResends < maxDroppedResends:
				droppedResends++
				lost = true
			}
		}
		if clientCtx.Err() != nil || finished || refused || (!cut && !broken && !lost) {
			if aborted && !refused {
				panic(http.ErrAbortHandler)
			}
			rec.flushHeld()
			if (err != nil || rec.splice != nil) && clientCtx.Err() == nil && rec.wroteHeader && rec.sse && !rec.done {
				// The stream has begun and the attempt failed without
				// ending it (a continuation found no upstream, or its
				// upstream refused it or answered with no stream): the
				// headers are gone, so only an error event can tell the
				// client.
				msg := "the upstream failed"
				switch shed := st.shedInfo(); {
				case shed != nil:
					msg = "no upstream could take its continuation: " + shed.message
				case rec.splice != nil && rec.splice.refused != 0:
					who := "the continuation's upstream"
					if rec.splice.restart {
						who = "the upstream it was sent again to"
					}
					msg = fmt.Sprintf("%s answered %d", who, rec.splice.refused)
					if rec.splice.refused == http.StatusOK {
						msg += " with no event stream to splice" // JSON, say, or a compressed stream
					}
				}
				h.logger.Debug("stream ended by a failed attempt", zap.Error(err), zap.String("why", msg))
				return h.endStream(rec, msg)
			}
			if err != nil && !rec.wroteHeader && clientCtx.Err() != nil {
				// The client left before any answer (while held at the
				// gateway, say: the policy then chose no upstream, which
				// the proxy reports as its 503). Caddy's proxy logs a
				// client gone as 499, not as a server error.
				return caddyhttp.Error(statusClientClosedRequest, context.Cause(clientCtx))
			}
			return err
		}
		cause := "upstream_error"
		if cut {
			cause = "drain"
		}
		outcome := func(o string) { st.countMove(cause, o) }
		switch {
		case !rec.wroteHeader && moves >= maxRedispatch:
			// Nothing reached the client: it gets a 503 it may retry.
			outcome("cut")
			st.giveUp(&shedding{status: http.StatusServiceUnavailable, typ: "service_unavailable", code: http.StatusServiceUnavailable,
				message:           "the request was moved between upstreams too many times (their drain deadlines passed); retry later",
				retryAfterSeconds: 1, reason: movedReason})
			return nil
		case !rec.wroteHeader:
			// Nothing reached the client: send the same request again.
			outcome("redispatched")
			continue
		case rec.responses && rec.sse && !rec.outputStarted && moves < maxRedispatch:
			// Its stream had only announced the response (held back):
			// send the same request again, its stream the client's.
			outcome("redispatched")
			rec.restart()
			continue
		case !rec.sse:
			outcome("cut")
			panic(http.ErrAbortHandler) // a partial JSON body cannot be mended
		case moves >= maxRedispatch:
			outcome("cut")
			return h.endStream(rec, "the request was moved too many times")
		}
		rec.dropUnsent() // what was read of a held event the client never got
		body, req, err := h.continuation(st, rec)
		if err != nil {
			outcome("cut")
			h.logger.Debug("stream not continued", zap.Error(err))
			return h.endStream(rec, err.Error())
		}
		// The cut event's start, held back, and the line being read go:
		// the continuation begins at an event's start.
		rec.held, rec.heldEvents, rec.line, rec.skipLine = rec.held[:0], 0, rec.line[:0], false
		if body == nil { // nothing left to generate
			outcome("continued")
			endedClean = true
			return h.endStream(rec, "")
		}
		continuing = append(continuing, cause)
		st.replace(req, body)
		rec.splice = &spliceState{priorTokens: rec.tokens}
		r.Body, r.ContentLength = nil, int64(len(body))
		setContentLength(r.Header, len(body))
	}
}

// ownVars returns ctx with a copy of its request's variable table
// (caddyhttp.VarsCtxKey), for an attempt after a move. Caddy's transport
// reads the table on its dialing goroutine (GetVar in its DialContext),
// which outlives an attempt given up while it dialed, or one that took an
// idle connection first; the next attempt's proxy writes it (SetVar in
// prepareRequest and on each of its tries). One table shared is a data
// race, which the runtime may end the whole process for ("concurrent map
// read and map write"). Only the table's readers meet the original from
// then on: the handlers and the access log after this one find the
// variables set before it, not what a later attempt's proxy set for its
// own use (its dial, PROXY protocol and TLS settings).
func ownVars(ctx context.Context) context.Context {
	vars, _ := ctx.Value(caddyhttp.VarsCtxKey).(map[string]any)
	if vars == nil {
		return ctx
	}
	return context.WithValue(ctx, caddyhttp.VarsCtxKey, maps.Clone(vars))
}

// serveRecovering calls next, turning the proxy's abort of an
// interrupted stream (a panic with http.ErrAbortHandler) into a flag, and
// returning when the policy answered the request itself (see
// Policy.answered).
func serveRecovering(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) (err error, aborted bool) {
	defer func() {
		if v := recover(); v != nil {
			if _, ok := v.(policyAnswered); ok {
				if cause := r.Context().Err(); cause != nil {
					err = caddyhttp.Error(statusClientClosedRequest, cause)
				}
				return
			}
			if v != http.ErrAbortHandler { //nolint:errorlint // the sentinel is panicked as is
				panic(v)
			}
			aborted = true
		}
	}()
	return next.ServeHTTP(w, r), false
}

// endStream finishes a stream that cannot go on: an error event (when
// msg is set) and [DONE], or for the Responses API, whose streams have no
// [DONE], its error event.
func (h *Handler) endStream(rec *tokenRecorder, msg string) error {
	w := &rec.ResponseWriterWrapper
	if rec.responses {
		// The whole events held back go first (the error follows the
		// response's announcement, numbered after it); an event cut off
		// in the middle does not. (Never beyond held's length: its buffer
		// may hold an earlier request's bytes, see keepBuffers.)
		rec.held = rec.held[:min(rec.heldEvents, len(rec.held))]
		rec.flushHeld()
		seq := int64(0)
		if rec.seenSeq {
			seq = rec.lastSeq + 1
		}
		ev, _ := json.Marshal(map[string]any{
			"type": "error", "code": "server_error", "message": "stream interrupted: " + msg, "param": nil,
			"sequence_number": seq,
		})
		_, err := fmt.Fprintf(w, "event: error\ndata: %s\n\n", ev)
		http.NewResponseController(w).Flush()
		return err
	}
	if msg != "" {
		ev, _ := json.Marshal(map[string]any{"error": map[string]any{
			"message": "stream interrupted: " + msg, "type": "server_error", "param": nil, "code": http.StatusServiceUnavailable,
		}})
		fmt.Fprintf(w, "data: %s\n\n", ev)
	}
	_, err := w.Write([]byte("data: [DONE]\n\n"))
	http.NewResponseController(w).Flush()
	return err
}

// continuation builds the request that continues st's stream from the
// text generated so far. It returns a nil body when nothing is left to
// generate.
func (h *Handler) continuation(st *requestState, rec *tokenRecorder) ([]byte, *Request, error) {
	st.mu.Lock()
	orig, endpoint := st.origBody, st.req.Endpoint
	st.mu.Unlock()
	if endpoint == EndpointResponses {
		// Its stream's events carry item ids, output indexes and
		// sequence numbers that a second engine's stream would restart.
		return nil, nil, errors.New("a Responses API stream cannot be continued on another upstream")
	}
	var m map[string]json.RawMessage
	if err := json.Unmarshal(bytes.TrimPrefix(orig, utf8BOM), &m); err != nil {
		return nil, nil, err
	}
	// The recorder keeps one choice's text, and no tool calls: a stream
	// of several choices, or one that may be calling tools, cannot be
	// rebuilt from it.
	if n, ok := rawLaxInt(m["n"]); ok && n > 1 {
		return nil, nil, errors.New("a stream of several choices (n > 1) cannot be continued")
	}
	if tools, ok := m["tools"]; ok && string(tools) != "null" && string(tools) != "[]" {
		return nil, nil, errors.New("a stream that may call tools cannot be continued")
	}
	if constrained(m) {
		// The engine would start the format's grammar anew on the
		// continuation's output, after text that began it already.
		return nil, nil, errors.New("a stream with a response format or structured output cannot be continued")
	}
	if rec.untold {
		return nil, nil, errors.New("a stream with reasoning or tool call deltas cannot be continued from its text")
	}
	if rec.overlong {
		return nil, nil, errors.New("a stream whose text is longer than max_body cannot be continued")
	}
	text := string(rec.generated)
	echo, _ := rawLaxBool(m["echo"])
	switch endpoint {
	case EndpointCompletions:
		// Text only: token ids would need the text generated as token
		// ids, which only the engine's tokenizer gives.
		var prompt string
		var inList []string
		if err := json.Unmarshal(m["prompt"], &prompt); err != nil {
			if json.Unmarshal(m["prompt"], &inList) != nil || len(inList) != 1 {
				return nil, nil, errors.New("only a text prompt can be continued (not token ids, nor several prompts)")
			}
			prompt = inList[0] // a list of one text
		}
		if echo && text != "" {
			// vLLM sends the prompt before the first text: the client has
			// it, and the continuation must not send it again. (Without
			// text yet, the client has no echo either.)
			var ok bool
			if text, ok = strings.CutPrefix(text, prompt); !ok {
				return nil, nil, errors.New("a stream that echoes its prompt cannot be continued unless it began with it")
			}
			m["echo"] = json.RawMessage("false")
		}
		if inList != nil {
			m["prompt"] = mustJSON([]string{prompt + text})
		} else {
			m["prompt"] = mustJSON(prompt + text)
		}
	case EndpointChatCompletions:
		if echo {
			// With echo, vLLM sends the final message again when the
			// answer continues it, as a continuation does.
			return nil, nil, errors.New("a chat stream with echo cannot be continued")
		}
		var msgs []json.RawMessage
		if err := json.Unmarshal(m["messages"], &msgs); err != nil {
			return nil, nil, err
		}
		if continuesFinal, _ := rawLaxBool(m["continue_final_message"]); continuesFinal && len(msgs) > 0 {
			// The engine was extending the client's own final message
			// (a prefilled answer): the text goes on in it, not in a
			// turn of its own, which the chat template would open anew.
			last, err := extendContent(msgs[len(msgs)-1], text)
			if err != nil {
				return nil, nil, err
			}
			msgs[len(msgs)-1] = last
		} else {
			msgs = append(msgs, mustJSON(map[string]string{"role": "assistant", "content": text}))
		}
		m["messages"] = mustJSON(msgs)
		// vLLM's way to extend a partial assistant message.
		m["continue_final_message"] = json.RawMessage("true")
		m["add_generation_prompt"] = json.RawMessage("false")
	default:
		return nil, nil, errors.New("not a generation endpoint")
	}
	if _, given := m["max_tokens"]; endpoint == EndpointCompletions && !given {
		// vLLM's default for a completion (OpenAI's too): the
		// continuation gets what is left of it, not 16 more.
		m["max_tokens"] = json.RawMessage("16")
	}
	for _, key := range []string{"max_tokens", "max_completion_tokens", "kvsim_output_tokens"} {
		if n, ok := rawLaxInt(m[key]); ok && n > 0 {
			left := n - rec.tokens
			if left <= 0 && key != "kvsim_output_tokens" {
				return nil, nil, nil
			}
			m[key] = mustJSON(max(1, left))
		}
	}
	// What the engine must still generate before it may stop; vLLM
	// refuses a min_tokens over max_tokens.
	if n, ok := rawLaxInt(m["min_tokens"]); ok && n > 0 {
		m["min_tokens"] = mustJSON(max(0, n-rec.tokens))
	}
	body := mustJSON(m)
	req := new(Request)
	if err := h.parser.parseInto(req, endpoint, body); err != nil {
		return nil, nil, err
	}
	req.BlockTokens = h.BlockTokens
	return body, req, nil
}

// constrained says the request m asks for structured output: a
// response_format other than text, or vLLM's structured_outputs or
// guided_* parameters.
func constrained(m map[string]json.RawMessage) bool {
	given := func(k string) bool {
		v := bytes.TrimSpace(m[k])
		return len(v) > 0 && string(v) != "null"
	}
	if given("response_format") {
		var format struct{ Type string }
		if json.Unmarshal(m["response_format"], &format) != nil || format.Type != "text" {
			return true
		}
	}
	for _, k := range []string{"structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar"} {
		if given(k) {
			return true
		}
	}
	return false
}

// extendContent returns msg, a chat message, with text added to the end of
// its content: a string, or the text of its last part when that is a
// text part (vLLM joins parts with newlines, so a part of its own would
// add one).
func extendContent(msg json.RawMessage, text string) (json.RawMessage, error) {
	var m map[string]json.RawMessage
	if err := json.Unmarshal(msg, &m); err != nil || m == nil {
		return nil, errors.New("its final message is not an object")
	}
	var s string
	switch content := bytes.TrimSpace(m["content"]); {
	case len(content) == 0 || string(content) == "null":
		m["content"] = mustJSON(text)
	case json.Unmarshal(content, &s) == nil:
		m["content"] = mustJSON(s + text)
	default:
		var parts []map[string]json.RawMessage
		var typ, partText string
		if json.Unmarshal(content, &parts) != nil || len(parts) == 0 ||
			json.Unmarshal(parts[len(parts)-1]["type"], &typ) != nil || typ != "text" ||
			json.Unmarshal(parts[len(parts)-1]["text"], &partText) != nil {
			return nil, errors.New("its final message's content does not end with text")
		}
		parts[len(parts)-1]["text"] = mustJSON(partText + text)
		m["content"] = mustJSON(parts)
	}
	return mustJSON(m), nil
}

// rawLaxBool reads a raw JSON value as the parser reads a boolean field
// (true, "yes", 1), as vLLM does; ok is false for anything else.
func rawLaxBool(raw json.RawMessage) (v, ok bool) {
	p, quoted, ok := rawScalar(raw)
	switch {
	case !ok:
		return false, false
	case !quoted && string(p) == "true":
		return true, true
	case !quoted && string(p) == "false":
		return false, true
	}
	return laxBool(p, quoted)
}

// rawScalar is raw, a JSON value, as the lax readers take it: a string's
// contents (quoted), or the value itself; ok is false for a string that
// does not decode.
func rawScalar(raw json.RawMessage) (p []byte, quoted, ok bool) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || raw[0] != '"' {
		return raw, false, true
	}
	var s string
	if json.Unmarshal(raw, &s) != nil {
		return nil, false, false
	}
	return []byte(s), true, true
}

// rawLaxInt reads a raw JSON value as the parser reads an integer field
// (16, 16.0, "16", true), as vLLM does; ok is false for anything else.
func rawLaxInt(raw json.RawMessage) (int, bool) {
	p, quoted, ok := rawScalar(raw)
	switch {
	case !ok:
		return 0, false
	case !quoted && string(p) == "true":
		return 1, true
	case !quoted && string(p) == "false":
		return 0, true
	}
	return laxInt(p, quoted)
}

func mustJSON(v any) json.RawMessage {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err) // only plain values are marshalled here
	}
	return bytes.TrimSpace(b)
}
