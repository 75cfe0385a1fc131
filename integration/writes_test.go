package integration

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"strings"
	"testing"
)

// TestOneWritePerProxiedRequest: through a real Caddy, a request routed by
// llm_affinity reaches its upstream in one write (headers and body
// together). The policy's body must be one net/http knows is in memory;
// any other makes the transport flush the headers first, a system call
// more for every request, and a Caddy upgrade that wrapped the body after
// Select would bring that back. Counted with the process's write system
// calls (Linux /proc/self/io) over sequential requests, everything in this
// process: the client's request, Caddy's to the upstream, the upstream's
// answer and Caddy's, one write each.
func TestOneWritePerProxiedRequest(t *testing.T) {
	if _, err := os.Stat("/proc/self/io"); err != nil {
		t.Skip("needs /proc/self/io (Linux)")
	}
	answer := []byte(`{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":"ok","finish_reason":"length"}],"usage":{"prompt_tokens":140,"completion_tokens":16,"total_tokens":156}}`)
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		w.Write(answer)
	}))
	defer upstream.Close()
	dial := strings.TrimPrefix(upstream.URL, "http://")
	startCaddy(t, globalOptions+fmt.Sprintf(`http://%s {
	llm_affinity
	reverse_proxy %s {
		lb_policy llm_affinity
	}
}
`, routerHost, dial))

	body := []byte(`{"model":"m","prompt":"` + strings.Repeat("lorem a ", 64) + `","max_tokens":16}`)
	client := &http.Client{Transport: &http.Transport{}}
	defer client.CloseIdleConnections()
	send := func() {
		resp, err := client.Post(routerURL+"/v1/completions", "application/json", bytes.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("status %d", resp.StatusCode)
		}
	}
	for range 20 { // connections made, pools warm
		send()
	}
	const requests = 200
	before := processWrites(t)
	for range requests {
		send()
	}
	perRequest := float64(processWrites(t)-before) / requests
	t.Logf("%.2f writes per proxied request, process-wide", perRequest)
	if perRequest < 3.5 || perRequest > 4.5 {
		t.Fatalf("%.2f writes per request, want 4 (client, Caddy to upstream, upstream, Caddy to client); 5 means the proxy flushed the headers before the body", perRequest)
	}
}

// processWrites is the process's write system calls so far.
func processWrites(t *testing.T) int64 {
	t.Helper()
	f, err := os.Open("/proc/self/io")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "syscw: "); ok {
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil {
				t.Fatal(err)
			}
			return n
		}
	}
	t.Fatal("no syscw in /proc/self/io")
	return 0
}
