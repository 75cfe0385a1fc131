package integration

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptrace"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/llmaffinity/caddy-llm-affinity/kvsim"
)

// TestCompressingEngine: engines behind something that compresses (a
// Caddy with encode gzip in front of each, as here) are asked for their
// responses uncompressed, since the router reads them on their way back.
// Clients such as the OpenAI Python client send Accept-Encoding: gzip;
// passed on, it made the engine's stream arrive compressed, and the
// router, reading it as text, saw no token (the prefix never confirmed,
// every turn cold) and held the stream back until its end.
func TestCompressingEngine(t *testing.T) {
	fleet := startFleet(t, 2, 1, kvsim.Config{})
	fronts := make([]string, len(fleet))
	var sites strings.Builder
	for i, r := range fleet {
		port := freePort(t)
		fronts[i] = fmt.Sprintf("127.0.0.1:%d", port)
		// Any host: the router passes the client's Host on.
		fmt.Fprintf(&sites, "http://:%d {\n\tencode gzip\n\treverse_proxy %s\n}\n", port, r.dial())
	}
	startCaddy(t, globalOptions+sites.String()+fmt.Sprintf(`http://%s {
	llm_affinity
	reverse_proxy %s {
		lb_policy llm_affinity {
			explain_header
		}
	}
}
`, routerHost, strings.Join(fronts, " ")))

	client := &http.Client{Transport: &http.Transport{DisableCompression: true}}
	defer client.CloseIdleConnections()
	send := func(ctx context.Context, maxTokens int) *http.Response {
		t.Helper()
		body := fmt.Sprintf(`{"model":%q,"messages":[{"role":"system","content":%q},{"role":"user","content":"hello"}],"max_tokens":%d,"stream":true}`,
			kvsim.DefaultModel, strings.Repeat("You answer questions about compressed streams. ", 40), maxTokens)
		req, _ := http.NewRequestWithContext(ctx, "POST", routerURL+"/v1/chat/completions", strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		req.Header.Set("Accept-Encoding", "gzip, deflate")
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		if resp.StatusCode != http.StatusOK {
			b, _ := io.ReadAll(resp.Body)
			t.Fatalf("status %d: %s", resp.StatusCode, b)
		}
		if enc := resp.Header.Get("Content-Encoding"); enc != "" {
			t.Fatalf("Content-Encoding %q reached the client of a site without encode", enc)
		}
		return resp
	}

	// A whole stream: plain SSE to its end.
	resp := send(context.Background(), 8)
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !bytes.HasPrefix(b, []byte("data: ")) || !bytes.HasSuffix(b, []byte("data: [DONE]\n\n")) {
		t.Fatalf("not a whole SSE stream: %q", b)
	}
	// Its first token confirmed the prefix there: the same prompt again
	// is warm.
	resp = send(context.Background(), 8)
	io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if explain := resp.Header.Get("X-LLM-Affinity"); !strings.Contains(explain, "reason=warm") || strings.Contains(explain, "matched=0;") {
		t.Fatalf("second turn not warm: %s", explain)
	}

	// A long stream reaches the client as it is generated: its first
	// token arrives while the engine is still at work on it.
	before := map[string]uint64{}
	for _, r := range fleet {
		before[r.name] = r.sim.State().Finished
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	resp = send(ctx, 4000)
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	if !sc.Scan() || !strings.HasPrefix(sc.Text(), "data: {") {
		t.Fatalf("first line %q, %v", sc.Text(), sc.Err())
	}
	replica := resp.Header.Get(kvsim.ReplicaHeader)
	for _, r := range fleet {
		if r.name == replica {
			if st := r.sim.State(); st.Finished != before[r.name] || st.InFlight == 0 {
				t.Fatalf("the first event came after the engine finished (finished %d → %d, in flight %d): the stream was held back",
					before[r.name], st.Finished, st.InFlight)
			}
			return
		}
	}
	t.Fatalf("answered by %q, not a replica of the fleet", replica)
}

// TestCompressedStreamPassesUnread: an engine that compresses its stream
// although asked not to gets it passed on as it is, never mended: when
// the stream breaks, the client keeps a gzip stream of what came (here
// the connection is cut), not gzip bytes followed by a plain-text error
// event.
func TestCompressedStreamPassesUnread(t *testing.T) {
	const event = "data: {\"id\":\"c1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\n"
	engine := func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		w.Header().Set("Content-Encoding", "gzip")
		w.WriteHeader(http.StatusOK)
		zw := gzip.NewWriter(w)
		for range 3 {
			zw.Write([]byte(event))
			zw.Flush()
			w.(http.Flusher).Flush()
		}
		panic(http.ErrAbortHandler) // the engine's connection breaks
	}
	dials := startScriptedCaddy(t, 2, engine)

	req, _ := http.NewRequest("POST", routerURL+"/v1/chat/completions",
		strings.NewReader(`{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":50,"stream":true}`))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept-Encoding", "gzip")
	client := &http.Client{Transport: &http.Transport{DisableCompression: true}, Timeout: 30 * time.Second}
	defer client.CloseIdleConnections()
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.Header.Get("Content-Encoding") != "gzip" {
		t.Fatalf("Content-Encoding %q, want the engine's gzip", resp.Header.Get("Content-Encoding"))
	}
	raw, _ := io.ReadAll(resp.Body) // ends with the cut
	zr, err := gzip.NewReader(bytes.NewReader(raw))
	if err != nil {
		t.Fatalf("the client's body is not gzip: %v: %q", err, raw)
	}
	text, _ := io.ReadAll(zr) // unexpected EOF: the stream was cut
	if want := strings.Repeat(event, 3); string(text) != want {
		t.Fatalf("decompressed %q, want the engine's three events", text)
	}
	// Nothing stays charged, and its first bytes were its first token.
	mfs := metricFamilies(t, adminURL+"/metrics")
	firstTokens := 0.0
	for _, m := range mfs["caddy_llm_affinity_time_to_first_token_seconds"].GetMetric() {
		for _, l := range m.GetLabel() {
			if l.GetName() == "upstream" && slices.Contains(dials, l.GetValue()) {
				firstTokens += float64(m.GetHistogram().GetSampleCount())
			}
		}
	}
	if firstTokens != 1 {
		t.Errorf("%v first tokens measured, want 1", firstTokens)
	}
	for _, dial := range dials {
		eventually(t, 10*time.Second, dial+" holding nothing in flight", func() bool { return upstream(t, dial).InFlight == 0 })
	}
}

// TestEarlyAnswerKeepsHTTP2Connection: an answer given before the body is
// read closes an HTTP/1 connection (the rest of the body is never read),
// but on HTTP/2 only the request's stream ends: a Connection: close there
// made Go's server send GOAWAY, ending the client's other streams too.
func TestEarlyAnswerKeepsHTTP2Connection(t *testing.T) {
	fleet := startFleet(t, 1, 20, kvsim.Config{})
	startCaddy(t, strings.Replace(caddyfile(fleet, "max_body 1KiB", "", ""),
		"grace_period 1ns", "grace_period 1ns\n\tservers {\n\t\tprotocols h1 h2c\n\t}", 1))

	var protocols http.Protocols
	protocols.SetUnencryptedHTTP2(true)
	client := &http.Client{Transport: &http.Transport{Protocols: &protocols}, Timeout: 30 * time.Second}
	defer client.CloseIdleConnections()
	send := func(body string) (status int, reused bool) {
		t.Helper()
		req, _ := http.NewRequest("POST", routerURL+"/v1/completions", strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		req = req.WithContext(httptrace.WithClientTrace(req.Context(), &httptrace.ClientTrace{
			GotConn: func(info httptrace.GotConnInfo) { reused = info.Reused },
		}))
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.ProtoMajor != 2 {
			t.Fatalf("%s, want HTTP/2", resp.Proto)
		}
		return resp.StatusCode, reused
	}
	ok := fmt.Sprintf(`{"model":%q,"prompt":"hi","max_tokens":2}`, kvsim.DefaultModel)
	if status, _ := send(ok); status != http.StatusOK {
		t.Fatalf("status %d", status)
	}
	if status, reused := send(fmt.Sprintf(`{"model":%q,"prompt":%q}`, kvsim.DefaultModel, strings.Repeat("x", 4096))); status != http.StatusRequestEntityTooLarge || !reused {
		t.Fatalf("over max_body: status %d on a reused connection %v", status, reused)
	}
	if status, reused := send(ok); status != http.StatusOK || !reused {
		t.Fatalf("after the 413: status %d, reused connection %v; want the same connection", status, reused)
	}
}

// TestStreamedTextArrivesAsSent: an engine's streamed tokens reach the
// client byte for byte through Caddy's proxy, which reads every piece of
// the stream into one buffer: plain tokens and tokens with escapes (a
// newline, a quote, a unicode escape) in turn, one event a flush and
// several in one. (The recorder used to decode an escaped token into the
// proxy's buffer where the previous plain one lay, and the client got a
// raw newline that broke the event.)
func TestStreamedTextArrivesAsSent(t *testing.T) {
	texts := []string{`Hello`, `\n`, ` world`, `\"quoted\"`, `caf\u00e9`, `\t`, `end`}
	var events []string
	for i := range 40 {
		events = append(events, `data: {"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"`+
			texts[i%len(texts)]+`"},"logprobs":null,"finish_reason":null}]}`+"\n\n")
	}
	events = append(events, "data: [DONE]\n\n")
	want := strings.Join(events, "")
	startScriptedCaddy(t, 1, func(w http.ResponseWriter, r *http.Request) {
		io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		w.WriteHeader(http.StatusOK)
		for i, e := range events {
			io.WriteString(w, e)
			if i%3 != 1 { // now and then two events in one flush
				w.(http.Flusher).Flush()
			}
		}
	})
	for range 3 {
		c := postRaw(t, "/v1/chat/completions", []byte(`{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":50,"stream":true}`))
		if c.status != 200 || c.body != want {
			t.Fatalf("status %d, the client got\n%s\nwant\n%s", c.status, c.body, want)
		}
	}
}
