package caddyllm

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/llmaffinity/caddy-llm-affinity/drain"
	"github.com/llmaffinity/caddy-llm-affinity/fleetsync"
	"github.com/llmaffinity/caddy-llm-affinity/internal/cputime"
	"github.com/llmaffinity/caddy-llm-affinity/prefixindex"
	"github.com/llmaffinity/caddy-llm-affinity/router"
	"github.com/llmaffinity/caddy-llm-affinity/scorer"
	"github.com/llmaffinity/caddy-llm-affinity/scrape"
)

// testPolicy is a policy set up as Provision would, without a Caddy
// context, with routing state of its own.
func testPolicy(tb testing.TB, logger *zap.Logger) *Policy {
	p := &Policy{QueueTimeout: caddy.Duration(0), ShedStatus: 503, ExplainHeader: true}
	p.opts = router.Options{Scorer: scorer.Options{Strategy: scorer.TTFT}, OutputTokens: 100}.WithDefaults()
	p.rng, p.names, p.series = newLockedRand(), new(namesCache), new(seriesCache)
	p.logger = logger
	p.sh = newShared()
	p.site = p.sh.addSite(&site{drainDeadline: defaultDrainDeadline}, nil)
	tb.Cleanup(func() { p.sh.Destruct() })
	return p
}

func selectFor(t *testing.T, p *Policy, pool reverseproxy.UpstreamPool, body string) (*reverseproxy.Upstream, *httptest.ResponseRecorder) {
	t.Helper()
	pr := newParser(prefixindex.Hasher{}, 4, "")
	req, err := pr.parse(EndpointChatCompletions, []byte(body))
	if err != nil {
		t.Fatal(err)
	}
	req.BlockTokens = prefixindex.DefaultBlockTokens
	st := &requestState{req: req, body: []byte(body), origBody: []byte(body)}
	ctx := context.WithValue(context.Background(), stateKey{}, st)
	r := httptest.NewRequest("POST", "/v1/chat/completions", nil).WithContext(ctx)
	w := httptest.NewRecorder()
	up := p.Select(pool, r, w)
	t.Cleanup(func() {
		if st.current != nil {
			st.current.release()
		}
	})
	return up, w
}

// TestDebugLogExplainsWithoutPromptText: the debug log of a decision
// carries the top candidates' features and the filter reasons, and never
// the prompt.
func TestDebugLogExplainsWithoutPromptText(t *testing.T) {
	core, logs := observer.New(zapcore.DebugLevel)
	p := testPolicy(t, zap.New(core))
	pool := reverseproxy.UpstreamPool{
		{Host: new(reverseproxy.Host), Dial: "debuglog-a:1"},
		{Host: new(reverseproxy.Host), Dial: "debuglog-b:1"},
	}
	p.sh.drains.Drain("debuglog-b:1", 0, drain.Admin)
	secret := strings.Repeat("the secret prompt ", 100)
	body, _ := json.Marshal(map[string]any{"model": "m", "messages": []map[string]string{{"role": "user", "content": secret}}})
	up, w := selectFor(t, p, pool, string(body))
	if up == nil || up.Dial != "debuglog-a:1" {
		t.Fatalf("chose %v", up)
	}
	if h := w.Header().Get("X-LLM-Affinity"); !strings.Contains(h, "upstream=debuglog-a:1") || !strings.Contains(h, "reason=cold") {
		t.Fatalf("explain header %q", h)
	}
	entries := logs.FilterMessage("routed").All()
	if len(entries) != 1 {
		t.Fatalf("%d routed log entries", len(entries))
	}
	enc := zapcore.NewJSONEncoder(zap.NewProductionEncoderConfig())
	buf, err := enc.EncodeEntry(entries[0].Entry, entries[0].Context)
	if err != nil {
		t.Fatal(err)
	}
	line := buf.String()
	if strings.Contains(line, "secret") {
		t.Fatalf("log carries prompt text: %s", line)
	}
	for _, want := range []string{`"top":[{"upstream":"debuglog-a:1"`, `"filtered":["debuglog-b:1:draining"]`, `"prompt_tokens":`} {
		if !strings.Contains(line, want) {
			t.Errorf("log lacks %s: %s", want, line)
		}
	}
}

// TestRetryAvoidsTriedUpstream: a second Select for the same request
// releases the first attempt's charge and picks another upstream.
func TestRetryAvoidsTriedUpstream(t *testing.T) {
	p := testPolicy(t, zap.NewNop())
	pool := reverseproxy.UpstreamPool{
		{Host: new(reverseproxy.Host), Dial: "retry-a:1"},
		{Host: new(reverseproxy.Host), Dial: "retry-b:1"},
	}
	pr := newParser(prefixindex.Hasher{}, 4, "")
	body := `{"model":"m","messages":[{"role":"user","content":"` + strings.Repeat("x", 2000) + `"}]}`
	req, _ := pr.parse(EndpointChatCompletions, []byte(body))
	req.BlockTokens = 64
	st := &requestState{req: req, body: []byte(body), origBody: []byte(body)}
	ctx := context.WithValue(context.Background(), stateKey{}, st)
	r := httptest.NewRequest("POST", "/v1/chat/completions", nil).WithContext(ctx)
	first := p.Select(pool, r, httptest.NewRecorder())
	second := p.Select(pool, r, httptest.NewRecorder())
	defer st.current.release()
	if first == nil || second == nil || first.Dial == second.Dial {
		t.Fatalf("first %v second %v", first, second)
	}
	for _, u := range p.sh.fleet.Snapshot(time.Now()) {
		if u.Dial == first.Dial && (u.InFlight != 0 || u.QueuedPrefillTokens != 0 || u.KVTokensInFlight != 0) {
			t.Fatalf("the first attempt's charge was not released: %+v", u)
		}
	}
}

// BenchmarkSelect is the policy's work for one request, across 4
// upstreams: Select (the decision, its charge, the drain registration and
// the body for the attempt) and the release when the response ends. The
// request is parsed and made once, outside the loop: parsing has its own
// benchmark, and httptest's request is not what Caddy hands the policy.
func BenchmarkSelect(b *testing.B) {
	p := testPolicy(b, zap.NewNop())
	p.ExplainHeader = false
	pool := reverseproxy.UpstreamPool{
		{Host: new(reverseproxy.Host), Dial: "bench-a:1"}, {Host: new(reverseproxy.Host), Dial: "bench-b:1"},
		{Host: new(reverseproxy.Host), Dial: "bench-c:1"}, {Host: new(reverseproxy.Host), Dial: "bench-d:1"},
	}
	pr := newParser(prefixindex.Hasher{}, 4, "")
	body := []byte(`{"model":"m","prompt":"` + strings.Repeat("abcd", 150) + `","max_tokens":16}`)
	req, err := pr.parse(EndpointCompletions, body)
	if err != nil {
		b.Fatal(err)
	}
	req.BlockTokens = 64
	st := &requestState{req: req, body: body, origBody: body}
	ctx := context.WithValue(context.Background(), stateKey{}, st)
	r := httptest.NewRequest("POST", "/v1/completions", nil).WithContext(ctx)
	w := httptest.NewRecorder()
	b.ReportAllocs()
	cpu := cputime.Start()
	for b.Loop() {
		st.current, st.tried = nil, st.tried[:0]
		if p.Select(pool, r, w) == nil {
			b.Fatal("no upstream")
		}
		// Served: its first token keeps the prefix in the index, as a
		// conversation's turns find it.
		p.sh.fleet.Progress(st.current.charge, 1, time.Now())
		st.current.release()
	}
	cputime.Report(b, cpu)
}

// TestPeerChargesExpireWithoutSync: peers' charges go when the peer falls
// silent even after the last sync connection was unloaded (the shared
// host's janitor expires them, not the connection).
func TestPeerChargesExpireWithoutSync(t *testing.T) {
	sh := newShared()
	defer sh.Destruct()
	dial := "peer-expiry:1"
	sh.fleet.Name(dial, time.Now())
	sh.applyPeer("peer#1", fleetsync.Message{Event: &router.Event{Kind: router.EventRouted, ID: 1, Dial: dial, Prefill: 1000, Decode: 100, KV: 1100}})
	inFlight := func() int { return inFlightOn(sh.fleet, dial) }
	if inFlight() != 1 {
		t.Fatalf("the peer's charge was not applied: %d in flight", inFlight())
	}
	deadline := time.Now().Add(peerSilence + 30*time.Second)
	for inFlight() != 0 {
		if time.Now().After(deadline) {
			t.Fatal("the silent peer's charge stayed")
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestAttemptBodyGoesWithTheHeaders: the body Select installs for an
// attempt is one net/http knows is in memory, so the transport writes
// headers and body to the upstream in one system call; an opaque reader
// (the control) makes it flush the headers first.
func TestAttemptBodyGoesWithTheHeaders(t *testing.T) {
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
	}))
	defer upstream.Close()
	var writes atomic.Int64
	transport := &http.Transport{DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := (&net.Dialer{}).DialContext(ctx, network, addr)
		return &countingConn{Conn: c, writes: &writes}, err
	}}
	defer transport.CloseIdleConnections()
	body := `{"model":"m","prompt":"` + strings.Repeat("abcd", 150) + `","max_tokens":16}`
	send := func(t *testing.T, install func(r *http.Request)) int64 {
		t.Helper()
		r, err := http.NewRequest("POST", upstream.URL+"/v1/completions", nil)
		if err != nil {
			t.Fatal(err)
		}
		install(r)
		writes.Store(0)
		resp, err := transport.RoundTrip(r)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return writes.Load()
	}
	p := testPolicy(t, zap.NewNop())
	pool := reverseproxy.UpstreamPool{{Host: new(reverseproxy.Host), Dial: "body-a:1"}}
	n := send(t, func(r *http.Request) {
		pr := newParser(prefixindex.Hasher{}, 4, "")
		req, err := pr.parse(EndpointCompletions, []byte(body))
		if err != nil {
			t.Fatal(err)
		}
		req.BlockTokens = prefixindex.DefaultBlockTokens
		st := &requestState{req: req, body: []byte(body), origBody: []byte(body)}
		*r = *r.WithContext(context.WithValue(r.Context(), stateKey{}, st))
		if p.Select(pool, r, httptest.NewRecorder()) == nil {
			t.Fatal("no upstream")
		}
		t.Cleanup(st.current.release)
	})
	if n != 1 {
		t.Errorf("the attempt's request took %d writes, want 1", n)
	}
	control := send(t, func(r *http.Request) {
		r.Body = io.NopCloser(struct{ io.Reader }{strings.NewReader(body)})
		r.ContentLength = int64(len(body))
	})
	if control < 2 {
		t.Errorf("the control (an opaque body) took %d writes: the count does not see the flush", control)
	}
}

// countingConn counts the writes made to a connection.
type countingConn struct {
	net.Conn
	writes *atomic.Int64
}

func (c *countingConn) Write(p []byte) (int, error) {
	c.writes.Add(1)
	return c.Conn.Write(p)
}

// TestIdleDynamicUpstreamForgetsItsDrain: an operator's drain of a
// dynamic upstream (one no config names) goes with the upstream when the
// janitor forgets it idle, rather than stay in the admin view for ever.
func TestIdleDynamicUpstreamForgetsItsDrain(t *testing.T) {
	p := testPolicy(t, zap.NewNop())
	pool := reverseproxy.UpstreamPool{{Host: new(reverseproxy.Host), Dial: "dynamic-drain:1"}}
	st := &requestState{req: mustParse(t, `{"model":"m","messages":[{"role":"user","content":"hi"}]}`)}
	r := httptest.NewRequest("POST", "/v1/chat/completions", nil).WithContext(context.WithValue(context.Background(), stateKey{}, st))
	if p.Select(pool, r, httptest.NewRecorder()) == nil {
		t.Fatal("no upstream")
	}
	st.current.release() // the request ends
	p.sh.drains.Drain("dynamic-drain:1", time.Second, drain.Admin)
	scraper := scrape.New(scrape.Config{}) // not started: its targets are what matters
	scraper.AddTargets("dynamic-drain:1", "named-drain:1")
	p.sh.addScraper(scraper)
	p.sh.expireIdle(time.Now().Add(2 * idleExpiry))
	if p.sh.fleet.Known("dynamic-drain:1") || len(p.sh.drains.Snapshot()) != 0 {
		t.Fatalf("after expiry: fleet knows it %v, drains %+v", p.sh.fleet.Known("dynamic-drain:1"), p.sh.drains.Snapshot())
	}
	if _, ok := scraper.StatusOf("dynamic-drain:1"); ok {
		t.Fatal("the forgotten upstream is still scraped")
	}
	if _, ok := scraper.StatusOf("named-drain:1"); !ok {
		t.Fatal("another target went with it")
	}
}

// TestQueueLimitShedsAtOnce: once queue_limit requests wait at the
// gateway, one more is shed at once with Retry-After and the queue_full
// reason, not held for queue_timeout; the waiting ones still route when
// an upstream can take them.
func TestQueueLimitShedsAtOnce(t *testing.T) {
	for _, tc := range []struct {
		limit   int
		waiting string // the shed's message, in part
	}{
		{1, "1 request waits already: queue_limit"},
		{2, "2 requests wait already: queue_limit"},
	} {
		t.Run(fmt.Sprint("queue_limit=", tc.limit), func(t *testing.T) {
			p, pool := nothingFits(t)
			p.QueueLimit, p.opts.QueueLimit = tc.limit, tc.limit
			routed := make(chan *reverseproxy.Upstream, tc.limit)
			for range tc.limit {
				st, r := heldRequest(t, context.Background())
				go func() {
					up := p.Select(pool, r, httptest.NewRecorder())
					if st.current != nil {
						st.current.release()
					}
					routed <- up
				}()
			}
			for p.sh.fleet.Held() < tc.limit {
				time.Sleep(time.Millisecond)
			}
			st, r := heldRequest(t, context.Background())
			if up := p.Select(pool, r, httptest.NewRecorder()); up != nil || st.shed == nil {
				t.Fatalf("a request over queue_limit %d: routed to %v, shed %+v", tc.limit, up, st.shed)
			}
			if st.shed.reason != queueFullReason || st.shed.status != 503 || st.shed.retryAfterSeconds != 3600 ||
				!strings.Contains(st.shed.message, tc.waiting) {
				t.Errorf("shed as %+v, want queue_full, 503, Retry-After 3600, %q", st.shed, tc.waiting)
			}
			if got := testutil.ToFloat64(p.sh.metrics.shed.WithLabelValues(queueFullReason)); got != 1 {
				t.Errorf("shed_total{blocked_by=queue_full} = %v, want 1", got)
			}
			p.sh.drains.Undrain(pool[0].Dial, drain.Admin)
			for range tc.limit {
				if up := <-routed; up != pool[0] {
					t.Fatalf("a held request went to %v, want %s", up, pool[0].Dial)
				}
			}
			if n := p.sh.fleet.Held(); n != 0 {
				t.Fatalf("%d requests still held", n)
			}
		})
	}
}

// TestNoSelectAfterTheClientLeft: a held request whose client leaves ends
// its wait (counted as canceled), and Caddy's retries after it (lb_retries,
// lb_try_duration: Caddy asks again after a nil, waiting on the config's
// context, not the request's) neither route, charge nor hold it again, nor
// count it as held twice.
func TestNoSelectAfterTheClientLeft(t *testing.T) {
	p, pool := nothingFits(t)
	ctx, cancel := context.WithCancel(context.Background())
	st, r := heldRequest(t, ctx)
	st.ph = new(placeholderValues)
	done := make(chan struct{})
	go func() {
		defer close(done)
		p.Select(pool, r, httptest.NewRecorder())
	}()
	for p.sh.fleet.Held() < 1 {
		time.Sleep(time.Millisecond)
	}
	cancel()
	<-done
	// The access log's fields say it left while held, and what held it.
	for name, want := range map[string]any{"reason": "canceled", "blocked_by": "draining", "upstream": ""} {
		if got, _ := st.ph.placeholder(placeholderPrefix + name); got != want {
			t.Errorf("{%s%s} = %v, want %v", placeholderPrefix, name, got, want)
		}
	}
	p.sh.drains.Undrain(pool[0].Dial, drain.Admin) // room frees as Caddy asks again
	if up := p.Select(pool, r, httptest.NewRecorder()); up != nil {
		st.current.release()
		t.Fatalf("the client is gone, yet the request was routed to %s", up.Dial)
	}
	p.sh.drains.Drain(pool[0].Dial, time.Hour, drain.Admin)
	for range 3 {
		p.Select(pool, r, httptest.NewRecorder())
	}
	if n := p.sh.fleet.Held(); n != 0 {
		t.Errorf("%d requests held after their client left", n)
	}
	if got := testutil.ToFloat64(p.sh.metrics.queued); got != 1 {
		t.Errorf("gateway_queued_total = %v for one request, want 1", got)
	}
	if got := histogramCount(t, p.sh.metrics.queueWaitOf(canceledWhileHeld)); got != 1 {
		t.Errorf("queue_wait_seconds{reason=canceled} count = %d, want 1", got)
	}
}

// TestQueueTimeoutCountsFromArrival: queue_timeout counts from the
// request's arrival (its dispatch), not from each of Caddy's attempts: a
// retry after it has passed decides once and is shed, without waiting.
func TestQueueTimeoutCountsFromArrival(t *testing.T) {
	p, pool := nothingFits(t)
	st, r := heldRequest(t, context.Background())
	st.waitSince = time.Now().Add(-time.Hour - time.Second)
	done := make(chan *reverseproxy.Upstream)
	go func() { done <- p.Select(pool, r, httptest.NewRecorder()) }()
	for {
		select {
		case up := <-done:
			if up != nil || st.shed == nil || st.shed.status != 503 {
				t.Fatalf("routed to %v, shed %+v; want a 503", up, st.shed)
			}
			if got := histogramCount(t, p.sh.metrics.queueWaitOf(string(scorer.Shed))); got != 1 {
				t.Errorf("queue_wait_seconds{reason=shed} count = %d, want 1", got)
			}
			return
		default:
		}
		if p.sh.fleet.Held() > 0 {
			t.Fatal("a request past its queue_timeout was held for another")
		}
		time.Sleep(time.Millisecond)
	}
}

// nothingFits is a policy whose upstreams are all drained (an admin drain
// of an hour), so that requests wait at the gateway, for an hour at most.
func nothingFits(t *testing.T) (*Policy, reverseproxy.UpstreamPool) {
	p, pool := testPolicy(t, zap.NewNop()), movePool()
	p.QueueTimeout = caddy.Duration(time.Hour)
	for _, u := range pool {
		p.sh.drains.Drain(u.Dial, time.Hour, drain.Admin)
	}
	return p, pool
}

// TestRoutedDecisionCountedByReason: a routed request counts once in
// the decisions and the queue wait of its decision's reason, which its
// latency series carry.
func TestRoutedDecisionCountedByReason(t *testing.T) {
	p, pool := testPolicy(t, zap.NewNop()), movePool()
	st, r := heldRequest(t, context.Background())
	up := p.Select(pool, r, httptest.NewRecorder())
	if up == nil {
		t.Fatal("no upstream")
	}
	defer st.current.release()
	reason := st.decision.reason
	if got := testutil.ToFloat64(p.sh.metrics.decision(reason)); got != 1 {
		t.Errorf("decisions_total{reason=%s} = %v, want 1", reason, got)
	}
	if got := histogramCount(t, p.sh.metrics.queueWaitOf(reason)); got != 1 {
		t.Errorf("queue_wait_seconds{reason=%s} count = %d, want 1", reason, got)
	}
}

// heldRequest is a parsed chat request with its state in ctx, as the
// handler passes it to the policy.
func heldRequest(t *testing.T, ctx context.Context) (*requestState, *http.Request) {
	st := &requestState{req: mustParse(t, `{"model":"m","messages":[{"role":"user","content":"hi"}]}`)}
	return st, httptest.NewRequest("POST", "/v1/chat/completions", nil).WithContext(context.WithValue(ctx, stateKey{}, st))
}

// histogramCount is how many observations o, a histogram's series, has.
func histogramCount(t *testing.T, o prometheus.Observer) uint64 {
	t.Helper()
	var m dto.Metric
	if err := o.(prometheus.Metric).Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetHistogram().GetSampleCount()
}

// TestFallbackSkipsDraining: a drain closes an upstream to the requests
// the handler does not parse (GET /v1/models, embeddings) as well, with
// the built-in fallback and with a configured one.
func TestFallbackSkipsDraining(t *testing.T) {
	p := testPolicy(t, zap.NewNop())
	pool := reverseproxy.UpstreamPool{
		{Host: new(reverseproxy.Host), Dial: "fallback-a:1"}, {Host: new(reverseproxy.Host), Dial: "fallback-b:1"},
		{Host: new(reverseproxy.Host), Dial: "fallback-c:1"},
	}
	p.sh.drains.Drain("fallback-a:1", time.Hour, drain.Admin)
	p.sh.drains.Drain("fallback-c:1", time.Hour, drain.Admin)
	for _, fallback := range []reverseproxy.Selector{nil, reverseproxy.FirstSelection{}} {
		p.fallback = fallback
		for range 20 {
			r := httptest.NewRequest("GET", "/v1/models", nil)
			if up := p.Select(pool, r, httptest.NewRecorder()); up == nil || up.Dial != "fallback-b:1" {
				t.Fatalf("fallback %T chose %v, want the one upstream not draining", fallback, up)
			}
		}
	}
	p.sh.drains.Drain("fallback-b:1", time.Hour, drain.Admin)
	p.fallback = nil
	if up := p.Select(pool, httptest.NewRequest("GET", "/v1/models", nil), httptest.NewRecorder()); up != nil {
		t.Fatalf("chose %s with every upstream draining", up.Dial)
	}
}

// TestPassThroughWithoutHandlerHoldsItsDrain: a request the policy routes
// without the handler (not in the route) is in flight on its upstream
// until it ends: a drain of the upstream waits for it.
func TestPassThroughWithoutHandlerHoldsItsDrain(t *testing.T) {
	p := testPolicy(t, zap.NewNop())
	pool := reverseproxy.UpstreamPool{{Host: new(reverseproxy.Host), Dial: "pass-a:1"}}
	ctx, cancel := context.WithCancel(context.Background())
	r := httptest.NewRequestWithContext(ctx, "POST", "/v1/embeddings", strings.NewReader(`{}`))
	if up := p.Select(pool, r, httptest.NewRecorder()); up == nil {
		t.Fatal("no upstream chosen")
	}
	p.sh.drains.Drain("pass-a:1", time.Hour, drain.Admin)
	if got := p.sh.drains.Phase("pass-a:1"); got != drain.Draining {
		t.Fatalf("with the request in flight: %s, want draining", got)
	}
	cancel() // the request ends
	deadline := time.Now().Add(10 * time.Second)
	for p.sh.drains.Phase("pass-a:1") != drain.Drained {
		if time.Now().After(deadline) {
			t.Fatalf("still %s after the request ended", p.sh.drains.Phase("pass-a:1"))
		}
		time.Sleep(time.Millisecond)
	}
}

// TestUnloadedConfigSkipsDroppedUpstreams: a request still deciding with a
// config a reload replaced (it was held at the gateway) does not go to,
// nor bring back the state of, an upstream the new config dropped.
func TestUnloadedConfigSkipsDroppedUpstreams(t *testing.T) {
	p := testPolicy(t, zap.NewNop())
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	p.ctx = ctx
	pool := reverseproxy.UpstreamPool{{Host: new(reverseproxy.Host), Dial: "dropped:1"}, {Host: new(reverseproxy.Host), Dial: "kept:1"}}
	p.parentDials = []string{"dropped:1", "kept:1"}
	now := time.Now()
	p.sh.fleet.Name("dropped:1", now)
	p.sh.fleet.Name("kept:1", now)
	// dropped:1 is much the faster: loaded, it would take the request.
	body := `{"model":"m","messages":[{"role":"user","content":"` + strings.Repeat("a long prompt ", 400) + `"}]}`
	p.hardwareByDial = map[string]router.Hardware{"dropped:1": {PrefillTokensPerSecond: 1e6, DecodeTokensPerSecond: 100, KVCapacityTokens: 1 << 20}}
	cancel() // the reload: this config is unloaded, and the new one does not name dropped:1
	p.sh.fleet.Forget("dropped:1")
	for range 5 {
		if up, _ := selectFor(t, p, pool, body); up == nil || up.Dial != "kept:1" {
			t.Fatalf("after the reload: %v, want kept:1", up)
		}
	}
	if p.sh.fleet.Known("dropped:1") {
		t.Fatal("the dropped upstream's state came back")
	}
}
