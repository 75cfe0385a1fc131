package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"

	"github.com/llmaffinity/caddy-llm-affinity/caddyllm"
	"github.com/llmaffinity/caddy-llm-affinity/kvsim"
	"github.com/llmaffinity/caddy-llm-affinity/prefixindex"
)

// sendUntil posts a completion of prompt bytes of text seeded by tag,
// asking for maxTokens, until ctx ends; its status (0 when it got no
// answer) goes to the channel returned.
func sendUntil(ctx context.Context, tag string, prompt, maxTokens int) <-chan int {
	done := make(chan int, 1)
	go func() {
		body, _ := json.Marshal(map[string]any{"model": kvsim.DefaultModel, "prompt": text(tag, prompt), "max_tokens": maxTokens})
		req, _ := http.NewRequestWithContext(ctx, "POST", routerURL+"/v1/completions", strings.NewReader(string(body)))
		req.Header.Set("Content-Type", "application/json")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			done <- 0
			return
		}
		resp.Body.Close()
		done <- resp.StatusCode
	}()
	return done
}

// heldAtGateway is the admin API's count of requests held at the
// gateway.
func heldAtGateway(t *testing.T) int {
	t.Helper()
	var v caddyllm.GatewayView
	getJSON(t, adminURL+"/llm_affinity/gateway", &v)
	return v.Held
}

// TestReloadShowsNewCapacityAtOnce: a reload that changes kv_capacity
// shows in the admin view, the capacity and the index's size, as soon as
// the reload returns (it showed the old ones until the next decision, or,
// lowered, for a minute), up and down; a reload that removes it shows the
// capacity unknown and the index at its default size.
func TestReloadShowsNewCapacityAtOnce(t *testing.T) {
	fleet := startFleet(t, 1, 20, kvsim.Config{})
	dial := fleet[0].dial()
	config := func(kv int) string { return caddyfile(fleet, "", fmt.Sprintf("kv_capacity %d", kv), "") }
	tester := startCaddy(t, config(65536))
	// A routed request gives the index its block size.
	if c := post(t, "/v1/completions", map[string]any{"model": kvsim.DefaultModel, "prompt": text("sized", 2000), "max_tokens": 2}); c.status != 200 {
		t.Fatalf("%d %s", c.status, c.body)
	}
	u := upstream(t, dial)
	if u.KVCapacityTokens != 65536 || u.IndexCapacity == 0 {
		t.Fatalf("before the reloads: kv_capacity_tokens %d, index_capacity_blocks %d", u.KVCapacityTokens, u.IndexCapacity)
	}
	blockTokens := 65536 / u.IndexCapacity
	for _, kv := range []int{131072, 32768} {
		reload(t, tester, config(kv))
		if u := upstream(t, dial); u.KVCapacityTokens != kv || u.IndexCapacity != kv/blockTokens {
			t.Errorf("right after the reload to kv_capacity %d: kv_capacity_tokens %d, index_capacity_blocks %d (want %d)",
				kv, u.KVCapacityTokens, u.IndexCapacity, kv/blockTokens)
		}
	}
	// A reload without the figure: unknown again (it showed the last one).
	reload(t, tester, caddyfile(fleet, "", "", ""))
	if u := upstream(t, dial); u.KVCapacityTokens != 0 || u.IndexCapacity != prefixindex.DefaultCapacity {
		t.Errorf("right after the reload without kv_capacity: kv_capacity_tokens %d, index_capacity_blocks %d (want 0, %d)",
			u.KVCapacityTokens, u.IndexCapacity, prefixindex.DefaultCapacity)
	}
}

// TestRemovedUpstreamLeavesDraining: an upstream that a reload drops while
// a request is in flight there is listed, until that request ends, as
// draining because removed (not active: nothing routes there any more),
// and the metrics count it so under upstream="other"; then it leaves the
// view.
func TestRemovedUpstreamLeavesDraining(t *testing.T) {
	fleet := startFleet(t, 2, 1, kvsim.Config{})
	a, b := fleet[0], fleet[1]
	a.sim.SetFaults(kvsim.Faults{Stall: true})
	tester := startCaddy(t, caddyfile(fleet, "", "drain "+b.dial(), ""))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := sendUntil(ctx, "removed", 400, 4)
	eventually(t, 10*time.Second, "the request in flight on A", func() bool { return upstream(t, a.dial()).InFlight == 1 })
	adminDo(t, "POST", "/llm_affinity/upstreams/"+a.dial()+"/drain?deadline=1h")

	reload(t, tester, caddyfile(fleet[1:], "", "", ""))
	u, ok := upstreams(t)[a.dial()]
	if !ok || u.InFlight != 1 || u.Drain != "draining" || u.DrainCause != "removed" {
		t.Fatalf("A, dropped with a request in flight: listed %v, in_flight %d, drain %q (%q)", ok, u.InFlight, u.Drain, u.DrainCause)
	}
	mfs := metricFamilies(t, adminURL+"/metrics")
	if m := scrapeMetrics(t); strings.Contains(m, a.dial()) {
		t.Error("the metrics still label a series with the dropped upstream")
	}
	if n := phaseGauge(mfs, "other", "draining"); n != 1 {
		t.Errorf("caddy_llm_affinity_upstream_drain_phase{upstream=\"other\",phase=\"draining\"} = %v, want 1", n)
	}
	if n := phaseGauge(mfs, "other", "active"); n != 0 {
		t.Errorf("caddy_llm_affinity_upstream_drain_phase{upstream=\"other\",phase=\"active\"} = %v, want 0", n)
	}

	cancel()
	<-done
	eventually(t, 10*time.Second, "A gone from the view with its request", func() bool {
		_, ok := upstreams(t)[a.dial()]
		return !ok
	})
}

// TestRemovedUpstreamCountsItsCompletions: a request that completes on an
// upstream a reload dropped while it ran there completed while that
// upstream was draining (cause removed, as the admin API lists it), and
// caddy_llm_affinity_drain_completed_total counts it as it counts one on
// an upstream an operator drains.
func TestRemovedUpstreamCountsItsCompletions(t *testing.T) {
	fleet := startFleet(t, 2, 50, kvsim.Config{})
	a, b := fleet[0], fleet[1]
	a.sim.SetFaults(kvsim.Faults{Stall: true})
	tester := startCaddy(t, caddyfile(fleet, "", "drain "+b.dial(), ""))
	completed := func() float64 {
		for _, m := range metricFamilies(t, adminURL+"/metrics")["caddy_llm_affinity_drain_completed_total"].GetMetric() {
			return m.GetCounter().GetValue()
		}
		return 0
	}
	before := completed()
	done := sendUntil(context.Background(), "removed-completes", 400, 4)
	eventually(t, 10*time.Second, "the request in flight on A", func() bool { return upstream(t, a.dial()).InFlight == 1 })
	reload(t, tester, caddyfile(fleet[1:], "", "", ""))
	if u := upstreams(t)[a.dial()]; u.DrainCause != "removed" {
		t.Fatalf("A, dropped with a request in flight: drain %q (%q)", u.Drain, u.DrainCause)
	}
	a.sim.SetFaults(kvsim.Faults{})
	if status := <-done; status != 200 {
		t.Fatalf("the request on A: %d", status)
	}
	eventually(t, 10*time.Second, "the completion counted", func() bool { return completed() == before+1 })
}

// phaseGauge is caddy_llm_affinity_upstream_drain_phase's value for
// upstream and phase, 0 when absent.
func phaseGauge(mfs map[string]*dto.MetricFamily, upstream, phase string) float64 {
	for _, m := range mfs["caddy_llm_affinity_upstream_drain_phase"].GetMetric() {
		labels := map[string]string{}
		for _, l := range m.GetLabel() {
			labels[l.GetName()] = l.GetValue()
		}
		if labels["upstream"] == upstream && labels["phase"] == phase {
			return m.GetGauge().GetValue()
		}
	}
	return 0
}

// TestReloadReleasesHeldRequest: a request held at the gateway because its
// KV fits nowhere (the replica's is full of stalled requests, which would
// free it only long after queue_timeout) is let through once a reload
// raises kv_capacity enough, as a new request would be, rather than
// waiting for queue_timeout under the replaced config's figure.
func TestReloadReleasesHeldRequest(t *testing.T) {
	testReloadReleasesHeldRequest(t, func(fleet []*replica, policyOpts string) string {
		return caddyfile(fleet, "", policyOpts, "")
	})
}

// testReloadReleasesHeldRequest is TestReloadReleasesHeldRequest with the
// Caddyfile config gives for a one-replica fleet and the policy options:
// the held request is routed, and the admin view shows the new
// kv_capacity as soon as the reload returns.
func testReloadReleasesHeldRequest(t *testing.T, config func(fleet []*replica, policyOpts string) string) {
	fleet := startFleet(t, 1, 1, kvsim.Config{})
	fleet[0].sim.SetFaults(kvsim.Faults{Stall: true})
	dial := fleet[0].dial()
	withKV := func(kv int) string {
		return config(fleet, fmt.Sprintf("kv_capacity %d\n\t\t\tprefill_rate 1\n\t\t\tqueue_timeout 10m\n\t\t\toutput_estimate max_tokens", kv))
	}
	tester := startCaddy(t, withKV(20000))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// Two 9k-token requests fill the 20k tokens; at 1 prefill token a
	// second, they would free them in hours.
	for i := range 2 {
		sendUntil(ctx, fmt.Sprint("filler", i), 36_000, 100)
	}
	eventually(t, 10*time.Second, "two fillers in flight", func() bool {
		u, ok := upstreams(t)[dial] // a dynamic upstream is listed once routed to
		return ok && u.InFlight == 2
	})
	late := sendUntil(ctx, "late", 20_000, 100)
	eventually(t, 10*time.Second, "the late request held", func() bool { return heldAtGateway(t) == 1 })

	reload(t, tester, withKV(200_000))
	if u := upstream(t, dial); u.KVCapacityTokens != 200_000 {
		t.Errorf("right after the reload: kv_capacity_tokens %d, want 200000", u.KVCapacityTokens)
	}
	eventually(t, 20*time.Second, "the held request routed", func() bool {
		return heldAtGateway(t) == 0 && upstream(t, dial).InFlight == 3
	})
	select {
	case status := <-late:
		t.Fatalf("the late request was answered %d; it should be on the (stalled) replica", status)
	default:
	}
}

// dynamicCaddyfile is the test config with the replica's address as a
// dynamic upstream (an A lookup of localhost at its port), the policy
// options given.
func dynamicCaddyfile(r *replica, policyOpts string) string {
	_, port, _ := strings.Cut(r.dial(), ":")
	return globalOptions + fmt.Sprintf(`http://%s {
	llm_affinity
	reverse_proxy {
		dynamic a localhost %s {
			versions ipv4
		}
		lb_policy llm_affinity {
			explain_header
			%s
		}
	}
}
`, routerHost, port, policyOpts)
}

// TestReloadReleasesHeldRequestOnDynamicUpstream is
// TestReloadReleasesHeldRequest with the replica a dynamic upstream (one
// no config names, which kv_capacity applies to as to every upstream): a
// held request takes the loaded configs' figure there too, and the reload
// shows in the admin view at once, as README says of kv_capacity.
func TestReloadReleasesHeldRequestOnDynamicUpstream(t *testing.T) {
	testReloadReleasesHeldRequest(t, func(fleet []*replica, policyOpts string) string {
		return dynamicCaddyfile(fleet[0], policyOpts)
	})
}
