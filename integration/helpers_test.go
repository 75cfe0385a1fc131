// Package integration runs a real in-process Caddy with the llm_affinity
// plugin in front of a fleet of kvsim engines. All Caddy tests live in
// this one package: caddytest uses fixed admin and HTTP ports.
package integration

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddytest"

	"github.com/llmaffinity/caddy-llm-affinity/caddyllm"
	"github.com/llmaffinity/caddy-llm-affinity/kvsim"
)

// The in-process Caddy's ports are free ports picked once per test
// process, not caddytest's fixed ones: other checkouts' test runs on the
// same machine would otherwise answer this one's requests (and load their
// configs into its Caddy).
var (
	adminPort, httpPort, httpsPort = pickPorts()

	routerHost = fmt.Sprintf("localhost:%d", httpPort)
	routerURL  = "http://" + routerHost
	adminURL   = fmt.Sprintf("http://localhost:%d", adminPort)
)

// pickPorts returns three free ports.
func pickPorts() (a, b, c int) {
	var ports [3]int
	for i := range ports {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			panic(err)
		}
		defer l.Close() // held until all three are picked, so they differ
		ports[i] = l.Addr().(*net.TCPAddr).Port
	}
	return ports[0], ports[1], ports[2]
}

// replica is one kvsim engine behind an httptest listener.
type replica struct {
	name string
	sim  *kvsim.Server
	http *httptest.Server
}

func (r *replica) dial() string { return strings.TrimPrefix(r.http.URL, "http://") }

// startFleet starts n kvsim replicas; they stop with the test.
func startFleet(t *testing.T, n int, speed float64, cfg kvsim.Config) []*replica {
	return startFleetServing(t, n, speed, cfg, nil)
}

// startFleetServing is startFleet with each replica's HTTP handler
// wrapped, when wrap is given: to add an endpoint kvsim does not have.
func startFleetServing(t *testing.T, n int, speed float64, cfg kvsim.Config, wrap func(name string, sim http.Handler) http.Handler) []*replica {
	t.Helper()
	var out []*replica
	for i := 0; i < n; i++ {
		out = append(out, startReplica(t, fmt.Sprintf("%s-%d", t.Name(), i), speed, cfg, wrap))
	}
	return out
}

// startReplica starts one kvsim replica named name, its handler wrapped
// when wrap is given; it stops with the test.
func startReplica(t *testing.T, name string, speed float64, cfg kvsim.Config, wrap func(name string, sim http.Handler) http.Handler) *replica {
	t.Helper()
	sim, err := kvsim.NewServer(kvsim.ServerConfig{Name: name, Engine: cfg, Speed: speed})
	if err != nil {
		t.Fatal(err)
	}
	var h http.Handler = sim
	if wrap != nil {
		h = wrap(name, sim)
	}
	hs := httptest.NewServer(h)
	t.Cleanup(func() { hs.CloseClientConnections(); hs.Close(); sim.Close() })
	return &replica{name: name, sim: sim, http: hs}
}

// named is the replica of fleet named name (a response's X-Kvsim-Replica),
// nil for none.
func named(fleet []*replica, name string) *replica {
	for _, r := range fleet {
		if r.name == name {
			return r
		}
	}
	return nil
}

func dials(fleet []*replica) string {
	var d []string
	for _, r := range fleet {
		d = append(d, r.dial())
	}
	return strings.Join(d, " ")
}

// globalOptions are every test config's: the test ports, no trust
// store, no grace period on reloads.
var globalOptions = fmt.Sprintf(`{
	skip_install_trust
	admin localhost:%d
	http_port %d
	https_port %d
	grace_period 1ns
}
`, adminPort, httpPort, httpsPort)

// caddyfile renders the test config: the handler and reverse_proxy with
// the policy options given, in front of fleet.
func caddyfile(fleet []*replica, handlerOpts, policyOpts, proxyOpts string) string {
	return globalOptions + fmt.Sprintf(`http://%s {
	llm_affinity {
		%s
	}
	reverse_proxy %s {
		lb_policy llm_affinity {
			explain_header
			%s
		}
		%s
	}
}
`, routerHost, handlerOpts, dials(fleet), policyOpts, proxyOpts)
}

// startScriptedCaddy starts n engines that answer with engine (scripted
// for the test; they stop with it) and Caddy with the llm_affinity handler
// and policy, at their defaults, in front of them; it returns their dials.
func startScriptedCaddy(t *testing.T, n int, engine http.HandlerFunc) []string {
	t.Helper()
	var dials []string
	for range n {
		s := httptest.NewServer(engine)
		t.Cleanup(s.Close)
		dials = append(dials, strings.TrimPrefix(s.URL, "http://"))
	}
	startCaddy(t, globalOptions+fmt.Sprintf(`http://%s {
	llm_affinity
	reverse_proxy %s {
		lb_policy llm_affinity
	}
}
`, routerHost, strings.Join(dials, " ")))
	return dials
}

func startCaddy(t *testing.T, config string) *caddytest.Tester {
	t.Helper()
	tester := caddytest.NewTester(t).WithDefaultOverrides(caddytest.Config{AdminPort: adminPort})
	tester.InitServer(config, "caddyfile")
	// Connections kept alive to an earlier test's server on the same
	// port are dead: a POST sent on one before the client noticed its
	// close fails with EOF (a POST is not retried).
	http.DefaultClient.CloseIdleConnections()
	return tester
}

// completion is what a test needs from one response.
type completion struct {
	status  int
	replica string
	explain string
	cached  int
	body    string
	header  http.Header
}

func post(t *testing.T, path string, body any) completion {
	t.Helper()
	raw, err := json.Marshal(body)
	if err != nil {
		t.Fatal(err)
	}
	return postRaw(t, path, raw)
}

func postRaw(t *testing.T, path string, raw []byte) completion {
	t.Helper()
	resp, err := http.Post(routerURL+path, "application/json", bytes.NewReader(raw))
	if err != nil {
		t.Fatalf("POST %s: %v", path, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	c := completion{
		status: resp.StatusCode, replica: resp.Header.Get(kvsim.ReplicaHeader),
		explain: resp.Header.Get("X-LLM-Affinity"), body: string(b), header: resp.Header,
	}
	var parsed struct {
		Usage struct {
			Details struct {
				Cached int `json:"cached_tokens"`
			} `json:"prompt_tokens_details"`
		} `json:"usage"`
	}
	if json.Unmarshal(b, &parsed) == nil {
		c.cached = parsed.Usage.Details.Cached
	}
	return c
}

// upstreams reads the plugin's admin API: every upstream's state, by dial.
func upstreams(t *testing.T) map[string]caddyllm.UpstreamSnapshot {
	t.Helper()
	resp, err := http.Get(adminURL + "/llm_affinity/upstreams")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var list []caddyllm.UpstreamSnapshot
	if err := json.NewDecoder(resp.Body).Decode(&list); err != nil {
		t.Fatal(err)
	}
	out := make(map[string]caddyllm.UpstreamSnapshot, len(list))
	for _, u := range list {
		out[u.Dial] = u
	}
	return out
}

// upstream is dial's state in the admin API; the test fails if the API
// does not list it, so that checks on it cannot pass on a zero value.
func upstream(t *testing.T, dial string) caddyllm.UpstreamSnapshot {
	t.Helper()
	u, ok := upstreams(t)[dial]
	if !ok {
		t.Fatalf("the admin API does not list %s", dial)
	}
	return u
}

// eventually polls cond until it holds or the timeout passes.
func eventually(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting until %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// text returns n bytes of deterministic filler text seeded by s.
func text(s string, n int) string {
	var b strings.Builder
	for i := 0; b.Len() < n; i++ {
		fmt.Fprintf(&b, "%s-%d ", s, i)
	}
	return b.String()[:n]
}

type msg struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}
