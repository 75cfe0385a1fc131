package scorer

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
)

func cand(name string, matched, queuedPrefill int) Candidate {
	return Candidate{
		Name: name, Available: true, MatchedTokens: matched, QueuedPrefillTokens: queuedPrefill,
		Waiting: -1, FreeKVTokens: -1, UncachedRoomTokens: -1, PrefillTokensPerSecond: 10_000, DecodeTokensPerSecond: 2_000,
	}
}

func req(prompt int) Request {
	return Request{PromptTokens: prompt, Blocks: prompt / 64, BlockTokens: 64, OutputTokens: 100}
}

func TestFilters(t *testing.T) {
	base := cand("ok", 0, 0)
	cases := []struct {
		name string
		edit func(c *Candidate, r *Request)
		want FilterReason
	}{
		{"passes", func(c *Candidate, r *Request) {}, NotFiltered},
		{"unavailable", func(c *Candidate, r *Request) { c.Available = false }, FilteredUnavailable},
		{"draining", func(c *Candidate, r *Request) { c.Draining = true }, FilteredDraining},
		{"wrong model", func(c *Candidate, r *Request) { c.Models = []string{"a"}; r.Model = "b" }, FilteredModel},
		{"right model", func(c *Candidate, r *Request) { c.Models = []string{"a"}; r.Model = "a" }, NotFiltered},
		{"adapter not served", func(c *Candidate, r *Request) { c.Models = []string{"a"}; r.Model = "a"; r.Adapter = "x" }, FilteredModel},
		{"kv unknown", func(c *Candidate, r *Request) { r.PromptTokens = 1 << 30 }, NotFiltered},
		{"kv too small", func(c *Candidate, r *Request) { c.FreeKVTokens = 1000; r.PromptTokens = 950 }, FilteredKV},
		{"kv fits thanks to cache", func(c *Candidate, r *Request) {
			c.FreeKVTokens = 1000
			r.PromptTokens = 950
			c.MatchedTokens = 900
		}, NotFiltered},
	}
	for _, tc := range cases {
		c, r := base, req(1000)
		tc.edit(&c, &r)
		if got := filter(&r, &c, 0); got != tc.want {
			t.Errorf("%s: filter = %v, want %v", tc.name, got, tc.want)
		}
	}
	c, r := base, req(1000)
	c.FreeKVTokens = 1150
	if filter(&r, &c, 100) != FilteredKV {
		t.Error("KV margin not applied")
	}
}

// TestMaybeTooLongIsNotHeldForKV: a request whose expected context is
// beyond every engine's, though what it surely takes is within it (its
// prompt counted from text), goes to an engine at once, busy or not: the
// engine counts it exactly and refuses it at once if it is too long. Held
// for the whole KV to free, it was shed with 503 under load, and the
// client retried what the idle fleet answered with 400. One within the
// context still waits for KV as before.
func TestMaybeTooLongIsNotHeldForKV(t *testing.T) {
	busy := cand("busy", 0, 2000)
	busy.ContextTokens, busy.KVCapacityTokens, busy.FreeKVTokens = 4096, 4096, 500
	busy.QueuedDecodeTokens = 20_000 // the KV frees in about 10 s
	r := Request{PromptTokens: 3011, BlockTokens: 16, OutputTokens: 1500, MaxKVWaitSeconds: 4}
	r.ContextTokens, r.LeastKVTokens = 3011+1500, 2509+1500
	if d := Choose(r, []Candidate{busy}, Options{}, nil, nil); d.Chosen != 0 {
		t.Fatalf("a request the engine may refuse as too long was held for KV: %+v", d)
	}
	// Where nothing queued frees the KV (the engine's own figure says it
	// is in use), the wait is endless: the request is not sent there with
	// an infinite estimate.
	stuck := busy
	stuck.QueuedPrefillTokens, stuck.QueuedDecodeTokens = 0, 0
	if d := Choose(r, []Candidate{stuck}, Options{}, nil, nil); d.Chosen != -1 || d.Blocked != FilteredKV {
		t.Fatalf("sent where the KV never frees: %+v", d)
	}
	r.ContextTokens, r.LeastKVTokens = 3011+1000, 2509+1000
	r.OutputTokens = 1000
	if d := Choose(r, []Candidate{busy}, Options{}, nil, nil); d.Chosen != -1 || d.Blocked != FilteredKV {
		t.Fatalf("a request within the context did not wait for KV: %+v", d)
	}

	// An expected context beyond the whole KV may be refused alike (an
	// engine's context fits its KV), whether the context length is not
	// known or said to be longer.
	for _, context := range []int{0, 131_072} {
		other := busy
		other.ContextTokens = context
		r.ContextTokens, r.LeastKVTokens, r.OutputTokens = 3011+1500, 500+1500, 1500
		if d := Choose(r, []Candidate{other}, Options{}, nil, nil); d.Chosen != 0 {
			t.Fatalf("context %d: a request beyond the whole KV was held for KV: %+v", context, d)
		}
		r.ContextTokens, r.LeastKVTokens = 3011, 500 // its output expected, not asked for
		if d := Choose(r, []Candidate{other}, Options{}, nil, nil); d.Chosen != -1 || d.Blocked != FilteredKV {
			t.Fatalf("context %d: a request whose prompt and max_tokens fit the KV did not wait for KV: %+v", context, d)
		}
	}
}

func TestShedWhenNothingFits(t *testing.T) {
	a, b := cand("a", 0, 0), cand("b", 0, 0)
	a.FreeKVTokens, b.FreeKVTokens = 100, 200
	c := cand("c", 0, 0)
	c.Draining = true
	var ex Explanation
	d := Choose(req(5000), []Candidate{a, b, c}, Options{}, nil, &ex)
	if d.Chosen != -1 || d.Reason != Shed || d.Blocked != FilteredKV {
		t.Fatalf("got %+v, want shed blocked by kv", d)
	}
	if len(ex.Filtered) != 3 {
		t.Fatalf("explanation lists %d filtered, want 3", len(ex.Filtered))
	}
}

// TestToleranceRule checks the rule "stay warm iff Q_warm − Q_cold <
// t_prefill(k)" on random pairs of replicas, alone (the other terms off)
// and with the delay each choice imposes on the requests already there
// (I) and the request's own generation time (G, its output capped at
// 1,024 tokens): then warm wins iff
// Q_warm − Q_cold < t_prefill(k) + w·(I_cold − I_warm) + d·(G_cold − G_warm).
func TestToleranceRule(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	// Configured weights, and the weights they mean (0: the defaults,
	// 0.1 each; negative: off).
	for _, weights := range []struct{ imposed, decode, w, d float64 }{
		{-1, -1, 0, 0}, {0, -1, 0.1, 0}, {0.5, -1, 0.5, 0}, {-1, 0, 0, 0.1}, {0, 0, 0.1, 0.1}, {0.3, 0.7, 0.3, 0.7},
	} {
		opts := Options{TieSeconds: 1e-9, ImposedDelayWeight: weights.imposed, DecodeWeight: weights.decode}
		for trial := 0; trial < 5000; trial++ {
			prompt := 64 + r.IntN(20_000)
			k := r.IntN(prompt + 1)
			warm, cold := cand("warm", k, r.IntN(40_000)), cand("cold", 0, r.IntN(40_000))
			warm.QueuedDecodeTokens, cold.QueuedDecodeTokens = r.IntN(5000), r.IntN(5000)
			warm.InFlight, cold.InFlight = r.IntN(100), r.IntN(100)
			warm.ForeignInFlight, cold.ForeignInFlight = r.IntN(3)*r.IntN(50), r.IntN(3)*r.IntN(50)
			rq := req(prompt)
			rq.OutputTokens = []int{0, 1, 100, 1024, 5000, 100_000}[r.IntN(6)]
			nWarm, nCold := warm.InFlight+warm.ForeignInFlight, cold.InFlight+cold.ForeignInFlight
			rate, decode := 10_000.0, 2_000.0
			qWarm, qCold := QueuedSeconds(&warm), QueuedSeconds(&cold)
			tPrefill := float64(k) / rate
			imposedWarm := float64(prompt-k) / rate * float64(nWarm)
			imposedCold := float64(prompt) / rate * float64(nCold)
			out := float64(min(rq.OutputTokens, 1024))
			genWarm := out * float64(nWarm+1) / decode
			genCold := out * float64(nCold+1) / decode
			margin := tPrefill + weights.w*(imposedCold-imposedWarm) + weights.d*(genCold-genWarm)
			if diff := qWarm - qCold - margin; diff > -1e-6 && diff < 1e-6 {
				continue // too close to call in floating point
			}
			cands := []Candidate{warm, cold}
			if trial%2 == 1 {
				cands[0], cands[1] = cands[1], cands[0]
			}
			dec := Choose(rq, cands, opts, nil, nil)
			gotWarm := cands[dec.Chosen].Name == "warm"
			if wantWarm := qWarm-qCold < margin; gotWarm != wantWarm {
				t.Fatalf("weights %+v trial %d: prompt %d k %d output %d Qw %.4f Qc %.4f tp %.4f Iw %.4f Ic %.4f Gw %.4f Gc %.4f: chose %s",
					weights, trial, prompt, k, rq.OutputTokens, qWarm, qCold, tPrefill, imposedWarm, imposedCold, genWarm, genCold, cands[dec.Chosen].Name)
			}
		}
	}
}

func TestFilteredNeverChosen(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 5))
	for _, s := range Strategies {
		for trial := 0; trial < 2000; trial++ {
			n := 1 + r.IntN(8)
			if trial%10 == 0 { // beyond the 64 whose filtering choose remembers
				n = 60 + r.IntN(40)
			}
			cands := make([]Candidate, n)
			for i := range cands {
				c := cand(fmt.Sprint(i), r.IntN(4000), r.IntN(10_000))
				c.InFlight = r.IntN(100)
				c.Available = r.IntN(5) > 0
				c.Draining = r.IntN(6) == 0
				if r.IntN(3) == 0 {
					c.FreeKVTokens, c.KVCapacityTokens = r.IntN(8000), 8000
				}
				if r.IntN(4) == 0 {
					c.Models = []string{"other"}
				}
				cands[i] = c
			}
			rq := req(r.IntN(6000))
			rq.Model = "m"
			d := Choose(rq, cands, Options{Strategy: s}, r, nil)
			if d.Chosen >= 0 && filter(&rq, &cands[d.Chosen], 0) != NotFiltered {
				t.Fatalf("%s chose filtered candidate %+v", s, cands[d.Chosen])
			}
			if (d.Chosen < 0) != (d.Eligible == 0) {
				t.Fatalf("%s: chosen %d with %d eligible", s, d.Chosen, d.Eligible)
			}
		}
	}
}

// hotPrefixSpillsAfter replays a stream of requests sharing one long
// prefix against a warm and a cold replica that already run others'
// requests: each goes to warm, adding its 200 uncached tokens to warm's
// queue, until the first goes to cold. It returns how many went to warm.
func hotPrefixSpillsAfter(t *testing.T, opts Options, othersInFlight int) int {
	t.Helper()
	warm, cold := cand("warm", 8000, 0), cand("cold", 0, 0)
	warm.InFlight, cold.InFlight = othersInFlight, othersInFlight
	rq := req(8200) // 8000 cached tokens save 0.8 s of prefill on warm
	for i := 0; i < 1000; i++ {
		d := Choose(rq, []Candidate{warm, cold}, opts, nil, nil)
		if d.Chosen == 1 {
			if d.Reason != Spill {
				t.Fatalf("reason %s, want spill", d.Reason)
			}
			return i
		}
		warm.QueuedPrefillTokens += 200
		warm.QueuedDecodeTokens += 100
		warm.InFlight++
	}
	t.Fatal("never spilled")
	return 0
}

// TestHotPrefixSpills: the warm replica takes a hot prefix's requests
// until its queue outweighs the prefill it saves, then the cold one gets
// one (spill).
func TestHotPrefixSpills(t *testing.T) {
	ttftOnly := Options{ImposedDelayWeight: -1, DecodeWeight: -1}
	// First token only: each warm request queues its 200 uncached tokens
	// (0.02 s) and one more sequence in flight (0.5 ms a step), so it
	// spills once that passes 0.8 s, after about 39.
	if n := hotPrefixSpillsAfter(t, ttftOnly, 0); n < 35 || n > 40 {
		t.Fatalf("spilled after %d requests, want about 39", n)
	}
	// Two idle replicas: copying the prefix to cold delays nobody there,
	// while each request on warm delays the ones before it a little, and
	// generates a little slower (0.1 × 100 tokens at 2,000 tokens/s per
	// request in flight): it spills sooner.
	if n := hotPrefixSpillsAfter(t, Options{DecodeWeight: -1}, 0); n < 30 || n > 38 {
		t.Fatalf("idle replicas: spilled after %d requests, want about 35", n)
	}
	if n := hotPrefixSpillsAfter(t, Options{}, 0); n < 26 || n > 34 {
		t.Fatalf("idle replicas, with generation time: spilled after %d requests, want about 29", n)
	}
	// Both replicas run 30 other requests: copying the 8,200-token prompt
	// to cold would slow each of them by 0.82 s, 2.46 s at weight 0.1, so
	// warm keeps the prefix far longer; its own crowding brings that in a
	// little (110 requests, 131 without it).
	withoutGeneration := hotPrefixSpillsAfter(t, Options{DecodeWeight: -1}, 30)
	if n := hotPrefixSpillsAfter(t, Options{}, 30); n < 100 || n > 120 || n >= withoutGeneration {
		t.Fatalf("busy replicas: spilled after %d requests, want about 110 (%d without generation time)", n, withoutGeneration)
	}
	if n := hotPrefixSpillsAfter(t, ttftOnly, 30); n > 40 {
		t.Fatalf("busy replicas, first token only: spilled after %d requests", n)
	}
}

func TestSameSeedSameDecisions(t *testing.T) {
	run := func() []int {
		r := rand.New(rand.NewPCG(42, 42))
		var out []int
		cands := make([]Candidate, 16)
		for i := range cands {
			cands[i] = cand(fmt.Sprint(i), 0, 0)
		}
		for i := 0; i < 200; i++ {
			d := Choose(req(1000), cands, Options{}, r, nil)
			out = append(out, d.Chosen)
			cands[d.Chosen].QueuedPrefillTokens += 1 // tiny: stays a tie
		}
		return out
	}
	a, b := run(), run()
	spread := map[int]bool{}
	for i := range a {
		if a[i] != b[i] {
			t.Fatalf("decision %d differs: %d vs %d", i, a[i], b[i])
		}
		spread[a[i]] = true
	}
	if len(spread) < 8 {
		t.Fatalf("ties herd onto %d of 16 replicas", len(spread))
	}
}

func TestAdapterCost(t *testing.T) {
	resident, remote := cand("resident", 0, 5000), cand("remote", 0, 0)
	resident.Adapter = AdapterResident
	remote.Adapter, remote.AdapterLoadSeconds = AdapterRemote, 2
	rq := req(1000)
	rq.Adapter = "tenant-a"
	d := Choose(rq, []Candidate{resident, remote}, Options{}, nil, nil)
	if d.Chosen != 0 || d.Reason != Cold {
		t.Fatalf("got %+v, want the resident holder (0.5 s queue < 2 s load)", d)
	}
	resident.QueuedPrefillTokens = 30_000 // 3 s queue > 2 s load
	d = Choose(rq, []Candidate{resident, remote}, Options{}, nil, nil)
	if d.Chosen != 1 || d.Reason != Adapter {
		t.Fatalf("got %+v, want the remote one to load the adapter", d)
	}
}

// TestAdapterEvictionCost: loading an adapter where every GPU slot holds
// another costs the evicted adapter's reload; among replicas that must
// load it, one with a free slot wins whatever the random draw, and a
// resident adapter evicts nothing.
func TestAdapterEvictionCost(t *testing.T) {
	rq := req(1000)
	rq.Adapter = "tenant-a"
	full, free := cand("full", 0, 0), cand("free", 0, 0)
	full.Adapter, full.AdapterLoadSeconds, full.AdapterEvictedSeconds = AdapterRemote, 2, 0.03
	free.Adapter, free.AdapterLoadSeconds = AdapterRemote, 2
	if got := AdapterEvictedSeconds(&rq, &full); got != 0.03 {
		t.Fatalf("evicted %v, want 0.03", got)
	}
	for seed := range uint64(32) {
		d := Choose(rq, []Candidate{full, free}, Options{}, rand.New(rand.NewPCG(seed, 1)), nil)
		if d.Chosen != 1 {
			t.Fatalf("seed %d: chose %s, want the replica with a free slot", seed, []string{"full", "free"}[d.Chosen])
		}
	}
	// The term is an eviction cost: off with the eviction weight, and
	// never charged for a resident adapter or a request without one.
	if d := Choose(rq, []Candidate{full, free}, Options{EvictionWeight: -1}, nil, nil); d.Chosen != 0 {
		t.Errorf("weight off: the first of two equal candidates, got %d", d.Chosen)
	}
	resident := full
	resident.Adapter = AdapterResident
	if got := AdapterEvictedSeconds(&rq, &resident); got != 0 {
		t.Errorf("resident adapter evicts %v", got)
	}
	base := req(1000)
	if got := AdapterEvictedSeconds(&base, &full); got != 0 {
		t.Errorf("base model evicts %v", got)
	}
	// A reload from host memory onto full slots costs its own load and
	// the evicted one's: still far less than a load from storage.
	host := full
	host.Adapter, host.AdapterLoadSeconds = AdapterHost, 0.03
	if d := Choose(rq, []Candidate{host, free}, Options{}, nil, nil); d.Chosen != 0 {
		t.Errorf("host reload (0.06 s with the eviction) lost to a 2 s load")
	}
}

func TestStrategies(t *testing.T) {
	warm, idle := cand("warm", 4096, 0), cand("idle", 0, 0)
	warm.InFlight, idle.InFlight = 10, 0
	warm.QueuedPrefillTokens = 6000
	rq := req(4160)
	cases := []struct {
		s    Strategy
		want string
	}{
		{TTFT, "idle"},      // 0.6 s queue vs 0.4 s of prefill saved: 0.6+0.006 > 0.416
		{SGLang, "warm"},    // balanced (10−0 ≤ 32), match rate 0.98 > 0.5
		{LLMD, "warm"},      // prefix 3·0.98 beats queue 2·1
		{Dynamo, "idle"},    // warm: 1+6000/64 + ..., idle: 65 + 65
		{LeastWork, "idle"}, // fewest queued tokens
	}
	for _, tc := range cases {
		d := Choose(rq, []Candidate{warm, idle}, Options{Strategy: tc.s}, nil, nil)
		if got := []string{"warm", "idle"}[d.Chosen]; got != tc.want {
			t.Errorf("%s chose %s, want %s", tc.s, got, tc.want)
		}
	}
	// SGLang's imbalance rule overrides the cache.
	warm.InFlight = 100
	d := Choose(rq, []Candidate{warm, idle}, Options{Strategy: SGLang}, nil, nil)
	if d.Chosen != 1 {
		t.Error("sglang ignored an imbalance of 100 vs 0")
	}
	if _, err := ParseStrategy("bogus"); err == nil {
		t.Error("ParseStrategy accepted bogus")
	}
}

func TestExplanation(t *testing.T) {
	cands := []Candidate{cand("a", 0, 100), cand("b", 1000, 0), cand("c", 0, 0), cand("d", 0, 50)}
	cands[3].Draining = true
	var ex Explanation
	d := Choose(req(2000), cands, Options{}, nil, &ex)
	if d.Chosen != 1 || len(ex.Top) != 3 || ex.Top[0].Name != "b" || len(ex.Filtered) != 1 || ex.Filtered[0].Reason != FilteredDraining {
		t.Fatalf("decision %+v explanation %+v", d, ex)
	}
}

func TestChooseDoesNotAllocate(t *testing.T) {
	cands, rq := benchCandidates(64)
	r := rand.New(rand.NewPCG(1, 1))
	for _, s := range Strategies {
		if n := testing.AllocsPerRun(100, func() { Choose(rq, cands, Options{Strategy: s}, r, nil) }); n != 0 {
			t.Errorf("%s: %.0f allocations per Choose", s, n)
		}
	}
}

func benchCandidates(n int) ([]Candidate, Request) {
	r := rand.New(rand.NewPCG(7, 7))
	cands := make([]Candidate, n)
	for i := range cands {
		c := cand(fmt.Sprintf("10.0.0.%d:8000", i), 64*r.IntN(60), r.IntN(50_000))
		c.QueuedDecodeTokens = r.IntN(20_000)
		c.InFlight = r.IntN(64)
		c.FreeKVTokens, c.KVCapacityTokens = 50_000+r.IntN(100_000), 160_000
		cands[i] = c
	}
	return cands, req(64_000)
}

func BenchmarkChoose(b *testing.B) {
	for _, n := range []int{8, 64} {
		b.Run(fmt.Sprintf("upstreams=%d", n), func(b *testing.B) {
			cands, rq := benchCandidates(n)
			r := rand.New(rand.NewPCG(1, 1))
			b.ReportAllocs()
			for b.Loop() {
				Choose(rq, cands, Options{}, r, nil)
			}
		})
	}
}

// TestExtremeCostsStillChoose: costs that overflow to +Inf (a huge
// imposed-delay weight) or turn NaN still leave a choice among the
// eligible candidates, never a panic.
func TestExtremeCostsStillChoose(t *testing.T) {
	busy, idle, empty := cand("busy", 0, 1000), cand("idle", 0, 0), cand("empty", 0, 0)
	busy.InFlight, idle.InFlight = 50, 10
	// With an infinite weight, the empty replica's imposed delay is Inf·0,
	// NaN, which must count as +Inf rather than win or poison the rest.
	for _, w := range []float64{1e308, math.Inf(1), math.NaN()} {
		for _, cands := range [][]Candidate{{busy, idle}, {idle, busy}, {empty, busy, idle}, {busy, idle, empty}} {
			d := Choose(req(4000), cands, Options{ImposedDelayWeight: w}, rand.New(rand.NewPCG(1, 1)), nil)
			if d.Chosen < 0 || d.Chosen >= len(cands) {
				t.Fatalf("weight %v: chose %d", w, d.Chosen)
			}
		}
	}
}

// TestForeignRequestsCountForTTFT: requests the engine reported beyond
// the router's own slow a new prompt (ttft) but are invisible to the
// strategies that mirror routers without engine metrics (sglang).
func TestForeignRequestsCountForTTFT(t *testing.T) {
	a, b := cand("a", 0, 0), cand("b", 0, 0)
	a.ForeignInFlight = 200
	if d := Choose(req(1000), []Candidate{a, b}, Options{}, nil, nil); d.Chosen != 1 {
		t.Fatalf("ttft chose the replica with 200 foreign requests")
	}
	b.InFlight = 1
	if d := Choose(req(1000), []Candidate{a, b}, Options{Strategy: SGLang}, nil, nil); d.Chosen != 0 {
		t.Fatalf("sglang counted foreign requests")
	}
}

// The other routers' rules break ties at random, as their own code does in
// effect: on an idle fleet with nothing cached every replica ties, and a
// port that took the lowest index would pile everything onto replica 0.
func TestPortedStrategiesBreakTiesAtRandom(t *testing.T) {
	cands := make([]Candidate, 32)
	for i := range cands {
		cands[i] = cand(fmt.Sprint(i), 0, 0)
	}
	warm := make([]Candidate, 32)
	copy(warm, cands)
	for _, i := range []int{5, 9, 20} { // three replicas hold the whole prompt
		warm[i].MatchedTokens = 1000
	}
	for _, s := range []Strategy{SGLang, LLMD, Dynamo} {
		r := rand.New(rand.NewPCG(1, 2))
		chosen := map[int]bool{}
		for range 400 {
			chosen[Choose(req(1000), cands, Options{Strategy: s}, r, nil).Chosen] = true
		}
		if len(chosen) < 24 {
			t.Errorf("%s on 32 idle replicas used %d of them in 400 decisions; ties should fall at random", s, len(chosen))
		}
		holders := map[int]bool{}
		for range 100 {
			holders[Choose(req(1000), warm, Options{Strategy: s}, r, nil).Chosen] = true
		}
		if len(holders) != 3 || !holders[5] || !holders[9] || !holders[20] {
			t.Errorf("%s chose %v among three equal holders; want all three and only them", s, holders)
		}
	}
}

// Within the tie tolerance the estimate cannot tell candidates apart; the
// one that holds the prefix wins over a cold copy, whatever the random
// draw, and among equally warm ones the draw still spreads.
func TestTiesPreferTheHolder(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	for trial := range 200 {
		n := 2 + r.IntN(7)
		cands := make([]Candidate, n)
		holder := r.IntN(n)
		for i := range cands {
			cands[i] = cand(fmt.Sprint(i), 0, 0)
		}
		// The holder's queue costs half a millisecond more than its
		// cached prefix saves: a tie within DefaultTieSeconds.
		cands[holder].MatchedTokens = 640
		cands[holder].QueuedPrefillTokens = 640 + 5
		q := req(1000)
		q.OutputTokens = 0
		d := Choose(q, cands, Options{ImposedDelayWeight: -1, DecodeWeight: -1}, r, nil)
		if d.Chosen != holder {
			t.Fatalf("trial %d: chose %d over the holder %d, within a tie", trial, d.Chosen, holder)
		}
	}
}

// The eviction term: on a replica whose prefix cache has room the copy
// costs nothing more; on a full one, each uncached token beyond the room
// counts its prefill. With every cache full, a holder whose queue costs
// less than twice the prefill it saves keeps the request; with room
// everywhere the plain estimate decides.
func TestEvictionCost(t *testing.T) {
	q := req(1000)
	q.OutputTokens = 0
	roomy := cand("roomy", 0, 0)
	roomy.UncachedRoomTokens = 5000
	full := cand("full", 0, 0)
	full.UncachedRoomTokens = 0
	half := cand("half", 0, 0)
	half.UncachedRoomTokens = 400
	if got := EvictedSeconds(&q, &roomy); got != 0 {
		t.Errorf("a cache with room: %v s evicted, want 0", got)
	}
	if got := EvictedSeconds(&q, &full); math.Abs(got-0.1) > 1e-12 {
		t.Errorf("a full cache: %v s evicted, want 1000 tokens at 10,000/s", got)
	}
	if got := EvictedSeconds(&q, &half); math.Abs(got-0.06) > 1e-12 {
		t.Errorf("room for 400 of 1000: %v s evicted, want 0.06", got)
	}
	unknown := cand("unknown", 0, 0)
	if got := EvictedSeconds(&q, &unknown); got != 0 {
		t.Errorf("unknown room: %v s evicted, want 0", got)
	}

	opts := Options{ImposedDelayWeight: -1, DecodeWeight: -1}
	for _, queued := range []int{100, 600, 900} { // the holder's queue, in prefill tokens
		warm, cold := cand("warm", 500, queued), cand("cold", 0, 0)
		// Full caches: staying costs the queue, moving costs the 500
		// saved tokens plus the 1000 the copy evicts from the cold one
		// (the warm one evicts 500 only).
		warm.UncachedRoomTokens, cold.UncachedRoomTokens = 0, 0
		d := Choose(q, []Candidate{warm, cold}, opts, nil, nil)
		if want := 0; queued < 1000 && d.Chosen != want {
			t.Errorf("full caches, holder queue %d: chose %d, want the holder", queued, d.Chosen)
		}
		// Room everywhere: the plain estimate, which moves once the queue
		// outweighs the 500 saved tokens.
		warm.UncachedRoomTokens, cold.UncachedRoomTokens = 1<<20, 1<<20
		d = Choose(q, []Candidate{warm, cold}, opts, nil, nil)
		if want := 0; queued > 500 {
			want = 1
			if d.Chosen != want {
				t.Errorf("caches with room, holder queue %d: chose %d, want the cold one", queued, d.Chosen)
			}
		} else if d.Chosen != want {
			t.Errorf("caches with room, holder queue %d: chose %d, want the holder", queued, d.Chosen)
		}
	}
}

// TestSequencesTakeKVNotTime: a request with several sequences (n
// choices) needs KV for each one's output, but its sequences decode side
// by side: its generation time is one sequence's.
func TestSequencesTakeKVNotTime(t *testing.T) {
	c := Candidate{FreeKVTokens: 1_000, KVCapacityTokens: 10_000, QueuedPrefillTokens: 5_000, InFlight: 4,
		PrefillTokensPerSecond: 10_000, DecodeTokensPerSecond: 2_000}
	one := Request{PromptTokens: 100, OutputTokens: 300}
	four := one
	four.Sequences = 4
	if w := KVWaitSeconds(&one, &c); w != 0 {
		t.Errorf("one sequence, 400 tokens in 1,000 free: waits %v", w)
	}
	if w := KVWaitSeconds(&four, &c); w <= 0 {
		t.Errorf("four sequences, 1,300 tokens in 1,000 free: waits %v", w)
	}
	if g1, g4 := GenerationSeconds(&one, &c), GenerationSeconds(&four, &c); g1 != g4 {
		t.Errorf("generation: %v for one sequence, %v for four", g1, g4)
	}
}

// TestWeight: 0 is the default, a negative value or NaN turns the term
// off; llmbench records the result as the weight a replay used.
func TestWeight(t *testing.T) {
	for _, tc := range []struct{ configured, def, want float64 }{{0, 0.1, 0.1}, {0.3, 0.1, 0.3}, {-1, 1, 0}, {math.NaN(), 1, 0}} {
		if got := Weight(tc.configured, tc.def); got != tc.want {
			t.Errorf("Weight(%v, %v) = %v, want %v", tc.configured, tc.def, got, tc.want)
		}
	}
}

// TestKVWaitFollowsTheEngineSteps: KV frees as requests end, and they
// decode side by side, so the wait is set by the requests that must end
// and by the prefill the steps carry meanwhile:
//   - a single request in flight frees nothing before it ends, however
//     small the share needed;
//   - of many, with requests queued for KV behind them, each one that
//     ends is replaced, so the batch stays full until the k-th of n to
//     end has, after 2·m·k/(n+1) steps (m the mean output left);
//   - with nothing queued for KV the batch shrinks as they end: when the
//     share e of them has ended, e·(2−e) of the output is decoded;
//   - the prefill queued there runs in those steps, up to a chunk a step,
//     and lengthens the wait by its prefill time.
func TestKVWaitFollowsTheEngineSteps(t *testing.T) {
	rq := req(1000) // needs 1,100 tokens of KV
	full := cand("full", 0, 0)
	full.KVCapacityTokens, full.FreeKVTokens = 100_000, 0
	full.QueuedDecodeTokens, full.InFlight = 1000, 1
	one := KVWaitSeconds(&rq, &full)
	if want := 1000.0 / 2000; math.Abs(one-want) > 1e-9 {
		t.Errorf("one request in flight: wait %v s, want its whole 1,000 tokens at 2,000/s (%v s)", one, want)
	}
	// 100 requests with 1,000 tokens each left on average, 10,000 tokens
	// queued for KV ahead: 11,100 of 110,000 must free, the first 11 of
	// 100 to end, after 2·1000·11/101 steps of 100 tokens.
	queued := full
	queued.InFlight, queued.QueuedDecodeTokens, queued.KVOvercommitTokens = 100, 100_000, 10_000
	if got, want := KVWaitSeconds(&rq, &queued), 2*1000*11.0/101*100/2000; math.Abs(got-want) > 1e-9 {
		t.Errorf("100 in flight, a queue for KV: wait %v s, want %v", got, want)
	}
	// Nothing queued for KV, half the KV needed: half the requests end
	// while the batch shrinks, three quarters of the output decoded.
	many := queued
	many.KVOvercommitTokens = 0
	half := req(49_000)
	half.OutputTokens = 1000
	if got, want := KVWaitSeconds(&half, &many), 100_000*0.75/2000; math.Abs(got-want) > 1e-9 {
		t.Errorf("half the KV, no queue: wait %v s, want %v", got, want)
	}
	// Queued prefill runs in the steps until then, at most a chunk each.
	prefilling := full
	prefilling.QueuedPrefillTokens = 50_000
	if got, want := KVWaitSeconds(&rq, &prefilling), one+5.0; math.Abs(got-want) > 1e-9 {
		t.Errorf("with 5 s of prefill queued: wait %v s, want %v", got, want)
	}
	prefilling.QueuedDecodeTokens = 2 // two steps: two chunks at most
	if got, want := KVWaitSeconds(&rq, &prefilling), 2.0/2000+2*PrefillChunkTokens/10_000.0; math.Abs(got-want) > 1e-9 {
		t.Errorf("two steps left: wait %v s, want %v", got, want)
	}
}
