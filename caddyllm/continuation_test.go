package caddyllm

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httptrace"
	"os"
	"reflect"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"go.uber.org/zap"

	"github.com/llmaffinity/caddy-llm-affinity/drain"
	"github.com/llmaffinity/caddy-llm-affinity/router"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// The handler's moves between upstreams, driven as reverse_proxy drives
// them: each attempt calls the policy's Select, then answers or fails.

const sseChunk = "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"}}]}\n\n"

func moveHandler() *Handler {
	return &Handler{logger: zap.NewNop(), BlockTokens: 4, MaxBodyBytes: defaultMaxBodyBytes, parser: testParser()}
}

func moveRequest(body string) *http.Request { return moveRequestTo("/v1/chat/completions", body) }

func moveRequestTo(path, body string) *http.Request {
	r := httptest.NewRequest("POST", path, strings.NewReader(body))
	r.Header.Set("Content-Type", "application/json")
	return r.WithContext(context.WithValue(context.Background(), caddy.ReplacerCtxKey, caddy.NewEmptyReplacer()))
}

func movePool() reverseproxy.UpstreamPool {
	return reverseproxy.UpstreamPool{{Host: new(reverseproxy.Host), Dial: "move-a:1"}, {Host: new(reverseproxy.Host), Dial: "move-b:1"}}
}

// moves serves a chat request with the given extra fields (JSON members,
// each followed by a comma) through the handler, reverse_proxy being each
// attempt: the attempt selects an upstream as the proxy does, then runs
// attempt (n counts from 1). It returns the response, the attempts and
// the handler's error.
func moves(t *testing.T, extra string, attempt func(n int, w http.ResponseWriter, r *http.Request) error) (*httptest.ResponseRecorder, int, error) {
	t.Helper()
	rr, n, _, err := movesBody(t, `{"model":"m",`+extra+`"messages":[{"role":"user","content":"hello there"}],"max_tokens":7}`, attempt)
	return rr, n, err
}

// movesBody is moves with the whole body given, and the policy returned;
// configure, if any, changes the policy first.
func movesBody(t *testing.T, body string, attempt func(n int, w http.ResponseWriter, r *http.Request) error, configure ...func(*Policy)) (*httptest.ResponseRecorder, int, *Policy, error) {
	t.Helper()
	return movesTo(t, "/v1/chat/completions", body, attempt, configure...)
}

// movesTo is movesBody for a request to path.
func movesTo(t *testing.T, path, body string, attempt func(n int, w http.ResponseWriter, r *http.Request) error, configure ...func(*Policy)) (*httptest.ResponseRecorder, int, *Policy, error) {
	t.Helper()
	p, pool, h := testPolicy(t, zap.NewNop()), movePool(), moveHandler()
	for _, c := range configure {
		c(p)
	}
	t.Cleanup(func() {
		// Whatever happened, nothing stays charged or registered.
		if f, d := inFlightLeft(p); f != 0 || d != 0 {
			t.Errorf("left in flight: fleet %d, drain registry %d", f, d)
		}
	})
	n := 0
	next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		n++
		p.Select(pool, r, w)
		return attempt(n, w, r)
	})
	rr := httptest.NewRecorder()
	err := h.ServeHTTP(rr, moveRequestTo(path, body), next)
	return rr, n, p, err
}

// startStream writes a stream's headers and its first chunk.
func startStream(w http.ResponseWriter) {
	w.Header().Set("Content-Type", "text/event-stream")
	w.WriteHeader(http.StatusOK)
	w.Write([]byte(sseChunk))
}

// continued is moves for a stream whose first upstream dies after its
// first chunk; continuation answers the attempts after it.
func continued(t *testing.T, continuation func(w http.ResponseWriter, r *http.Request) error) (*httptest.ResponseRecorder, int, error) {
	t.Helper()
	return moves(t, `"stream":true,`, func(n int, w http.ResponseWriter, r *http.Request) error {
		if n == 1 {
			startStream(w)
			panic(http.ErrAbortHandler) // the upstream died mid-stream
		}
		return continuation(w, r)
	})
}

// TestFailedContinuationEndsTheStream: a stream broken off mid-generation
// whose continuation attempt fails before writing anything (no upstream
// left) ends with an error event and [DONE], not silently. The event's
// error has the four fields of vLLM's error object (param null).
func TestFailedContinuationEndsTheStream(t *testing.T) {
	rr, attempts, err := continued(t, func(w http.ResponseWriter, r *http.Request) error {
		return caddyhttp.Error(http.StatusBadGateway, errors.New("no upstreams available"))
	})
	body := rr.Body.String()
	if err != nil || attempts != 2 || !strings.HasPrefix(body, sseChunk) || !strings.Contains(body, `"param":null,"type":"server_error"`) ||
		!strings.HasSuffix(body, "data: [DONE]\n\n") {
		t.Fatalf("attempts %d, error %v, body %q", attempts, err, body)
	}
}

// TestTooManyMovesBeforeTheResponse: a request whose attempts are all cut
// before any response began gets a 503 with Retry-After in JSON, not an
// SSE error stream under 200.
// It is a shed like any other: counted, and said so in the placeholders
// and the explanation header rather than the last attempt's decision.
func TestTooManyMovesBeforeTheResponse(t *testing.T) {
	var repl *caddy.Replacer
	rr, attempts, p, err := movesBody(t, `{"model":"m","messages":[{"role":"user","content":"hello there"}],"max_tokens":7}`,
		func(_ int, w http.ResponseWriter, r *http.Request) error {
			repl = r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
			requestStateOf(r).current.Cut() // its upstream's drain deadline
			<-r.Context().Done()
			return r.Context().Err()
		})
	if err != nil || attempts != maxRedispatch+1 || rr.Code != http.StatusServiceUnavailable || rr.Header().Get("Retry-After") == "" ||
		rr.Header().Get("Content-Type") != "application/json" || !strings.Contains(rr.Body.String(), "moved between upstreams") {
		t.Fatalf("attempts %d, error %v: %d %v %q", attempts, err, rr.Code, rr.Header(), rr.Body)
	}
	if got := rr.Header().Get(explainHeader); !strings.HasPrefix(got, "reason=shed; blocked_by=moved; prompt=") || !strings.HasSuffix(got, fmt.Sprintf("; attempt=%d", maxRedispatch+1)) {
		t.Errorf("explanation %q", got)
	}
	reason, _ := repl.GetString("http.llm_affinity.reason")
	blocked, _ := repl.GetString("http.llm_affinity.blocked_by")
	upstream, _ := repl.GetString("http.llm_affinity.upstream")
	if reason != "shed" || blocked != "moved" || upstream != "" {
		t.Errorf("placeholders reason %q, blocked_by %q, upstream %q", reason, blocked, upstream)
	}
	if n := testutil.ToFloat64(p.sh.metrics.shed.WithLabelValues(movedReason)); n != 1 {
		t.Errorf("shed_total{blocked_by=moved} %v, want 1", n)
	}
	if n := testutil.ToFloat64(p.sh.metrics.decision("shed")); n != 1 {
		t.Errorf("decisions_total{reason=shed} %v, want 1", n)
	}
}

// TestCutAfterTheAttemptEnded: a drain's cut that lands after its attempt
// ended on its own (the upstream refused the connection) and the request
// moved on does not touch the next attempt: neither cancels it nor
// discards its response.
func TestCutAfterTheAttemptEnded(t *testing.T) {
	var first *attempt
	rr, attempts, err := moves(t, "", func(n int, w http.ResponseWriter, r *http.Request) error {
		st := requestStateOf(r)
		if n == 1 {
			first = st.current
			st.current.Cut() // cut as the attempt ends on its own
			return errors.New("dial tcp: connection refused")
		}
		first.Cut() // the same cut again, late: the request has moved on
		if err := r.Context().Err(); err != nil {
			t.Errorf("the second attempt was cancelled by the first one's cut: %v", err)
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusOK)
		_, err := w.Write([]byte(`{"id":"x","choices":[{"text":"ok"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}`))
		return err
	})
	if err != nil || attempts != 2 || rr.Code != http.StatusOK || !strings.Contains(rr.Body.String(), `"ok"`) {
		t.Fatalf("attempts %d, error %v: %d %q", attempts, err, rr.Code, rr.Body)
	}
}

// TestStaleCutDuringSelectWait: reverse_proxy retries on another upstream
// and Select waits for capacity there; a drain's cut of the first attempt
// meanwhile neither waits for Select nor cancels the retry.
func TestStaleCutDuringSelectWait(t *testing.T) {
	p, pool := testPolicy(t, zap.NewNop()), movePool()
	p.QueueTimeout = caddy.Duration(time.Minute)
	st := &requestState{req: mustParse(t, `{"model":"m","messages":[{"role":"user","content":"hi"}]}`)}
	ctx, cancel := context.WithCancelCause(context.WithValue(context.Background(), stateKey{}, st))
	defer cancel(nil)
	st.setCancel(cancel, time.Now())
	r := httptest.NewRequest("POST", "/v1/chat/completions", nil).WithContext(ctx)
	first := p.Select(pool, r, httptest.NewRecorder())
	cutFirst := st.current
	for _, u := range pool { // both close: the retry must wait
		p.sh.drains.Drain(u.Dial, time.Hour, drain.Admin)
	}
	retried := make(chan *reverseproxy.Upstream)
	go func() { retried <- p.Select(pool, r, httptest.NewRecorder()) }()
	// Once the retry has released the first attempt, it waits.
	for p.sh.drains.Phase(first.Dial) != drain.Drained {
		time.Sleep(time.Millisecond)
	}
	cutDone := make(chan struct{})
	go func() { cutFirst.Cut(); close(cutDone) }()
	select {
	case <-cutDone:
	case <-time.After(10 * time.Second):
		t.Fatal("the cut waited for Select's wait")
	}
	other := pool[0].Dial
	if other == first.Dial {
		other = pool[1].Dial
	}
	p.sh.drains.Undrain(other, drain.Admin)
	if up := <-retried; up == nil || up.Dial != other || ctx.Err() != nil {
		t.Fatalf("the retry: %v, its context %v", up, context.Cause(ctx))
	}
}

func mustParse(t *testing.T, body string) *Request {
	t.Helper()
	req, err := testParser().parse(EndpointChatCompletions, []byte(body))
	if err != nil {
		t.Fatal(err)
	}
	return req
}

// inFlightLeft counts what the fleet and the drain registry still hold.
func inFlightLeft(p *Policy) (fleet, flights int) {
	for _, s := range p.sh.fleet.Snapshot(time.Now()) {
		fleet += s.InFlight
	}
	for _, s := range p.sh.drains.Snapshot() {
		flights += s.InFlight
	}
	return fleet, flights
}

// TestRefusedContinuationEndsTheStream: a continuation the next upstream
// refuses (a 400: the prompt with the text so far is too long) is not
// spliced in; the stream ends with an error event and [DONE].
func TestRefusedContinuationEndsTheStream(t *testing.T) {
	rr, attempts, err := continued(t, func(w http.ResponseWriter, r *http.Request) error {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusBadRequest)
		_, err := w.Write([]byte(`{"error":{"message":"too long","type":"BadRequestError","param":null,"code":400}}`))
		return err
	})
	body := rr.Body.String()
	if err != nil || attempts != 2 || strings.Contains(body, "too long") || !strings.Contains(body, "answered 400") ||
		!strings.HasSuffix(body, "data: [DONE]\n\n") {
		t.Fatalf("attempts %d, error %v, body %q", attempts, err, body)
	}
}

// TestContinuationAnsweredWithoutAStreamIsCutAtOnce: a continuation
// answered 200 with a body that is not an event stream (an engine that
// ignores stream, here with JSON that never ends) is not read on: its
// attempt is cancelled as its headers come, so the proxy's copy of the
// body fails at once, and the stream ends with an error event and [DONE]
// instead of staying open for as long as the body comes.
func TestContinuationAnsweredWithoutAStreamIsCutAtOnce(t *testing.T) {
	// What the proxy would copy of the endless body before the test gives
	// up on the router cutting it: far more than nothing.
	const copies = 1000
	read := 0
	rr, attempts, err := continued(t, func(w http.ResponseWriter, r *http.Request) error {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusOK)
		// The proxy copies the body until its read fails, as it does once
		// the attempt's context is cancelled.
		for ; r.Context().Err() == nil; read++ {
			if read == copies {
				return nil // the body ended, so that the test does not hang
			}
			w.Write([]byte(`{"id":"c2","object":"chat.completion","choices":[{"index":0,"message":{"content":"endless `))
		}
		panic(http.ErrAbortHandler)
	})
	body := rr.Body.String()
	if read != 0 {
		t.Errorf("the proxy copied %d pieces of the continuation's answer; want it cut as its headers came", read)
	}
	if err != nil || attempts != 2 || !strings.HasPrefix(body, sseChunk) || strings.Contains(body, "endless") ||
		!strings.Contains(body, "the continuation's upstream answered 200") || !strings.HasSuffix(body, "data: [DONE]\n\n") {
		t.Fatalf("attempts %d, error %v, body %q", attempts, err, body)
	}
}

// TestToolStreamsAreNotContinued: a stream of a request that offers tools
// (it may have been calling one) or asks for several choices is not
// rebuilt from its text; it ends with an error event and [DONE].
func TestToolStreamsAreNotContinued(t *testing.T) {
	for _, extra := range []string{`"tools":[{"type":"function","function":{"name":"f"}}],`, `"n":2,`} {
		rr, attempts, _ := moves(t, `"stream":true,`+extra, func(_ int, w http.ResponseWriter, _ *http.Request) error {
			startStream(w)
			panic(http.ErrAbortHandler)
		})
		body := rr.Body.String()
		if attempts != 1 || !strings.Contains(body, "cannot be continued") || !strings.HasSuffix(body, "data: [DONE]\n\n") {
			t.Fatalf("%s: attempts %d, body %q", extra, attempts, body)
		}
	}
}

// TestCutInsideAnEventSplicesWholeEvents: an upstream that dies in the
// middle of an event (its start already written) leaves the client only
// whole events: the partial one is never sent, and the continuation's
// events follow the last whole one, each valid JSON.
func TestCutInsideAnEventSplicesWholeEvents(t *testing.T) {
	rr, attempts, err := moves(t, `"stream":true,`, func(n int, w http.ResponseWriter, _ *http.Request) error {
		if n == 1 {
			startStream(w)
			w.Write([]byte(`data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"co`))
			panic(http.ErrAbortHandler) // died in the middle of the event
		}
		w.Header().Set("Content-Type", "text/event-stream")
		w.WriteHeader(http.StatusOK)
		w.Write([]byte(`data: {"id":"c2","object":"chat.completion.chunk","created":2,"model":"m","choices":[{"index":0,"delta":{"content":" there"},"finish_reason":"stop"}]}` + "\n\n"))
		_, err := w.Write([]byte("data: [DONE]\n\n"))
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	events := strings.Split(strings.TrimSuffix(rr.Body.String(), "\n\n"), "\n\n")
	if attempts != 2 || len(events) != 3 || events[2] != "data: [DONE]" {
		t.Fatalf("attempts %d, events %q", attempts, events)
	}
	for _, ev := range events[:2] {
		var chunk struct{ ID string }
		if err := json.Unmarshal([]byte(strings.TrimPrefix(ev, "data: ")), &chunk); err != nil || chunk.ID != "c1" {
			t.Fatalf("event %q: id %q, %v", ev, chunk.ID, err)
		}
	}
}

// TestContinuationReadsWhatTheParserReads: the continuation reads the
// body as the parser does. A lax n ("2", 2.0: several choices) is not
// continued as one; a lax max_tokens ("7", 7.0) is cut by what was
// generated; a body after a byte order mark is continued.
func TestContinuationReadsWhatTheParserReads(t *testing.T) {
	breaks := func(n int, w http.ResponseWriter, r *http.Request) error {
		startStream(w)
		panic(http.ErrAbortHandler)
	}
	for _, n := range []string{`"2"`, `2.0`} {
		rr, attempts, _, _ := movesBody(t, `{"model":"m","stream":true,"n":`+n+`,"messages":[{"role":"user","content":"hello there"}],"max_tokens":7}`, breaks)
		if attempts != 1 || !strings.Contains(rr.Body.String(), "cannot be continued") {
			t.Errorf("n %s: %d attempts, body %q; want 1, not continued", n, attempts, rr.Body)
		}
	}
	for _, maxTokens := range []string{`"7"`, `7.0`, `7`} {
		var second []byte
		movesBody(t, `{"model":"m","stream":true,"messages":[{"role":"user","content":"hello there"}],"max_tokens":`+maxTokens+`}`,
			func(n int, w http.ResponseWriter, r *http.Request) error {
				if n == 1 {
					return breaks(n, w, r)
				}
				second, _ = io.ReadAll(r.Body)
				startStream(w)
				_, err := w.Write([]byte("data: [DONE]\n\n"))
				return err
			})
		var body struct {
			MaxTokens json.RawMessage `json:"max_tokens"`
		}
		if json.Unmarshal(second, &body) != nil || string(body.MaxTokens) != "6" {
			t.Errorf("max_tokens %s: the continuation asks for %s, want 6", maxTokens, body.MaxTokens)
		}
	}
	_, attempts, _, _ := movesBody(t, "\xef\xbb\xbf"+`{"model":"m","stream":true,"messages":[{"role":"user","content":"hello there"}],"max_tokens":7}`,
		func(n int, w http.ResponseWriter, r *http.Request) error {
			if n == 1 {
				return breaks(n, w, r)
			}
			startStream(w)
			_, err := w.Write([]byte("data: [DONE]\n\n"))
			return err
		})
	if attempts != 2 {
		t.Errorf("a body after a byte order mark: %d attempts, want 2", attempts)
	}
}

// TestMovedTwiceCountsContinued: a stream moved twice, the second time
// with nothing left to generate, ends cleanly: both moves count as
// continued.
func TestMovedTwiceCountsContinued(t *testing.T) {
	_, _, p, _ := movesBody(t, `{"model":"m","stream":true,"messages":[{"role":"user","content":"hello there"}],"max_tokens":3}`,
		func(n int, w http.ResponseWriter, _ *http.Request) error {
			if n == 1 {
				startStream(w)
				panic(http.ErrAbortHandler)
			}
			w.Header().Set("Content-Type", "text/event-stream")
			w.WriteHeader(http.StatusOK)
			for range 5 {
				w.Write([]byte(sseChunk))
			}
			panic(http.ErrAbortHandler)
		})
	m := p.sh.metrics.movedRequests
	if continued, cut := testutil.ToFloat64(m.WithLabelValues("upstream_error", "continued")), testutil.ToFloat64(m.WithLabelValues("upstream_error", "cut")); continued != 2 || cut != 0 {
		t.Errorf("continued %v, cut %v; want 2 and 0", continued, cut)
	}
}

// TestAnswersExplained: with explain_header, a request the router answers
// itself says so in X-LLM-Affinity, also after a failed attempt (whose
// explanation used to stay on the 503), and the prompt length in the
// header, the placeholder and a too-long refusal's message is one figure.
func TestAnswersExplained(t *testing.T) {
	p, h, pool := testPolicy(t, zap.NewNop()), moveHandler(), movePool()
	p.hardwareByDial = map[string]router.Hardware{}
	for _, u := range pool {
		p.hardwareByDial[u.Dial] = router.Hardware{KVCapacityTokens: 1000}
	}
	serve := func(body string, failFirst func()) (*httptest.ResponseRecorder, *caddy.Replacer) {
		t.Helper()
		r := moveRequest(body)
		repl := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
		next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
			up := p.Select(pool, r, w)
			if up != nil && failFirst != nil {
				failFirst() // the attempt fails; the proxy asks again
				up = p.Select(pool, r, w)
			}
			if up == nil {
				return caddyhttp.Error(http.StatusServiceUnavailable, errors.New("no upstreams available"))
			}
			// An engine counting 2 bytes a token, as for code or CJK.
			tokens := requestStateOf(r).req.PromptBytes / 2
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusOK)
			fmt.Fprintf(w, `{"id":"c","object":"chat.completion","choices":[],"usage":{"prompt_tokens":%d,"completion_tokens":2,"total_tokens":%d}}`, tokens, tokens+2)
			return nil
		})
		rr := httptest.NewRecorder()
		if err := h.ServeHTTP(rr, r, next); err != nil {
			t.Fatal(err)
		}
		return rr, repl
	}
	placeholder := func(repl *caddy.Replacer, name string) string {
		v, _ := repl.GetString("http.llm_affinity." + name)
		return v
	}

	rr, repl := serve(`{"model":"m","messages":[{"role":"user","content":"hello there"}],"max_tokens":7}`, func() {
		for _, u := range pool {
			p.sh.drains.Drain(u.Dial, time.Hour, drain.Admin)
		}
	})
	want := fmt.Sprintf("reason=shed; blocked_by=%s; prompt=%s; attempt=2", placeholder(repl, "blocked_by"), placeholder(repl, "prompt_tokens"))
	if rr.Code != http.StatusServiceUnavailable || rr.Header().Get(explainHeader) != want || placeholder(repl, "blocked_by") == "" {
		t.Errorf("shed after a failed attempt: %d, explanation %q, want %q", rr.Code, rr.Header().Get(explainHeader), want)
	}
	for _, u := range pool {
		p.sh.drains.Undrain(u.Dial, drain.Admin)
	}

	// The engines' usage teaches the model's bytes per token; a refusal
	// then says the learned count, everywhere.
	for i := range 3 {
		if rr, _ := serve(fmt.Sprintf(`{"model":"m","messages":[{"role":"user","content":"turn %d %s"}],"max_tokens":7}`, i, strings.Repeat("x", 1200)), nil); rr.Code != http.StatusOK {
			t.Fatalf("teaching request: %d %s", rr.Code, rr.Body)
		}
	}
	rr, repl = serve(`{"model":"m","messages":[{"role":"user","content":"`+strings.Repeat("many words ", 2000)+`"}],"max_tokens":7}`, nil)
	prompt := placeholder(repl, "prompt_tokens")
	want = fmt.Sprintf("reason=refused; blocked_by=context_length; prompt=%s; attempt=1", prompt)
	var answer struct {
		Error struct{ Message string } `json:"error"`
	}
	json.Unmarshal(rr.Body.Bytes(), &answer)
	if parsed, _ := strconv.Atoi(prompt); parsed < 10_000 {
		t.Errorf("the refusal's prompt %s tokens is not the learned count (22,000 bytes at 2 a token)", prompt)
	}
	if rr.Code != http.StatusBadRequest || rr.Header().Get(explainHeader) != want || !strings.Contains(answer.Error.Message, prompt) {
		t.Errorf("too long: %d, explanation %q, want %q; message %q", rr.Code, rr.Header().Get(explainHeader), want, answer.Error.Message)
	}
}

// TestAdapterRefusedIsNotResident: an upstream that answered 404 for an
// adapter is not presumed to hold it afterwards (the adapter's next
// requests followed the first there, each to a 404).
func TestAdapterRefusedIsNotResident(t *testing.T) {
	_, _, p, err := movesBody(t, `{"model":"tenant-a","messages":[{"role":"user","content":"hi"}],"max_tokens":2}`,
		func(_ int, w http.ResponseWriter, r *http.Request) error {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusNotFound)
			w.Write([]byte(`{"error":{"message":"The model tenant-a does not exist.","type":"NotFoundError","param":null,"code":404}}`))
			return nil
		}, func(p *Policy) { p.opts.Adapters = map[string]bool{"tenant-a": true} })
	if err != nil {
		t.Fatal(err)
	}
	for _, u := range p.sh.fleet.Snapshot(time.Now()) {
		if slices.Contains(u.Adapters, "tenant-a") {
			t.Fatalf("%s presumed to hold tenant-a after its 404", u.Dial)
		}
	}
}

// TestContinuationFollowsWhatTheClientGot: a token whose event was cut
// before its end (its line came, the blank line after it did not) was
// held back, so the client never got it: the continuation asks for the
// text the client has, not that token too, and counts it once.
func TestContinuationFollowsWhatTheClientGot(t *testing.T) {
	const partial = "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" lost\"}}]}\n"
	var continued string
	rr, attempts, err := moves(t, `"stream":true,`, func(n int, w http.ResponseWriter, r *http.Request) error {
		if n == 1 {
			startStream(w) // "Hi"
			w.Write([]byte(partial))
			panic(http.ErrAbortHandler) // the upstream died before the event's end
		}
		b, _ := io.ReadAll(r.Body)
		continued = string(b)
		w.Header().Set("Content-Type", "text/event-stream")
		w.WriteHeader(http.StatusOK)
		w.Write([]byte(strings.Replace(sseChunk, `"Hi"`, `" again"`, 1) + "data: [DONE]\n\n"))
		return nil
	})
	if err != nil || attempts != 2 {
		t.Fatalf("attempts %d, error %v", attempts, err)
	}
	if !strings.Contains(continued, `"content":"Hi"`) || strings.Contains(continued, "lost") {
		t.Errorf("the continuation asked for %s, want the text the client got (Hi)", continued)
	}
	if body := rr.Body.String(); strings.Contains(body, "lost") || !strings.Contains(body, `" again"`) {
		t.Errorf("the client got %q", body)
	}
}

// continuedBody serves body to path, its first attempt writing first (a
// stream's events) and dying, its second answering with second (events,
// after the headers); it returns what the client got and the body the
// second attempt was sent, "" when there was none.
func continuedBody(t *testing.T, path, body, first, second string) (got, continued string) {
	t.Helper()
	rr, _, _, err := movesTo(t, path, body, func(n int, w http.ResponseWriter, r *http.Request) error {
		w.Header().Set("Content-Type", "text/event-stream")
		w.WriteHeader(http.StatusOK)
		if n == 1 {
			w.Write([]byte(first))
			panic(http.ErrAbortHandler) // the upstream died mid-stream
		}
		b, _ := io.ReadAll(r.Body)
		continued = string(b)
		_, err := w.Write([]byte(second))
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return rr.Body.String(), continued
}

// completionEvent is a streamed completion's event with text.
func completionEvent(text string) string {
	return `data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":` + strconv.Quote(text) + `,"logprobs":null,"finish_reason":null}]}` + "\n\n"
}

// chatEvent is a streamed chat completion's event with delta.
func chatEvent(delta string) string {
	return `data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":` + delta + `}]}` + "\n\n"
}

// TestContinuationOfAnEchoedPrompt: vLLM sends a completion's prompt
// before its text when asked to echo it. The continuation is the prompt
// and the text after the echo, without echo (the client has the prompt):
// neither the prompt nor its echo twice. A chat stream with echo, whose
// continuation vLLM would answer by sending the final message again, is
// not continued.
func TestContinuationOfAnEchoedPrompt(t *testing.T) {
	got, continued := continuedBody(t, "/v1/completions",
		`{"model":"m","prompt":"Hello world","max_tokens":8,"stream":true,"echo":true}`,
		completionEvent("Hello world w0")+completionEvent(" w1"),
		completionEvent(" w2")+"data: [DONE]\n\n")
	var req struct {
		Prompt    string
		Echo      bool
		MaxTokens int `json:"max_tokens"`
	}
	if err := json.Unmarshal([]byte(continued), &req); err != nil || req.Prompt != "Hello world w0 w1" || req.Echo || req.MaxTokens != 6 {
		t.Fatalf("the continuation asked for %s (%v); want the prompt Hello world w0 w1, no echo, 6 tokens", continued, err)
	}
	if strings.Count(got, "Hello world") != 1 || !strings.Contains(got, `" w2"`) {
		t.Errorf("the client got %q", got)
	}
	// Cut before any text: the client has no echo yet, and the
	// continuation is the request as it came.
	_, continued = continuedBody(t, "/v1/completions",
		`{"model":"m","prompt":"Hello world","max_tokens":8,"stream":true,"echo":true}`,
		completionEvent(""), completionEvent("Hello world w0")+"data: [DONE]\n\n")
	req.Echo = false
	if err := json.Unmarshal([]byte(continued), &req); err != nil || req.Prompt != "Hello world" || !req.Echo {
		t.Fatalf("cut before any text, the continuation asked for %s (%v); want the prompt as it came, with echo", continued, err)
	}
	got, continued = continuedBody(t, "/v1/chat/completions",
		`{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"echo":"yes"}`,
		chatEvent(`{"content":"Hi"}`), "")
	if continued != "" || !strings.Contains(got, "with echo cannot be continued") || !strings.HasSuffix(got, "data: [DONE]\n\n") {
		t.Errorf("a chat stream with echo: continued with %q, the client got %q", continued, got)
	}
}

// TestContinuationLowersMinTokens: min_tokens counts the output already
// generated, as max_tokens does; vLLM refuses a min_tokens over
// max_tokens, which a continuation asking for the original min_tokens
// would be.
func TestContinuationLowersMinTokens(t *testing.T) {
	_, continued := continuedBody(t, "/v1/chat/completions",
		`{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"max_tokens":8,"min_tokens":8}`,
		chatEvent(`{"content":"a"}`)+chatEvent(`{"content":"b"}`),
		chatEvent(`{"content":"c"}`)+"data: [DONE]\n\n")
	var req struct {
		MaxTokens int `json:"max_tokens"`
		MinTokens int `json:"min_tokens"`
	}
	if err := json.Unmarshal([]byte(continued), &req); err != nil || req.MaxTokens != 6 || req.MinTokens != 6 {
		t.Fatalf("the continuation asked for %s (%v); want max_tokens and min_tokens 6", continued, err)
	}
}

// TestReasoningStreamsAreNotContinued: the recorder keeps a stream's
// text, not a reasoning model's thoughts (nor a tool call's arguments):
// continued from the text alone, the engine would think again from the
// start. Such a stream ends with an error event and [DONE].
func TestReasoningStreamsAreNotContinued(t *testing.T) {
	for _, event := range []string{
		chatEvent(`{"reasoning_content":"hmm"}`),
		chatEvent(`{"reasoning":"hmm"}`),
		// A key given twice: decoded by encoding/json, not scanned.
		strings.Replace(chatEvent(`{"reasoning":"hmm"}`), `"object":`, `"object":"x","object":`, 1),
		// The thoughts' end and the answer's start in one event (an
		// event of several tokens), read either way.
		chatEvent(`{"reasoning_content":"hmm.","content":"So"}`),
		strings.Replace(chatEvent(`{"reasoning":"hmm.","content":"So"}`), `"object":`, `"object":"x","object":`, 1),
	} {
		got, continued := continuedBody(t, "/v1/chat/completions",
			`{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}`,
			chatEvent(`{"role":"assistant","content":""}`)+event+chatEvent(`{"content":"So"}`), "")
		if continued != "" || !strings.Contains(got, "reasoning or tool call deltas cannot be continued") || !strings.HasSuffix(got, "data: [DONE]\n\n") {
			t.Errorf("%s: continued with %q, the client got %q", event, continued, got)
		}
	}
}

// TestContinuationExtendsTheClientsFinalMessage: a client that has the
// engine continue its own final message (continue_final_message, a
// prefilled answer) gets it continued still: the text generated goes on
// in that message, a string or the text of its last part, not in a turn
// of its own that the chat template would open anew.
func TestContinuationExtendsTheClientsFinalMessage(t *testing.T) {
	for _, tc := range []struct{ content, want string }{
		{`"{\"name\": \""`, `"{\"name\": \"Ada\""`},
		{`[{"type":"text","text":"{"}]`, `[{"text":"{Ada\"","type":"text"}]`},
	} {
		_, continued := continuedBody(t, "/v1/chat/completions",
			`{"model":"m","messages":[{"role":"user","content":"JSON"},{"role":"assistant","content":`+tc.content+`}],"continue_final_message":true,"add_generation_prompt":false,"stream":true}`,
			chatEvent(`{"content":"Ada"}`)+chatEvent(`{"content":"\""}`),
			chatEvent(`{"content":"}"}`)+"data: [DONE]\n\n")
		var req struct{ Messages []map[string]json.RawMessage }
		if err := json.Unmarshal([]byte(continued), &req); err != nil || len(req.Messages) != 2 {
			t.Fatalf("%s: the continuation asked for %s (%v); want the same two messages", tc.content, continued, err)
		}
		if got := string(req.Messages[1]["content"]); got != tc.want {
			t.Errorf("%s: the final message's content is %s, want %s", tc.content, got, tc.want)
		}
	}
	got, continued := continuedBody(t, "/v1/chat/completions",
		`{"model":"m","messages":[{"role":"user","content":"describe"},{"role":"assistant","content":[{"type":"image_url","image_url":{"url":"data:,"}}]}],"continue_final_message":true,"add_generation_prompt":false,"stream":true}`,
		chatEvent(`{"content":"It"}`), "")
	if continued != "" || !strings.Contains(got, "does not end with text") {
		t.Errorf("a final message ending with an image: continued with %q, the client got %q", continued, got)
	}
}

// TestSplicedUsageKeepsItsDetails: the usage of a continued stream counts
// the client's prompt and the whole output; the cached tokens, counted by
// the continuation's engine over a prompt that held the text generated
// before, are at most the client's prompt, and the usage's other members
// pass on.
func TestSplicedUsageKeepsItsDetails(t *testing.T) {
	got, _ := continuedBody(t, "/v1/chat/completions",
		`{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true}}`,
		chatEvent(`{"content":"a"}`)+chatEvent(`{"content":"b"}`),
		chatEvent(`{"content":"c"}`)+
			`data: {"id":"c2","object":"chat.completion.chunk","created":2,"model":"m","choices":[],"usage":{"prompt_tokens":12,"completion_tokens":1,"total_tokens":13,"prompt_tokens_details":{"cached_tokens":12},"completion_tokens_details":{"reasoning_tokens":0}}}`+"\n\n"+
			"data: [DONE]\n\n")
	var u struct {
		PromptTokens        int `json:"prompt_tokens"`
		CompletionTokens    int `json:"completion_tokens"`
		TotalTokens         int `json:"total_tokens"`
		PromptTokensDetails struct {
			CachedTokens int `json:"cached_tokens"`
		} `json:"prompt_tokens_details"`
		CompletionTokensDetails *struct {
			ReasoningTokens int `json:"reasoning_tokens"`
		} `json:"completion_tokens_details"`
	}
	clientUsage(t, got, &u)
	if u.PromptTokens != 10 || u.CompletionTokens != 3 || u.TotalTokens != 13 || u.PromptTokensDetails.CachedTokens != 10 || u.CompletionTokensDetails == nil {
		t.Errorf("usage %+v; want 10 prompt (2 of the 12 were generated), 3 completion, 10 cached, the completion details kept", u)
	}
}

// clientUsage decodes into u the usage in got, a stream the client got.
func clientUsage(t *testing.T, got string, u any) {
	t.Helper()
	i := strings.Index(got, `"usage":`)
	if i < 0 {
		t.Fatalf("no usage in %q", got)
	}
	if err := json.NewDecoder(strings.NewReader(got[i+len(`"usage":`):])).Decode(u); err != nil {
		t.Fatal(err)
	}
}

// TestSplicedUsageSaturates: a continued stream's usage adds the tokens
// generated before the cut (here 2) to the continuation's completion and
// takes them from its prompt. An engine's absurd count near the int's
// range saturates there instead of wrapping round: the client got a
// negative completion or total, and a prompt far below zero came out
// huge. (The router learns nothing from such a count, over
// router.MaxTokens, as from the same report on a stream not continued.)
func TestSplicedUsageSaturates(t *testing.T) {
	for _, tc := range []struct {
		usage                     string
		prompt, completion, total int64
	}{
		{`{"prompt_tokens":12,"completion_tokens":9223372036854775806,"total_tokens":9223372036854775807}`, 10, math.MaxInt64, math.MaxInt64},
		{`{"prompt_tokens":9223372036854775807,"completion_tokens":1,"total_tokens":9223372036854775807}`, math.MaxInt64 - 2, 3, math.MaxInt64},
		{`{"prompt_tokens":-9223372036854775808,"completion_tokens":1,"total_tokens":1}`, 0, 3, 3},
		{`{"prompt_tokens":12,"completion_tokens":1,"total_tokens":13}`, 10, 3, 13},
	} {
		got, _ := continuedBody(t, "/v1/chat/completions",
			`{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"stream_options":{"include_usage":true}}`,
			chatEvent(`{"content":"a"}`)+chatEvent(`{"content":"b"}`),
			chatEvent(`{"content":"c"}`)+
				`data: {"id":"c2","object":"chat.completion.chunk","created":2,"model":"m","choices":[],"usage":`+tc.usage+`}`+"\n\n"+
				"data: [DONE]\n\n")
		var u struct {
			PromptTokens     int64 `json:"prompt_tokens"`
			CompletionTokens int64 `json:"completion_tokens"`
			TotalTokens      int64 `json:"total_tokens"`
		}
		clientUsage(t, got, &u)
		if u.PromptTokens != tc.prompt || u.CompletionTokens != tc.completion || u.TotalTokens != tc.total {
			t.Errorf("the engine's usage %s: the client got %+v; want prompt %d, completion %d, total %d",
				tc.usage, u, tc.prompt, tc.completion, tc.total)
		}
	}
}

// TestStructuredStreamsAreNotContinued: an engine constraining output to a
// format starts its grammar anew on a continuation's output, after text
// that began the format already: such a stream ends with an error event
// and [DONE]. A response_format of plain text constrains nothing.
func TestStructuredStreamsAreNotContinued(t *testing.T) {
	for _, extra := range []string{
		`"response_format":{"type":"json_object"},`,
		`"response_format":{"type":"json_schema","json_schema":{"name":"x","schema":{}}},`,
		`"structured_outputs":{"choice":["a","b"]},`,
		`"guided_json":{"type":"object"},`,
		`"guided_regex":"[a-z]+",`,
	} {
		got, continued := continuedBody(t, "/v1/chat/completions",
			`{"model":"m",`+extra+`"messages":[{"role":"user","content":"hi"}],"stream":true}`,
			chatEvent(`{"content":"{"}`), "")
		if continued != "" || !strings.Contains(got, "structured output cannot be continued") || !strings.HasSuffix(got, "data: [DONE]\n\n") {
			t.Errorf("%s: continued with %q, the client got %q", extra, continued, got)
		}
	}
	_, continued := continuedBody(t, "/v1/chat/completions",
		`{"model":"m","response_format":{"type":"text"},"guided_json":null,"messages":[{"role":"user","content":"hi"}],"stream":true}`,
		chatEvent(`{"content":"Hi"}`), chatEvent(`{"content":" there"}`)+"data: [DONE]\n\n")
	if continued == "" {
		t.Error("a stream with response_format text was not continued")
	}
}

// FuzzExtendContent: whatever the final message, extendContent either
// refuses it or returns a JSON object whose content is the message's
// content with text at the end: the string, or the last text part's.
func FuzzExtendContent(f *testing.F) {
	for _, msg := range []string{
		`{"role":"assistant","content":"{\"a\": "}`,
		`{"role":"assistant","content":[{"type":"text","text":"x"}]}`,
		`{"role":"assistant","content":[{"type":"image_url","image_url":{"url":"u"}}]}`,
		`{"role":"assistant","content":null}`,
		`{"role":"assistant"}`,
		`{"content":7}`, `[]`, `null`, `"x"`, `{"content":[]}`,
	} {
		f.Add([]byte(msg), "more")
	}
	f.Fuzz(func(t *testing.T, msg []byte, text string) {
		out, err := extendContent(msg, text)
		if err != nil {
			return
		}
		var m map[string]json.RawMessage
		if json.Unmarshal(out, &m) != nil {
			t.Fatalf("not an object: %s", out)
		}
		var before map[string]json.RawMessage
		if json.Unmarshal(msg, &before) != nil {
			t.Fatalf("extended a message that is not an object: %q", msg)
		}
		// Text as encoding/json would read it back (invalid UTF-8 is
		// replaced).
		var want string
		json.Unmarshal(mustJSON(text), &want)
		var s string
		if json.Unmarshal(m["content"], &s) == nil {
			var was string
			json.Unmarshal(before["content"], &was)
			if s != was+want {
				t.Fatalf("content %q, want %q + %q", s, was, want)
			}
			return
		}
		var parts []struct {
			Type, Text string
		}
		if json.Unmarshal(m["content"], &parts) != nil || len(parts) == 0 || parts[len(parts)-1].Type != "text" ||
			!strings.HasSuffix(parts[len(parts)-1].Text, want) {
			t.Fatalf("content %s does not end with the text part %q", m["content"], want)
		}
	})
}

// TestContinuationOfACompletionWithoutMaxTokens: vLLM generates 16 tokens
// for a completion that gives no max_tokens; its continuation asks for
// what is left of them, not 16 more.
func TestContinuationOfACompletionWithoutMaxTokens(t *testing.T) {
	_, continued := continuedBody(t, "/v1/completions",
		`{"model":"m","prompt":"Hello","stream":true}`,
		completionEvent(" a")+completionEvent(" b"), completionEvent(" c")+"data: [DONE]\n\n")
	var req struct {
		MaxTokens int `json:"max_tokens"`
	}
	if err := json.Unmarshal([]byte(continued), &req); err != nil || req.MaxTokens != 14 {
		t.Fatalf("the continuation asked for %s (%v); want max_tokens 14", continued, err)
	}
	_, continued = continuedBody(t, "/v1/chat/completions",
		`{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}`,
		chatEvent(`{"content":"a"}`), chatEvent(`{"content":"b"}`)+"data: [DONE]\n\n")
	if strings.Contains(continued, "max_tokens") {
		t.Errorf("a chat continuation asked for %s; a chat request without max_tokens has no such default", continued)
	}
}

// TestContinuationOfPromptForms: a completion's prompt given as a list of
// one text is continued as one; token ids (the text generated would have
// to be token ids, which only the engine's tokenizer gives) and several
// prompts are not, and their streams end with an error event.
func TestContinuationOfPromptForms(t *testing.T) {
	_, continued := continuedBody(t, "/v1/completions",
		`{"model":"m","prompt":["Hello"],"max_tokens":8,"stream":true}`,
		completionEvent(" a"), completionEvent(" b")+"data: [DONE]\n\n")
	var req struct{ Prompt []string }
	if err := json.Unmarshal([]byte(continued), &req); err != nil || !slices.Equal(req.Prompt, []string{"Hello a"}) {
		t.Fatalf("a list of one text: the continuation asked for %s (%v); want the prompt [Hello a]", continued, err)
	}
	for _, prompt := range []string{`[1,2,3]`, `[[1,2],[3]]`, `["a","b"]`} {
		got, continued := continuedBody(t, "/v1/completions",
			`{"model":"m","prompt":`+prompt+`,"max_tokens":8,"stream":true}`, completionEvent(" a"), "")
		if continued != "" || !strings.Contains(got, "only a text prompt can be continued") || !strings.HasSuffix(got, "data: [DONE]\n\n") {
			t.Errorf("prompt %s: continued with %q, the client got %q", prompt, continued, got)
		}
	}
}

// TestUpstreamLoss: only an upstream gone before answering sends a
// request again: refused (nothing listens: the request reached no engine)
// or dropped (its connection closed or reset); a timeout, the client's
// leaving or another failure does not.
func TestUpstreamLoss(t *testing.T) {
	for _, tc := range []struct {
		name             string
		err              error
		refused, dropped bool
	}{
		{"refused", caddyhttp.Error(http.StatusBadGateway, reverseproxy.NewDialError(syscall.ECONNREFUSED)), true, false},
		{"refused, wrapped", caddyhttp.Error(http.StatusBadGateway, &net.OpError{Op: "dial", Err: os.NewSyscallError("connect", syscall.ECONNREFUSED)}), true, false},
		{"closed", caddyhttp.Error(http.StatusBadGateway, io.EOF), false, true},
		{"closed mid-header", caddyhttp.Error(http.StatusBadGateway, fmt.Errorf("reading: %w", io.ErrUnexpectedEOF)), false, true},
		{"reset", caddyhttp.Error(http.StatusBadGateway, &net.OpError{Op: "read", Err: os.NewSyscallError("read", syscall.ECONNRESET)}), false, true},
		{"timeout", caddyhttp.Error(http.StatusGatewayTimeout, context.DeadlineExceeded), false, false},
		{"client gone", caddyhttp.Error(statusClientClosedRequest, context.Canceled), false, false},
		{"another failure", caddyhttp.Error(http.StatusBadGateway, errors.New("malformed HTTP response")), false, false},
		{"no upstream", caddyhttp.Error(http.StatusServiceUnavailable, errors.New("no upstreams available")), false, false},
		{"no error", nil, false, false},
	} {
		if refused, dropped := upstreamLoss(tc.err); refused != tc.refused || dropped != tc.dropped {
			t.Errorf("%s: refused %v dropped %v, want %v %v", tc.name, refused, dropped, tc.refused, tc.dropped)
		}
	}
}

// TestOnlyARefusalIsUnreached: an attempt counts as having found nothing
// listening only when its dial was refused (or, on a unix socket, found
// no socket) and it got no connection: a dial that timed out (an engine
// with a full accept queue), or the router's own want of sockets, leaves
// the engine, alive perhaps and holding a stored response, a candidate (a
// review found the first version taking any attempt without a
// connection for a refusal).
func TestOnlyARefusalIsUnreached(t *testing.T) {
	for _, tc := range []struct {
		name      string
		dialErr   error
		got       bool
		unreached bool
	}{
		{"refused", &net.OpError{Op: "dial", Err: os.NewSyscallError("connect", syscall.ECONNREFUSED)}, false, true},
		{"no unix socket", &net.OpError{Op: "dial", Err: os.NewSyscallError("connect", syscall.ENOENT)}, false, true},
		{"timed out", &net.OpError{Op: "dial", Err: os.ErrDeadlineExceeded}, false, false},
		{"no sockets left here", &net.OpError{Op: "dial", Err: os.NewSyscallError("socket", syscall.EMFILE)}, false, false},
		{"refused, then a kept-alive connection", &net.OpError{Op: "dial", Err: os.NewSyscallError("connect", syscall.ECONNREFUSED)}, true, false},
		{"connected", nil, true, false},
	} {
		var l connLog
		trace := httptrace.ContextClientTrace(l.traced(context.Background()))
		trace.ConnectDone("tcp", "127.0.0.1:1", tc.dialErr)
		if tc.got {
			trace.GotConn(httptrace.GotConnInfo{})
		}
		l.attemptEnded("a:1")
		if got := l.isUnreached("a:1"); got != tc.unreached {
			t.Errorf("%s: unreached %v, want %v", tc.name, got, tc.unreached)
		}
		l.attemptEnded("b:1") // nothing reported of this one
		if l.isUnreached("b:1") {
			t.Errorf("%s: the next attempt counted as unreached too", tc.name)
		}
	}
}

// TestOverlongStreamIsNotKeptNorContinued: a stream's text is kept, to
// continue it elsewhere, only up to max_body (the largest body the
// continuation could be); beyond it the stream is passed on but not kept,
// and, broken off, it ends with the error event instead of moving. An
// engine streaming without end grew the router's memory with every event
// (four such streams held 2.5 GB within seconds).
func TestOverlongStreamIsNotKeptNorContinued(t *testing.T) {
	const maxBody = 4 << 10
	p, pool, h := testPolicy(t, zap.NewNop()), movePool(), moveHandler()
	h.MaxBodyBytes = maxBody
	t.Cleanup(func() {
		if f, d := inFlightLeft(p); f != 0 || d != 0 {
			t.Errorf("left in flight: fleet %d, drain registry %d", f, d)
		}
	})
	text := strings.Repeat("x", 100)
	event := "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"" + text + "\"}}]}\n\n"
	const events = 2 * maxBody / 100
	attempts := 0
	var kept int
	next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		attempts++
		p.Select(pool, r, w)
		startStream(w)
		for range events {
			w.Write([]byte(event))
		}
		kept = len(requestStateOf(r).recorder.generated)
		panic(http.ErrAbortHandler) // the engine died mid-stream
	})
	rr := httptest.NewRecorder()
	if err := h.ServeHTTP(rr, moveRequest(`{"model":"m","stream":true,"messages":[{"role":"user","content":"hello there"}]}`), next); err != nil {
		t.Fatal(err)
	}
	if kept > maxBody {
		t.Errorf("%d bytes of the stream's text kept, more than max_body %d", kept, maxBody)
	}
	body := rr.Body.String()
	if attempts != 1 || strings.Count(body, text) != events || !strings.Contains(body, "cannot be continued") || !strings.HasSuffix(body, "data: [DONE]\n\n") {
		t.Errorf("%d attempts, %d of %d events passed on, body ending %q; want 1 attempt, every event, then the error event", attempts, strings.Count(body, text), events, body[max(0, len(body)-300):])
	}
}

// TestContinuationCountsReportedTokens: a stream whose chunks carry
// several tokens each and report the usage so far (vLLM with
// stream_options.continuous_usage_stats) is continued with what is left
// of max_tokens by the engine's count, not by the chunks: one chunk of
// three tokens left the continuation asking for 6 of the 7, and the
// whole stream exceeded max_tokens by two.
func TestContinuationCountsReportedTokens(t *testing.T) {
	const chunk = `data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"m",` +
		`"choices":[{"index":0,"delta":{"content":"abcdef"},"finish_reason":null}],` +
		`"usage":{"prompt_tokens":5,"completion_tokens":3,"total_tokens":8}}` + "\n\n"
	var maxTokens any
	_, attempts, err := moves(t, `"stream":true,"stream_options":{"include_usage":true,"continuous_usage_stats":true},`,
		func(n int, w http.ResponseWriter, r *http.Request) error {
			w.Header().Set("Content-Type", "text/event-stream")
			w.WriteHeader(http.StatusOK)
			if n == 1 {
				w.Write([]byte(chunk))
				panic(http.ErrAbortHandler) // the upstream died mid-stream
			}
			var body map[string]any
			if err := json.NewDecoder(r.Body).Decode(&body); err != nil {
				return err
			}
			maxTokens = body["max_tokens"]
			_, err := w.Write([]byte("data: [DONE]\n\n"))
			return err
		})
	if err != nil || attempts != 2 {
		t.Fatalf("attempts %d, error %v", attempts, err)
	}
	if maxTokens != float64(4) {
		t.Fatalf("the continuation asked for max_tokens %v, want 4 (7 less the 3 reported)", maxTokens)
	}
}

// TestMovedAttemptHasItsOwnVars: an attempt sent again after a move runs
// the proxy with a variable table of its own. Caddy's transport reads the
// request's table (caddyhttp.GetVar) on its dialing goroutine, which
// outlives an attempt given up while a connection was dialed (or one
// that went to an idle connection first); the next attempt's proxy
// writes the table (caddyhttp.SetVar in prepareRequest). Sharing one
// table is a data race, and the runtime's "concurrent map read and map
// write" ends the whole process. (Found by a stress test with -race.)
func TestMovedAttemptHasItsOwnVars(t *testing.T) {
	p, pool, h := testPolicy(t, zap.NewNop()), movePool(), moveHandler()
	vars := map[string]any{"set_before": "kept"}
	r := moveRequest(`{"model":"m","messages":[{"role":"user","content":"hello there"}],"max_tokens":7}`)
	r = r.WithContext(context.WithValue(r.Context(), caddyhttp.VarsCtxKey, vars))
	stopDial, dialed := make(chan struct{}), make(chan struct{})
	var seen []map[string]any
	n := 0
	next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		n++
		p.Select(pool, r, w)
		m, _ := r.Context().Value(caddyhttp.VarsCtxKey).(map[string]any)
		seen = append(seen, m)
		if m["set_before"] != "kept" {
			t.Errorf("attempt %d: the variables set before the handler are not there: %v", n, m)
		}
		caddyhttp.SetVar(r.Context(), "reverse_proxy.attempt", n) // as prepareRequest does
		if n == 1 {
			// A dial the transport goes on with after the attempt: it
			// reads the table until the request is done.
			ctx := r.Context()
			go func() {
				defer close(dialed)
				for {
					select {
					case <-stopDial:
						return
					default:
						_ = caddyhttp.GetVar(ctx, "reverse_proxy.attempt")
						runtime.Gosched()
					}
				}
			}()
			// The connection it went to was dropped: sent again.
			return caddyhttp.Error(http.StatusBadGateway, &net.OpError{Op: "read", Err: os.NewSyscallError("read", syscall.ECONNRESET)})
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusOK)
		_, err := io.WriteString(w, `{"id":"c","object":"chat.completion","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":2,"total_tokens":11}}`)
		return err
	})
	rr := httptest.NewRecorder()
	err := h.ServeHTTP(rr, r, next)
	close(stopDial)
	<-dialed
	if err != nil || rr.Code != http.StatusOK || n != 2 {
		t.Fatalf("%d attempts, status %d, error %v; want 2 attempts, 200", n, rr.Code, err)
	}
	if reflect.ValueOf(seen[0]).Pointer() == reflect.ValueOf(seen[1]).Pointer() {
		t.Error("the attempt sent again wrote the variable table the first attempt's dial still reads")
	}
}
