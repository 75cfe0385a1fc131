package router

import (
	"math"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/llmaffinity/caddy-llm-affinity/scorer"
)

// TestKVWaitProperties checks the KV-fit rule on random fleets and
// requests, against the scorer's view of each member
// (scorer.KVWaitSeconds):
//
//   - a request is routed only where it fits its KV now or is expected to
//     within its MaxWait, and never where its need exceeds the whole KV;
//   - it is refused only when no member can start it within MaxWait;
//   - allowing a longer wait never refuses a request a shorter one
//     admitted;
//   - with MaxWait 0 the rule is the old one: fits in free KV now;
//   - charging more on a member never shortens its wait;
//   - a prompt larger than every member's KV is TooLong, whatever the wait.
func TestKVWaitProperties(t *testing.T) {
	r := rand.New(rand.NewPCG(14, 2))
	opts := Options{OutputTokens: 200}.WithDefaults()
	for iter := range 400 {
		f := New()
		n := 1 + r.IntN(4)
		ms := make([]Member, n)
		for i := range ms {
			ms[i] = Member{
				Dial: string(rune('a' + i)), Available: true, Healthy: true,
				Hardware: Hardware{PrefillTokensPerSecond: 10_000, DecodeTokensPerSecond: 2_000, KVCapacityTokens: 20_000 + r.IntN(80_000)},
			}
		}
		// Load the members with charges, some beyond their capacity (queued
		// at the engine for KV).
		for k := range r.IntN(30) {
			m := ms[r.IntN(n)]
			req := Request{Hashes: hashes(uint64(1000*iter+k), 64), BlockTokens: 64, PromptTokens: 500 + r.IntN(30_000), MaxTokens: 50 + r.IntN(500), MaxWait: time.Hour}
			if d := f.Decide(t0, req, []Member{m}, &opts, rng(), nil); d.Charge != nil && r.IntN(4) == 0 {
				f.Progress(d.Charge, 1+r.IntN(20), t0)
			}
		}
		req := Request{Hashes: hashes(uint64(iter)<<32, 64), BlockTokens: 64, PromptTokens: 100 + r.IntN(60_000), MaxTokens: 1 + r.IntN(1000)}
		maxWait := time.Duration(r.IntN(10_000)) * time.Millisecond
		req.MaxWait = maxWait

		// The scorer's view of every member, before deciding.
		f.mu.Lock()
		sreq, view, _ := f.candidates(t0, &req, ms, &opts, true)
		cands := append([]scorer.Candidate(nil), view...)
		f.mu.Unlock()
		waits := make([]float64, n)
		startable := false
		for i := range cands {
			waits[i] = scorer.KVWaitSeconds(&sreq, &cands[i])
			need := max(0, sreq.PromptTokens-cands[i].MatchedTokens) + sreq.OutputTokens
			if need > cands[i].KVCapacityTokens && !math.IsInf(waits[i], 1) {
				t.Fatalf("iter %d: need %d > capacity %d, wait %v", iter, need, cands[i].KVCapacityTokens, waits[i])
			}
			if (waits[i] == 0) != (need <= cands[i].FreeKVTokens) {
				t.Fatalf("iter %d: wait %v with need %d and %d free", iter, waits[i], need, cands[i].FreeKVTokens)
			}
			startable = startable || waits[i] <= maxWait.Seconds()
			// Monotone in the MaxWait: Fits with w implies Fits with more.
			short, long := req, req
			short.MaxWait, long.MaxWait = 0, maxWait+time.Hour
			fitsNow, fits, fitsLater := f.Fits(t0, short, ms[i], &opts), f.Fits(t0, req, ms[i], &opts), f.Fits(t0, long, ms[i], &opts)
			if fitsNow != (need <= cands[i].FreeKVTokens) || (fitsNow && !fits) || (fits && !fitsLater) {
				t.Fatalf("iter %d member %d: fits now %v, within %v %v, within an hour more %v (wait %v)", iter, i, fitsNow, maxWait, fits, fitsLater, waits[i])
			}
			// Charging more KV there never shortens the wait.
			more := cands[i]
			more.FreeKVTokens = max(0, more.FreeKVTokens-1000)
			more.KVOvercommitTokens += 1000 - (cands[i].FreeKVTokens - more.FreeKVTokens)
			more.QueuedDecodeTokens += 200
			if w := scorer.KVWaitSeconds(&sreq, &more); w < waits[i] {
				t.Fatalf("iter %d: more charged, wait %v < %v", iter, w, waits[i])
			}
		}

		d := f.Decide(t0, req, ms, &opts, rng(), nil)
		if d.Charge == nil {
			if startable {
				t.Fatalf("iter %d: refused although waits %v are within %v", iter, waits, maxWait)
			}
			continue
		}
		if !startable || waits[d.Chosen] > maxWait.Seconds() {
			t.Fatalf("iter %d: routed to %d with wait %v > %v", iter, d.Chosen, waits[d.Chosen], maxWait)
		}
		// The wait is part of the estimate.
		if d.EstimatedTTFTSeconds < waits[d.Chosen] {
			t.Fatalf("iter %d: estimate %v below the KV wait %v", iter, d.EstimatedTTFTSeconds, waits[d.Chosen])
		}
	}

	// A prompt beyond every member's KV is TooLong at once, however long
	// it may wait.
	f := New()
	ms := []Member{{Dial: "a", Available: true, Hardware: Hardware{KVCapacityTokens: 10_000}}, {Dial: "b", Available: true, Hardware: Hardware{KVCapacityTokens: 20_000}}}
	d := f.Decide(t0, Request{PromptTokens: 30_000, MaxTokens: 10, MaxWait: time.Hour}, ms, &opts, rng(), nil)
	if d.Charge != nil || !d.TooLong {
		t.Fatalf("a 30k prompt on 10k and 20k KV: %+v", d)
	}
}

// TestKVWaitRoutesWhereItStartsSoonest: with both members' KV full, the
// request goes to the one whose charged work drains sooner, queued there
// rather than shed, and its estimate includes the wait.
func TestKVWaitRoutesWhereItStartsSoonest(t *testing.T) {
	f := New()
	opts := Options{OutputTokens: 1000, OutputEstimate: OutputFixed}.WithDefaults()
	hw := Hardware{PrefillTokensPerSecond: 10_000, DecodeTokensPerSecond: 1_000, KVCapacityTokens: 20_000}
	ms := []Member{{Dial: "a", Available: true, Hardware: hw}, {Dial: "b", Available: true, Hardware: hw}}
	// a: 19k of KV in one request with 1,000 tokens to generate; b: the
	// same, plus a second request's output still to generate.
	fill := func(m Member, prompt, seed int) *Charge {
		d := f.Decide(t0, Request{Hashes: hashes(uint64(seed), 64), BlockTokens: 64, PromptTokens: prompt, MaxTokens: 1000}, []Member{m}, &opts, rng(), nil)
		if d.Charge == nil {
			t.Fatalf("fill %s: %+v", m.Dial, d)
		}
		f.Progress(d.Charge, 1, t0) // prefill done
		return d.Charge
	}
	fill(ms[0], 18_000, 1)
	fill(ms[1], 8_000, 2)
	fill(ms[1], 9_000, 3)
	req := Request{Hashes: hashes(9, 64), BlockTokens: 64, PromptTokens: 4_000, MaxTokens: 1000}
	if d := f.Decide(t0, req, ms, &opts, rng(), nil); d.Charge != nil || d.TooLong {
		t.Fatalf("without a wait allowed it fits nowhere now: %+v", d)
	}
	req.MaxWait = 30 * time.Second
	d := f.Decide(t0, req, ms, &opts, rng(), nil)
	if d.Charge == nil || d.Chosen != 0 {
		t.Fatalf("with a wait allowed, want a (its KV frees sooner): %+v", d)
	}
	// a: 19k in use, 1k free, 5k needed: 4k of 19k must free, which only
	// the end of a's one request does, its 999 tokens in 0.999 s (b's
	// first of two to end, at a third of their 1,998 tokens at two a step,
	// takes 1.332 s).
	want := 0.999
	if math.Abs(d.EstimatedTTFTSeconds-(want+0.4)) > 0.05 {
		t.Errorf("estimate %.3f s, want the KV wait %.3f s plus 0.4 s of prefill", d.EstimatedTTFTSeconds, want)
	}
}
