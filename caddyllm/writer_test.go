package caddyllm

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/llmaffinity/caddy-llm-affinity/internal/cputime"
	"github.com/llmaffinity/caddy-llm-affinity/router"
)

func TestTokenRecorderCountsSSE(t *testing.T) {
	st := &requestState{req: &Request{Model: "m"}}
	sh := newShared()
	defer sh.Destruct()
	opts := router.Options{OutputEstimate: router.OutputFixed, OutputTokens: 10}.WithDefaults()
	d := sh.fleet.Decide(time.Now(), router.Request{PromptTokens: 500, Model: "m"},
		[]router.Member{{Dial: "w:1", Available: true}}, &opts, newLockedRand(), nil)
	st.current = &attempt{sh: sh, charge: d.Charge}
	defer st.current.release()

	w := httptest.NewRecorder()
	rec := newTokenRecorder(w, st)
	rec.Header().Set("Content-Type", "text/event-stream")
	rec.WriteHeader(200)
	stream := `data: {"choices":[{"text":" a"}],"usage":null}` + "\n\n" +
		`data: {"choices":[{"text":" b"}]}` + "\n\n" +
		`data: {"choices":[{"text":" c"}]}` + "\n\n" +
		`data: {"choices":[],"usage":{"prompt_tokens":2000,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":1500}}}` + "\n\n" +
		"data: [DONE]\n\n"
	// Split mid-line to exercise the carry buffer.
	for _, part := range []string{stream[:17], stream[17:60], stream[60:]} {
		rec.Write([]byte(part))
	}
	if w.Body.String() != stream {
		t.Fatal("stream altered")
	}
	if rec.tokens != 3 || !rec.complete() || rec.completionTokens() != 3 || rec.cachedTokens() != 1500 {
		t.Fatalf("events %d complete %v tokens %d cached %d", rec.tokens, rec.complete(), rec.completionTokens(), rec.cachedTokens())
	}
	if u := sh.fleet.Snapshot(time.Now())[0]; u.QueuedPrefillTokens != 0 || u.QueuedDecodeTokens != 7 {
		t.Fatalf("after 3 tokens: prefill %d decode %d, want 0 and 7", u.QueuedPrefillTokens, u.QueuedDecodeTokens)
	}
}

func TestTokenRecorderJSONUsage(t *testing.T) {
	st := &requestState{req: &Request{}}
	w := httptest.NewRecorder()
	rec := newTokenRecorder(w, st)
	rec.Header().Set("Content-Type", "application/json")
	rec.Write([]byte(`{"choices":[],"usage":{"prompt_tokens":10,"completion_tokens":42}}`))
	if !rec.complete() || rec.completionTokens() != 42 || rec.cachedTokens() != -1 {
		t.Fatal("usage not read from a JSON body")
	}
	rec = newTokenRecorder(httptest.NewRecorder(), st)
	rec.Write([]byte(strings.Repeat("x", 100)))
	if rec.complete() {
		t.Fatal("a non-JSON body counted as complete")
	}
}

// TestResponseBodyKeptWithTheState: an unstreamed response up to
// maxKeptBuffer is kept in the recorder's own buffer, which the next
// request on the pooled state reuses; a larger one moves to a buffer from
// bodyPool, whole, and its usage at the end is read all the same.
func TestResponseBodyKeptWithTheState(t *testing.T) {
	st := newRequestState()
	st.parsed = Request{Endpoint: EndpointChatCompletions}
	st.req = &st.parsed
	st.recorder.init(httptest.NewRecorder(), st)
	rec := &st.recorder
	rec.Write([]byte(`{"choices":[],"usage":{"prompt_tokens":10,"completion_tokens":42}}`))
	if rec.bodyBuf != nil || !rec.complete() || rec.completionTokens() != 42 {
		t.Fatalf("small body: pooled %v, usage %d", rec.bodyBuf != nil, rec.completionTokens())
	}
	own := &rec.body[0]
	rec.releaseBody()
	buffers := rec.keepBuffers()
	if len(buffers.body) != 0 || cap(buffers.body) == 0 || &buffers.body[:1][0] != own {
		t.Fatal("the response's buffer is not kept with the state")
	}

	// The next request's response starts in the same buffer, and goes on
	// in a pooled one once it outgrows what a state keeps.
	rec.reuseBuffers(buffers)
	text := strings.Repeat("x", maxKeptBuffer)
	parts := []string{`{"choices":[{"text":"`, text[:maxKeptBuffer/2], text[maxKeptBuffer/2:], `"}],"usage":{"completion_tokens":7}}`}
	rec.Write([]byte(parts[0]))
	if &rec.body[0] != own {
		t.Fatal("the kept buffer is not reused")
	}
	for _, p := range parts[1:] {
		rec.Write([]byte(p))
	}
	if rec.bodyBuf == nil || string(rec.body) != strings.Join(parts, "") || !rec.complete() || rec.completionTokens() != 7 {
		t.Fatalf("large body: pooled %v, %d bytes kept, usage %d", rec.bodyBuf != nil, len(rec.body), rec.completionTokens())
	}
	pooled := rec.bodyBuf
	rec.releaseBody()
	if rec.body != nil || rec.bodyBuf != nil || len(pooled.b) != 0 || cap(pooled.b) < len(strings.Join(parts, "")) {
		t.Fatal("the pooled buffer did not go back")
	}
	// The state keeps its own buffer, grown to the half that fitted, not
	// the pooled one.
	if b := rec.keepBuffers().body; cap(b) < len(parts[0])+len(parts[1]) || &b[:1][0] == &pooled.b[:1][0] {
		t.Fatalf("the state's own buffer is lost (capacity %d)", cap(b))
	}
}

func TestUsageOfBody(t *testing.T) {
	for _, tc := range []struct {
		body   string
		ok     bool
		tokens int
	}{
		{`{"choices":[{"text":"a \"usage\": 5"}],"usage":{"prompt_tokens":3,"completion_tokens":9}}`, true, 9},
		{`{"usage": {"completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 2}}, "id": "x"}`, true, 4},
		{`{"choices":[],"usage":{"completion_tokens":4`, false, 0},
		{`{"choices":[]}`, false, 0},
		{`not json "usage":{}`, false, 0},
	} {
		u, ok := usageOfBody([]byte(tc.body), false)
		if ok != tc.ok || (ok && u.completionTokens != tc.tokens) {
			t.Errorf("%s: ok=%v usage=%+v", tc.body, ok, u)
		}
	}
}

// FuzzTokenRecorder: whatever an upstream streams back passes through
// unchanged, in any split, and never panics the recorder.
func FuzzTokenRecorder(f *testing.F) {
	f.Add([]byte("data: {\"choices\":[{\"text\":\" a\"}]}\n\ndata: [DONE]\n\n"), uint8(7), true)
	f.Add([]byte("data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\r\n\r\n"), uint8(3), true)
	f.Add([]byte(`{"choices":[],"usage":{"completion_tokens":3}}`), uint8(5), false)
	f.Fuzz(func(t *testing.T, body []byte, split uint8, sse bool) {
		w := httptest.NewRecorder()
		rec := newTokenRecorder(w, &requestState{req: &Request{}})
		if sse {
			rec.Header().Set("Content-Type", "text/event-stream")
		}
		step := int(split)%32 + 1
		for rest := body; len(rest) > 0; {
			n := min(step, len(rest))
			rec.Write(rest[:n])
			rest = rest[n:]
		}
		rec.flushHeld() // as the handler does when the attempt ends normally
		rec.complete()
		if w.Body.String() != string(body) {
			t.Fatal("the recorder altered the stream")
		}
	})
}

// TestErrorEventIsNoCompletion: a stream that ends with vLLM's error event
// and then [DONE] did not complete: nothing is learned from it as from a
// finished generation.
func TestErrorEventIsNoCompletion(t *testing.T) {
	w := httptest.NewRecorder()
	rec := newTokenRecorder(w, &requestState{req: &Request{}})
	rec.Header().Set("Content-Type", "text/event-stream")
	rec.Write([]byte("data: {\"choices\":[{\"text\":\" a\"}]}\n\n" +
		"data: {\"error\":{\"message\":\"engine died\",\"type\":\"InternalServerError\",\"code\":500}}\n\ndata: [DONE]\n\n"))
	if rec.complete() {
		t.Fatal("a stream ending in an error event counts as complete")
	}
}

// TestToolCallsAndReasoningAreGenerated: chunks carrying a tool call's
// arguments or a reasoning model's thoughts, without text, count as
// generated tokens (the first one ends the prefill); empty ones do not.
func TestToolCallsAndReasoningAreGenerated(t *testing.T) {
	w := httptest.NewRecorder()
	rec := newTokenRecorder(w, &requestState{req: &Request{}})
	rec.Header().Set("Content-Type", "text/event-stream")
	for _, chunk := range []string{
		`{"choices":[{"delta":{"role":"assistant","content":""}}]}`,
		`{"choices":[{"delta":{"reasoning_content":"Let me think"}}]}`,
		`{"choices":[{"delta":{"reasoning_content":""}}]}`,
		`{"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\"a\":"}}]}}]}`,
		`{"choices":[{"delta":{"tool_calls":[]}}]}`,
		`{"choices":[{"delta":{"content":"done"}}]}`,
	} {
		rec.Write([]byte("data: " + chunk + "\n\n"))
	}
	if rec.tokens != 3 || string(rec.generated) != "done" {
		t.Fatalf("%d tokens, text %q; want 3 and \"done\"", rec.tokens, string(rec.generated))
	}
}

// TestResponsesRecorderEnds: a Responses API stream ends at the event
// named response.completed even when its data, which carries the whole
// response, is too long to read; a response answered before it is done
// (background: its usage null) is not complete, and one done is, with
// its id kept for previous_response_id.
func TestResponsesRecorderEnds(t *testing.T) {
	st := &requestState{req: &Request{Endpoint: EndpointResponses}}
	rec := newTokenRecorder(httptest.NewRecorder(), st)
	rec.Header().Set("Content-Type", "text/event-stream")
	rec.WriteHeader(200)
	rec.Write([]byte("event: response.created\ndata: {\"type\":\"response.created\",\"sequence_number\":0,\"response\":{\"id\":\"resp_7\",\"usage\":null}}\n\n" +
		"event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"hi\",\"sequence_number\":1}\n\n"))
	long := []byte("event: response.completed\ndata: {\"response\":{\"output\":[{\"text\":\"" + strings.Repeat("x", 2*maxSSELine) +
		"\"}]},\"type\":\"response.completed\",\"sequence_number\":2}\n\n")
	for len(long) > 0 { // as a proxy passes it on: in pieces, the data line carried over
		n := min(len(long), 64<<10)
		rec.Write(long[:n])
		long = long[n:]
	}
	if !rec.complete() || rec.tokens != 1 || rec.responseID != "resp_7" || rec.lastSeq != 1 {
		t.Fatalf("complete %v tokens %d id %q seq %d", rec.complete(), rec.tokens, rec.responseID, rec.lastSeq)
	}

	for _, tc := range []struct {
		body     string
		id       string
		complete bool
	}{
		// Not done, but stored: its id is kept all the same.
		{`{"id":"resp_8","status":"queued","background":true,"output":[],"usage":null}`, "resp_8", false},
		{`{"id":"resp_9","status":"completed","output":[],"usage":{"input_tokens":5,"output_tokens":2,"total_tokens":7}}`, "resp_9", true},
		// Longer than the recorder keeps: the id, first, is still found.
		{`{"id":"resp_10","output":[{"text":"` + strings.Repeat("y", maxUsageBody) + `"}],"usage":{"input_tokens":5,"output_tokens":2}}`, "resp_10", false},
	} {
		rec := newTokenRecorder(httptest.NewRecorder(), st)
		rec.Header().Set("Content-Type", "application/json")
		for b := []byte(tc.body); len(b) > 0; {
			n := min(len(b), 32<<10)
			rec.Write(b[:n])
			b = b[n:]
		}
		if rec.complete() != tc.complete || rec.responseID != tc.id {
			t.Errorf("%.60s: complete %v, id %q", tc.body, !tc.complete, rec.responseID)
		}
	}

	// An event counts once it has all come.
	rec = newTokenRecorder(httptest.NewRecorder(), st)
	rec.Header().Set("Content-Type", "text/event-stream")
	rec.WriteHeader(200)
	rec.Write([]byte("event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"usage\":"))
	if rec.complete() {
		t.Fatal("complete before its last event came")
	}
	rec.Write([]byte("{\"input_tokens\":3,\"output_tokens\":1}}}\n\n"))
	if !rec.complete() {
		t.Fatal("not complete once its last event came")
	}
}

// TestResponsesHoldBack: a Responses stream's announcement is held back
// until its output begins, unless it is too large to hold (it then goes
// to the client, and the request can no longer be sent again unseen); a
// request sent again whose new answer is not a stream is refused, though
// the proxy adds its headers to the first answer's.
func TestResponsesHoldBack(t *testing.T) {
	st := &requestState{req: &Request{Endpoint: EndpointResponses}}
	created := "event: response.created\ndata: {\"type\":\"response.created\",\"sequence_number\":0,\"response\":{\"id\":\"resp_1\"}}\n\n"
	w := httptest.NewRecorder()
	rec := newTokenRecorder(w, st)
	rec.Header().Set("Content-Type", "text/event-stream")
	rec.WriteHeader(200)
	rec.Write([]byte(created))
	if w.Body.Len() != 0 || rec.outputStarted {
		t.Fatalf("announcement passed on (%d bytes) or taken for output", w.Body.Len())
	}
	rec.restart()
	rec.Header().Add("Content-Type", "application/json") // the new answer's, added
	rec.WriteHeader(404)
	if rec.splice.refused != 404 || w.Body.Len() != 0 {
		t.Fatalf("refused %d, %d bytes passed on", rec.splice.refused, w.Body.Len())
	}
	rec = newTokenRecorder(httptest.NewRecorder(), st)
	rec.Header().Set("Content-Type", "text/event-stream")
	rec.WriteHeader(200)
	rec.Write([]byte(created))
	rec.restart()
	rec.Header().Add("Content-Type", "application/json")
	rec.WriteHeader(200)
	if rec.splice.refused != 200 {
		t.Fatal("a JSON answer to the request sent again was taken for its stream")
	}
	// Nor is a compressed stream (its engine ignored the Accept-Encoding
	// it was sent): the client reads this stream uncompressed.
	w = httptest.NewRecorder()
	rec = newTokenRecorder(w, st)
	rec.Header().Set("Content-Type", "text/event-stream")
	rec.WriteHeader(200)
	rec.Write([]byte(created))
	rec.restart()
	rec.Header().Add("Content-Type", "text/event-stream")
	rec.Header().Add("Content-Encoding", "gzip")
	rec.WriteHeader(200)
	rec.Write([]byte("\x1f\x8b\x08\x00compressed events"))
	if rec.splice.refused != 200 || strings.Contains(w.Body.String(), "\x1f\x8b") {
		t.Fatalf("a compressed stream sent again was spliced in: refused %d, client has %q", rec.splice.refused, w.Body)
	}

	w = httptest.NewRecorder()
	rec = newTokenRecorder(w, st)
	rec.Header().Set("Content-Type", "text/event-stream")
	rec.WriteHeader(200)
	huge := "event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"instructions\":\"" + strings.Repeat("i", maxSSELine) + "\"}}\n\n"
	for b := []byte(huge); len(b) > 0; {
		n := min(len(b), 64<<10)
		rec.Write(b[:n])
		b = b[n:]
	}
	if !rec.outputStarted || w.Body.Len() == 0 {
		t.Fatalf("an announcement too large to hold: held %d bytes, passed on %d, started %v", len(rec.held), w.Body.Len(), rec.outputStarted)
	}
}

// TestResponsesStreamEndsWithWholeEvents: a Responses stream ended by the
// router gets the whole events held back, never one cut off in the
// middle, then the API's error event, numbered after the last event the
// client may have seen (0 when none).
func TestResponsesStreamEndsWithWholeEvents(t *testing.T) {
	st := &requestState{req: &Request{Endpoint: EndpointResponses}}
	created := "event: response.created\ndata: {\"type\":\"response.created\",\"sequence_number\":0,\"response\":{\"id\":\"resp_1\"}}\n\n"
	for _, tc := range []struct {
		name, written, want string
		seq                 string
	}{
		{"announced, then cut in an event", created + "event: response.in_progress\ndata: {\"type\":\"resp",
			created, `"sequence_number":1`},
		{"output begun, then cut in an event", created + "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"a\",\"sequence_number\":1}\n\n" +
			"event: response.output_text.delta\ndata: {\"ty", "", `"sequence_number":2`},
	} {
		w := httptest.NewRecorder()
		rec := newTokenRecorder(w, st)
		rec.Header().Set("Content-Type", "text/event-stream")
		rec.WriteHeader(200)
		rec.Write([]byte(tc.written))
		if err := (&Handler{}).endStream(rec, "cut"); err != nil {
			t.Fatal(err)
		}
		body := w.Body.String()
		tail := body[strings.LastIndex(body, "event: error"):]
		head := body[:len(body)-len(tail)]
		if !strings.HasSuffix(head, "\n\n") && head != "" || strings.Contains(head, `{"ty"`) || strings.Contains(head, `{"type":"resp"`) ||
			!strings.Contains(tail, tc.seq) || (tc.want != "" && head != tc.want) {
			t.Errorf("%s: the client got %q", tc.name, body)
		}
	}
	// Sent again, and the new attempt failed before any event: the error
	// is the first event the client sees.
	w := httptest.NewRecorder()
	rec := newTokenRecorder(w, st)
	rec.Header().Set("Content-Type", "text/event-stream")
	rec.WriteHeader(200)
	rec.Write([]byte(created))
	rec.restart()
	(&Handler{}).endStream(rec, "cut")
	if body := w.Body.String(); !strings.HasPrefix(body, "event: error") || !strings.Contains(body, `"sequence_number":0`) {
		t.Errorf("after a restart: the client got %q", body)
	}
}

// TestContinuedResponseTeachesNothing: the usage of a Responses request
// continuing a stored response counts the stored conversation too, so it
// does not teach the model's bytes per token; the same answers to a
// request sending its whole conversation do.
func TestContinuedResponseTeachesNothing(t *testing.T) {
	for _, previous := range []string{"resp_earlier", ""} {
		sh := newShared()
		opts := router.Options{}.WithDefaults()
		for range 5 {
			st := &requestState{req: &Request{Endpoint: EndpointResponses, Model: "m", PromptTokens: 100, PromptBytes: 400, PreviousResponseID: previous}}
			d := sh.fleet.Decide(time.Now(), router.Request{PromptTokens: 100, PromptBytes: 400, Model: "m"},
				[]router.Member{{Dial: "w:1", Available: true, Healthy: true}}, &opts, newLockedRand(), nil)
			st.current = &attempt{st: st, sh: sh, charge: d.Charge}
			rec := newTokenRecorder(httptest.NewRecorder(), st)
			rec.Header().Set("Content-Type", "application/json")
			rec.Write([]byte(`{"id":"resp_1","usage":{"input_tokens":3000,"output_tokens":2,"total_tokens":3002}}`))
			st.finish(rec)
		}
		_, learned := sh.fleet.BytesPerToken("m")
		sh.Destruct()
		if learned != (previous == "") {
			t.Errorf("previous_response_id %q: learned %v", previous, learned)
		}
	}
}

// TestStoredResponseHomeAtFirstEvent: a Responses stream's home is known
// (and told to the peers) once its first event names the response, long
// before it ends; a plain body's once its start, where the id is, is
// read. A request with
// store: false, or an answer that is not 200, leaves nothing.
func TestStoredResponseHomeAtFirstEvent(t *testing.T) {
	created := "event: response.created\ndata: {\"type\":\"response.created\",\"sequence_number\":0,\"response\":{\"id\":\"resp_s\",\"status\":\"in_progress\"}}\n\n"
	for _, tc := range []struct {
		name    string
		noStore bool
		status  int
		stream  bool
		want    string
	}{
		{"stream", false, 200, true, "w:1"},
		{"body", false, 200, false, "w:1"},
		{"large body", false, 200, false, "w:1"},
		{"store false", true, 200, true, ""},
		{"refused", false, 400, false, ""},
	} {
		sh := newShared()
		var told []router.Event
		sh.fleet.SetPublisher(func(ev router.Event) { told = append(told, ev) })
		opts := router.Options{}.WithDefaults()
		st := &requestState{req: &Request{Endpoint: EndpointResponses, Model: "m", NoStore: tc.noStore}}
		d := sh.fleet.Decide(time.Now(), router.Request{PromptTokens: 100, Model: "m"},
			[]router.Member{{Dial: "w:1", Available: true, Healthy: true}}, &opts, newLockedRand(), nil)
		st.current = &attempt{st: st, sh: sh, charge: d.Charge}
		rec := newTokenRecorder(httptest.NewRecorder(), st)
		st.rec = rec
		id := "resp_s"
		if tc.stream {
			rec.Header().Set("Content-Type", "text/event-stream")
			rec.WriteHeader(tc.status)
			rec.Write([]byte(created))
			if got := sh.fleet.ResponseHome(id); got != tc.want {
				t.Errorf("%s: after the first event, home %q, want %q", tc.name, got, tc.want)
			}
		} else {
			id = "resp_b"
			rec.Header().Set("Content-Type", "application/json")
			rec.WriteHeader(tc.status)
			start := `{"id":"resp_b","status":"comp`
			if tc.name == "large body" {
				// A first write beyond maxIDScan (Caddy copies 32 KiB at
				// a time): its start is read all the same.
				start = `{"id":"resp_b","instructions":"` + strings.Repeat("x", 2*maxIDScan) + `","status":"comp`
			}
			rec.Write([]byte(start))
			if got := sh.fleet.ResponseHome(id); got != tc.want {
				t.Errorf("%s: after the body's start, home %q, want %q", tc.name, got, tc.want)
			}
			rec.Write([]byte(`leted","usage":{"input_tokens":30,"output_tokens":2,"total_tokens":32}}`))
		}
		st.finish(rec)
		if got := sh.fleet.ResponseHome(id); got != tc.want {
			t.Errorf("%s: home %q, want %q", tc.name, got, tc.want)
		}
		stored := 0
		for _, ev := range told {
			if ev.Kind == router.EventStored {
				stored++
			}
		}
		if want := min(1, len(tc.want)); stored != want {
			t.Errorf("%s: told the peers %d times, want %d", tc.name, stored, want)
		}
		sh.Destruct()
	}
}

// streamEvents is a streamed chat completion as vLLM sends it: a role
// chunk, n one-token chunks, the finish, the usage, [DONE].
func streamEvents(n int) []string {
	const head = `data: {"id":"chatcmpl-5f0c","object":"chat.completion.chunk","created":1732000000,"model":"meta-llama/Llama-3.1-8B-Instruct","choices":[{"index":0,"delta":`
	events := []string{head + `{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}],"usage":null}` + "\n\n"}
	for i := range n {
		events = append(events, head+`{"content":" tok`+strconv.Itoa(i)+`"},"logprobs":null,"finish_reason":null}],"usage":null}`+"\n\n")
	}
	return append(events, head+`{},"logprobs":null,"finish_reason":"length","stop_reason":null}],"usage":null}`+"\n\n",
		`data: {"id":"chatcmpl-5f0c","object":"chat.completion.chunk","created":1732000000,"model":"meta-llama/Llama-3.1-8B-Instruct","choices":[],"usage":{"prompt_tokens":130,"total_tokens":`+strconv.Itoa(130+n)+`,"completion_tokens":`+strconv.Itoa(n)+`}}`+"\n\n",
		"data: [DONE]\n\n")
}

// responsesStreamEvents is a streamed Responses API answer as vLLM sends
// it: created, n deltas of one token, completed with the usage.
func responsesStreamEvents(n int) []string {
	events := []string{"event: response.created\ndata: {\"response\":{\"id\":\"resp_1\",\"object\":\"response\",\"status\":\"in_progress\",\"usage\":null},\"sequence_number\":0,\"type\":\"response.created\"}\n\n"}
	for i := range n {
		events = append(events, "event: response.output_text.delta\ndata: "+responsesHead+`" tok`+strconv.Itoa(i)+`"`+responsesMid+strconv.Itoa(i+1)+responsesTail+"\n\n")
	}
	return append(events, "event: response.completed\ndata: {\"response\":{\"id\":\"resp_1\",\"object\":\"response\",\"status\":\"completed\",\"usage\":{\"input_tokens\":12,\"output_tokens\":"+
		strconv.Itoa(n)+",\"total_tokens\":"+strconv.Itoa(12+n)+"}},\"sequence_number\":"+strconv.Itoa(n+1)+",\"type\":\"response.completed\"}\n\n")
}

// TestResponsesStreamByShape: a Responses stream's deltas, whose sequence
// number changes at every event, are read by the first one's shape, and
// recorded as reading each whole records them.
func TestResponsesStreamByShape(t *testing.T) {
	record := func(readWhole bool) *tokenRecorder {
		w := httptest.NewRecorder()
		w.Header().Set("Content-Type", "text/event-stream")
		rec := newTokenRecorder(w, &requestState{req: &Request{Endpoint: EndpointResponses, Stream: true}})
		rec.readWhole = readWhole
		rec.WriteHeader(http.StatusOK)
		for _, e := range responsesStreamEvents(20) {
			rec.Write([]byte(e))
		}
		return rec
	}
	fast, whole := record(false), record(true)
	if len(fast.shape) == 0 || fast.shapeSeq == 0 {
		t.Fatal("no shape learned from the deltas")
	}
	if fast.tokens != 20 || fast.lastSeq != 21 || !fast.done || !fast.hasUsage || fast.usage.completionTokens != 20 || fast.responseID != "resp_1" {
		t.Fatalf("%d tokens, last sequence number %d, done %v, usage %+v, id %q", fast.tokens, fast.lastSeq, fast.done, fast.usage, fast.responseID)
	}
	if a, b := recorderState(fast), recorderState(whole); a != b {
		t.Fatalf("by shape %s\nread whole %s", a, b)
	}
}

// TestStreamRecordedAlikeInAnySplit: a stream written an event at a time
// (each token event read by its shape) is recorded and passed on as the
// same stream written whole, in small pieces, or with other line endings
// (read line by line).
func TestStreamRecordedAlikeInAnySplit(t *testing.T) {
	events := streamEvents(20)
	whole := strings.Join(events, "")
	record := func(writes []string) (*tokenRecorder, string) {
		w := httptest.NewRecorder()
		w.Header().Set("Content-Type", "text/event-stream")
		rec := newTokenRecorder(w, &requestState{req: &Request{Endpoint: EndpointChatCompletions, Stream: true}})
		rec.WriteHeader(http.StatusOK)
		for _, p := range writes {
			rec.Write([]byte(p))
		}
		rec.flushHeld()
		return rec, w.Body.String()
	}
	want, wantBody := record([]string{whole})
	if want.tokens != 20 || !want.done || !want.hasUsage || want.usage.completionTokens != 20 {
		t.Fatalf("whole: %d tokens, done %v, usage %+v", want.tokens, want.done, want.usage)
	}
	var pieces []string
	for i := 0; i < len(whole); i += 7 {
		pieces = append(pieces, whole[i:min(i+7, len(whole))])
	}
	crlf := strings.ReplaceAll(whole, "\n", "\r\n")
	for name, writes := range map[string][]string{"an event at a time": events, "7 bytes at a time": pieces, "CRLF": {crlf}} {
		got, body := record(writes)
		if got.tokens != want.tokens || string(got.generated) != string(want.generated) || got.usage != want.usage || got.done != want.done {
			t.Errorf("%s: %d tokens %q usage %+v, want %d %q %+v", name, got.tokens, string(got.generated), got.usage, want.tokens, string(want.generated), want.usage)
		}
		if name != "CRLF" && body != wantBody {
			t.Errorf("%s: passed on %q, want %q", name, body, wantBody)
		}
	}
}

// BenchmarkStreamedResponse is the recorder's work on a streamed chat
// completion as vLLM sends it (streamEvents(64)), written one event at a
// time (an engine flushes each token, and Caddy's proxy each read), three
// at a time (reads that found several), or in pieces of 1,000 bytes (reads
// that end within an event): the router's cost per
// streamed token, beside Caddy's copying. The request has no attempt: the
// fleet's accounting is not part of it.
func BenchmarkStreamedResponse(b *testing.B) {
	b.Run("responses", func(b *testing.B) { benchmarkStream(b, responsesStreamEvents(64), EndpointResponses, []int{1}) })
	benchmarkStream(b, streamEvents(64), EndpointChatCompletions, []int{1, 3, 0})
}

// benchmarkStream runs BenchmarkStreamedResponse's cases for events of
// endpoint: perWrite events a Write, or 1,000 bytes a Write for 0.
func benchmarkStream(b *testing.B, events []string, endpoint Endpoint, perWrites []int) {
	whole := []byte(strings.Join(events, ""))
	for _, perWrite := range perWrites {
		var writes [][]byte
		name := fmt.Sprintf("events-per-write=%d", perWrite)
		if perWrite == 0 {
			// Reads that end in the middle of an event.
			name = "bytes-per-write=1000"
			for i := 0; i < len(whole); i += 1000 {
				writes = append(writes, whole[i:min(i+1000, len(whole))])
			}
		}
		for i := 0; perWrite > 0 && i < len(events); i += perWrite {
			writes = append(writes, []byte(strings.Join(events[i:min(i+perWrite, len(events))], "")))
		}
		size := len(whole)
		b.Run(name, func(b *testing.B) {
			w := &discardWriter{h: make(http.Header)}
			b.SetBytes(int64(size))
			b.ReportAllocs()
			cpu := cputime.Start()
			for b.Loop() {
				streamTo(b, newTokenRecorder(w, &requestState{req: &Request{Endpoint: endpoint, Stream: true}}), w, writes)
			}
			cputime.Report(b, cpu)
		})
	}
}

// streamTo has rec pass on a 64-token stream in writes to w, and checks
// it read the stream whole.
func streamTo(b *testing.B, rec *tokenRecorder, w *discardWriter, writes [][]byte) {
	w.h.Set("Content-Type", "text/event-stream")
	rec.WriteHeader(http.StatusOK)
	for _, p := range writes {
		rec.Write(p)
	}
	if rec.tokens != 64 || !rec.done || !rec.hasUsage {
		b.Fatalf("%d tokens, done %v, usage %v", rec.tokens, rec.done, rec.hasUsage)
	}
}

// BenchmarkStreamedResponsePooled is BenchmarkStreamedResponse's chat
// stream, an event a Write, with each request's state from statePool and
// back, as the handler has it: the recorder's buffers are the last
// stream's.
func BenchmarkStreamedResponsePooled(b *testing.B) {
	var writes [][]byte
	for _, e := range streamEvents(64) {
		writes = append(writes, []byte(e))
	}
	w := &discardWriter{h: make(http.Header)}
	b.SetBytes(int64(len(strings.Join(streamEvents(64), ""))))
	b.ReportAllocs()
	cpu := cputime.Start()
	for b.Loop() {
		st := newRequestState()
		st.parsed = Request{Endpoint: EndpointChatCompletions, Stream: true}
		st.req = &st.parsed
		st.recorder.init(w, st)
		streamTo(b, &st.recorder, w, writes)
		st.putBack()
	}
	cputime.Report(b, cpu)
}

// TestRecorderNeverWritesIntoTheProxysBuffer: Caddy's proxy reads every
// piece of a stream into one buffer and writes it on; the text of a token
// that needs no decoding is kept where it lies, and the next one that
// does is decoded into the recorder's own space, never into that buffer
// (the client got a token's escaped newline as a raw one, breaking the
// event).
func TestRecorderNeverWritesIntoTheProxysBuffer(t *testing.T) {
	const head = `data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"`
	const tail = `"},"finish_reason":null}]}` + "\n\n"
	for _, texts := range [][]string{{`Hello`, `\n`, `\"`, `caf\u00e9`, `x`, `\t`}, {`ab`, `\u00e9`}} {
		w := httptest.NewRecorder()
		w.Header().Set("Content-Type", "text/event-stream")
		rec := newTokenRecorder(w, &requestState{req: &Request{Endpoint: EndpointChatCompletions, Stream: true}})
		rec.WriteHeader(http.StatusOK)
		buf, want := make([]byte, 32<<10), ""
		for _, text := range texts {
			n := copy(buf, head+text+tail)
			rec.Write(buf[:n])
			want += head + text + tail
		}
		// Two events in one piece too.
		both := head + texts[0] + tail + head + texts[1] + tail
		n := copy(buf, both)
		rec.Write(buf[:n])
		want += both
		if w.Body.String() != want {
			t.Errorf("%q: the client got\n%s\nwant\n%s", texts, w.Body.String(), want)
		}
	}
}
