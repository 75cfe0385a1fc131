package integration

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/llmaffinity/caddy-llm-affinity/caddyllm"
)

// caddyProc is a Caddy process running a config file.
type caddyProc struct {
	admin string // http://localhost:port
	log   string // its log file
}

// runCaddy runs bin with the Caddyfile config until the test ends, and
// waits until its admin API answers at adminAddr.
func runCaddy(t *testing.T, bin, name, config, adminAddr string) *caddyProc {
	t.Helper()
	dir := t.TempDir()
	file := filepath.Join(dir, name+".Caddyfile")
	if err := os.WriteFile(file, []byte(config), 0o644); err != nil {
		t.Fatal(err)
	}
	p := &caddyProc{admin: "http://" + adminAddr, log: filepath.Join(dir, "caddy.log")}
	logFile, err := os.Create(p.log)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "run", "--config", file)
	cmd.Stdout, cmd.Stderr = logFile, logFile
	cmd.Env = append(os.Environ(), "XDG_DATA_HOME="+dir, "XDG_CONFIG_HOME="+dir, "HOME="+dir)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Signal(os.Interrupt)
		done := make(chan struct{})
		go func() { cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			cmd.Process.Kill()
			<-done
		}
		logFile.Close()
		if t.Failed() {
			log, _ := os.ReadFile(p.log)
			t.Logf("%s's log:\n%s", name, log)
		}
	})
	eventually(t, 60*time.Second, name+"'s admin API answering", func() bool {
		resp, err := http.Get(p.admin + "/llm_affinity/upstreams")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == 200
	})
	return p
}

// quickstartWithStatus runs caddyfile-examples/quickstart.Caddyfile, as
// the README does, with its ports moved to free ones. It returns the
// process, the router's URL, the status page's site and the replicas'
// dial addresses.
func quickstartWithStatus(t *testing.T) (proc *caddyProc, routerURL, statusURL string, dials []string) {
	t.Helper()
	raw, err := os.ReadFile("../caddyfile-examples/quickstart.Caddyfile")
	if err != nil {
		t.Fatal(err)
	}
	config := string(raw)
	adminAddr := fmt.Sprintf("localhost:%d", freePort(t))
	site := freePort(t)
	replace := func(old, new string, n int) {
		if strings.Count(config, old) != n {
			t.Fatalf("the quickstart has %q %d times, want %d", old, strings.Count(config, old), n)
		}
		config = strings.ReplaceAll(config, old, new)
	}
	replace("admin localhost:2019", "admin "+adminAddr, 1)
	replace(":8080 {", fmt.Sprintf(":%d {", site), 1)
	status := freePort(t)
	replace("localhost:2020", fmt.Sprintf("localhost:%d", status), 2) // the comment and the site
	for i := 1; i <= 4; i++ {
		port := freePort(t)
		replace(fmt.Sprintf(":900%d", i), fmt.Sprintf(":%d", port), 2) // the upstream and the replica's site
		dials = append(dials, fmt.Sprintf("127.0.0.1:%d", port))
	}
	proc = runCaddy(t, buildCaddy(t), "quickstart", config, adminAddr)
	routerURL = fmt.Sprintf("http://127.0.0.1:%d", site)
	statusURL = fmt.Sprintf("http://localhost:%d/llm_affinity/", status)
	// The admin API starts before the sites.
	for _, u := range append([]string{routerURL + "/v1/models"}, dials...) {
		if !strings.HasPrefix(u, "http") {
			u = "http://" + u + "/health"
		}
		eventually(t, 30*time.Second, u+" answering", func() bool {
			resp, err := http.Get(u)
			if err != nil {
				return false
			}
			resp.Body.Close()
			return resp.StatusCode == 200
		})
	}
	return proc, routerURL, statusURL, dials
}

// metricFamilies fetches and parses a Prometheus text exposition.
func metricFamilies(t *testing.T, url string) map[string]*dto.MetricFamily {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	parser := expfmt.NewTextParser(model.UTF8Validation)
	mfs, err := parser.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatalf("parsing %s: %v", url, err)
	}
	return mfs
}

// counterValue sums the values of name's counter series whose label label
// has value.
func counterValue(mfs map[string]*dto.MetricFamily, name, label, value string) float64 {
	var n float64
	for _, m := range mfs[name].GetMetric() {
		for _, l := range m.GetLabel() {
			if l.GetName() == label && l.GetValue() == value {
				n += m.GetCounter().GetValue()
			}
		}
	}
	return n
}

// gaugeOf is the value of name's only series, 0 when it has none.
func gaugeOf(mfs map[string]*dto.MetricFamily, name string) float64 {
	for _, m := range mfs[name].GetMetric() {
		return m.GetGauge().GetValue()
	}
	return 0
}

// histogramCount sums the sample counts of name's series whose label
// label has value (any series when label is empty).
func histogramCount(mfs map[string]*dto.MetricFamily, name, label, value string) uint64 {
	var n uint64
	for _, m := range mfs[name].GetMetric() {
		for _, l := range m.GetLabel() {
			if label == "" || l.GetName() == label && l.GetValue() == value {
				n += m.GetHistogram().GetSampleCount()
				break
			}
		}
	}
	return n
}

// sendChat posts a chat request to the router and returns the upstream
// its explanation header names.
func sendChat(t *testing.T, url string, body map[string]any) string {
	t.Helper()
	raw, _ := json.Marshal(body)
	resp, err := http.Post(url+"/v1/chat/completions", "application/json", bytes.NewReader(raw))
	if err != nil {
		t.Error(err)
		return ""
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 {
		t.Errorf("status %d: %s", resp.StatusCode, b)
		return ""
	}
	_, rest, _ := strings.Cut(resp.Header.Get("X-LLM-Affinity"), "upstream=")
	up, _, _ := strings.Cut(rest, ";")
	return up
}

// TestQuickstartMetrics runs the quickstart with the README's "Try it"
// conversation, then spreads requests until every replica has served some:
// the admin API's /metrics then shows the latency histograms with counts
// for each upstream, and Caddy's own HTTP metrics (the metrics option).
// Every metric the Grafana dashboard queries is exported, by the router or
// by the kvsim engines.
func TestQuickstartMetrics(t *testing.T) {
	proc, url, statusURL, dials := quickstartWithStatus(t)
	// The replicas are the quickstart's own sites, which listen only once
	// its config runs: the scraper starts then, and never finds them
	// refusing.
	eventually(t, 30*time.Second, "every replica scraped", func() bool {
		var ups []caddyllm.UpstreamSnapshot
		if code, body := do(t, "GET", proc.admin+"/llm_affinity/upstreams", nil); code != 200 || json.Unmarshal([]byte(body), &ups) != nil {
			return false
		}
		scraped := 0
		for _, u := range ups {
			if u.Engine != nil && u.Engine.Errors > 0 {
				t.Fatalf("%s: %d scrape errors at startup (%s)", u.Dial, u.Engine.Errors, u.Engine.LastError)
			}
			if u.Engine != nil && u.Engine.KVCapacity > 0 {
				scraped++
			}
		}
		return scraped == len(dials)
	})
	if code, body := do(t, "GET", statusURL, map[string]string{"Sec-Fetch-Mode": "navigate"}); code != 200 || !strings.Contains(body, "llm_affinity") {
		t.Fatalf("the quickstart's status page: %d %.200s", code, body)
	}
	const model = "meta-llama/Llama-3.1-8B-Instruct"
	sys := strings.Repeat("You are a helpful assistant for the ACME support desk. ", 150)
	turn1 := []msg{{"system", sys}, {"user", "My order is late."}}
	sendChat(t, url, map[string]any{"model": model, "max_tokens": 16, "messages": turn1})
	sendChat(t, url, map[string]any{"model": model, "max_tokens": 16, "stream": true,
		"messages": append(turn1, msg{"assistant", "Sorry to hear that."}, msg{"user", "Order 1234."})})

	// Concurrent cold requests spread: each one's prefill makes the
	// replica it lands on costlier for the next.
	seen := map[string]bool{}
	for round := 0; len(seen) < len(dials) && round < 20 && !t.Failed(); round++ {
		var mu sync.Mutex
		var wg sync.WaitGroup
		for i := range 8 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				up := sendChat(t, url, map[string]any{"model": model, "max_tokens": 8, "stream": true,
					"messages": []msg{{"user", text(fmt.Sprintf("spread-%d-%d", round, i), 4000)}}})
				mu.Lock()
				seen[up] = true
				mu.Unlock()
			}()
		}
		wg.Wait()
	}
	for _, d := range dials {
		if !seen[d] {
			t.Fatalf("no request reached %s (reached: %v)", d, seen)
		}
	}

	// The request duration is observed once the handler returns, just
	// after the client has read the last byte.
	var mfs map[string]*dto.MetricFamily
	eventually(t, 30*time.Second, "every upstream has latency counts", func() bool {
		mfs = metricFamilies(t, proc.admin+"/metrics")
		for _, d := range dials {
			for _, name := range []string{
				"caddy_llm_affinity_time_to_first_token_seconds",
				"caddy_llm_affinity_request_duration_seconds",
				"caddy_llm_affinity_ttft_estimate_error_seconds",
				"caddy_llm_affinity_prefix_match_ratio",
			} {
				if histogramCount(mfs, name, "upstream", d) == 0 {
					return false
				}
			}
		}
		return true
	})
	if n := histogramCount(mfs, "caddy_llm_affinity_queue_wait_seconds", "", ""); n < 10 {
		t.Errorf("queue_wait_seconds counts %d routing attempts, want at least 10", n)
	}
	if n := histogramCount(mfs, "caddy_http_request_duration_seconds", "", ""); n == 0 {
		t.Errorf("Caddy's own caddy_http_request_duration_seconds has no counts: is the metrics option on?")
	}

	// The dashboard's queries name only exported metrics.
	engine := metricFamilies(t, "http://"+dials[0]+"/metrics")
	for _, name := range dashboardMetrics(t) {
		from := mfs
		switch {
		case strings.HasPrefix(name, "vllm:"):
			from = engine
		case strings.HasPrefix(name, "caddy_llm_affinity_sync_"):
			continue // only with the sync option: TestClusterSharesOneView checks them
		}
		if !exported(from, name) {
			t.Errorf("the dashboard queries %s, which is not exported", name)
		}
	}
}

// dashboardMetrics returns the metric names the Grafana dashboard's
// PromQL expressions query.
func dashboardMetrics(t *testing.T) []string {
	t.Helper()
	raw, err := os.ReadFile("../dashboards/llm-affinity.json")
	if err != nil {
		t.Fatal(err)
	}
	var dash struct {
		Panels []struct {
			Targets []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
	}
	if err := json.Unmarshal(raw, &dash); err != nil {
		t.Fatal(err)
	}
	// Metric names are identifiers followed by a selector, a range or
	// the end of an argument; function names are followed by "(", label
	// names by an operator, and the keywords of by() are skipped.
	ident := regexp.MustCompile(`[a-zA-Z_:][a-zA-Z0-9_:]*`)
	keywords := map[string]bool{"by": true, "without": true, "on": true, "ignoring": true, "le": true,
		"sum": true, "rate": true, "histogram_quantile": true, "and": true, "or": true, "unless": true}
	var names []string
	exprs := 0
	for _, p := range dash.Panels {
		for _, tg := range p.Targets {
			exprs++
			// Drop label matchers and grouping lists: what is left names
			// functions and metrics.
			e := regexp.MustCompile(`\{[^}]*\}|\[[^\]]*\]|by \([^)]*\)`).ReplaceAllString(tg.Expr, " ")
			for _, loc := range ident.FindAllStringIndex(e, -1) {
				id := e[loc[0]:loc[1]]
				if keywords[id] || strings.HasPrefix(strings.TrimSpace(e[loc[1]:]), "(") {
					continue
				}
				if !slices.Contains(names, id) {
					names = append(names, id)
				}
			}
		}
	}
	if exprs < 15 || len(names) < 15 {
		t.Fatalf("the dashboard has %d expressions naming %d metrics: the parsing is broken", exprs, len(names))
	}
	return names
}

// exported reports whether a queried series name belongs to a family of
// mfs (a histogram's _bucket, _count and _sum belong to it).
func exported(mfs map[string]*dto.MetricFamily, name string) bool {
	if _, ok := mfs[name]; ok {
		return true
	}
	for _, suffix := range []string{"_bucket", "_count", "_sum"} {
		if base, ok := strings.CutSuffix(name, suffix); ok {
			if mf, ok := mfs[base]; ok && mf.GetType() == dto.MetricType_HISTOGRAM {
				return true
			}
		}
	}
	return false
}
