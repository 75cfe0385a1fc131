// Package httprun is llmbench's HTTP mode: it replays a workload against a real, in-process
// Caddy in front of kvsim servers on loopback ports. Importing it sets [llmbench.HTTPRunner].
//
// Each pass (one policy) starts N fresh kvsim servers, loads a Caddy config with one site on
// a free 127.0.0.1 port (admin endpoint off, no HTTPS, no access log, Caddy's logs at ERROR),
// sends every request in its own goroutine at its arrival time as a streamed
// /v1/completions, then reads the replicas' prefix cache counters and stops Caddy and the
// replicas. For llm_affinity/<strategy> the route is the llm_affinity handler and
// reverse_proxy with lb_policy llm_affinity, configured as [llmbench.Sim] configures its
// mirror of the plugin (hardware profile from the kvsim engine config, the same scorer rates,
// queue timeout, output estimate, adapters and tuning); for Caddy's own policies it is
// reverse_proxy alone with that lb_policy (header hashes the X-Session-Id header, which the
// client sets to [llmbench.HeaderKey]).
//
// Time is scaled: kvsim runs TimeScale times faster than wall clock, requests are sent at
// arrival/TimeScale wall seconds, the router's time-valued settings (rates, queue timeout,
// adapter loads, the ttft tie) are scaled to wall clock, and every time measured is reported
// multiplied by TimeScale, so results read in the same simulated seconds as sim mode.
//
// Caddy runs one config per process, so passes of every Runner are serialised. The plugin's
// routing state lives in caddyllm's usage pool, shared by the configs of the process while any
// holds it, and keyed by dial address: every pass uses replica ports no earlier pass of this
// process used, so no prefix index or charge carries over even where it outlives a pass; model and adapter names get a per-pass suffix, so the learned output
// estimates (kept per model name) do not carry over either.
package httprun

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/caddyserver/caddy/v2"

	// The llm_affinity handler and policy, and (through it) Caddy's http app and
	// reverse_proxy with its selection policies.
	_ "github.com/llmaffinity/caddy-llm-affinity/caddyllm"
	"github.com/llmaffinity/caddy-llm-affinity/kvsim"
	"github.com/llmaffinity/caddy-llm-affinity/llmbench"
	"github.com/llmaffinity/caddy-llm-affinity/scorer"
)

func init() {
	llmbench.HTTPRunner = func(settings *llmbench.Sim, timeScale float64) (llmbench.Runner, error) {
		r, err := New(settings, timeScale)
		if err != nil {
			return nil, err
		}
		return r, nil
	}
}

// SessionHeader is the request header Caddy's header policy hashes; the client sets it to
// [llmbench.HeaderKey] of each request.
const SessionHeader = llmbench.SessionHeader

// Runner replays workloads over HTTP. It implements [llmbench.Runner].
type Runner struct {
	settings  llmbench.Sim
	timeScale float64
}

// New returns a runner with the settings of sim (replicas, engine, seed, progress and the
// llm_affinity options) and the time scale (0 means 1).
func New(settings *llmbench.Sim, timeScale float64) (*Runner, error) {
	if settings == nil {
		return nil, errors.New("httprun: no settings")
	}
	if timeScale == 0 {
		timeScale = 1
	}
	if !(timeScale > 0) || math.IsInf(timeScale, 0) {
		return nil, fmt.Errorf("time scale must be a positive number, got %v", timeScale)
	}
	if settings.Replicas < 1 {
		return nil, fmt.Errorf("replicas must be at least 1, got %d", settings.Replicas)
	}
	switch settings.OutputEstimate {
	case "", llmbench.OutputAverage, llmbench.OutputMaxTokens, llmbench.OutputFixed:
	default:
		return nil, fmt.Errorf("output estimate must be average, max_tokens or fixed, got %q", settings.OutputEstimate)
	}
	return &Runner{settings: *settings, timeScale: timeScale}, nil
}

var (
	// caddyMu serialises passes: Caddy runs one config per process.
	caddyMu sync.Mutex
	// passes counts passes in this process, for the per-pass model name suffix.
	passes int
	// usedPorts are the replica ports of earlier passes in this process. Guarded by caddyMu.
	usedPorts = map[int]bool{}
)

// Replay runs the workload under policy against a fresh Caddy and fresh replicas.
func (r *Runner) Replay(ctx context.Context, w *llmbench.Workload, policy string) (*llmbench.Results, error) {
	if !llmbench.ValidPolicy(policy) {
		return nil, fmt.Errorf("unknown policy %q", policy)
	}
	if len(w.Requests) == 0 {
		return nil, errors.New("empty workload")
	}
	caddyMu.Lock()
	defer caddyMu.Unlock()
	start := time.Now()
	passes++
	p, err := r.newPass(w, policy, fmt.Sprintf("@llmbench%d", passes))
	if err != nil {
		return nil, err
	}
	defer p.close()
	if err := p.startCaddy(); err != nil {
		return nil, err
	}
	if err := p.replay(ctx); err != nil {
		return nil, err
	}
	if err := p.readCounters(ctx); err != nil {
		return nil, err
	}
	p.results.Wall = time.Since(start)
	return p.results, nil
}

// replica is one kvsim server on a loopback port.
type replica struct {
	name string
	dial string
	sim  *kvsim.Server
	srv  *http.Server
}

// pass is the state of one replay.
type pass struct {
	r         *Runner
	w         *llmbench.Workload
	policy    string
	tag       string // suffix of model and adapter names in this pass
	base      string // the base model name, tagged
	engine    kvsim.Config
	timeScale float64

	replicas []*replica
	byName   map[string]int
	url      string
	caddyUp  bool
	client   *http.Client

	t0      time.Time     // wall time of the first arrival
	first   time.Duration // the workload's first arrival
	results *llmbench.Results

	mu   sync.Mutex // guards done and the Progress calls
	done int
}

func (r *Runner) newPass(w *llmbench.Workload, policy, tag string) (p *pass, err error) {
	cfg := r.settings.Engine.WithDefaults()
	if cfg.BytesPerToken != llmbench.BytesPerToken {
		return nil, fmt.Errorf("engine bytes_per_token must be %d, the workload's token size", llmbench.BytesPerToken)
	}
	p = &pass{
		r: r, w: w, policy: policy, tag: tag, timeScale: r.timeScale,
		byName: make(map[string]int),
		results: &llmbench.Results{
			Policy:   policy,
			Replicas: make([]llmbench.ReplicaResult, r.settings.Replicas),
			Requests: make([]llmbench.RequestResult, len(w.Requests)),
		},
		first: w.Requests[0].Arrival,
	}
	defer func() {
		if err != nil {
			p.close()
		}
	}()
	for i := range p.results.Requests {
		q := &w.Requests[i]
		p.results.Requests[i] = llmbench.RequestResult{Index: q.Index, Replica: -1, Arrival: q.Arrival, PromptTokens: q.PromptTokens}
	}
	cfg.Model += tag
	var adapters []string
	for _, a := range append(append([]string(nil), cfg.Adapters...), w.Adapters...) {
		adapters = append(adapters, a+tag)
	}
	cfg.Adapters = adapters
	p.engine, p.base = cfg, cfg.Model

	for i := range r.settings.Replicas {
		name := "replica-" + strconv.Itoa(i)
		sim, err := kvsim.NewServer(kvsim.ServerConfig{Name: name, Engine: cfg, Speed: r.timeScale})
		if err != nil {
			return p, err
		}
		ln, err := listenFresh()
		if err != nil {
			sim.Close()
			return p, err
		}
		rep := &replica{name: name, dial: ln.Addr().String(), sim: sim,
			srv: &http.Server{Handler: sim, ReadHeaderTimeout: time.Minute}}
		go func() { _ = rep.srv.Serve(ln) }()
		p.replicas = append(p.replicas, rep)
		p.byName[name] = i
		p.results.Replicas[i].Name = rep.dial
	}
	p.client = &http.Client{Transport: &http.Transport{
		Proxy:               nil,
		DialContext:         (&net.Dialer{Timeout: 10 * time.Second}).DialContext,
		MaxIdleConns:        0,
		MaxIdleConnsPerHost: 4096,
		IdleConnTimeout:     time.Minute,
		DisableCompression:  true,
	}}
	return p, nil
}

// listenFresh listens on a loopback port that no earlier pass of this process used, so the
// plugin's state (keyed by dial address) starts empty for it. Caller holds caddyMu.
func listenFresh() (net.Listener, error) {
	var rejected []net.Listener
	defer func() {
		for _, l := range rejected {
			l.Close()
		}
	}()
	for range 1000 {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		port := ln.Addr().(*net.TCPAddr).Port
		if !usedPorts[port] {
			usedPorts[port] = true
			return ln, nil
		}
		rejected = append(rejected, ln) // held open so the next Listen gets another port
	}
	return nil, errors.New("no fresh loopback port")
}

// freePort returns a loopback port free at the time of the call.
func freePort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

// wall returns the wall-clock duration of d in the replay's clock (simulated seconds).
func (p *pass) wall(d time.Duration) time.Duration {
	return time.Duration(float64(d) / p.timeScale)
}

// replayTime returns the replay's clock duration of wall-clock duration d.
func (p *pass) replayTime(d time.Duration) time.Duration {
	return time.Duration(float64(d) * p.timeScale)
}

// startCaddy loads the pass's Caddy config.
func (p *pass) startCaddy() error {
	port, err := freePort()
	if err != nil {
		return err
	}
	listen := "127.0.0.1:" + strconv.Itoa(port)
	cfg, err := p.caddyConfig(listen)
	if err != nil {
		return err
	}
	if err := caddy.Load(cfg, true); err != nil {
		return fmt.Errorf("loading the Caddy config: %w", err)
	}
	p.caddyUp = true
	p.url = "http://" + listen
	return nil
}

// caddyConfig returns the JSON config of the pass: one server on listen, a route of the
// llm_affinity handler (for llm_affinity policies) and reverse_proxy to the replicas.
func (p *pass) caddyConfig(listen string) ([]byte, error) {
	var upstreams []map[string]any
	for _, rep := range p.replicas {
		upstreams = append(upstreams, map[string]any{"dial": rep.dial})
	}
	proxy := map[string]any{
		"handler":   "reverse_proxy",
		"upstreams": upstreams,
		"load_balancing": map[string]any{
			"selection_policy": p.selectionPolicy(),
		},
		// More idle connections to each replica than Caddy's default 32, so that hundreds of
		// concurrent streams do not keep dialling.
		"transport": map[string]any{
			"protocol":   "http",
			"keep_alive": map[string]any{"max_idle_conns_per_host": 4096},
		},
	}
	var handlers []any
	if _, ok := llmbench.AffinityStrategy(p.policy); ok {
		handlers = append(handlers, map[string]any{
			"handler":           "llm_affinity",
			"block_tokens":      llmbench.RouterBlockTokens,
			"bytes_per_token":   llmbench.BytesPerToken,
			"max_prefix_tokens": max(p.engine.MaxModelLen, llmbench.RouterBlockTokens),
		})
	}
	handlers = append(handlers, proxy)
	cfg := map[string]any{
		"admin":   map[string]any{"disabled": true, "config": map[string]any{"persist": false}},
		"logging": map[string]any{"logs": map[string]any{"default": map[string]any{"level": "ERROR"}}},
		"apps": map[string]any{
			"http": map[string]any{
				"grace_period": int64(time.Second),
				"servers": map[string]any{
					"llmbench": map[string]any{
						"listen":          []string{listen},
						"automatic_https": map[string]any{"disable": true},
						"routes":          []any{map[string]any{"handle": handlers}},
					},
				},
			},
		},
	}
	return json.Marshal(cfg)
}

// selectionPolicy is the reverse_proxy selection policy of the pass. The llm_affinity policy
// gets the settings sim mode gives its mirror of the plugin, with every time-valued one
// scaled to wall clock.
func (p *pass) selectionPolicy() map[string]any {
	strategy, ok := llmbench.AffinityStrategy(p.policy)
	if !ok {
		sel := map[string]any{"policy": p.policy}
		if p.policy == "header" {
			sel["field"] = SessionHeader
		}
		return sel
	}
	s := &p.r.settings
	prefill, decode := s.Rates(p.w)
	cfg := p.engine
	queueTimeout := s.QueueTimeout
	switch {
	case queueTimeout == 0:
		queueTimeout = llmbench.DefaultQueueTimeout
	case queueTimeout < 0:
		queueTimeout = -1
	}
	if queueTimeout > 0 {
		queueTimeout = max(p.wall(queueTimeout), 1)
	}
	tie := s.Scorer.TieSeconds
	if tie <= 0 {
		tie = scorer.DefaultTieSeconds
	}
	sel := map[string]any{
		"policy":   "llm_affinity",
		"strategy": string(strategy),
		"hardware": map[string]any{
			"prefill_tokens_per_second": prefill * p.timeScale,
			"decode_tokens_per_second":  decode * p.timeScale,
			"kv_capacity_tokens":        cfg.NumGPUBlocks * cfg.BlockSize,
		},
		"output_estimate":     cmp.Or(s.OutputEstimate, llmbench.OutputAverage),
		"output_tokens":       cmp.Or(s.OutputTokens, llmbench.DefaultOutputTokens),
		"queue_timeout":       int64(queueTimeout),
		"queue_limit":         s.QueueLimit,
		"max_loras":           cfg.MaxLoRAs,
		"adapter_load_host":   int64(max(p.wall(cfg.LoRAHostLoad), 1)),
		"adapter_load_remote": int64(max(p.wall(cfg.LoRAStorageLoad), 1)),
		"tie_seconds":         tie / p.timeScale,
	}
	if len(cfg.Adapters) > 0 {
		sel["adapters"] = cfg.Adapters
	}
	o := s.Scorer
	if o.KVMarginTokens > 0 {
		sel["kv_margin_tokens"] = o.KVMarginTokens
	}
	if o.SGLang.CacheThreshold > 0 {
		sel["sglang_cache_threshold"] = o.SGLang.CacheThreshold
	}
	if o.SGLang.BalanceAbsThreshold > 0 {
		sel["sglang_balance_abs"] = o.SGLang.BalanceAbsThreshold
	}
	if o.SGLang.BalanceRelThreshold > 0 {
		sel["sglang_balance_rel"] = o.SGLang.BalanceRelThreshold
	}
	if l := o.LLMD; l.PrefixWeight != 0 || l.QueueWeight != 0 || l.KVWeight != 0 {
		sel["llmd_weights"] = []float64{l.PrefixWeight, l.QueueWeight, l.KVWeight}
	}
	if o.Dynamo.OverlapWeight > 0 {
		sel["dynamo_overlap_weight"] = o.Dynamo.OverlapWeight
	}
	if o.ImposedDelayWeight != 0 { // ratios of seconds: no time scaling
		sel["imposed_delay_weight"] = o.ImposedDelayWeight
	}
	if o.DecodeWeight != 0 {
		sel["decode_weight"] = o.DecodeWeight
	}
	if o.EvictionWeight != 0 {
		sel["eviction_weight"] = o.EvictionWeight
	}
	return sel
}

// replay sends every request at its arrival time, each in its own goroutine, and waits for
// them all.
func (p *pass) replay(ctx context.Context) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	p.t0 = time.Now()
	var err error
	for i := range p.w.Requests {
		due := p.t0.Add(p.wall(p.w.Requests[i].Arrival - p.first))
		if d := time.Until(due); d > 0 {
			timer.Reset(d)
			select {
			case <-ctx.Done():
				err = ctx.Err()
			case <-timer.C:
			}
			if err != nil {
				break
			}
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			p.send(ctx, i)
		}()
	}
	wg.Wait()
	if err == nil {
		err = ctx.Err()
	}
	return err
}

// send sends request i, streams its response and records what it measured.
func (p *pass) send(ctx context.Context, i int) {
	q := &p.w.Requests[i]
	res := &p.results.Requests[i]
	defer p.progress()
	c := q.Completion(p.base, true)
	if q.Model != "" {
		c.Model = q.Model + p.tag
	}
	body, err := json.Marshal(c)
	if err != nil {
		res.Err = err.Error()
		return
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, p.url+"/v1/completions", bytes.NewReader(body))
	if err != nil {
		res.Err = err.Error()
		return
	}
	req.Header.Set("Content-Type", "application/json")
	if key := llmbench.HeaderKey(q); key != "" {
		req.Header.Set(SessionHeader, key)
	}
	sent := time.Now()
	res.Arrival = p.first + p.replayTime(sent.Sub(p.t0))
	resp, err := p.client.Do(req)
	if err != nil {
		res.Err = err.Error()
		return
	}
	defer resp.Body.Close()
	replica, ok := p.byName[resp.Header.Get(kvsim.ReplicaHeader)]
	if ok {
		res.Replica = replica
		p.mu.Lock()
		rr := &p.results.Replicas[replica]
		rr.Requests++
		rr.PromptTokens += int64(q.PromptTokens)
		p.mu.Unlock()
	}
	if resp.StatusCode != http.StatusOK {
		if resp.StatusCode == http.StatusServiceUnavailable && !ok {
			res.Shed = true // refused by the router, not by an engine
		} else {
			res.Err = errorMessage(resp)
		}
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<20))
		return
	}
	st, err := readStream(resp.Body)
	switch {
	case err != nil:
		res.Err = err.Error()
	case !st.done:
		res.Err = "stream ended before [DONE]"
	case !st.usage:
		res.Err = "stream carried no usage"
	}
	if !st.firstToken.IsZero() {
		res.TTFT = max(p.replayTime(st.firstToken.Sub(sent)), 1)
	}
	if res.Err != "" {
		return
	}
	last := st.lastToken
	if last.IsZero() {
		last = st.end
	}
	res.E2E = max(p.replayTime(last.Sub(sent)), 1)
	res.PromptTokens, res.CachedTokens, res.OutputTokens = st.promptTokens, st.cachedTokens, st.outputTokens
	if ok {
		p.mu.Lock()
		p.results.Replicas[replica].OutputTokens += int64(st.outputTokens)
		p.mu.Unlock()
	}
}

func (p *pass) progress() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.done++
	if p.r.settings.Progress != nil {
		p.r.settings.Progress(p.done, len(p.results.Requests))
	}
}

// errorMessage describes a failed response by its status and the message of an OpenAI or
// vLLM error body (never the request's text: neither Caddy nor kvsim echoes prompts).
func errorMessage(resp *http.Response) string {
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 64<<10))
	var e struct {
		Message string `json:"message"`
		Error   struct {
			Message string `json:"message"`
		} `json:"error"`
	}
	msg := ""
	if json.Unmarshal(b, &e) == nil {
		msg = cmp.Or(e.Message, e.Error.Message)
	}
	if len(msg) > 200 {
		msg = msg[:200]
	}
	if msg == "" {
		return "HTTP " + strconv.Itoa(resp.StatusCode)
	}
	return "HTTP " + strconv.Itoa(resp.StatusCode) + ": " + msg
}

// streamStats is what a streamed completion showed.
type streamStats struct {
	firstToken, lastToken, end time.Time
	done, usage                bool
	promptTokens, cachedTokens int
	outputTokens               int
}

var (
	dataPrefix  = []byte("data: ")
	donePayload = []byte("[DONE]")
	usageKey    = []byte(`"usage":`)
)

// readStream reads an SSE completion stream: content chunks (their arrival times), the usage
// chunk and [DONE]. A quote inside a JSON string is escaped, so `"usage":` appears only as a
// key; content chunks are not decoded.
func readStream(body io.Reader) (streamStats, error) {
	var st streamStats
	sc := bufio.NewScanner(body)
	sc.Buffer(make([]byte, 0, 16<<10), 4<<20)
	for sc.Scan() {
		line := sc.Bytes()
		payload, ok := bytes.CutPrefix(line, dataPrefix)
		if !ok {
			continue
		}
		now := time.Now()
		if bytes.Equal(bytes.TrimSpace(payload), donePayload) {
			st.done, st.end = true, now
			break
		}
		if !bytes.Contains(payload, usageKey) {
			if st.firstToken.IsZero() {
				st.firstToken = now
			}
			st.lastToken = now
			continue
		}
		var chunk struct {
			Choices []struct {
				Text string `json:"text"`
			} `json:"choices"`
			Usage *struct {
				PromptTokens     int `json:"prompt_tokens"`
				CompletionTokens int `json:"completion_tokens"`
				Details          struct {
					CachedTokens int `json:"cached_tokens"`
				} `json:"prompt_tokens_details"`
			} `json:"usage"`
		}
		if err := json.Unmarshal(payload, &chunk); err != nil {
			return st, fmt.Errorf("bad stream chunk: %v", err)
		}
		if len(chunk.Choices) > 0 && chunk.Choices[0].Text != "" {
			if st.firstToken.IsZero() {
				st.firstToken = now
			}
			st.lastToken = now
		}
		if u := chunk.Usage; u != nil {
			st.usage = true
			st.promptTokens, st.cachedTokens, st.outputTokens = u.PromptTokens, u.Details.CachedTokens, u.CompletionTokens
		}
	}
	if err := sc.Err(); err != nil {
		return st, err
	}
	return st, nil
}

// readCounters fills each replica's prefix cache counters from its /kvsim/state.
func (p *pass) readCounters(ctx context.Context) error {
	for i, rep := range p.replicas {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+rep.dial+"/kvsim/state", nil)
		if err != nil {
			return err
		}
		resp, err := p.client.Do(req)
		if err != nil {
			return fmt.Errorf("reading %s's state: %w", rep.name, err)
		}
		var st kvsim.State
		err = json.NewDecoder(resp.Body).Decode(&st)
		resp.Body.Close()
		if err != nil {
			return fmt.Errorf("reading %s's state: %w", rep.name, err)
		}
		p.results.Replicas[i].PrefixQueries = st.PrefixQueries
		p.results.Replicas[i].PrefixHits = st.PrefixHits
	}
	return nil
}

// close stops Caddy, then the replicas.
func (p *pass) close() {
	if p.client != nil {
		p.client.CloseIdleConnections()
	}
	if p.caddyUp {
		_ = caddy.Stop()
		p.caddyUp = false
	}
	for _, rep := range p.replicas {
		_ = rep.srv.Close()
		_ = rep.sim.Close()
	}
	p.replicas = nil
}
