package caddyllm

import (
	"bytes"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/llmaffinity/caddy-llm-affinity/drain"
	"github.com/llmaffinity/caddy-llm-affinity/internal/cputime"
	"github.com/llmaffinity/caddy-llm-affinity/prefixindex"
	"github.com/llmaffinity/caddy-llm-affinity/router"
)

// benchBody is a request body whose reader can be rewound, so the
// benchmark's loop allocates no reader of its own.
type benchBody struct{ bytes.Reader }

func (*benchBody) Close() error { return nil }

// BenchmarkHandlerServe is the handler's ServeHTTP around a next handler
// that does what reverse_proxy does with a trivial upstream: Select, then
// a small JSON completion with usage. It is the per-request cost of the
// llm_affinity path apart from the proxying itself (overhead.sh measures
// that): the read and parse of the body, the request state, the attempt's
// context, the response writer and the bookkeeping at the end. As in
// net/http's server, each request's context is a fresh cancellable one
// carrying Caddy's replacer. completion-602B is overhead.sh's request;
// chat-256KiB an agent's turn, whose body is most of the memory.
func BenchmarkHandlerServe(b *testing.B) {
	b.Run("completion-602B", func(b *testing.B) {
		benchServe(b, "/v1/completions", []byte(`{"model":"m","prompt":"`+strings.Repeat("abcd", 128)+`","max_tokens":16,"n":1,"user":"r-000042"}`))
	})
	b.Run("responses-608B", func(b *testing.B) {
		benchServe(b, "/v1/responses", []byte(`{"model":"m","input":"`+strings.Repeat("abcd", 128)+`","max_output_tokens":16,"user":"r-000042"}`))
	})
	b.Run("chat-256KiB", func(b *testing.B) {
		benchServe(b, "/v1/chat/completions", benchChat(b, 256<<10, false, false))
	})
}

// benchResponse is a Responses API response as vLLM writes it, with its
// usage.
const benchResponse = `{"background":false,"created_at":1700000000,"error":null,"id":"resp_bench0000000000000001",` +
	`"incomplete_details":null,"max_output_tokens":null,"model":"m","object":"response","output":[{"content":` +
	`[{"annotations":[],"text":" ok","type":"output_text"}],"id":"msg_bench0000000000000001","role":"assistant",` +
	`"status":"completed","type":"message"}],"parallel_tool_calls":true,"status":"completed","tool_choice":"auto",` +
	`"tools":[],"usage":{"input_tokens":140,"input_tokens_details":{"cached_tokens":0},"output_tokens":16,` +
	`"output_tokens_details":{"reasoning_tokens":0},"total_tokens":156}}`

func benchServe(b *testing.B, path string, reqBody []byte) {
	h := &Handler{logger: zap.NewNop(), BlockTokens: prefixindex.DefaultBlockTokens, MaxBodyBytes: defaultMaxBodyBytes}
	h.parser = newParser(prefixindex.Hasher{MaxBlocks: defaultMaxPrefixTokens / prefixindex.DefaultBlockTokens}, 4, "")
	p := testPolicy(b, zap.NewNop())
	p.ExplainHeader = false
	pool := reverseproxy.UpstreamPool{
		{Host: new(reverseproxy.Host), Dial: "bench-a:1"}, {Host: new(reverseproxy.Host), Dial: "bench-b:1"},
		{Host: new(reverseproxy.Host), Dial: "bench-c:1"}, {Host: new(reverseproxy.Host), Dial: "bench-d:1"},
	}
	respBody := []byte(`{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":"ok","finish_reason":"length"}],"usage":{"prompt_tokens":140,"completion_tokens":16,"total_tokens":156}}`)
	if strings.HasSuffix(path, "/responses") {
		respBody = []byte(benchResponse)
	}
	next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		if p.Select(pool, r, w) == nil {
			b.Fatal("no upstream")
		}
		io.Copy(io.Discard, r.Body)
		_ = r.Context().Done() // the transport watches it
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusOK)
		_, err := w.Write(respBody)
		return err
	})
	base := httptest.NewRequest("POST", path, nil)
	base.Header.Set("Content-Type", "application/json")
	body := new(benchBody)
	w := &discardWriter{h: make(http.Header)}
	b.SetBytes(int64(len(reqBody)))
	b.ReportAllocs()
	cpu := cputime.Start()
	for b.Loop() {
		ctx, cancel := context.WithCancel(context.Background())
		ctx = context.WithValue(ctx, caddy.ReplacerCtxKey, caddy.NewEmptyReplacer())
		r := base.WithContext(ctx)
		body.Reset(reqBody)
		r.Body, r.ContentLength = body, int64(len(reqBody))
		clear(w.h)
		if err := h.ServeHTTP(w, r, next); err != nil {
			b.Fatal(err)
		}
		cancel()
	}
	cputime.Report(b, cpu)
}

// discardWriter is a response writer that keeps nothing but its header
// map, which the loop reuses.
type discardWriter struct{ h http.Header }

func (w *discardWriter) Header() http.Header         { return w.h }
func (w *discardWriter) Write(p []byte) (int, error) { return len(p), nil }
func (w *discardWriter) WriteHeader(int)             {}

// TestSetContentLength: the header is left alone when it says the length
// already, and set when it is missing or says another.
func TestSetContentLength(t *testing.T) {
	for _, tc := range []struct {
		have []string
		n    int
	}{
		{nil, 602}, {[]string{"602"}, 602}, {[]string{"17"}, 602}, {[]string{"602", "602"}, 602},
	} {
		h := http.Header{}
		if tc.have != nil {
			h["Content-Length"] = tc.have
		}
		setContentLength(h, tc.n)
		if v := h["Content-Length"]; len(v) != 1 || v[0] != "602" {
			t.Errorf("with %q: Content-Length %q", tc.have, v)
		}
	}
}

// TestAttemptContextCarriesState: the policy finds the request's state
// under the values reverse_proxy adds, other values still resolve, and
// a context derived from it (as the transport derives one) is cancelled
// with the attempt.
func TestAttemptContextCarriesState(t *testing.T) {
	st := &requestState{}
	parent := context.WithValue(context.Background(), caddy.ReplacerCtxKey, "repl")
	inner, cancel := context.WithCancelCause(parent)
	r := httptest.NewRequest("POST", "/v1/completions", nil)
	r = r.WithContext(context.WithValue(&attemptContext{Context: inner, st: st}, struct{ k int }{1}, "proxy"))
	if requestStateOf(r) != st {
		t.Fatal("state not found through the attempt's context")
	}
	if r.Context().Value(caddy.ReplacerCtxKey) != "repl" {
		t.Fatal("the parent's value is lost")
	}
	derived, stop := context.WithCancel(r.Context())
	defer stop()
	cancel(errDrainCut)
	<-derived.Done()
	if context.Cause(derived) != errDrainCut {
		t.Fatalf("cause %v", context.Cause(derived))
	}
}

// TestDeclaredLengthIsNotAllocatedUpFront: a body declaring a gigabyte and
// sending ten bytes costs no more than a chunk, and reads as cut short; a
// body that does arrive in full is read whole, whatever its size.
func TestDeclaredLengthIsNotAllocatedUpFront(t *testing.T) {
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	b, err := readDeclared(strings.NewReader("0123456789"), 1<<30, nil)
	runtime.ReadMemStats(&after)
	if !errors.Is(err, io.ErrUnexpectedEOF) || string(b) != "0123456789" {
		t.Fatalf("read %q, %v", b, err)
	}
	if n := after.TotalAlloc - before.TotalAlloc; n > 2*bodyChunk {
		t.Fatalf("a 10-byte body declaring 1 GiB allocated %d bytes", n)
	}
	for _, size := range []int{1, 600, bodyChunk, bodyChunk + 1, 3*bodyChunk + 17} {
		want := strings.Repeat("x", size)
		if got, err := readDeclared(strings.NewReader(want), int64(size), nil); err != nil || string(got) != want {
			t.Fatalf("%d bytes: read %d, %v", size, len(got), err)
		}
	}
}

// TestDeclaredBodyReadIntoTheGivenBuffer: a buffer from bodyPool with room
// for the body is read into as it is, with no allocation.
func TestDeclaredBodyReadIntoTheGivenBuffer(t *testing.T) {
	body := strings.Repeat("y", 3*bodyChunk+5)
	buf := make([]byte, 0, 4*bodyChunk)
	r := strings.NewReader(body)
	allocs := testing.AllocsPerRun(20, func() {
		r.Reset(body)
		got, err := readDeclared(r, int64(len(body)), buf)
		if err != nil || string(got) != body || &got[0] != &buf[:1][0] {
			t.Fatalf("read %d bytes, %v, into the given buffer: %v", len(got), err, &got[0] == &buf[:1][0])
		}
	})
	if allocs != 0 {
		t.Fatalf("%v allocations reading into a buffer with room", allocs)
	}
}

// TestBodyBufferReturnsOnlyWhenNothingReadsIt: a request's body buffer
// goes back to bodyPool only when no transport can still be sending from
// it: after the one attempt, answered 2xx by the engine, which read the
// whole body to answer. After an attempt the proxy gave up on (a retry, a
// continuation), an answer before the body may have been read (4xx, 5xx),
// or none (nothing was sent, or another policy's proxy may have sent it),
// it is left to the garbage collector. The response's buffer always goes
// back.
func TestBodyBufferReturnsOnlyWhenNothingReadsIt(t *testing.T) {
	for _, tc := range []struct {
		sent, status int
		back         bool
	}{
		{1, http.StatusOK, true},
		{1, http.StatusCreated, true},
		{2, http.StatusOK, false},
		{3, http.StatusOK, false},
		{1, http.StatusBadRequest, false},
		{1, http.StatusRequestEntityTooLarge, false},
		{1, http.StatusBadGateway, false},
		{1, 0, false},
		{0, http.StatusOK, false},
		{0, http.StatusServiceUnavailable, false},
	} {
		pb := &pooledBody{b: []byte(`{"prompt":"x"}`)}
		st := &requestState{pooled: pb, sent: tc.sent}
		st.rec = &st.recorder
		st.recorder.status = tc.status
		resp := &pooledBody{}
		st.recorder.bodyBuf, st.recorder.body = resp, []byte(`{"usage":{}}`)
		st.recorder.releaseBody()
		st.releaseBody()
		if back := len(pb.b) == 0; back != tc.back {
			t.Errorf("%d attempts, status %d: back in the pool %v, want %v", tc.sent, tc.status, back, tc.back)
		}
		// The response kept for its usage is the recorder's alone: its
		// buffer always goes back.
		if st.recorder.bodyBuf != nil || st.recorder.body != nil || len(resp.b) != 0 || cap(resp.b) == 0 {
			t.Errorf("%d attempts, status %d: the response's buffer is not back in the pool", tc.sent, tc.status)
		}
		if st.pooled != nil {
			t.Errorf("%d attempts, status %d: the state still holds the buffer", tc.sent, tc.status)
		}
	}
	big := &pooledBody{b: make([]byte, maxPooledBody+1)}
	big.release()
	if len(big.b) == 0 {
		t.Error("a buffer over maxPooledBody went back to the pool")
	}
}

// TestEnginesAskedForIdentity: the request the proxy sends asks for an
// uncompressed response (the router reads it on its way back), and the
// client's own Accept-Encoding is back once the handler is done (the
// access log records the client's request).
func TestEnginesAskedForIdentity(t *testing.T) {
	for _, clientSent := range [][]string{{"gzip, deflate"}, nil, {"gzip"}} {
		h := moveHandler()
		r := moveRequest(`{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":2}`)
		if clientSent != nil {
			r.Header["Accept-Encoding"] = clientSent
		}
		var proxied []string
		next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
			proxied = slices.Clone(r.Header.Values("Accept-Encoding"))
			// A handler after this one (request_header) may change the
			// value in place: it must be this request's own.
			r.Header["Accept-Encoding"][0] = "br"
			w.WriteHeader(http.StatusOK)
			return nil
		})
		if err := h.ServeHTTP(httptest.NewRecorder(), r, next); err != nil {
			t.Fatal(err)
		}
		if len(proxied) != 1 || proxied[0] != "identity" {
			t.Errorf("client sent %q: the proxy sent %q, want identity", clientSent, proxied)
		}
		if got, ok := r.Header["Accept-Encoding"]; ok != (clientSent != nil) || strings.Join(got, ",") != strings.Join(clientSent, ",") {
			t.Errorf("client sent %q: %q after the handler", clientSent, got)
		}
	}
}

// uploadBody is a request body that arrives in two parts: the second
// only once the test lets it (a slow client), and it records when the
// body ended.
type uploadBody struct {
	parts [][]byte
	gate  chan struct{}
	ended time.Time
}

func (b *uploadBody) Read(p []byte) (int, error) {
	if len(b.parts) == 0 {
		return 0, io.EOF
	}
	if len(b.parts) == 1 {
		<-b.gate
	}
	n := copy(p, b.parts[0])
	b.parts = b.parts[1:]
	if len(b.parts) == 0 {
		b.ended = time.Now()
	}
	return n, nil
}

func (*uploadBody) Close() error { return nil }

// TestTTFTFromTheBodysEnd: the time to first token counts from the end
// of the request's body: a client's slow upload is not its upstream's
// time (it counted from the request's first byte).
func TestTTFTFromTheBodysEnd(t *testing.T) {
	p, h, pool := testPolicy(t, zap.NewNop()), moveHandler(), movePool()
	body := `{"model":"m","messages":[{"role":"user","content":"hello there"}],"max_tokens":2}`
	upload := &uploadBody{parts: [][]byte{[]byte(body[:10]), []byte(body[10:])}, gate: make(chan struct{})}
	r := moveRequest("")
	r.Body, r.ContentLength = upload, int64(len(body))
	repl := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	var answered time.Time
	next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		if p.Select(pool, r, w) == nil {
			t.Fatal("no upstream")
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusOK) // a non-streaming answer's first token
		answered = time.Now()
		return nil
	})
	started := time.Now()
	go func() {
		// The client takes its time: the rest of the body comes once
		// the handler has been reading for a while.
		time.Sleep(50 * time.Millisecond)
		close(upload.gate)
	}()
	if err := h.ServeHTTP(httptest.NewRecorder(), r, next); err != nil {
		t.Fatal(err)
	}
	v, ok := repl.Get("http.llm_affinity.ttft")
	ttft, _ := v.(float64)
	if !ok || upload.ended.Sub(started) < 50*time.Millisecond {
		t.Fatalf("ttft %v (%v); the body ended %v after the start", v, ok, upload.ended.Sub(started))
	}
	if limit := answered.Sub(upload.ended).Seconds(); ttft > limit {
		t.Fatalf("ttft %.4fs, more than the %.4fs from the body's end to the answer: the upload counted", ttft, limit)
	}
}

// modelsWriterWith is a modelsWriter over a recorder, with the pool's list.
func modelsWriterWith(list string) (*httptest.ResponseRecorder, *modelsWriter) {
	rec := httptest.NewRecorder()
	st := &requestState{listModels: true, modelList: []byte(list)}
	return rec, &modelsWriter{ResponseWriterWrapper: caddyhttp.ResponseWriterWrapper{ResponseWriter: rec}, st: st}
}

// TestModelsWriterReplacesOnlyJSON: an engine's JSON 200 gets the pool's
// list in its place, without the engine's validators, also when copied in
// through ReadFrom (which the embedded wrapper would send to the client
// directly); a 200 that is not JSON (another server behind the path) and
// an error go as they are.
func TestModelsWriterReplacesOnlyJSON(t *testing.T) {
	const list = `{"object":"list","data":[{"id":"m"},{"id":"tenant-0"}]}`
	rec, mw := modelsWriterWith(list)
	mw.Header().Set("Content-Type", "application/json")
	mw.Header().Set("ETag", `"engine-list"`)
	if _, err := io.CopyN(mw, strings.NewReader(`{"object":"list","data":[{"id":"m"}]}`), 1<<20); err != io.EOF {
		t.Fatal(err)
	}
	if rec.Body.String() != list || rec.Header().Get("ETag") != "" || rec.Header().Get("Content-Length") != strconv.Itoa(len(list)) {
		t.Errorf("JSON 200 copied in: %q, headers %v", rec.Body.String(), rec.Header())
	}
	rec, mw = modelsWriterWith(list)
	mw.Header().Set("Content-Type", "text/html; charset=utf-8")
	mw.WriteHeader(http.StatusOK)
	mw.Write([]byte("<html>not a models list</html>"))
	if rec.Body.String() != "<html>not a models list</html>" {
		t.Errorf("an HTML 200 was replaced: %q", rec.Body.String())
	}
	rec, mw = modelsWriterWith(list)
	mw.Header().Set("Content-Type", "application/json")
	mw.WriteHeader(http.StatusUnauthorized)
	mw.Write([]byte(`{"error":"Unauthorized"}`))
	if rec.Code != 401 || rec.Body.String() != `{"error":"Unauthorized"}` {
		t.Errorf("the engine's 401 became %d %q", rec.Code, rec.Body.String())
	}
}

// TestPeekBody: a pass-through body within max_body is read whole (also
// chunked, then sent with its length); a chunked one beyond it is sent on
// as it came, the bytes read first, and not read for its model.
func TestPeekBody(t *testing.T) {
	h := &Handler{MaxBodyBytes: 32}
	for _, c := range []struct {
		name    string
		body    string
		chunked bool
		whole   bool
	}{
		{"declared", `{"model":"m","input":"x"}`, false, true},
		{"chunked", `{"model":"m","input":"x"}`, true, true},
		{"chunked, exactly max_body", `{"model":"m","input":"xxxxxxxx"}`, true, true},
		{"chunked, beyond max_body", `{"input":"a long input","model":"m"}`, true, false},
	} {
		r := httptest.NewRequest(http.MethodPost, "/v1/embeddings", strings.NewReader(c.body))
		if c.chunked {
			r.ContentLength, r.TransferEncoding = -1, []string{"chunked"}
		}
		body, whole, err := h.peekBody(r)
		if err != nil || whole != c.whole || (whole && string(body) != c.body) {
			t.Errorf("%s: whole %v, %q, %v", c.name, whole, body, err)
			continue
		}
		sent, _ := io.ReadAll(r.Body)
		if string(sent) != c.body {
			t.Errorf("%s: sends %q", c.name, sent)
		}
		if wantLength := int64(-1); whole {
			if r.ContentLength != int64(len(c.body)) || r.TransferEncoding != nil {
				t.Errorf("%s: length %d, transfer encoding %v", c.name, r.ContentLength, r.TransferEncoding)
			}
		} else if r.ContentLength != wantLength || len(r.TransferEncoding) != 1 {
			t.Errorf("%s: length %d, transfer encoding %v; sent as it came", c.name, r.ContentLength, r.TransferEncoding)
		}
	}
}

// TestPassThroughBodyOverALimitIs413: a pass-through body cut by a limit
// ahead of the handler (Caddy's request_body) is answered 413 naming that
// limit, as a routed one is, not 400.
func TestPassThroughBodyOverALimitIs413(t *testing.T) {
	h := &Handler{MaxBodyBytes: 1 << 20}
	body := `{"model":"m","input":"` + strings.Repeat("x", 200) + `"}`
	rec := httptest.NewRecorder()
	r := httptest.NewRequest(http.MethodPost, "/v1/embeddings", strings.NewReader(body))
	r.ContentLength, r.TransferEncoding = -1, []string{"chunked"}
	r.Body = http.MaxBytesReader(rec, r.Body, 64) // request_body max_size 64
	next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error { w.WriteHeader(200); return nil })
	_ = h.servePassThrough(rec, r, nil, next)
	if rec.Code != http.StatusRequestEntityTooLarge || !strings.Contains(rec.Body.String(), "limit of 64 bytes") {
		t.Errorf("a body over request_body's limit: %d %s", rec.Code, rec.Body)
	}
}

// TestBodyReadErrors: a body that did not come in time (Caddy's read_body
// timeout) gets 408, and one whose connection failed a 400 that does not
// name the sockets; a cut body says what was wrong with it.
func TestBodyReadErrors(t *testing.T) {
	sockets := &net.OpError{Op: "read", Net: "tcp", Source: &net.TCPAddr{IP: net.IPv4(10, 0, 0, 1), Port: 443},
		Addr: &net.TCPAddr{IP: net.IPv4(10, 9, 8, 7), Port: 58750}}
	timeout := *sockets
	timeout.Err = os.ErrDeadlineExceeded
	reset := *sockets
	reset.Err = syscall.ECONNRESET
	for _, tc := range []struct {
		err    error
		status int
		want   string
	}{
		{&timeout, http.StatusRequestTimeout, "did not arrive in time"},
		{&reset, http.StatusBadRequest, "connection failed"},
		{io.ErrUnexpectedEOF, http.StatusBadRequest, "unexpected EOF"},
	} {
		w := httptest.NewRecorder()
		writeBodyError(w, tc.err)
		if w.Code != tc.status || !strings.Contains(w.Body.String(), tc.want) || strings.Contains(w.Body.String(), "10.9.8.7") {
			t.Errorf("%v: %d %s, want %d with %q", tc.err, w.Code, w.Body, tc.status, tc.want)
		}
	}
}

// TestBodyNotDeclaredJSONIsPassedThrough: a generation request whose body
// is not declared application/json goes to an upstream unread, and is no
// sign of a route without the handler (that warning is for requests the
// handler never saw, logged once).
func TestBodyNotDeclaredJSONIsPassedThrough(t *testing.T) {
	core, logs := observer.New(zapcore.WarnLevel)
	p := testPolicy(t, zap.New(core))
	p.warnedUnparsed = new(atomic.Bool)
	pool := movePool()
	h := moveHandler()
	var routed *reverseproxy.Upstream
	next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		routed = p.Select(pool, r, w)
		w.WriteHeader(http.StatusBadRequest) // what vLLM answers
		return nil
	})
	for _, contentType := range []string{"text/plain", "application/x-www-form-urlencoded", "application/json-seq"} {
		r := moveRequest(`{"model":"m","messages":[{"role":"user","content":"hi"}]}`)
		r.Header.Set("Content-Type", contentType)
		routed = nil
		if err := h.ServeHTTP(httptest.NewRecorder(), r, next); err != nil || routed == nil {
			t.Fatalf("Content-Type %q: error %v, routed to %v", contentType, err, routed)
		}
		if requestStateOf(r) != nil {
			t.Fatalf("Content-Type %q: the body was read", contentType)
		}
	}
	if n := logs.Len(); n != 0 {
		t.Fatalf("%d warnings for requests the handler passed on: %v", n, logs.All()[0].Message)
	}
	// Without the handler: warned once.
	for range 2 {
		r := httptest.NewRequest("POST", "/v1/chat/completions", strings.NewReader(`{}`))
		if p.Select(pool, r, httptest.NewRecorder()) == nil {
			t.Fatal("not routed")
		}
	}
	if n := logs.FilterMessageSnippet("without the llm_affinity handler").Len(); n != 1 {
		t.Fatalf("%d warnings for a route without the handler, want 1", n)
	}
}

// TestStateGoesBackOnlyWhenNothingReachesIt: a request's state returns to
// statePool only when no transport may still read the first attempt's
// body from it (the body buffer's rule), no attempt is left registered,
// and no drain cut, taken before its attempt ended, may still run.
func TestStateGoesBackOnlyWhenNothingReachesIt(t *testing.T) {
	for _, tc := range []struct {
		sent, status int
		current      bool
		back         bool
	}{
		{1, http.StatusOK, false, true},
		{1, http.StatusCreated, false, true},
		// Shed or refused by the policy, or sent by another policy's
		// proxy, whose transport may still read the body.
		{0, http.StatusServiceUnavailable, false, false},
		{0, http.StatusUnauthorized, false, false},
		{0, http.StatusOK, false, false},
		{2, http.StatusOK, false, false},
		{1, http.StatusBadGateway, false, false},
		{1, 0, false, false},
		{1, http.StatusOK, true, false},
	} {
		st := newRequestState()
		st.sent = tc.sent
		if tc.status != 0 {
			st.rec = &st.recorder
			st.recorder.status = tc.status
		}
		if tc.current {
			st.current = &st.firstAttempt
		}
		scratch := st.scratchSpace()
		body := &pooledBody{b: []byte(`{"prompt":"x"}`)}
		st.pooled = body
		if back := st.recycle(); back != tc.back {
			t.Errorf("%d attempts, status %d, attempt left %v: back %v, want %v", tc.sent, tc.status, tc.current, back, tc.back)
		}
		if tc.back && (st.sent != 0 || st.rec != nil) {
			t.Errorf("%d attempts, status %d: the state went back without being emptied", tc.sent, tc.status)
		}
		// The scratch space goes with the state, or back to its pool
		// alone: a state kept out may still be reached, its scratch not.
		if kept := st.scratch == scratch; kept != tc.back {
			t.Errorf("%d attempts, status %d, attempt left %v: scratch space kept with the state %v, want %v", tc.sent, tc.status, tc.current, kept, tc.back)
		}
		// So does the body's buffer, emptied, or it goes by its own rule
		// (TestBodyBufferReturnsOnlyWhenNothingReadsIt).
		if kept := st.pooled == body; kept != tc.back || tc.back && len(body.b) != 0 || !tc.back && st.pooled != nil {
			t.Errorf("%d attempts, status %d, attempt left %v: body's buffer kept with the state %v (%d bytes), want %v", tc.sent, tc.status, tc.current, kept, len(body.b), tc.back)
		}
	}

	// The recorder's buffers stay with the state, emptied, but for one
	// too large to keep.
	st0 := newRequestState()
	st0.sent, st0.rec = 1, &st0.recorder
	rec := &st0.recorder
	rec.status, rec.tokens = http.StatusOK, 3
	rec.generated, rec.shape, rec.held = []byte("some text"), []byte(`{"choices":[{"text":`), []byte("data: {")
	rec.line = make([]byte, maxKeptBuffer+1)
	if !st0.recycle() {
		t.Fatal("a state answered 200 by its only attempt did not go back")
	}
	if len(rec.generated) != 0 || cap(rec.generated) == 0 || len(rec.shape) != 0 || cap(rec.shape) == 0 ||
		len(rec.held) != 0 || cap(rec.held) == 0 || rec.line != nil || rec.tokens != 0 || rec.status != 0 {
		t.Errorf("the state went back with its recorder's buffers %q %q %q (line %d bytes), %d tokens, status %d",
			rec.generated, rec.shape, rec.held, cap(rec.line), rec.tokens, rec.status)
	}

	// A drain deadline took the attempt to cut (its Cut is running)
	// before the attempt ended: the Cut reaches into the state.
	drains := drain.New(drain.Events{})
	st := newRequestState()
	st.rec = &st.recorder
	st.recorder.status = http.StatusOK
	a := st.newAttempt()
	*a = attempt{st: st}
	a.flight = drains.Enter("up:1", a)
	cutting, finish := make(chan struct{}), make(chan struct{})
	st.setCancel(func(error) { close(cutting); <-finish }, time.Now())
	st.cutTarget = a
	drains.Drain("up:1", 0, drain.Admin)
	<-cutting
	a.endFlight()
	close(finish)
	if st.recycle() {
		t.Error("the state went back while a drain's cut of its attempt was under way")
	}

	// A traced request (one continuing a stored response): a transport
	// may run the trace's hooks, which write into the state, after the
	// request ended (a dial finishing in the background).
	traced := newRequestState()
	traced.sent, traced.rec = 1, &traced.recorder
	traced.recorder.status = http.StatusOK
	traced.conns.traced(context.Background())
	if traced.recycle() {
		t.Error("the state went back with its connection trace's hooks pointing into it")
	}
}

// TestPlaceholdersOutliveTheRequestState: an access log reads a request's
// placeholders after the handler returned, when its state may already
// serve the next request: each request keeps its own values.
func TestPlaceholdersOutliveTheRequestState(t *testing.T) {
	p, h, pool := testPolicy(t, zap.NewNop()), moveHandler(), movePool()
	next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		if p.Select(pool, r, w) == nil {
			return caddyhttp.Error(http.StatusServiceUnavailable, errors.New("no upstreams available"))
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusOK)
		_, err := io.WriteString(w, `{"id":"c","object":"chat.completion","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":2,"total_tokens":11}}`)
		return err
	})
	var repls []*caddy.Replacer
	for i := range 32 {
		r := moveRequest(fmt.Sprintf(`{"model":"model-%d","messages":[{"role":"user","content":"%s"}],"max_tokens":2}`, i, strings.Repeat("x", 4*(i+1))))
		repls = append(repls, r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer))
		rr := httptest.NewRecorder()
		if err := h.ServeHTTP(rr, r, next); err != nil || rr.Code != http.StatusOK {
			t.Fatalf("request %d: %v, %d %s", i, err, rr.Code, rr.Body)
		}
	}
	for i, repl := range repls {
		model, _ := repl.GetString("http.llm_affinity.model")
		attempt, _ := repl.GetString("http.llm_affinity.attempt")
		upstream, _ := repl.GetString("http.llm_affinity.upstream")
		if model != fmt.Sprintf("model-%d", i) || attempt != "1" || upstream == "" {
			t.Errorf("request %d's placeholders after the others: model %q, attempt %q, upstream %q", i, model, attempt, upstream)
		}
	}
}

// TestStateReturnsThroughTheHandler follows the state's return through
// ServeHTTP (a state that went back is emptied): a request answered 200 by
// its one attempt gives it back; one whose attempt a drain deadline cut,
// one that panicked, and one that another policy's proxy sent keep it out.
// The last one's body is read after the handler returned, as a transport
// may, and after the next request was served: it must arrive whole.
func TestStateReturnsThroughTheHandler(t *testing.T) {
	const completion = `{"id":"c","object":"chat.completion","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":2,"total_tokens":11}}`
	body := func(content string) string {
		return `{"model":"m","messages":[{"role":"user","content":"` + content + `"}],"max_tokens":2}`
	}
	p, h, pool := testPolicy(t, zap.NewNop()), moveHandler(), movePool()
	serve := func(reqBody string, attempt func(w http.ResponseWriter, r *http.Request, up *reverseproxy.Upstream)) *requestState {
		t.Helper()
		var st *requestState
		next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
			if st == nil {
				st = requestStateOf(r)
			}
			up := p.Select(pool, r, w)
			if up == nil {
				return caddyhttp.Error(http.StatusServiceUnavailable, errors.New("no upstreams available"))
			}
			attempt(w, r, up)
			return nil
		})
		if err := h.ServeHTTP(httptest.NewRecorder(), moveRequest(reqBody), next); err != nil {
			t.Fatal(err)
		}
		return st
	}
	answer := func(w http.ResponseWriter) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusOK)
		io.WriteString(w, completion)
	}
	back := func(st *requestState) bool { return st.req == nil && st.rec == nil }

	if st := serve(body("plain"), func(w http.ResponseWriter, _ *http.Request, _ *reverseproxy.Upstream) { answer(w) }); !back(st) {
		t.Error("a request answered 200 by its only attempt kept its state out of the pool")
	}

	// The response has begun when the deadline cuts: the attempt ends as
	// it is, with a Cut taken before its end.
	st := serve(body("cut"), func(w http.ResponseWriter, r *http.Request, up *reverseproxy.Upstream) {
		answer(w)
		p.sh.drains.Drain(up.Dial, 0, drain.Admin)
		select {
		case <-r.Context().Done():
		case <-time.After(time.Minute):
			t.Fatal("the drain deadline did not cut the attempt")
		}
	})
	if back(st) {
		t.Error("a request whose attempt the drain deadline took to cut gave its state back")
	}
	for _, u := range pool {
		p.sh.drains.Undrain(u.Dial, drain.Admin)
	}

	var panicked *requestState
	func() {
		defer func() {
			if recover() != http.ErrAbortHandler {
				t.Error("the client's abort did not reach the server")
			}
		}()
		next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
			panicked = requestStateOf(r)
			p.Select(pool, r, w)
			answer(w)
			panic(http.ErrAbortHandler) // the proxy's, for a client gone mid-response
		})
		h.ServeHTTP(httptest.NewRecorder(), moveRequest(body("aborted")), next)
	}()
	if panicked == nil || back(panicked) {
		t.Error("a request that panicked gave its state back")
	}

	// A proxy with another policy (no Select) sends the body, and its
	// transport is still reading it when the upstream's early answer ends
	// the handler.
	first := body(strings.Repeat("A", 64<<10))
	var unread io.Reader
	var other *requestState
	next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		other, unread = requestStateOf(r), r.Body
		w.WriteHeader(http.StatusUnauthorized)
		return nil
	})
	if err := h.ServeHTTP(httptest.NewRecorder(), moveRequest(first), next); err != nil {
		t.Fatal(err)
	}
	if back(other) {
		t.Error("a request another proxy sent gave its state back")
	}
	serve(body("SECRET "+strings.Repeat("B", 1<<10)), func(w http.ResponseWriter, _ *http.Request, _ *reverseproxy.Upstream) { answer(w) })
	if got, _ := io.ReadAll(unread); string(got) != first {
		t.Errorf("the other proxy's transport read %d bytes (%.40q...), not the request's %d", len(got), got, len(first))
	}
}

// TestFirstChargeLivesInTheState: the first attempt's charge is the
// state's own (router.Request.Charge), a retry's its own, and however a
// request ends, served, failed, refused or retried, states reused
// leave nothing charged on any upstream.
func TestFirstChargeLivesInTheState(t *testing.T) {
	p, h, pool := testPolicy(t, zap.NewNop()), moveHandler(), movePool()
	const completion = `{"id":"c","object":"chat.completion","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":2,"total_tokens":11}}`
	statuses := []int{http.StatusOK, http.StatusBadGateway, http.StatusOK, http.StatusNotFound, 0, http.StatusOK, http.StatusInternalServerError}
	for i := range 3 * len(statuses) {
		status := statuses[i%len(statuses)]
		attempts := 0
		next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
			for {
				st := requestStateOf(r)
				if p.Select(pool, r, w) == nil {
					return caddyhttp.Error(http.StatusServiceUnavailable, errors.New("no upstreams available"))
				}
				attempts++
				st.mu.Lock()
				charge, first := st.current.charge, &st.firstCharge
				st.mu.Unlock()
				if (attempts == 1) != (charge == first) {
					t.Errorf("request %d, attempt %d: its charge in the state %v", i, attempts, charge == first)
				}
				if status == 0 && attempts == 1 {
					continue // a retry, as after a failed dial
				}
				w.Header().Set("Content-Type", "application/json")
				w.WriteHeader(cmp.Or(status, http.StatusOK))
				io.WriteString(w, completion)
				return nil
			}
		})
		if err := h.ServeHTTP(httptest.NewRecorder(), moveRequest(`{"model":"m","messages":[{"role":"user","content":"hello `+strconv.Itoa(i)+`"}],"max_tokens":2}`), next); err != nil {
			t.Fatal(err)
		}
		for _, u := range p.sh.fleet.Snapshot(time.Now()) {
			if u.InFlight != 0 || u.KVTokensInFlight != 0 || u.QueuedDecodeTokens != 0 || u.QueuedPrefillTokens != 0 {
				t.Fatalf("after request %d (status %d), %s still holds %+v", i, status, u.Dial, u)
			}
		}
	}
}

// TestModelNotServedReadsTheEnginesAnswer: only an engine's 404 for the
// model makes the router take the model off that engine's list; a 404 for
// a path the engine lacks (an older vLLM's /v1/responses) would have
// taken the base model off it, and had the list fetched again at each.
func TestModelNotServedReadsTheEnginesAnswer(t *testing.T) {
	for body, want := range map[string]bool{
		`{"error":{"message":"The model ` + "`tenant`" + ` does not exist.","type":"NotFoundError","param":"model","code":404}}`:     true, // current vLLM, kvsim
		`{"error":{"message":"The model ` + "`tenant`" + ` does not exist.","type":"NotFoundError","param":null,"code":404}}`:        true,
		`{"object":"error","message":"The model ` + "`tenant`" + ` does not exist.","type":"NotFoundError","param":null,"code":404}`: true,
		`{"detail":"Not Found"}`: false,
		``:                       false,
	} {
		if got := modelNotServed([]byte(body)); got != want {
			t.Errorf("%s: %v, want %v", body, got, want)
		}
	}
}

// TestTextPartsCountTheirText: a message's content parts count as the
// text in them, not as the JSON around it. A chat of 100,000 empty text
// parts (2.6 MB of body, no text) was refused as context_length_exceeded
// on upstreams of 100,000 tokens, its parts' objects counted as text; so
// was a Responses API input of empty input_text parts. Parts whose text
// is too long even at 16 bytes a token still are refused, and the
// engines' usage for text parts teaches the text's bytes per token.
func TestTextPartsCountTheirText(t *testing.T) {
	p, h, pool := testPolicy(t, zap.NewNop()), moveHandler(), movePool()
	p.hardwareByDial = map[string]router.Hardware{}
	for _, u := range pool {
		p.hardwareByDial[u.Dial] = router.Hardware{KVCapacityTokens: 100_000}
	}
	// serve sends body to path; an engine answers with usage counting
	// promptTokens.
	serve := func(path, body string, promptTokens int) *httptest.ResponseRecorder {
		t.Helper()
		next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
			if p.Select(pool, r, w) == nil {
				return caddyhttp.Error(http.StatusServiceUnavailable, errors.New("no upstreams available"))
			}
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusOK)
			fmt.Fprintf(w, `{"id":"c","object":"chat.completion","choices":[],"usage":{"prompt_tokens":%d,"completion_tokens":2,"total_tokens":%d}}`, promptTokens, promptTokens+2)
			return nil
		})
		rr := httptest.NewRecorder()
		if err := h.ServeHTTP(rr, moveRequestTo(path, body), next); err != nil {
			t.Fatal(err)
		}
		return rr
	}
	// parts is n text parts of type typ, each with text.
	parts := func(typ string, n int, text string) string {
		part := `{"type":"` + typ + `","text":"` + text + `"}`
		return "[" + strings.Repeat(part+",", n-1) + part + "]"
	}
	chat := func(content string) string {
		return `{"model":"m","max_tokens":7,"messages":[{"role":"user","content":` + content + `}]}`
	}
	responses := func(content string) string {
		return `{"model":"m","max_output_tokens":7,"input":[{"role":"user","content":` + content + `}]}`
	}

	for _, c := range []struct {
		name, path, body string
		refused          bool
	}{
		{"100,000 empty text parts", "/v1/chat/completions", chat(parts("text", 100_000, "")), false},
		{"100,000 empty input_text parts", "/v1/responses", responses(parts("input_text", 100_000, "")), false},
		// 1.7 MB of text, 106,250 tokens at 16 bytes a token.
		{"text parts of 1.7 MB of text", "/v1/chat/completions", chat(parts("text", 1_000, strings.Repeat("x", 1_700))), true},
		{"input_text parts of 1.7 MB of text", "/v1/responses", responses(parts("input_text", 1_000, strings.Repeat("x", 1_700))), true},
	} {
		rr := serve(c.path, c.body, 10)
		tooLong := rr.Code == http.StatusBadRequest && strings.Contains(rr.Body.String(), "context_length_exceeded")
		if tooLong != c.refused || !c.refused && rr.Code != http.StatusOK {
			t.Errorf("%s (%d bytes of body): %d %.200s", c.name, len(c.body), rr.Code, rr.Body)
		}
	}

	// Three turns of 100 parts of 40 bytes of text each, which the engine
	// counts at 4 bytes a token (2,600 bytes of parts' keys and
	// punctuation besides, no tokens of their own).
	for i := range 3 {
		text := fmt.Sprintf("turn %d %s", i, strings.Repeat("x", 33))
		if rr := serve("/v1/chat/completions", chat(parts("text", 100, text)), 100*len(text)/4); rr.Code != http.StatusOK {
			t.Fatalf("teaching request: %d %s", rr.Code, rr.Body)
		}
	}
	if bpt, learned := p.sh.fleet.BytesPerToken("m"); !learned || bpt < 3.9 || bpt > 4.2 {
		t.Errorf("learned %.2f bytes a token (learned %v) from text parts of 4", bpt, learned)
	}
}
