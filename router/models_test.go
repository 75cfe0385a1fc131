package router

import (
	"fmt"
	"math"
	"runtime"
	"slices"
	"testing"
	"time"

	"github.com/llmaffinity/caddy-llm-affinity/scorer"
	"github.com/llmaffinity/caddy-llm-affinity/scrape"
)

// The engines' usage reports teach a model's bytes per token: a text
// prompt estimated at the configured 4 bytes a token, on an engine that
// counts 2, is charged at the engine's count once three responses said
// so, and so is the prefix an upstream holds. Prompts of token ids and
// other models keep the caller's count.
func TestLearnedBytesPerToken(t *testing.T) {
	f := New()
	opts := Options{OutputTokens: 10}.WithDefaults()
	text := func(seed uint64) Request {
		return Request{Hashes: hashes(seed, 1024), BlockTokens: 64, PromptTokens: 1024, PromptBytes: 4096, MaxTokens: 10, Model: "code"}
	}
	now := t0
	for i := range 3 {
		if _, ok := f.BytesPerToken("code"); ok {
			t.Fatalf("learned after %d responses", i)
		}
		d := f.Decide(now, text(uint64(i)), members("a"), &opts, rng(), nil)
		if got := state(t, f, "a").QueuedPrefillTokens; got != 1024 {
			t.Fatalf("before learning, response %d charged %d prefill tokens, want the estimate 1024", i, got)
		}
		f.Complete(d.Charge, "code", Usage{PromptTokens: 2048, OutputTokens: 10}, now)
		now = now.Add(time.Second)
	}
	if bpt, ok := f.BytesPerToken("code"); !ok || math.Abs(bpt-2) > 1e-9 {
		t.Fatalf("learned %v bytes per token (%v), want 2", bpt, ok)
	}

	// A new prompt: all of it is charged at the learned rate.
	d := f.Decide(now, text(100), members("a"), &opts, rng(), nil)
	if got := state(t, f, "a").QueuedPrefillTokens; got != 2048 {
		t.Errorf("after learning, a cold 4096-byte prompt charged %d prefill tokens, want 2048", got)
	}
	served(f, d.Charge, now)
	// The same prompt again: its whole prefix is held, at the same scale.
	d = f.Decide(now, text(100), members("a"), &opts, rng(), nil)
	if d.MatchedTokens != 2048 || state(t, f, "a").QueuedPrefillTokens != 0 {
		t.Errorf("a repeated prompt matched %d tokens and charged %d, want 2048 and 0", d.MatchedTokens, state(t, f, "a").QueuedPrefillTokens)
	}
	served(f, d.Charge, now)

	ids := text(200)
	ids.PromptBytes = 0 // token ids: exact
	d = f.Decide(now, ids, members("a"), &opts, rng(), nil)
	if got := state(t, f, "a").QueuedPrefillTokens; got != 1024 {
		t.Errorf("a prompt of token ids charged %d, want its exact 1024", got)
	}
	served(f, d.Charge, now)
	other := text(300)
	other.Model = "prose"
	d = f.Decide(now, other, members("a"), &opts, rng(), nil)
	if got := state(t, f, "a").QueuedPrefillTokens; got != 1024 {
		t.Errorf("another model charged %d, want the configured estimate 1024", got)
	}
	served(f, d.Charge, now)
}

// One odd usage report (a proxy that rewrote the prompt, a prompt of
// emoji) moves the learned ratio by a bounded step, and nonsense is
// ignored.
func TestLearnedBytesPerTokenIsRobust(t *testing.T) {
	var m modelStats
	for range 30 {
		m.learnPrompt(4000, 1000)
	}
	m.learnPrompt(4000, 40) // 100 bytes a token
	if v := m.bytesPerToken.value; v > 4*1.06 {
		t.Errorf("one outlier moved 4 bytes per token to %v", v)
	}
	before := m.bytesPerToken
	m.learnPrompt(0, 1000)   // token ids
	m.learnPrompt(4000, 0)   // no usage reported
	m.learnPrompt(100, 20)   // mostly chat template
	m.learnPrompt(-5, -1000) // nonsense
	if m.bytesPerToken != before {
		t.Errorf("ignored reports changed the ratio: %+v, was %+v", m.bytesPerToken, before)
	}
	for range 200 {
		m.learnPrompt(1_000_000, 32) // beyond any tokenizer
	}
	if v := m.bytesPerToken.value; v > maxBytesPerToken {
		t.Errorf("ratio %v beyond its bound %v", v, maxBytesPerToken)
	}
}

// An engine's report of more prompt tokens than the prompt has bytes (an
// absurd usage, up to MaxTokens and beyond) weighs no more than the
// prompt's bytes: weighed by its count, one such report outweighed
// hundreds of later ones, and the model's prompts were estimated at
// twice their tokens for as long.
func TestAbsurdPromptCountWeighsLittle(t *testing.T) {
	for _, absurd := range []int{MaxTokens, 1 << 62} {
		var m modelStats
		for range 30 {
			m.learnPrompt(4000, 1000)
		}
		m.learnPrompt(4000, absurd)
		for range 30 {
			m.learnPrompt(4000, 1000)
		}
		if v := m.bytesPerToken.value; math.Abs(v-4) > 0.2 {
			t.Errorf("a report of %d tokens for 4,000 bytes: 30 reports of 4 bytes a token later, the ratio is %v", absurd, v)
		}
	}
}

// The per-model table is bounded: a client sending a new model name with
// every request, each answered, never grows it past maxModels, and the
// models in use stay.
func TestModelTableIsBounded(t *testing.T) {
	f := New()
	opts := Options{OutputTokens: 10}.WithDefaults()
	for i := range 3 * maxModels {
		req := Request{Hashes: hashes(uint64(i), 64), BlockTokens: 64, PromptTokens: 64, Model: fmt.Sprint("m", i)}
		d := f.Decide(t0, req, members("a"), &opts, rng(), nil)
		f.Complete(d.Charge, req.Model, Usage{OutputTokens: 5}, t0)
		// The steady model is used between every new one.
		steady := Request{Hashes: hashes(1, 64), BlockTokens: 64, PromptTokens: 64, Model: "steady"}
		d = f.Decide(t0, steady, members("a"), &opts, rng(), nil)
		f.Complete(d.Charge, "steady", Usage{OutputTokens: 7}, t0)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.models) > maxModels {
		t.Errorf("%d models remembered, bound %d", len(f.models), maxModels)
	}
	if m := f.models["steady"]; m == nil || m.output.value != 7 {
		t.Errorf("the model in use was evicted: %+v", m)
	}
}

// TestModelLookupAgreesWithTheTable: the model the last lookup found,
// kept apart, is always the table's entry of its name, also once evicted.
func TestModelLookupAgreesWithTheTable(t *testing.T) {
	f := New()
	f.mu.Lock()
	defer f.mu.Unlock()
	names := []string{"steady"}
	for i := range maxModels + 8 {
		names = append(names, fmt.Sprint("m", i))
		f.model(names[len(names)-1], true)
		f.model("steady", true).output.add(float64(i))
	}
	for _, name := range append(names, "never") {
		if got, want := f.model(name, false), f.models[name]; got != want {
			t.Fatalf("%s: the lookup found %p, the table holds %p", name, got, want)
		}
	}
	// The last one found, evicted as the oldest (which the clock keeps
	// from happening), is not found after.
	last := f.model("m20", false)
	last.used = 0
	f.model("new", true)
	if f.models["m20"] != nil || f.model("m20", false) != nil {
		t.Fatal("an evicted model was still found")
	}
}

// TestShortTurnsDoNotDecideTheRatio: an agent's short turns are mostly
// chat template, whose tokens have no bytes in the request, so their
// ratio is far below the text's. Three of them do not make the ratio
// learned, and the first long prompt outweighs them.
func TestShortTurnsDoNotDecideTheRatio(t *testing.T) {
	var m modelStats
	for range 3 {
		m.learnPrompt(80, 80) // a tool call's turn: 1 byte a token
	}
	if m.bytesPerToken.learned() {
		t.Fatalf("three 80-token turns made the ratio learned: %+v", m.bytesPerToken)
	}
	m.learnPrompt(18_000, 4000) // a document: 4.5 bytes a token
	if v := m.bytesPerToken.value; !m.bytesPerToken.learned() || v < 4.2 || v > 4.5 {
		t.Fatalf("after a 4,000-token prompt: %+v, want learned near 4.5", m.bytesPerToken)
	}
}

// TestModelNames: the names of one base model (its root) seed alike, with
// the smallest, whatever the lists' order; a request naming no model
// seeds as the base model when the lists show one; adapters, names the
// lists dispute and names they do not give stay themselves, as does
// everything before any list came.
func TestModelNames(t *testing.T) {
	base := func(id, root string) scrape.ModelInfo { return scrape.ModelInfo{ID: id, Root: root} }
	adapter := func(id, parent string) scrape.ModelInfo {
		return scrape.ModelInfo{ID: id, Root: "/adapters/" + id, Parent: parent}
	}
	for _, tc := range []struct {
		name  string
		lists [][]scrape.ModelInfo
		want  map[string]string // a request's model: its seed name
	}{
		{"no lists yet", nil, map[string]string{"llama": "llama", "": "", "x": "x"}},
		{"empty lists", [][]scrape.ModelInfo{{}, {}}, map[string]string{"llama": "llama", "": ""}},
		{"one name", [][]scrape.ModelInfo{{base("llama", "/models/llama")}, {base("llama", "/models/llama")}},
			map[string]string{"llama": "llama", "": "llama", "llama-3.1-8b": "llama-3.1-8b"}},
		{"vLLM without served names", [][]scrape.ModelInfo{{base("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-8B-Instruct")}},
			map[string]string{"meta-llama/Llama-3.1-8B-Instruct": "meta-llama/Llama-3.1-8B-Instruct", "": "meta-llama/Llama-3.1-8B-Instruct"}},
		{"no root given", [][]scrape.ModelInfo{{{ID: "llama"}}}, map[string]string{"llama": "llama", "": "llama"}},
		{"aliases", [][]scrape.ModelInfo{
			{base("llama-3.1-8b", "/models/llama"), base("llama", "/models/llama"), adapter("sql-lora", "llama-3.1-8b")},
			{base("llama", "/models/llama")},
		}, map[string]string{"llama-3.1-8b": "llama", "llama": "llama", "": "llama", "sql-lora": "sql-lora", "/models/llama": "/models/llama", "x": "x"}},
		{"aliases on different engines", [][]scrape.ModelInfo{{base("b", "/m")}, {base("c", "/m")}, {base("a", "/m")}},
			map[string]string{"a": "a", "b": "a", "c": "a", "": "a"}},
		{"two base models", [][]scrape.ModelInfo{
			{base("llama", "/models/llama"), base("llama-3.1-8b", "/models/llama")},
			{base("qwen", "/models/qwen"), base("qwen-7b", "/models/qwen")},
		}, map[string]string{"llama-3.1-8b": "llama", "qwen-7b": "qwen", "qwen": "qwen", "": ""}},
		{"a name with two roots", [][]scrape.ModelInfo{{base("x", "/m1")}, {base("x", "/m2"), base("y", "/m2")}},
			map[string]string{"x": "x", "y": "y", "": ""}},
		{"a name an adapter elsewhere", [][]scrape.ModelInfo{
			{base("a-name", "/m"), base("z-name", "/m")},
			{base("z-name", "/m"), adapter("a-name", "z-name")},
		}, map[string]string{"a-name": "a-name", "z-name": "z-name", "": "z-name"}},
	} {
		check := func(order string, n *ModelNames) {
			for model, want := range tc.want {
				if got := n.Seed(model); got != want {
					t.Errorf("%s (%s): %q seeds as %q, want %q", tc.name, order, model, got, want)
				}
			}
		}
		check("as listed", NewModelNames(tc.lists...))
		// Every router reads the engines' lists in its own order.
		reversed := make([][]scrape.ModelInfo, len(tc.lists))
		for i, l := range tc.lists {
			r := slices.Clone(l)
			slices.Reverse(r)
			reversed[len(tc.lists)-1-i] = r
		}
		check("reversed", NewModelNames(reversed...))
	}
	var none *ModelNames
	if none.Seed("llama") != "llama" || none.Seed("") != "" {
		t.Error("a nil table renames")
	}
}

// TestModelNamesOfOneNameAreEmpty: a model served under one name, with
// adapters or not, is no entry of the table (its hashes stay as they
// were, and the lookup finds nothing).
func TestModelNamesOfOneNameAreEmpty(t *testing.T) {
	n := NewModelNames([]scrape.ModelInfo{{ID: "llama", Root: "/m"}, {ID: "tenant", Root: "/a/tenant", Parent: "llama"}}, []scrape.ModelInfo{{ID: "llama", Root: "/m"}})
	if len(n.canonical) != 0 || n.omitted != "llama" {
		t.Fatalf("table %+v, want no entries and llama for no model", n)
	}
}

// BenchmarkModelNamesSeed is the per-request cost of a model's seed
// name: a lookup in the table read from the lists.
func BenchmarkModelNamesSeed(b *testing.B) {
	list := []scrape.ModelInfo{{ID: "llama-3.1-8b", Root: "/m"}, {ID: "llama", Root: "/m"}}
	for i := range 32 {
		list = append(list, scrape.ModelInfo{ID: fmt.Sprintf("tenant-%d", i), Root: "/a", Parent: "llama"})
	}
	n := NewModelNames(list, list)
	for _, model := range []string{"llama", "llama-3.1-8b", "tenant-7", ""} {
		b.Run("model="+model, func(b *testing.B) {
			for b.Loop() {
				_ = n.Seed(model)
			}
		})
	}
}

// TestLongModelListsAreNotCopied: an engine may list thousands of models
// (adapters, or a misbehaving engine); a decision reads each list through
// what was derived from it once, where it copied every list's ids for
// each candidate and searched them from the start: with 20,000 models a
// decision took 2 ms under the fleet's lock, and a release as long for
// each request held at the gateway.
func TestLongModelListsAreNotCopied(t *testing.T) {
	const n = 10_000
	list := []scrape.ModelInfo{{ID: "base", MaxModelLen: 4096}}
	for i := range n - 1 {
		list = append(list, scrape.ModelInfo{ID: fmt.Sprint("ad-", i), Parent: "base"})
	}
	ms := members("a", "b", "c", "d")
	for i := range ms {
		ms[i].Engine = &scrape.Signals{Running: -1, Waiting: -1, Models: list}
	}
	f := New()
	opts := Options{}.WithDefaults()
	decide := func(model string, prompt int) Decision {
		d := f.Decide(t0, Request{Hashes: hashes(1, 256), BlockTokens: 64, PromptTokens: prompt, Model: model}, ms, &opts, rng(), nil)
		if d.Charge != nil {
			served(f, d.Charge, t0)
		}
		return d
	}
	// What the lists say still holds: an adapter is one (and has its
	// base's context), a model none lists is not served.
	if d := decide("ad-9000", 256); d.Charge == nil || d.Reason != scorer.Adapter {
		t.Errorf("a listed adapter: %+v", d.Decision)
	}
	if d := decide("ad-9000", 5000); d.Charge != nil || !d.TooLong {
		t.Errorf("an adapter's prompt beyond its base's context: %+v", d.Decision)
	}
	if d := decide("nobody", 256); d.Charge != nil || !d.Unservable {
		t.Errorf("a model no list names: %+v", d.Decision)
	}
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	const decisions = 50
	for range decisions {
		decide("base", 256)
	}
	runtime.ReadMemStats(&after)
	// Copying one list's ids is 160 KB.
	if per := (after.TotalAlloc - before.TotalAlloc) / decisions; per > 16<<10 {
		t.Errorf("a decision among 4 engines listing %d models each allocated %d bytes", n, per)
	}
}

// TestModelListIndexAgrees: what a decision derives from a model list
// answers as the list itself does (scrape.ContextTokens, the first entry
// of an id given twice), for every id, and for a list replaced.
func TestModelListIndexAgrees(t *testing.T) {
	lists := [][]scrape.ModelInfo{
		{{ID: "base", MaxModelLen: 4096}, {ID: "a", Parent: "base"}, {ID: "b", Parent: "base", MaxModelLen: 1024},
			{ID: "orphan", Parent: "gone"}, {ID: "base", MaxModelLen: 8192}, {ID: "plain"}},
		{{ID: "other", MaxModelLen: 100}, {ID: "a", Parent: "other"}},
		{},
	}
	// The first again, long enough to be searched through its index.
	long := slices.Clone(lists[0])
	for i := range shortModelList {
		long = append(long, scrape.ModelInfo{ID: fmt.Sprintf("filler-%d", i), Parent: "base"})
	}
	lists = append(lists, long)
	u := new(upstream)
	// Each list read twice in a row, and the last two in turn, so that
	// both cached entries are read back, not only made.
	var reads [][]scrape.ModelInfo
	for _, list := range lists {
		reads = append(reads, list, list)
	}
	reads = append(reads, lists[0], lists[3], lists[0], lists[3])
	for round := range 2 {
		for _, list := range reads {
			l := u.models(list)
			for _, id := range []string{"base", "a", "b", "orphan", "plain", "other", "gone", ""} {
				if got, want := l.contextTokens(id), scrape.ContextTokens(list, id); got != want {
					t.Errorf("round %d, list %v: context of %q %d, want %d", round, list, id, got, want)
				}
				i := slices.IndexFunc(list, func(m scrape.ModelInfo) bool { return m.ID == id })
				if m := l.find(id); (m == nil) != (i < 0) || m != nil && m != &list[i] {
					t.Errorf("round %d, list %v: %q found as %v, want entry %d", round, list, id, m, i)
				}
			}
			if !slices.Equal(l.ids, scrape.ModelIDs(list)) {
				t.Errorf("round %d: ids %v of list %v", round, l.ids, list)
			}
		}
	}
	if l := u.models(nil); l.ids != nil || l.find("base") != nil {
		t.Errorf("an unknown list read as %+v", l)
	}
}

// TestOutputStillToCome: a response that has generated as much as
// expected, or more, is not about to end: the output still charged for it
// is what the responses seen beyond its length generated beyond it, no
// more than its max_tokens leaves, and the same on a peer applying its
// events. Short and long responses alike (half of 50 tokens, half of
// 1,000) are expected at their mean; past 50 a response is one of the
// long, with 1,000 − k to go. A configured estimate stays as configured.
func TestOutputStillToCome(t *testing.T) {
	f, peer := New(), New()
	peer.Name("a", t0)
	var events []Event
	f.SetPublisher(func(ev Event) { events = append(events, ev) })
	opts := Options{}.WithDefaults()
	ms := members("a")
	for i := range 40 {
		d := f.Decide(t0, Request{Model: "m", PromptTokens: 100}, ms, &opts, rng(), nil)
		f.Progress(d.Charge, 1, t0)
		f.Complete(d.Charge, "m", Usage{PromptTokens: 100, OutputTokens: []int{50, 1000}[i%2]}, t0)
	}
	d := f.Decide(t0, Request{Model: "m", PromptTokens: 100}, ms, &opts, rng(), nil)
	capped := f.Decide(t0, Request{Model: "m", PromptTokens: 100, MaxTokens: 700}, ms, &opts, rng(), nil)
	for _, ev := range events {
		peer.Apply("r1", ev, t0)
	}
	events = events[:0]
	mean := state(t, f, "a").QueuedDecodeTokens / 2
	if mean < 400 || mean > 650 {
		t.Fatalf("expected output %d at the start, want about the mean of 50 and 1,000", mean)
	}
	for _, step := range []struct{ tokens, want, wantCapped int }{
		{100, 900, 600}, // past every short one: a long one's rest
		{300, 700, 400},
		{600, 400, 100},
		{990, 10, 0}, // the capped one is past its max_tokens
	} {
		for _, c := range []*Charge{d.Charge, capped.Charge} {
			f.Progress(c, step.tokens-c.Tokens, t0)
		}
		for _, ev := range events {
			peer.Apply("r1", ev, t0)
		}
		events = events[:0]
		got := state(t, f, "a").QueuedDecodeTokens
		if got != step.want+step.wantCapped {
			t.Errorf("after %d tokens: %d still charged, want %d + %d (max_tokens 700)", step.tokens, got, step.want, step.wantCapped)
		}
		// The peer knows no max_tokens: it charges both as uncapped.
		if got := state(t, peer, "a").QueuedDecodeTokens; got < 2*step.want-1 || got > 2*step.want+1 {
			t.Errorf("peer, after %d tokens: %d still charged, want 2 × %d", step.tokens, got, step.want)
		}
	}
	f.Release(d.Charge, t0)
	f.Release(capped.Charge, t0)
	// A configured estimate is the operator's: the lengths do not
	// replace it, and a response past it counts as ending.
	fixed := Options{OutputEstimate: OutputFixed, OutputTokens: 300}.WithDefaults()
	d = f.Decide(t0, Request{Model: "m", PromptTokens: 100}, ms, &fixed, rng(), nil)
	for _, step := range []struct{ tokens, want int }{{100, 200}, {400, 0}} {
		f.Progress(d.Charge, step.tokens-d.Charge.Tokens, t0)
		if got := state(t, f, "a").QueuedDecodeTokens; got != step.want {
			t.Errorf("fixed estimate of 300, after %d tokens: %d still charged, want %d", step.tokens, got, step.want)
		}
	}
}

// TestOutputBuckets: buckets are a third of a doubling wide (within one
// of 3·log2), in order, and the last holds every length beyond 2^21.
func TestOutputBuckets(t *testing.T) {
	prev := 0
	for n := 1; n <= 1<<22; n++ {
		b := outputBucket(n)
		if b < prev {
			t.Fatalf("bucket of %d is %d after %d", n, b, prev)
		}
		if want := min(outputBuckets-1, int(3*math.Log2(float64(n)))); b < want-1 || b > want {
			t.Fatalf("bucket of %d is %d, want about %d", n, b, want)
		}
		prev = b
	}
	if outputBucket(0) != 0 || outputBucket(MaxTokens) != outputBuckets-1 {
		t.Fatal("lengths out of range are not in the end buckets")
	}
}
