package caddyllm

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"go.uber.org/zap"

	"github.com/llmaffinity/caddy-llm-affinity/drain"
	"github.com/llmaffinity/caddy-llm-affinity/scrape"
)

// listingEngine serves vLLM's metrics and a model list of one model,
// list(), answering the list after delay (spun, to land within
// microseconds).
func listingEngine(t *testing.T, list func() string, delay *atomic.Int64) *httptest.Server {
	prom, err := os.ReadFile("../scrape/testdata/vllm.prom")
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/v1/models" {
			_, _ = w.Write(prom)
			return
		}
		model := list() // the list as the request finds it
		for end := time.Now().Add(time.Duration(delay.Load())); time.Now().Before(end); {
		}
		fmt.Fprintf(w, `{"object":"list","data":[{"id":%q,"object":"model"}]}`, model)
	}))
	t.Cleanup(srv.Close)
	return srv
}

// scrapedPolicy is a test policy over a pool of engines, whose scraper
// has read each once (metrics and model list) and then reads only when
// asked (scrape.Scraper.AskModels), until the test ends.
func scrapedPolicy(t *testing.T, engines ...*httptest.Server) (*Policy, reverseproxy.UpstreamPool) {
	s := scrape.New(scrape.Config{Interval: time.Hour, ModelsInterval: time.Hour})
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	var pool reverseproxy.UpstreamPool
	var dials []string
	for _, e := range engines {
		pool = append(pool, &reverseproxy.Upstream{Host: new(reverseproxy.Host), Dial: e.Listener.Addr().String()})
		dials = append(dials, e.Listener.Addr().String())
	}
	s.SetTargets(dials)
	s.Start(ctx)
	for _, d := range dials {
		for s.Seq(d) == 0 {
			select {
			case <-s.ModelsFetched():
			case <-time.After(time.Second): // the first scrapes' metrics
			}
		}
	}
	p := testPolicy(t, zap.NewNop())
	p.QueueTimeout = caddy.Duration(10 * time.Second)
	p.scraper = s
	return p, pool
}

// selectChat has p select among pool for the chat completion body, as
// the handler would have parsed it, and returns the choice and the
// request's state.
func selectChat(t *testing.T, p *Policy, pool reverseproxy.UpstreamPool, body string) (*reverseproxy.Upstream, *requestState) {
	st := &requestState{req: mustParse(t, body), body: []byte(body), origBody: []byte(body), arrived: time.Now()}
	r := httptest.NewRequest("POST", "/v1/chat/completions", nil).WithContext(context.WithValue(context.Background(), stateKey{}, st))
	return p.Select(pool, r, httptest.NewRecorder()), st
}

// TestListDuringTheDecisionIsNotMissed: a request for an adapter loaded on
// engine B directly has both engines' lists fetched anew; A's answer wakes
// it, and B's, which lists the adapter, comes microseconds later, at
// times while the request is being decided again. It must still find the
// adapter: it used to get 404 model_not_found about one time in ten, B
// counted as fetched and nothing left to wait for.
func TestListDuringTheDecisionIsNotMissed(t *testing.T) {
	var trial, noDelay, bDelay atomic.Int64
	a := listingEngine(t, func() string { return "base" }, &noDelay)
	b := listingEngine(t, func() string { return fmt.Sprintf("adapter-%d", trial.Load()) }, &bDelay)
	p, pool := scrapedPolicy(t, a, b)
	missed, n := 0, 0
	for _, d := range []time.Duration{6 * time.Microsecond, 10 * time.Microsecond, 15 * time.Microsecond} {
		bDelay.Store(int64(d))
		for range 12 {
			i := trial.Add(1)
			up, st := selectChat(t, p, pool, fmt.Sprintf(`{"model":"adapter-%d","messages":[{"role":"user","content":"hi"}]}`, i))
			if st.current != nil {
				st.current.release()
			}
			n++
			if up == nil {
				missed++
				t.Logf("B answering %v after A, trial %d: %d %s", d, i, st.shed.status, st.shed.code)
			}
		}
	}
	if missed > 0 {
		t.Fatalf("%d of %d requests for an adapter B lists got no upstream", missed, n)
	}
}

// TestUnknownModelDecidesOnce: a request for a model no engine lists has
// every engine's list fetched anew before its 404, and each fetch's end
// wakes it; lists that come back as they were decide nothing again. It
// used to decide again at every engine's answer, one decision an engine
// under the fleet's lock, for a name a misconfigured client sends on
// every request.
func TestUnknownModelDecidesOnce(t *testing.T) {
	var noDelay atomic.Int64
	var engines []*httptest.Server
	for range 8 {
		engines = append(engines, listingEngine(t, func() string { return "base" }, &noDelay))
	}
	p, pool := scrapedPolicy(t, engines...)
	for i := range 3 {
		before := p.sh.fleet.Decisions()
		if up, st := selectChat(t, p, pool, `{"model":"no-such-model","messages":[{"role":"user","content":"hi"}]}`); up != nil ||
			st.shed == nil || st.shed.status != http.StatusNotFound {
			t.Fatalf("request %d: upstream %v, answer %+v; want the 404", i, up, st.shed)
		}
		if n := p.sh.fleet.Decisions() - before; n != 1 {
			t.Errorf("request %d: %d decisions while 8 lists were fetched anew, want 1", i, n)
		}
	}
}

// TestPassThroughAroundADeadLister: an engine that listed the model died
// (nothing listens: its list is kept however old), and another runs but
// its /v1/models fails (its list unknown). A request for the model is
// not sent only to the dead one: the one whose list is unknown may serve
// it.
func TestPassThroughAroundADeadLister(t *testing.T) {
	var noDelay atomic.Int64
	a := listingEngine(t, func() string { return "base" }, &noDelay)
	prom, err := os.ReadFile("../scrape/testdata/vllm.prom")
	if err != nil {
		t.Fatal(err)
	}
	b := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/v1/models" {
			http.Error(w, "busy", http.StatusServiceUnavailable)
			return
		}
		_, _ = w.Write(prom)
	}))
	t.Cleanup(b.Close)
	p, pool := policyAfterADeath(t, a, b, false)
	db := pool[1].Dial
	toB := 0
	for range 40 {
		r := httptest.NewRequest("POST", "/v1/embeddings", nil)
		if up := p.chooseFallback(pool, r, httptest.NewRecorder(), &passThrough{model: "base"}); up != nil && up.Dial == db {
			toB++
		}
	}
	if toB == 0 {
		t.Fatal("40 requests for a model the dead engine lists: none went to the running one, whose list is unknown")
	}
}

// TestPassThroughDownListerIsNoNotFound: a model listed only by an engine
// the last scrape found down is no 404 model_not_found for a request
// passed through (the model exists; its engine is down): engines found
// down come last, after the model's listers are chosen, not before (a
// review's test, failing when they were left out first).
func TestPassThroughDownListerIsNoNotFound(t *testing.T) {
	var noDelay atomic.Int64
	a := listingEngine(t, func() string { return "emb" }, &noDelay)
	b := listingEngine(t, func() string { return "chat" }, &noDelay)
	p, pool := policyAfterADeath(t, a, b, true)
	pt := &passThrough{model: "emb"}
	r := httptest.NewRequest("POST", "/v1/embeddings", nil)
	up := p.chooseFallback(pool, r, httptest.NewRecorder(), pt)
	if pt.refusedBy != "" {
		t.Fatalf("model listed by a down engine: router answered 404 model_not_found (up=%v)", up)
	}
}

// policyAfterADeath starts a scraper over engines a and b, waits until it
// has scraped both (with listsFetched, their model lists too), closes a,
// waits until the scrape finds it down, and returns a policy on that
// scraper with the pool of the two, a first.
func policyAfterADeath(t *testing.T, a, b *httptest.Server, listsFetched bool) (*Policy, reverseproxy.UpstreamPool) {
	t.Helper()
	s := scrape.New(scrape.Config{Interval: 50 * time.Millisecond, ModelsInterval: 50 * time.Millisecond})
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	da, db := a.Listener.Addr().String(), b.Listener.Addr().String()
	s.SetTargets([]string{da, db})
	s.Start(ctx)
	waitUntil(t, "both engines scraped", func() bool {
		if s.Seq(da) == 0 || s.Seq(db) == 0 {
			return false
		}
		sa, _ := s.Latest(da, time.Now(), time.Hour)
		sb, _ := s.Latest(db, time.Now(), time.Hour)
		return !listsFetched || !sa.ModelsAt.IsZero() && !sb.ModelsAt.IsZero()
	})
	a.Close()
	waitUntil(t, "the dead engine seen down", func() bool { return s.Down(da) })
	p := testPolicy(t, zap.NewNop())
	p.scraper = s
	return p, reverseproxy.UpstreamPool{
		{Host: new(reverseproxy.Host), Dial: da},
		{Host: new(reverseproxy.Host), Dial: db},
	}
}

// waitUntil waits for cond, failing the test after a minute (a busy
// machine slows the scrapes).
func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestModelNamesSeedAlike: with the engines' lists in hand, a request
// naming any of the names a base model is served under, or none, hashes
// as one naming the model's smallest name, and that one hashes as it
// always did, as does a model served under one name; an adapter keeps
// its own hashes. Without lists every name hashes as sent.
func TestModelNamesSeedAlike(t *testing.T) {
	prom, err := os.ReadFile("../scrape/testdata/vllm.prom")
	if err != nil {
		t.Fatal(err)
	}
	engine := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/v1/models" {
			_, _ = w.Write(prom)
			return
		}
		fmt.Fprint(w, `{"object":"list","data":[`+
			`{"id":"llama-3.1-8b","object":"model","root":"/models/llama","parent":null,"max_model_len":8192},`+
			`{"id":"llama","object":"model","root":"/models/llama","parent":null,"max_model_len":8192},`+
			`{"id":"sql-lora","object":"model","root":"/adapters/sql","parent":"llama-3.1-8b"}]}`)
	}))
	t.Cleanup(engine.Close)
	p, pool := scrapedPolicy(t, engine)
	if lists := p.scraper.ModelLists(); len(lists) != 1 {
		t.Fatalf("model lists %v: the engine's not fetched", lists)
	}
	body := func(model string) string {
		return `{` + model + `"messages":[{"role":"user","content":"` + strings.Repeat("one long system prompt ", 40) + `"}]}`
	}
	// routed is a request's hashes once p routed it among pool.
	routed := func(p *Policy, pool reverseproxy.UpstreamPool, model string) []uint64 {
		t.Helper()
		req := new(Request)
		if err := testParser().parseInto(req, EndpointChatCompletions, []byte(body(model))); err != nil {
			t.Fatal(err)
		}
		st := &requestState{req: req, body: []byte(body(model)), origBody: []byte(body(model)), arrived: time.Now()}
		r := httptest.NewRequest("POST", "/v1/chat/completions", nil).WithContext(context.WithValue(context.Background(), stateKey{}, st))
		if up := p.Select(pool, r, httptest.NewRecorder()); up == nil {
			t.Fatalf("%s: not routed: %+v", model, st.shed)
		}
		st.current.release()
		return req.Hashes
	}
	asSent := func(model string) []uint64 { return mustParse(t, body(model)).Hashes }

	llama := routed(p, pool, `"model":"llama",`)
	if len(llama) < 10 || !slices.Equal(llama, asSent(`"model":"llama",`)) {
		t.Fatal("the model's smallest name no longer hashes as sent")
	}
	for _, model := range []string{`"model":"llama-3.1-8b",`, ``, `"model":"",`, `"model":null,`} {
		if !slices.Equal(routed(p, pool, model), llama) {
			t.Errorf("{%s...} hashes unlike llama", model)
		}
	}
	if slices.Equal(asSent(`"model":"llama-3.1-8b",`), llama) {
		t.Fatal("the names hash alike as sent: the test shows nothing")
	}
	adapter := routed(p, pool, `"model":"sql-lora",`)
	if slices.Equal(adapter, llama) || !slices.Equal(adapter, asSent(`"model":"sql-lora",`)) {
		t.Error("the adapter does not keep its own hashes")
	}

	// A model served under one name hashes as sent, as it always did; a
	// request naming none, as one naming it.
	var noDelay atomic.Int64
	solo, soloPool := scrapedPolicy(t, listingEngine(t, func() string { return "solo" }, &noDelay))
	if got := routed(solo, soloPool, `"model":"solo",`); !slices.Equal(got, asSent(`"model":"solo",`)) {
		t.Error("a model served under one name no longer hashes as sent")
	}
	if got := routed(solo, soloPool, ``); !slices.Equal(got, asSent(`"model":"solo",`)) {
		t.Error("no model hashes unlike the one model served")
	}

	// Without model lists (no scraping), as sent.
	plain := testPolicy(t, zap.NewNop())
	if got := routed(plain, pool, `"model":"llama-3.1-8b",`); !slices.Equal(got, asSent(`"model":"llama-3.1-8b",`)) {
		t.Error("without lists, a name did not hash as sent")
	}
}

// TestPassThroughToADrainingHomeEndsTheAttemptBefore: a request passed
// through whose retry goes to a draining upstream (a stored response's
// home, which alone has the response) is no longer in flight where its
// attempt before went: that upstream's drain does not wait for it (nor
// would its deadline cut it, at the home).
func TestPassThroughToADrainingHomeEndsTheAttemptBefore(t *testing.T) {
	p := testPolicy(t, zap.NewNop())
	pt := &passThrough{cancel: func(error) { t.Error("the request was cut") }}
	r := httptest.NewRequest("GET", "/v1/responses/resp_1", nil)
	op := drain.Hold{Cause: drain.ByAdmin}
	p.enterPassThrough(r, pt, "a:1")
	p.sh.drains.Drain("home:1", time.Hour, op)
	p.enterPassThrough(r, pt, "home:1") // the retry, after a refused dial, say
	p.sh.drains.Drain("a:1", time.Hour, op)
	if phase := p.sh.drains.Phase("a:1"); phase != drain.Drained {
		t.Fatalf("a:1 is %v after its drain, want drained: the request left it", phase)
	}
	pt.end()
}
