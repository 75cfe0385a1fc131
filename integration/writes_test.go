package integration

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
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
	startScriptedCaddy(t, 1, func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		w.Write(answer)
	})

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

// TestBodiesArriveWholeFromReusedBuffers: the handler reuses the buffers
// it reads request bodies into, so a buffer must not go back to its pool
// while the request may still be sent from it. Through a real Caddy, eight
// clients send bodies of 600 bytes to 300 KB, each with its own text,
// to two upstreams that check every body against the client's digest,
// and to a dead one (a dial error: Caddy retries elsewhere, resending the
// body); some requests are refused at once, before the body is read. Every
// body that reaches an upstream must be the client's. A buffer released
// while its request is in flight (tried: once Select has chosen) fails it;
// the rule for which buffers go back at the request's end is
// TestBodyBufferReturnsOnlyWhenNothingReadsIt's (net/http's transports
// do not read a body after the response's end, so no test here can tell).
func TestBodiesArriveWholeFromReusedBuffers(t *testing.T) {
	var checked, corrupt atomic.Int64
	check := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("X-Refuse") != "" {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusBadRequest)
			w.Write([]byte(`{"error":{"message":"refused","type":"invalid_request_error","code":400}}`))
			return
		}
		body, err := io.ReadAll(r.Body)
		sum := sha256.Sum256(body)
		if err != nil || hex.EncodeToString(sum[:]) != r.Header.Get("X-Body-Sum") {
			corrupt.Add(1)
		}
		checked.Add(1)
		w.Header().Set("Content-Type", "application/json")
		w.Write([]byte(`{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":"ok","finish_reason":"length"}],"usage":{"prompt_tokens":140,"completion_tokens":1,"total_tokens":141}}`))
	})
	a, b := httptest.NewServer(check), httptest.NewServer(check)
	defer a.Close()
	defer b.Close()
	dead := httptest.NewServer(check)
	deadDial := strings.TrimPrefix(dead.URL, "http://")
	dead.Close()
	startCaddy(t, globalOptions+fmt.Sprintf(`http://%s {
	llm_affinity
	reverse_proxy %s %s %s {
		lb_policy llm_affinity {
			explain_header
		}
		lb_retries 3
	}
}
`, routerHost, strings.TrimPrefix(a.URL, "http://"), strings.TrimPrefix(b.URL, "http://"), deadDial))

	const clients, each = 8, 40
	var wg sync.WaitGroup
	var served, refused, retried atomic.Int64
	errs := make(chan error, clients)
	for c := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(c), 1))
			for i := range each {
				size := 600 + rng.IntN(300_000)
				if i%4 != 0 {
					size = 600 + rng.IntN(6_000)
				}
				words := make([]byte, 0, size)
				for len(words) < size {
					words = fmt.Appendf(words, "c%d-r%d-w%d ", c, i, rng.Uint32())
				}
				body := fmt.Appendf(nil, `{"model":"m","prompt":%q,"max_tokens":1}`, words)
				sum := sha256.Sum256(body)
				req, _ := http.NewRequest("POST", routerURL+"/v1/completions", bytes.NewReader(body))
				req.Header.Set("Content-Type", "application/json")
				req.Header.Set("X-Body-Sum", hex.EncodeToString(sum[:]))
				refuse := i%5 == 3
				if refuse {
					req.Header.Set("X-Refuse", "1")
				}
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					errs <- err
					return
				}
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if !strings.Contains(resp.Header.Get("X-LLM-Affinity"), "attempt=1") {
					retried.Add(1)
				}
				switch {
				case refuse && resp.StatusCode == http.StatusBadRequest:
					refused.Add(1)
				case !refuse && resp.StatusCode == http.StatusOK:
					served.Add(1)
				default:
					errs <- fmt.Errorf("client %d request %d (refuse %v): status %d", c, i, refuse, resp.StatusCode)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	t.Logf("%d bodies checked, %d served, %d refused, %d sent more than once", checked.Load(), served.Load(), refused.Load(), retried.Load())
	if n := corrupt.Load(); n > 0 {
		t.Fatalf("%d of %d bodies reached their upstream changed", n, checked.Load())
	}
	if served.Load() != clients*each-clients*each/5 || checked.Load() < served.Load() {
		t.Fatalf("served %d, checked %d", served.Load(), checked.Load())
	}
	if retried.Load() == 0 {
		t.Fatal("no request was sent again after the dead upstream's dial error")
	}
}
