package kvsim

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"net/url"
	"path"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.uber.org/zap"
)

// ReplicaHeader is the response header naming the replica that served a request.
const ReplicaHeader = "X-Kvsim-Replica"

// maxBodyBytes caps request bodies; vLLM's own limit is far larger, but a simulator has no
// use for more than a few max-model-len prompts.
const maxBodyBytes = 64 << 20

// Faults are failures injected for tests. The zero value injects nothing.
type Faults struct {
	// Unhealthy makes /health answer 503.
	Unhealthy bool `json:"unhealthy"`
	// ErrorRate is the probability (0..1) that a generation request fails with 500.
	ErrorRate float64 `json:"error_rate"`
	// Stall stops simulated time: requests are accepted but produce nothing until unstalled.
	Stall bool `json:"stall"`
	// CutAfterTokens, when positive, closes the connection of a generation response after
	// that many tokens were written, without finishing the stream.
	CutAfterTokens int `json:"cut_after_tokens"`
}

// Validate checks f's values.
func (f Faults) Validate() error {
	if !(f.ErrorRate >= 0 && f.ErrorRate <= 1) { // NaN too
		return fmt.Errorf("error_rate must be in 0..1, got %v", f.ErrorRate)
	}
	if f.CutAfterTokens < 0 {
		return fmt.Errorf("cut_after_tokens must not be negative, got %d", f.CutAfterTokens)
	}
	return nil
}

// MaxSpeed bounds ServerConfig.Speed: beyond it simulated time, counted in
// nanoseconds, would run out within days of wall clock.
const MaxSpeed = 10_000

// Options returns f's settings, with Field pointing into f. The Caddyfile and cmd/kvsim name
// them with a fault_ (fault-) prefix.
func (f *Faults) Options() []Option {
	return []Option{
		{"unhealthy", "answer 503 on /health", &f.Unhealthy},
		{"error_rate", "probability (0..1) that a generation request fails with 500", &f.ErrorRate},
		{"stall", "accept requests but produce nothing until unstalled via POST /kvsim/faults", &f.Stall},
		{"cut_after_tokens", "close each generation response's connection after this many tokens (0: never)", &f.CutAfterTokens},
	}
}

// ServerConfig configures a [Server].
type ServerConfig struct {
	// Name is the replica name sent in the X-Kvsim-Replica header. Default "kvsim".
	Name string
	// Engine configures the simulated engine.
	Engine Config
	// Speed runs simulated time this many times faster than wall clock. Default 1.
	Speed float64
	// Faults are the initial injected faults.
	Faults Faults
	// Logger receives request-level logs (never prompt text). Default: no logs.
	Logger *zap.Logger
}

// Server serves vLLM's OpenAI-compatible HTTP API, /health and /ping, /tokenize and
// /detokenize, /metrics and kvsim's control endpoints (/kvsim/state, /kvsim/faults) in front
// of one simulated engine. It is an http.Handler; Close stops its engine driver.
type Server struct {
	name string
	// model is the base model's first served name, the one its
	// responses give; served are all of them.
	model   string
	served  []string
	cfg     Config
	tok     *Tokenizer
	driver  *Driver
	metrics *metrics
	logger  *zap.Logger
	mux     *http.ServeMux

	faultsMu sync.Mutex
	faults   Faults

	// responses are the Responses API's stored responses.
	responses responseStore

	// maxBody is maxBodyBytes, lowered by tests of the cap.
	maxBody int64
}

// NewServer builds a server and starts its engine driver.
func NewServer(sc ServerConfig) (*Server, error) {
	if !(sc.Speed >= 0 && sc.Speed <= MaxSpeed) { // NaN too
		return nil, fmt.Errorf("speed must be in 0..%d (0: 1), got %v", MaxSpeed, sc.Speed)
	}
	if err := sc.Faults.Validate(); err != nil {
		return nil, fmt.Errorf("fault_%w", err)
	}
	engine, err := NewEngine(sc.Engine)
	if err != nil {
		return nil, err
	}
	if sc.Name == "" {
		sc.Name = "kvsim"
	}
	if sc.Logger == nil {
		sc.Logger = zap.NewNop()
	}
	s := &Server{
		name:    sc.Name,
		cfg:     engine.Config(),
		tok:     engine.Tokenizer(),
		logger:  sc.Logger,
		maxBody: maxBodyBytes,
	}
	s.served = s.cfg.ServedNames()
	s.model = s.served[0]
	var m *metrics
	s.driver = NewDriver(engine, sc.Speed, func(ev Event) { m.observe(ev) })
	m = newMetrics(s.driver, s.model)
	s.metrics = m
	s.mux = http.NewServeMux()
	s.mux.HandleFunc("POST /v1/completions", s.handleGenerate(EndpointCompletions))
	s.mux.HandleFunc("POST /v1/chat/completions", s.handleGenerate(EndpointChatCompletions))
	s.mux.HandleFunc("POST /v1/responses", s.handleGenerate(EndpointResponses))
	s.mux.HandleFunc("GET /v1/responses/{id}", s.handleRetrieve)
	s.mux.HandleFunc("POST /v1/responses/{id}/cancel", s.handleCancel)
	s.mux.HandleFunc("GET /v1/models", s.handleModels)
	s.mux.HandleFunc("POST /v1/load_lora_adapter", s.handleLoadAdapter)
	s.mux.HandleFunc("POST /v1/unload_lora_adapter", s.handleUnloadAdapter)
	s.mux.HandleFunc("GET /health", s.handleHealth)
	// vLLM's /ping (SageMaker's) answers as /health, to GET and POST.
	s.mux.HandleFunc("GET /ping", s.handleHealth)
	s.mux.HandleFunc("POST /ping", s.handleHealth)
	s.mux.HandleFunc("POST /tokenize", s.handleTokenize)
	s.mux.HandleFunc("POST /detokenize", s.handleDetokenize)
	s.mux.HandleFunc("GET /version", s.handleVersion)
	// As in vLLM, /metrics itself ignores a name[] query (vLLM answers it
	// from a handler that renders everything) and the paths below it honour
	// one (vLLM's mounted Prometheus app).
	exposition := promhttp.HandlerFor(m.registry, promhttp.HandlerOpts{})
	s.mux.HandleFunc("GET /metrics", func(w http.ResponseWriter, r *http.Request) {
		r = r.Clone(r.Context())
		r.URL.RawQuery = ""
		exposition.ServeHTTP(w, r)
	})
	s.mux.Handle("GET /metrics/", exposition)
	s.mux.HandleFunc("GET /kvsim/state", s.handleState)
	s.mux.HandleFunc("GET /kvsim/faults", s.handleFaults)
	s.mux.HandleFunc("POST /kvsim/faults", s.handleFaults)
	s.SetFaults(sc.Faults)
	s.driver.Start()
	return s, nil
}

// Name returns the replica name.
func (s *Server) Name() string { return s.name }

// Driver returns the server's engine driver.
func (s *Server) Driver() *Driver { return s.driver }

// Registry returns the server's own Prometheus registry.
func (s *Server) Registry() *prometheus.Registry { return s.metrics.registry }

// Close stops the engine driver. In-flight responses stop receiving tokens.
func (s *Server) Close() error {
	s.driver.Stop()
	return nil
}

// Faults returns the injected faults.
func (s *Server) Faults() Faults {
	s.faultsMu.Lock()
	defer s.faultsMu.Unlock()
	return s.faults
}

// SetFaults replaces the injected faults.
func (s *Server) SetFaults(f Faults) {
	s.faultsMu.Lock()
	s.faults = f
	s.faultsMu.Unlock()
	s.driver.SetFrozen(f.Stall)
}

// ServeHTTP implements http.Handler.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	w.Header().Set(ReplicaHeader, s.name)
	if corsPreflight(w, r) {
		return
	}
	if !cleanPath(r.URL.Path) {
		s.noRoute(w, r, http.NotFoundHandler())
		return
	}
	if h, pattern := s.mux.Handler(r); pattern == "" {
		s.noRoute(w, r, h)
		return
	}
	s.mux.ServeHTTP(w, r) // which sets the path's wildcards, as Handler does not
}

// corsPreflight does what vLLM's CORS middleware (Starlette's, with
// vLLM's defaults: every origin, method and header allowed, no
// credentials) does ahead of the routes: a preflight (OPTIONS with Origin
// and an Access-Control-Request-Method header, empty or not) is answered
// at once, 200 "OK", or 400 "Disallowed CORS method" for a method not
// among Starlette's (compared as sent), and it reports true; any other
// request with an Origin gets Access-Control-Allow-Origin on its response,
// whatever answers it (the request's own origin, and Vary, when it carries
// cookies).
func corsPreflight(w http.ResponseWriter, r *http.Request) bool {
	origin := r.Header.Get("Origin")
	if origin == "" {
		return false
	}
	h := w.Header()
	if method, asked := r.Header["Access-Control-Request-Method"]; r.Method == http.MethodOptions && asked {
		h.Set("Access-Control-Allow-Origin", "*")
		h.Set("Access-Control-Allow-Methods", strings.Join(corsMethods, ", "))
		h.Set("Access-Control-Max-Age", "600")
		if asked := r.Header.Get("Access-Control-Request-Headers"); asked != "" {
			h.Set("Access-Control-Allow-Headers", asked)
		}
		status, text := http.StatusOK, "OK"
		if len(method) == 0 || !slices.Contains(corsMethods, method[0]) {
			status, text = http.StatusBadRequest, "Disallowed CORS method"
		}
		h.Set("Content-Type", "text/plain; charset=utf-8")
		h.Set("Content-Length", strconv.Itoa(len(text)))
		w.WriteHeader(status)
		_, _ = io.WriteString(w, text)
		return true
	}
	if r.Header.Get("Cookie") != "" {
		h.Set("Access-Control-Allow-Origin", origin)
		h.Add("Vary", "Origin")
	} else {
		h.Set("Access-Control-Allow-Origin", "*")
	}
	return false
}

// corsMethods are the methods Starlette's CORS middleware allows for "*".
var corsMethods = []string{"DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT"}

// noRoute answers a request no route takes as vLLM's server (FastAPI)
// does: 404 or 405 (with Allow) and a JSON body {"detail": ...}, where
// the mux, h, answers in plain text.
//
// Before that, as Starlette's router (redirect_slashes, on in FastAPI),
// a path that a route takes with its trailing slash added or removed,
// with any method, is redirected there: 307, which keeps the method and
// body, to the URL built from the request's Host.
func (s *Server) noRoute(w http.ResponseWriter, r *http.Request, h http.Handler) {
	if r.URL.Path != "/" {
		alt := r.Clone(r.Context())
		if p, ok := strings.CutSuffix(r.URL.Path, "/"); ok {
			alt.URL.Path = p
		} else {
			alt.URL.Path += "/"
		}
		alt.URL.RawPath = ""
		if s.routes(alt) {
			u := url.URL{Scheme: "http", Host: r.Host, Path: alt.URL.Path, RawQuery: r.URL.RawQuery}
			if r.TLS != nil {
				u.Scheme = "https"
			}
			w.Header().Set("Location", u.String())
			w.Header().Set("Content-Length", "0")
			w.WriteHeader(http.StatusTemporaryRedirect)
			return
		}
	}
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, r)
	if allow := rec.Header().Get("Allow"); allow != "" {
		w.Header().Set("Allow", allow)
	}
	writeJSON(w, rec.Code, map[string]string{"detail": http.StatusText(rec.Code)})
}

// cleanPath says p is in its clean form (no empty, . or .. segment),
// which alone Starlette's routes match: Go's mux would redirect any other
// form to it.
func cleanPath(p string) bool {
	clean := path.Clean(p)
	if strings.HasSuffix(p, "/") && clean != "/" {
		clean += "/"
	}
	return clean == p
}

// routes says a route takes r's path, with r's method or another.
func (s *Server) routes(r *http.Request) bool {
	if !cleanPath(r.URL.Path) {
		return false
	}
	h, pattern := s.mux.Handler(r)
	if pattern != "" {
		return true
	}
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, r)
	return rec.Code == http.StatusMethodNotAllowed
}

// jsonContentType reports whether a request's Content-Type is JSON as
// vLLM checks it (validate_json_request): its media type, lowercased,
// before any parameter, must be application/json; a missing one, or
// curl's -d default of application/x-www-form-urlencoded, is refused
// with 400.
func jsonContentType(contentType string) bool {
	mediaType, _, _ := strings.Cut(strings.ToLower(contentType), ";")
	return mediaType == "application/json"
}

// readJSON reads the JSON body of a route vLLM guards with
// validate_json_request (generation, /tokenize, /detokenize): its media
// type checked (see jsonContentType) and its size capped at maxBodyBytes,
// both answered with 400.
func (s *Server) readJSON(w http.ResponseWriter, r *http.Request) ([]byte, error) {
	if !jsonContentType(r.Header.Get("Content-Type")) {
		return nil, errBadRequest("Unsupported Media Type: Only 'application/json' is allowed")
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, s.maxBody))
	if err != nil {
		return nil, errBadRequestf("could not read request body: %v", err)
	}
	return body, nil
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

func writeError(w http.ResponseWriter, err error) {
	var ae *APIError
	if !errors.As(err, &ae) {
		ae = newAPIError(http.StatusInternalServerError, err.Error())
	}
	writeJSON(w, ae.Code, ae)
}

func newID(prefix string) string {
	var b [16]byte
	for i := 0; i < len(b); i += 8 {
		v := rand.Uint64()
		for j := range 8 {
			b[i+j] = byte(v >> (8 * j))
		}
	}
	return prefix + hex.EncodeToString(b[:])
}

// usage is the OpenAI usage object, with vLLM's cached-token detail.
type usage struct {
	PromptTokens        int `json:"prompt_tokens"`
	TotalTokens         int `json:"total_tokens"`
	CompletionTokens    int `json:"completion_tokens"`
	PromptTokensDetails struct {
		CachedTokens int `json:"cached_tokens"`
	} `json:"prompt_tokens_details"`
}

func (s *Server) handleGenerate(endpoint Endpoint) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		f := s.Faults()
		if f.ErrorRate > 0 && rand.Float64() < f.ErrorRate {
			writeError(w, newAPIError(http.StatusInternalServerError, "kvsim injected fault"))
			return
		}
		body, err := s.readJSON(w, r)
		if err != nil {
			writeError(w, err)
			return
		}
		p, err := ParseRequest(endpoint, body, s.tok, s.cfg.DefaultOutputTokens)
		if err != nil {
			writeError(w, err)
			return
		}
		var previous []ChatMessage
		if p.PreviousResponseID != "" {
			// Stored in this server's memory only, as in vLLM: another
			// replica does not know it.
			stored, ok := s.responses.get(p.PreviousResponseID)
			if !ok {
				writeError(w, errResponseNotFound(p.PreviousResponseID))
				return
			}
			previous = stored.msgs
			if p.Context, err = p.RenderResponses(previous); err != nil {
				writeError(w, err)
				return
			}
		}
		// As vLLM: a request naming none of the served names, or no
		// model at all, is the base model's, answered under its first
		// name; any other name is an adapter's.
		model, adapter := p.Model, p.Model
		if model == "" || slices.Contains(s.served, model) {
			model, adapter = s.model, ""
		}
		prefix := "cmpl-"
		switch endpoint {
		case EndpointChatCompletions:
			prefix = "chatcmpl-"
		case EndpointResponses:
			prefix = "resp_"
		}
		// One engine sequence of prompt: the request's own, and one for
		// each further choice or prompt (below).
		sequence := func(id string, prompt []byte) *Request {
			return &Request{ID: id, Adapter: adapter, CacheSalt: p.CacheSalt, Context: prompt,
				OutputTokens: p.OutputTokens, LengthLimited: p.LengthLimited, CapOutput: p.CapsMaxTokens}
		}
		req := sequence(newID(prefix), p.Context)
		stream, err := s.driver.Submit(req)
		if err != nil {
			writeError(w, err)
			return
		}
		// Abort is a no-op once finished; otherwise (client gone, cut) it
		// frees the blocks. A background response runs on after the answer.
		if !p.Background {
			defer s.driver.Abort(req)
		}
		s.logger.Debug("request accepted", zap.String("id", req.ID), zap.String("model", model),
			zap.Int("prompt_tokens", req.PromptTokens()), zap.Int("output_tokens", req.OutputTokens))
		rs := &responder{s: s, w: w, r: r, p: p, req: req, model: model, stream: stream,
			created: time.Now().Unix(), cutAfter: f.CutAfterTokens, previous: previous}
		// A sequence for each further choice (n > 1, vLLM's parallel
		// sampling) and each further prompt of a batch, queued and run as
		// any other; choice i*n+j is prompt i's j-th, as vLLM numbers them.
		var more []*responder
		for i, prompt := range append([][]byte{p.Context}, p.MorePrompts...) {
			for j := range p.N {
				if i == 0 && j == 0 {
					continue
				}
				child := sequence(fmt.Sprintf("%d_%s", i*p.N+j, req.ID), prompt)
				cs, err := s.driver.Submit(child)
				if err != nil {
					writeError(w, err)
					return
				}
				defer s.driver.Abort(child)
				c := *rs
				c.req, c.stream, c.furtherChoice = child, cs, j > 0
				more = append(more, &c)
			}
		}
		switch {
		case p.Background:
			rs.background()
		case endpoint == EndpointResponses && p.Stream:
			rs.streamResponse()
		case endpoint == EndpointResponses:
			rs.collectResponse()
		case p.Stream:
			rs.streamSSE(more...)
		default:
			rs.collect(more...)
		}
	}
}

// responder writes one generation response from a request's event stream.
type responder struct {
	s        *Server
	w        http.ResponseWriter
	r        *http.Request
	p        *ParsedRequest
	req      *Request
	model    string
	stream   *Stream
	created  int64
	cutAfter int
	written  int
	// previous is the stored conversation a Responses API request
	// continues.
	previous []ChatMessage
	// furtherChoice says this sequence is a prompt's second choice or
	// later (n > 1): the usage counts a prompt once.
	furtherChoice bool
	// gone ends the generation: the client's going away, or, for a
	// background response, its cancellation.
	gone <-chan struct{}
}

// next waits for the next events; false when the client went away.
func (rs *responder) next() ([]Event, bool) {
	gone := rs.gone
	if gone == nil {
		gone = rs.r.Context().Done()
	}
	select {
	case <-gone: // first: a cancelled generation takes no more events
		return nil, false
	default:
	}
	select {
	case <-gone:
		return nil, false
	case <-rs.s.driver.Done():
		return nil, false // the engine was stopped (server closed or config unloaded)
	case <-rs.stream.Ready():
		return rs.stream.Take(), true
	}
}

// cutHere counts a token written and, once the fault's CutAfterTokens
// are, cuts the connection; it reports whether it did.
func (rs *responder) cutHere() bool {
	rs.written++
	if rs.cutAfter > 0 && rs.written >= rs.cutAfter {
		rs.cut()
		return true
	}
	return false
}

// cut closes the connection abruptly, as a crashed engine would: a
// stream after what it sent, an answer not streamed with nothing written
// (vLLM sends that one whole once generated, its headers too).
func (rs *responder) cut() {
	rc := http.NewResponseController(rs.w)
	if rs.p.Stream {
		_ = rc.Flush()
	}
	if conn, _, err := rc.Hijack(); err == nil {
		_ = conn.Close()
		return
	}
	panic(http.ErrAbortHandler) // HTTP/2: net/http resets the stream without logging
}

// generate gathers the generated text until the request finishes and
// returns it with the finishing event; false when there is nothing to
// answer with (the client went away, the engine stopped, an injected cut),
// what could be said being said.
func (rs *responder) generate() ([]byte, Event, bool) {
	var text []byte
	for {
		evs, ok := rs.next()
		if !ok {
			if rs.r.Context().Err() == nil {
				writeError(rs.w, newAPIError(http.StatusServiceUnavailable, "kvsim engine stopped"))
			}
			return nil, Event{}, false
		}
		for _, ev := range evs {
			if ev.Kind == EventFinished {
				return text, ev, true
			}
			text = append(text, ev.Text...)
			if rs.cutHere() {
				return nil, Event{}, false
			}
		}
	}
}

// addUsage adds the finished sequence ev of rs to u (nil: none yet): its
// output, and its prompt unless another choice of it counted it (see
// furtherChoice).
func (rs *responder) addUsage(u *usage, ev Event) *usage {
	if u == nil {
		u = &usage{}
	}
	u.CompletionTokens += ev.GeneratedTokens
	u.TotalTokens += ev.GeneratedTokens
	if !rs.furtherChoice {
		u.PromptTokens += ev.PromptTokens
		u.TotalTokens += ev.PromptTokens
		u.PromptTokensDetails.CachedTokens += ev.CachedTokens
	}
	return u
}

// collect answers a non-streaming completion or chat completion: its
// choice, and one for each of more (the further choices of n > 1, whose
// output the usage counts too, their prompt once, as vLLM's does).
func (rs *responder) collect(more ...*responder) {
	object := "text_completion"
	if rs.p.Endpoint == EndpointChatCompletions {
		object = "chat.completion"
	}
	choices := make([]any, 0, 1+len(more))
	var u *usage
	for i, c := range append([]*responder{rs}, more...) {
		text, ev, ok := c.generate()
		if !ok {
			return
		}
		choice := map[string]any{"index": i, "logprobs": nil, "finish_reason": ev.FinishReason, "stop_reason": nil}
		if rs.p.Endpoint == EndpointChatCompletions {
			choice["message"] = map[string]any{"role": "assistant", "content": string(text), "tool_calls": []any{}}
		} else {
			choice["text"] = c.echoed() + string(text)
		}
		choices = append(choices, choice)
		u = c.addUsage(u, ev)
	}
	writeJSON(rs.w, http.StatusOK, map[string]any{
		"id": rs.req.ID, "object": object, "created": rs.created, "model": rs.model,
		"choices": choices, "usage": u,
	})
}

func (rs *responder) streamSSE(more ...*responder) {
	h := rs.w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache")
	rc := http.NewResponseController(rs.w)
	chat := rs.p.Endpoint == EndpointChatCompletions
	object := "text_completion"
	if chat {
		object = "chat.completion.chunk"
	}
	send := func(v any) bool {
		b, _ := json.Marshal(v)
		if _, err := fmt.Fprintf(rs.w, "data: %s\n\n", b); err != nil {
			return false
		}
		return rc.Flush() == nil
	}
	chunk := func(index int, text string, first bool, finish any) map[string]any {
		choice := map[string]any{"index": index, "logprobs": nil, "finish_reason": finish}
		if chat {
			delta := map[string]any{}
			if first {
				delta["role"] = "assistant"
			}
			if text != "" || first {
				delta["content"] = text
			}
			choice["delta"] = delta
		} else {
			choice["text"] = text
			choice["stop_reason"] = nil
		}
		return map[string]any{"id": rs.req.ID, "object": object, "created": rs.created, "model": rs.model, "choices": []any{choice}}
	}
	// counted gives a chunk of choice index, at ev, the usage so far when
	// the client asked for it in every chunk (continuous_usage_stats):
	// the prompt's tokens and the choice's generated (none on a chat's
	// role chunk), as vLLM counts them.
	counted := func(c map[string]any, ev Event, generated int) map[string]any {
		if rs.p.ContinuousUsage {
			c["usage"] = map[string]int{"prompt_tokens": ev.PromptTokens, "completion_tokens": generated,
				"total_tokens": ev.PromptTokens + generated}
		}
		return c
	}
	next := func() (int, []Event, bool) { evs, ok := rs.next(); return 0, evs, ok }
	if len(more) > 0 {
		next = rs.interleave(more)
	}
	all := append([]*responder{rs}, more...)
	finishSent := make([]bool, 1+len(more)) // on the chunk of the last token
	left := 1 + len(more)
	var u *usage
	for {
		index, evs, ok := next()
		if !ok {
			return
		}
		for i, ev := range evs {
			switch ev.Kind {
			case EventFirstToken, EventToken:
				if ev.Kind == EventFirstToken && chat && !send(counted(chunk(index, "", true, nil), ev, 0)) {
					return
				}
				var finish any
				if i+1 < len(evs) && evs[i+1].Kind == EventFinished {
					finish = evs[i+1].FinishReason
					finishSent[index] = true
				}
				text := string(ev.Text)
				if ev.Kind == EventFirstToken && !chat {
					text = all[index].echoed() + text
				}
				if !send(counted(chunk(index, text, false, finish), ev, ev.GeneratedTokens)) {
					return
				}
				if rs.cutHere() {
					return
				}
			case EventFinished:
				// The last token came in an earlier batch: the finish
				// reason goes in a chunk of its own, as vLLM sends it.
				if !finishSent[index] && !send(counted(chunk(index, "", false, ev.FinishReason), ev, ev.GeneratedTokens)) {
					return
				}
				u = all[index].addUsage(u, ev)
				if left--; left > 0 {
					continue
				}
				if rs.p.IncludeUsage {
					send(map[string]any{"id": rs.req.ID, "object": object, "created": rs.created,
						"model": rs.model, "choices": []any{}, "usage": u})
				}
				_, _ = io.WriteString(rs.w, "data: [DONE]\n\n")
				_ = rc.Flush()
				return
			}
		}
	}
}

// echoed is what a completion's choice text begins with: its prompt when
// the request asked for an echo (vLLM's serving_completion puts it before
// the first token's text, streamed or not), else nothing.
func (rs *responder) echoed() string {
	if !rs.p.Echo || rs.p.Endpoint != EndpointCompletions {
		return ""
	}
	return string(rs.req.Context)
}

// interleave returns the events of rs's stream and of more's (the further
// choices of n > 1) as they come, each batch with its choice's index, as
// vLLM streams parallel choices; false when the client went away or the
// engine stopped. Its goroutines end with the request.
func (rs *responder) interleave(more []*responder) func() (int, []Event, bool) {
	type batch struct {
		index int
		evs   []Event
		ok    bool
	}
	out := make(chan batch)
	done := rs.r.Context().Done()
	for i, c := range append([]*responder{rs}, more...) {
		go func() {
			for {
				evs, ok := c.next()
				select {
				case out <- batch{i, evs, ok}:
				case <-done:
					return
				}
				if !ok || slices.ContainsFunc(evs, func(ev Event) bool { return ev.Kind == EventFinished }) {
					return
				}
			}
		}()
	}
	return func() (int, []Event, bool) {
		select {
		case b := <-out:
			return b.index, b.evs, b.ok
		case <-done:
			return 0, nil, false
		}
	}
}

func (s *Server) handleModels(w http.ResponseWriter, r *http.Request) {
	var adapters []AdapterInfo
	s.driver.Do(func(e *Engine) { adapters = e.Adapters() })
	// vLLM's cards (OpenAIServingModels.show_available_models): one per
	// served name, each with the base model's path as its root; an
	// adapter's parent is the first name. ModelCard and ModelPermission
	// take their created time when built, for each request.
	now := time.Now().Unix()
	card := func(id, root string, parent, maxModelLen any) map[string]any {
		return map[string]any{
			"id": id, "object": "model", "created": now, "owned_by": "vllm",
			"root": root, "parent": parent, "max_model_len": maxModelLen,
			"permission": []any{modelPermission(now)},
		}
	}
	var data []map[string]any
	for _, name := range s.served {
		data = append(data, card(name, s.cfg.Model, nil, s.cfg.MaxModelLen))
	}
	for _, a := range adapters {
		data = append(data, card(a.Name, a.Path, s.model, nil))
	}
	writeJSON(w, http.StatusOK, map[string]any{"object": "list", "data": data})
}

// modelPermission is vLLM's ModelPermission with its defaults, the one
// each card of /v1/models carries.
func modelPermission(created int64) map[string]any {
	return map[string]any{
		"id": newID("modelperm-"), "object": "model_permission", "created": created,
		"allow_create_engine": false, "allow_sampling": true, "allow_logprobs": true,
		"allow_search_indices": false, "allow_view": true, "allow_fine_tuning": false,
		"organization": "*", "group": nil, "is_blocking": false,
	}
}

// Version is what GET /version reports as the server's version, where
// vLLM reports its release: a version of no vLLM release (a PEP 440
// local version), so that nothing mistakes kvsim for one.
const Version = "0.0.0+kvsim"

// handleVersion answers GET /version as vLLM does: {"version": ...}.
func (s *Server) handleVersion(w http.ResponseWriter, r *http.Request) {
	writeJSON(w, http.StatusOK, map[string]string{"version": Version})
}

// adapterRequest is the body of vLLM's LoadLoRAAdapterRequest and UnloadLoRAAdapterRequest.
type adapterRequest struct {
	LoraName string `json:"lora_name"`
	LoraPath string `json:"lora_path"`
	// LoadInplace replaces the weights of an adapter already loaded (a load only). A bool
	// with a default in vLLM's pydantic model, not Optional: null is refused.
	LoadInplace strictBool `json:"load_inplace"`
}

func readAdapterRequest(r *http.Request, load bool) (adapterRequest, error) {
	var ar adapterRequest
	body, err := io.ReadAll(io.LimitReader(r.Body, 1<<20))
	if err != nil {
		return ar, errBadRequest("could not read request body")
	}
	if err := json.Unmarshal(body, &ar); err != nil {
		return ar, errBadRequestf("Invalid JSON body: %v", err)
	}
	switch {
	case load && (ar.LoraName == "" || ar.LoraPath == ""):
		return ar, errInvalidUserInput("Both 'lora_name' and 'lora_path' must be provided.")
	case !load && ar.LoraName == "":
		return ar, errInvalidUserInput("'lora_name' needs to be provided to unload a LoRA adapter.")
	}
	return ar, nil
}

func (s *Server) handleLoadAdapter(w http.ResponseWriter, r *http.Request) {
	ar, err := readAdapterRequest(r, true)
	if err == nil && slices.Contains(s.served, ar.LoraName) {
		// kvsim's own refusal: vLLM would load an adapter under a served name.
		err = errAdapterLoaded(ar.LoraName)
	}
	if err == nil {
		s.driver.Do(func(e *Engine) { err = e.LoadAdapterToHost(ar.LoraName, ar.LoraPath, bool(ar.LoadInplace)) })
	}
	if err != nil {
		writeError(w, err)
		return
	}
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	_, _ = fmt.Fprintf(w, "Success: LoRA adapter '%s' added successfully.", ar.LoraName)
}

func (s *Server) handleUnloadAdapter(w http.ResponseWriter, r *http.Request) {
	ar, err := readAdapterRequest(r, false)
	if err == nil {
		s.driver.Do(func(e *Engine) { err = e.UnregisterAdapter(ar.LoraName) })
	}
	if err != nil {
		writeError(w, err)
		return
	}
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	_, _ = fmt.Fprintf(w, "Success: LoRA adapter '%s' removed successfully.", ar.LoraName)
}

func (s *Server) handleHealth(w http.ResponseWriter, r *http.Request) {
	if s.Faults().Unhealthy {
		w.WriteHeader(http.StatusServiceUnavailable)
		return
	}
	w.WriteHeader(http.StatusOK)
}

// State is the JSON of GET /kvsim/state.
type State struct {
	Name             string   `json:"name"`
	Model            string   `json:"model"`
	SimulatedSeconds float64  `json:"simulated_seconds"`
	Speed            float64  `json:"speed"`
	InFlight         int      `json:"in_flight"`
	Running          int      `json:"running"`
	Waiting          int      `json:"waiting"`
	KVCacheUsage     float64  `json:"kv_cache_usage"`
	BlockSize        int      `json:"block_size"`
	TotalBlocks      int      `json:"total_blocks"`
	UsedBlocks       int      `json:"used_blocks"`
	CachedBlocks     int      `json:"cached_blocks"`
	ReservedBlocks   int      `json:"reserved_blocks"`
	PrefixQueries    uint64   `json:"prefix_cache_queries"`
	PrefixHits       uint64   `json:"prefix_cache_hits"`
	PromptTokens     uint64   `json:"prompt_tokens"`
	GenerationTokens uint64   `json:"generation_tokens"`
	Finished         uint64   `json:"finished"`
	Aborted          uint64   `json:"aborted"`
	GPUAdapters      []string `json:"gpu_adapters"`
	HostAdapters     []string `json:"host_adapters"`
	LoadingAdapters  []string `json:"loading_adapters"`
	// AdapterStorageLoads and AdapterHostLoads count the adapter loads
	// into a GPU slot from storage and from host memory.
	AdapterStorageLoads uint64 `json:"adapter_storage_loads"`
	AdapterHostLoads    uint64 `json:"adapter_host_loads"`
	Faults              Faults `json:"faults"`
}

// State returns the server's state as served by GET /kvsim/state.
func (s *Server) State() State {
	var st Stats
	s.driver.Do(func(e *Engine) { st = e.Stats() })
	return State{
		Name: s.name, Model: s.model, SimulatedSeconds: st.Now.Seconds(), Speed: s.driver.Speed(),
		InFlight: s.driver.InFlight(), Running: st.Running, Waiting: st.Waiting,
		KVCacheUsage: st.KVCacheUsage, BlockSize: s.cfg.BlockSize, TotalBlocks: st.TotalBlocks,
		UsedBlocks: st.UsedBlocks, CachedBlocks: st.CachedBlocks, ReservedBlocks: st.ReservedBlocks,
		PrefixQueries: st.PrefixQueries, PrefixHits: st.PrefixHits, PromptTokens: st.PromptTokens,
		GenerationTokens: st.GenerationTokens, Finished: st.Finished, Aborted: st.Aborted,
		GPUAdapters: st.GPUAdapters, HostAdapters: st.HostAdapters, LoadingAdapters: st.LoadingAdapters,
		AdapterStorageLoads: st.StorageLoads, AdapterHostLoads: st.HostLoads,
		Faults: s.Faults(),
	}
}

func (s *Server) handleState(w http.ResponseWriter, r *http.Request) {
	writeJSON(w, http.StatusOK, s.State())
}

// handleFaults returns the faults (GET) or updates them (POST): fields present in the JSON
// body replace the current ones, absent fields are kept.
func (s *Server) handleFaults(w http.ResponseWriter, r *http.Request) {
	if r.Method == http.MethodPost {
		body, err := io.ReadAll(io.LimitReader(r.Body, 1<<20))
		f := s.Faults()
		if err == nil {
			// A misspelt fault must not pass for an accepted one.
			dec := json.NewDecoder(bytes.NewReader(body))
			dec.DisallowUnknownFields()
			err = dec.Decode(&f)
		}
		if err == nil {
			err = f.Validate()
		}
		if err != nil {
			writeError(w, errBadRequestf("Invalid faults: %v", err))
			return
		}
		s.SetFaults(f)
	}
	writeJSON(w, http.StatusOK, s.Faults())
}
