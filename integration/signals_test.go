package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/llmaffinity/caddy-llm-affinity/caddyllm"
	"github.com/llmaffinity/caddy-llm-affinity/kvsim"
)

// direct sends requests straight to a replica, bypassing the router (as
// another router or client would), until ctx ends.
func direct(ctx context.Context, t *testing.T, r *replica, n, promptBytes, maxTokens int, wg *sync.WaitGroup) {
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			body, _ := json.Marshal(map[string]any{"model": kvsim.DefaultModel, "max_tokens": maxTokens,
				"prompt": text(fmt.Sprintf("direct %s %d", r.name, i), promptBytes)})
			req, _ := http.NewRequestWithContext(ctx, "POST", r.http.URL+"/v1/completions", strings.NewReader(string(body)))
			req.Header.Set("Content-Type", "application/json")
			if resp, err := http.DefaultClient.Do(req); err == nil {
				resp.Body.Close()
			}
		}(i)
	}
}

func engineRunning(t *testing.T, r *replica) int {
	resp, err := http.Get(r.http.URL + "/kvsim/state")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var st struct {
		Running int `json:"running"`
	}
	json.NewDecoder(resp.Body).Decode(&st)
	return st.Running
}

// TestKVFullSkipsLongPrompt: a replica whose KV is nearly full (with work
// the router did not send) is skipped for a long prompt that may not wait
// for its KV to free (a negative queue_timeout: only where it fits now),
// while a short prompt still goes there. (With time to wait, the request
// may queue there: see router.TestKVWaitProperties and TestAnswers.)
func TestKVFullSkipsLongPrompt(t *testing.T) {
	fleet := startFleet(t, 2, 1, kvsim.Config{NumGPUBlocks: 2048}) // 32,768 tokens of KV
	a, b := fleet[0], fleet[1]
	// B is slow at prefill, so A wins every cold request it can hold.
	// scrape_max_age: a busy machine may delay a scrape past three
	// intervals, and the router would then fall back to its own view (in
	// which A is idle).
	startCaddy(t, caddyfile(fleet, "", fmt.Sprintf(`scrape_interval 100ms
			scrape_max_age 10s
			queue_timeout -1s
			output_estimate max_tokens
			upstream %s {
				prefill_rate 100000
			}
			upstream %s {
				prefill_rate 1000
			}`, a.dial(), b.dial()), ""))
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	defer func() { cancel(); wg.Wait() }()
	direct(ctx, t, a, 2, 48_000, 1000, &wg) // two 12k-token prompts: ~24k of 32k tokens used
	eventually(t, 5*time.Second, "A's KV filling up", func() bool { return engineRunning(t, a) == 2 })
	// Both prompts prefilled (their KV allocated), as the router last
	// scraped A: about 24k of 32k tokens in use.
	eventually(t, 10*time.Second, "the router seeing A's KV fill", func() bool {
		v := engineView(t, a.dial())
		return v != nil && v.Running == 2 && v.KVUsage > 0.7
	})

	long := post(t, "/v1/completions", map[string]any{"model": kvsim.DefaultModel, "prompt": text("long", 40_000), "max_tokens": 16})
	if long.status != 200 || long.replica != b.name {
		t.Fatalf("long prompt went to %q (%d, %s), want B: A's KV is nearly full", long.replica, long.status, long.explain)
	}
	short := post(t, "/v1/completions", map[string]any{"model": kvsim.DefaultModel, "prompt": text("short", 1600), "max_tokens": 16})
	if short.status != 200 || short.replica != a.name {
		t.Fatalf("short prompt went to %q (%d, %s), want A", short.replica, short.status, short.explain)
	}
}

// TestDirectLoadChangesDecisions: load sent to an engine directly,
// bypassing the router, moves the router's decisions within two scrape
// intervals.
func TestDirectLoadChangesDecisions(t *testing.T) {
	// Four sequences at a time: most of the direct load waits in A's queue.
	fleet := startFleet(t, 2, 1, kvsim.Config{MaxNumSeqs: 4})
	a, b := fleet[0], fleet[1]
	startCaddy(t, caddyfile(fleet, "", "scrape_interval 100ms", ""))
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	defer func() { cancel(); wg.Wait() }()
	direct(ctx, t, a, 24, 2000, 1000, &wg)
	eventually(t, 5*time.Second, "A busy", func() bool { return engineRunning(t, a) == 4 })
	eventually(t, 5*time.Second, "the router seeing A's queue", func() bool {
		v := engineView(t, a.dial())
		return v != nil && v.Running == 4 && v.Waiting >= 1
	})
	for i := 0; i < 6; i++ {
		c := post(t, "/v1/completions", map[string]any{"model": kvsim.DefaultModel, "prompt": text(fmt.Sprint("routed", i), 1000), "max_tokens": 8})
		if c.replica != b.name {
			t.Fatalf("request %d went to the busy replica %q (%s)", i, c.replica, c.explain)
		}
	}
	// The admin API shows what the router saw of A's engine (the prefix
	// hit rate is -1 until two reads of the counters, 10 s apart).
	view := engineView(t, a.dial())
	if view == nil || view.Engine != "vllm" || view.Running != 4 || view.Waiting < 1 || view.KVCapacity <= 0 ||
		view.PrefixHitRate < -1 || view.PrefixHitRate > 1 || view.AgeSeconds > 1 {
		t.Fatalf("engine view of A: %+v", view)
	}
}

// engineView returns the admin API's engine view of dial.
func engineView(t *testing.T, dial string) *caddyllm.EngineView {
	t.Helper()
	return upstream(t, dial).Engine
}

// TestLoRAReplicatesOnce: a tenant's requests go to the replica holding
// its adapter until that replica's queue outweighs the load cost, then
// exactly one more replica loads it. The adapter is learned from the
// engines' /v1/models (it has a parent), not configured. The burst is
// routed while the engines are stalled (kvsim's fault), so that the queues
// it is routed by are the ones the router charged, however slowly a busy
// machine lets the engines run or the requests arrive.
//
// The engines are scraped once, before the first request (the interval
// is also the fetches' timeout): what the router learns of them then
// stands for the whole test, however slowly a busy machine runs it.
// Scraped every 100ms, the signals and model lists lapsed mid-burst on a
// loaded machine (older than three intervals, their fetches timing out),
// and the router rightly stopped counting on them: with no list naming
// the adapter it routed the rest of the burst as the base model's, by
// load alone (a third replica, the holder below seven); with some lists
// lapsed, it sent the rest where a list still named the adapter.
func TestLoRAReplicatesOnce(t *testing.T) {
	// Loading costs 1 s: a burst that queues less than that on two
	// replicas needs no third.
	fleet := startFleet(t, 3, 1, kvsim.Config{Adapters: []string{"tenant-a"}, LoRAStorageLoad: time.Second})
	startCaddy(t, caddyfile(fleet, "", `scrape_interval 10m
			output_estimate max_tokens
			adapter_load_remote 1s`, ""))
	eventually(t, 5*time.Second, "every model list scraped", func() bool {
		for _, r := range fleet {
			if v := engineView(t, r.dial()); v == nil || !slices.Contains(v.Models, "tenant-a") {
				return false
			}
		}
		return true
	})
	first := post(t, "/v1/completions", map[string]any{"model": "tenant-a", "prompt": text("tenant first", 4000), "max_tokens": 60})
	if first.status != 200 || !strings.Contains(first.explain, "reason=adapter") {
		t.Fatalf("first tenant request: %d %q %s", first.status, first.explain, first.body)
	}
	// Its answer may reach the client before the router releases it:
	// the burst's count below must not include it.
	eventually(t, 5*time.Second, "the first request released", func() bool {
		for _, u := range upstreams(t) {
			if u.InFlight > 0 {
				return false
			}
		}
		return true
	})
	for _, r := range fleet {
		r.sim.SetFaults(kvsim.Faults{Stall: true})
	}
	count := map[string]int{}
	var mu sync.Mutex
	var wg sync.WaitGroup
	t.Cleanup(func() { // also when the test fails while the engines are stalled
		for _, r := range fleet {
			r.sim.SetFaults(kvsim.Faults{})
		}
		wg.Wait()
	})
	for i := 0; i < 14; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			c := post(t, "/v1/completions", map[string]any{"model": "tenant-a", "prompt": text(fmt.Sprint("tenant q", i), 4000), "max_tokens": 60})
			if c.status != 200 {
				t.Errorf("tenant request %d: %d %s", i, c.status, c.body)
				return
			}
			mu.Lock()
			count[c.replica]++
			mu.Unlock()
		}(i)
	}
	eventually(t, 30*time.Second, "the whole burst routed", func() bool {
		routed := 0
		for _, u := range upstreams(t) {
			routed += u.InFlight
		}
		return routed == 14
	})
	for _, r := range fleet {
		r.sim.SetFaults(kvsim.Faults{})
	}
	wg.Wait()
	t.Logf("holder %s, burst %v", first.replica, count)
	if count[first.replica] < 7 {
		t.Fatalf("the holder took only %d of 14: %v", count[first.replica], count)
	}
	if len(count) != 2 {
		t.Fatalf("the adapter went to %d replicas (%v), want the holder and exactly one more", len(count), count)
	}
}

// TestFinishedWorkIsNotForeign: requests the router routed and that
// finished since the last scrape are not mistaken for load from elsewhere,
// so turn 2 of a conversation still lands warm between scrapes.
func TestFinishedWorkIsNotForeign(t *testing.T) {
	fleet := startFleet(t, 4, 20, kvsim.Config{})
	startCaddy(t, caddyfile(fleet, "", "scrape_interval 10s", ""))
	eventually(t, 5*time.Second, "the first scrape of every engine, before any request", func() bool {
		for _, r := range fleet {
			if engineView(t, r.dial()) == nil {
				return false
			}
		}
		return true
	})
	convo := []msg{{"system", text("scraped conversation", 12_000)}, {"user", "hi"}}
	first := post(t, "/v1/chat/completions", chat(convo, 8))
	convo = append(convo, msg{"assistant", "hello"}, msg{"user", "more"})
	second := post(t, "/v1/chat/completions", chat(convo, 8))
	if first.status != 200 || second.replica != first.replica || !strings.Contains(second.explain, "reason=warm") {
		t.Fatalf("turn 1 on %s, turn 2 on %s (%s)", first.replica, second.replica, second.explain)
	}
}

// TestRestartedEngineIsNotWarm: a replica holding a long cached prefix
// is killed and started again on its address with an empty cache; as soon
// as the router has scraped it back (with no request meanwhile), it forgets
// the replica's prefixes, and the next request for that prefix is not sent
// there as warm.
func TestRestartedEngineIsNotWarm(t *testing.T) {
	fleet := startFleet(t, 2, 20, kvsim.Config{})
	startCaddy(t, caddyfile(fleet, "", "scrape_interval 100ms", ""))
	convo := []msg{{"system", text("restart conversation", 50_000)}, {"user", "hi"}}
	first := post(t, "/v1/chat/completions", chat(convo, 4))
	if first.status != 200 {
		t.Fatalf("turn 1: %d %s", first.status, first.body)
	}
	victim := named(fleet, first.replica)
	dial := victim.dial()
	if u := upstream(t, dial); u.IndexBlocks == 0 {
		t.Fatalf("turn 1's replica holds no blocks in the index: %+v", u)
	}

	// Kill it, then start a new engine on the same address.
	victim.http.CloseClientConnections()
	victim.http.Close()
	victim.sim.Close()
	eventually(t, 10*time.Second, "scrapes of the dead replica failing", func() bool {
		v := engineView(t, dial)
		return v != nil && v.Errors > 0
	})
	sim, err := kvsim.NewServer(kvsim.ServerConfig{Name: victim.name + "-restarted", Speed: 20})
	if err != nil {
		t.Fatal(err)
	}
	var l net.Listener
	eventually(t, 10*time.Second, "the address free again", func() bool {
		l, err = net.Listen("tcp", dial)
		return err == nil
	})
	hs := httptest.NewUnstartedServer(sim)
	hs.Listener.Close()
	hs.Listener = l
	hs.Start()
	t.Cleanup(func() { hs.CloseClientConnections(); hs.Close(); sim.Close() })

	// The scrape that sees the engine back tells the fleet: no request is
	// needed for the index to forget, and the admin view shows it. Within
	// a slow interval (10 s) at most: on a starved machine the dead
	// engine's scrapes may all have run out of time rather than been
	// refused, and then the restart shows only as counters that went back,
	// which the next full read sees.
	eventually(t, 30*time.Second, "the router forgetting the restarted engine's prefixes", func() bool {
		u := upstream(t, dial)
		return u.IndexResets > 0 && u.IndexBlocks == 0
	})
	convo = append(convo, msg{"assistant", "hello"}, msg{"user", "again"})
	second := post(t, "/v1/chat/completions", chat(convo, 4))
	if second.status != 200 || (strings.Contains(second.explain, "upstream="+dial) && !strings.Contains(second.explain, "matched=0;")) {
		t.Fatalf("turn 2 after the restart: %d %s", second.status, second.explain)
	}
}
