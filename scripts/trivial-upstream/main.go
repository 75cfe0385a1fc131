// Command trivial-upstream is a stand-in for an inference engine that costs nothing: it answers
// every POST at once with a small OpenAI-style completion (and GET /health and /v1/models), so
// that a benchmark through a proxy in front of it measures the proxy. scripts/overhead.sh
// uses it. A request with "stream":true gets the completion as vLLM streams it: -chunks
// events of one token each, flushed one by one, a last one with the finish reason, the usage
// (vLLM sends it with stream_options.include_usage; here always) and [DONE].
//
//	go run ./scripts/trivial-upstream -addr 127.0.0.1:18091,127.0.0.1:18092 -chunks 64
package main

import (
	"bytes"
	"errors"
	"flag"
	"io"
	"log"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
)

const completion = `{"id":"cmpl-trivial","object":"text_completion","created":1700000000,` +
	`"model":"meta-llama/Llama-3.1-8B-Instruct","choices":[{"index":0,"text":" ok","logprobs":null,` +
	`"finish_reason":"length"}],"usage":{"prompt_tokens":64,"completion_tokens":16,"total_tokens":80}}`

const models = `{"object":"list","data":[{"id":"meta-llama/Llama-3.1-8B-Instruct","object":"model",` +
	`"owned_by":"trivial","root":"meta-llama/Llama-3.1-8B-Instruct"}]}`

// The events of a streamed completion: a token, the last one, the usage.
const (
	tokenEvent = `data: {"id":"cmpl-trivial","object":"text_completion","created":1700000000,` +
		`"model":"meta-llama/Llama-3.1-8B-Instruct","choices":[{"index":0,"text":" ok","logprobs":null,` +
		`"finish_reason":null,"stop_reason":null}],"usage":null}` + "\n\n"
	lastEvent = `data: {"id":"cmpl-trivial","object":"text_completion","created":1700000000,` +
		`"model":"meta-llama/Llama-3.1-8B-Instruct","choices":[{"index":0,"text":"","logprobs":null,` +
		`"finish_reason":"length","stop_reason":null}],"usage":null}` + "\n\n"
	usageEvent = `data: {"id":"cmpl-trivial","object":"text_completion","created":1700000000,` +
		`"model":"meta-llama/Llama-3.1-8B-Instruct","choices":[],"usage":{"prompt_tokens":64,` +
		`"completion_tokens":%d,"total_tokens":%d}}` + "\n\n"
)

func main() {
	addrs := flag.String("addr", "127.0.0.1:18091", "comma-separated `addresses` to listen on, one replica each")
	chunks := flag.Int("chunks", 16, "tokens of a streamed completion, an event each")
	flag.Parse()
	usage := strings.Replace(strings.Replace(usageEvent, "%d", strconv.Itoa(*chunks), 1), "%d", strconv.Itoa(64+*chunks), 1)

	handler := func(replica string) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			// Read the request like an engine would, so the proxy's body
			// handling is part of what is measured.
			body, _ := io.ReadAll(r.Body)
			switch {
			case r.URL.Path == "/health":
				return
			case r.URL.Path == "/v1/models":
				w.Header().Set("Content-Type", "application/json")
				_, _ = io.WriteString(w, models)
				return
			case r.Method != http.MethodPost:
				// No /metrics: an engine the router cannot scrape.
				http.NotFound(w, r)
				return
			}
			w.Header().Set("X-Replica", replica)
			if !bytes.Contains(body, []byte(`"stream":true`)) {
				w.Header().Set("Content-Type", "application/json")
				_, _ = io.WriteString(w, completion)
				return
			}
			w.Header().Set("Content-Type", "text/event-stream; charset=utf-8")
			flusher, _ := w.(http.Flusher)
			for range *chunks {
				if _, err := io.WriteString(w, tokenEvent); err != nil {
					return
				}
				flusher.Flush()
			}
			_, _ = io.WriteString(w, lastEvent)
			_, _ = io.WriteString(w, usage)
			_, _ = io.WriteString(w, "data: [DONE]\n\n")
		})
	}

	var wg sync.WaitGroup
	for _, addr := range strings.Split(*addrs, ",") {
		ln, err := net.Listen("tcp", strings.TrimSpace(addr))
		if err != nil {
			log.Fatal(err)
		}
		log.Printf("trivial upstream on %s", ln.Addr())
		wg.Add(1)
		go func() {
			defer wg.Done()
			err := http.Serve(ln, handler(ln.Addr().String()))
			if err != nil && !errors.Is(err, http.ErrServerClosed) {
				log.Fatal(err)
			}
		}()
	}
	wg.Wait()
}
