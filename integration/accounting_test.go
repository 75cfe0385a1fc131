package integration

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/llmaffinity/caddy-llm-affinity/kvsim"
)

// TestEveryEndingReleasesItsCharge: whatever ends a request (its client
// leaving while it waits at the gateway, before its first token or in the
// middle of its stream; a shed, a refusal; the engine's 500 or 404; a
// stream whose engines keep breaking it off, moved until the router gives
// up), what it charged goes back exactly once: once the fleet is idle the
// admin view and the metrics show nothing queued, reserved or in flight on
// any upstream, and nothing held at the gateway (a count left above zero
// or taken below it fails).
func TestEveryEndingReleasesItsCharge(t *testing.T) {
	fleet := startFleet(t, 2, 1, kvsim.Config{})
	startCaddy(t, caddyfile(fleet, "", "kv_capacity 20000\n\t\t\tqueue_timeout 10m\n\t\t\tqueue_limit 1", ""))
	upstreamDials := strings.Fields(dials(fleet))
	inFlight := func() (n int) {
		for _, r := range fleet {
			n += upstream(t, r.dial()).InFlight
		}
		return n
	}
	completion := func(tag string, stream bool, extra map[string]any) map[string]any {
		b := map[string]any{"model": kvsim.DefaultModel, "prompt": text(tag, 2000), "max_tokens": 40, "stream": stream}
		for k, v := range extra {
			b[k] = v
		}
		return b
	}
	// Counters outlive a config (and this test, run again with -count).
	before := metricFamilies(t, adminURL+"/metrics")

	// leaving sends body with a context its client cancels; done is
	// closed once the client has its answer or gave up.
	leaving := func(body map[string]any) (leave func(), done <-chan struct{}) {
		ctx, cancel := context.WithCancel(context.Background())
		t.Cleanup(cancel)
		finished := make(chan struct{})
		go func() {
			defer close(finished)
			raw, _ := json.Marshal(body)
			req, _ := http.NewRequestWithContext(ctx, "POST", routerURL+"/v1/completions", strings.NewReader(string(raw)))
			req.Header.Set("Content-Type", "application/json")
			if resp, err := http.DefaultClient.Do(req); err == nil {
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
		}()
		return cancel, finished
	}

	// Held at the gateway (every upstream draining), its client leaves;
	// meanwhile one more is shed at once (queue_limit 1).
	for _, r := range fleet {
		adminDo(t, "POST", "/llm_affinity/upstreams/"+r.dial()+"/drain?deadline=1h")
	}
	leave, done := leaving(completion("held", false, nil))
	eventually(t, 10*time.Second, "a request held", func() bool { return heldAtGateway(t) == 1 })
	if c := post(t, "/v1/completions", completion("shed", false, nil)); c.status != 503 {
		t.Fatalf("a request past queue_limit: %d %s, want 503", c.status, c.body)
	}
	leave()
	<-done
	for _, r := range fleet {
		adminDo(t, "DELETE", "/llm_affinity/upstreams/"+r.dial()+"/drain")
	}

	// Their clients leave before the first token (the engines stalled),
	// streamed or not.
	for _, r := range fleet {
		r.sim.SetFaults(kvsim.Faults{Stall: true})
	}
	var leaves []func()
	var dones []<-chan struct{}
	for i, stream := range []bool{false, true} {
		leave, done := leaving(completion("stalled"+string(rune('a'+i)), stream, nil))
		leaves, dones = append(leaves, leave), append(dones, done)
	}
	eventually(t, 10*time.Second, "two requests at the stalled engines", func() bool {
		n := 0
		for _, r := range fleet {
			n += r.sim.State().InFlight
		}
		return n == 2 && inFlight() == 2
	})
	for i := range leaves {
		leaves[i]()
		<-dones[i]
	}
	for _, r := range fleet {
		r.sim.SetFaults(kvsim.Faults{})
	}
	released(t, upstreamDials, "after the gateway's and the stalled requests' clients left")

	// Its client leaves in the middle of its stream.
	func() {
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		raw, _ := json.Marshal(completion("midstream", true, map[string]any{"max_tokens": 2000}))
		req, _ := http.NewRequestWithContext(ctx, "POST", routerURL+"/v1/completions", strings.NewReader(string(raw)))
		req.Header.Set("Content-Type", "application/json")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		lines := bufio.NewScanner(resp.Body)
		for lines.Scan() && !strings.Contains(lines.Text(), `"text"`) {
		}
		if inFlight() != 1 {
			t.Fatalf("%d requests in flight mid-stream, want 1", inFlight())
		}
	}()

	// Answered by the router, by the engines with an error, or in full.
	if c := post(t, "/v1/completions", completion("toolong", false, map[string]any{"max_tokens": 30000})); c.status != 400 {
		t.Errorf("a request larger than every KV: %d %s, want 400", c.status, c.body)
	}
	if c := post(t, "/v1/completions", completion("unknown", false, map[string]any{"model": "no-such-model"})); c.status != 404 {
		t.Errorf("a model no engine serves: %d %s, want the engine's 404", c.status, c.body)
	}
	if c := post(t, "/v1/completions", completion("parallel", true, map[string]any{"n": 3})); c.status != 200 || !strings.Contains(c.body, "[DONE]") {
		t.Errorf("n=3 stream: %d %s", c.status, c.body)
	}
	for _, r := range fleet {
		r.sim.SetFaults(kvsim.Faults{ErrorRate: 1})
	}
	if c := post(t, "/v1/completions", completion("failing", false, nil)); c.status != 500 {
		t.Errorf("engines failing every request: %d %s, want 500", c.status, c.body)
	}
	// Every engine breaks the stream off after 3 tokens: it moves from
	// one to the other until the router gives up and ends it.
	for _, r := range fleet {
		r.sim.SetFaults(kvsim.Faults{CutAfterTokens: 3})
	}
	if c := post(t, "/v1/completions", completion("broken", true, nil)); c.status != 200 || !strings.Contains(c.body, "stream interrupted") {
		t.Errorf("a stream broken off everywhere: %d %s, want its error event", c.status, c.body)
	}
	for _, r := range fleet {
		r.sim.SetFaults(kvsim.Faults{})
	}

	released(t, upstreamDials, "once idle")
	mfs := metricFamilies(t, adminURL+"/metrics")
	for _, name := range []string{"caddy_llm_affinity_upstream_queued_tokens", "caddy_llm_affinity_upstream_in_flight", "caddy_llm_affinity_gateway_held"} {
		for _, m := range mfs[name].GetMetric() {
			if v := m.GetGauge().GetValue(); v != 0 {
				t.Errorf("%s%v = %v once idle, want 0", name, m.GetLabel(), v)
			}
		}
	}
	// The endings above happened as meant.
	const shed, waited, moved = "caddy_llm_affinity_shed_total", "caddy_llm_affinity_queue_wait_seconds", "caddy_llm_affinity_moved_requests_total"
	if n := counterValue(mfs, shed, "blocked_by", "queue_full") - counterValue(before, shed, "blocked_by", "queue_full"); n != 1 {
		t.Errorf("%v requests shed for queue_limit, want 1", n)
	}
	if n := histogramCount(mfs, waited, "reason", "canceled") - histogramCount(before, waited, "reason", "canceled"); n != 1 {
		t.Errorf("%d held requests whose client left, want 1", n)
	}
	if n := counterValue(mfs, moved, "outcome", "cut") - counterValue(before, moved, "outcome", "cut"); n == 0 {
		t.Error("no stream was cut by its engines")
	}
}

// charged says what the admin view still counts on the upstreams at dials
// and at the gateway, "" for nothing.
func charged(t *testing.T, dials []string) string {
	t.Helper()
	var left []string
	for _, dial := range dials {
		u := upstream(t, dial)
		if u.InFlight != 0 || u.ThisRouterInFlight != 0 || u.QueuedPrefillTokens != 0 || u.QueuedDecodeTokens != 0 || u.KVTokensInFlight != 0 {
			left = append(left, fmt.Sprintf("%s: in flight %d (this router's %d), queued prefill %d, decode %d, KV %d", u.Dial,
				u.InFlight, u.ThisRouterInFlight, u.QueuedPrefillTokens, u.QueuedDecodeTokens, u.KVTokensInFlight))
		}
	}
	if n := heldAtGateway(t); n != 0 {
		left = append(left, fmt.Sprintf("%d held at the gateway", n))
	}
	return strings.Join(left, "; ")
}

// released waits until nothing is charged on the upstreams at dials nor
// held at the gateway (see charged): the router notices a client gone
// after the client does, and an upstream gone after its connection closes.
func released(t *testing.T, dials []string, what string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	left := charged(t, dials)
	for ; left != "" && time.Now().Before(deadline); left = charged(t, dials) {
		time.Sleep(20 * time.Millisecond)
	}
	if left != "" {
		t.Fatalf("%s, still charged: %s", what, left)
	}
}
