// Command trivial-upstream is a stand-in for an inference engine that costs nothing: it answers
// every POST at once with a small OpenAI-style completion (and GET /health and /v1/models), so
// that a benchmark through a proxy in front of it measures the proxy. scripts/overhead.sh
// uses it.
//
//	go run ./scripts/trivial-upstream -addr 127.0.0.1:18091,127.0.0.1:18092
package main

import (
	"errors"
	"flag"
	"io"
	"log"
	"net"
	"net/http"
	"strings"
	"sync"
)

const completion = `{"id":"cmpl-trivial","object":"text_completion","created":1700000000,` +
	`"model":"meta-llama/Llama-3.1-8B-Instruct","choices":[{"index":0,"text":" ok","logprobs":null,` +
	`"finish_reason":"length"}],"usage":{"prompt_tokens":64,"completion_tokens":16,"total_tokens":80}}`

const models = `{"object":"list","data":[{"id":"meta-llama/Llama-3.1-8B-Instruct","object":"model",` +
	`"owned_by":"trivial","root":"meta-llama/Llama-3.1-8B-Instruct"}]}`

func main() {
	addrs := flag.String("addr", "127.0.0.1:18091", "comma-separated `addresses` to listen on, one replica each")
	flag.Parse()

	handler := func(replica string) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			// Read the request like an engine would, so the proxy's body
			// handling is part of what is measured.
			_, _ = io.Copy(io.Discard, r.Body)
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
			w.Header().Set("Content-Type", "application/json")
			w.Header().Set("X-Replica", replica)
			_, _ = io.WriteString(w, completion)
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
