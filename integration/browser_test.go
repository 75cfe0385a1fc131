package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/chromedp/cdproto/cdp"
	"github.com/chromedp/cdproto/emulation"
	"github.com/chromedp/cdproto/page"
	"github.com/chromedp/chromedp"

	"github.com/llmaffinity/caddy-llm-affinity/fleetsync"
	"github.com/llmaffinity/caddy-llm-affinity/internal/natstest"
	"github.com/llmaffinity/caddy-llm-affinity/kvsim"
)

// ttftCell is the page's "estimated / observed" TTFT with both figures.
var ttftCell = regexp.MustCompile(`^[0-9.]+ m?s / [0-9.]+ m?s$`)

// inCI reports whether the CI environment variable is set, as CI systems
// set it: there, a missing browser fails the browser test.
func inCI() bool {
	v := strings.ToLower(os.Getenv("CI"))
	return v == "1" || v == "true"
}

// chromium finds Debian's chromium (or $CHROMIUM). Without one the test is
// skipped, except under CI, where .ci/run installs it and its absence is
// a failure.
func chromium(t *testing.T) string {
	t.Helper()
	for _, name := range []string{os.Getenv("CHROMIUM"), "/usr/bin/chromium", "chromium", "chromium-browser"} {
		if name == "" {
			continue
		}
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
	}
	if inCI() {
		t.Fatal("CI is set and no chromium is installed (.ci/run installs it with apt-get install -y chromium)")
	}
	t.Skip("no chromium: apt-get install -y chromium, or set CHROMIUM")
	return ""
}

// statusSite is the router's site in front of fleet with engine scraping,
// sync over natsURL and the status page.
func statusSite(fleet []*replica, natsURL string) string {
	return fmt.Sprintf(`handle /llm_affinity/* {
		llm_affinity_status
	}
	llm_affinity
	reverse_proxy %s {
		lb_policy llm_affinity {
			explain_header
			kv_capacity 131072
			scrape_interval 100ms
			sync %s {
				name browser-router
			}
		}
	}`, dials(fleet), natsURL)
}

// TestStatusPageInBrowser loads the status page in headless chromium
// against a router and a kvsim fleet that has served traffic: every
// upstream has a row with live numbers; clicking drain drains the upstream
// (the row's phase changes, and the admin API agrees); the same page
// served by the admin API undrains it, its request passing Caddy's
// default admin origin checks. With LLM_AFFINITY_SCREENSHOT=file.png it
// saves a screenshot of the page.
func TestStatusPageInBrowser(t *testing.T) {
	browser := chromium(t)
	fleet := startFleet(t, 3, 1, kvsim.Config{})
	ns := natstest.Start(t, -1)
	r := startObserved(t, "browser", "", statusSite(fleet, ns.ClientURL()))
	// A peer router, heard on the page's sync line.
	peer, err := fleetsync.New(fleetsync.Config{URLs: []string{ns.ClientURL()}, Name: "peer-router", Subject: fleetsync.DefaultSubject})
	if err != nil || peer.Start() != nil {
		t.Fatal(err)
	}
	t.Cleanup(peer.Close)

	// Traffic until every replica has served a request.
	seen := map[string]bool{}
	for round := 0; len(seen) < len(fleet) && round < 20 && !t.Failed(); round++ {
		var mu sync.Mutex
		var wg sync.WaitGroup
		for i := range 6 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				up := sendChat(t, r.site, map[string]any{"model": testModel, "max_tokens": 8, "stream": true,
					"messages": []msg{{"user", text(fmt.Sprintf("browser-%d-%d", round, i), 6000)}}})
				mu.Lock()
				seen[up] = true
				mu.Unlock()
			}()
		}
		wg.Wait()
	}
	for _, rep := range fleet {
		if !seen[rep.dial()] {
			t.Fatalf("no request reached %s", rep.dial())
		}
	}
	// Second turns of a few of them, served from the prefix cache, so
	// the page has hits and more points to show.
	for i := range 6 {
		first := msg{"user", text(fmt.Sprintf("browser-0-%d", i), 6000)}
		sendChat(t, r.site, map[string]any{"model": testModel, "max_tokens": 8, "stream": true,
			"messages": []msg{first, {"assistant", "Noted."}, {"user", "And then?"}}})
	}

	opts := []chromedp.ExecAllocatorOption{
		chromedp.ExecPath(browser), chromedp.Headless, chromedp.NoSandbox, chromedp.DisableGPU,
		chromedp.NoFirstRun, chromedp.NoDefaultBrowserCheck, chromedp.UserDataDir(t.TempDir()),
		chromedp.Flag("disable-quic", true), chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true), chromedp.Flag("disable-sync", true),
		chromedp.WindowSize(1400, 400),
	}
	actx, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
	defer cancelAlloc()
	ctx, cancel := chromedp.NewContext(actx)
	defer cancel()
	ctx, cancelTimeout := context.WithTimeout(ctx, 2*time.Minute)
	defer cancelTimeout()

	row := func(dial string) string { return fmt.Sprintf(`tr[data-dial=%q]`, dial) }
	// The page replaces its rows on every refresh, so nodes found by one
	// call may be gone by the next: read and click in one evaluation.
	js := func(expr string) string {
		t.Helper()
		s, err := chromedp.Run(ctx, chromedp.Evaluate[string](expr))
		if err != nil {
			t.Fatalf("evaluating %s: %v", expr, err)
		}
		return s
	}
	query := func(sel string) string { b, _ := json.Marshal(sel); return "document.querySelector(" + string(b) + ")" }
	cellText := func(dial, cell string) string {
		t.Helper()
		q := query(row(dial) + " td." + cell)
		return js(q + " ? " + q + ".textContent : \"\"")
	}
	click := func(sel string) {
		t.Helper()
		q := query(sel)
		if js(q+" ? ("+q+".click(), \"clicked\") : \"missing\"") != "clicked" {
			t.Fatalf("no %s to click", sel)
		}
	}
	// waitCell polls the page (it refreshes itself every 2 s) until the
	// cell's text satisfies ok.
	waitCell := func(dial, cell, what string, ok func(string) bool) {
		t.Helper()
		eventually(t, 60*time.Second, dial+" "+what+" on the page", func() bool { return ok(cellText(dial, cell)) })
	}
	do := func(what string, steps ...chromedp.Action[chromedp.Void]) {
		t.Helper()
		if err := chromedp.Do(ctx, steps...); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	}

	// The site's page: a typed URL, as an operator opens it.
	do("opening the site's page", chromedp.Navigate(r.site+"/llm_affinity/"))
	for _, rep := range fleet {
		d := rep.dial()
		do("waiting for "+d+"'s row", chromedp.WaitVisible(chromedp.CSS(row(d))))
		waitCell(d, "kv", "KV capacity", func(s string) bool { return strings.Contains(s, "/ 131,072") })
		waitCell(d, "hits", "engine prefix hit rate", func(s string) bool { return strings.HasSuffix(s, "%") })
		// "251 ms / 270 ms" (or seconds on a slow machine); "–" is no figure.
		waitCell(d, "ttft", "estimated and observed TTFT", func(s string) bool { return ttftCell.MatchString(s) })
		waitCell(d, "drain", "active phase", func(s string) bool { return s == "active" })
		q := query(row(d) + " td.chart polyline")
		if points := js(q + " ? " + q + `.getAttribute("points") : ""`); points == "" {
			t.Fatalf("%s's TTFT chart has no line", d)
		}
	}

	if summary := js(`document.getElementById("summary").textContent`); !strings.Contains(summary, "0 waiting at the gateway") {
		t.Errorf("the summary does not count the requests held at the gateway: %q", summary)
	}
	syncLine := func() string {
		return js(`document.getElementById("sync").hidden ? "" : document.getElementById("sync").textContent`)
	}
	eventually(t, 60*time.Second, "the sync line naming the peer", func() bool {
		return strings.HasPrefix(syncLine(), "sync: NATS connected, 1 peer (peer-router#")
	})

	target := fleet[1].dial()
	click(row(target) + " button.drain")
	waitCell(target, "drain", "drain phase", func(s string) bool { return strings.HasPrefix(s, "drain") })
	if phase := r.phase(t, target); phase == "active" {
		t.Fatalf("the page shows %s drained, the admin API says %s", target, phase)
	}
	if file := os.Getenv("LLM_AFFINITY_SCREENSHOT"); file != "" {
		// The click may have scrolled the table sideways.
		do("scrolling back", chromedp.Func(func(ctx context.Context, tg *chromedp.Target) error {
			_, err := chromedp.Evaluate[any]("window.scrollTo(0, 0)")(ctx, tg)
			return err
		}))
		png, err := chromedp.Run(ctx, chromedp.CaptureScreenshot())
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(file, png, 0o644); err != nil {
			t.Fatal(err)
		}
	}

	// The admin API's page. A typed URL is refused by Caddy (the browser
	// sends Sec-Fetch-Mode and no Origin) ...
	if resp, err := chromedp.Run(ctx, chromedp.NavigateResponse(r.admin+"/llm_affinity/")); err != nil || resp.Status != 403 {
		status := int64(0)
		if resp != nil {
			status = resp.Status
		}
		t.Logf("a typed URL of the admin API's page got %d (%v); Caddy refused it with 403 when this was written", status, err)
	}
	// ... arriving from a link of the same origin, the page loads, and its
	// DELETE carries the admin origin, which Caddy's default checks accept.
	do("opening the admin API's page from a same-origin link", chromedp.Func(func(ctx context.Context, tg *chromedp.Target) error {
		res, err := cdp.Call(ctx, tg, page.Navigate, page.NavigateParams{
			URL: r.admin + "/llm_affinity/", Referrer: r.admin + "/llm_affinity/"})
		if err == nil && res.ErrorText != "" {
			err = fmt.Errorf("%s", res.ErrorText)
		}
		return err
	}))
	do("waiting for the admin page's undrain button", chromedp.WaitVisible(chromedp.CSS(row(target)+" button.undrain")))
	click(row(target) + " button.undrain")
	waitCell(target, "drain", "undrained", func(s string) bool { return s == "active" })
	if phase := r.phase(t, target); phase != "active" {
		t.Fatalf("after undrain from the admin page the admin API says %s", phase)
	}

	// NATS gone: the line says the router routes on its own view.
	ns.Shutdown()
	eventually(t, 60*time.Second, "the sync line saying NATS is down", func() bool {
		return strings.Contains(syncLine(), "NATS not connected, routing on this router's own view") &&
			js(`document.getElementById("sync").className`) == "bad" &&
			strings.Contains(js(`document.getElementById("sync").title`), "refused")
	})

	// An engine gone: its row says its scrape fails, not in the green,
	// and its engine figures are marked as the last read.
	gone := fleet[2].dial()
	fleet[2].http.CloseClientConnections()
	fleet[2].http.Close()
	health := query(row(gone) + " td:nth-child(2)")
	eventually(t, 60*time.Second, gone+"'s scrape failing on the page", func() bool {
		return strings.Contains(js(health+" ? "+health+".textContent : \"\""), "scrape failing") &&
			js(health+" ? "+health+".className : \"\"") != "ok"
	})
	waitCell(gone, "kv", "engine KV as last read", func(s string) bool { return strings.Contains(s, "last read") })

	// A phone's width: the rows are cards, and nothing runs past the
	// screen or out of its cell.
	do("narrowing the page to a phone's width", chromedp.Func(func(ctx context.Context, tg *chromedp.Target) error {
		_, err := cdp.Call(ctx, tg, emulation.SetDeviceMetricsOverride, emulation.SetDeviceMetricsOverrideParams{
			Width: 360, Height: 800, DeviceScaleFactor: 1, Mobile: true})
		return err
	}))
	overflow := `(() => {
		const cells = [...document.querySelectorAll("#upstreams td")];
		if (cells.length === 0 || getComputedStyle(cells[0]).display !== "flex") return "no cards yet";
		const over = cells.filter(td => td.scrollWidth > td.clientWidth + 1).map(td => td.dataset.label);
		const page = document.documentElement.scrollWidth > window.innerWidth + 1 ? "the page scrolls sideways; " : "";
		return page + (over.length ? over.length + " cells overflow: " + [...new Set(over)].join(", ") : "");
	})()`
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		last := js(overflow)
		if last == "" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("at 360 px: %s", last)
		}
	}
}
