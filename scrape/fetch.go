package scrape

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"time"
)

// Fetch limits and headers.
const (
	maxExpositionBytes = 8 << 20 // real vLLM expositions are ~100-300 KB
	maxModelsBytes     = 4 << 20
	// maxDrainBytes is how much of an answer left unread (an error page,
	// JSON's trailing newline) is read and discarded before the body is
	// closed: a body read to its end leaves the connection to the next
	// request, one closed before its end closes it.
	maxDrainBytes = 4 << 10
	// maxHeaderBytes bounds an answer's header.
	maxHeaderBytes     = 64 << 10
	scrapeAcceptHeader = "text/plain;version=0.0.4;q=1,*/*;q=0.1"
	scrapeUserAgent    = "caddy-llm-affinity"
)

// errExpositionTooLarge says a response body exceeded its size cap.
var errExpositionTooLarge = errors.New("response body too large")

// newTransport returns the transport of a scraper's own client, made
// for small GETs repeated every interval to a fixed set of hosts: one
// connection per target kept alive from one scrape to the next, dialled
// directly (no proxy, as reverse_proxy dials upstreams), HTTP/1.1, no
// compression (cheaper on both ends at these sizes).
func newTransport(cfg Config) *http.Transport {
	var protocols http.Protocols
	protocols.SetHTTP1(true)
	return &http.Transport{
		DialContext:         (&net.Dialer{Timeout: cfg.Timeout, KeepAlive: 30 * time.Second}).DialContext,
		TLSHandshakeTimeout: cfg.Timeout,
		// A target has one fetch in flight at a time (its metrics, then
		// its models), so one idle connection each; a spare for the
		// rare overlap with a fetch timing out.
		MaxIdleConnsPerHost: 2,
		// Outlasts the wait between two scrapes.
		IdleConnTimeout:        max(90*time.Second, 3*cfg.Interval),
		DisableCompression:     true,
		ReadBufferSize:         64 << 10, // an exposition in a few reads, not dozens
		MaxResponseHeaderBytes: maxHeaderBytes,
		Protocols:              &protocols,
	}
}

// newGet returns a GET of url asking for accept. Prepared once per
// target and query: a request is only read when sent, so one fetch after
// another can send the same one (with its own context).
func newGet(url, accept string) (*http.Request, error) {
	req, err := http.NewRequest(http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	req.Header.Set("Accept", accept)
	req.Header.Set("User-Agent", scrapeUserAgent)
	return req, nil
}

// fetchMetrics GETs and parses t's metrics as query asks, on the
// target's kept connection when it has one (see fetchKeptAlive), else
// with metricsClient. The charge mark and the time the signals are
// stamped with are taken just before the request is sent, and a second
// mark once the answer is read.
func (s *Scraper) fetchMetrics(ctx context.Context, t *scrapeTarget, query metricsQuery) (Signals, int, error) {
	req := t.metricsRequests[query.index()]
	if req == nil {
		return Signals{}, 0, t.requestErr
	}
	var mark Mark
	if s.cfg.Mark != nil {
		mark = s.cfg.Mark(t.dial)
	}
	now := time.Now()
	var sig Signals
	var dropped int
	var err error
	if t.rawRequests[query.index()] != nil {
		sig, dropped, err = s.fetchKeptAlive(ctx, t, query, now)
	} else {
		ctx, cancel := context.WithTimeout(ctx, s.cfg.Timeout)
		err = s.get(s.metricsClient, req.WithContext(ctx), maxExpositionBytes, func(r io.Reader) error {
			var err error
			sig, dropped, err = parseEngineMetricsSkipping(r, now, query.skipSlow)
			return err
		})
		cancel()
	}
	sig.Mark = mark
	if s.cfg.Mark != nil {
		sig.MarkAfter = s.cfg.Mark(t.dial)
	}
	return sig, dropped, err
}

// fetchModels GETs and parses t's models list.
func (s *Scraper) fetchModels(ctx context.Context, t *scrapeTarget) ([]ModelInfo, error) {
	if t.modelsRequest == nil {
		return nil, t.requestErr
	}
	ctx, cancel := context.WithTimeout(ctx, s.cfg.Timeout)
	defer cancel()
	var models []ModelInfo
	// Without following redirects, as for metrics: an engine has no reason to send the
	// router (and the proxy's client certificate) elsewhere.
	err := s.get(s.metricsClient, t.modelsRequest.WithContext(ctx), maxModelsBytes, func(r io.Reader) error {
		var err error
		models, err = parseModels(r)
		return err
	})
	return models, err
}

// get sends req with client and hands at most limit bytes of a 200
// answer's body to read. Informational answers (103 Early Hints) are
// skipped by the transport. Whatever read leaves, and an error answer's
// body, is drained up to maxDrainBytes so that the connection is kept.
func (s *Scraper) get(client *http.Client, req *http.Request, limit int64, read func(io.Reader) error) error {
	resp, err := client.Do(req)
	if err != nil {
		var uerr *url.Error
		if errors.As(err, &uerr) {
			// Without the query, which would fill Status.LastError.
			err = fmt.Errorf("GET %s: %w", shortURL(req.URL), uerr.Err)
		}
		return err
	}
	defer func() {
		_, _ = io.CopyN(io.Discard, resp.Body, maxDrainBytes)
		_ = resp.Body.Close()
	}()
	if resp.StatusCode != http.StatusOK {
		return &statusError{shortURL(req.URL), resp.StatusCode}
	}
	return read(&capReader{r: resp.Body, left: limit})
}

// statusError is an answer other than 200.
type statusError struct {
	url  string
	code int
}

// Error implements error.
func (e *statusError) Error() string { return fmt.Sprintf("GET %s: status %d", e.url, e.code) }

// shortURL returns u without its query, marked by "?…": the names asked
// for are many and always the same.
func shortURL(u *url.URL) string {
	short := *u
	short.RawQuery, short.ForceQuery = "", false
	if u.RawQuery != "" {
		return short.String() + "?…"
	}
	return short.String()
}

// noRedirects makes a client return redirects instead of following them:
// a redirected metrics query is a sign for nextMode.
func noRedirects(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }

// capReader reads at most left bytes and then fails, so an oversized
// body is an error rather than silently truncated (which could parse).
type capReader struct {
	r    io.Reader
	left int64
}

// Read implements io.Reader.
func (c *capReader) Read(p []byte) (int, error) {
	if c.left <= 0 {
		// Distinguish "exactly at the limit" from "more to come".
		var one [1]byte
		if n, _ := c.r.Read(one[:]); n > 0 {
			return 0, errExpositionTooLarge
		}
		return 0, io.EOF
	}
	if int64(len(p)) > c.left {
		p = p[:c.left]
	}
	n, err := c.r.Read(p)
	c.left -= int64(n)
	return n, err
}

// parseModels reads an OpenAI /v1/models response.
func parseModels(r io.Reader) ([]ModelInfo, error) {
	var body struct {
		Data []json.RawMessage `json:"data"`
	}
	if err := json.NewDecoder(r).Decode(&body); err != nil {
		return nil, fmt.Errorf("parsing models list: %w", err)
	}
	models := make([]ModelInfo, len(body.Data))
	for i, card := range body.Data {
		if err := json.Unmarshal(card, &models[i]); err != nil {
			return nil, fmt.Errorf("parsing models list: entry %d: %w", i, err)
		}
		models[i].Card = card
	}
	return models, nil
}
