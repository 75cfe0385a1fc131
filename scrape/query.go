package scrape

import (
	"context"
	"errors"
	"net/url"
	"slices"
	"strings"
	"time"

	"go.uber.org/zap"
)

// metricsMode is how a target's metrics are asked for.
//
// The Python Prometheus client that vLLM and SGLang serve /metrics with
// answers a name[] query with only the series named (as Prometheus's
// federation endpoint does), and so does Go's promhttp, by family name,
// which for gauges and counters is the same name. Asking for the dozen
// families read cuts an exposition of tens of kilobytes, mostly histogram
// buckets, to under one: less for the engine to render and send, and for
// the router to read. But engines differ:
//
//   - vLLM answers /metrics itself from a handler that ignores the query,
//     and passes the paths below it (/metrics/) to the Prometheus client's
//     app, which honours it;
//   - SGLang, and vLLM with several API server processes, use a
//     multiprocess registry whose filtered answer is empty.
//
// So a target starts with modeNamed; an engine that answers with more
// than was asked for is asked at the path below once (modeNamedBelow),
// and one whose answers cannot be used is asked for everything
// (modeWhole). Whatever comes back, parseEngineMetrics keeps only what it
// reads.
type metricsMode uint8

const (
	modeNamed       metricsMode = iota // metrics_path?name[]=…
	modeNamedBelow                     // metrics_path/?name[]=…
	modeWhole                          // metrics_path
	numMetricsModes                    // the number of modes
)

// metricsQuery is one metrics request: a mode, and whether it leaves out
// the slow families.
type metricsQuery struct {
	mode     metricsMode
	skipSlow bool
}

// index numbers the queries, for the tables of prepared requests.
func (q metricsQuery) index() int {
	i := int(q.mode) * 2
	if q.skipSlow {
		i++
	}
	return i
}

// numMetricsQueries is the number of distinct metricsQuery values.
const numMetricsQueries = int(numMetricsModes) * 2

// path returns the request path of q, under metricsPath.
func (q metricsQuery) path(metricsPath string) string {
	if q.mode == modeWhole {
		return metricsPath
	}
	path, query, hasQuery := strings.Cut(metricsPath, "?")
	if q.mode == modeNamedBelow && !strings.HasSuffix(path, "/") {
		path += "/"
	}
	names := make([]string, 0, len(engineFamilies))
	for name, slow := range engineFamilies {
		if !q.skipSlow || !slow {
			names = append(names, name)
		}
	}
	slices.Sort(names)
	if hasQuery {
		query += "&"
	}
	return path + "?" + query + url.Values{"name[]": names}.Encode()
}

// wholeProbeIntervals is how many slow intervals a target asked for its
// whole exposition waits before the filtered query is tried again.
const wholeProbeIntervals = 6

// nextMode returns the mode to ask in after an answer in mode (see
// metricsMode): on to the next mode when the engine sent more than was
// asked for (dropped lines) or, from modeNamed, redirected; to modeWhole
// when the filtered answer had no engine metrics or was malformed, or
// the path below was refused. Network errors, timeouts and 5xx answers
// say nothing about the query and change nothing; modeWhole is left only
// by the scraper's periodic probe.
func nextMode(mode metricsMode, dropped int, err error) metricsMode {
	var status *statusError
	switch {
	case mode == modeWhole:
	case err == nil && dropped > 0:
		// The engine ignored the query: a usable answer, but the next
		// scrape asks one level down (or for everything).
		return mode + 1
	case err == nil:
	case mode == modeNamed && errors.As(err, &status) && status.code/100 == 3:
		return modeNamedBelow // /metrics redirects to /metrics/
	case errors.Is(err, errNoEngineMetrics) || errors.Is(err, errMalformedExposition),
		mode == modeNamedBelow && errors.As(err, &status) && status.code/100 != 5:
		return modeWhole
	}
	return mode
}

// fetchMetricsMode fetches t's metrics asking as mode says, and moves the
// target to the mode nextMode gives, asking again at once in it when the
// answer was not usable. Each attempt takes its own charge mark and time.
func (s *Scraper) fetchMetricsMode(ctx context.Context, t *scrapeTarget, mode metricsMode, skipSlow bool) (Signals, error) {
	for {
		sig, dropped, err := s.fetchMetrics(ctx, t, metricsQuery{mode, skipSlow})
		if ctx.Err() != nil {
			return sig, err // shutting down: the answer says nothing
		}
		next := nextMode(mode, dropped, err)
		if next == mode {
			return sig, err
		}
		t.mu.Lock()
		t.mode = next
		if next == modeWhole {
			t.probeDue = time.Now().Add(wholeProbeIntervals * s.cfg.SlowInterval)
		}
		t.mu.Unlock()
		s.cfg.Logger.Debug("engine metrics: asking differently", zap.String("upstream", t.dial),
			zap.String("path", metricsQuery{next, skipSlow}.path(s.cfg.MetricsPath)))
		if err == nil {
			return sig, nil
		}
		mode = next
	}
}
