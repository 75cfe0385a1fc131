package scrape

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"syscall"
	"time"
)

// errExpositionTooLarge says a response body exceeded its size cap.
var errExpositionTooLarge = errors.New("response body too large")

// fetchMetricsQuery fetches t's metrics with query, on the target's
// kept-alive connection when it has one.
func (s *Scraper) fetchMetricsQuery(ctx context.Context, t *scrapeTarget, query metricsQuery, now time.Time) (Signals, int, error) {
	if t.metricsRequests[query.index()] != nil {
		return s.fetchMetricsKeptAlive(ctx, t, query, now)
	}
	return s.fetchMetrics(ctx, t.metricsURLs[query.index()], now, query.skipSlow)
}

// fetchMetrics GETs and parses one metrics exposition.
func (s *Scraper) fetchMetrics(ctx context.Context, url string, now time.Time, skipSlow bool) (Signals, int, error) {
	var sig Signals
	var dropped int
	err := s.get(ctx, url, scrapeAcceptHeader, maxExpositionBytes, func(r io.Reader) error {
		var err error
		sig, dropped, err = parseEngineMetricsSkipping(r, now, skipSlow)
		return err
	})
	return sig, dropped, err
}

// fetchMetricsKeptAlive GETs t's metrics over the target's own kept-alive
// connection, reading the response with net/http's own parser
// (http.ReadResponse) on the calling goroutine. At 640 scrapes a second
// the http.Client's per-request machinery (a request and context, hand-
// offs to its connection goroutines) cost about as much as parsing the
// exposition; this path skips it. A reused connection the engine closed
// meanwhile is redialled once.
func (s *Scraper) fetchMetricsKeptAlive(ctx context.Context, t *scrapeTarget, query metricsQuery, now time.Time) (Signals, int, error) {
	for attempt := 0; ; attempt++ {
		bc, reused, err := t.takeConn(ctx, s.cfg.Timeout)
		if err != nil {
			return Signals{}, 0, err
		}
		sig, dropped, keep, err := s.fetchOn(bc, t, query, now)
		if keep {
			t.putConn(bc)
		} else {
			bc.Close()
		}
		if err != nil && reused && attempt == 0 && ctx.Err() == nil && errors.Is(err, errStaleConn) {
			continue
		}
		return sig, dropped, err
	}
}

// errStaleConn says a kept-alive connection was closed before the
// response began.
var errStaleConn = errors.New("connection closed before the response")

// fetchOn sends the metrics request on bc and parses the response. keep
// says the connection can carry the next request.
func (s *Scraper) fetchOn(bc *bufferedConn, t *scrapeTarget, query metricsQuery, now time.Time) (sig Signals, dropped int, keep bool, err error) {
	if err := bc.SetDeadline(time.Now().Add(s.cfg.Timeout)); err != nil {
		return sig, 0, false, err
	}
	if _, err := bc.Write(t.metricsRequests[query.index()]); err != nil {
		return sig, 0, false, errStaleConn
	}
	var resp *http.Response
	for {
		resp, err = http.ReadResponse(bc.r, nil)
		if err != nil {
			if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, syscall.ECONNRESET) {
				err = errStaleConn
			}
			return sig, 0, false, err
		}
		// Informational answers (103 Early Hints) precede the real one.
		if resp.StatusCode >= 200 || resp.StatusCode == http.StatusSwitchingProtocols {
			break
		}
		resp.Body.Close()
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		// A short error body read to its end leaves the connection usable.
		_, err := io.CopyN(io.Discard, resp.Body, 4<<10)
		keep := err == io.EOF && !resp.Close && resp.StatusCode >= 200
		return sig, 0, keep, &statusError{t.metricsURLs[query.index()], resp.StatusCode}
	}
	// parseEngineMetrics reads to EOF before it parses, so unless reading
	// failed the connection is ready for the next request.
	sig, dropped, err = parseEngineMetricsSkipping(&capReader{r: resp.Body, left: maxExpositionBytes}, now, query.skipSlow)
	read := err == nil || errors.Is(err, errNoEngineMetrics) || errors.Is(err, errMalformedExposition)
	return sig, dropped, read && !resp.Close, err
}

// bufferedConn is a connection with its read buffer.
type bufferedConn struct {
	net.Conn
	r *bufio.Reader
}

// takeConn returns the target's idle connection, or dials a new one;
// reused says which.
func (t *scrapeTarget) takeConn(ctx context.Context, timeout time.Duration) (bc *bufferedConn, reused bool, err error) {
	t.connMu.Lock()
	bc, t.conn = t.conn, nil
	t.connMu.Unlock()
	if bc != nil {
		return bc, true, nil
	}
	d := net.Dialer{Timeout: timeout}
	c, err := d.DialContext(ctx, "tcp", t.dial)
	if err != nil {
		return nil, false, err
	}
	return &bufferedConn{Conn: c, r: bufio.NewReaderSize(c, 64<<10)}, false, nil
}

// putConn keeps bc for the next fetch, unless the target is gone.
func (t *scrapeTarget) putConn(bc *bufferedConn) {
	t.connMu.Lock()
	defer t.connMu.Unlock()
	if t.closed || t.conn != nil {
		bc.Close()
		return
	}
	t.conn = bc
}

// closeConn closes the idle connection and refuses later ones.
func (t *scrapeTarget) closeConn() {
	t.connMu.Lock()
	defer t.connMu.Unlock()
	t.closed = true
	if t.conn != nil {
		t.conn.Close()
		t.conn = nil
	}
}

// fetchModels GETs and parses one models list.
func (s *Scraper) fetchModels(ctx context.Context, url string) ([]ModelInfo, error) {
	var models []ModelInfo
	err := s.get(ctx, url, "application/json", maxModelsBytes, func(r io.Reader) error {
		var err error
		models, err = parseModels(r)
		return err
	})
	return models, err
}

// get fetches url within the timeout and hands at most limit bytes of a
// 200 response to read.
func (s *Scraper) get(ctx context.Context, url, accept string, limit int64, read func(io.Reader) error) error {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.Timeout)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	req.Header.Set("Accept", accept)
	req.Header.Set("User-Agent", "caddy-llm-affinity")
	resp, err := s.client.Do(req)
	if err != nil {
		return err
	}
	defer func() {
		// Drain a little so the connection can be reused.
		_, _ = io.CopyN(io.Discard, resp.Body, 4<<10)
		_ = resp.Body.Close()
	}()
	if resp.StatusCode != http.StatusOK {
		return &statusError{url, resp.StatusCode}
	}
	return read(&capReader{r: resp.Body, left: limit})
}

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
		Data []ModelInfo `json:"data"`
	}
	if err := json.NewDecoder(r).Decode(&body); err != nil {
		return nil, fmt.Errorf("parsing models list: %w", err)
	}
	if body.Data == nil {
		body.Data = []ModelInfo{}
	}
	return body.Data, nil
}
