// Package caddyllm is the Caddy glue of llm_affinity: the handler that
// parses OpenAI-style request bodies once, and the reverse_proxy selection
// policy that routes each request to the upstream where its first token
// comes soonest by asking the decision engine (package router). The
// routing state is keyed by dial address and held in a usage pool that
// every loaded policy references, so it survives config reloads and goes
// with the last config that names it.
package caddyllm

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net"
	"net/http"
	"net/http/httptrace"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"

	"github.com/llmaffinity/caddy-llm-affinity/drain"
	"github.com/llmaffinity/caddy-llm-affinity/prefixindex"
	"github.com/llmaffinity/caddy-llm-affinity/router"
	"github.com/llmaffinity/caddy-llm-affinity/scorer"
)

func init() {
	caddy.RegisterModule(Handler{})
	caddy.RegisterModule(Policy{})
}

// stateKey is the context key under which the handler hands the parsed
// request to the selection policy. It is not a request variable: vars are
// readable as placeholders ({http.vars.*}) and by log_append, and the
// state holds the prompt.
type stateKey struct{}

// Defaults of the handler's options.
const (
	defaultMaxBodyBytes    = 32 << 20
	defaultMaxPrefixTokens = 128 << 10
)

// Handler parses OpenAI-style requests (POST .../completions and
// .../chat/completions) once: it reads the body up to a limit, puts it
// back on the request, computes the chained block hashes of the prompt and
// hands them to the llm_affinity selection policy through the request's
// context. It wraps the response writer to count the tokens streaming
// back, and releases the request's charge on the upstream when the
// response ends, also when the client goes away. Other requests pass
// through untouched. It and the policy set the {http.llm_affinity.*}
// placeholders (see placeholders.go), which carry no prompt text.
//
// A body that is not valid JSON gets 400 with an OpenAI-style error; a
// body over the limit gets 413. Prompt text is never logged.
type Handler struct {
	// BlockTokens is the number of estimated tokens per prefix block; the
	// index tracks prefixes at this granularity. Default 64.
	BlockTokens int `json:"block_tokens,omitempty"`

	// BytesPerToken is the number of prompt bytes counted as one token
	// when the prompt is text. Default 4.
	BytesPerToken int `json:"bytes_per_token,omitempty"`

	// MaxBodyBytes caps the request body the handler reads; larger bodies
	// are refused with 413. Default 32 MiB.
	MaxBodyBytes int64 `json:"max_body_bytes,omitempty"`

	// MaxPrefixTokens caps how much of a prompt is hashed, so a huge
	// prompt cannot stall the router. Default 131072.
	MaxPrefixTokens int `json:"max_prefix_tokens,omitempty"`

	// Salt is mixed into every block hash, so routes with different salts
	// never share prefixes in the index (for example, to keep two tenants'
	// identical system prompts apart). It is a fixed string.
	Salt string `json:"salt,omitempty"`

	parser *parser
	logger *zap.Logger
}

// CaddyModule returns the Caddy module information.
func (Handler) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.llm_affinity",
		New: func() caddy.Module { return new(Handler) },
	}
}

// Provision sets defaults.
func (h *Handler) Provision(ctx caddy.Context) error {
	h.logger = ctx.Logger()
	registerRunningMetrics(ctx)
	if h.BlockTokens <= 0 {
		h.BlockTokens = prefixindex.DefaultBlockTokens
	}
	if h.BytesPerToken <= 0 {
		h.BytesPerToken = prefixindex.DefaultBytesPerToken
	}
	if h.MaxBodyBytes <= 0 {
		h.MaxBodyBytes = defaultMaxBodyBytes
	}
	if h.MaxPrefixTokens <= 0 {
		h.MaxPrefixTokens = defaultMaxPrefixTokens
	}
	h.parser = newParser(prefixindex.Hasher{
		BlockTokens:   h.BlockTokens,
		BytesPerToken: h.BytesPerToken,
		MaxBlocks:     max(1, h.MaxPrefixTokens/h.BlockTokens),
	}, h.BytesPerToken, h.Salt)
	return nil
}

// Validate checks the options.
func (h *Handler) Validate() error {
	if h.BlockTokens > 1<<16 {
		return fmt.Errorf("block_tokens %d is too large", h.BlockTokens)
	}
	if h.BytesPerToken > 16 {
		return fmt.Errorf("bytes_per_token must be in 1..16, got %d", h.BytesPerToken)
	}
	if h.MaxBodyBytes > maxMaxBodyBytes {
		return fmt.Errorf("max_body %d is larger than %d (1 GiB): the router holds a request's whole body", h.MaxBodyBytes, int64(maxMaxBodyBytes))
	}
	return nil
}

// maxMaxBodyBytes bounds max_body: a body is held in memory while it is
// routed and sent.
const maxMaxBodyBytes = 1 << 30

// clientEncoding is a client's Accept-Encoding, kept while the engine is
// asked for identity.
type clientEncoding struct {
	values []string
	had    bool
}

// askIdentity asks r's engine for an uncompressed answer, returning the
// client's Accept-Encoding to restore. identity is the request's own
// one-element slice to hold the value: a handler after this one (a
// request_header replace) may change it in place.
func askIdentity(r *http.Request, identity []string) clientEncoding {
	values, had := r.Header["Accept-Encoding"]
	identity[0] = "identity"
	r.Header["Accept-Encoding"] = identity[:1]
	return clientEncoding{values, had}
}

// restore puts the client's Accept-Encoding back on r.
func (c clientEncoding) restore(r *http.Request) {
	if c.had {
		r.Header["Accept-Encoding"] = c.values
	} else {
		delete(r.Header, "Accept-Encoding")
	}
}

// encodedBody reports whether h says its message's body is compressed: a
// Content-Encoding other than identity, in any of its values.
func encodedBody(h http.Header) bool {
	// Indexed by its canonical key: Values would canonicalize it on every
	// request and every response.
	for _, v := range h["Content-Encoding"] {
		for enc := range strings.SplitSeq(v, ",") {
			if enc = strings.TrimSpace(enc); enc != "" && !strings.EqualFold(enc, "identity") {
				return true
			}
		}
	}
	return false
}

// closeUnread is for an answer given before the request's body is read
// to its end: on HTTP/1 the connection closes with it. Otherwise net/http
// reads the rest first, to keep the connection, and a client that holds
// the body back (Expect: 100-continue, or a Content-Length it never
// sends) gets no answer until Caddy's read idle timeout. HTTP/2 resets
// just the stream, and a Connection header there would end the client's
// other streams (Go sends GOAWAY).
func closeUnread(w http.ResponseWriter, r *http.Request) {
	if r.ProtoMajor == 1 {
		w.Header().Set("Connection", "close")
	}
}

// ServeHTTP implements caddyhttp.MiddlewareHandler.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	endpoint := endpointOf(r.Method, r.URL.Path)
	repl, _ := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	if endpoint == EndpointOther {
		if (r.Method == http.MethodGet || r.Method == http.MethodHead) && strings.HasSuffix(r.URL.Path, "/v1/models") {
			return serveModels(w, r, repl, next)
		}
		return h.servePassThrough(w, r, repl, next)
	}
	if !declaresJSON(r.Header) {
		// vLLM refuses such a body, however good its JSON (400,
		// "Unsupported Media Type"), before it reads the model: the
		// engine answers, where the router's own 404 or 400 would point
		// the client at another mistake first.
		return h.servePassThrough(w, r, repl, next)
	}
	if encodedBody(r.Header) {
		// Engines such as vLLM read request bodies uncompressed, and the
		// prompt must be read to be routed.
		unrouted(repl)
		closeUnread(w, r)
		writeAPIError(w, http.StatusUnsupportedMediaType, "invalid_request_error",
			fmt.Sprintf("Content-Encoding %q is not supported: send the request body uncompressed",
				strings.Join(r.Header.Values("Content-Encoding"), ", ")))
		return nil
	}
	st := newRequestState()
	body, pooled, err := h.readBody(r, st.pooled)
	st.pooled = pooled
	if err != nil {
		st.putBack() // nothing else has seen it, nor its body's buffer
		unrouted(repl)
		closeUnread(w, r)
		writeBodyError(w, err)
		return nil
	}
	// TTFT and the request's duration count from here: a client's slow
	// upload is not its upstream's time.
	st.body, st.origBody, st.arrived = body, body, time.Now()
	if err := h.parser.parseWith(&st.scratchSpace().parse, &st.parsed, endpoint, body); err != nil {
		st.putBack() // nothing else has seen it; the error quotes none of the body
		var bad errBadRequest
		errors.As(err, &bad)
		unrouted(repl)
		writeAPIErrorCode(w, http.StatusBadRequest, "invalid_request_error", http.StatusBadRequest, bad.param, err.Error())
		return nil
	}
	st.req = &st.parsed
	st.req.BlockTokens = h.BlockTokens
	if repl != nil {
		st.ph = new(placeholderValues)
		repl.Map(st.ph.placeholder)
	}
	st.setParsedPlaceholders()
	return h.serveParsed(w, r, next, st)
}

// serveParsed sends on the request st has parsed and keeps its books as
// it ends. It is ServeHTTP's but for the checks before the parse: with
// their returns apart, its deferred calls are few enough times its
// returns for the compiler to run them inline, not through the runtime's
// list of defers.
func (h *Handler) serveParsed(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler, st *requestState) error {
	body := st.body
	// Put the bytes back with a fixed length; the policy installs a fresh
	// reader on every attempt after the first, so retries resend the
	// whole body.
	r.Body = st.firstBody(body)
	r.ContentLength = int64(len(body))
	r.TransferEncoding = nil
	setContentLength(r.Header, len(body))
	// The response is read on its way back (its first token, its usage,
	// a stream to continue): the engine must not compress it. Caddy's
	// encode handler, before this one, still compresses it for a client
	// that asked. The client's header is back for the access log once
	// the proxy is done.
	//
	// The state goes back to statePool after everything else, the
	// client's header included (the request held st.identity).
	defer st.recycleAfter(r)
	defer askIdentity(r, st.identity[:]).restore(r)

	// The recorder lives in the state: one allocation for both. The state
	// reaches the policy through each attempt's context (see serve).
	rec := &st.recorder
	rec.init(w, st)
	rec.maxText = int(h.MaxBodyBytes)
	st.rec = rec
	// Bookkeeping in defer: a client abort panics with
	// http.ErrAbortHandler inside next.ServeHTTP. The request body's
	// buffer goes back with the state, or alone (see recycleAfter).
	defer rec.releaseBody()
	defer st.finish(rec)

	err := h.serve(rec, r, next, st)
	st.servedAll = true // not unwinding a panic
	if shed := st.shedInfo(); shed != nil && !rec.wroteHeader {
		if shed.explained != "" {
			w.Header().Set(explainHeader, shed.explained)
		}
		if shed.retryAfterSeconds > 0 {
			w.Header().Set("Retry-After", strconv.Itoa(shed.retryAfterSeconds))
		}
		writeAPIErrorCode(w, shed.status, cmp.Or(shed.typ, "invalid_request_error"), shed.code, shed.param, shed.message)
		return nil
	}
	return err
}

// servePassThrough proxies a request the router does not route by its
// prompt (embeddings, tokenization, scoring, a stored response, ...). A
// JSON POST body up to max_body, of a declared length or chunked, is read
// for its model, so that the policy sends it to an upstream serving that
// model, or answers 404 for one no upstream lists (see
// Policy.chooseFallback); a larger one is streamed to an upstream chosen
// without it. The policy
// registers each of its attempts with the drain registry, as it does a
// routed one's (see Policy.enterPassThrough), so a drain waits for it;
// the drain's deadline cancels it. It is not sent again from here: one
// cut before its response began is answered 503 with Retry-After, which a
// client may retry at once, on another upstream. Its placeholders, in
// repl, are pt's (see passThrough.placeholder).
func (h *Handler) servePassThrough(w http.ResponseWriter, r *http.Request, repl *caddy.Replacer, next caddyhttp.Handler) error {
	ctx, cancel := context.WithCancelCause(r.Context())
	pt := &passThrough{cancel: cancel}
	pt.writer.ResponseWriter, pt.writer.pt = w, pt
	pt.mapPlaceholders(repl)
	defer pt.end()
	defer cancel(nil)
	if r.Method == http.MethodPost && r.Body != nil && r.Body != http.NoBody && r.ContentLength != 0 &&
		r.ContentLength <= h.MaxBodyBytes && isJSON(r.Header) {
		body, whole, err := h.peekBody(r)
		if err != nil {
			closeUnread(w, r)
			writeBodyError(w, err)
			return nil
		}
		switch {
		case !whole:
		case changesAdapters(r):
			pt.unload = strings.HasSuffix(r.URL.Path, "/unload_lora_adapter")
			pt.loraName, pt.inplace = adapterCallOfBody(body)
			pt.inplace = pt.inplace && !pt.unload
		case declaresJSON(r.Header):
			// Only then: vLLM refuses any other body (400) before it
			// reads the model, which the router's 404 would hide.
			pt.model, pt.body = modelOfBody(body), body
		}
	}
	// Caddy's retry of an attempt that found nothing listening (health
	// checks, if any, have not noticed) must go to another upstream, and a
	// stored response's request must leave its home, whose engine crashed
	// with the response (see Policy.selectFallback).
	return pt.serve(w, r, r.WithContext(context.WithValue(pt.conns.traced(ctx), passThroughKey{}, pt)), next)
}

// serve runs next for a request passed through, r with the context that
// carries pt (inner), and answers for it when the proxy did not: 404 for a
// model no upstream lists, 503 with Retry-After for an attempt its
// upstream's drain deadline cut before the response began.
func (pt *passThrough) serve(w http.ResponseWriter, r, inner *http.Request, next caddyhttp.Handler) error {
	err, aborted := serveRecovering(&pt.writer, inner, next)
	if aborted && pt.models != nil && pt.models.cutOff && r.Context().Err() == nil {
		// The client has the pool's whole list: only the engine's own,
		// dropped, was cut off. Its connection carries its next request.
		return nil
	}
	if aborted {
		panic(http.ErrAbortHandler) // the proxy's, passed on
	}
	switch {
	case pt.writer.started:
	case pt.refusedBy == blockedByUTF8:
		writeAPIErrorCode(w, http.StatusBadRequest, "invalid_request_error", http.StatusBadRequest, "", invalidUTF8Message)
		return nil
	case pt.refusedBy != "":
		writeAPIErrorCode(w, http.StatusNotFound, "invalid_request_error", "model_not_found", "model", modelNotFound(pt.model))
		return nil
	}
	if pt.wasCut() && !pt.writer.started && r.Context().Err() == nil {
		w.Header().Set("Retry-After", "1")
		writeAPIErrorCode(w, http.StatusServiceUnavailable, "service_unavailable", http.StatusServiceUnavailable, "",
			"the upstream's drain deadline passed before it answered; retry")
		return nil
	}
	return err
}

// passThroughWriter is a pass-through request's response writer: it
// notes whether the response began, and keeps back the 499 Caddy's proxy
// writes for an attempt the drain deadline cancelled (the client is
// there, and gets a 503 instead).
type passThroughWriter struct {
	caddyhttp.ResponseWriterWrapper
	pt      *passThrough
	started bool
}

// WriteHeader implements http.ResponseWriter.
func (w *passThroughWriter) WriteHeader(status int) {
	if status == statusClientClosedRequest && !w.started && w.pt.wasCut() {
		return
	}
	if status >= 200 && status < 300 && !w.started {
		w.pt.mu.Lock()
		unloaded := w.pt.unloaded
		w.pt.mu.Unlock()
		if unloaded != nil {
			// Before the client hears of it: its next request for the
			// adapter must not go back there.
			unloaded()
		}
	}
	w.started = w.started || status >= 200
	w.ResponseWriterWrapper.WriteHeader(status)
}

// Write implements http.ResponseWriter.
func (w *passThroughWriter) Write(p []byte) (int, error) {
	w.started = true
	return w.ResponseWriterWrapper.Write(p)
}

// ReadFrom implements io.ReaderFrom, keeping the wrapped writer's.
func (w *passThroughWriter) ReadFrom(r io.Reader) (int64, error) {
	w.started = true
	return w.ResponseWriterWrapper.ReadFrom(r)
}

// noContinueFromEngine drops r's Expect header as the handler reads its
// body: reading sends the client its 100 Continue, if it waits for one,
// and asking the engine again would only forward the engine's as a
// second. (Indexed by its canonical key: Del would canonicalize it on
// every request.)
func noContinueFromEngine(r *http.Request) { delete(r.Header, "Expect") }

// peekBody reads r's body, of a declared length up to max_body or
// chunked, and puts back a body that sends the same bytes: the whole body,
// with its length declared, when it is within max_body (whole), else the
// bytes read followed by the rest, still streamed.
func (h *Handler) peekBody(r *http.Request) (body []byte, whole bool, err error) {
	noContinueFromEngine(r)
	if r.ContentLength > 0 {
		if body, err = readDeclared(r.Body, r.ContentLength, nil); err != nil {
			return nil, false, err
		}
	} else {
		var buf bytes.Buffer
		if _, err = buf.ReadFrom(io.LimitReader(r.Body, h.MaxBodyBytes+1)); err != nil {
			return nil, false, err
		}
		if body = buf.Bytes(); int64(len(body)) > h.MaxBodyBytes {
			r.Body = struct {
				io.Reader
				io.Closer
			}{io.MultiReader(bytes.NewReader(body), r.Body), r.Body}
			return body, false, nil
		}
	}
	r.Body.Close()
	r.Body = io.NopCloser(bytes.NewReader(body))
	r.ContentLength = int64(len(body))
	r.TransferEncoding = nil
	return body, true, nil
}

// isJSON says the request's Content-Type is JSON (or unset, as some
// clients send it).
func isJSON(h http.Header) bool {
	ct := h.Get("Content-Type")
	if ct == "" {
		return true
	}
	mt, _, err := mime.ParseMediaType(ct)
	return err == nil && (mt == "application/json" || strings.HasSuffix(mt, "+json"))
}

// declaresJSON reports whether h's Content-Type is application/json, in
// any case, its parameters aside: the only body vLLM's generation
// endpoints take (it compares what comes before the first semicolon,
// lower-cased, and so does this, without parsing the parameters). A body
// without a Content-Type counts as JSON: SGLang and other engines read it
// so (vLLM refuses it, routed or not).
func declaresJSON(h http.Header) bool {
	const mediaType = "application/json"
	values := h["Content-Type"] // canonical: no Get's canonicalization
	if len(values) == 0 {
		return true
	}
	if values[0] == mediaType {
		return true // as clients send it, compared at once
	}
	v, _, _ := strings.Cut(values[0], ";")
	return strings.EqualFold(v, mediaType)
}

// passThroughKey is the context key of a pass-through request's
// *passThrough.
type passThroughKey struct{}

// passThrough is a request the handler does not read, in flight: its
// current attempt's registration with the drain registry, and what the
// drain deadline cancels.
type passThrough struct {
	writer passThroughWriter
	cancel context.CancelCauseFunc
	// model is the body's model, "" when not read, and body the body it
	// was read from, set before the request is served. refusedBy says why
	// the policy chose no upstream for it, "" while it has not refused:
	// blockedByModel (no upstream lists the model: 404) or blockedByUTF8
	// (a body that is not UTF-8, which vLLM refuses with 400 before it
	// reads the model), set under mu (the placeholders read it).
	model     string
	body      []byte
	refusedBy string
	// loraName is the adapter a load or unload (vLLM's runtime adapter
	// API) names, "" when not read; unload says it is an unload, inplace
	// that it is a load with load_inplace (new weights for an adapter
	// loaded), and unloaded, set by the policy, takes the adapter off the
	// chosen engine's list as the engine says it unloaded it.
	loraName string
	unload   bool
	inplace  bool
	unloaded func()
	mu       sync.Mutex
	flight   drain.Flight
	// attempts counts the attempts routed; a cut is for one of them, and
	// one for an attempt the proxy has left does nothing.
	attempts int
	cut      bool
	// conns is what the transport reported of the attempts, the
	// proxy's goroutine's; lastDial is the last one's upstream (see
	// Policy.selectFallback), set under mu by enter, the placeholders
	// reading it.
	conns    connLog
	lastDial string
	// models is the writer of a GET /v1/models (see serveModels), nil
	// for any other request.
	models *modelsWriter
}

// enter registers the request's next attempt, on dial, ending the last;
// with drains nil, it only ends the last (an attempt on a draining
// upstream, which its drain does not wait for).
func (pt *passThrough) enter(drains *drain.Registry, dial string) {
	pt.mu.Lock()
	pt.attempts++
	pt.lastDial = dial
	n, last := pt.attempts, pt.flight
	pt.mu.Unlock()
	last.End()
	var f drain.Flight // none, with no registry: an attempt no drain waits for
	if drains != nil {
		f = drains.Enter(dial, drain.CutFunc(func() { pt.cutAttempt(n) }))
	}
	pt.mu.Lock()
	pt.flight = f
	pt.mu.Unlock()
}

// cutAttempt cancels the request if attempt n is still its current one.
func (pt *passThrough) cutAttempt(n int) {
	pt.mu.Lock()
	current := n == pt.attempts
	pt.cut = pt.cut || current
	pt.mu.Unlock()
	if current {
		pt.cancel(errDrainCut)
	}
}

func (pt *passThrough) wasCut() bool {
	pt.mu.Lock()
	defer pt.mu.Unlock()
	return pt.cut
}

// end ends the last attempt's registration.
func (pt *passThrough) end() {
	pt.mu.Lock()
	f := pt.flight
	pt.mu.Unlock()
	f.End()
}

// serveModels serves GET /v1/models: the policy sends it to one engine,
// as any request the router does not route, and makes the pool's list
// (see Policy.listModels), which replaces the engine's (modelsWriter).
func serveModels(w http.ResponseWriter, r *http.Request, repl *caddy.Replacer, next caddyhttp.Handler) error {
	// The engine's body is replaced, so it must come uncompressed; Caddy's
	// encode handler, before this one, compresses the list for a client
	// that asked.
	defer askIdentity(r, make([]string, 1)).restore(r)
	st := &requestState{listModels: true}
	mw := &modelsWriter{ResponseWriterWrapper: caddyhttp.ResponseWriterWrapper{ResponseWriter: w}, st: st}
	// Passed through as any request the router does not parse: a drain
	// waits for it and its deadline cuts it.
	ctx, cancel := context.WithCancelCause(r.Context())
	pt := &passThrough{cancel: cancel, models: mw}
	pt.writer.ResponseWriter, pt.writer.pt = mw, pt
	pt.mapPlaceholders(repl)
	defer pt.end()
	defer cancel(nil)
	return pt.serve(w, r, r.WithContext(&attemptContext{Context: context.WithValue(pt.conns.traced(ctx), passThroughKey{}, pt), st: st}), next)
}

// modelsWriter passes an engine's answer to GET /v1/models on with its
// body replaced by the pool's list, when the policy made one: the status
// and headers (CORS, the proxy's header_down) stay the engine's. An
// error, a body that is not JSON (not an engine's list) or one the engine
// compressed all the same goes as it is.
type modelsWriter struct {
	caddyhttp.ResponseWriterWrapper
	st                    *requestState
	wroteHeader, replaced bool
	// dropped counts the bytes of the engine's list dropped once
	// replaced; cutOff says they outgrew maxDroppedModels.
	dropped int
	cutOff  bool
}

// maxDroppedModels bounds how much of an engine's own list is read, and
// dropped, after the pool's list replaced it: the most the scraper reads
// of one (scrape's 4 MiB). The proxy reads an answer to its end, and an
// engine whose list never ended held the request for ever, and with it
// the client's connection: its next request waited behind it.
const maxDroppedModels = 4 << 20

// errModelsCutOff ends the proxy's copy of an engine's list past
// maxDroppedModels.
var errModelsCutOff = errors.New("the engine's models list is longer than any the router reads; cut off after the pool's list was sent")

// WriteHeader writes the list in place of a 200's body.
func (m *modelsWriter) WriteHeader(status int) {
	if m.wroteHeader || status < 200 {
		m.ResponseWriterWrapper.WriteHeader(status)
		return
	}
	m.wroteHeader = true
	list := m.st.modelList
	mediaType, _, _ := mime.ParseMediaType(m.Header().Get("Content-Type"))
	if status != http.StatusOK || list == nil || encodedBody(m.Header()) || mediaType != "application/json" {
		m.ResponseWriterWrapper.WriteHeader(status)
		return
	}
	m.replaced = true
	m.Header().Set("Content-Length", strconv.Itoa(len(list)))
	// The engine's validators describe its own list, not this one.
	m.Header().Del("ETag")
	m.Header().Del("Last-Modified")
	m.ResponseWriterWrapper.WriteHeader(status)
	_, _ = m.ResponseWriterWrapper.Write(list)
}

// ReadFrom copies through Write: the embedded wrapper's would write to
// the client directly (Caddy's proxy writes, but a handle_response route
// may copy).
func (m *modelsWriter) ReadFrom(r io.Reader) (int64, error) {
	return io.Copy(writerOnly{m}, r)
}

// writerOnly hides a writer's ReadFrom from io.Copy.
type writerOnly struct{ io.Writer }

// Write drops the engine's own list once replaced.
func (m *modelsWriter) Write(p []byte) (int, error) {
	if !m.wroteHeader {
		m.WriteHeader(http.StatusOK)
	}
	if m.replaced {
		if m.dropped += len(p); m.dropped > maxDroppedModels {
			m.cutOff = true
			return 0, errModelsCutOff
		}
		return len(p), nil
	}
	return m.ResponseWriterWrapper.Write(p)
}

// unrouted gives a request the handler does not route its placeholders:
// all without a value.
func unrouted(repl *caddy.Replacer) {
	if repl != nil {
		repl.Map(noPlaceholders)
	}
}

// setContentLength sets the Content-Length header to n unless it says so
// already, as it does when the client sent the length: setting it costs
// two allocations a request.
func setContentLength(h http.Header, n int) {
	var buf [20]byte
	s := strconv.AppendInt(buf[:0], int64(n), 10)
	if v := h["Content-Length"]; len(v) == 1 && v[0] == string(s) {
		return
	}
	h.Set("Content-Length", string(s))
}

// attemptContext is an attempt's context: the one a drain cut cancels,
// carrying the request's state for the policy under stateKey. One value
// serves both, so an attempt costs one copy of the request, not two.
type attemptContext struct {
	context.Context
	st *requestState
}

// Value returns the request's state for stateKey, and otherwise the
// parent's value.
func (c *attemptContext) Value(key any) any {
	if _, ok := key.(stateKey); ok {
		return c.st
	}
	return c.Context.Value(key)
}

// readBody reads the whole body up to the limit, into pb, a buffer a
// reused request state kept, or, when nil, one from bodyPool. It returns
// the buffer it read into, or pb.
func (h *Handler) readBody(r *http.Request, pb *pooledBody) ([]byte, *pooledBody, error) {
	if r.ContentLength > h.MaxBodyBytes {
		return nil, pb, &http.MaxBytesError{Limit: h.MaxBodyBytes}
	}
	if r.Body == nil {
		return nil, pb, nil
	}
	noContinueFromEngine(r)
	defer r.Body.Close()
	if pb == nil {
		pb = newPooledBody()
	}
	var err error
	if r.ContentLength > 0 {
		pb.b, err = readDeclared(r.Body, r.ContentLength, pb.b)
	} else {
		buf := bytes.NewBuffer(pb.b)
		_, err = buf.ReadFrom(http.MaxBytesReader(nil, r.Body, h.MaxBodyBytes))
		pb.b = buf.Bytes()
	}
	return pb.b, pb, err
}

// bodyPool holds the buffers of request bodies read for routing, for
// reuse: an agent sends its whole conversation, often hundreds of
// kilobytes, on every turn, and a buffer per request was most of the
// router's garbage. Caddy's reverse_proxy pools the bodies it buffers the
// same way.
var bodyPool sync.Pool // of *pooledBody

// maxPooledBody is the largest buffer bodyPool keeps, so that a rare body
// near max_body does not hold on to its memory.
const maxPooledBody = 4 << 20

// pooledBody is a request body's buffer from bodyPool.
type pooledBody struct{ b []byte }

// newPooledBody returns an empty buffer from bodyPool, or a new one.
func newPooledBody() *pooledBody {
	if pb, _ := bodyPool.Get().(*pooledBody); pb != nil {
		return pb
	}
	return new(pooledBody)
}

// release puts the buffer back in bodyPool. Only a caller that knows
// nothing reads the body any more may call it (see
// requestState.releaseBody).
func (pb *pooledBody) release() {
	if pb = pb.emptied(); pb != nil {
		bodyPool.Put(pb)
	}
}

// emptied returns pb emptied for another body, nil when it is too large to
// keep (or nil).
func (pb *pooledBody) emptied() *pooledBody {
	if pb == nil || cap(pb.b) > maxPooledBody {
		return nil
	}
	pb.b = pb.b[:0]
	return pb
}

// bodyChunk is the most memory a body gets before its bytes arrive.
const bodyChunk = 16 << 10

// readDeclared reads a body of the declared length n (the server's reader
// ends there) into buf's capacity (a pooled buffer, see bodyPool), or into
// one new buffer of that size when it is small, as nearly every body is; a
// larger one grows as its bytes arrive, so a client that declares a huge
// body and sends nothing costs no more new memory than bodyChunk (it holds
// the pooled buffer it was given for as long as it takes).
func readDeclared(body io.Reader, n int64, buf []byte) ([]byte, error) {
	if size := min(n, max(bodyChunk, int64(cap(buf)))); int64(cap(buf)) >= size {
		buf = buf[:size]
	} else {
		buf = make([]byte, size)
	}
	read := 0
	for {
		m, err := io.ReadFull(body, buf[read:])
		read += m
		if err != nil {
			return buf[:read], err
		}
		if int64(read) == n {
			return buf, nil
		}
		next := make([]byte, min(n, 2*int64(len(buf))))
		copy(next, buf)
		buf = next
	}
}

// writeBodyError answers a request whose body could not be read: 413
// for one over a limit (max_body, or Caddy's request_body ahead of the
// handler), 408 for one that did not come in time, else 400.
func writeBodyError(w http.ResponseWriter, err error) {
	var tooLarge *http.MaxBytesError
	if errors.As(err, &tooLarge) {
		writeAPIError(w, http.StatusRequestEntityTooLarge, "invalid_request_error",
			fmt.Sprintf("request body exceeds the limit of %d bytes", tooLarge.Limit))
		return
	}
	var netErr net.Error
	switch {
	case errors.As(err, &netErr) && netErr.Timeout():
		// Caddy's read_body timeout: the body did not come in time.
		writeAPIError(w, http.StatusRequestTimeout, "invalid_request_error", "the request body did not arrive in time")
	case errors.As(err, new(*net.OpError)):
		// The connection failed; its error names the sockets, which the
		// client has no use for.
		writeAPIError(w, http.StatusBadRequest, "invalid_request_error", "the connection failed while the request body was read")
	default:
		writeAPIError(w, http.StatusBadRequest, "invalid_request_error", "reading the request body: "+err.Error())
	}
}

// writeAPIError writes an OpenAI-style error body whose code is the
// status.
func writeAPIError(w http.ResponseWriter, status int, typ, msg string) {
	writeAPIErrorCode(w, status, typ, status, "", msg)
}

// writeAPIErrorCode writes an OpenAI-style error body with its code (a
// string such as "model_not_found", or a number) and the parameter at
// fault (none when empty).
func writeAPIErrorCode(w http.ResponseWriter, status int, typ string, code any, param, msg string) {
	var p any
	if param != "" {
		p = param
	}
	body, _ := json.Marshal(map[string]any{"error": map[string]any{
		"message": msg, "type": typ, "param": p, "code": code,
	}})
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(status)
	w.Write(body)
}

// requestState is one request's routing record, shared by the handler
// and the policy's Select calls (one per attempt).
type requestState struct {
	mu       sync.Mutex
	req      *Request
	body     []byte // what the next attempt sends
	origBody []byte // what the client sent
	// pooled is origBody's buffer, for bodyPool or the state's next
	// request; sent counts the attempts given the body (see releaseBody).
	pooled  *pooledBody
	sent    int
	current *attempt
	tried   []string
	// conns holds the upstreams an attempt found nothing listening at
	// (they hold nothing of this request's) and, for a request that goes
	// to its stored response's home, what the transport reported of each
	// attempt's connection.
	conns connLog
	// sh is the routing state of the policy that routed the request.
	sh   *shared
	shed *shedding
	// hold is the request's wait at the gateway while no upstream can
	// start it, nil when it does not wait.
	hold     *router.Hold
	decision decisionRecord
	// explanation is the last decision's, when debug logging is on;
	// explain says the policy sets the explanation header.
	explanation *scorer.Explanation
	explain     bool

	// cancel cuts the current attempt; cut records that a drain did.
	// cutTarget is the attempt a drain may cut: the current one until
	// the proxy leaves it (see attempt.Cut).
	cancel    context.CancelCauseFunc
	cut       bool
	cutTarget *attempt
	rec       *tokenRecorder

	// parsed, recorder, firstAttempt, firstCharge and firstReader are
	// the request as parsed, the handler's response writer, the first
	// attempt, its charge (see router.Request.Charge) and its body's
	// reader, held here to save allocations; a later attempt, a
	// continuation's request and body get their own (sent counts them).
	// firstReadCloser is firstReader as the request's body (see
	// firstBody).
	parsed          Request
	recorder        tokenRecorder
	firstAttempt    attempt
	firstCharge     router.Charge
	firstReader     bytes.Reader
	firstReadCloser io.ReadCloser
	// firstRequest is the request the first attempt is served with, its
	// context the attempt's (see Handler.serve). Nothing holds it after
	// the handler returns: the proxy sends a clone of its own, whose body
	// the policy replaces (the clone's body that Caddy's proxy makes to
	// read the request's trailers refers to this request, but no
	// transport reads it unless another policy sent it, and then sent
	// says the state is not recycled; see recycle).
	firstRequest http.Request
	// scratch is the space the request's parse and decisions work in
	// (see scratchSpace), nil until the first needs it.
	scratch *scratchSpace

	// arrived is when the handler had read the request's body;
	// sawFirstToken records that its first token was measured (a
	// continuation's is not).
	arrived       time.Time
	sawFirstToken bool
	// waitSince is when the current dispatch began, from which it may
	// wait queue_timeout to start: the arrival, or a move off a drained
	// upstream. heldSince is when the current attempt, now held at the
	// gateway, began (zero when it is not held); queued records that the
	// request was counted as held once.
	waitSince, heldSince time.Time
	queued               bool
	// ph holds the placeholders' values (see placeholder); nil when the
	// request has no replacer (the model list's state, tests').
	ph *placeholderValues
	// cutPending records that a drain deadline took one of the
	// request's attempts to cut before it ended (its Cut may still run);
	// servedAll that the handler's serve returned, rather than panicked.
	// Either keeps the state out of statePool (see recycle).
	cutPending atomic.Bool
	servedAll  bool
	// identity holds the Accept-Encoding value sent to engines (see
	// askIdentity), saving an allocation.
	identity [1]string
	// listModels marks a GET /v1/models, which the policy answers with
	// modelList, the whole pool's (see Policy.listModels).
	listModels bool
	modelList  []byte
}

// setCancel installs the function that cuts the current attempt.
// since is when the dispatch began (see waitSince).
func (st *requestState) setCancel(cancel context.CancelCauseFunc, since time.Time) {
	st.mu.Lock()
	defer st.mu.Unlock()
	st.cancel, st.cut, st.waitSince = cancel, false, since
}

// cancelAttempt cancels the current attempt with cause, if one is under
// way. Unlike a drain's cut, it moves nothing: the handler ends the
// request with what the attempt left.
func (st *requestState) cancelAttempt(cause error) {
	st.mu.Lock()
	cancel := st.cancel
	st.mu.Unlock()
	if cancel != nil {
		cancel(cause)
	}
}

// takeCut reports and clears whether a drain cut the last attempt.
func (st *requestState) takeCut() bool {
	st.mu.Lock()
	defer st.mu.Unlock()
	cut := st.cut
	st.cut, st.cancel, st.cutTarget = false, nil, nil
	if st.rec != nil {
		st.rec.discard.Store(false)
	}
	return cut
}

// replace sets the request the next attempt sends (a continuation).
func (st *requestState) replace(req *Request, body []byte) {
	st.mu.Lock()
	defer st.mu.Unlock()
	st.req, st.body = req, body
}

// decisionRecord is what the last decision said, for metrics and logs.
type decisionRecord struct {
	upstream string
	reason   string
	estimate float64
	matched  int
	// prompt is the prompt length the decision used: the parse's
	// estimate, or the engine-learned one (router.Decision.PromptTokens).
	prompt int
	// series is the upstream's and reason's latency series, resolved
	// as the decision is observed (see metrics.latencyOf).
	series seriesRef
}

// shedding is the policy's answer to a request it gave up on: for now (a
// 503 with Retry-After), or for good (no upstream serves its model, or can
// ever hold its prompt). The handler writes it as an OpenAI-style error.
type shedding struct {
	status            int
	typ               string // default invalid_request_error
	code              any    // the error's code: a string, or the status
	param             string
	message           string
	retryAfterSeconds int    // 0: no Retry-After
	reason            string // the metric label and log field
	// refused marks a request that can never succeed (404, 400), as
	// opposed to one shed for now.
	refused bool
	// explained is the X-LLM-Affinity header the answer carries (with
	// explain_header), replacing a failed attempt's; "" for none.
	explained string
}

// outcome is the answer's reason in metrics, placeholders and the
// explanation header: refused or shed.
func (s *shedding) outcome() string {
	if s.refused {
		return refusedReason
	}
	return string(scorer.Shed)
}

// explainHeader is the response header explain_header sets.
const explainHeader = "X-LLM-Affinity"

// explainAnswer is the explanation header of a request answered without
// an upstream after attempt-1 attempts: its outcome, what blocked it, and
// the prompt length the decision used.
func explainAnswer(s *shedding, prompt, attempt int) string {
	return fmt.Sprintf("reason=%s; blocked_by=%s; prompt=%d; attempt=%d", s.outcome(), s.reason, prompt, attempt)
}

// movedReason is the blocked_by of a request shed because drains moved it
// too often; notRunningReason of one no running upstream may serve.
const (
	movedReason      = "moved"
	notRunningReason = "not_running"
)

// refusedReason is the decision's reason, in metrics and placeholders, for
// a request answered at once with a client error.
const refusedReason = "refused"

// What blocked a request passed through and refused (the blocked_by
// placeholder), as the routed path's refusals say it (see Policy.Select):
// no upstream lists its model, or its body is not UTF-8 (and names no
// listed model).
const (
	blockedByModel     = "model"
	blockedByUTF8      = "invalid_utf8"
	invalidUTF8Message = "the request body is not valid UTF-8"
)

// giveUp records the answer the handler writes for a request it stops
// trying to route, and counts it as a shed (as the policy counts its own).
func (st *requestState) giveUp(answer *shedding) {
	st.mu.Lock()
	defer st.mu.Unlock()
	st.shed = answer
	st.setShedPlaceholders(answer.outcome(), answer.reason, 0)
	if st.explain {
		answer.explained = explainAnswer(answer, st.decision.prompt, len(st.tried)+1)
	}
	if st.sh != nil {
		st.sh.metrics.shed.WithLabelValues(answer.reason).Inc()
		st.sh.metrics.decision(answer.outcome()).Inc()
	}
}

func (st *requestState) shedInfo() *shedding {
	st.mu.Lock()
	defer st.mu.Unlock()
	return st.shed
}

// progress records output tokens streaming back. The request's first
// token is measured: its TTFT and, for a stream, the estimate's error and
// the admin view's recent TTFTs.
func (st *requestState) progress(n int) {
	st.mu.Lock()
	a := st.current
	first := a != nil && !st.sawFirstToken
	if first {
		st.sawFirstToken = true
	}
	dec, stream, background := st.decision, st.req.Stream, st.req.Background
	st.mu.Unlock()
	if a == nil {
		return
	}
	now := time.Now()
	a.sh.fleet.Progress(a.charge, n, now)
	// A background response's plain answer comes queued: the engine has
	// its prompt (and will prefill it), but the time says nothing of a
	// first token. (Streamed, its first text is one.)
	if first && !(background && !stream) {
		a.sh.metrics.observeFirstToken(&dec, now.Sub(st.arrived))
		if stream {
			// A non-streaming response's headers come after the whole
			// generation: no measure of the estimate.
			sinceDecision := now.Sub(a.charge.Started).Seconds()
			a.sh.metrics.observeEstimateError(&dec, sinceDecision-a.charge.Estimate)
			a.sh.metrics.recordTTFT(dec.upstream, sinceDecision, a.charge.Estimate)
		}
		st.setTTFTPlaceholder(now.Sub(st.arrived).Seconds())
	}
}

// modelNotServed says body, an engine's 404, is for the model asked for
// (vLLM's and kvsim's "The model `…` does not exist."), not for a path the
// engine lacks (an older vLLM's /v1/responses: FastAPI's "Not Found").
func modelNotServed(body []byte) bool {
	return bytes.Contains(body, []byte("does not exist"))
}

// markUnreached notes that the current attempt's upstream had nothing
// listening (see router.Member.Unreached).
func (st *requestState) markUnreached() {
	st.mu.Lock()
	defer st.mu.Unlock()
	if a := st.current; a != nil {
		st.conns.note(a.charge.Dial())
	}
}

// connLog is what the transport reported of a request's attempts, which
// Caddy's retries, asking the policy again, do not say: whether the last
// one got a connection or had its dial refused, and the upstreams where
// one found nothing listening. The trace's hooks may run on the
// transport's dialing goroutine; the rest is the request's.
type connLog struct {
	trace        *httptrace.ClientTrace
	got, refused atomic.Bool
	unreached    []string
}

// traced returns ctx with l's trace: a connection got (new or kept
// alive), or a dial refused.
func (l *connLog) traced(ctx context.Context) context.Context {
	if l.trace == nil {
		l.trace = &httptrace.ClientTrace{
			GotConn: func(httptrace.GotConnInfo) { l.got.Store(true) },
			ConnectDone: func(_, _ string, err error) {
				if errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ENOENT) { // nothing listens (a unix socket: none there)
					l.refused.Store(true)
				}
			},
		}
	}
	return httptrace.WithClientTrace(ctx, l.trace)
}

// attemptEnded notes dial ("" for none) as unreached when its attempt,
// traced, had its dial refused and got no connection, and readies l for
// the next attempt. A dial that timed out, a TLS handshake that failed,
// or the router's own want of sockets is not that: the engine may be
// alive (and, for a stored response, hold it).
func (l *connLog) attemptEnded(dial string) {
	if l.trace != nil && dial != "" && l.refused.Load() && !l.got.Load() {
		l.note(dial)
	}
	l.got.Store(false)
	l.refused.Store(false)
}

// note adds dial to the upstreams found with nothing listening.
func (l *connLog) note(dial string) {
	if !slices.Contains(l.unreached, dial) {
		l.unreached = append(l.unreached, dial)
	}
}

// isUnreached says an attempt found nothing listening at dial.
func (l *connLog) isUnreached(dial string) bool { return slices.Contains(l.unreached, dial) }

// countMove counts a request moved off its upstream (by cause) and what
// became of it.
func (st *requestState) countMove(cause, outcome string) {
	st.mu.Lock()
	sh := st.sh
	st.mu.Unlock()
	if sh != nil {
		sh.metrics.movedRequests.WithLabelValues(cause, outcome).Inc()
	}
}

// rememberResponse tells the fleet, and through it the peers, that the
// current attempt's upstream stored the Responses API response id: a
// request naming it as previous_response_id can only be answered there.
func (st *requestState) rememberResponse(id string) {
	st.mu.Lock()
	a := st.current
	st.mu.Unlock()
	st.rememberResponseOf(a, id)
}

// rememberResponseOf notes that attempt a's upstream stored the response
// id, if it answered 200 and was asked to store it.
func (st *requestState) rememberResponseOf(a *attempt, id string) {
	if a == nil || id == "" || st.rec == nil || st.rec.status != http.StatusOK || st.req.NoStore {
		return
	}
	a.sh.fleet.RememberResponse(id, a.charge.Dial())
}

// finish releases the current attempt and learns from the response.
func (st *requestState) finish(rec *tokenRecorder) {
	st.mu.Lock()
	a := st.current
	st.current = nil
	sh, dec := st.sh, st.decision
	st.mu.Unlock()
	now := time.Now()
	if sh != nil && dec.upstream != "" {
		sh.metrics.observeDuration(&dec, now.Sub(st.arrived))
	}
	if a == nil {
		return
	}
	complete := rec.status == http.StatusOK && rec.complete()
	// Also a response answered before it is done (background): its
	// engine has stored it all the same.
	st.rememberResponseOf(a, rec.responseID)
	if !complete {
		// A 404 says the upstream does not serve the model or adapter,
		// unless the request continued a stored response (the engine's
		// 404 is then for the response).
		if rec.status == http.StatusNotFound && st.req.PreviousResponseID == "" {
			a.refused(st.req.Model, modelNotServed(rec.body))
		} else {
			a.release()
		}
		return
	}
	a.endFlight()
	draining := a.sh.drains.IsDraining(a.charge.Dial())
	a.sh.metrics.observeCompletion(rec)
	usage := router.Usage{OutputTokens: rec.completionTokens()}
	// A continuation's prompt is the original one plus the text so far,
	// and its usage is rewritten to cover the whole generation: neither
	// tells the prompt's bytes per token.
	// Nor does a Responses request continuing a stored response (the
	// engine counts the stored conversation too), nor a prompt with
	// media (the engine counts the images' tokens).
	if rec.hasUsage && (rec.splice == nil || rec.splice.restart) && st.req.PreviousResponseID == "" && !st.req.Media {
		usage.PromptTokens = rec.usage.promptTokens
	}
	// An upstream no config names any more is draining too, its cause
	// "removed" (see UpstreamSnapshot.Drain).
	if removed := a.sh.fleet.Complete(a.charge, st.req.Model, usage, now); draining || removed {
		a.sh.metrics.drainCompleted.Inc()
	}
}

// releaseBody returns the body's buffer to bodyPool, for a state that is
// not reused, when no transport can be reading it any more. A
// RoundTripper may read a request's body after the round trip has
// returned (its contract), and an attempt the proxy gave up on may still
// be sending it. net/http's own transports see to it for HTTP/1 and
// HTTP/2: a response's end waits for the body's write, or the connection
// is closed; HTTP/3 upstreams are not checked. As a second guard the
// buffer goes back only after one attempt answered 2xx: an engine reads
// the whole body before it answers, so all of it was sent. (The
// recorder's status is what the client got: a handle_response route that
// turns an engine's early error into a 200 leaves only the first guard.)
// Any other request leaves its buffer to the garbage collector.
func (st *requestState) releaseBody() {
	st.mu.Lock()
	pooled, sent := st.pooled, st.sent
	st.pooled = nil
	st.mu.Unlock()
	if bodySentWhole(sent, st.rec) {
		pooled.release()
	}
}

// bodySentWhole is the rule releaseBody and recycle share: the request's
// only attempt was answered 2xx (see releaseBody for why that says no
// transport still reads its body). sent counts the attempts; rec is the
// request's recorder, nil before one was set up.
func bodySentWhole(sent int, rec *tokenRecorder) bool {
	return sent == 1 && rec != nil && rec.status >= 200 && rec.status < 300
}

// scratchSpace is the memory a request's parse and its policy's
// decisions work in, free again as each returns: it stays with the
// request's state when the state is reused, and goes back to
// scratchPool when the state does not (see recycle), so that one pool's
// Get and Put a request serve the state and the scratch alike.
type scratchSpace struct {
	parse    parseScratch
	decision decisionScratch
}

// scratchPool holds the scratch spaces of states not reused.
var scratchPool = sync.Pool{New: func() any { return new(scratchSpace) }}

// scratchSpace returns st's scratch space, taken from scratchPool when
// it has none.
func (st *requestState) scratchSpace() *scratchSpace {
	if st.scratch == nil {
		st.scratch = scratchPool.Get().(*scratchSpace)
	}
	return st.scratch
}

// statePool holds request states for reuse. The state is the largest
// allocation a routed request makes, and measured under load its garbage
// collection cost the router more than its own parse of the request.
var statePool = sync.Pool{New: func() any { return new(requestState) }}

// newRequestState returns an empty state, from statePool when it has one.
func newRequestState() *requestState { return statePool.Get().(*requestState) }

// recycleAfter ends the request's use of st, for the handler's last defer:
// r's body, a reader in st, goes, and st goes back to statePool when it
// can (see recycle).
func (st *requestState) recycleAfter(r *http.Request) {
	if !st.servedAll {
		// A panic: an attempt may be anywhere. The body's buffer goes by
		// its own rule.
		st.releaseBody()
		return
	}
	r.Body = http.NoBody
	st.recycle()
}

// recycle puts st back in statePool, emptied, when nothing can reach it
// any more; otherwise it is left to the garbage collector. What may reach
// it after the handler is done:
//   - a drain deadline's Cut of an attempt, taken before the attempt
//     ended (cutPending): the first attempt lives in st;
//   - a transport still sending the body: the first attempt's reader
//     lives in st, so the state goes back under the body buffer's own
//     rule (one attempt sent, answered 2xx; see releaseBody). A request
//     this policy never sent may have been sent by another proxy in the
//     route, whose transport may still read it (HTTP/3's sends the body
//     on a goroutine of its own), and with it the first attempt's
//     request, which Caddy's proxy refers to for its trailers;
//   - an access log's placeholders, which live apart (ph);
//   - a connection trace's hooks (conns.traced), which write into st: a
//     transport may finish a dial in the background after its request
//     ended, and run them then.
//
// Every attempt's registration has ended by then (finish, or Select on a
// retry), and its charge been completed or released: the fleet no longer
// lists the first attempt's, which lives in st. Contexts given to
// transports hold the state only for the policy's key, which no transport
// asks for. It reports whether st went back.
func (st *requestState) recycle() bool {
	if st.cutPending.Load() || st.current != nil || !bodySentWhole(st.sent, st.rec) || st.conns.trace != nil {
		// Only the request's parse and decisions, all done, used the
		// scratch space.
		if sc := st.scratch; sc != nil {
			st.scratch = nil
			scratchPool.Put(sc)
		}
		st.releaseBody()
		return false
	}
	st.putBack() // the body's buffer with it: its rule holds (bodySentWhole)
	return true
}

// putBack empties st and puts it in statePool; only a caller that knows
// nothing else can reach st may call it.
func (st *requestState) putBack() {
	st.empty()
	statePool.Put(st)
}

// empty makes st a new request's state, keeping what is its own: the
// first body's closer (it wraps st's reader), the scratch space (each
// parse and decision fills it anew), the body's buffer and the
// recorder's buffers, emptied.
func (st *requestState) empty() {
	closer, scratch, body := st.firstReadCloser, st.scratch, st.pooled.emptied()
	buffers := st.recorder.keepBuffers()
	*st = requestState{} // cleared in place: a literal with fields set is built apart and copied
	st.firstReadCloser, st.scratch, st.pooled = closer, scratch, body
	st.recorder.reuseBuffers(buffers)
}

// Interface guards
var (
	_ caddy.Provisioner           = (*Handler)(nil)
	_ caddy.Validator             = (*Handler)(nil)
	_ caddyhttp.MiddlewareHandler = (*Handler)(nil)
)
