package integration

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"

	"github.com/llmaffinity/caddy-llm-affinity/caddyllm"
	"github.com/llmaffinity/caddy-llm-affinity/internal/natstest"
	"github.com/llmaffinity/caddy-llm-affinity/kvsim"
)

// A cluster test runs several routers as separate Caddy processes (Caddy
// holds one config per process): the project's own binary, built once.

var (
	caddyBinOnce sync.Once
	caddyBin     string
	caddyBinErr  error
)

// buildCaddy builds cmd/caddy into a directory that outlives the test.
func buildCaddy(t *testing.T) string {
	t.Helper()
	caddyBinOnce.Do(func() {
		dir, err := os.MkdirTemp("", "llm-affinity-caddy")
		if err != nil {
			caddyBinErr = err
			return
		}
		caddyBin = filepath.Join(dir, "caddy")
		out, err := exec.Command("go", "build", "-o", caddyBin, "../cmd/caddy").CombinedOutput()
		if err != nil {
			caddyBinErr = fmt.Errorf("go build ./cmd/caddy: %v\n%s", err, out)
		}
	})
	if caddyBinErr != nil {
		t.Fatal(caddyBinErr)
	}
	return caddyBin
}

// freePort returns a TCP port nothing listens on now, never one it
// returned before in this process.
func freePort(t *testing.T) int {
	t.Helper()
	portsMu.Lock()
	defer portsMu.Unlock()
	for {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		port := l.Addr().(*net.TCPAddr).Port
		l.Close()
		// The kernel may hand out a port again once it is closed, before
		// the process it was picked for listens on it: a quickstart's
		// replica once got its admin API's port and never answered.
		if !portsGiven[port] {
			portsGiven[port] = true
			return port
		}
	}
}

// portsGiven are the ports freePort returned in this process.
var (
	portsMu    sync.Mutex
	portsGiven = make(map[int]bool)
)

// natsServer runs a real NATS server in this process on port.
func natsServer(t *testing.T, port int) *server.Server { return natstest.Start(t, port) }

// routerProc is one Caddy process of the cluster.
type routerProc struct {
	name  string
	url   string // its llm_affinity site
	admin string // its admin endpoint
}

// startRouter runs the Caddy binary with a config routing to fleet and
// syncing over natsURL; it stops with the test.
func startRouter(t *testing.T, bin, name, natsURL string, fleet []*replica) *routerProc {
	t.Helper()
	r := &routerProc{name: name,
		url:   fmt.Sprintf("http://127.0.0.1:%d", freePort(t)),
		admin: fmt.Sprintf("http://127.0.0.1:%d", freePort(t)),
	}
	config := fmt.Sprintf(`{
	admin %s
	persist_config off
	skip_install_trust
	grace_period 1ns
}
%s {
	llm_affinity
	reverse_proxy %s {
		lb_policy llm_affinity {
			explain_header
			sync %s {
				name %s
			}
		}
	}
}
`, strings.TrimPrefix(r.admin, "http://"), r.url, dials(fleet), natsURL, name)
	// runCaddy waits for the admin API; the router is up once sync is
	// served there too.
	runCaddy(t, bin, name, config, strings.TrimPrefix(r.admin, "http://"))
	eventually(t, 30*time.Second, name+" listening", func() bool {
		resp, err := http.Get(r.admin + "/llm_affinity/sync")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == 200
	})
	return r
}

func (r *routerProc) sync(t *testing.T) caddyllm.SyncView {
	t.Helper()
	var v caddyllm.SyncView
	getJSON(t, r.admin+"/llm_affinity/sync", &v)
	return v
}

func (r *routerProc) upstreams(t *testing.T) map[string]caddyllm.UpstreamSnapshot {
	t.Helper()
	var list []caddyllm.UpstreamSnapshot
	getJSON(t, r.admin+"/llm_affinity/upstreams", &list)
	out := map[string]caddyllm.UpstreamSnapshot{}
	for _, u := range list {
		out[u.Dial] = u
	}
	return out
}

func getJSON(t *testing.T, url string, v any) {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if err := json.NewDecoder(resp.Body).Decode(v); err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
}

// post sends a chat request through the router and returns the replica
// that served it and the router's explanation; any failure fails the
// test.
func (r *routerProc) post(t *testing.T, messages []msg) (replica, explain string) {
	t.Helper()
	raw, _ := json.Marshal(chat(messages, 4))
	resp, err := http.Post(r.url+"/v1/chat/completions", "application/json", bytes.NewReader(raw))
	if err != nil {
		t.Errorf("%s: %v", r.name, err)
		return "", ""
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 {
		t.Errorf("%s: %d %s", r.name, resp.StatusCode, body)
	}
	return resp.Header.Get(kvsim.ReplicaHeader), resp.Header.Get("X-LLM-Affinity")
}

// allConnected waits until every router is connected and hears the others.
func allConnected(t *testing.T, routers []*routerProc) {
	t.Helper()
	eventually(t, 30*time.Second, "every router connected and hearing its peers", func() bool {
		for _, r := range routers {
			v := r.sync(t)
			if len(v.Connections) != 1 || !v.Connections[0].Connected || len(v.Peers) != len(routers)-1 {
				return false
			}
		}
		return true
	})
}

// thinkTime is how long a client takes between a response and its next
// turn (see conversations).
const thinkTime = 20 * time.Millisecond

// conversations runs n conversations of turns turns, one after another,
// turn k of conversation c sent through router (k+c) mod len(routers). It
// returns the share of turns 2 and later served by the replica of turn 1.
// One at a time, so that nothing but the routers' view decides: with the
// fleet idle, staying warm is always the faster choice, and a router that
// does not know where turn 1 went picks among idle replicas. Each turn
// follows the last response after thinkTime: a peer learns of a request's
// first token over NATS, and a turn sent sooner than that takes (on this
// loaded test machine, at times a few milliseconds) may be decided
// without it.

func conversations(t *testing.T, routers []*routerProc, tag string, n, turns int) float64 {
	t.Helper()
	stayed, later := 0, 0
	for c := range n {
		convo := []msg{{"system", marker + text(fmt.Sprintf("%s conversation %d", tag, c), 8000)}, {"user", "hello"}}
		first := ""
		for k := range turns {
			time.Sleep(thinkTime)
			got, explain := routers[(k+c)%len(routers)].post(t, convo)
			convo = append(convo, msg{"assistant", "ok"}, msg{"user", fmt.Sprintf("turn %d", k+1)})
			switch {
			case k == 0:
				first = got
			case got == first:
				stayed, later = stayed+1, later+1
			default:
				later++
				t.Logf("%s %d turn %d moved from %s: %s", tag, c, k+1, first, explain)
			}
		}
	}
	return float64(stayed) / float64(later)
}

// marker is prompt text that must never cross the wire.
const marker = "MARKER-7f3a-never-on-the-wire "

// TestClusterSharesOneView runs three routers (Caddy processes) syncing
// over a real NATS server in front of one kvsim fleet: conversations whose
// turns alternate between the routers stay on one replica; an operator's
// drain on one router reaches all three; losing NATS fails no request and
// sharing resumes when it is back; no prompt text is ever published.
func TestClusterSharesOneView(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs three Caddy processes")
	}
	bin := buildCaddy(t)
	natsPort := freePort(t)
	ns := natsServer(t, natsPort)
	natsURL := fmt.Sprintf("nats://127.0.0.1:%d", natsPort)

	// Everything published, as a peer sees it.
	var wireMu sync.Mutex
	var wire [][]byte
	spy, err := nats.Connect(natsURL, nats.MaxReconnects(-1), nats.ReconnectWait(100*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	defer spy.Close()
	// The events, and the snapshots' answers to their requesters'
	// inboxes (a subscriber of the requests themselves, which never
	// answers, would keep each starting router waiting for it).
	for _, subject := range []string{"llm_affinity", "_INBOX.>"} {
		if _, err := spy.Subscribe(subject, func(m *nats.Msg) {
			wireMu.Lock()
			wire = append(wire, m.Data)
			wireMu.Unlock()
		}); err != nil {
			t.Fatal(err)
		}
	}

	fleet := startFleet(t, 3, 20, kvsim.Config{})
	var routers []*routerProc
	for i := range 3 {
		routers = append(routers, startRouter(t, bin, fmt.Sprintf("router-%d", i), natsURL, fleet))
	}
	allConnected(t, routers)

	if share := conversations(t, routers, "synced", 8, 5); share < 0.9 {
		t.Fatalf("only %.0f%% of later turns stayed on the first turn's replica", 100*share)
	}
	// The dashboard's sync panels query what a router with sync exports
	// (the quickstart test checks the rest of the dashboard).
	mfs := metricFamilies(t, routers[0].admin+"/metrics")
	for _, name := range dashboardMetrics(t) {
		if strings.HasPrefix(name, "caddy_llm_affinity_sync_") && !exported(mfs, name) {
			t.Errorf("the dashboard queries %s, which a router with sync does not export", name)
		}
	}

	// An operator drains replica 0 through router 0: all three stop
	// sending it new requests.
	a := fleet[0]
	req, _ := http.NewRequest("POST", routers[0].admin+"/llm_affinity/upstreams/"+a.dial()+"/drain", nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("drain: %v %v", err, resp)
	}
	resp.Body.Close()
	for _, r := range routers {
		eventually(t, 10*time.Second, r.name+" seeing the drain", func() bool { return r.upstreams(t)[a.dial()].Drain != "active" })
	}
	for i := range 6 {
		if got, _ := routers[i%3].post(t, []msg{{"user", text(fmt.Sprint("while drained ", i), 2000)}}); got == a.name {
			t.Fatalf("router %d sent a request to the drained replica", i%3)
		}
	}
	req, _ = http.NewRequest("DELETE", routers[2].admin+"/llm_affinity/upstreams/"+a.dial()+"/drain", nil)
	if resp, err = http.DefaultClient.Do(req); err != nil || resp.StatusCode != 200 {
		t.Fatalf("undrain: %v %v", err, resp)
	}
	resp.Body.Close()
	for _, r := range routers {
		eventually(t, 10*time.Second, r.name+" seeing the undrain", func() bool { return r.upstreams(t)[a.dial()].Drain == "active" })
	}

	// NATS goes away: every request still succeeds, each router on its
	// own view.
	ns.Shutdown()
	for _, r := range routers {
		eventually(t, 10*time.Second, r.name+" noticing the loss", func() bool { return !r.sync(t).Connections[0].Connected })
	}
	// Any error fails the test; the share is what routers apart achieve.
	t.Logf("without NATS, %.0f%% of later turns stayed", 100*conversations(t, routers, "partitioned", 4, 4))
	// NATS is back on its address: sharing resumes.
	natsServer(t, natsPort)
	allConnected(t, routers)
	if share := conversations(t, routers, "healed", 8, 5); share < 0.9 {
		t.Fatalf("after NATS came back only %.0f%% of later turns stayed on the first turn's replica", 100*share)
	}

	// A router that starts now gets its peers' view: the next turns of
	// conversations the others routed go warm through it at once.
	var convos [][]msg
	var homes []string
	for c := range 6 {
		convo := []msg{{"system", marker + text(fmt.Sprintf("before the late router, conversation %d", c), 8000)}, {"user", "hello"}}
		got, _ := routers[c%3].post(t, convo)
		convos, homes = append(convos, append(convo, msg{"assistant", "ok"}, msg{"user", "again"})), append(homes, got)
	}
	late := startRouter(t, bin, "router-late", natsURL, fleet)
	eventually(t, 30*time.Second, "the late router starting with a peer's view", func() bool {
		v := late.sync(t)
		return len(v.Connections) == 1 && v.Connections[0].SnapshotFrom != ""
	})
	for c, convo := range convos {
		if got, explain := late.post(t, convo); got != homes[c] {
			t.Errorf("conversation %d's next turn through the late router went to %s, its first to %s: %s", c, got, homes[c], explain)
		}
	}
	if v := late.sync(t); v.Connections[0].SnapshotMessages == 0 {
		t.Errorf("the late router's sync view: %+v", v)
	}

	wireMu.Lock()
	defer wireMu.Unlock()
	if len(wire) == 0 {
		t.Fatal("nothing was published")
	}
	for _, p := range wire {
		if bytes.Contains(p, []byte("MARKER")) || bytes.Contains(p, []byte("conversation")) {
			t.Fatal("prompt text crossed the wire")
		}
	}
	for _, r := range routers {
		if st := r.sync(t).Connections[0]; st.Sent == 0 || st.Applied == 0 || st.Disconnects == 0 {
			t.Errorf("%s's counters: %+v", r.name, st)
		}
	}
}

// TestClusterForgetsAFailedRequest: a conversation's first turn, sent
// through one router, fails at its engine before any token (the engine
// answers 500 at once, as vLLM does when a request errors in its
// scheduler). The router that sent it takes its blocks back, and so do
// its peers: the next attempt through another router is not routed as
// warm to the engine that never prefilled the prompt.
func TestClusterForgetsAFailedRequest(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and runs two Caddy processes")
	}
	bin := buildCaddy(t)
	natsPort := freePort(t)
	natsServer(t, natsPort)
	natsURL := fmt.Sprintf("nats://127.0.0.1:%d", natsPort)

	// Each replica fails the first request whose prompt holds a
	// conversation's failure mark, once.
	var failedMu sync.Mutex
	failed := map[string]string{} // mark -> the replica that failed it
	const mark = "FAIL-ONCE-"
	fleet := startFleetServing(t, 3, 20, kvsim.Config{}, func(name string, sim http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			body, _ := io.ReadAll(r.Body)
			r.Body = io.NopCloser(bytes.NewReader(body))
			if i := bytes.Index(body, []byte(mark)); i >= 0 {
				key := string(body[i : i+len(mark)+2])
				failedMu.Lock()
				_, seen := failed[key]
				if !seen {
					failed[key] = name
				}
				failedMu.Unlock()
				if !seen {
					http.Error(w, `{"error":{"message":"engine error","type":"InternalServerError","code":500}}`, http.StatusInternalServerError)
					return
				}
			}
			sim.ServeHTTP(w, r)
		})
	})
	routers := []*routerProc{
		startRouter(t, bin, "router-0", natsURL, fleet),
		startRouter(t, bin, "router-1", natsURL, fleet),
	}
	allConnected(t, routers)

	indexBlocks := func(r *routerProc) int {
		n := 0
		for _, u := range r.upstreams(t) {
			n += u.IndexBlocks
		}
		return n
	}
	for c := range 4 {
		key := fmt.Sprintf("%s%02d", mark, c)
		convo := []msg{{"system", key + " " + text(fmt.Sprintf("failed conversation %d", c), 8000)}, {"user", "hello"}}
		blocks, applied := indexBlocks(routers[1]), routers[1].sync(t).Connections[0].Applied
		raw, _ := json.Marshal(chat(convo, 4))
		resp, err := http.Post(routers[0].url+"/v1/chat/completions", "application/json", bytes.NewReader(raw))
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusInternalServerError {
			t.Fatalf("conversation %d's failing turn: %d", c, resp.StatusCode)
		}
		// Router 0 tells its peer of three things: the routing, the
		// release, and the blocks to forget.
		eventually(t, 10*time.Second, "router-1 hearing of the failed request", func() bool {
			return routers[1].sync(t).Connections[0].Applied >= applied+3
		})
		if got := indexBlocks(routers[1]); got != blocks {
			t.Errorf("conversation %d: router-1's index holds %d blocks after the failure, %d before it", c, got, blocks)
		}
		// The same prompt again through router 1 is not taken as cached
		// anywhere (kvsim holds none of it).
		if _, explain := routers[1].post(t, convo); strings.Contains(explain, "reason=warm") || !strings.Contains(explain, "matched=0;") {
			t.Errorf("conversation %d's failed turn, sent again through router-1: %s", c, explain)
		}
	}
}
