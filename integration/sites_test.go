package integration

import (
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddytest"

	"github.com/llmaffinity/caddy-llm-affinity/kvsim"
)

// twoSites renders a config with two sites sharing upstreams: site one
// (localhost) proxies to oneDials with oneOpts, site two (127.0.0.1)
// proxies to twoDials with twoOpts. Site one comes first, so Caddy
// provisions its policy before site two's.
func twoSites(oneDials, oneOpts, twoDials, twoOpts string) string {
	return globalOptions + fmt.Sprintf(`http://localhost:%[5]d {
	llm_affinity
	reverse_proxy %[1]s {
		lb_policy llm_affinity {
			%[2]s
		}
	}
}
http://127.0.0.1:%[5]d {
	llm_affinity
	reverse_proxy %[3]s {
		lb_policy llm_affinity {
			%[4]s
		}
	}
}
`, oneDials, oneOpts, twoDials, twoOpts, httpPort)
}

// reload loads a Caddyfile through the admin API and fails the test
// unless Caddy takes it. The replaced server closes the connections it
// kept, so the test's client drops its idle ones: a POST on one fails.
func reload(t *testing.T, tester *caddytest.Tester, config string) {
	t.Helper()
	if status, body := load(t, tester, "text/caddyfile", config); status != 200 {
		t.Fatalf("reload: %d %s", status, body)
	}
	http.DefaultClient.CloseIdleConnections()
}

// load posts config (of the content type, a Caddyfile or JSON) to the
// admin API's /load and returns Caddy's answer.
func load(t *testing.T, tester *caddytest.Tester, contentType, config string) (int, string) {
	t.Helper()
	req, _ := http.NewRequest("POST", adminURL+"/load", strings.NewReader(config))
	req.Header.Set("Content-Type", contentType)
	// On a connection of its own: a load replaces Caddy's admin server and
	// shuts the old one down meanwhile, which may close a kept-alive
	// connection of the last load's under the next (a reset on a busy
	// machine).
	req.Close = true
	resp, err := tester.Client.Do(req)
	if err != nil {
		t.Fatalf("load: %v", err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(body)
}

// TestTwoSitesShareUpstreams is the rule for sites that share an upstream
// (README, "Several sites, one upstream"): routing state is shared by
// dial address; a drain is lifted only by whoever set it, so site one's
// config drain survives site two's provisioning and reloads; an upstream
// that no loaded config names any more leaves the admin view, its drains
// with it.
func TestTwoSitesShareUpstreams(t *testing.T) {
	fleet := startFleet(t, 3, 20, kvsim.Config{})
	a, b, c := fleet[0], fleet[1], fleet[2]
	all := dials(fleet)
	tester := startCaddy(t, twoSites(all, "drain "+a.dial(), all, ""))

	u := upstream(t, a.dial())
	if u.Drain == "active" || u.DrainCause != "config" {
		t.Fatalf("site two's provisioning lifted site one's config drain: %s (%s)", u.Drain, u.DrainCause)
	}
	// The drain holds for both sites: it is the upstream's.
	for i, base := range []string{routerURL, fmt.Sprintf("http://127.0.0.1:%d", httpPort)} {
		body := fmt.Sprintf(`{"model":%q,"prompt":%q,"max_tokens":2}`, kvsim.DefaultModel, text(fmt.Sprint("site", i), 400))
		resp, err := http.Post(base+"/v1/completions", "application/json", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if got := resp.Header.Get(kvsim.ReplicaHeader); resp.StatusCode != 200 || got == a.name {
			t.Fatalf("site %d: status %d on %q while A drains", i+1, resp.StatusCode, got)
		}
	}

	// Reloading with site two changed keeps site one's drain.
	reload(t, tester, twoSites(all, "drain "+a.dial(), all, "queue_timeout 2s"))
	if p := drainPhase(t, a.dial()); p == "active" {
		t.Fatal("site one's config drain lost when site two changed")
	}

	// A drain or undrain of an upstream no config has is refused.
	for _, method := range []string{"POST", "DELETE"} {
		req, _ := http.NewRequest(method, adminURL+"/llm_affinity/upstreams/nowhere.invalid:1/drain", nil)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusNotFound {
			t.Fatalf("%s drain of an unknown upstream: %d, want 404", method, resp.StatusCode)
		}
	}

	// An operator drains C; then no config names A or C any more: both
	// leave the admin view, drains and all.
	adminDo(t, "POST", "/llm_affinity/upstreams/"+c.dial()+"/drain")
	if p := drainPhase(t, c.dial()); p == "active" {
		t.Fatal("admin drain of C did not take")
	}
	reload(t, tester, twoSites(b.dial(), "", b.dial(), ""))
	eventually(t, 10*time.Second, "A and C leave the admin view", func() bool {
		ups := upstreams(t)
		_, hasA := ups[a.dial()]
		_, hasC := ups[c.dial()]
		return !hasA && !hasC
	})
	if _, ok := upstreams(t)[b.dial()]; !ok {
		t.Fatal("B, still named, left the admin view")
	}
	if m := scrapeMetrics(t); strings.Contains(m, a.dial()) || strings.Contains(m, c.dial()) {
		t.Fatal("the metrics still export an upstream no config names")
	}

	// Named again, A is back in service: its config drain went with it.
	reload(t, tester, twoSites(all, "", all, ""))
	if p := drainPhase(t, a.dial()); p != "active" {
		t.Fatalf("A is %s after every drain on it was unloaded", p)
	}
}
