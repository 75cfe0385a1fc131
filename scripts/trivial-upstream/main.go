// Command trivial-upstream is a stand-in for an inference engine that costs nothing: it answers
// every POST at once with a small OpenAI-style completion (and GET /health and /v1/models), so
// that a benchmark through a proxy in front of it measures the proxy. scripts/overhead.sh
// uses it. A request with "stream":true gets the completion as vLLM streams it: -chunks
// events of one token each, flushed one by one, a last one with the finish reason, the usage
// (vLLM sends it with stream_options.include_usage; here always) and [DONE]. A POST to
// /v1/responses gets a Responses API response instead, with an id of its own; streamed, as
// vLLM streams one (its fields in alphabetical order): response.created and .in_progress, the
// message's item and content part, -chunks output_text.delta events, the text, part and item
// done, and response.completed with the usage. -token-interval paces the token events as an
// engine generating does, so that a proxy passes each on in a write of its own; without it they
// come as fast as they are written, and a proxy reads several at once.
//
//	go run ./scripts/trivial-upstream -addr 127.0.0.1:18091,127.0.0.1:18092 -chunks 64
//	go run ./scripts/trivial-upstream -chunks 64 -token-interval 2ms
package main

import (
	"bytes"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
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

// The Responses API's events, their ids and numbers to fill in. A response's fields are in
// alphabetical order, as vLLM (and kvsim) write them. Its answers stop at max_output_tokens, as
// overhead.sh asks (16, or the streamed tokens), so they are "incomplete", as kvsim has them.
const (
	responseInProgress = `{"background":false,"created_at":1700000000,"error":null,"id":"%[1]s",` +
		`"incomplete_details":null,"max_output_tokens":%[2]d,"model":"meta-llama/Llama-3.1-8B-Instruct",` +
		`"object":"response","output":[],"parallel_tool_calls":true,"status":"in_progress","tool_choice":"auto",` +
		`"tools":[],"usage":null}`
	responseDone = `{"background":false,"created_at":1700000000,"error":null,"id":"%[1]s",` +
		`"incomplete_details":{"reason":"max_output_tokens"},"max_output_tokens":%[4]d,` +
		`"model":"meta-llama/Llama-3.1-8B-Instruct","object":"response","output":[{"content":[{"annotations":[],` +
		`"text":"%[3]s","type":"output_text"}],"id":"%[2]s","role":"assistant","status":"completed","type":"message"}],` +
		`"parallel_tool_calls":true,"status":"incomplete","tool_choice":"auto","tools":[],"usage":{"input_tokens":64,` +
		`"input_tokens_details":{"cached_tokens":0},"output_tokens":%[4]d,` +
		`"output_tokens_details":{"reasoning_tokens":0},"total_tokens":%[5]d}}`
)

// responseEvents streams a Responses API answer of chunks one-token deltas, each event flushed
// on its own, interval apart.
func responseEvents(w io.Writer, flush func(), n uint64, chunks int, interval time.Duration) {
	id, msg := fmt.Sprintf("resp_trivial%016x", n), fmt.Sprintf("msg_trivial%016x", n)
	text := strings.Repeat(" ok", chunks)
	seq := 0
	// event writes an event: fields are those before sequence_number, after those between it
	// and type.
	event := func(typ, fields string, after ...string) bool {
		_, err := fmt.Fprintf(w, "event: %s\ndata: {%s\"sequence_number\":%d,%s\"type\":\"%s\"}\n\n", typ, fields, seq, strings.Join(after, ""), typ)
		seq++
		flush()
		return err == nil
	}
	at := fmt.Sprintf(`"item_id":"%s","logprobs":[],"output_index":0,`, msg)
	if !event("response.created", `"response":`+fmt.Sprintf(responseInProgress, id, chunks)+`,`) ||
		!event("response.in_progress", `"response":`+fmt.Sprintf(responseInProgress, id, chunks)+`,`) ||
		!event("response.output_item.added", fmt.Sprintf(`"item":{"content":[],"id":"%s","role":"assistant","status":"in_progress","type":"message"},"output_index":0,`, msg)) ||
		!event("response.content_part.added", fmt.Sprintf(`"content_index":0,"item_id":"%s","output_index":0,"part":{"annotations":[],"text":"","type":"output_text"},`, msg)) {
		return
	}
	for range chunks {
		pace(interval)
		if !event("response.output_text.delta", `"content_index":0,"delta":" ok",`+at) {
			return
		}
	}
	_ = event("response.output_text.done", `"content_index":0,`+at, `"text":"`+text+`",`) &&
		event("response.content_part.done", fmt.Sprintf(`"content_index":0,"item_id":"%s","output_index":0,"part":{"annotations":[],"text":"%s","type":"output_text"},`, msg, text)) &&
		event("response.output_item.done", fmt.Sprintf(`"item":{"content":[{"annotations":[],"text":"%s","type":"output_text"}],"id":"%s","role":"assistant","status":"completed","type":"message"},"output_index":0,`, text, msg)) &&
		event("response.completed", `"response":`+fmt.Sprintf(responseDone, id, msg, text, chunks, 64+chunks)+`,`)
}

// pace waits interval, the time an engine takes to generate a token (none for 0).
func pace(interval time.Duration) {
	if interval > 0 {
		time.Sleep(interval)
	}
}

func main() {
	addrs := flag.String("addr", "127.0.0.1:18091", "comma-separated `addresses` to listen on, one replica each")
	chunks := flag.Int("chunks", 16, "tokens of a streamed completion, an event each")
	interval := flag.Duration("token-interval", 0, "time between a stream's token events (0: none)")
	flag.Parse()
	var responses atomic.Uint64 // numbers the Responses API's ids
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
			streamed := bytes.Contains(body, []byte(`"stream":true`))
			if strings.HasSuffix(r.URL.Path, "/responses") {
				n := responses.Add(1)
				if !streamed {
					w.Header().Set("Content-Type", "application/json")
					fmt.Fprintf(w, responseDone, fmt.Sprintf("resp_trivial%016x", n), fmt.Sprintf("msg_trivial%016x", n), " ok", 16, 80)
					return
				}
				w.Header().Set("Content-Type", "text/event-stream")
				flusher, _ := w.(http.Flusher)
				responseEvents(w, flusher.Flush, n, *chunks, *interval)
				return
			}
			if !streamed {
				w.Header().Set("Content-Type", "application/json")
				_, _ = io.WriteString(w, completion)
				return
			}
			w.Header().Set("Content-Type", "text/event-stream; charset=utf-8")
			flusher, _ := w.(http.Flusher)
			for range *chunks {
				pace(*interval)
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
