// Command loadgen is a small closed-loop HTTP load generator: a fixed number of workers each
// send a request, wait for the whole response, and send the next, for a fixed duration. It
// prints one line of key=value results (requests per second, errors, latency percentiles).
// scripts/overhead.sh uses it so that the benchmark needs nothing but Go.
//
// Every {{seq}} in the body is replaced by the request's sequence number, so that requests
// can share a prefix and differ after it, like chats with one system prompt.
//
//	go run ./scripts/loadgen -url http://127.0.0.1:18081/v1/completions -body req.json -c 32 -d 10s
package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log"
	"net/http"
	"os"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
)

type result struct {
	latencies []time.Duration
	errors    int
}

func main() {
	url := flag.String("url", "", "`URL` to send requests to (required)")
	method := flag.String("method", http.MethodPost, "HTTP `method`")
	bodyFile := flag.String("body", "", "request body `file` (empty: no body)")
	contentType := flag.String("content-type", "application/json", "Content-Type of the body")
	concurrency := flag.Int("c", 32, "concurrent workers (connections)")
	duration := flag.Duration("d", 10*time.Second, "measured duration")
	warmup := flag.Duration("warmup", time.Second, "unmeasured warm-up before the measured duration")
	timeout := flag.Duration("timeout", 10*time.Second, "per-request timeout")
	flag.Parse()
	if *url == "" || *concurrency < 1 || *duration <= 0 {
		flag.Usage()
		os.Exit(2)
	}
	var body []byte
	if *bodyFile != "" {
		var err error
		if body, err = os.ReadFile(*bodyFile); err != nil {
			log.Fatal(err)
		}
	}

	client := &http.Client{
		Timeout: *timeout,
		Transport: &http.Transport{
			MaxIdleConns:        *concurrency,
			MaxIdleConnsPerHost: *concurrency,
			DisableCompression:  true,
		},
	}

	placeholder := []byte("{{seq}}")
	vary := bytes.Contains(body, placeholder)
	var seq atomic.Int64
	send := func(ctx context.Context) error {
		b := body
		if vary {
			b = bytes.ReplaceAll(body, placeholder, strconv.AppendInt(nil, seq.Add(1), 10))
		}
		req, err := http.NewRequestWithContext(ctx, *method, *url, bytes.NewReader(b))
		if err != nil {
			return err
		}
		if body != nil {
			req.Header.Set("Content-Type", *contentType)
		}
		resp, err := client.Do(req)
		if err != nil {
			return err
		}
		_, err = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if err != nil {
			return err
		}
		if resp.StatusCode >= 300 {
			return fmt.Errorf("status %d", resp.StatusCode)
		}
		return nil
	}

	// Warm up: connections, caches, the proxy's first-request work.
	if *warmup > 0 {
		ctx, cancel := context.WithTimeout(context.Background(), *warmup)
		run(ctx, *concurrency, send, nil)
		cancel()
	}

	ctx, cancel := context.WithTimeout(context.Background(), *duration)
	defer cancel()
	results := make([]result, *concurrency)
	start := time.Now()
	run(ctx, *concurrency, send, results)
	elapsed := time.Since(start)

	var all []time.Duration
	errs := 0
	for _, r := range results {
		all = append(all, r.latencies...)
		errs += r.errors
	}
	slices.Sort(all)
	pct := func(p float64) time.Duration {
		if len(all) == 0 {
			return 0
		}
		return all[min(len(all)-1, int(p*float64(len(all))))]
	}
	fmt.Printf("rps=%.1f requests=%d errors=%d p50=%s p90=%s p99=%s concurrency=%d duration=%s\n",
		float64(len(all))/elapsed.Seconds(), len(all), errs,
		pct(0.50).Round(time.Microsecond), pct(0.90).Round(time.Microsecond), pct(0.99).Round(time.Microsecond),
		*concurrency, elapsed.Round(time.Millisecond))
}

// run keeps n workers sending until ctx ends. With results non-nil, worker i records the
// latency of each successful request, and counts failures, in results[i]; a request cut off
// by the end of the run counts as neither.
func run(ctx context.Context, n int, send func(context.Context) error, results []result) {
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil {
				t0 := time.Now()
				err := send(ctx)
				if results == nil {
					continue
				}
				switch {
				case err == nil:
					results[i].latencies = append(results[i].latencies, time.Since(t0))
				case ctx.Err() != nil && errors.Is(err, context.DeadlineExceeded):
					// cut off by the end of the run
				default:
					results[i].errors++
					if results[i].errors == 1 {
						log.Printf("worker %d: %v", i, err)
					}
				}
			}
		}()
	}
	wg.Wait()
}
