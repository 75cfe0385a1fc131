package router

import (
	"math"
	"testing"
	"time"

	"github.com/llmaffinity/caddy-llm-affinity/prefixindex"
	"github.com/llmaffinity/caddy-llm-affinity/scorer"
	"github.com/llmaffinity/caddy-llm-affinity/scrape"
)

// The fleet takes numbers from clients, engines and peers; wrong ones must
// not make its accounting wrap around or hold a model hostage.

// TestAbsurdUsageIsNotLearned: one response reporting an output no model
// can generate, or a negative one, teaches nothing: the next requests of
// the model are still routed, and no charge goes negative.
func TestAbsurdUsageIsNotLearned(t *testing.T) {
	for _, bad := range []int{1_000_000_000_000, -1_000_000} {
		f := New()
		opts := Options{}.WithDefaults()
		ms := members("a", "b")
		for i := range ms {
			ms[i].Hardware.KVCapacityTokens = 1 << 20
		}
		req := Request{Hashes: hashes(1, 512), BlockTokens: 64, PromptTokens: 512, Model: "m"}
		d := f.Decide(t0, req, ms, &opts, rng(), nil)
		f.Complete(d.Charge, "m", Usage{OutputTokens: bad}, t0)
		d = f.Decide(t0.Add(time.Second), req, ms, &opts, rng(), nil)
		if d.Charge == nil {
			t.Fatalf("usage %d: the next request of the model was not routed: %+v", bad, d.Decision)
		}
		if u := state(t, f, d.Charge.Dial()); u.QueuedDecodeTokens != opts.OutputTokens || u.KVTokensInFlight < 0 {
			t.Fatalf("usage %d: the estimate learned it: %+v", bad, u)
		}
	}
}

// TestCompleteLearnsOnce: a second Complete of the same charge, or one
// after its Release, learns nothing.
func TestCompleteLearnsOnce(t *testing.T) {
	f := New()
	opts := Options{}.WithDefaults()
	d := f.Decide(t0, Request{PromptTokens: 10, Model: "m"}, members("a"), &opts, rng(), nil)
	f.Complete(d.Charge, "m", Usage{OutputTokens: 100}, t0)
	f.Complete(d.Charge, "m", Usage{OutputTokens: 100}, t0)
	d = f.Decide(t0, Request{PromptTokens: 10, Model: "m"}, members("a"), &opts, rng(), nil)
	served(f, d.Charge, t0)
	f.Complete(d.Charge, "m", Usage{OutputTokens: 100}, t0)
	if n := f.models["m"].output.n; n != 1 {
		t.Fatalf("%d samples learned from one completion", n)
	}
}

// TestAbsurdEngineQueue: an engine reporting an absurd queue makes its
// upstream look busy, never idle: the sizes of its foreign requests do not
// wrap around, under any strategy.
func TestAbsurdEngineQueue(t *testing.T) {
	for _, o := range []scorer.Options{
		{Strategy: scorer.TTFT},
		{Strategy: scorer.TTFT, ImposedDelayWeight: -1, DecodeWeight: -1},
		{Strategy: scorer.Dynamo},
		{Strategy: scorer.LeastWork},
	} {
		f := New()
		opts := Options{Scorer: o}.WithDefaults()
		ms := members("a", "b")
		for range 3 { // a mean prompt of 1,000 tokens
			d := f.Decide(t0, Request{PromptTokens: 1000, Model: "m"}, ms, &opts, rng(), nil)
			served(f, d.Charge, t0)
		}
		ms[0].Engine = &scrape.Signals{Running: 0, Waiting: 1e16}
		ms[1].Engine = &scrape.Signals{Running: 4, Waiting: 2}
		if d := f.Decide(t0, Request{PromptTokens: 1000, Model: "m"}, ms, &opts, rng(), nil); d.Chosen != 1 {
			t.Errorf("%s: the upstream reporting 1e16 waiting requests won: %+v", o.Strategy, d.Decision)
		}
	}
}

// TestHugeMaxTokens: a max_tokens near the largest integer, with the
// max_tokens output estimate, does not wrap the KV need around: it does
// not fit a nearly full replica, and charges stay positive.
func TestHugeMaxTokens(t *testing.T) {
	f := New()
	opts := Options{OutputEstimate: OutputMaxTokens}.WithDefaults()
	ms := members("a")
	ms[0].Hardware.KVCapacityTokens = 10_000
	f.Decide(t0, Request{PromptTokens: 9_900, MaxTokens: 50}, ms, &opts, rng(), nil)
	if d := f.Decide(t0, Request{PromptTokens: 100, MaxTokens: math.MaxInt64}, ms, &opts, rng(), nil); d.Charge != nil {
		t.Fatalf("max_tokens %d fit a replica with 50 tokens free: %+v", math.MaxInt64, d.Decision)
	}
	if u := state(t, f, "a"); u.KVTokensInFlight != 9_950 || u.QueuedDecodeTokens != 50 {
		t.Fatalf("charges %+v", u)
	}
}

// TestRestartReportedByTwoScrapers: two scrapers of one upstream (two
// sites, or a reload's old and new config), one of which saw a restart,
// forget the index once, not each time the other one's view comes in.
func TestRestartReportedByTwoScrapers(t *testing.T) {
	f := New()
	opts := Options{}.WithDefaults()
	req := Request{Hashes: hashes(3, 512), BlockTokens: 64, PromptTokens: 512, MaxTokens: 8, Model: "m"}
	siteA, siteB := members("a"), members("a")
	siteA[0].Engine = &scrape.Signals{Running: -1, Waiting: -1}
	siteB[0].Engine = &scrape.Signals{Running: -1, Waiting: -1}
	served(f, f.Decide(t0, req, siteA, &opts, rng(), nil).Charge, t0)
	siteA[0].Engine.LastRestart = t0.Add(time.Second) // site A's scraper sees the engine restart
	cold := 0
	for i := range 10 {
		ms := siteA
		if i%2 == 1 {
			ms = siteB
		}
		d := f.Decide(t0.Add(time.Duration(2+i)*time.Second), req, ms, &opts, rng(), nil)
		if d.MatchedTokens == 0 {
			cold++
		}
		served(f, d.Charge, t0)
	}
	if u := state(t, f, "a"); cold != 1 || u.IndexResets != 1 {
		t.Fatalf("one restart: %d cold decisions, %d index resets", cold, u.IndexResets)
	}
}

// TestStaleScrapeKeepsTheEnginesCapacity: while an engine's scrape is
// stale the index keeps the capacity the engine reported, rather than
// shrink to the configured one and evict what the engine holds.
func TestStaleScrapeKeepsTheEnginesCapacity(t *testing.T) {
	f := New()
	opts := Options{}.WithDefaults()
	ms := members("a")
	ms[0].Hardware.KVCapacityTokens = 64 * 64 // configured: 64 blocks
	fresh := &scrape.Signals{Running: 0, Waiting: 0, KVKnown: true, BlockSize: 16, NumGPUBlocks: 4096}
	var reqs []Request
	for i := range 20 {
		reqs = append(reqs, Request{Hashes: hashes(uint64(i), 512), BlockTokens: 64, PromptTokens: 512, MaxTokens: 1, Model: "m"})
	}
	ms[0].Engine = fresh
	for _, r := range reqs {
		served(f, f.Decide(t0, r, ms, &opts, rng(), nil).Charge, t0)
	}
	ms[0].Engine = nil // one decision while the scrape is stale
	ms[0].Scraped = true
	served(f, f.Decide(t0.Add(time.Second), reqs[19], ms, &opts, rng(), nil).Charge, t0)
	ms[0].Engine = fresh
	for i, r := range reqs {
		d := f.Decide(t0.Add(2*time.Second), r, ms, &opts, rng(), nil)
		if d.MatchedTokens == 0 {
			t.Fatalf("prompt %d forgotten after one stale scrape", i)
		}
		served(f, d.Charge, t0)
	}
}

// TestSitesDisagreeingOnCapacity: two sites configuring different KV
// capacities for one upstream do not resize its index in turn (each
// decision through the smaller one evicted what the larger one let it
// hold): the index keeps the largest.
func TestSitesDisagreeingOnCapacity(t *testing.T) {
	f := New()
	opts := Options{}.WithDefaults()
	big, small := members("a"), members("a")
	big[0].Hardware.KVCapacityTokens = 1_000_000
	small[0].Hardware.KVCapacityTokens = 1_000
	var reqs []Request
	for i := range 40 {
		reqs = append(reqs, Request{Hashes: hashes(uint64(50+i), 512), BlockTokens: 64, PromptTokens: 512, MaxTokens: 1, Model: "m"})
	}
	for _, r := range reqs {
		served(f, f.Decide(t0, r, big, &opts, rng(), nil).Charge, t0)
	}
	served(f, f.Decide(t0, Request{Hashes: hashes(999, 128), BlockTokens: 64, PromptTokens: 128, MaxTokens: 1, Model: "m"}, small, &opts, rng(), nil).Charge, t0)
	for i, r := range reqs {
		d := f.Decide(t0, r, big, &opts, rng(), nil)
		if d.MatchedTokens != 512 {
			t.Fatalf("prompt %d matched %d tokens after one decision through the smaller site", i, d.MatchedTokens)
		}
		served(f, d.Charge, t0)
	}
}

// TestLoweredCapacityShrinksTheIndex: a configured capacity that no
// decision uses any more (a reload lowered it) gives way, capacityMemory
// after its last use, to the one in use: the index no longer believes in
// prefixes the smaller cache cannot hold, and the admin view says so.
func TestLoweredCapacityShrinksTheIndex(t *testing.T) {
	f := New()
	opts := Options{}.WithDefaults()
	big, small := members("a"), members("a")
	big[0].Hardware.KVCapacityTokens = 131_072
	small[0].Hardware.KVCapacityTokens = 4096
	req := func(seed uint64) Request {
		return Request{Hashes: hashes(seed, 512), BlockTokens: 64, PromptTokens: 512, MaxTokens: 1, Model: "m"}
	}
	served(f, f.Decide(t0, req(1), big, &opts, rng(), nil).Charge, t0)
	capacity := func() int { return state(t, f, "a").KVCapacityTokens }
	soon := t0.Add(capacityMemory / 2)
	served(f, f.Decide(soon, req(2), small, &opts, rng(), nil).Charge, soon)
	if got := capacity(); got != 131_072 {
		t.Fatalf("within capacityMemory of the larger figure's use: index sized for %d, want 131072", got)
	}
	later := soon.Add(capacityMemory)
	served(f, f.Decide(later, req(3), small, &opts, rng(), nil).Charge, later)
	if got := capacity(); got != 4096 {
		t.Fatalf("the larger figure unused for longer than capacityMemory: index sized for %d, want 4096", got)
	}
}

// TestConfigureResizesAtOnce: the loaded configurations' figure, given
// when they change (a reload), sizes the index at once, down as well as
// up: decisions alone kept a lowered figure's index for capacityMemory,
// and showed a raised one only once they routed. When the caller scrapes,
// the engine's own figure stays. An upstream nothing hashed for yet takes
// the figure, and its first decision the block size. A figure that
// lapses (no loaded config gives one) leaves the capacity unknown.
func TestConfigureResizesAtOnce(t *testing.T) {
	f := New()
	opts := Options{}.WithDefaults()
	ms := members("a")
	ms[0].Hardware.KVCapacityTokens = 131_072
	req := Request{Hashes: hashes(1, 512), BlockTokens: 64, PromptTokens: 512, MaxTokens: 1, Model: "m"}
	served(f, f.Decide(t0, req, ms, &opts, rng(), nil).Charge, t0)
	check := func(when string, tokens, blocks int) {
		t.Helper()
		if s := state(t, f, "a"); s.KVCapacityTokens != tokens || s.IndexCapacityBlocks != blocks {
			t.Fatalf("%s: index sized for %d tokens, %d blocks; want %d, %d", when, s.KVCapacityTokens, s.IndexCapacityBlocks, tokens, blocks)
		}
	}
	check("routed", 131_072, 2048)

	soon := t0.Add(time.Second)
	f.Configure("a", 4096, false, soon)
	check("lowered", 4096, 64)
	ms[0].Hardware.KVCapacityTokens = 4096
	served(f, f.Decide(soon, req, ms, &opts, rng(), nil).Charge, soon)
	check("lowered, then routed", 4096, 64)
	f.Configure("a", 262_144, false, soon)
	check("raised", 262_144, 4096)

	// Scraped: the engine's figure, once a decision read it, wins.
	ms[0].Engine = &scrape.Signals{KVKnown: true, BlockSize: 16, NumGPUBlocks: 2048}
	served(f, f.Decide(soon, req, ms, &opts, rng(), nil).Charge, soon)
	check("the engine's figure", 32_768, 512)
	f.Configure("a", 262_144, true, soon)
	check("configured while scraped", 32_768, 512)
	// No figure any more (a reload removed kv_capacity and the scraping):
	// the capacity is unknown, as at a fresh start, and the index takes
	// its default size; it kept the lapsed figure, which the admin view
	// showed as the capacity the filter used.
	f.Configure("a", 0, false, soon)
	check("no figure given", 0, prefixindex.DefaultCapacity)
	if d := f.Decide(soon, req, members("a"), &opts, rng(), nil); d.Charge == nil {
		t.Fatalf("routed with the capacity unknown: %+v", d)
	} else {
		served(f, d.Charge, soon)
	}
	check("no figure given, then routed", 0, prefixindex.DefaultCapacity)
	f.Configure("a", 4096, false, soon)
	check("given again", 4096, 64)

	// Not routed to yet: the figure at once, the blocks with the first
	// decision.
	f.Name("b", t0)
	f.Configure("b", 8192, false, soon)
	if s := state(t, f, "b"); s.KVCapacityTokens != 8192 {
		t.Fatalf("not routed to yet: capacity %d, want 8192", s.KVCapacityTokens)
	}
	mb := members("b")
	mb[0].Hardware.KVCapacityTokens = 8192
	served(f, f.Decide(soon, req, mb, &opts, rng(), nil).Charge, soon)
	if s := state(t, f, "b"); s.KVCapacityTokens != 8192 || s.IndexCapacityBlocks != 128 {
		t.Fatalf("first routed: %d tokens, %d blocks; want 8192, 128", s.KVCapacityTokens, s.IndexCapacityBlocks)
	}
}

// TestSmallerBlocksGiveWay: an index sized for a smaller block size (a
// site, or a peer router, hashing with smaller blocks) keeps it while
// requests use it within capacityMemory, and takes the larger one back
// once they have not for longer: a router's brief reload to smaller blocks
// left every router's index at twice the engine's cache until restart.
func TestSmallerBlocksGiveWay(t *testing.T) {
	f := New()
	opts := Options{}.WithDefaults()
	ms := members("a")
	ms[0].Hardware.KVCapacityTokens = 131_072
	route := func(at time.Time, blockTokens int) {
		t.Helper()
		req := Request{Hashes: hashes(uint64(at.UnixNano()), 8), BlockTokens: blockTokens, PromptTokens: 8 * blockTokens, MaxTokens: 1}
		d := f.Decide(at, req, ms, &opts, rng(), nil)
		if d.Charge == nil {
			t.Fatalf("not routed: %+v", d)
		}
		served(f, d.Charge, at)
	}
	blocks := func(when string, want int) {
		t.Helper()
		if got := state(t, f, "a").IndexCapacityBlocks; got != want {
			t.Fatalf("%s: index of %d blocks, want %d", when, got, want)
		}
	}
	route(t0, 64)
	blocks("64-token blocks", 2048)
	route(t0.Add(time.Second), 32)
	blocks("32-token blocks", 4096)
	at := t0.Add(time.Second + capacityMemory/2)
	route(at, 64)
	blocks("64 while 32 was used within capacityMemory", 4096)
	at = at.Add(capacityMemory)
	route(at, 64)
	blocks("32 unused for longer than capacityMemory", 2048)

	// A peer's events count as uses.
	at = at.Add(time.Second)
	f.Apply("peer", Event{Kind: EventRouted, ID: 1, Dial: "a", Hashes: hashes(7, 4), BlockTokens: 32, Prefill: 128, Decode: 1, KV: 129}, at)
	blocks("a peer's 32-token blocks", 4096)
	route(at.Add(capacityMemory/2), 64)
	blocks("64 soon after the peer's 32", 4096)
	route(at.Add(2*capacityMemory), 64)
	blocks("the peer's 32 unused for longer than capacityMemory", 2048)
}
