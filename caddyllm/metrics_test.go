package caddyllm

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/prometheus/common/expfmt"

	"github.com/llmaffinity/caddy-llm-affinity/router"
)

// TestLatencyLabelsBounded: only named upstreams become label values, and
// forgetting one deletes its series and its recent TTFTs.
func TestLatencyLabelsBounded(t *testing.T) {
	sh := newShared()
	defer sh.Destruct()
	m := sh.metrics
	m.name("a:1")
	m.observeDecision(&decisionRecord{upstream: "a:1", reason: "warm", matched: 50, prompt: 100})
	m.observeDecision(&decisionRecord{upstream: "dyn:9", reason: "cold", matched: 0, prompt: 100})
	m.observeFirstToken(&decisionRecord{upstream: "a:1", reason: "warm"}, 300*time.Millisecond)
	m.observeEstimateError(&decisionRecord{upstream: "a:1", reason: "warm"}, 0.2-0.5)
	m.recordTTFT("a:1", 0.2, 0.5)
	m.recordTTFT("dyn:9", 0.2, 0.5)

	reg := prometheus.NewRegistry()
	reg.MustRegister(m.prefixMatch, m.timeToFirstToken, m.estimateError)
	if n := testutil.CollectAndCount(m.prefixMatch); n != 2 {
		t.Fatalf("prefix_match_ratio has %d series, want 2 (a:1 and other)", n)
	}
	// 0.2 s observed against 0.5 s estimated: -0.3 s, in le="-0.25".
	got := exposition(t, reg)
	if !strings.Contains(got, `caddy_llm_affinity_ttft_estimate_error_seconds_bucket{reason="warm",upstream="a:1",le="-0.25"} 1`) ||
		!strings.Contains(got, `caddy_llm_affinity_ttft_estimate_error_seconds_bucket{reason="warm",upstream="a:1",le="-0.5"} 0`) {
		t.Fatalf("the signed buckets do not hold -0.3 s:\n%s", got)
	}
	if obs, est := m.recentTTFT("a:1"); len(obs) != 1 || obs[0] != 0.2 || est[0] != 0.5 {
		t.Fatalf("recent TTFT of a:1 = %v %v", obs, est)
	}
	if obs, _ := m.recentTTFT("dyn:9"); obs != nil {
		t.Fatalf("a dynamic upstream's TTFTs are kept: %v", obs)
	}

	m.forget("a:1")
	if out := exposition(t, reg); strings.Contains(out, `"a:1"`) {
		t.Fatalf("the forgotten upstream's series are kept:\n%s", out)
	}
	if obs, _ := m.recentTTFT("a:1"); obs != nil {
		t.Fatalf("the forgotten upstream's TTFTs are kept")
	}
	// The series resolved for a:1 while it was named are not used after
	// it is forgotten, and are resolved again once it is named again.
	m.observeFirstToken(&decisionRecord{upstream: "a:1", reason: "warm"}, time.Second)
	if out := exposition(t, reg); strings.Contains(out, `"a:1"`) ||
		!strings.Contains(out, `caddy_llm_affinity_time_to_first_token_seconds_count{reason="warm",upstream="other"} 1`) {
		t.Fatalf("a forgotten upstream's first token is not counted as other's:\n%s", out)
	}
	m.name("a:1")
	m.observeFirstToken(&decisionRecord{upstream: "a:1", reason: "warm"}, time.Second)
	if out := exposition(t, reg); !strings.Contains(out, `caddy_llm_affinity_time_to_first_token_seconds_count{reason="warm",upstream="a:1"} 1`) {
		t.Fatalf("the named again upstream has no series:\n%s", out)
	}
}

// TestTTFTRing keeps the last recentTTFTs samples, oldest first.
func TestTTFTRing(t *testing.T) {
	var r ttftRing
	for i := range recentTTFTs + 5 {
		r.add(float64(i), float64(-i))
	}
	obs, est := r.list()
	if len(obs) != recentTTFTs || obs[0] != 5 || obs[len(obs)-1] != recentTTFTs+4 || est[0] != -5 {
		t.Fatalf("ring = %v", obs)
	}
}

// exposition renders reg in the text format.
func exposition(t *testing.T, reg *prometheus.Registry) string {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	for _, mf := range mfs {
		if _, err := expfmt.MetricFamilyToText(&b, mf); err != nil {
			t.Fatal(err)
		}
	}
	return b.String()
}

// TestLatencySeriesConcurrentRename: observations racing with an
// upstream being named and forgotten (config reloads) leave no series of
// it once it is forgotten, and once it is named again its observations
// are exported under its name (run with -race).
func TestLatencySeriesConcurrentRename(t *testing.T) {
	sh := newShared()
	defer sh.Destruct()
	m := sh.metrics
	const observers, each = 4, 2000
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := range 500 {
			if i%2 == 0 {
				m.name("r:1")
			} else {
				m.forget("r:1")
			}
		}
	}()
	var wg sync.WaitGroup
	for range observers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range each {
				m.observeFirstToken(&decisionRecord{upstream: "r:1", reason: "warm"}, time.Millisecond)
			}
		}()
	}
	wg.Wait()
	<-done
	m.forget("r:1")
	reg := prometheus.NewRegistry()
	reg.MustRegister(m.timeToFirstToken)
	if out := exposition(t, reg); strings.Contains(out, `"r:1"`) {
		t.Fatalf("the forgotten upstream's series are kept:\n%s", out)
	}
	m.observeFirstToken(&decisionRecord{upstream: "r:1", reason: "warm"}, time.Millisecond)
	if out := exposition(t, reg); !strings.Contains(out, `time_to_first_token_seconds_count{reason="warm",upstream="other"}`) {
		t.Fatalf("no series for the forgotten upstream's first token:\n%s", out)
	}
	m.name("r:1")
	m.observeFirstToken(&decisionRecord{upstream: "r:1", reason: "warm"}, time.Millisecond)
	m.observeFirstToken(&decisionRecord{upstream: "r:1", reason: "warm"}, time.Millisecond)
	if out := exposition(t, reg); !strings.Contains(out, `time_to_first_token_seconds_count{reason="warm",upstream="r:1"} 2`) {
		t.Fatalf("the upstream named again does not export its first tokens:\n%s", out)
	}
}

// TestLatencyCacheBoundedByNamedUpstreams: a churn of upstreams no config
// names keeps one cached entry per reason (other's), and an upstream
// named afterwards is still cached under its own name.
func TestLatencyCacheBoundedByNamedUpstreams(t *testing.T) {
	sh := newShared()
	defer sh.Destruct()
	m := sh.metrics
	for i := range 1000 {
		m.observeFirstToken(&decisionRecord{upstream: fmt.Sprintf("dyn-%d:1", i), reason: "cold"}, time.Millisecond)
	}
	if n := len(*m.series.Load()); n != 1 {
		t.Fatalf("%d cached series after 1000 dynamic upstreams, want 1 (other's, cold)", n)
	}
	m.name("named:1")
	m.observeFirstToken(&decisionRecord{upstream: "named:1", reason: "warm"}, time.Millisecond)
	if _, ok := (*m.series.Load())[seriesKey{"named:1", "warm"}]; !ok {
		t.Fatal("the named upstream's series are not cached")
	}
}

// TestDecisionSeriesFollowNames: a request's latency series, kept from
// its decision, are those latency would resolve when it observes: an
// upstream named or forgotten in between moves its later observations
// to the series of its new label.
func TestDecisionSeriesFollowNames(t *testing.T) {
	sh := newShared()
	defer sh.Destruct()
	m := sh.metrics
	reg := prometheus.NewRegistry()
	reg.MustRegister(m.timeToFirstToken, m.requestDuration)
	dec := &decisionRecord{upstream: "late:1", reason: "warm", matched: 1, prompt: 2}
	m.observeDecision(dec) // not named yet: other's series
	m.name("late:1")
	m.observeFirstToken(dec, time.Millisecond)
	if out := exposition(t, reg); !strings.Contains(out, `caddy_llm_affinity_time_to_first_token_seconds_count{reason="warm",upstream="late:1"} 1`) {
		t.Fatalf("a first token after its upstream was named is not counted as its own:\n%s", out)
	}
	m.forget("late:1")
	m.observeDuration(dec, time.Second)
	if out := exposition(t, reg); strings.Contains(out, `"late:1"`) ||
		!strings.Contains(out, `caddy_llm_affinity_request_duration_seconds_count{reason="warm",upstream="other"} 1`) {
		t.Fatalf("an end after its upstream was forgotten is not counted as other's:\n%s", out)
	}
}

// TestSeriesByPlaceAsLatency: the series a decision finds by its place in
// the pool (resolveAt) are those latency resolves, whatever was at that
// place before (another upstream, another reason), however the upstream
// was named since, and beyond the places cached.
func TestSeriesByPlaceAsLatency(t *testing.T) {
	sh := newShared()
	defer sh.Destruct()
	m := sh.metrics
	var c seriesCache
	m.name("a:1")
	m.name("b:1")
	check := func(place int, dial, reason string) {
		t.Helper()
		dec := &decisionRecord{upstream: dial, reason: reason}
		m.resolveAt(&c, place, dec)
		if got, want := m.latencyOf(dec), m.latency(dial, reason); *got != *want {
			t.Fatalf("place %d, %s, %s: the series found by place are not latency's", place, dial, reason)
		}
	}
	for range 2 {
		check(0, "a:1", "warm")
		check(0, "a:1", "cold")
		check(1, "b:1", "warm")
		check(placesCached, "b:1", "warm")
		check(-1, "b:1", "warm")
		check(0, "b:1", "warm") // the pool reordered
		check(0, "b:1", "spill")
		check(1, "a:1", "no such reason")
	}
	m.forget("b:1")
	check(0, "b:1", "warm") // other's now
	m.name("b:1")
	check(0, "b:1", "warm")
	dec := &decisionRecord{upstream: "b:1", reason: "warm"}
	m.resolveAt(&c, 0, dec)
	if dec.series.series == nil {
		t.Fatal("a series cached at its place was not found there")
	}
	other := newShared()
	defer other.Destruct()
	dec = &decisionRecord{upstream: "b:1", reason: "warm"}
	other.metrics.resolveAt(&c, 0, dec)
	if dec.series.series != other.metrics.latency("b:1", "warm") {
		t.Fatal("another metrics' decision found the series cached for the first's")
	}
}

// TestUpstreamGaugesBounded: the per-upstream gauges have one set of
// series per named upstream and one for all the others, whatever the
// number of dynamic upstreams the router has seen.
func TestUpstreamGaugesBounded(t *testing.T) {
	sh := newShared()
	defer sh.Destruct()
	sh.metrics.name("named:1")
	now := time.Now()
	sh.fleet.Name("named:1", now)
	opts := router.Options{}.WithDefaults()
	rng := newLockedRand()
	for i := range 300 {
		dial := fmt.Sprintf("dyn-%d:1", i)
		members := []router.Member{{Dial: dial, Available: true, Healthy: true}}
		if d := sh.fleet.Decide(now, router.Request{PromptTokens: 10}, members, &opts, rng, nil); i%2 == 0 {
			sh.fleet.Release(d.Charge, now)
		}
	}
	c := newFleetCollector(sh)
	reg := prometheus.NewRegistry()
	reg.MustRegister(c)
	// named:1 and other: queued (2 phases), in flight, index blocks, drain
	// phase; and the gateway's held requests.
	if n := testutil.CollectAndCount(c); n != 2*5+1 {
		t.Fatalf("%d series for 1 named and 300 dynamic upstreams:\n%s", n, exposition(t, reg))
	}
	out := exposition(t, reg)
	for _, want := range []string{
		`caddy_llm_affinity_upstream_in_flight{upstream="other"} 150`,
		`caddy_llm_affinity_upstream_drain_phase{phase="active",upstream="other"} 300`,
		`caddy_llm_affinity_upstream_in_flight{upstream="named:1"} 0`,
		`caddy_llm_affinity_gateway_held 0`,
	} {
		if !strings.Contains(out, want) {
			t.Errorf("no %s in:\n%s", want, out)
		}
	}
}

// TestFixedLabelCountersStartAtZero: the counters whose labels take a
// fixed set of values have every series, at 0, before their first event,
// so that a rate or an alert on the first one sees it.
func TestFixedLabelCountersStartAtZero(t *testing.T) {
	sh := newShared()
	defer sh.Destruct()
	m := sh.metrics
	for _, c := range []struct {
		vec  *prometheus.CounterVec
		name string
		want int
	}{
		{m.decisions, "decisions_total", 7}, {m.drainTransitions, "drain_transitions_total", 3},
		{m.shed, "shed_total", 9}, {m.refused, "refused_total", 3}, {m.movedRequests, "moved_requests_total", 6},
	} {
		if n := testutil.CollectAndCount(c.vec); n != c.want {
			t.Errorf("%s has %d series before any event, want %d", c.name, n, c.want)
		}
	}
}

// TestBucketsTellColdAndLongApart: a cold decision (0 tokens matched)
// has a bucket of its own, not the one of matches up to 64 tokens, and a
// five-minute generation (production.Caddyfile's response_header_timeout)
// lands in a bucket below +Inf.
func TestBucketsTellColdAndLongApart(t *testing.T) {
	sh := newShared()
	defer sh.Destruct()
	m := sh.metrics
	m.name("a:1")
	m.observeDecision(&decisionRecord{upstream: "a:1", reason: "cold", matched: 0, prompt: 100})
	m.observeDecision(&decisionRecord{upstream: "a:1", reason: "warm", matched: 50, prompt: 100})
	m.observeDuration(&decisionRecord{upstream: "a:1", reason: "cold"}, 5*time.Minute)
	reg := prometheus.NewRegistry()
	reg.MustRegister(m.matchedTokens, m.requestDuration)
	got := exposition(t, reg)
	for _, want := range []string{
		`caddy_llm_affinity_matched_tokens_bucket{le="0"} 1`,
		`caddy_llm_affinity_matched_tokens_bucket{le="64"} 2`,
		`caddy_llm_affinity_request_duration_seconds_bucket{reason="cold",upstream="a:1",le="327.68"} 1`,
	} {
		if !strings.Contains(got, want) {
			t.Errorf("no %s in:\n%s", want, got)
		}
	}
}

// TestAbsurdUsageKeepsTheAnswerAndItsRelease: an engine's usage report is
// not trusted. A negative prompt count made the completion's counter
// panic (a Prometheus counter cannot go down) after the answer was read:
// the client got an empty reply, and the request's charge stayed on its
// upstream for good, so that each such answer made it look busier. A
// count no prompt can have would have swamped the counter's rate, and a
// cached count over the prompt's its hit rate.
func TestAbsurdUsageKeepsTheAnswerAndItsRelease(t *testing.T) {
	for _, tc := range []struct {
		usage          string
		prompt, cached float64
	}{
		{`{"prompt_tokens":-5,"completion_tokens":3,"total_tokens":-2}`, 0, 0},
		{`{"prompt_tokens":-5,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":4}}`, 0, 0},
		{`{"prompt_tokens":4611686018427387904,"completion_tokens":3}`, 0, 0},
		{`{"prompt_tokens":10,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":-4}}`, 10, 0},
		{`{"prompt_tokens":10,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":4611686018427387904}}`, 10, 10},
		{`{"prompt_tokens":10,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":4}}`, 10, 4},
	} {
		answer := `{"id":"c","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"hi"}}],"usage":` + tc.usage + `}`
		var rr *httptest.ResponseRecorder
		var p *Policy
		func() {
			defer func() {
				if v := recover(); v != nil {
					t.Errorf("usage %s: the handler panicked: %v", tc.usage, v)
				}
			}()
			rr, _, p, _ = movesBody(t, `{"model":"m","messages":[{"role":"user","content":"hello there"}],"max_tokens":7}`,
				func(_ int, w http.ResponseWriter, _ *http.Request) error {
					w.Header().Set("Content-Type", "application/json")
					w.WriteHeader(http.StatusOK)
					io.WriteString(w, answer)
					return nil
				})
		}()
		if p == nil {
			continue
		}
		if rr.Code != http.StatusOK || rr.Body.String() != answer {
			t.Errorf("usage %s: the client got %d %q, not the engine's answer", tc.usage, rr.Code, rr.Body.String())
		}
		for _, s := range p.sh.fleet.Snapshot(time.Now()) {
			if s.InFlight != 0 || s.KVTokensInFlight != 0 || s.QueuedPrefillTokens != 0 || s.QueuedDecodeTokens != 0 {
				t.Errorf("usage %s: %s still charged: %+v", tc.usage, s.Dial, s)
			}
		}
		if prompt, cached := testutil.ToFloat64(p.sh.metrics.promptTokens), testutil.ToFloat64(p.sh.metrics.cachedPromptTokens); prompt != tc.prompt || cached != tc.cached {
			t.Errorf("usage %s: counted %v prompt tokens, %v cached; want %v and %v", tc.usage, prompt, cached, tc.prompt, tc.cached)
		}
	}
}

// TestRefusedCodesDocumented: every refusal the policy answers is told
// apart where an operator reads refused_total: a refusal whose code is a
// word (model_not_found) is named by it in README.md's metrics row and in
// the metric's help; one whose code is its status (400), which several
// refusals share, is named there by its blocked_by (model_required,
// invalid_utf8), so a rise of code="400" can be traced in the access log.
// (A body not valid UTF-8 naming an unlisted model counted under "400"
// while both said that label meant only a missing model.)
func TestRefusedCodesDocumented(t *testing.T) {
	src, err := os.ReadFile("policy.go")
	if err != nil {
		t.Fatal(err)
	}
	// The policy's refusals: &shedding{... code: X, ... reason: "R", refused: true}.
	refusal := regexp.MustCompile(`&shedding\{[^}]*?code: ([^,]+),[^}]*?reason: "([a-z0-9_]+)", refused: true\}`)
	found := refusal.FindAllStringSubmatch(string(src), -1)
	if len(found) < 4 {
		t.Fatalf("found %d refusals in policy.go, want at least 4: the pattern is broken", len(found))
	}
	readme, err := os.ReadFile("../README.md")
	if err != nil {
		t.Fatal(err)
	}
	row := regexp.MustCompile("(?m)^\\| `caddy_llm_affinity_refused_total\\{code\\}` \\|.*$").Find(readme)
	if row == nil {
		t.Fatal("README.md has no row for caddy_llm_affinity_refused_total")
	}
	sh := newShared()
	defer sh.Destruct()
	descs := make(chan *prometheus.Desc, 1)
	sh.metrics.refused.Describe(descs)
	help := (<-descs).String()
	for _, f := range found {
		code, reason := f[1], f[2]
		name := reason
		if word, ok := strings.CutPrefix(code, `"`); ok {
			name = strings.TrimSuffix(word, `"`)
		}
		if !strings.Contains(string(row), "`"+name+"`") {
			t.Errorf("README.md's refused_total row does not name %s (code %s, blocked_by %s)", name, code, reason)
		}
		if name == reason && !strings.Contains(string(row), "`400`") {
			t.Errorf("README.md's refused_total row has no code 400 for blocked_by %s", reason)
		}
	}
	// The help cannot use the access log's words; it says what each
	// refusal under 400 is.
	for _, what := range []string{"model_not_found", "context_length_exceeded", "no model named", "not valid UTF-8"} {
		if !strings.Contains(help, what) {
			t.Errorf("refused_total's help does not say %q: %s", what, help)
		}
	}
}
