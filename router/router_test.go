package router

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/llmaffinity/caddy-llm-affinity/prefixindex"
	"github.com/llmaffinity/caddy-llm-affinity/scorer"
	"github.com/llmaffinity/caddy-llm-affinity/scrape"
)

var t0 = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

func members(dials ...string) []Member {
	out := make([]Member, len(dials))
	for i, d := range dials {
		out[i] = Member{Dial: d, Available: true, Healthy: true}
	}
	return out
}

func hashes(seed uint64, tokens int) []uint64 {
	h := prefixindex.Hasher{BlockTokens: 64, BytesPerToken: 4}
	text := make([]byte, tokens*4)
	for i := range text {
		text[i] = byte('a' + (uint64(i)*7+seed)%26)
	}
	return h.HashBytes(nil, seed, text)
}

func rng() scorer.Rand { return rand.New(rand.NewPCG(1, 2)) }

// served ends c as a request the engine served: its first token came, so
// what its decision added to the index stays (a release before the first
// token takes it back).
func served(f *Fleet, c *Charge, now time.Time) {
	if c != nil {
		f.Progress(c, 1, now)
	}
	f.Release(c, now)
}

func state(t *testing.T, f *Fleet, dial string) UpstreamState {
	t.Helper()
	for _, u := range f.Snapshot(t0) {
		if u.Dial == dial {
			return u
		}
	}
	t.Fatalf("no state for %s", dial)
	return UpstreamState{}
}

// TestChargeLifecycle: a decision charges the uncached prompt, the
// expected output and both as KV; the first token ends the prefill
// charge, tokens lower the decode charge, Complete releases the rest and
// teaches the output estimate.
func TestChargeLifecycle(t *testing.T) {
	f := New()
	opts := Options{OutputTokens: 50}.WithDefaults()
	req := Request{Hashes: hashes(1, 1024), BlockTokens: 64, PromptTokens: 1024, MaxTokens: 100, Model: "m"}
	d := f.Decide(t0, req, members("a"), &opts, rng(), nil)
	if d.Charge == nil || d.Chosen != 0 || d.Reason != scorer.Cold {
		t.Fatalf("decision %+v", d)
	}
	u := state(t, f, "a")
	if u.QueuedPrefillTokens != 1024 || u.QueuedDecodeTokens != 50 || u.KVTokensInFlight != 1074 || u.InFlight != 1 || u.IndexBlocks != 16 {
		t.Fatalf("after the decision: %+v", u)
	}
	f.Progress(d.Charge, 1, t0.Add(100*time.Millisecond))
	f.Progress(d.Charge, 9, t0.Add(200*time.Millisecond))
	u = state(t, f, "a")
	if u.QueuedPrefillTokens != 0 || u.QueuedDecodeTokens != 40 || u.LastTTFT != 100*time.Millisecond {
		t.Fatalf("after 10 tokens: %+v", u)
	}
	f.Complete(d.Charge, "m", Usage{OutputTokens: 20}, t0.Add(time.Second))
	f.Release(d.Charge, t0.Add(time.Second)) // a second release does nothing
	u = state(t, f, "a")
	if u.QueuedDecodeTokens != 0 || u.KVTokensInFlight != 0 || u.InFlight != 0 || u.Completed != 1 {
		t.Fatalf("after Complete: %+v", u)
	}
	// The same prompt again: warm, and expected to generate what was
	// learned (20), not the default.
	first := d.Charge.Estimate
	d = f.Decide(t0.Add(2*time.Second), req, members("a", "b"), &opts, rng(), nil)
	if d.Reason != scorer.Warm || d.MatchedTokens != 1024 || state(t, f, "a").QueuedDecodeTokens != 20 {
		t.Fatalf("second decision %+v, state %+v", d, state(t, f, "a"))
	}
	// The last TTFT and its estimate are one request's: a request not at
	// its first token yet (or abandoned before it) does not pair its
	// estimate with another's TTFT.
	if u := state(t, f, "a"); u.LastTTFT != 100*time.Millisecond || u.LastEstimatedTTFTSeconds != first || first == d.Charge.Estimate {
		t.Fatalf("before the second's first token: last TTFT %v with estimate %v; the first's estimate %v, the second's %v",
			u.LastTTFT, u.LastEstimatedTTFTSeconds, first, d.Charge.Estimate)
	}
	f.Progress(d.Charge, 1, t0.Add(2*time.Second+5*time.Millisecond))
	if u := state(t, f, "a"); u.LastTTFT != 5*time.Millisecond || u.LastEstimatedTTFTSeconds != d.Charge.Estimate {
		t.Fatalf("after the second's first token: last TTFT %v with estimate %v, want 5ms with %v", u.LastTTFT, u.LastEstimatedTTFTSeconds, d.Charge.Estimate)
	}
}

// TestExpectedOutput covers the three estimates, including a request
// without max_tokens (which bounds nothing).
func TestExpectedOutput(t *testing.T) {
	f := New()
	f.models["m"] = &modelStats{output: runningMean{value: 30, n: 5}}
	for _, tc := range []struct {
		estimate  string
		maxTokens int
		want      int
	}{
		{OutputAverage, 0, 30},
		{OutputAverage, 10, 10},
		{OutputMaxTokens, 0, 256},
		{OutputMaxTokens, 77, 77},
		{OutputFixed, 10, 256},
	} {
		opts := Options{OutputEstimate: tc.estimate}.WithDefaults()
		if got := f.expectedOutput(&Request{Model: "m", MaxTokens: tc.maxTokens}, &opts); got != tc.want {
			t.Errorf("%s with max_tokens %d: %d, want %d", tc.estimate, tc.maxTokens, got, tc.want)
		}
	}
	opts := Options{}.WithDefaults()
	if got := f.expectedOutput(&Request{Model: "new"}, &opts); got != DefaultOutputTokens {
		t.Errorf("unseen model: %d", got)
	}
}

// TestKVFit: a request that does not fit the KV left is not placed; Fits
// says when it would be.
func TestKVFit(t *testing.T) {
	f := New()
	opts := Options{OutputEstimate: OutputFixed, OutputTokens: 100}.WithDefaults()
	ms := members("a")
	ms[0].Hardware.KVCapacityTokens = 3000
	big := Request{Hashes: hashes(1, 2000), BlockTokens: 64, PromptTokens: 2000}
	d := f.Decide(t0, big, ms, &opts, rng(), nil)
	if d.Charge == nil {
		t.Fatal("first request did not fit an empty replica")
	}
	other := Request{Hashes: hashes(2, 2000), BlockTokens: 64, PromptTokens: 2000}
	if d2 := f.Decide(t0, other, ms, &opts, rng(), nil); d2.Charge != nil || d2.Blocked != scorer.FilteredKV {
		t.Fatalf("second request placed over capacity: %+v", d2)
	}
	if f.Fits(t0, other, ms[0], &opts) {
		t.Fatal("Fits says yes while the KV is taken")
	}
	// The same prompt needs only its output: it fits.
	if !f.Fits(t0, big, ms[0], &opts) {
		t.Fatal("Fits says no to a prompt the replica holds")
	}
	served(f, d.Charge, t0)
	if !f.Fits(t0, other, ms[0], &opts) {
		t.Fatal("Fits says no after the release")
	}
}

// TestTriedAvoided: an upstream an earlier attempt went to is avoided
// while another is available, and used when it is the only one.
func TestTriedAvoided(t *testing.T) {
	f := New()
	opts := Options{}.WithDefaults()
	req := Request{Hashes: hashes(1, 512), BlockTokens: 64, PromptTokens: 512}
	ms := members("a", "b")
	ms[0].Tried = true
	for range 5 {
		d := f.Decide(t0, req, ms, &opts, rng(), nil)
		if d.Chosen != 1 {
			t.Fatalf("chose the tried upstream over an untried one")
		}
		served(f, d.Charge, t0)
	}
	ms[1].Available = false
	if d := f.Decide(t0, req, ms, &opts, rng(), nil); d.Chosen != 0 {
		t.Fatalf("chose %d; the tried upstream is the only one left", d.Chosen)
	}
}

// TestDownAvoided: an upstream whose engine was found not listening
// (Caddy, without health checks of its own, still counts it healthy) is
// avoided while an untried one that listens is available, though it holds
// the request's whole prefix; it is used when it is all there is, and when
// the only other one was tried already.
func TestDownAvoided(t *testing.T) {
	f := New()
	opts := Options{}.WithDefaults()
	req := Request{Hashes: hashes(1, 512), BlockTokens: 64, PromptTokens: 512}
	ms := members("a", "b")
	served(f, f.Decide(t0, req, ms[:1], &opts, rng(), nil).Charge, t0) // a holds the prefix
	ms[0].Down = true
	for range 5 {
		d := f.Decide(t0, req, ms, &opts, rng(), nil)
		if d.Chosen != 1 {
			t.Fatalf("chose the upstream not listening over one that is")
		}
		served(f, d.Charge, t0)
	}
	ms[1].Tried = true
	if d := f.Decide(t0, req, ms, &opts, rng(), nil); d.Chosen != 0 {
		t.Fatalf("chose %d; the other was tried already", d.Chosen)
	} else {
		served(f, d.Charge, t0)
	}
	ms[1].Tried, ms[1].Available = false, false
	if d := f.Decide(t0, req, ms, &opts, rng(), nil); d.Chosen != 0 {
		t.Fatalf("chose %d; the upstream not listening is the only one left", d.Chosen)
	}
}

// TestAdapterResidency: the last MaxLoras adapters sent to an upstream
// are resident, older ones in host memory, others remote; a running
// adapter the engine reports is resident.
func TestAdapterResidency(t *testing.T) {
	f := New()
	opts := Options{Adapters: map[string]bool{"l0": true, "l1": true, "l2": true}, MaxLoras: 2}.WithDefaults()
	ms := members("a")
	for _, a := range []string{"l0", "l1", "l2"} {
		d := f.Decide(t0, Request{Model: a, PromptTokens: 10}, ms, &opts, rng(), nil)
		served(f, d.Charge, t0)
	}
	u := f.upstreams["a"]
	for adapter, want := range map[string]scorer.AdapterState{"l2": scorer.AdapterResident, "l1": scorer.AdapterResident, "l0": scorer.AdapterHost, "l9": scorer.AdapterRemote} {
		if got, _, _ := opts.adapterCost(adapter, u, nil); got != want {
			t.Errorf("%s: %v, want %v", adapter, got, want)
		}
	}
	// An engine that answered 404 for an adapter does not have it: it is
	// not presumed resident there any more (its next requests followed
	// the first there, each to a 404).
	d := f.Decide(t0, Request{Model: "l0", PromptTokens: 10}, ms, &opts, rng(), nil)
	if got, _, _ := opts.adapterCost("l0", u, nil); got != scorer.AdapterResident {
		t.Fatalf("l0 just sent: %v", got)
	}
	f.Refused(d.Charge, t0)
	if got, _, _ := opts.adapterCost("l0", u, nil); got != scorer.AdapterRemote || state(t, f, "a").InFlight != 0 {
		t.Errorf("l0 refused: %v, %d in flight", got, state(t, f, "a").InFlight)
	}
	sig := &scrape.Signals{AdaptersKnown: true, RunningAdapters: []string{"l9"}}
	if got, _, _ := opts.adapterCost("l9", u, &Member{Engine: sig}); got != scorer.AdapterResident {
		t.Errorf("running adapter: %v", got)
	}
	// An adapter known only from an engine's model list is an adapter too,
	// also from a list whose scrape went stale.
	ms[0].Engine = &scrape.Signals{Models: []scrape.ModelInfo{{ID: "l7", Parent: "base"}}}
	if got := opts.adapterOf("l7", ms, []*upstream{u}); got != "l7" {
		t.Errorf("adapter from /v1/models: %q", got)
	}
	ms[0].Engine, ms[0].Models = nil, []scrape.ModelInfo{{ID: "l8", Parent: "base"}}
	if got := opts.adapterOf("l8", ms, []*upstream{u}); got != "l8" {
		t.Errorf("adapter from a stale /v1/models: %q", got)
	}
	if got := opts.adapterOf("base", ms, []*upstream{u}); got != "" {
		t.Errorf("base model taken for an adapter: %q", got)
	}
}

// TestRefusedAdapterGoesElsewhere: an engine that answered 404 for a
// configured adapter (unloaded there; nothing scraped says so) is not
// sent the adapter again for a minute, though its freed slot makes it
// the cheapest place to load it, unless a load of the adapter goes there;
// when every engine refused it, the request is unservable (the router's
// 404 at once).
func TestRefusedAdapterGoesElsewhere(t *testing.T) {
	f := New()
	opts := Options{Adapters: map[string]bool{"l0": true}, MaxLoras: 1}.WithDefaults()
	ms := members("a", "b")
	random := rng()
	d := f.Decide(t0, Request{Model: "l0", PromptTokens: 10}, ms, &opts, random, nil)
	refuser := ms[d.Chosen].Dial
	f.Refused(d.Charge, t0)
	for i := range 20 {
		d := f.Decide(t0.Add(time.Duration(i)*time.Second), Request{Model: "l0", PromptTokens: 10}, ms, &opts, random, nil)
		if d.Chosen < 0 || ms[d.Chosen].Dial == refuser {
			t.Fatalf("decision %d: chose %d, the engine that refused l0 is %s", i, d.Chosen, refuser)
		}
		f.Release(d.Charge, t0)
	}
	other := map[string]string{"a": "b", "b": "a"}[refuser]
	d = f.Decide(t0, Request{Model: "l0", PromptTokens: 10}, ms, &opts, random, nil)
	f.Refused(d.Charge, t0)
	if d := f.Decide(t0, Request{Model: "l0", PromptTokens: 10}, ms, &opts, random, nil); d.Chosen >= 0 || !d.Unservable {
		t.Fatalf("both engines refused l0: chose %d, unservable %v", d.Chosen, d.Unservable)
	}
	f.AdapterLoading(other, "l0")
	if st, load, _ := opts.adapterCost("l0", f.upstreams[other], nil); st == scorer.AdapterRemote {
		t.Errorf("l0 loaded on %s through the router: remote (load %v), want in its memory", other, load)
	}
	if d := f.Decide(t0, Request{Model: "l0", PromptTokens: 10}, ms, &opts, random, nil); d.Chosen < 0 || ms[d.Chosen].Dial != other {
		t.Fatalf("l0 loaded on %s: chose %d", other, d.Chosen)
	} else {
		f.Release(d.Charge, t0)
	}
	// A minute on, the engine that refused it may be tried again (here
	// the other is down).
	for i := range ms {
		ms[i].Available = ms[i].Dial == refuser
	}
	if d := f.Decide(t0.Add(refusalMemory-time.Second), Request{Model: "l0", PromptTokens: 10}, ms, &opts, random, nil); d.Chosen >= 0 {
		t.Fatalf("within a minute of its 404, %s was tried again", refuser)
	}
	if d := f.Decide(t0.Add(refusalMemory+time.Second), Request{Model: "l0", PromptTokens: 10}, ms, &opts, random, nil); d.Chosen < 0 || ms[d.Chosen].Dial != refuser {
		t.Errorf("a minute after its 404, %s is not tried again: chose %d", refuser, d.Chosen)
	}
}

// TestDrainingIsNoAlternative: a member tried already (its attempt
// failed) is tried again when the only untried one is draining, rather
// than the request waiting for an upstream that takes nothing new; so is
// a member whose last scrape found nothing listening.
func TestDrainingIsNoAlternative(t *testing.T) {
	f := New()
	opts := Options{}.WithDefaults()
	req := Request{PromptTokens: 10}
	ms := members("a", "b")
	ms[0].Tried, ms[1].Draining = true, true
	if d := f.Decide(t0, req, ms, &opts, rng(), nil); d.Chosen != 0 {
		t.Fatalf("tried a, draining b: chose %d, want a", d.Chosen)
	} else {
		f.Release(d.Charge, t0)
	}
	ms[0].Tried, ms[0].Down = false, true
	if d := f.Decide(t0, req, ms, &opts, rng(), nil); d.Chosen != 0 {
		t.Fatalf("down a, draining b: chose %d, want a", d.Chosen)
	}
}

// TestAllDownTriesOnce: with every member's engine found not listening
// at its last scrape, a request makes one attempt (an engine may have
// started since) and, once that attempt found nothing listening either,
// is not running: a 503 at once, not an attempt at each member. Without
// scrapes, each member is tried once, and none twice.
func TestAllDownTriesOnce(t *testing.T) {
	f := New()
	opts := Options{}.WithDefaults()
	req := Request{PromptTokens: 10}
	ms := members("a", "b", "c")
	for i := range ms {
		ms[i].Down = true
	}
	d := f.Decide(t0, req, ms, &opts, rng(), nil)
	if d.Chosen < 0 {
		t.Fatalf("every member down: no attempt at all (%+v)", d)
	}
	f.Release(d.Charge, t0)
	ms[d.Chosen].Tried, ms[d.Chosen].Unreached = true, true
	if d := f.Decide(t0, req, ms, &opts, rng(), nil); d.Chosen >= 0 || !d.NotRunning {
		t.Fatalf("the attempt found nothing listening, the others down: chose %d, not running %v", d.Chosen, d.NotRunning)
	}
	// Caddy's own retry (lb_retries) does not say how its attempt
	// failed: a down member tried already counts as refused too.
	for i := range ms {
		ms[i].Tried, ms[i].Unreached = false, false
	}
	d = f.Decide(t0, req, ms, &opts, rng(), nil)
	f.Release(d.Charge, t0)
	ms[d.Chosen].Tried = true
	if d := f.Decide(t0, req, ms, &opts, rng(), nil); d.Chosen >= 0 || !d.NotRunning {
		t.Fatalf("retried by Caddy after a down member: chose %d, not running %v", d.Chosen, d.NotRunning)
	}

	// Nothing scraped: each is tried, and none again once unreached.
	for i := range ms {
		ms[i].Down, ms[i].Tried, ms[i].Unreached = false, false, false
	}
	for range ms {
		d := f.Decide(t0, req, ms, &opts, rng(), nil)
		if d.Chosen < 0 || ms[d.Chosen].Tried {
			t.Fatalf("chose %d: tried already, or none while untried ones are left", d.Chosen)
		}
		f.Release(d.Charge, t0)
		ms[d.Chosen].Tried, ms[d.Chosen].Unreached = true, true
	}
	if d := f.Decide(t0, req, ms, &opts, rng(), nil); d.Chosen >= 0 || !d.NotRunning {
		t.Fatalf("every member refused this request: chose %d, not running %v", d.Chosen, d.NotRunning)
	}
	// One that answered (tried, reached) is tried again; a down one is
	// not tried once another attempt found nothing listening.
	ms[0].Unreached = false
	ms[1].Down = true
	if d := f.Decide(t0, req, ms, &opts, rng(), nil); d.Chosen != 0 {
		t.Fatalf("chose %d, want the one that answered", d.Chosen)
	}
}

// TestAdaptersTakeFreeSlots: adapters requested one after another on an
// idle fleet fill every replica's GPU slots before any replica holds more
// than it has slots, whatever the random draw, and after that each
// request finds its adapter resident. Before the eviction cost, each new
// adapter went to a random idle replica; one holding more adapters than
// slots kept them all (a reload from host memory beat a load from storage
// elsewhere), and requests in turn there reloaded every time.
func TestAdaptersTakeFreeSlots(t *testing.T) {
	adapters := []string{"l0", "l1", "l2", "l3", "l4", "l5"}
	opts := Options{Adapters: map[string]bool{}, MaxLoras: 2}.WithDefaults()
	for _, a := range adapters {
		opts.Adapters[a] = true
	}
	for seed := range uint64(20) {
		f := New()
		random := rand.New(rand.NewPCG(seed, 7))
		ms := members("a", "b", "c")
		for round := range 3 {
			for _, a := range adapters {
				d := f.Decide(t0, Request{Model: a, PromptTokens: 10}, ms, &opts, random, nil)
				if d.Chosen < 0 {
					t.Fatalf("seed %d: %s not routed", seed, a)
				}
				if round > 0 && d.Decision.Reason == scorer.Adapter {
					t.Fatalf("seed %d, round %d: %s loaded again on %s (%s)", seed, round, a, ms[d.Chosen].Dial, d.Decision.Reason)
				}
				served(f, d.Charge, t0)
			}
		}
		for _, dial := range []string{"a", "b", "c"} {
			if n := len(f.upstreams[dial].adapters); n != 2 {
				t.Fatalf("seed %d: %s holds %d adapters %v, want its 2 slots", seed, dial, n, f.upstreams[dial].adapters)
			}
		}
	}
}

// TestRestartForgetsAdapters: an engine that restarted holds none of the
// adapters the router sent before, in a GPU slot or in host memory: each
// is loaded anew from storage, and loading one evicts nothing.
func TestRestartForgetsAdapters(t *testing.T) {
	f := New()
	opts := Options{Adapters: map[string]bool{"l0": true, "l1": true, "l2": true}, MaxLoras: 2}.WithDefaults()
	ms := members("a")
	for _, a := range []string{"l0", "l1"} {
		d := f.Decide(t0, Request{Model: a, PromptTokens: 10}, ms, &opts, rng(), nil)
		served(f, d.Charge, t0)
	}
	u := f.upstreams["a"]
	if st, _, evicted := opts.adapterCost("l2", u, nil); st != scorer.AdapterRemote || evicted == 0 {
		t.Fatalf("before the restart: l2 %v, evicting %v s; want remote, evicting one", st, evicted)
	}
	f.EngineRestarted("a", t0.Add(time.Second))
	if st, _, _ := opts.adapterCost("l0", u, nil); st != scorer.AdapterRemote {
		t.Errorf("l0 after a restart: %v, want remote", st)
	}
	if _, _, evicted := opts.adapterCost("l2", u, nil); evicted != 0 {
		t.Errorf("l2 after a restart evicts %v s, want 0 (every slot free)", evicted)
	}
}

// TestAdapterSlotsBeyondTheDefaultList: with max_loras above the sixteen
// adapters an upstream's list keeps by default, every slot still counts:
// the twentieth adapter sent back is resident, and loading one more
// evicts. Adapters the engine runs that this router did not send take
// slots too.
func TestAdapterSlotsBeyondTheDefaultList(t *testing.T) {
	f := New()
	opts := Options{Adapters: map[string]bool{}, MaxLoras: 32}.WithDefaults()
	for i := range 21 {
		opts.Adapters[fmt.Sprintf("l%d", i)] = true
	}
	ms := members("a")
	for i := range 20 {
		served(f, f.Decide(t0, Request{Model: fmt.Sprintf("l%d", i), PromptTokens: 10}, ms, &opts, rng(), nil).Charge, t0)
	}
	u := f.upstreams["a"]
	if got, load, _ := opts.adapterCost("l0", u, nil); got != scorer.AdapterResident {
		t.Errorf("the 20th adapter back with 32 slots: %v (load %v), want resident", got, load)
	}
	if _, _, evicted := opts.adapterCost("l20", u, nil); evicted != 0 {
		t.Errorf("a 21st adapter with 32 slots evicts %v, want 0", evicted)
	}
	// Two slots: l19 and l18 hold them; l0 (in host memory) evicts.
	two := Options{Adapters: opts.Adapters, MaxLoras: 2}.WithDefaults()
	if _, _, evicted := two.adapterCost("l0", u, nil); evicted == 0 {
		t.Errorf("a load onto two full slots evicts nothing")
	}
	// One slot taken by this router's l19, the other by an adapter the
	// engine runs for someone else: full.
	g := New()
	served(g, g.Decide(t0, Request{Model: "l19", PromptTokens: 10}, ms, &two, rng(), nil).Charge, t0)
	sig := &scrape.Signals{AdaptersKnown: true, RunningAdapters: []string{"other"}}
	if _, _, evicted := two.adapterCost("l0", g.upstreams["a"], &Member{Engine: sig}); evicted == 0 {
		t.Errorf("slots held by l19 and a running adapter another router sent: a load evicts nothing")
	}
	if _, _, evicted := two.adapterCost("l0", g.upstreams["a"], nil); evicted != 0 {
		t.Errorf("one of two slots free: a load evicts %v", evicted)
	}
}

// TestEngineAdapterSlots: an engine that reports its adapter slots
// (vLLM's lora_requests_info max_lora) keeps that many of the adapters
// last sent there resident, whatever max_loras says, also while its scrape
// is stale; a caller that does not scrape uses its own figure.
func TestEngineAdapterSlots(t *testing.T) {
	f := New()
	opts := Options{Adapters: map[string]bool{"l0": true, "l1": true}}.WithDefaults() // MaxLoras 4
	ms := members("a")
	ms[0].Scraped = true
	ms[0].Engine = &scrape.Signals{Running: 0, Waiting: 0, AdaptersKnown: true, RunningAdapters: []string{}, MaxLoRAs: 1}
	for _, a := range []string{"l0", "l1"} {
		d := f.Decide(t0, Request{Model: a, PromptTokens: 10}, ms, &opts, rng(), nil)
		served(f, d.Charge, t0)
	}
	u := f.upstreams["a"]
	fresh, stale, unscraped := ms[0], Member{Dial: "a", Scraped: true}, Member{Dial: "a"}
	for _, tc := range []struct {
		name    string
		m       *Member
		adapter string
		want    scorer.AdapterState
	}{
		{"fresh, last sent", &fresh, "l1", scorer.AdapterResident},
		{"fresh, one slot taken by l1", &fresh, "l0", scorer.AdapterHost},
		{"stale scrape", &stale, "l0", scorer.AdapterHost},
		{"caller without scrapes: max_loras", &unscraped, "l0", scorer.AdapterResident},
	} {
		if got, _, _ := opts.adapterCost(tc.adapter, u, tc.m); got != tc.want {
			t.Errorf("%s: %s is %v, want %v", tc.name, tc.adapter, got, tc.want)
		}
	}
	// An engine with more slots than the router remembers adapters by
	// default: each slot can hold one of the last adapters sent.
	many := map[string]bool{}
	for i := range 40 {
		many[fmt.Sprintf("m%d", i)] = true
	}
	opts = Options{Adapters: many}.WithDefaults()
	fresh.Engine = &scrape.Signals{Running: 0, Waiting: 0, AdaptersKnown: true, RunningAdapters: []string{}, MaxLoRAs: 32}
	for i := range 40 {
		d := f.Decide(t0, Request{Model: fmt.Sprintf("m%d", i), PromptTokens: 10}, []Member{fresh}, &opts, rng(), nil)
		served(f, d.Charge, t0)
	}
	if got, _, _ := opts.adapterCost("m8", u, &fresh); got != scorer.AdapterResident {
		t.Errorf("the 32nd adapter sent last to an engine of 32 slots: %v, want resident", got)
	}
	if got, _, _ := opts.adapterCost("m7", u, &fresh); got == scorer.AdapterResident {
		t.Errorf("the 33rd: %v, want not resident", got)
	}
}

// TestEngineSignals: fresh engine signals cap the free KV, and requests
// the engine has that the router did not send count as queued work.
func TestEngineSignals(t *testing.T) {
	f := New()
	opts := Options{OutputEstimate: OutputFixed, OutputTokens: 100}.WithDefaults()
	ms := members("a")
	ms[0].Engine = &scrape.Signals{Running: 3, Waiting: 2, KVKnown: true, KVUsage: 0.5, BlockSize: 16, NumGPUBlocks: 1000}
	f.mu.Lock()
	defer f.mu.Unlock()
	u := f.upstream("a", t0)
	var c scorer.Candidate
	f.candidate(&c, t0, &ms[0], u, &opts, "", 64, true)
	if c.KVCapacityTokens != 16000 || c.FreeKVTokens != 8000 || c.ForeignInFlight != 5 || c.Waiting != 2 || c.QueuedDecodeTokens != 500 {
		t.Fatalf("candidate %+v", c)
	}
}

// TestRoutedDuringAScrapeIsNotForeign: requests the router sent to an
// upstream while its metrics were being fetched, which an engine rendering
// its gauges as it answers counts, are the router's own, not foreign load
// (a burst's target would count them twice until the next scrape).
func TestRoutedDuringAScrapeIsNotForeign(t *testing.T) {
	f := New()
	opts := Options{OutputEstimate: OutputFixed, OutputTokens: 100}.WithDefaults()
	ms := members("a")
	f.mu.Lock()
	defer f.mu.Unlock()
	u := f.upstream("a", t0)
	// One request in flight when the scrape was sent, five more routed
	// before its answer was read, all six in the engine's gauges, and two
	// that came another way.
	before := scrape.Mark{Requests: 10, KVTokens: 1000, InFlight: 1}
	after := scrape.Mark{Requests: 15, KVTokens: 1500, InFlight: 6}
	u.charged = after
	ms[0].Engine = &scrape.Signals{Running: 2, Waiting: 6, Mark: before, MarkAfter: after}
	var c scorer.Candidate
	if f.candidate(&c, t0, &ms[0], u, &opts, "", 64, true); c.ForeignInFlight != 2 {
		t.Errorf("foreign %d, want the 2 that came another way", c.ForeignInFlight)
	}
	// Without a second mark (a scraper without one), as before.
	ms[0].Engine = &scrape.Signals{Running: 2, Waiting: 6, Mark: before}
	if f.candidate(&c, t0, &ms[0], u, &opts, "", 64, true); c.ForeignInFlight != 7 {
		t.Errorf("foreign %d without a second mark, want 7", c.ForeignInFlight)
	}
}

// TestIndexSizedForTheSmallestBlock: two sites hashing with different
// block sizes do not resize an upstream's index back and forth: it keeps
// the capacity of the smallest block size seen.
func TestIndexSizedForTheSmallestBlock(t *testing.T) {
	f := New()
	opts := Options{}.WithDefaults()
	ms := members("a")
	ms[0].Hardware.KVCapacityTokens = 64 * 1024
	decide := func(bt int) {
		d := f.Decide(t0, Request{BlockTokens: bt, PromptTokens: 10}, ms, &opts, rng(), nil)
		served(f, d.Charge, t0)
	}
	decide(64)
	decide(256)
	if got := state(t, f, "a").IndexCapacityBlocks; got != 1024 {
		t.Fatalf("capacity %d blocks after a 256-token site, want 1024", got)
	}
	decide(16)
	if got := state(t, f, "a").IndexCapacityBlocks; got != 4096 {
		t.Fatalf("capacity %d blocks after a 16-token site, want 4096", got)
	}
}

// TestNamedUpstreamsLifecycle: named upstreams stay while idle; a
// forgotten one goes at once when idle, or with its last request; unnamed
// (dynamic) ones expire when idle long enough.
func TestNamedUpstreamsLifecycle(t *testing.T) {
	f := New()
	opts := Options{}.WithDefaults()
	f.Name("named", t0)
	f.Name("busy", t0)
	d := f.Decide(t0, Request{PromptTokens: 10}, members("busy"), &opts, rng(), nil)
	served(f, f.Decide(t0, Request{PromptTokens: 10}, members("dynamic"), &opts, rng(), nil).Charge, t0)
	if dropped := f.Expire(t0.Add(time.Hour)); !slices.Equal(dropped, []string{"dynamic"}) || f.Known("dynamic") || !f.Known("named") {
		t.Fatalf("expired %v; dynamic known %v, named known %v", dropped, f.Known("dynamic"), f.Known("named"))
	}
	f.Forget("named")
	if f.Known("named") {
		t.Fatal("an idle forgotten upstream stayed")
	}
	f.Forget("busy")
	if !f.Known("busy") {
		t.Fatal("a forgotten upstream went with a request in flight")
	}
	served(f, d.Charge, t0)
	if f.Known("busy") {
		t.Fatal("a forgotten upstream stayed after its last request")
	}
	// Named again before its last request ends, it stays.
	f.Name("back", t0)
	d = f.Decide(t0, Request{PromptTokens: 10}, members("back"), &opts, rng(), nil)
	f.Forget("back")
	f.Name("back", t0)
	served(f, d.Charge, t0)
	if !f.Known("back") {
		t.Fatal("an upstream named again was dropped")
	}
}

// TestRemovedUpstreamNotReused: a decision takes each member's state from
// the previous decision's at its place, when it is that member's; one
// removed since (forgotten with nothing in flight) and named again is new
// state, and the next decision charges that, not what was removed.
func TestRemovedUpstreamNotReused(t *testing.T) {
	f := New()
	opts := Options{}.WithDefaults()
	req := Request{Hashes: hashes(1, 256), BlockTokens: 64, PromptTokens: 256}
	f.Name("a", t0)
	served(f, f.Decide(t0, req, members("b", "a"), &opts, rng(), nil).Charge, t0)
	f.Forget("a")
	if f.Known("a") {
		t.Fatal("a forgotten upstream with nothing in flight stayed")
	}
	f.Name("a", t0)
	ms := members("b", "a")
	ms[0].Available = false
	d := f.Decide(t0, req, ms, &opts, rng(), nil)
	if d.Charge == nil || d.Chosen != 1 {
		t.Fatalf("not routed to a: %+v", d)
	}
	if st := state(t, f, "a"); st.InFlight != 1 || st.IndexBlocks != 4 {
		t.Fatalf("a named again has %d in flight and %d blocks, want the decision's 1 and 4", st.InFlight, st.IndexBlocks)
	}
}

// TestChargeInCallerMemory: a decision keeps its charge in the memory the
// request offers (Request.Charge) once what was there is released, and
// never over a charge still held there, which the fleet still lists.
func TestChargeInCallerMemory(t *testing.T) {
	f := New()
	opts := Options{}.WithDefaults()
	var mem Charge
	req := Request{Hashes: hashes(1, 256), BlockTokens: 64, PromptTokens: 256, Charge: &mem}
	first := f.Decide(t0, req, members("a"), &opts, rng(), nil).Charge
	if first != &mem {
		t.Fatalf("the charge is not in the caller's memory")
	}
	second := f.Decide(t0, req, members("a"), &opts, rng(), nil).Charge
	if second == nil || second == &mem {
		t.Fatalf("a charge still held was overwritten by the next decision's")
	}
	if st := state(t, f, "a"); st.InFlight != 2 {
		t.Fatalf("%d in flight, want 2", st.InFlight)
	}
	f.Progress(first, 1, t0)
	f.Complete(first, "", Usage{OutputTokens: 1}, t0)
	f.Release(second, t0)
	if st := state(t, f, "a"); st.InFlight != 0 || st.QueuedPrefillTokens != 0 || st.QueuedDecodeTokens != 0 || st.KVTokensInFlight != 0 {
		t.Fatalf("released, a still holds %+v", st)
	}
	// Released: the memory serves the next decision, which charges
	// afresh.
	third := f.Decide(t0, req, members("a"), &opts, rng(), nil).Charge
	if third != &mem || third.Tokens != 0 || !third.FirstToken.IsZero() {
		t.Fatalf("the released memory was not reused as a new charge: %+v", third)
	}
	if st := state(t, f, "a"); st.InFlight != 1 || st.KVTokensInFlight == 0 {
		t.Fatalf("the reused charge is not held: %+v", st)
	}
	f.Release(third, t0)
	if st := state(t, f, "a"); st.InFlight != 0 || st.KVTokensInFlight != 0 {
		t.Fatalf("released, a still holds %+v", st)
	}
}

// BenchmarkDecide is one decision and its release: across 64 upstreams
// for a 2,048-token prompt, and across 4 for a 140-token one with 16
// tokens of output (the shape of scripts/overhead.sh's requests).
func BenchmarkDecide(b *testing.B) {
	for _, bc := range []struct {
		name              string
		upstreams, prompt int
		maxTokens         int
	}{
		{"upstreams=64", 64, 2048, 100},
		{"upstreams=4", 4, 140, 16},
	} {
		b.Run(bc.name, func(b *testing.B) {
			f := New()
			opts := Options{}.WithDefaults()
			var ms []Member
			for i := range bc.upstreams {
				ms = append(ms, Member{Dial: "u" + string(rune('A'+i)), Available: true, Healthy: true})
			}
			req := Request{Hashes: hashes(1, bc.prompt), BlockTokens: 64, PromptTokens: bc.prompt, MaxTokens: bc.maxTokens}
			r := rng()
			b.ReportAllocs()
			for b.Loop() {
				d := f.Decide(t0, req, ms, &opts, r, nil)
				served(f, d.Charge, t0)
			}
		})
	}
}

// TestUnservableModel: when every member lists its models and none lists
// the request's, the decision says waiting cannot help; a member without
// a model list (unknown) or a full one (KV) only makes the request wait.
func TestUnservableModel(t *testing.T) {
	f := New()
	opts := Options{}.WithDefaults()
	ms := members("a", "b")
	for i := range ms {
		ms[i].Engine = &scrape.Signals{Running: -1, Waiting: -1, Models: []scrape.ModelInfo{{ID: "llama"}}}
	}
	if d := f.Decide(t0, Request{Model: "gpt-4", PromptTokens: 10}, ms, &opts, rng(), nil); d.Charge != nil || !d.Unservable {
		t.Fatalf("a model nobody serves: %+v", d)
	}
	ms[1].Engine = nil // b's models unknown: it may serve it
	if d := f.Decide(t0, Request{Model: "gpt-4", PromptTokens: 10}, ms, &opts, rng(), nil); d.Charge == nil || d.Chosen != 1 {
		t.Fatalf("b, whose models are unknown, was not chosen: %+v", d)
	}
	ms[1].Available = false
	if d := f.Decide(t0, Request{Model: "gpt-4", PromptTokens: 10}, ms, &opts, rng(), nil); d.Charge != nil || d.Unservable {
		t.Fatalf("an unavailable member that may serve the model made it unservable: %+v", d)
	}
	// Nothing listens there (its engine refused the last scrape): not
	// running, though not surely unservable (an engine still starting).
	ms[1].Down = true
	if d := f.Decide(t0, Request{Model: "gpt-4", PromptTokens: 10}, ms, &opts, rng(), nil); d.Charge != nil || d.Unservable || !d.NotRunning {
		t.Fatalf("a model only a member that is down might serve: %+v", d)
	}
	ms[1].Down = false
	// A member whose scrape went stale keeps its last model list: it
	// still serves only what it listed (its /metrics failing says
	// nothing of its models), and a model nobody listed is unservable.
	ms[1].Available = true
	ms[1].Models = []scrape.ModelInfo{{ID: "llama"}, {ID: "tenant-a", Parent: "llama"}}
	if d := f.Decide(t0, Request{Model: "gpt-4", PromptTokens: 10}, ms, &opts, rng(), nil); d.Charge != nil || !d.Unservable {
		t.Fatalf("a model no list has, b's list stale: %+v", d)
	}
	for range 10 {
		d := f.Decide(t0, Request{Model: "tenant-a", PromptTokens: 10}, ms, &opts, rng(), nil)
		if d.Charge == nil || d.Chosen != 1 {
			t.Fatalf("an adapter only b's stale list has went elsewhere: %+v", d)
		}
		f.Release(d.Charge, t0)
	}
	// Down with its last list: a model it never listed is unservable,
	// one it listed is not running (nothing else serves it).
	ms[1].Down = true
	if d := f.Decide(t0, Request{Model: "gpt-4", PromptTokens: 10}, ms, &opts, rng(), nil); d.Charge != nil || !d.Unservable {
		t.Fatalf("a model no list has, b down: %+v", d)
	}
	ms[1].Available = false // tried already, or Caddy's verdict
	if d := f.Decide(t0, Request{Model: "tenant-a", PromptTokens: 10}, ms, &opts, rng(), nil); d.Charge != nil || d.Unservable || !d.NotRunning {
		t.Fatalf("an adapter only b, down, listed: %+v", d)
	}
	// The whole fleet down, each listing the model: not running either
	// (a wait at the gateway would not bring an engine back), and so
	// while one of them is still up but busy (it can take the request
	// later).
	all := members("a", "b")
	for i := range all {
		all[i].Models, all[i].Down, all[i].Available = []scrape.ModelInfo{{ID: "llama"}}, true, false
	}
	if d := f.Decide(t0, Request{Model: "llama", PromptTokens: 10}, all, &opts, rng(), nil); d.Charge != nil || d.Unservable || !d.NotRunning {
		t.Fatalf("every upstream serving the model down: %+v", d)
	}
	all[0].Down = false
	if d := f.Decide(t0, Request{Model: "llama", PromptTokens: 10}, all, &opts, rng(), nil); d.Charge != nil || d.NotRunning {
		t.Fatalf("one upstream serving the model up, unavailable now: %+v", d)
	}
}

// TestListedBeatsUnknown: an upstream whose list names the model asked
// for is chosen before one whose list is unknown (not fetched yet, or
// stale: it may not serve the model, and would answer 404), however busy
// the one and idle the other. The unknown one takes the request when no
// list names the model, and when no upstream that lists it can take the
// request: its engine is down, Caddy counts it unavailable, or it was
// tried already; so a request is held only when no upstream at all can
// take it. A stored response's home whose list is unknown stays its home.
func TestListedBeatsUnknown(t *testing.T) {
	f := New()
	opts := Options{}.WithDefaults()
	ms := members("a", "b")
	ms[0].Engine = &scrape.Signals{Running: -1, Waiting: -1, Models: []scrape.ModelInfo{{ID: "llama"}}}
	req := Request{Model: "llama", PromptTokens: 100}
	for i := range 20 {
		d := f.Decide(t0, req, ms, &opts, rng(), nil)
		if d.Charge == nil || d.Charge.Dial() != "a" {
			t.Fatalf("request %d for the model a lists, a busy and b's list unknown: %+v", i, d)
		}
	}
	goesTo := func(what string, req Request, ms []Member, want string) {
		t.Helper()
		d := f.Decide(t0, req, ms, &opts, rng(), nil)
		if d.Charge == nil || d.Charge.Dial() != want {
			t.Fatalf("%s: %+v (blocked by %s), want %s", what, d, d.Blocked, want)
		}
		f.Release(d.Charge, t0)
	}
	goesTo("a model no list names", Request{Model: "qwen", PromptTokens: 100}, ms, "b")
	goesTo("a stored response's home, its list unknown", Request{Model: "llama", PromptTokens: 100, Home: "b"}, ms, "b")
	for _, tc := range []struct {
		name string
		set  func(m *Member)
	}{
		{"a's engine down", func(m *Member) { m.Down = true }},
		{"a unavailable to Caddy", func(m *Member) { m.Available = false }},
		{"a tried already", func(m *Member) { m.Tried = true }},
	} {
		ms := slices.Clone(ms)
		tc.set(&ms[0])
		goesTo(tc.name, req, ms, "b")
	}
	var explain scorer.Explanation
	if d := f.Decide(t0, req, ms, &opts, rng(), &explain); d.Charge == nil || len(explain.Top) == 0 || explain.Top[0].Name != "a" || len(explain.Filtered) != 0 {
		t.Fatalf("the explanation of a choice among the listing upstreams (b, not tried, is not filtered out): %+v", explain)
	}

	// A listing upstream that can take the request only cut at its
	// context (its engine may refuse it) does not beat an unknown one.
	f = New()
	ms = members("a", "b")
	ms[0].Models = []scrape.ModelInfo{{ID: "llama", MaxModelLen: 8192}}
	// 7,000 tokens counted from text (5,600 surely) and max_tokens 2,000:
	// 9,000 expected, more than a's 8,192; 7,600 surely, less.
	long := Request{Model: "llama", PromptTokens: 7000, PromptBytes: 28000, MaxTokens: 2000}
	if d := f.Decide(t0, long, ms, &opts, rng(), nil); d.Charge == nil || d.Charge.Dial() != "b" {
		t.Fatalf("a request a's context holds only cut: %+v, want b, whose list is unknown", d)
	}
}

// TestModelRequired: a request naming no model goes anywhere while the
// members serve one base model (adapters aside), and is refused when they
// serve several.
func TestModelRequired(t *testing.T) {
	f := New()
	opts := Options{}.WithDefaults()
	ms := members("a", "b")
	ms[0].Models = []scrape.ModelInfo{{ID: "llama"}}
	ms[1].Models = []scrape.ModelInfo{{ID: "llama"}, {ID: "tenant-a", Parent: "llama"}}
	d := f.Decide(t0, Request{PromptTokens: 10}, ms, &opts, rng(), nil)
	if d.Charge == nil || d.ModelRequired {
		t.Fatalf("one base model: %+v", d)
	}
	f.Release(d.Charge, t0)
	ms[1].Engine = &scrape.Signals{Running: -1, Waiting: -1, Models: []scrape.ModelInfo{{ID: "qwen"}}}
	if d := f.Decide(t0, Request{PromptTokens: 10}, ms, &opts, rng(), nil); d.Charge != nil || !d.ModelRequired {
		t.Fatalf("two base models: %+v", d)
	}
	if d := f.Decide(t0, Request{Model: "qwen", PromptTokens: 10}, ms, &opts, rng(), nil); d.Charge == nil || d.Chosen != 1 {
		t.Fatalf("a named model: %+v", d)
	} else {
		f.Release(d.Charge, t0)
	}
	// One model served under two names (vLLM's --served-model-name a b):
	// one root, one model.
	ms[1].Engine = nil
	ms[0].Models = []scrape.ModelInfo{{ID: "llama", Root: "/models/llama"}, {ID: "assistant", Root: "/models/llama"}}
	ms[1].Models = []scrape.ModelInfo{{ID: "llama", Root: "/models/llama"}}
	if d := f.Decide(t0, Request{PromptTokens: 10}, ms, &opts, rng(), nil); d.Charge == nil || d.ModelRequired {
		t.Fatalf("one model under two names: %+v", d)
	}
}

// TestTooLong: a prompt larger than every member's KV capacity can never
// run; one that fits an empty member only waits.
func TestTooLong(t *testing.T) {
	f := New()
	opts := Options{OutputEstimate: OutputFixed, OutputTokens: 10}.WithDefaults()
	ms := members("a", "b")
	for i := range ms {
		ms[i].Hardware.KVCapacityTokens = 4096
	}
	if d := f.Decide(t0, Request{PromptTokens: 5000}, ms, &opts, rng(), nil); d.Charge != nil || !d.TooLong {
		t.Fatalf("a 5,000-token prompt against 4,096 tokens of KV: %+v", d)
	}
	full := f.Decide(t0, Request{PromptTokens: 4000}, ms, &opts, rng(), nil)
	full2 := f.Decide(t0, Request{PromptTokens: 4000}, ms, &opts, rng(), nil)
	if d := f.Decide(t0, Request{PromptTokens: 4000}, ms, &opts, rng(), nil); d.Charge != nil || d.TooLong {
		t.Fatalf("a prompt that fits an empty member was called too long: %+v", d)
	}
	served(f, full.Charge, t0)
	served(f, full2.Charge, t0)
	ms[1].Hardware.KVCapacityTokens = 0 // unknown: it may hold it
	if d := f.Decide(t0, Request{PromptTokens: 5000}, ms, &opts, rng(), nil); d.TooLong || d.Chosen != 1 {
		t.Fatalf("with b's capacity unknown: %+v", d)
	}
}

// TestContextLength: a member whose context for the model (its engine's
// max_model_len) is shorter than the prompt and max_tokens is left out,
// as the engine would refuse the request; an adapter listed without one
// has its base model's. Longer than the context on every member serving
// the model, the request is TooLong.
func TestContextLength(t *testing.T) {
	f := New()
	opts := Options{OutputEstimate: OutputFixed, OutputTokens: 10}.WithDefaults()
	ms := members("short", "long")
	ms[0].Models = []scrape.ModelInfo{{ID: "m", MaxModelLen: 4096}, {ID: "lora", Parent: "m"}}
	ms[1].Models = []scrape.ModelInfo{{ID: "m", MaxModelLen: 32768}, {ID: "lora", Parent: "m"}}
	for _, model := range []string{"m", "lora"} {
		for range 10 {
			d := f.Decide(t0, Request{Model: model, PromptTokens: 4000, MaxTokens: 200}, ms, &opts, rng(), nil)
			if d.Charge == nil || d.Chosen != 1 {
				t.Fatalf("%s: 4,200 tokens against contexts of 4,096 and 32,768: %+v", model, d)
			}
			f.Release(d.Charge, t0)
		}
	}
	if d := f.Decide(t0, Request{Model: "m", PromptTokens: 40000}, ms, &opts, rng(), nil); d.Charge != nil || !d.TooLong {
		t.Fatalf("longer than every context: %+v", d)
	}
	// Counted from text, 4,200 tokens may be fewer: short may hold it,
	// and takes it when long cannot.
	fromText := Request{Model: "m", PromptTokens: 4200, PromptBytes: 4 * 4200}
	ms[1].Draining = true
	d := f.Decide(t0, fromText, ms, &opts, rng(), nil)
	if d.Charge == nil || d.Chosen != 0 {
		t.Fatalf("an estimate over short's context, with long draining: %+v", d)
	}
	f.Release(d.Charge, t0)
	ms[1].Draining = false
	ms[1].Models = []scrape.ModelInfo{{ID: "m"}} // unknown: it may hold it
	if d := f.Decide(t0, Request{Model: "m", PromptTokens: 40000}, ms, &opts, rng(), nil); d.TooLong || d.Chosen != 1 {
		t.Fatalf("with long's context unknown: %+v", d)
	}
}

// TestTooLongWhateverBlocksTheOthers: a prompt larger than the KV of every
// upstream that may serve its model is too long however many of them are
// draining, down or full, and whatever upstreams serving other models
// hold (it was refused only when the KV filter was the commonest reason,
// and otherwise shed with a 503 after queue_timeout). One that only a
// draining upstream could hold waits for it.
func TestTooLongWhateverBlocksTheOthers(t *testing.T) {
	opts := Options{OutputEstimate: OutputFixed, OutputTokens: 10}.WithDefaults()
	other := []scrape.ModelInfo{{ID: "other"}}
	mine := []scrape.ModelInfo{{ID: "m"}}
	for _, tc := range []struct {
		name    string
		setup   func(ms []Member)
		tooLong bool
	}{
		{"three of four draining", func(ms []Member) {
			for i := range 3 {
				ms[i].Draining = true
			}
		}, true},
		{"all draining", func(ms []Member) {
			for i := range ms {
				ms[i].Draining = true
			}
		}, true},
		{"two down", func(ms []Member) { ms[0].Available, ms[1].Available = false, false }, true},
		{"the others serve another model, with more KV", func(ms []Member) {
			for i := range 3 {
				ms[i].Models, ms[i].Hardware.KVCapacityTokens = other, 1<<20
			}
			ms[3].Models = mine
		}, true},
		{"only a draining upstream could hold it", func(ms []Member) {
			ms[0].Hardware.KVCapacityTokens, ms[0].Draining = 1<<20, true
		}, false},
	} {
		f := New()
		ms := members("a", "b", "c", "d")
		for i := range ms {
			ms[i].Hardware.KVCapacityTokens = 4096
		}
		tc.setup(ms)
		d := f.Decide(t0, Request{Model: "m", PromptTokens: 5000}, ms, &opts, rng(), nil)
		if d.Charge != nil || d.TooLong != tc.tooLong || d.Unservable {
			t.Errorf("%s: too long %v, want %v (%+v)", tc.name, d.TooLong, tc.tooLong, d)
		}
	}
}

// TestEngineRestartForgetsTheIndex: a restart the scraper reports clears
// what the index says the upstream holds, and counts as an index reset;
// one reported before anything was routed there (an engine not yet
// listening when the router started) has nothing to forget and is not
// counted.
func TestEngineRestartForgetsTheIndex(t *testing.T) {
	f := New()
	opts := Options{}.WithDefaults()
	ms := members("a")
	ms[0].Engine = &scrape.Signals{Running: -1, Waiting: -1, LastRestart: t0.Add(-time.Minute)}
	req := Request{Hashes: hashes(3, 512), BlockTokens: 64, PromptTokens: 512, MaxTokens: 8, Model: "m"}
	d := f.Decide(t0, req, ms, &opts, rng(), nil)
	served(f, d.Charge, t0)
	if u := state(t, f, "a"); u.IndexResets != 0 || u.IndexBlocks != 8 {
		t.Fatalf("a restart seen before anything was routed: %+v", u)
	}
	ms[0].Engine = &scrape.Signals{Running: -1, Waiting: -1, LastRestart: t0.Add(500 * time.Millisecond)}
	d = f.Decide(t0.Add(time.Second), req, ms, &opts, rng(), nil)
	if d.Reason != scorer.Cold || d.MatchedTokens != 0 {
		t.Fatalf("after the restart the prompt is still warm: %+v", d)
	}
	if u := state(t, f, "a"); u.IndexResets != 1 {
		t.Fatalf("the restart was not counted: %+v", u)
	}
	// Told by the scraper as it sees a restart, the index forgets at once,
	// before any decision; the same restart read again at a decision is
	// not a second one.
	served(f, d.Charge, t0.Add(time.Second))
	restart := t0.Add(2 * time.Second)
	f.EngineRestarted("a", restart)
	if u := state(t, f, "a"); u.IndexResets != 2 || u.IndexBlocks != 0 {
		t.Fatalf("after being told of a restart: %d resets, %d blocks; want 2, 0", u.IndexResets, u.IndexBlocks)
	}
	ms[0].Engine = &scrape.Signals{Running: -1, Waiting: -1, LastRestart: restart}
	d = f.Decide(t0.Add(3*time.Second), req, ms, &opts, rng(), nil)
	served(f, d.Charge, t0.Add(3*time.Second))
	d = f.Decide(t0.Add(4*time.Second), req, ms, &opts, rng(), nil)
	if u := state(t, f, "a"); u.IndexResets != 2 || d.Reason != scorer.Warm {
		t.Fatalf("the told restart counted again at a decision: %d resets, %v", u.IndexResets, d.Reason)
	}
	f.EngineRestarted("unknown", restart) // nothing to forget
}

// TestFailedAttemptForgetsItsBlocks: a request released before its first
// token (it failed before the engine prefilled it) takes back the blocks
// its decision added to the index, not those the upstream held before; one
// that got its first token keeps them.
func TestFailedAttemptForgetsItsBlocks(t *testing.T) {
	f := New()
	opts := Options{}.WithDefaults()
	ms := members("a")
	system := hashes(5, 1024) // 16 blocks every turn shares
	turn := func(extra int) Request {
		h := append(append([]uint64(nil), system...), hashes(uint64(100+extra), 256)...)
		return Request{Hashes: h, BlockTokens: 64, PromptTokens: 1024 + 256, MaxTokens: 8, Model: "m"}
	}
	// The shared part, served: the upstream holds it.
	first := f.Decide(t0, Request{Hashes: system, BlockTokens: 64, PromptTokens: 1024, MaxTokens: 8, Model: "m"}, ms, &opts, rng(), nil)
	f.Progress(first.Charge, 1, t0)
	f.Complete(first.Charge, "m", Usage{OutputTokens: 8}, t0)

	failed := f.Decide(t0, turn(1), ms, &opts, rng(), nil)
	f.Release(failed.Charge, t0) // e.g. the engine answered 500 at once
	again := f.Decide(t0, turn(1), ms, &opts, rng(), nil)
	if again.MatchedTokens != 1024 {
		t.Fatalf("after a failed attempt the turn matched %d tokens, want the 1,024 held before", again.MatchedTokens)
	}
	f.Progress(again.Charge, 1, t0) // this one was prefilled, then the client left
	f.Release(again.Charge, t0)
	if d := f.Decide(t0, turn(1), ms, &opts, rng(), nil); d.MatchedTokens != 1280 {
		t.Fatalf("after a prefilled attempt the turn matched %d tokens, want 1,280", d.MatchedTokens)
	}
}

// TestFailedAttemptKeepsWhatAnotherPrefilled: a request that fails before
// its first token does not take back blocks a later request on the same
// upstream ran through: whether that one's first token came before the
// failure (its prefill went through them) or after it (the engine has
// just prefilled them), the upstream holds the failed request's prompt,
// and the index says so, prefix-closed. It takes back the rest: all of
// its blocks when the other's prompt shares none of them, its own tail
// when the two share a system prompt.
func TestFailedAttemptKeepsWhatAnotherPrefilled(t *testing.T) {
	opts := Options{}.WithDefaults()
	ms := members("a")
	long := hashes(1, 2048) // B: A's 1,024 tokens and 1,024 more
	reqA := Request{Hashes: long[:16], BlockTokens: 64, PromptTokens: 1024, Model: "m"}
	reqB := Request{Hashes: long, BlockTokens: 64, PromptTokens: 2048, Model: "m"}
	for _, bFirst := range []bool{true, false} {
		f := New()
		a := f.Decide(t0, reqA, ms, &opts, rng(), nil)
		b := f.Decide(t0, reqB, ms, &opts, rng(), nil)
		if b.MatchedTokens != 1024 {
			t.Fatalf("B matched %d of A's 1,024 tokens", b.MatchedTokens)
		}
		if bFirst {
			f.Progress(b.Charge, 1, t0) // B prefilled all 2,048 tokens...
			f.Release(a.Charge, t0)     // ...then A's client gave up
		} else {
			f.Release(a.Charge, t0) // A's client gave up...
			f.Progress(b.Charge, 1, t0)
		}
		f.Complete(b.Charge, "m", Usage{OutputTokens: 10}, t0)
		if d := f.Decide(t0, reqA, ms, &opts, rng(), nil); d.MatchedTokens != 1024 {
			t.Errorf("B's first token first: %v: A again matched %d of 1,024 tokens", bFirst, d.MatchedTokens)
		}
		if d := f.Decide(t0, reqB, ms, &opts, rng(), nil); d.MatchedTokens != 2048 {
			t.Errorf("B's first token first: %v: B again matched %d of 2,048 tokens", bFirst, d.MatchedTokens)
		}
	}

	system := hashes(5, 1024)
	turn := func(seed uint64) Request {
		h := append(append([]uint64(nil), system...), hashes(seed, 1024)...)
		return Request{Hashes: h, BlockTokens: 64, PromptTokens: 2048, Model: "m"}
	}
	for _, tc := range []struct {
		name    string
		a, c    Request
		matched int // A's prompt, sent again after A failed and C was served
	}{
		{"unrelated prompts", Request{Hashes: hashes(1, 1024), BlockTokens: 64, PromptTokens: 1024, Model: "m"},
			Request{Hashes: hashes(2, 1024), BlockTokens: 64, PromptTokens: 1024, Model: "m"}, 0},
		{"a shared system prompt", turn(100), turn(200), 1024},
	} {
		f := New()
		a := f.Decide(t0, tc.a, ms, &opts, rng(), nil)
		c := f.Decide(t0, tc.c, ms, &opts, rng(), nil)
		f.Progress(c.Charge, 1, t0) // C prefilled its prompt...
		f.Release(a.Charge, t0)     // ...then A failed before its first token
		if d := f.Decide(t0, tc.a, ms, &opts, rng(), nil); d.MatchedTokens != tc.matched {
			t.Errorf("%s: A's prompt matches %d tokens after A failed, want %d", tc.name, d.MatchedTokens, tc.matched)
		}
	}
}

// TestTooLongCountsWhatSurelyRuns: a request is refused as too long only
// for what it surely needs: its whole prompt (cached or not: the cache is
// in the same KV) and its max_tokens when set. Its expected output is an
// estimate that an engine cuts at the context, and a prompt counted from
// text is an estimate too, surely no shorter than a token every 16 bytes:
// within that the request is routed (it starts once the KV is free), and
// the engine, which counts exactly, answers for it.
func TestTooLongCountsWhatSurelyRuns(t *testing.T) {
	opts := Options{OutputEstimate: OutputFixed, OutputTokens: 500}.WithDefaults()
	ms := members("a", "b")
	for i := range ms {
		ms[i].Hardware.KVCapacityTokens = 4096
	}
	decide := func(f *Fleet, req Request) Decision {
		t.Helper()
		d := f.Decide(t0, req, ms, &opts, rng(), nil)
		if d.Charge != nil {
			served(f, d.Charge, t0)
		}
		return d
	}
	for _, tc := range []struct {
		name    string
		req     Request
		tooLong bool
	}{
		{"prompt 4,000 and 500 expected", Request{PromptTokens: 4000}, false},
		{"prompt 3,000 and max_tokens 2,000", Request{PromptTokens: 3000, MaxTokens: 2000}, true},
		{"prompt 3,000 and max_tokens 1,000", Request{PromptTokens: 3000, MaxTokens: 1000}, false},
		{"text estimated at 5,000", Request{PromptTokens: 5000, PromptBytes: 20_000}, false},
		{"text of 65,536 bytes: 4,096 tokens at 16 bytes a token", Request{PromptTokens: 16_384, PromptBytes: 65_536}, false},
		{"text of 65,552 bytes: 4,097 tokens at 16 bytes a token", Request{PromptTokens: 16_388, PromptBytes: 65_552}, true},
		{"text of 32,768 bytes and max_tokens 2,048", Request{PromptTokens: 8192, PromptBytes: 32_768, MaxTokens: 2048}, false},
		{"text of 32,784 bytes and max_tokens 2,048", Request{PromptTokens: 8196, PromptBytes: 32_784, MaxTokens: 2048}, true},
		{"token ids, 4,097", Request{PromptTokens: 4097}, true},
		{"prompt 3,000 and max_output_tokens 2,000, which the engine caps", Request{PromptTokens: 3000, MaxTokens: 2000, MaxTokensCapped: true}, false},
		{"a batch of two 3,000-token prompts", Request{PromptTokens: 6000, LongestPromptTokens: 3000}, false},
		{"a batch whose longest prompt is 4,097", Request{PromptTokens: 8194, LongestPromptTokens: 4097}, true},
	} {
		d := decide(New(), tc.req)
		if d.TooLong != tc.tooLong || (d.Charge != nil) == tc.tooLong {
			t.Errorf("%s: too long %v, chosen %d; want too long %v", tc.name, d.TooLong, d.Chosen, tc.tooLong)
		}
	}

	// A learned ratio does not make a refusal stricter: traffic at 1 byte
	// a token (short agent turns, code) says little of the next prompt's
	// text.
	dense := New()
	dense.learn("m", 8000, Usage{PromptTokens: 8000})
	dense.learn("m", 8000, Usage{PromptTokens: 8000})
	dense.learn("m", 8000, Usage{PromptTokens: 8000})
	if bpt, ok := dense.BytesPerToken("m"); !ok || bpt != 1 {
		t.Fatalf("learned %v (%v), want 1", bpt, ok)
	}
	if d := decide(dense, Request{Model: "m", PromptTokens: 1250, PromptBytes: 5000}); d.TooLong {
		t.Error("5,000 bytes of text refused on the learned ratio alone")
	}
	if d := decide(dense, Request{Model: "m", PromptTokens: 16_388, PromptBytes: 65_552}); !d.TooLong {
		t.Error("65,552 bytes of text not refused, though too long at 16 bytes a token")
	}

	// A prompt longer than the KV is too long however much of it an
	// upstream holds cached.
	f := New()
	long := Request{Hashes: hashes(7, 4000), BlockTokens: 64, PromptTokens: 4000}
	if d := decide(f, long); d.Charge == nil {
		t.Fatalf("the 4,000-token prefix was not placed: %+v", d)
	}
	longer := Request{Hashes: hashes(7, 6000), BlockTokens: 64, PromptTokens: 6000}
	if d := decide(f, longer); !d.TooLong || d.Charge != nil {
		t.Fatalf("6,000 tokens, 3,968 of them cached, against 4,096 of KV: %+v", d)
	}
}

// TestWholeFitFirst: a replica whose KV holds a request only cut at its
// context (its max_tokens, or its expected output, beyond what is left)
// is taken only when no replica holds it whole.
func TestWholeFitFirst(t *testing.T) {
	opts := Options{OutputEstimate: OutputFixed, OutputTokens: 500}.WithDefaults()
	ms := members("small", "big")
	ms[0].Hardware.KVCapacityTokens = 4096
	ms[1].Hardware.KVCapacityTokens = 131_072
	for seed := range uint64(20) {
		for _, req := range []Request{
			{PromptTokens: 3900, PromptBytes: 15_600, MaxTokens: 500},
			{PromptTokens: 3900},
		} {
			f := New()
			d := f.Decide(t0, req, ms, &opts, rand.New(rand.NewPCG(seed, 1)), nil)
			if d.Charge == nil || d.Charge.Dial() != "big" {
				t.Fatalf("seed %d, %+v: went to %v", seed, req, d.Charge)
			}
		}
	}
	// With big down, small runs what it can hold cut at its context.
	ms[1].Available = false
	if d := New().Decide(t0, Request{PromptTokens: 3900}, ms, &opts, rng(), nil); d.Charge == nil || d.Charge.Dial() != "small" {
		t.Fatalf("big down: %+v", d)
	}
}

// TestShortPromptCutAtContext: a request whose prompt is text shorter
// than the bytes a token surely holds, and that sets no max_tokens, still
// surely takes a token of KV (its first output token), so when its
// expected output (here n choices of it) exceeds every replica's KV it
// runs cut at its context, as a longer prompt does, instead of waiting
// for KV that never frees and being shed: "hi" with n=1000 was held for
// queue_timeout and got 503, where "hello there, how are you" was routed.
func TestShortPromptCutAtContext(t *testing.T) {
	opts := Options{OutputEstimate: OutputFixed, OutputTokens: 500}.WithDefaults()
	ms := members("a", "b")
	for i := range ms {
		ms[i].Hardware.KVCapacityTokens = 131_072
	}
	for _, req := range []Request{
		{PromptTokens: 1, PromptBytes: 2, Sequences: 1000},
		{PromptTokens: 6, PromptBytes: 24, Sequences: 1000},
		{PromptTokens: 0, Sequences: 1000}, // an empty prompt: the engine answers for it
	} {
		d := New().Decide(t0, req, ms, &opts, rng(), nil)
		if d.Charge == nil || !d.CutAtContext {
			t.Errorf("%+v: %+v, want it routed cut at its context", req, d.Decision)
		}
	}
}

// TestConfiguredCapacityAfterScraping: the KV capacity an engine reported
// outlives a stale scrape, but not a config that does not scrape: its
// configured capacity counts again.
func TestConfiguredCapacityAfterScraping(t *testing.T) {
	f := New()
	opts := Options{OutputEstimate: OutputFixed, OutputTokens: 10}.WithDefaults()
	ms := members("a")
	ms[0].Hardware.KVCapacityTokens = 4096
	ms[0].Scraped = true
	ms[0].Engine = &scrape.Signals{Running: 0, Waiting: 0, KVKnown: true, BlockSize: 16, NumGPUBlocks: 8192} // 131,072
	big := Request{PromptTokens: 20_000}
	d := f.Decide(t0, big, ms, &opts, rng(), nil)
	if d.Charge == nil {
		t.Fatalf("20,000 tokens against the engine's 131,072: %+v", d)
	}
	served(f, d.Charge, t0)
	ms[0].Engine = nil // stale
	if d := f.Decide(t0, big, ms, &opts, rng(), nil); d.Charge == nil {
		t.Fatalf("with the scrape stale: %+v", d)
	} else {
		served(f, d.Charge, t0)
	}
	ms[0].Scraped = false // reloaded without scraping
	if d := f.Decide(t0, big, ms, &opts, rng(), nil); !d.TooLong {
		t.Fatalf("after a reload that configures 4,096 and does not scrape: %+v", d)
	}
}

// TestSequencesChargedAndLearned: a request the engine answers with n
// sequences (n choices, or a batch of prompts) is charged each one's
// expected output, and its usage, which counts all their output, teaches
// the model their mean, here and at its peers.
func TestSequencesChargedAndLearned(t *testing.T) {
	f, peer := New(), New()
	peer.Name("a", t0)
	var events []Event
	f.SetPublisher(func(ev Event) { events = append(events, ev) })
	opts := Options{OutputTokens: 50}.WithDefaults()
	ms := members("a")
	d := f.Decide(t0, Request{Model: "m", PromptTokens: 100, Sequences: 4}, ms, &opts, rng(), nil)
	if s := state(t, f, "a"); s.QueuedDecodeTokens != 4*50 || s.KVTokensInFlight != 100+4*50 {
		t.Fatalf("4 sequences of 50 expected tokens: decode %d, KV %d; want 200, 300", s.QueuedDecodeTokens, s.KVTokensInFlight)
	}
	f.Progress(d.Charge, 1, t0)
	f.Complete(d.Charge, "m", Usage{PromptTokens: 100, OutputTokens: 4 * 80}, t0) // 80 each
	for _, fl := range []*Fleet{f, peer} {
		if fl == peer {
			for _, ev := range events {
				fl.Apply("r1", ev, t0)
			}
		}
		d := fl.Decide(t0, Request{Model: "m", PromptTokens: 100}, ms, &opts, rng(), nil)
		if got := state(t, fl, "a").QueuedDecodeTokens; got != 80 {
			t.Errorf("peer %v: one sequence's expected output %d, want the mean learned, 80", fl == peer, got)
		}
		fl.Release(d.Charge, t0)
	}
	// An absurd count (near MaxInt) is no mean to learn, as it is not for
	// one sequence: the estimate stays at the 80 learned.
	d = f.Decide(t0, Request{Model: "m", PromptTokens: 100, Sequences: 2}, ms, &opts, rng(), nil)
	f.Progress(d.Charge, 1, t0)
	f.Complete(d.Charge, "m", Usage{PromptTokens: 100, OutputTokens: math.MaxInt}, t0)
	d = f.Decide(t0, Request{Model: "m", PromptTokens: 100}, ms, &opts, rng(), nil)
	if got := state(t, f, "a").QueuedDecodeTokens; got != 80 {
		t.Errorf("after an absurd usage of 2 sequences, one sequence's expected output is %d, want 80", got)
	}
	f.Release(d.Charge, t0)
}

// BenchmarkFirstTokenWithPending: a first token at an upstream where
// 1,024 other requests wait for theirs notes, for each, the blocks their
// prompts share (see Fleet.confirm): half share a 2,048-token system
// prompt with it, half nothing.
func BenchmarkFirstTokenWithPending(b *testing.B) {
	f := New()
	opts := Options{OutputEstimate: OutputFixed, OutputTokens: 10}.WithDefaults()
	ms := members("a")
	ms[0].Hardware.KVCapacityTokens = 1 << 30
	system := hashes(1, 2048)
	turn := func(seed uint64) Request {
		h := append(append([]uint64(nil), system...), hashes(seed, 1024)...)
		if seed%2 == 0 {
			h = hashes(seed, 3072) // another prompt
		}
		return Request{Hashes: h, BlockTokens: 64, PromptTokens: 3072}
	}
	for i := range 1024 {
		if f.Decide(t0, turn(uint64(100+i)), ms, &opts, rng(), nil).Charge == nil {
			b.Fatal("a waiting request was not placed")
		}
	}
	req := turn(3)
	r := rng()
	b.ReportAllocs()
	for b.Loop() {
		d := f.Decide(t0, req, ms, &opts, r, nil)
		f.Progress(d.Charge, 1, t0)
		f.Complete(d.Charge, "", Usage{OutputTokens: 10}, t0)
	}
}

// TestConfiguredAdapterLoadsAnywhere: an adapter named in Options.Adapters
// is one any engine can load on its first request (vLLM's LoRA resolvers,
// kvsim's adapters on storage): no list naming it is no 404, and an engine
// whose list lacks it may take it, as one whose list is unknown may, the
// ones listing it first. An adapter not configured and listed nowhere is
// not served here, as before.
func TestConfiguredAdapterLoadsAnywhere(t *testing.T) {
	f := New()
	opts := Options{Adapters: map[string]bool{"tz": true}}.WithDefaults()
	ms := members("a", "b")
	for i := range ms {
		ms[i].Engine = &scrape.Signals{Running: -1, Waiting: -1, Models: []scrape.ModelInfo{{ID: "base"}}}
	}
	d := f.Decide(t0, Request{Model: "tz", PromptTokens: 100}, ms, &opts, rng(), nil)
	if d.Charge == nil || d.Unservable {
		t.Fatalf("a configured adapter no list names: %+v (blocked by %s), want it routed", d, d.Blocked)
	}
	f.Release(d.Charge, t0)
	if d := f.Decide(t0, Request{Model: "tq", PromptTokens: 100}, ms, &opts, rng(), nil); d.Charge != nil || !d.Unservable {
		t.Fatalf("an adapter neither configured nor listed: %+v, want it unservable", d)
	}
	ms[1].Engine.Models = append(ms[1].Engine.Models, scrape.ModelInfo{ID: "tz", Parent: "base"})
	for i := range 10 {
		d := f.Decide(t0, Request{Model: "tz", PromptTokens: 100}, ms, &opts, rng(), nil)
		if d.Charge == nil || d.Charge.Dial() != "b" {
			t.Fatalf("request %d with b listing the adapter: %+v, want b", i, d)
		}
	}
}

// TestConfiguredAdapterStaysOnItsBase: a configured adapter loads only on
// an engine of its base model: one serving another base model is no
// candidate for it, whatever the others' load (a review's test). Its base
// is its parent on the lists that name it; with no list naming it, any
// engine may take it only while the lists name one base model.
func TestConfiguredAdapterStaysOnItsBase(t *testing.T) {
	f := New()
	opts := Options{Adapters: map[string]bool{"tz": true}}.WithDefaults()
	ms := members("a", "b")
	ms[0].Engine = &scrape.Signals{Running: -1, Waiting: -1, Models: []scrape.ModelInfo{{ID: "llama"}, {ID: "tz", Parent: "llama"}}}
	ms[1].Engine = &scrape.Signals{Running: -1, Waiting: -1, Models: []scrape.ModelInfo{{ID: "qwen"}}}
	ms[0].Available = false
	if d := f.Decide(t0, Request{Model: "tz", PromptTokens: 100}, ms, &opts, rng(), nil); d.Charge != nil {
		t.Fatalf("adapter tz (base llama) routed to %s, which serves only qwen", d.Charge.Dial())
	}
	ms[0].Engine.Models = []scrape.ModelInfo{{ID: "llama"}}
	if d := f.Decide(t0, Request{Model: "tz", PromptTokens: 100}, ms, &opts, rng(), nil); d.Charge != nil || !d.Unservable {
		t.Fatalf("adapter tz listed nowhere, two base models: %+v, want it unservable", d)
	}
}
