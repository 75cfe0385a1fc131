package scrape

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

func BenchmarkParseEngineMetrics(b *testing.B) {
	body := kvsimExposition(b)
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	cpu0 := cpuTime(b)
	for b.Loop() {
		if _, err := parseEngineMetrics(bytes.NewReader(body), time.Now()); err != nil {
			b.Fatal(err)
		}
	}
	// CPU time per parse is steadier than wall time on a busy machine.
	b.ReportMetric(float64((cpuTime(b)-cpu0).Nanoseconds())/float64(b.N), "cpu-ns/op")
}

// cpuTime returns the process's user plus system CPU time.
func cpuTime(tb testing.TB) time.Duration {
	user, sys := cpuTimes(tb)
	return user + sys
}

// cpuTimes returns the process's user and system CPU time.
func cpuTimes(tb testing.TB) (user, sys time.Duration) {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		tb.Skip("getrusage:", err)
	}
	return time.Duration(ru.Utime.Nano()), time.Duration(ru.Stime.Nano())
}

// helperEnvCount, in the environment of the upstreams helper process,
// is the number of replicas it starts.
const helperEnvCount = "CADDYLLM_SCRAPE_HELPER_COUNT"

// TestScrapeHelperUpstreams is not a test: run by BenchmarkScrape64 in a
// child process, it starts $CADDYLLM_SCRAPE_HELPER_COUNT listeners that
// serve what one kvsim replica answers to each path and query (fetched
// once, then replayed), prints "ADDR host:port" for each, and exits when
// its stdin closes. Serving from another process keeps the upstreams'
// CPU out of the benchmark's measurement; replaying keeps it small, as
// it would be on a machine of their own.
func TestScrapeHelperUpstreams(t *testing.T) {
	count := os.Getenv(helperEnvCount)
	if count == "" {
		t.Skip("helper process for BenchmarkScrape64")
	}
	n, err := strconv.Atoi(count)
	if err != nil {
		t.Fatal(err)
	}
	replica := startKvsim(t)
	var mu sync.Mutex
	answers := map[string][]byte{}
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		body, ok := answers[r.URL.RequestURI()]
		if !ok {
			body = getBody(t, replica+r.URL.RequestURI())
			answers[r.URL.RequestURI()] = body
		}
		mu.Unlock()
		if r.URL.Path == defaultMetricsPath {
			w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
		}
		_, _ = w.Write(body)
	})
	for range n {
		srv := httptest.NewServer(handler)
		defer srv.Close()
		fmt.Println("ADDR", hostOf(srv))
	}
	_, _ = io.Copy(io.Discard, os.Stdin)
}

// startUpstreams starts n replayed kvsim replicas in a child process and
// returns their dial addresses.
func startUpstreams(b *testing.B, n int) []string {
	b.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestScrapeHelperUpstreams$", "-test.count=1")
	cmd.Env = append(os.Environ(), helperEnvCount+"="+strconv.Itoa(n))
	stdin, err := cmd.StdinPipe()
	if err != nil {
		b.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		b.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		_ = stdin.Close() // the helper exits when its stdin closes
		done := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
	})
	var dials []string
	sc := bufio.NewScanner(stdout)
	for len(dials) < n && sc.Scan() {
		if addr, ok := strings.CutPrefix(sc.Text(), "ADDR "); ok {
			dials = append(dials, addr)
		}
	}
	if len(dials) != n {
		b.Fatalf("helper started %d of %d upstreams: %v", len(dials), n, sc.Err())
	}
	go func() { _, _ = io.Copy(io.Discard, stdout) }()
	return dials
}

// BenchmarkScrape64 measures the CPU the scraper costs the router: 64
// upstreams answering as kvsim does (from a child process, so their CPU
// is not counted), scraped for 3 s every 100 ms (10× the default
// rate) and, for comparison, every second (the default). Reported as a
// percentage of one core, of which system time, and CPU per scrape; and
// every 100 ms again with the whole exposition asked for. Run with
// -benchtime=1x.
func BenchmarkScrape64(b *testing.B) {
	const upstreams = 64
	dials := startUpstreams(b, upstreams)
	whole := getBody(b, "http://"+dials[0]+defaultMetricsPath)
	asked := getBody(b, "http://"+dials[0]+metricsQuery{modeNamedBelow, true}.path(defaultMetricsPath))
	for _, interval := range []time.Duration{100 * time.Millisecond, time.Second} {
		b.Run("every_"+interval.String(), func(b *testing.B) {
			benchmarkScrape(b, dials, interval, 3*time.Second, false)
			b.ReportMetric(float64(len(whole)), "exposition_bytes")
			b.ReportMetric(float64(len(asked)), "scraped_bytes")
		})
	}
	// Engines that ignore the name[] query send their whole exposition.
	b.Run("every_100ms_whole_exposition", func(b *testing.B) {
		benchmarkScrape(b, dials, 100*time.Millisecond, 3*time.Second, true)
		b.ReportMetric(float64(len(whole)), "scraped_bytes")
	})
}

// benchmarkScrape scrapes dials every interval for window, b.N times,
// and reports the CPU it took.
// With whole, it asks for the whole exposition, as from engines that
// ignore the name[] query.
func benchmarkScrape(b *testing.B, dials []string, interval, window time.Duration, whole bool) {
	var pct, sysPct, perScrape, rate, failures float64
	for range b.N {
		ctx, cancel := context.WithCancel(context.Background())
		s := New(Config{Interval: interval})
		s.SetTargets(dials)
		if whole {
			for _, t := range s.targets {
				t.mode, t.probeDue = modeWhole, time.Now().Add(time.Hour) // and no re-probe
			}
		}
		s.Start(ctx)
		// Warm up: connections open, every target scraped once.
		deadline := time.Now().Add(5 * time.Second)
		for time.Now().Before(deadline) && slices.ContainsFunc(dials, func(d string) bool { return s.Seq(d) == 0 }) {
			time.Sleep(5 * time.Millisecond)
		}
		seq0 := scrapeTotal(s, dials)
		user0, sys0 := cpuTimes(b)
		wall0 := time.Now()
		time.Sleep(window)
		user1, sys1 := cpuTimes(b)
		wall := time.Since(wall0)
		scrapes := scrapeTotal(s, dials) - seq0
		cancel()
		<-s.Stopped()
		// A timeout now and then on a busy machine is fine; mostly
		// failing scrapes would make the figure meaningless.
		for _, st := range s.Statuses() {
			failures += float64(st.Errors)
			if st.Errors > st.Scrapes/10 {
				b.Fatalf("%s: %d scrape errors in %d, last %s", st.Dial, st.Errors, st.Scrapes, st.LastError)
			}
		}
		if whole {
			for _, t := range s.targets {
				if t.mode != modeWhole {
					b.Fatalf("%s left the whole exposition for mode %d", t.dial, t.mode)
				}
			}
		}
		cpu, sys := (user1-user0)+(sys1-sys0), sys1-sys0
		pct += 100 * cpu.Seconds() / wall.Seconds()
		sysPct += 100 * sys.Seconds() / wall.Seconds()
		perScrape += float64(cpu.Microseconds()) / float64(max(1, scrapes))
		rate += float64(scrapes) / wall.Seconds()
	}
	n := float64(b.N)
	b.ReportMetric(pct/n, "%core")
	b.ReportMetric(sysPct/n, "%core-sys")
	b.ReportMetric(perScrape/n, "cpu-µs/scrape")
	b.ReportMetric(rate/n, "scrapes/s")
	b.ReportMetric(failures/n, "failed_scrapes")
}

// scrapeTotal sums the successful scrapes of dials.
func scrapeTotal(s *Scraper, dials []string) uint64 {
	var n uint64
	for _, d := range dials {
		n += s.Seq(d)
	}
	return n
}
