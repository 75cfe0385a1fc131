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

// Engines whose metrics are understood.
const (
	engineVLLM   = "vllm"
	engineSGLang = "sglang"
)

// errNoEngineMetrics says an exposition parsed but held neither vLLM's nor
// SGLang's metrics.
var errNoEngineMetrics = errors.New("no vllm: or sglang: engine metrics in the exposition")

// errMalformedExposition says the Prometheus text parser rejected an
// exposition (after it was read whole).
var errMalformedExposition = errors.New("parsing metrics exposition")

// engineFamilies are the metric families parseEngineMetrics reads.
var engineFamilies = map[string]bool{
	vllmRunning: true, vllmWaiting: true, vllmKVUsage: true, vllmKVUsageLegacy: true,
	vllmPrefixQueries: true, vllmPrefixHits: true, vllmCacheConfig: true, vllmLoRAInfo: true,
	sglangRunning: true, sglangWaiting: true, sglangKVUsage: true, sglangMaxTokens: true,
	sglangCacheConfig: true, sglangHitRate: true, sglangLoRASlots: true,
}

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

// slowFamilies are not read on every scrape: the
// engine's configuration, which does not change while it runs (the long
// label sets of vLLM's cache_config_info made it about half of every
// parse), and the prefix cache counters, which only feed the hit rate
// shown by the admin API. The scraper reads them every
// scrapeConfig.SlowInterval and carries their figures over in between. What the policy routes by (queues, KV usage, adapters) is
// read every scrape.
var slowFamilies = map[string]bool{
	vllmCacheConfig: true, vllmPrefixQueries: true, vllmPrefixHits: true, sglangHitRate: true,
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
	kept, dropped := keepEngineLines(buf.Bytes(), skipSlow)
	parser := textParsers.Get().(*expfmt.TextParser)
	defer textParsers.Put(parser)
	families, err := parser.TextToMetricFamilies(bytes.NewReader(kept))
	if err != nil {
		return Signals{}, dropped, fmt.Errorf("%w: %w", errMalformedExposition, err)
	}
	sig, err = signalsFromFamilies(families, now)
	return sig, dropped, err
}

// keepEngineLines compacts text in place to the sample lines of the
// families in engineFamilies, and returns them and how many other sample
// lines it dropped.
func keepEngineLines(text []byte, skipSlow bool) (kept []byte, dropped int) {
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
		}
		text = text[next:]
	}
	return out, dropped
}

// lineKind is what keepEngineLines does with a line.
type lineKind uint8

const (
	lineKept    lineKind = iota // a sample of a family read
	lineDropped                 // a sample of another family
	lineComment                 // a comment or a blank line
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
	// Every name read starts with "vllm:" or "sglang:": reject the rest
	// (runtime, process, router metrics) before the map lookup.
	if !bytes.HasPrefix(line, []byte("vllm:")) && !bytes.HasPrefix(line, []byte("sglang:")) {
		return lineDropped
	}
	end := 0
	for end < len(line) {
		if c := line[end]; c == '{' || c == ' ' || c == '\t' || c == '\n' || c == '\r' {
			break
		}
		end++
	}
	name := line[:end]
	if engineFamilies[string(name)] && !(skipSlow && slowFamilies[string(name)]) {
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
// families come from.
func signalsFromFamilies(families map[string]*dto.MetricFamily, now time.Time) (Signals, error) {
	// An engine is recognised by a usable value (a gauge, counter or
	// untyped series with a finite value) in one of its core families.
	has := func(names ...string) bool {
		for _, n := range names {
			for _, m := range metricsOf(families[n]) {
				if _, ok := sampleValue(m); ok {
					return true
				}
			}
		}
		return false
	}
	sig := Signals{
		Running: -1, Waiting: -1, PrefixQueries: -1, PrefixHits: -1, PrefixHitRate: -1,
		ScrapedAt: now,
	}
	switch {
	case has(vllmRunning, vllmWaiting, vllmKVUsage, vllmKVUsageLegacy, vllmCacheConfig):
		sig.Engine = engineVLLM
		vllmSignals(families, &sig)
	case has(sglangRunning, sglangWaiting, sglangKVUsage, sglangMaxTokens):
		sig.Engine = engineSGLang
		sglangSignals(families, &sig)
	default:
		return Signals{}, errNoEngineMetrics
	}
	return sig, nil
}

// setCapacity sets NumGPUBlocks from the per-rank capacities in tokens.
func setCapacity(sig *Signals, capacity map[string]float64) {
	if sig.BlockSize <= 0 || len(capacity) == 0 {
		sig.BlockSize = 0
		return
	}
	var tokens float64
	for _, c := range capacity {
		tokens += c
	}
	sig.NumGPUBlocks = int(tokens) / sig.BlockSize
}

// groupKey identifies one engine instance inside an exposition: a model
// name and a data parallel rank.
type groupKey struct{ model, rank string }

// groups holds one value per engine instance. A slice rather than a map:
// an exposition has a handful of instances, usually one, and this runs
// for every family of every scrape.
type groups []groupValue

// groupValue is one engine instance's value.
type groupValue struct {
	groupKey
	value float64
}

// rankGroups reduces f's series to one value per (model_name, rank):
// the maximum, since series of the same rank that differ in other labels
// (SGLang's tp_rank) repeat the same figure. It returns nil when f has no
// usable series.
func rankGroups(f *dto.MetricFamily, rankLabel string) groups {
	var g groups
	for _, m := range metricsOf(f) {
		v, ok := sampleValue(m)
		if !ok {
			continue
		}
		k := groupKey{model: labelValue(m, "model_name"), rank: labelValue(m, rankLabel)}
		if i := slices.IndexFunc(g, func(gv groupValue) bool { return gv.groupKey == k }); i >= 0 {
			g[i].value = max(g[i].value, v)
		} else {
			g = append(g, groupValue{k, v})
		}
	}
	return g
}

// sum adds the instances' values.
func (g groups) sum() float64 {
	var s float64
	for _, gv := range g {
		s += gv.value
	}
	return s
}

// max returns the largest instance value.
func (g groups) max() float64 {
	m := math.Inf(-1)
	for _, gv := range g {
		m = max(m, gv.value)
	}
	return m
}

// byRank returns the values by rank, keeping the largest per rank.
func (g groups) byRank() map[string]float64 {
	out := make(map[string]float64, len(g))
	for _, gv := range g {
		out[gv.rank] = max(out[gv.rank], gv.value)
	}
	return out
}

// weightedMean averages the instances' values (fractions), weighting each
// by its rank's weight when every rank has one, else equally.
func (g groups) weightedMean(weights map[string]float64) float64 {
	var num, den float64
	for _, gv := range g {
		w, ok := weights[gv.rank]
		if !ok || w <= 0 {
			num, den = 0, 0
			break
		}
		num += gv.value * w
		den += w
	}
	if den > 0 {
		return num / den
	}
	for _, gv := range g {
		num += gv.value
		den++
	}
	if den == 0 {
		return 0
	}
	return num / den
}

// metricsOf returns f's series, nil for a nil family.
func metricsOf(f *dto.MetricFamily) []*dto.Metric {
	if f == nil {
		return nil
	}
	return f.GetMetric()
}

// sampleValue returns the value of a gauge, counter or untyped series;
// false for other types and for NaN or infinite values.
func sampleValue(m *dto.Metric) (float64, bool) {
	var v float64
	switch {
	case m.GetGauge() != nil:
		v = m.GetGauge().GetValue()
	case m.GetCounter() != nil:
		v = m.GetCounter().GetValue()
	case m.GetUntyped() != nil:
		v = m.GetUntyped().GetValue()
	default:
		return 0, false
	}
	if math.IsNaN(v) || math.IsInf(v, 0) {
		return 0, false
	}
	return v, true
}

// labelValue returns the value of m's label name, "" when absent.
func labelValue(m *dto.Metric, name string) string {
	for _, lp := range m.GetLabel() {
		if lp.GetName() == name {
			return lp.GetValue()
		}
	}
	return ""
}

// labelInt returns m's label name as an integer, 0 when absent or not a
// number (vLLM renders unset fields as "None").
func labelInt(m *dto.Metric, name string) int {
	s := labelValue(m, name)
	if s == "" {
		return 0
	}
	if n, err := strconv.Atoi(s); err == nil {
		return n
	}
	if f, err := strconv.ParseFloat(s, 64); err == nil && f >= 0 && f < math.MaxInt32 {
		return int(f)
	}
	return 0
}
