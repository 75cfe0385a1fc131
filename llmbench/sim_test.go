package llmbench

import (
	"context"
	"math"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"

	"github.com/llmaffinity/caddy-llm-affinity/kvsim"
)

// tinyGSP is a small gsp workload that still rewards affinity: 8 system prompts of 1024
// tokens shared by 8 questions each.
func tinyGSP(t *testing.T) *Workload {
	t.Helper()
	w, err := Generate("gsp", GeneratorOptions{Seed: 1, Rate: 40, GSP: GSPParams{
		Groups: 8, PromptsPerGroup: 8, SystemTokens: 1024, QuestionTokens: 64, OutputTokens: 16,
	}})
	if err != nil {
		t.Fatal(err)
	}
	return w
}

func replay(t *testing.T, sim *Sim, w *Workload, policy string) Summary {
	t.Helper()
	res, err := sim.Replay(context.Background(), w, policy)
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Requests) != len(w.Requests) || len(res.Replicas) != sim.Replicas {
		t.Fatalf("%s: %d results for %d requests, %d replicas", policy, len(res.Requests), len(w.Requests), len(res.Replicas))
	}
	return Summarize(res)
}

func TestSimAffinityBeatsRoundRobinOnGSP(t *testing.T) {
	w := tinyGSP(t)
	sim := &Sim{Config: Config{Replicas: 4, Seed: 1}}
	ttft := replay(t, sim, w, "llm_affinity/ttft")
	rr := replay(t, sim, w, "round_robin")
	for _, s := range []Summary{ttft, rr} {
		if s.Completed != len(w.Requests) || s.Shed != 0 || s.Errors != 0 {
			t.Fatalf("%s: %d completed, %d shed, %d errors of %d", s.Policy, s.Completed, s.Shed, s.Errors, len(w.Requests))
		}
		if !(s.TTFTP50 > 0 && s.TTFTP99 >= s.TTFTP50 && s.E2EP50 >= s.TTFTP50 && s.Throughput > 0) {
			t.Errorf("%s: implausible figures %+v", s.Policy, s)
		}
	}
	t.Logf("hit rate: ttft %.3f, round_robin %.3f", ttft.HitRate, rr.HitRate)
	if ttft.HitRate <= rr.HitRate {
		t.Errorf("llm_affinity/ttft hit rate %.3f is not above round_robin's %.3f", ttft.HitRate, rr.HitRate)
	}
	// Every system prompt is computed once per replica at most by a router that follows the
	// cache; round robin computes each on every replica.
	if ttft.HitRate < 0.6 {
		t.Errorf("llm_affinity/ttft hit rate %.3f, want at least 0.6", ttft.HitRate)
	}
}

func TestSimEveryPolicyRuns(t *testing.T) {
	w := tinyGSP(t)
	w.Truncate(24)
	sim := &Sim{Config: Config{Replicas: 3, Seed: 2}}
	for _, p := range Policies() {
		s := replay(t, sim, w, p)
		if s.Completed != len(w.Requests) {
			t.Errorf("%s: %d of %d completed", p, s.Completed, len(w.Requests))
		}
	}
	if _, err := sim.Replay(context.Background(), w, "nope"); err == nil {
		t.Error("unknown policy accepted")
	}
}

func TestSimIsDeterministic(t *testing.T) {
	w := tinyGSP(t)
	sim := &Sim{Config: Config{Replicas: 4, Seed: 5}}
	// Caddy's random and least_conn draw from Caddy's unseeded source; the
	// router's own draws are seeded.
	for _, p := range []string{"llm_affinity/ttft", "llm_affinity/sglang", "round_robin", "header"} {
		a, err := sim.Replay(context.Background(), w, p)
		if err != nil {
			t.Fatal(err)
		}
		b, err := sim.Replay(context.Background(), w, p)
		if err != nil {
			t.Fatal(err)
		}
		a.Wall, b.Wall = 0, 0
		if !reflect.DeepEqual(a, b) {
			t.Errorf("%s: two replays differ", p)
		}
	}
}

func TestSimPolicyPlacement(t *testing.T) {
	w := tinyGSP(t)
	sim := &Sim{Config: Config{Replicas: 4, Seed: 1}}
	first, err := sim.Replay(context.Background(), w, "first")
	if err != nil {
		t.Fatal(err)
	}
	if first.Replicas[0].Requests != len(w.Requests) {
		t.Errorf("first sent %d of %d requests to replica 0", first.Replicas[0].Requests, len(w.Requests))
	}
	rr, err := sim.Replay(context.Background(), w, "round_robin")
	if err != nil {
		t.Fatal(err)
	}
	for _, rep := range rr.Replicas {
		if rep.Requests != len(w.Requests)/4 {
			t.Errorf("round_robin sent %d requests to %s, want %d", rep.Requests, rep.Name, len(w.Requests)/4)
		}
	}
	// header hashes the group's system prompt: each group stays on one replica.
	header, err := sim.Replay(context.Background(), w, "header")
	if err != nil {
		t.Fatal(err)
	}
	where := map[string]int{}
	for i, r := range header.Requests {
		key := HeaderKey(&w.Requests[i])
		if prev, ok := where[key]; ok && prev != r.Replica {
			t.Fatalf("header split key %s over replicas %d and %d", key, prev, r.Replica)
		}
		where[key] = r.Replica
	}
}

func TestSimShedsWhatNeverFits(t *testing.T) {
	// 64 blocks of 16 tokens: a 2,000-token prompt never fits.
	w, err := Generate("gsp", GeneratorOptions{Seed: 1, Rate: 10, GSP: GSPParams{
		Groups: 1, PromptsPerGroup: 3, SystemTokens: 1900, QuestionTokens: 100, OutputTokens: 8,
	}})
	if err != nil {
		t.Fatal(err)
	}
	engine := kvsim.Config{NumGPUBlocks: 64}
	affinity := &Sim{Config: Config{Replicas: 2, Engine: engine}, QueueTimeout: time.Second}
	s := replay(t, affinity, w, "llm_affinity/ttft")
	if s.Shed != 3 {
		t.Errorf("llm_affinity shed %d of 3 requests that cannot fit", s.Shed)
	}
	// Caddy's policies do not look: the engine rejects the request.
	rr := &Sim{Config: Config{Replicas: 2, Engine: engine}}
	res, err := rr.Replay(context.Background(), w, "round_robin")
	if err != nil {
		t.Fatal(err)
	}
	if s := Summarize(res); s.Errors != 3 || !strings.Contains(res.Requests[0].Err, "exceeds the KV cache") {
		t.Errorf("round_robin: %d errors, first %q", s.Errors, res.Requests[0].Err)
	}
}

func TestSimProgressAndCancel(t *testing.T) {
	w := tinyGSP(t)
	calls, last := 0, 0
	sim := &Sim{Config: Config{Replicas: 2, Progress: func(done, total int) {
		calls++
		last = done
		if total != len(w.Requests) {
			t.Fatalf("total %d", total)
		}
	}}}
	replay(t, sim, w, "llm_affinity/ttft")
	if last != len(w.Requests) || calls != len(w.Requests) {
		t.Errorf("progress: %d calls, last %d, want %d", calls, last, len(w.Requests))
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := sim.Replay(ctx, w, "round_robin"); err == nil {
		t.Error("a cancelled replay succeeded")
	}
}

func TestSimLoRAAffinityKeepsAdaptersResident(t *testing.T) {
	w, err := Generate("lora", GeneratorOptions{Seed: 1, Rate: 20, LoRA: LoRAParams{
		Adapters: 8, Requests: 160, SystemTokens: 256, QuestionTokens: 64, OutputTokens: 8,
	}})
	if err != nil {
		t.Fatal(err)
	}
	sim := &Sim{Config: Config{Replicas: 4, Seed: 1}}
	ttft := replay(t, sim, w, "llm_affinity/ttft")
	rr := replay(t, sim, w, "round_robin")
	// Loading an adapter from storage costs 2s: round robin pays it on every replica.
	t.Logf("TTFT p90: ttft %.3fs, round_robin %.3fs", ttft.TTFTP90, rr.TTFTP90)
	if ttft.TTFTMean >= rr.TTFTMean {
		t.Errorf("mean TTFT: llm_affinity %.3fs, round_robin %.3fs", ttft.TTFTMean, rr.TTFTMean)
	}
}

// TestCaddyRequestCounts: the simulation keeps Caddy's own per-host request
// counts, which its least_conn policy reads, as Caddy's proxy would.
func TestCaddyRequestCounts(t *testing.T) {
	u := &reverseproxy.Upstream{Dial: "a", Host: new(reverseproxy.Host)}
	countRequest(u.Host, 1)
	countRequest(u.Host, 1)
	countRequest(u.Host, -1)
	if u.NumRequests() != 1 {
		t.Fatalf("Caddy counts %d requests, want 1", u.NumRequests())
	}
	idle := &reverseproxy.Upstream{Dial: "b", Host: new(reverseproxy.Host)}
	pool := reverseproxy.UpstreamPool{u, idle}
	for range 10 {
		if got := (reverseproxy.LeastConnSelection{}).Select(pool, nil, nil); got != idle {
			t.Fatalf("least_conn chose %v over the idle upstream", got.Dial)
		}
	}
}

// TestSimLeastConnSpreads: under Caddy's least_conn every replica gets
// work, and no replica gets more than twice its share.
func TestSimLeastConnSpreads(t *testing.T) {
	w := tinyGSP(t)
	sim := &Sim{Config: Config{Replicas: 4, Seed: 1}}
	res, err := sim.Replay(context.Background(), w, "least_conn")
	if err != nil {
		t.Fatal(err)
	}
	for _, rep := range res.Replicas {
		if rep.Requests == 0 || rep.Requests > 2*len(w.Requests)/4 {
			t.Errorf("least_conn sent %d of %d requests to %s", rep.Requests, len(w.Requests), rep.Name)
		}
	}
}

// TestSimRoutersShareTheirView: four routers splitting the arrivals lose
// hit rate on their own and keep one router's when they share their
// events; Caddy's own policies run one selector per router.
func TestSimRoutersShareTheirView(t *testing.T) {
	w := tinyGSP(t)
	hit := func(routers int, sync bool, delay time.Duration, policy string) float64 {
		t.Helper()
		sim := &Sim{Config: Config{Replicas: 4, Seed: 1}, Routers: routers, Sync: sync, SyncDelay: delay}
		res, err := sim.Replay(context.Background(), w, policy)
		if err != nil {
			t.Fatal(err)
		}
		for i, r := range res.Requests {
			if r.Shed || r.Err != "" || r.E2E == 0 {
				t.Fatalf("%s, %d routers: request %d not served: %+v", policy, routers, i, r)
			}
		}
		return Summarize(res).HitRate
	}
	one := hit(1, false, 0, "llm_affinity/ttft")
	apart := hit(4, false, 0, "llm_affinity/ttft")
	shared := hit(4, true, time.Millisecond, "llm_affinity/ttft")
	t.Logf("hit rate: one router %.3f, four apart %.3f, four sharing %.3f", one, apart, shared)
	if apart > one-0.05 {
		t.Errorf("four routers without sync kept the hit rate (%.3f against %.3f): the test shows nothing", apart, one)
	}
	if shared < one-0.02 {
		t.Errorf("four routers with sync: hit rate %.3f, one router %.3f", shared, one)
	}
	hit(4, false, 0, "least_conn")
}

// TestSimGatewayQueue: requests that no replica can start in time wait at
// the gateway and are served as KV frees, but no more than QueueLimit of
// them: the rest are shed at once, as the plugin sheds them.
func TestSimGatewayQueue(t *testing.T) {
	// Six requests at once, each about 600 tokens, on one replica whose
	// 1,024 tokens of KV hold one at a time; the router's assumed 100
	// prefill tokens a second make the KV of all but the first one or two
	// look further away than the 2 s queue timeout, so those wait here
	// rather than at the engine, which serves each in a fraction of a
	// second.
	w, err := Generate("gsp", GeneratorOptions{Seed: 1, Rate: math.Inf(1), GSP: GSPParams{
		Groups: 6, PromptsPerGroup: 1, SystemTokens: 500, QuestionTokens: 100, OutputTokens: 8,
	}})
	if err != nil {
		t.Fatal(err)
	}
	shed := func(limit int) int {
		t.Helper()
		sim := &Sim{Config: Config{Replicas: 1, Engine: kvsim.Config{NumGPUBlocks: 64}}, QueueTimeout: 2 * time.Second,
			QueueLimit: limit, PrefillTokensPerSecond: 100}
		s := replay(t, sim, w, "llm_affinity/ttft")
		if s.Completed+s.Shed != 6 {
			t.Fatalf("queue limit %d: %d completed, %d shed, of 6", limit, s.Completed, s.Shed)
		}
		return s.Shed
	}
	if n := shed(-1); n != 0 {
		t.Errorf("without a queue limit %d shed, want none: every waiting request is served", n)
	}
	// Each place in the queue saves one request from being shed.
	one, two := shed(1), shed(2)
	if two == 0 || one != two+1 {
		t.Errorf("shed %d with a queue limit of 1, %d with 2: want a difference of one, and some shed", one, two)
	}
}

// TestSimRestartedRouter: a router restarted halfway through (a rolling
// restart; the old process finishes what it has in flight) that starts
// with a peer's snapshot of the view routes the rest as if it had never
// restarted: every request served, the same hit rate and the same
// placements; one that starts with an empty index sends some next turns
// cold (a lower hit rate).
func TestSimRestartedRouter(t *testing.T) {
	w, err := Generate("mrqa", GeneratorOptions{Seed: 1, MRQA: MRQAParams{Users: 16, Rounds: 6}})
	if err != nil {
		t.Fatal(err)
	}
	run := func(restart time.Duration, snapshot bool) *Results {
		t.Helper()
		sim := &Sim{Config: Config{Replicas: 4, Seed: 1}, Routers: 4, Sync: true, SyncDelay: time.Millisecond,
			RestartAt: restart, RestartSnapshot: snapshot}
		res, err := sim.Replay(context.Background(), w, "llm_affinity/ttft")
		if err != nil {
			t.Fatal(err)
		}
		for i, r := range res.Requests {
			if r.Shed || r.Err != "" || r.E2E == 0 {
				t.Fatalf("restart %v, snapshot %v: request %d not served: %+v", restart, snapshot, i, r)
			}
		}
		return res
	}
	half := w.Requests[len(w.Requests)/2].Arrival
	never, with, without := run(0, false), run(half, true), run(half, false)
	hit := func(r *Results) float64 { return Summarize(r).HitRate }
	t.Logf("hit rate: no restart %.4f, restarted with the snapshot %.4f, without %.4f", hit(never), hit(with), hit(without))
	moved := 0
	for i := range never.Requests {
		if never.Requests[i].Replica != with.Requests[i].Replica {
			moved++
		}
	}
	if hit(with) < hit(never)-0.001 || moved > len(w.Requests)/50 {
		t.Errorf("restarted with the snapshot: hit rate %.4f against %.4f, %d requests placed elsewhere", hit(with), hit(never), moved)
	}
	if hit(without) > hit(never)-0.01 {
		t.Errorf("restarted with an empty index, the hit rate stayed %.4f (against %.4f): the test shows nothing", hit(without), hit(never))
	}
}

// TestSimRestartedRouterSeesItsPredecessor: a restarted router counts the
// requests its predecessor still has in flight, as its peers do (in the
// plugin the old process hears the new one and restates its charges).
func TestSimRestartedRouterSeesItsPredecessor(t *testing.T) {
	w := tinyGSP(t)
	sim := &Sim{Config: Config{Replicas: 4, Seed: 1}, Routers: 2, Sync: true, RestartAt: time.Second, RestartSnapshot: true}
	run, err := sim.newRun(w, "llm_affinity/ttft")
	if err != nil {
		t.Fatal(err)
	}
	inFlight := func(rt *simRouter) (n int) {
		for _, u := range rt.fleet.Snapshot(at(0)) {
			n += u.InFlight
		}
		return n
	}
	for i := range 6 { // router 0 routes 6 requests at 0; all are in flight
		r := &w.Requests[i]
		run.arrive(waiter{router: &run.routers[0], req: r, text: r.AppendPrompt(nil), deadline: time.Minute}, 0)
	}
	for len(run.outbox) > 0 {
		run.deliver()
	}
	if a, b := inFlight(&run.routers[0]), inFlight(&run.routers[1]); a != 6 || b != 6 {
		t.Fatalf("before the restart: router 0 counts %d in flight, router 1 %d", a, b)
	}
	run.restart(0)
	for len(run.outbox) > 0 {
		run.deliver()
	}
	if a, b := inFlight(&run.routers[0]), inFlight(&run.routers[1]); a != 6 || b != 6 {
		t.Fatalf("after the restart: the restarted router counts %d in flight, router 1 %d", a, b)
	}
}
