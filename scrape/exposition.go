package scrape

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"math"
	"slices"
	"strconv"
	"sync"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// errNoEngineMetrics says an exposition parsed but held neither vLLM's nor
// SGLang's metrics.
var errNoEngineMetrics = errors.New("no vllm: or sglang: engine metrics in the exposition")

// errMalformedExposition says the Prometheus text parser rejected an
// exposition (after it was read whole).
var errMalformedExposition = errors.New("parsing metrics exposition")

// engineFamilies maps the name of every metric family read (of every
// engine's table) to whether it is slow: slow families are not read on
// every scrape. They are the engine's configuration, which does not
// change while it runs (the long label sets of vLLM's cache_config_info
// made it about half of every parse), and the prefix cache figures,
// which only feed the hit rate shown by the admin API. The scraper reads
// them every Config.SlowInterval and carries their figures over in
// between. What the policy routes by (queues, KV usage, adapters) is read
// every scrape.
var engineFamilies = familySet()

// enginePrefixes start the names of the engines' families, one per
// engine.
var enginePrefixes = func() [][]byte {
	var ps [][]byte
	for _, e := range engines {
		ps = append(ps, []byte(e.prefix))
	}
	return ps
}()

// processStartLine starts the process start time's sample line.
var processStartLine = []byte(processStartTime)

// textParsers recycles Prometheus text parsers: TextToMetricFamilies
// resets one for each input and keeps its read buffer.
var textParsers = sync.Pool{New: func() any {
	p := expfmt.NewTextParser(model.UTF8Validation)
	return &p
}}

// expositionBuffers recycles the buffers expositions are read into.
var expositionBuffers = sync.Pool{New: func() any { return new(bytes.Buffer) }}

// parseEngineMetrics reads a Prometheus text exposition (format 0.0.4) of
// vLLM or SGLang and returns its signals, stamped now. It fails on a
// malformed exposition and on one with no engine metrics.
//
// Only the sample lines of the families it reads reach the Prometheus
// text parser: the exposition is first cut into lines, comments (HELP
// and TYPE) are dropped, and so are the samples of other families
// (histogram buckets, process and runtime metrics, the bulk of a whole
// exposition), by metric name. That makes a scrape cost a scan of the
// bytes plus the parse of a few lines, instead of the parse (and
// thousands of allocations) of everything; the figures themselves are
// still parsed by the Prometheus library. A malformed line in a family it
// does not read is therefore not an error.
func parseEngineMetrics(r io.Reader, now time.Time) (Signals, error) {
	sig, _, err := parseEngineMetricsSkipping(r, now, false)
	return sig, err
}

// parseEngineMetricsSkipping is parseEngineMetrics, leaving out the
// slow families when skipSlow is set. dropped counts the sample lines it
// left out: more than a name[] query asked for says the server ignored it.
func parseEngineMetricsSkipping(r io.Reader, now time.Time, skipSlow bool) (sig Signals, dropped int, err error) {
	buf := expositionBuffers.Get().(*bytes.Buffer)
	defer func() {
		if buf.Cap() <= 1<<20 { // do not keep the rare huge one
			buf.Reset()
			expositionBuffers.Put(buf)
		}
	}()
	buf.Reset()
	if _, err := buf.ReadFrom(r); err != nil {
		return Signals{}, 0, fmt.Errorf("reading metrics exposition: %w", err)
	}
	kept, dropped, started := keepEngineLines(buf.Bytes(), skipSlow)
	parser := textParsers.Get().(*expfmt.TextParser)
	defer textParsers.Put(parser)
	families, err := parser.TextToMetricFamilies(bytes.NewReader(kept))
	if err != nil {
		return Signals{}, dropped, fmt.Errorf("%w: %w", errMalformedExposition, err)
	}
	sig, err = signalsFromFamilies(families, now)
	sig.ProcessStart = started
	return sig, dropped, err
}

// keepEngineLines compacts text in place to the sample lines of the
// families in engineFamilies, and returns them, how many other sample
// lines it dropped, and the process start time's value (0 for none),
// which it reads itself: one line is not worth the text parser's families.
func keepEngineLines(text []byte, skipSlow bool) (kept []byte, dropped int, started float64) {
	out := text[:0]
	for len(text) > 0 {
		line := text
		next := len(text)
		if i := bytes.IndexByte(text, '\n'); i >= 0 {
			line, next = text[:i+1], i+1
		}
		switch engineLine(line, skipSlow) {
		case lineKept:
			out = append(out, line...) // never overtakes the reading position
		case lineDropped:
			dropped++
		case lineProcessStart:
			started = processStartOf(line)
		}
		text = text[next:]
	}
	return out, dropped, started
}

// processStartOf reads the value of a process_start_time_seconds sample
// line without labels (the clients write none), 0 when it is not a
// positive finite number.
func processStartOf(line []byte) float64 {
	rest := skipBlanks(skipBlanks(line)[len(processStartLine):])
	end := 0
	for end < len(rest) && rest[end] != ' ' && rest[end] != '\t' && rest[end] != '\n' && rest[end] != '\r' {
		end++
	}
	v, err := strconv.ParseFloat(string(rest[:end]), 64)
	if err != nil || !(v > 0) || math.IsInf(v, 0) {
		return 0
	}
	return v
}

// lineKind is what keepEngineLines does with a line.
type lineKind uint8

const (
	lineKept         lineKind = iota // a sample of a family read
	lineDropped                      // a sample of another family
	lineComment                      // a comment or a blank line
	lineProcessStart                 // the process start time's sample
)

// engineLine says whether an exposition line is a sample of a family in
// engineFamilies, a sample of another family or a comment. Lines whose
// name is quoted (UTF-8 names) are kept, for the parser to judge. It runs
// on every line of every scrape, so it avoids anything slower than a
// byte loop.
func engineLine(line []byte, skipSlow bool) lineKind {
	line = skipBlanks(line)
	if len(line) == 0 || line[0] == '#' || line[0] == '\n' || line[0] == '\r' {
		// HELP and TYPE lines: every family read is a gauge or a counter,
		// whose values read the same untyped, and without TYPE lines the
		// parser has a third less text to go through.
		return lineComment
	}
	if line[0] == '"' || line[0] == '{' {
		return lineKept
	}
	// Every name read starts with an engine's prefix ("vllm:"): reject
	// the rest (runtime, process, router metrics) before the map lookup.
	if !slices.ContainsFunc(enginePrefixes, func(p []byte) bool { return bytes.HasPrefix(line, p) }) {
		// The one family read that is not an engine's, asked for by name
		// (see metricsQuery): read without labels, as the clients write
		// it; with labels (or a longer name), left out but not counted as
		// a line the engine should not have sent.
		if line[0] == 'p' && bytes.HasPrefix(line, processStartLine) {
			if rest := line[len(processStartLine):]; len(rest) > 0 && (rest[0] == ' ' || rest[0] == '\t') {
				return lineProcessStart
			}
			return lineComment
		}
		return lineDropped
	}
	end := 0
	for end < len(line) {
		if c := line[end]; c == '{' || c == ' ' || c == '\t' || c == '\n' || c == '\r' {
			break
		}
		end++
	}
	if slow, ok := engineFamilies[string(line[:end])]; ok && !(skipSlow && slow) {
		return lineKept
	}
	return lineDropped
}

// skipBlanks drops leading spaces and tabs.
func skipBlanks(b []byte) []byte {
	for len(b) > 0 && (b[0] == ' ' || b[0] == '\t') {
		b = b[1:]
	}
	return b
}

// signalsFromFamilies extracts the signals of whichever engine the
// families come from: the first of engines that an identifying family
// has a usable value (a gauge, counter or untyped series with a finite
// value) of.
func signalsFromFamilies(families map[string]*dto.MetricFamily, now time.Time) (Signals, error) {
	for _, e := range engines {
		if !e.identifies(families) {
			continue
		}
		sig := Signals{
			Engine:  e.name,
			Running: -1, Waiting: -1, PrefixQueries: -1, PrefixHits: -1, PrefixHitRate: -1,
			ScrapedAt: now,
		}
		e.extract(families, &sig)
		return sig, nil
	}
	return Signals{}, errNoEngineMetrics
}
