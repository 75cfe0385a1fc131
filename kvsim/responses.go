package kvsim

import (
	"bytes"
	"cmp"
	"encoding/json"
	"fmt"
	"maps"
	"math"
	"net/http"
	"strconv"
	"strings"
	"sync"
)

// The Responses API (POST /v1/responses), as vLLM serves it: the input
// becomes chat messages rendered with the chat template, and the answer
// is a response object, or a stream of typed events ending with
// response.completed (its response's status "incomplete" when
// max_output_tokens stopped it: vLLM sends no response.incomplete event),
// without [DONE].

// responseItem is the part of a Responses API input item kvsim reads.
type responseItem struct {
	Type    string          `json:"type"`
	Role    string          `json:"role"`
	Content json.RawMessage `json:"content"`
	// A function call's, and its output's.
	CallID    string          `json:"call_id"`
	Name      string          `json:"name"`
	Arguments string          `json:"arguments"`
	Output    json.RawMessage `json:"output"`
}

// RenderResponses renders a Responses API request with the chat template
// (see responseMessages).
func (p *ParsedRequest) RenderResponses(previous []ChatMessage) ([]byte, error) {
	return RenderChat(p.responseMessages(previous), p.Tools, true, false)
}

// responseMessages is the conversation a Responses API request renders,
// as vLLM builds it: the instructions as a system message, then the
// stored conversation it continues (previous, nil for none: the earlier
// request's messages, its own instructions among them, and its output),
// then its input.
func (p *ParsedRequest) responseMessages(previous []ChatMessage) []ChatMessage {
	var msgs []ChatMessage
	if p.Instructions != nil {
		msgs = append(msgs, ChatMessage{Role: "system", Content: mustJSON(*p.Instructions)})
	}
	return append(append(msgs, previous...), p.Messages...)
}

// responsesMessages turns the input into the chat messages the chat
// template renders: a string as a user message, message items as they
// are, a function call as an assistant message calling a tool and its
// output as a tool message. Reasoning items are dropped, as engines do
// for models that do not read them back.
func responsesMessages(input json.RawMessage) ([]ChatMessage, error) {
	var msgs []ChatMessage
	input = bytes.TrimSpace(input)
	switch {
	case len(input) == 0 || bytes.Equal(input, []byte("null")):
		return nil, errBadRequest("input is required")
	case input[0] == '"':
		return append(msgs, ChatMessage{Role: "user", Content: input}), nil
	case input[0] != '[':
		return nil, errBadRequest("input must be a string or an array of items")
	}
	var items []responseItem
	if err := json.Unmarshal(input, &items); err != nil {
		return nil, errBadRequestf("input: %v", err)
	}
	if len(items) == 0 {
		return nil, errBadRequest("input must not be empty")
	}
	for i, it := range items {
		switch {
		case it.Type == "message" || (it.Type == "" && it.Role != ""):
			msgs = append(msgs, ChatMessage{Role: it.Role, Content: it.Content})
		case it.Type == "function_call":
			calls := []map[string]any{{"id": it.CallID, "type": "function",
				"function": map[string]any{"name": it.Name, "arguments": it.Arguments}}}
			msgs = append(msgs, ChatMessage{Role: "assistant", ToolCalls: mustJSON(calls)})
		case it.Type == "function_call_output":
			msgs = append(msgs, ChatMessage{Role: "tool", ToolCallID: it.CallID, Content: it.Output})
		case it.Type == "reasoning":
		default:
			return nil, errBadRequestf("input[%d]: item type %q is not supported", i, it.Type)
		}
	}
	if len(msgs) == 0 {
		return nil, errBadRequest("input has no messages")
	}
	return msgs, nil
}

// maxStoredResponses bounds the responses a server keeps for
// previous_response_id; the oldest goes first. maxEventLogs bounds the
// streamed background responses whose events it keeps (about 230 bytes
// a token): an older one is kept without them.
const (
	maxStoredResponses = 4096
	maxEventLogs       = 64
)

// responseStore is the server's stored responses, in memory, as vLLM
// keeps them when its response store is on: each one's conversation (its
// messages and output, to continue it) and the response object (to
// retrieve it).
type responseStore struct {
	mu    sync.Mutex
	byID  map[string]storedResponse
	order []string
	// logged are the ids whose events are kept, oldest first.
	logged []string
}

type storedResponse struct {
	msgs   []ChatMessage
	object map[string]any
	// cancel ends a background response's generation; nil once it has
	// ended, or for a response answered when done.
	cancel func()
	// events are a streamed background response's events, which
	// GET /v1/responses/{id}?stream=true replays and follows; nil for
	// any other response.
	events *eventLog
}

// eventLog is a streamed background response's events, as SSE frames
// numbered by their place (their sequence_number), for its readers: the
// stream that asked for it, and those resuming it by its id.
type eventLog struct {
	mu     sync.Mutex
	frames [][]byte
	done   bool
	// more is closed, and replaced, when a frame comes or the log ends.
	more chan struct{}
}

func newEventLog() *eventLog { return &eventLog{more: make(chan struct{})} }

// add appends frame; end ends the log (with frame, if any).
func (l *eventLog) add(frame []byte, end bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.done {
		return
	}
	if frame != nil {
		l.frames = append(l.frames, frame)
	}
	l.done = end
	close(l.more)
	l.more = make(chan struct{})
}

// from returns the frames from index i on, whether the log has ended,
// and a channel closed when there is more.
func (l *eventLog) from(i int) ([][]byte, bool, <-chan struct{}) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.frames[min(max(0, i), len(l.frames)):], l.done, l.more
}

// serve writes the log's frames from index i on to w as an SSE stream,
// following it until it ends or the client goes.
func (l *eventLog) serve(w http.ResponseWriter, r *http.Request, i int) {
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache")
	rc := http.NewResponseController(w)
	for {
		frames, done, more := l.from(i)
		for _, f := range frames {
			if _, err := w.Write(f); err != nil {
				return
			}
		}
		i += len(frames)
		if rc.Flush() != nil || done {
			return
		}
		select {
		case <-more:
		case <-r.Context().Done():
			return
		}
	}
}

func (rs *responseStore) get(id string) (storedResponse, bool) {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	r, ok := rs.byID[id]
	return r, ok
}

func (rs *responseStore) put(id string, r storedResponse) {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	if rs.byID == nil {
		rs.byID = make(map[string]storedResponse)
	}
	if _, ok := rs.byID[id]; ok { // a background response, done or cancelled
		rs.byID[id] = r
		return
	}
	rs.byID[id] = r
	if r.events != nil {
		rs.logged = append(rs.logged, id)
		if len(rs.logged) > maxEventLogs {
			// Its readers keep what they hold; no new one comes.
			if old, ok := rs.byID[rs.logged[0]]; ok {
				old.events = nil
				rs.byID[rs.logged[0]] = old
			}
			rs.logged = rs.logged[1:]
		}
	}
	rs.order = append(rs.order, id)
	if len(rs.order) > maxStoredResponses {
		delete(rs.byID, rs.order[0])
		rs.order = rs.order[1:]
	}
}

// store keeps a finished response, object, for later previous_response_id
// and retrieval, when the request asked for it.
func (rs *responder) store(text []byte, object map[string]any) {
	if !rs.p.Store {
		return
	}
	msgs := append(rs.p.responseMessages(rs.previous), ChatMessage{Role: "assistant", Content: mustJSON(string(text))})
	rs.s.responses.put(rs.req.ID, storedResponse{msgs: msgs, object: object})
}

// update replaces id's stored response with what change makes of it,
// under the store's lock, and reports whether id is stored. The objects
// are replaced, never changed: a retrieval may be encoding the old one.
func (rs *responseStore) update(id string, change func(*storedResponse)) bool {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	r, ok := rs.byID[id]
	if ok {
		change(&r)
		rs.byID[id] = r
	}
	return ok
}

// withStatus is object (not changed) with another status.
func withStatus(object map[string]any, status string) map[string]any {
	out := maps.Clone(object)
	out["status"] = status
	return out
}

// background answers a background Responses API request as vLLM does:
// at once, with the response queued and stored, and generates it after
// the answer (in progress from its first token), storing it done;
// retrieved by its id meanwhile, it says how far it is, and its
// cancellation (handleCancel) ends it. Streamed, its events are kept
// (eventLog) while it is generated, so that the stream goes on whether
// its client stays or goes, and GET /v1/responses/{id}?stream=true&
// starting_after=N resumes it.
func (rs *responder) background() {
	msgID := newID("msg_")
	queued := withStatus(rs.responseObject(msgID, nil, nil), "queued")
	var events *eventLog
	if rs.p.Stream {
		events = newEventLog()
	}
	stop := make(chan struct{})
	rs.s.responses.put(rs.req.ID, storedResponse{object: queued, cancel: sync.OnceFunc(func() { close(stop) }), events: events})
	if events == nil {
		writeJSON(rs.w, http.StatusOK, queued)
	}
	bg := *rs
	bg.w, bg.gone, bg.cutAfter = nil, stop, 0
	go bg.runBackground(msgID, events)
	if events != nil {
		events.serve(rs.w, rs.r, 0)
	}
}

// runBackground generates a background response, its events into events
// when it is streamed (nil: not); see background.
func (rs *responder) runBackground(msgID string, events *eventLog) {
	defer rs.s.driver.Abort(rs.req) // a no-op once it has finished
	id := rs.req.ID
	seq := 0
	emit := func(typ string, fields map[string]any, end bool) bool {
		if events != nil {
			fields["type"], fields["sequence_number"] = typ, seq
			seq++
			b, _ := json.Marshal(fields)
			events.add(fmt.Appendf(nil, "event: %s\ndata: %s\n\n", typ, b), end)
		}
		return true
	}
	done := rs.responseEvents(msgID, emit, func(status string) {
		rs.s.responses.update(id, func(r *storedResponse) {
			if r.cancel != nil {
				r.object = withStatus(r.object, status)
			}
		})
	}, func(text []byte, object map[string]any) {
		msgs := append(rs.p.responseMessages(rs.previous), ChatMessage{Role: "assistant", Content: mustJSON(string(text))})
		rs.s.responses.update(id, func(r *storedResponse) {
			if r.cancel != nil { // not cancelled meanwhile
				*r = storedResponse{msgs: msgs, object: object, events: r.events} // nil once evicted (maxEventLogs)
			}
		})
	})
	if !done {
		// Cancelled (handleCancel stored it so), or the engine stopped.
		rs.s.responses.update(id, func(r *storedResponse) {
			if r.cancel != nil {
				r.object, r.cancel = withStatus(r.object, "failed"), nil
			}
		})
	}
	if events != nil {
		events.add(nil, true)
	}
}

// handleCancel answers POST /v1/responses/{id}/cancel as vLLM does: a
// background response not done yet is cancelled and returned so; a
// response that is done, or was not a background one, cannot be (400); one
// the server does not hold gets 404.
func (s *Server) handleCancel(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	var object map[string]any
	var cancel func()
	if !s.responses.update(id, func(sr *storedResponse) {
		if sr.cancel != nil {
			sr.object, cancel, sr.cancel = withStatus(sr.object, "cancelled"), sr.cancel, nil
		}
		object = sr.object
	}) {
		writeError(w, errResponseNotFound(id))
		return
	}
	if cancel == nil {
		writeError(w, errBadRequest("Cannot cancel a synchronous response."))
		return
	}
	cancel()
	writeJSON(w, http.StatusOK, object)
}

// handleRetrieve answers GET /v1/responses/{id}: the stored response, or
// 404 from a server that does not hold it. With stream=true it replays a
// streamed background response's events after starting_after (a
// sequence_number; all without it) and follows them until the response
// ends, as vLLM does; a response that was not streamed in the background
// has none (400).
func (s *Server) handleRetrieve(w http.ResponseWriter, r *http.Request) {
	id := r.PathValue("id")
	stored, ok := s.responses.get(id)
	if !ok {
		writeError(w, errResponseNotFound(id))
		return
	}
	q := r.URL.Query()
	// A query bool as FastAPI reads it (pydantic's words).
	var stream bool
	switch strings.ToLower(cmp.Or(q.Get("stream"), "false")) {
	case "1", "true", "t", "yes", "y", "on":
		stream = true
	case "0", "false", "f", "no", "n", "off":
	default:
		writeError(w, errBadRequest("stream must be a boolean"))
		return
	}
	if !stream {
		writeJSON(w, http.StatusOK, stored.object)
		return
	}
	after := -1
	if v := q.Get("starting_after"); v != "" {
		var err error
		if after, err = strconv.Atoi(v); err != nil || after < -1 {
			writeError(w, errBadRequest("starting_after must be a sequence number"))
			return
		}
	}
	if stored.events == nil {
		writeError(w, errBadRequest(fmt.Sprintf("response '%s' was not streamed in the background: it has no events to stream", id)))
		return
	}
	stored.events.serve(w, r, min(after, math.MaxInt-1)+1)
}

func mustJSON(v any) json.RawMessage {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err) // only plain values are marshalled here
	}
	return b
}

// responseUsage is the Responses API's usage object, with the prefix
// cache's hits as cached_tokens.
func responseUsage(ev Event) map[string]any {
	return map[string]any{
		"input_tokens":          ev.PromptTokens,
		"input_tokens_details":  map[string]any{"cached_tokens": ev.CachedTokens},
		"output_tokens":         ev.GeneratedTokens,
		"output_tokens_details": map[string]any{"reasoning_tokens": 0},
		"total_tokens":          ev.PromptTokens + ev.GeneratedTokens,
	}
}

// responseObject is the response: in progress (nil finish), or finished
// with its text and usage.
func (rs *responder) responseObject(msgID string, text []byte, finish *Event) map[string]any {
	resp := map[string]any{
		"id": rs.req.ID, "object": "response", "created_at": rs.created, "model": rs.model,
		"status": "in_progress", "output": []any{}, "usage": nil, "error": nil, "incomplete_details": nil,
		"max_output_tokens": nil, "parallel_tool_calls": true, "tool_choice": "auto", "tools": []any{},
		"background": rs.p.Background,
	}
	if rs.p.MaxTokens > 0 {
		resp["max_output_tokens"] = rs.p.MaxTokens
	}
	if finish == nil {
		return resp
	}
	resp["status"] = "completed"
	if finish.FinishReason == "length" {
		resp["status"] = "incomplete"
		resp["incomplete_details"] = map[string]any{"reason": "max_output_tokens"}
	}
	resp["output"] = []any{rs.messageItem(msgID, text, "completed")}
	resp["usage"] = responseUsage(*finish)
	return resp
}

// messageItem is the assistant's output message.
func (rs *responder) messageItem(id string, text []byte, status string) map[string]any {
	content := []any{}
	if text != nil {
		content = append(content, outputText(text))
	}
	return map[string]any{"id": id, "type": "message", "role": "assistant", "status": status, "content": content}
}

func outputText(text []byte) map[string]any {
	return map[string]any{"type": "output_text", "text": string(text), "annotations": []any{}}
}

// collectResponse answers a non-streaming Responses API request.
func (rs *responder) collectResponse() {
	text, ev, ok := rs.generate()
	if !ok {
		return
	}
	object := rs.responseObject(newID("msg_"), text, &ev)
	rs.store(text, object)
	writeJSON(rs.w, http.StatusOK, object)
}

// streamResponse streams a Responses API answer as its typed events.
func (rs *responder) streamResponse() {
	h := rs.w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache")
	rc := http.NewResponseController(rs.w)
	seq := 0
	emit := func(typ string, fields map[string]any, _ bool) bool {
		fields["type"], fields["sequence_number"] = typ, seq
		seq++
		b, _ := json.Marshal(fields)
		if _, err := fmt.Fprintf(rs.w, "event: %s\ndata: %s\n\n", typ, b); err != nil {
			return false
		}
		return rc.Flush() == nil
	}
	rs.responseEvents(newID("msg_"), emit, nil, rs.store)
}

// responseEvents generates a Responses API answer as its typed events,
// handing each to emit (end for the last), which reports whether to go
// on. status, when set, is told of the response's first token
// ("in_progress"), and finished of the whole text and the response done,
// before the events that close it. It reports whether the response
// finished.
func (rs *responder) responseEvents(msgID string, emit func(typ string, fields map[string]any, end bool) bool,
	status func(string), finished func(text []byte, object map[string]any)) bool {
	at := func(fields map[string]any) map[string]any {
		fields["item_id"], fields["output_index"], fields["content_index"] = msgID, 0, 0
		return fields
	}
	if !emit("response.created", map[string]any{"response": rs.responseObject(msgID, nil, nil)}, false) ||
		!emit("response.in_progress", map[string]any{"response": rs.responseObject(msgID, nil, nil)}, false) {
		return false
	}
	var text []byte
	for {
		evs, ok := rs.next()
		if !ok {
			return false
		}
		for _, ev := range evs {
			switch ev.Kind {
			case EventFirstToken, EventToken:
				if ev.Kind == EventFirstToken {
					if status != nil {
						status("in_progress")
					}
					if !emit("response.output_item.added", map[string]any{"output_index": 0, "item": rs.messageItem(msgID, nil, "in_progress")}, false) ||
						!emit("response.content_part.added", at(map[string]any{"part": outputText(nil)}), false) {
						return false
					}
				}
				text = append(text, ev.Text...)
				if !emit("response.output_text.delta", at(map[string]any{"delta": string(ev.Text), "logprobs": []any{}}), false) {
					return false
				}
				if rs.cutHere() {
					return false
				}
			case EventFinished:
				object := rs.responseObject(msgID, text, &ev)
				finished(text, object)
				_ = emit("response.output_text.done", at(map[string]any{"text": string(text), "logprobs": []any{}}), false) &&
					emit("response.content_part.done", at(map[string]any{"part": outputText(text)}), false) &&
					emit("response.output_item.done", map[string]any{"output_index": 0, "item": rs.messageItem(msgID, text, "completed")}, false) &&
					emit("response.completed", map[string]any{"response": object}, true)
				return true
			}
		}
	}
}
