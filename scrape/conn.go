package scrape

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"sync"
	"syscall"
	"time"
)

// connReadBuffer is the size of a kept connection's read buffer: an
// exposition in a few reads, not dozens.
const connReadBuffer = 64 << 10

// errStaleConn says a kept-alive connection was closed before the
// response began.
var errStaleConn = errors.New("connection closed before the response")

// errHeaderTooLarge says an answer's header exceeded maxHeaderBytes.
var errHeaderTooLarge = errors.New("response header too large")

// fetchKeptAlive GETs and parses t's metrics as query asks, on the
// target's kept connection, within one timeout from now. A reused
// connection found closed is redialled once.
//
// Why the scraper has an HTTP/1.1 client of its own for metrics:
//
// A scrape is one small GET, repeated every interval on the same
// connection: at the documented load (64 upstreams every 100 ms, under
// 5 % of a core) that is 640 requests a second, and what a request
// costs besides reading the exposition shows. BenchmarkScrape64
// (-benchtime=1x, 2 shared cores, every_100ms, run back to back at the
// same load) measured this client at 3.6-4.9 % of a core, 58-76 cpu-µs
// a scrape, and net/http with a tuned Transport (one idle connection per
// target, HTTP/1.1, no proxy, no compression) at 4.5-6.6 %, 83-103
// cpu-µs: 25-45 µs a scrape more, from the hand-offs to and from the
// Transport's connection goroutines (a writeLoop and a readLoop per
// request); calling Transport.RoundTrip directly or dropping the
// per-fetch context did not change it. Restored here, with the stop
// closing the connection and the header limit: 4.5, 4.6 and 4.0 %
// (62-72 cpu-µs) in three runs; in alternation with net/http (before
// the header limit), 3.2-4.6 % (50-72 cpu-µs) against 5.0-5.9 % (77-92
// cpu-µs), and at the default 1 s interval 0.33-0.39 % against
// 0.50-0.56 %. Single runs on that machine vary by about a point: 18
// runs of this client gave 3.2-5.5 %, median 4.3 %.
//
// So each plain-HTTP target of a scraper with its own client keeps one
// connection of its own for its metrics, used by one fetch at a time
// (the target's busy flag). The request's bytes are prepared once per
// target and query (http.Request.Write), and the response is read with
// net/http's own parser (http.ReadResponse) on the fetching goroutine.
// What net/http gives and this keeps: 1xx answers are skipped, error
// bodies are drained up to maxDrainBytes so the connection is kept,
// oversized headers and bodies are refused and their connection
// closed, a reused connection the engine closed meanwhile is redialled
// once, and redirects are not followed (a redirect moves the query
// mode). The fetch has one deadline (Config.Timeout) for the dial, the
// request and the whole answer, and stopping the scraper (its context)
// closes the connection, so a hung fetch ends at once. Models lists,
// https targets and a caller's Config.Client go through net/http
// (fetch.go).
func (s *Scraper) fetchKeptAlive(ctx context.Context, t *scrapeTarget, query metricsQuery, now time.Time) (Signals, int, error) {
	deadline := now.Add(s.cfg.Timeout)
	for attempt := 0; ; attempt++ {
		bc, reused, err := t.conn.take(ctx, t.addr, deadline)
		if err != nil {
			return Signals{}, 0, t.getError(query, err)
		}
		// Stopping the scraper ends a fetch that hangs.
		stop := context.AfterFunc(ctx, func() { bc.Close() })
		sig, dropped, keep, err := s.fetchOn(bc, t, query, now, deadline)
		if stop() && keep {
			t.conn.put(bc)
		} else {
			bc.Close()
		}
		if errors.Is(err, errStaleConn) && reused && attempt == 0 && ctx.Err() == nil {
			continue
		}
		return sig, dropped, err
	}
}

// rawRequest returns req as sent on the wire, for a kept connection.
func rawRequest(req *http.Request) ([]byte, error) {
	var b bytes.Buffer
	if err := req.Write(&b); err != nil {
		return nil, err
	}
	return b.Bytes(), nil
}

// keptConn is a target's own connection for its metrics, idle between
// fetches.
type keptConn struct {
	mu     sync.Mutex
	conn   *bufferedConn
	closed bool // the target is gone: no connection is kept
}

// bufferedConn is a connection with its read buffer, which reads
// through a budget.
type bufferedConn struct {
	net.Conn
	r      *bufio.Reader
	budget headerBudget
}

// headerBudget reads from r at most left more bytes, then fails with
// errHeaderTooLarge: while a header is read, so that a header without
// end is refused as net/http's Transport does (MaxResponseHeaderBytes).
// The body's reader has its own limit.
type headerBudget struct {
	r    io.Reader
	left int
}

// Read implements io.Reader.
func (h *headerBudget) Read(p []byte) (int, error) {
	if h.left <= 0 {
		return 0, errHeaderTooLarge
	}
	if len(p) > h.left {
		p = p[:h.left]
	}
	n, err := h.r.Read(p)
	h.left -= n
	return n, err
}

// readResponse reads the next answer's header from bc. The budget
// allows maxHeaderBytes and what the read buffer may hold besides.
func (bc *bufferedConn) readResponse() (*http.Response, error) {
	bc.budget.left = maxHeaderBytes + connReadBuffer
	resp, err := http.ReadResponse(bc.r, nil)
	bc.budget.left = math.MaxInt
	return resp, err
}

// take returns the idle connection, or dials dial for a new one; reused
// says which.
func (k *keptConn) take(ctx context.Context, dial string, deadline time.Time) (bc *bufferedConn, reused bool, err error) {
	k.mu.Lock()
	bc, k.conn = k.conn, nil
	k.mu.Unlock()
	if bc != nil {
		return bc, true, nil
	}
	d := net.Dialer{Deadline: deadline}
	c, err := d.DialContext(ctx, "tcp", dial)
	if err != nil {
		return nil, false, err
	}
	bc = &bufferedConn{Conn: c, budget: headerBudget{r: c}}
	bc.r = bufio.NewReaderSize(&bc.budget, connReadBuffer)
	return bc, false, nil
}

// put keeps bc for the next fetch, unless the target is gone.
func (k *keptConn) put(bc *bufferedConn) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.closed || k.conn != nil {
		bc.Close()
		return
	}
	k.conn = bc
}

// close closes the idle connection and refuses later ones.
func (k *keptConn) close() {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.closed = true
	if k.conn != nil {
		k.conn.Close()
		k.conn = nil
	}
}

// fetchOn sends t's metrics request for query on bc and parses the
// answer. keep says the connection can carry the next request.
func (s *Scraper) fetchOn(bc *bufferedConn, t *scrapeTarget, query metricsQuery, now, deadline time.Time) (sig Signals, dropped int, keep bool, err error) {
	if err := bc.SetDeadline(deadline); err != nil {
		return sig, 0, false, t.getError(query, err)
	}
	if _, err := bc.Write(t.rawRequests[query.index()]); err != nil {
		return sig, 0, false, t.getError(query, fmt.Errorf("%w: %w", errStaleConn, err))
	}
	var resp *http.Response
	for {
		resp, err = bc.readResponse()
		if err != nil {
			if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, syscall.ECONNRESET) {
				err = fmt.Errorf("%w: %w", errStaleConn, err)
			}
			return sig, 0, false, t.getError(query, err)
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
		_, err := io.CopyN(io.Discard, resp.Body, maxDrainBytes)
		keep := err == io.EOF && !resp.Close && resp.StatusCode != http.StatusSwitchingProtocols
		return sig, 0, keep, &statusError{shortURL(t.metricsRequests[query.index()].URL), resp.StatusCode}
	}
	// parseEngineMetricsSkipping reads to EOF before it parses, so unless
	// reading failed the connection is ready for the next request.
	sig, dropped, err = parseEngineMetricsSkipping(&capReader{r: resp.Body, left: maxExpositionBytes}, now, query.skipSlow)
	read := err == nil || errors.Is(err, errNoEngineMetrics) || errors.Is(err, errMalformedExposition)
	return sig, dropped, read && !resp.Close, err
}

// getError is err from fetching t's metrics as query asks, named by the
// URL without its query.
func (t *scrapeTarget) getError(query metricsQuery, err error) error {
	return fmt.Errorf("GET %s: %w", shortURL(t.metricsRequests[query.index()].URL), err)
}
