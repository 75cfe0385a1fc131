// Package scrape reads the engines' own view of their load: the queue, the
// running batch, KV memory in use and its size, resident LoRA adapters and
// prefix cache hits, from vLLM's or SGLang's Prometheus /metrics, and the
// served models from /v1/models. The router's own accounting (package router)
// knows only what it routed; the engine also sees work that came another
// way (another router replica, a direct client) and what it actually holds.
//
// How the policy combines the two, without counting anything twice: a
// scrape is a snapshot of the engine at (about) EngineSignals.ScrapedAt,
// the moment the request was sent. Work the router charged before that
// moment is in the snapshot (it reached the engine, or finished); work it
// charged since is not. So the current estimate is the snapshot plus the
// charges made since ScrapedAt (EngineSignals.plusRouted). Comparing
// times works; cumulative counters work without clocks: give the scraper
// a Mark function returning the router's cumulative charges to a dial
// (requests and KV tokens, a chargeMark), which it samples just before
// each request, and the charges since the scrape are the current counters
// minus EngineSignals.Mark (chargeMark.since). Either way the window in
// which a request can be counted twice (routed after the request was
// sent, and rendered into the exposition) is one scrape latency,
// milliseconds.
//
// Failures never block routing: signals reads an atomic pointer, fetches
// run on the scraper's own goroutines with a timeout, and a target that
// fails simply ages until signals reports it stale, at which point the
// policy falls back to its own tracking.
package scrape

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"go.uber.org/zap"
)

// Engines whose metrics are understood.
const (
	engineVLLM   = "vllm"
	engineSGLang = "sglang"
)

// vLLM metric names (vllm/v1/metrics/loggers.py). Every per-engine series
// carries {model_name, engine}, engine being the data parallel rank.
const (
	vllmRunning       = "vllm:num_requests_running"
	vllmWaiting       = "vllm:num_requests_waiting"
	vllmKVUsage       = "vllm:kv_cache_usage_perc"
	vllmKVUsageLegacy = "vllm:gpu_cache_usage_perc" // before 0.9.2; removed in 0.12
	vllmPrefixQueries = "vllm:prefix_cache_queries_total"
	vllmPrefixHits    = "vllm:prefix_cache_hits_total"
	vllmCacheConfig   = "vllm:cache_config_info"
	vllmLoRAInfo      = "vllm:lora_requests_info"
	vllmRankLabel     = "engine"
)

// SGLang metric names (python/sglang/srt/metrics/collector.py). Series
// carry {model_name, engine_type, tp_rank, pp_rank, moe_ep_rank} and, with
// data parallel attention, dp_rank. Only attention-TP rank 0 reports
// unless --enable-metrics-for-all-schedulers, in which case the other TP
// ranks repeat the same figures; taking the maximum within a rank, never
// the sum, keeps them from being counted more than once.
const (
	sglangRunning     = "sglang:num_running_reqs"
	sglangWaiting     = "sglang:num_queue_reqs"
	sglangKVUsage     = "sglang:token_usage"
	sglangMaxTokens   = "sglang:max_total_num_tokens"
	sglangCacheConfig = "sglang:cache_config_info" // {page_size, num_pages}, as llm-d reads it
	sglangHitRate     = "sglang:cache_hit_rate"
	sglangLoRASlots   = "sglang:lora_pool_slots_total"
	sglangRankLabel   = "dp_rank"
)

// Scraper defaults and bounds.
const (
	defaultScrapeInterval  = time.Second
	MinInterval            = 100 * time.Millisecond
	defaultModelsInterval  = 10 * time.Second
	defaultSlowInterval    = 10 * time.Second
	defaultMetricsPath     = "/metrics"
	defaultModelsPath      = "/v1/models"
	defaultScrapeWorkers   = 64
	maxExpositionBytes     = 8 << 20 // real vLLM expositions are ~100-300 KB
	maxModelsBytes         = 4 << 20
	scrapeAcceptHeader     = "text/plain;version=0.0.4;q=1,*/*;q=0.1"
	defaultStaleIntervals  = 3 // signals older than this many intervals are stale by default
	maxScrapeErrorMessages = 256
)

// errNoEngineMetrics says an exposition parsed but held neither vLLM's nor
// SGLang's metrics.
var errNoEngineMetrics = errors.New("no vllm: or sglang: engine metrics in the exposition")

// errMalformedExposition says the Prometheus text parser rejected an
// exposition (after it was read whole).
var errMalformedExposition = errors.New("parsing metrics exposition")

// errExpositionTooLarge says a response body exceeded its size cap.
var errExpositionTooLarge = errors.New("response body too large")

// ModelInfo is one entry of an engine's /v1/models: a base model (Parent
// empty) or a LoRA adapter (Parent is its base model, Root its path).
type ModelInfo struct {
	// ID is the name requests use in their "model" field.
	ID string `json:"id"`
	// Parent is the base model of an adapter, empty for a base model.
	Parent string `json:"parent,omitempty"`
	// Root is the model's origin: the base model's name or the adapter's
	// path.
	Root string `json:"root,omitempty"`
}

// Signals is one engine's state as its /metrics (and /v1/models)
// reported it. Counts are summed over data parallel ranks (vLLM's engine
// label, SGLang's dp_rank) and model names; a figure the engine did not
// report is -1 (counts) or flagged unknown. The slices are shared between
// readers and must not be modified.
type Signals struct {
	// Engine is "vllm" or "sglang".
	Engine string
	// Running is the number of requests in the running batch, -1 when not
	// reported.
	Running int
	// Waiting is the number of requests queued in the engine, -1 when not
	// reported.
	Waiting int
	// KVUsage is the fraction of KV cache memory in use, 0..1 (averaged
	// over ranks, weighted by their capacity when known). Valid when
	// KVKnown.
	KVUsage float64
	// KVKnown says whether KVUsage was reported.
	KVKnown bool
	// BlockSize is the number of tokens in one KV block (SGLang: a page;
	// 1 when only its token total is known). 0 when unknown.
	BlockSize int
	// NumGPUBlocks is the number of KV blocks over all ranks, so the KV
	// capacity in tokens is BlockSize × NumGPUBlocks. 0 when unknown.
	NumGPUBlocks int
	// MaxLoRAs is the number of adapter slots (vLLM --max-loras, SGLang
	// max_loras_per_batch), 0 when unknown.
	MaxLoRAs int
	// AdaptersKnown says RunningAdapters and WaitingAdapters were reported
	// (vLLM with --enable-lora).
	AdaptersKnown bool
	// RunningAdapters are the adapters of running requests: resident on
	// the GPU. Adapters loaded but idle are not listed by vLLM.
	RunningAdapters []string
	// WaitingAdapters are the adapters of waiting requests.
	WaitingAdapters []string
	// PrefixQueries and PrefixHits are vLLM's cumulative prefix cache
	// counters, in tokens; -1 when not reported.
	PrefixQueries, PrefixHits float64
	// PrefixHitRate is the recent prefix cache hit rate, 0..1, or -1 when
	// unknown: SGLang's cache_hit_rate gauge, or for vLLM the ratio of the
	// counters' increase between the last two scrapes that read them
	// (set by the scraper).
	PrefixHitRate float64
	// Models are the models the engine serves, from /v1/models; nil when
	// not fetched yet (then any model is assumed servable).
	Models []ModelInfo
	// ScrapedAt is when the metrics request was sent: the snapshot
	// includes the work routed before it and not the work routed after.
	ScrapedAt time.Time
	// Mark is what the scraper's Mark function returned for this dial
	// just before the request was sent (zero without one).
	Mark Mark
	// Seq counts successful scrapes of this dial, from 1.
	Seq uint64

	// kvByRank and rankCapacity are the KV usage and capacity (tokens) of
	// each data parallel rank, so that a scrape without the capacity
	// (vLLM's slow cache_config_info) can weight the ranks as the last one
	// with it did.
	kvByRank     groups
	rankCapacity map[string]float64
}

// Mark is a snapshot of the router's cumulative charges to one
// upstream: every request it routed there and the KV tokens (prompt plus
// expected output) it charged for them. Both only grow.
type Mark struct {
	// Requests counts the requests routed to the upstream.
	Requests uint64
	// KVTokens sums the KV tokens charged for them.
	KVTokens uint64
	// InFlight is how many of them were unfinished at the time, so that
	// the engine's request counts can be split into the router's own and
	// foreign ones.
	InFlight int
}

// Since returns the charges made between old and m, for
// EngineSignals.plusRouted.
func (m Mark) Since(old Mark) (requests, kvTokens int) {
	if m.Requests >= old.Requests {
		requests = int(min(m.Requests-old.Requests, math.MaxInt32))
	}
	if m.KVTokens >= old.KVTokens {
		kvTokens = int(min(m.KVTokens-old.KVTokens, math.MaxInt32))
	}
	return requests, kvTokens
}

// KVCapacityTokens returns the engine's KV cache size in tokens, 0 when
// unknown.
func (s Signals) KVCapacityTokens() int {
	if s.BlockSize <= 0 || s.NumGPUBlocks <= 0 {
		return 0
	}
	return s.BlockSize * s.NumGPUBlocks
}

// FreeKVTokens returns the engine's free KV cache in tokens, or -1 when
// its usage or capacity is unknown (scorer.Candidate.FreeKVTokens).
func (s Signals) FreeKVTokens() int {
	c := s.KVCapacityTokens()
	if !s.KVKnown || c == 0 {
		return -1
	}
	return max(0, int(math.Floor((1-s.KVUsage)*float64(c))))
}

// ModelIDs returns the IDs of the served models, nil when unknown
// (scorer.Candidate.Models).
func (s Signals) ModelIDs() []string {
	if s.Models == nil {
		return nil
	}
	ids := make([]string, len(s.Models))
	for i, m := range s.Models {
		ids[i] = m.ID
	}
	return ids
}

// PlusRouted returns s corrected for the work the router sent since the
// scrape: requests more requests waiting and kvTokens more KV in use. The
// caller counts only charges made at or after s.ScrapedAt (or since
// s.Mark), which the snapshot cannot contain, so nothing is counted twice;
// requests that also finished since make the estimate pessimistic until
// the next scrape, never optimistic.
func (s Signals) PlusRouted(requests, kvTokens int) Signals {
	if s.Waiting >= 0 && requests > 0 {
		s.Waiting += requests
	}
	if c := s.KVCapacityTokens(); s.KVKnown && c > 0 && kvTokens > 0 {
		s.KVUsage = min(1, s.KVUsage+float64(kvTokens)/float64(c))
	}
	return s
}

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

// wholeProbeIntervals is how many slow intervals a target asked for its
// whole exposition waits before the filtered query is tried again.
const wholeProbeIntervals = 6

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
	modeNamed      metricsMode = iota // metrics_path?name[]=…
	modeNamedBelow                    // metrics_path/?name[]=…
	modeWhole                         // metrics_path
	numMetricsModes
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
	for name := range engineFamilies {
		if !q.skipSlow || !slowFamilies[name] {
			names = append(names, name)
		}
	}
	slices.Sort(names)
	if hasQuery {
		query += "&"
	}
	return path + "?" + query + url.Values{"name[]": names}.Encode()
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

// vllmSignals fills sig from vLLM's families.
func vllmSignals(families map[string]*dto.MetricFamily, sig *Signals) {
	if g := rankGroups(families[vllmRunning], vllmRankLabel); g != nil {
		sig.Running = int(g.sum())
	}
	if g := rankGroups(families[vllmWaiting], vllmRankLabel); g != nil {
		sig.Waiting = int(g.sum())
	}
	if g := rankGroups(families[vllmPrefixQueries], vllmRankLabel); g != nil {
		sig.PrefixQueries = g.sum()
	}
	if g := rankGroups(families[vllmPrefixHits], vllmRankLabel); g != nil {
		sig.PrefixHits = g.sum()
	}

	// Capacity: one cache_config_info series per engine, the figures in
	// its labels. num_gpu_blocks is "None" before the engine profiled.
	var capacity map[string]float64 // tokens by rank; none when cache_config_info was skipped
	for _, m := range metricsOf(families[vllmCacheConfig]) {
		bs := labelInt(m, "block_size")
		tokens := labelInt(m, "num_gpu_blocks") * bs
		if tokens <= 0 {
			tokens = labelInt(m, "kv_cache_size_tokens")
		}
		if bs <= 0 || tokens <= 0 {
			continue
		}
		sig.BlockSize = max(sig.BlockSize, bs)
		rank := labelValue(m, vllmRankLabel)
		if capacity == nil {
			capacity = map[string]float64{}
		}
		capacity[rank] = max(capacity[rank], float64(tokens))
	}
	setCapacity(sig, capacity)

	usage := rankGroups(families[vllmKVUsage], vllmRankLabel)
	if usage == nil {
		usage = rankGroups(families[vllmKVUsageLegacy], vllmRankLabel)
	}
	if usage != nil {
		sig.KVUsage, sig.KVKnown = clamp01(usage.weightedMean(capacity)), true
		sig.kvByRank, sig.rankCapacity = usage, capacity
	}

	// LoRA: the series' value is the time it was set; the newest wins.
	// Only emitted with --enable-lora.
	var newest *dto.Metric
	newestAt := math.Inf(-1)
	for _, m := range metricsOf(families[vllmLoRAInfo]) {
		if v, ok := sampleValue(m); ok && v > newestAt {
			newest, newestAt = m, v
		}
	}
	if newest != nil {
		sig.AdaptersKnown = true
		sig.MaxLoRAs = labelInt(newest, "max_lora")
		sig.RunningAdapters = splitAdapters(labelValue(newest, "running_lora_adapters"))
		sig.WaitingAdapters = splitAdapters(labelValue(newest, "waiting_lora_adapters"))
	}
}

// sglangSignals fills sig from SGLang's families.
func sglangSignals(families map[string]*dto.MetricFamily, sig *Signals) {
	if g := rankGroups(families[sglangRunning], sglangRankLabel); g != nil {
		sig.Running = int(g.sum())
	}
	if g := rankGroups(families[sglangWaiting], sglangRankLabel); g != nil {
		sig.Waiting = int(g.sum())
	}

	// Capacity: pages when cache_config_info reports them, else the token
	// pool size (SGLang's default page size is 1).
	capacity := make(map[string]float64)
	for _, m := range metricsOf(families[sglangCacheConfig]) {
		ps, pages := labelInt(m, "page_size"), labelInt(m, "num_pages")
		if ps <= 0 || pages <= 0 {
			continue
		}
		sig.BlockSize = max(sig.BlockSize, ps)
		rank := labelValue(m, sglangRankLabel)
		capacity[rank] = max(capacity[rank], float64(ps*pages))
	}
	if len(capacity) == 0 {
		if g := rankGroups(families[sglangMaxTokens], sglangRankLabel); g != nil {
			sig.BlockSize = 1
			capacity = g.byRank()
		}
	}
	setCapacity(sig, capacity)

	if g := rankGroups(families[sglangKVUsage], sglangRankLabel); g != nil {
		sig.KVUsage, sig.KVKnown = clamp01(g.weightedMean(capacity)), true
	}
	if g := rankGroups(families[sglangHitRate], sglangRankLabel); g != nil {
		sig.PrefixHitRate = clamp01(g.weightedMean(nil))
	}
	if g := rankGroups(families[sglangLoRASlots], sglangRankLabel); g != nil {
		sig.MaxLoRAs = int(g.max())
	}
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

// splitAdapters splits vLLM's comma-joined adapter list, dropping empty
// names.
func splitAdapters(s string) []string {
	if s == "" {
		return []string{}
	}
	parts := strings.Split(s, ",")
	out := parts[:0]
	for _, p := range parts {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}

// clamp01 bounds a fraction to 0..1.
func clamp01(v float64) float64 { return min(1, max(0, v)) }

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

// Config configures a scraper. Zero values mean the defaults.
type Config struct {
	// Interval is the time between scrapes of each target. Default 1s,
	// minimum 100ms.
	Interval time.Duration
	// Timeout bounds one fetch. Default Interval.
	Timeout time.Duration
	// ModelsInterval is the time between fetches of /v1/models. Default
	// 10s; negative disables them.
	ModelsInterval time.Duration
	// SlowInterval is the time between reads of slowFamilies. Default
	// 10s, never less than Interval.
	SlowInterval time.Duration
	// MetricsPath is the metrics endpoint's path. Default /metrics.
	MetricsPath string
	// ModelsPath is the models endpoint's path. Default /v1/models.
	ModelsPath string
	// Scheme is the URL scheme of the targets. Default http.
	Scheme string
	// Workers bounds the fetches in flight at once. Default 64: a round's
	// fetches in flight together cost less CPU each than one after
	// another, since the runtime's network poller wakes for many at once.
	Workers int
	// Client makes the requests. Default: a client of its own that keeps
	// connections alive, ignores proxy environment variables and does not
	// ask for compression (cheaper on both ends at these sizes).
	Client *http.Client
	// Mark, when set, is called with the dial just before each metrics
	// request is sent; its result is stored in EngineSignals.Mark. The
	// policy passes its cumulative charges to the dial, so that the
	// charges made since the scrape are now.since(sig.Mark).
	Mark func(dial string) Mark
	// Logger receives scrape failures and recoveries at debug level.
	Logger *zap.Logger
}

// withDefaults returns c with defaults filled in and bounds applied.
func (c Config) withDefaults() Config {
	if c.Interval <= 0 {
		c.Interval = defaultScrapeInterval
	}
	c.Interval = max(c.Interval, MinInterval)
	if c.Timeout <= 0 {
		c.Timeout = c.Interval
	}
	if c.ModelsInterval == 0 {
		c.ModelsInterval = defaultModelsInterval
	}
	if c.SlowInterval <= 0 {
		c.SlowInterval = defaultSlowInterval
	}
	c.SlowInterval = max(c.SlowInterval, c.Interval)
	if c.MetricsPath == "" {
		c.MetricsPath = defaultMetricsPath
	}
	if c.ModelsPath == "" {
		c.ModelsPath = defaultModelsPath
	}
	if c.Scheme == "" {
		c.Scheme = "http"
	}
	if c.Workers <= 0 {
		c.Workers = defaultScrapeWorkers
	}
	if c.Logger == nil {
		c.Logger = zap.NewNop()
	}
	return c
}

// Status is a target's scrape health, for the admin API and logs.
type Status struct {
	// Dial is the target's dial address.
	Dial string `json:"dial"`
	// Scrapes counts successful metrics scrapes.
	Scrapes uint64 `json:"scrapes"`
	// Errors counts failed metrics scrapes.
	Errors uint64 `json:"errors"`
	// ConsecutiveErrors counts failures since the last success.
	ConsecutiveErrors int `json:"consecutive_errors"`
	// LastSuccess is when the last successful scrape was sent.
	LastSuccess time.Time `json:"last_success,omitzero"`
	// LastError is the last failure's message (never request content).
	LastError string `json:"last_error,omitempty"`
	// LastErrorAt is when the last failure happened.
	LastErrorAt time.Time `json:"last_error_at,omitzero"`
	// ModelsError is the last /v1/models failure, cleared by a success.
	ModelsError string `json:"models_error,omitempty"`
}

// scrapeTarget is one upstream being scraped.
type scrapeTarget struct {
	dial      string
	modelsURL string
	// metricsURLs are the metrics URLs of each metricsQuery, by index.
	metricsURLs [numMetricsQueries]string
	// metricsRequests are the metrics GETs of each metricsQuery, by index,
	// as sent on a kept-alive connection (plain HTTP only); nil to go
	// through the http.Client.
	metricsRequests [numMetricsQueries][]byte

	// conn is the target's own kept-alive connection for metrics, used
	// by one fetch at a time (busy), closed when the target goes.
	connMu sync.Mutex
	conn   *bufferedConn
	closed bool

	// latest is the last successful scrape, read without locks.
	latest atomic.Pointer[Signals]

	// mu guards the fields below.
	mu        sync.Mutex
	busy      bool // a fetch is in flight
	status    Status
	models    []ModelInfo
	modelsDue time.Time
	// mode is how the metrics are asked for; see metricsMode. In
	// modeWhole the filtered query is tried again from probeDue on.
	mode     metricsMode
	probeDue time.Time
	// slow holds the figures of the slow families last read, until
	// slowDue.
	slow    Signals
	slowDue time.Time
}

// Scraper polls the engines' metrics (and model lists) of a set of
// upstreams in the background and keeps the latest EngineSignals of
// each. One scraper belongs to one policy instance: the policy creates it
// in Provision, gives it its static upstreams with setTargets, starts it
// with the caddy.Context (it stops when the config is unloaded) and reads
// signals while routing. A reload builds a new scraper, which scrapes at
// once; until its first results the policy uses its own tracking.
type Scraper struct {
	cfg        Config
	client     *http.Client
	ownsClient bool

	mu      sync.RWMutex
	targets map[string]*scrapeTarget

	kick    chan struct{} // asks for a round now
	done    chan struct{} // closed when the run loop has stopped
	started atomic.Bool
}

// New returns a scraper with cfg (defaults filled in). It does
// nothing until start.
func New(cfg Config) *Scraper {
	cfg = cfg.withDefaults()
	s := &Scraper{
		cfg:     cfg,
		client:  cfg.Client,
		targets: make(map[string]*scrapeTarget),
		kick:    make(chan struct{}, 1),
		done:    make(chan struct{}),
	}
	if s.client == nil {
		tr := http.DefaultTransport.(*http.Transport).Clone()
		tr.Proxy = nil // upstreams are dialled directly, as reverse_proxy does
		tr.DisableCompression = true
		tr.MaxIdleConnsPerHost = 2
		tr.MaxIdleConns = 0
		tr.ForceAttemptHTTP2 = false
		tr.ReadBufferSize = 64 << 10 // an exposition in a few reads, not dozens
		s.client = &http.Client{Transport: tr}
		s.ownsClient = true
	}
	return s
}

// SetTargets replaces the set of dials scraped. New dials are scraped at
// once; dropped ones are forgotten with their signals. Dials that are not
// host:port addresses (unix sockets) are skipped.
func (s *Scraper) SetTargets(dials []string) {
	s.mu.Lock()
	keep := make(map[string]bool, len(dials))
	added := false
	for _, d := range dials {
		keep[d] = true
		added = s.addLocked(d) || added
	}
	for d, t := range s.targets {
		if !keep[d] {
			t.closeConn()
			delete(s.targets, d)
		}
	}
	s.mu.Unlock()
	if added {
		s.poke()
	}
}

// AddTargets adds dials not scraped yet and scrapes them at once, leaving
// the others alone. It is cheap when every dial is already a target, so
// the policy may call it with each pool it sees (dynamic upstreams);
// only setTargets removes targets.
func (s *Scraper) AddTargets(dials ...string) {
	s.mu.RLock()
	missing := false
	for _, d := range dials {
		if _, ok := s.targets[d]; !ok && scrapable(d) {
			missing = true
			break
		}
	}
	s.mu.RUnlock()
	if !missing {
		return
	}
	s.mu.Lock()
	added := false
	for _, d := range dials {
		added = s.addLocked(d) || added
	}
	s.mu.Unlock()
	if added {
		s.poke()
	}
}

// addLocked adds dial as a target if it is new and scrapable, and says
// whether it did. Caller holds s.mu for writing.
func (s *Scraper) addLocked(d string) bool {
	if _, ok := s.targets[d]; ok || !scrapable(d) {
		return false
	}
	base := s.cfg.Scheme + "://" + d
	t := &scrapeTarget{dial: d, modelsURL: base + s.cfg.ModelsPath, status: Status{Dial: d}}
	for mode := range numMetricsModes {
		for _, skipSlow := range []bool{false, true} {
			q := metricsQuery{mode, skipSlow}
			path := q.path(s.cfg.MetricsPath)
			t.metricsURLs[q.index()] = base + path
			if s.cfg.Scheme == "http" && s.ownsClient {
				t.metricsRequests[q.index()] = []byte("GET " + path + " HTTP/1.1\r\nHost: " + d +
					"\r\nAccept: " + scrapeAcceptHeader + "\r\nUser-Agent: caddy-llm-affinity\r\n\r\n")
			}
		}
	}
	s.targets[d] = t
	return true
}

// scrapable says whether dial is a host:port the scraper can reach (not
// empty, not a unix socket).
func scrapable(dial string) bool {
	return dial != "" && !strings.Contains(dial, "/")
}

// poke asks the run loop for a round now.
func (s *Scraper) poke() {
	select {
	case s.kick <- struct{}{}:
	default:
	}
}

// Start runs the scraper in the background until ctx is done. Calling it
// again does nothing.
func (s *Scraper) Start(ctx context.Context) {
	if !s.started.CompareAndSwap(false, true) {
		return
	}
	go s.run(ctx)
}

// Stopped returns a channel closed once the scraper has stopped and its
// fetches have returned.
func (s *Scraper) Stopped() <-chan struct{} { return s.done }

// run is the scraper's loop: a round at start, then one per interval
// (and whenever targets are added), each handing the idle targets to a
// fixed pool of workers.
func (s *Scraper) run(ctx context.Context) {
	defer close(s.done)
	jobs := make(chan *scrapeTarget)
	var wg sync.WaitGroup
	for range s.cfg.Workers {
		wg.Go(func() {
			for t := range jobs {
				s.scrape(ctx, t)
			}
		})
	}
	defer func() {
		close(jobs)
		wg.Wait()
		if s.ownsClient {
			s.client.CloseIdleConnections()
		}
		s.mu.RLock()
		for _, t := range s.targets {
			t.closeConn()
		}
		s.mu.RUnlock()
	}()

	ticker := time.NewTicker(s.cfg.Interval)
	defer ticker.Stop()
	for {
		s.round(ctx, jobs)
		select {
		case <-ctx.Done():
			return
		case <-ticker.C:
		case <-s.kick:
		}
	}
}

// round hands every target without a fetch in flight to the workers.
func (s *Scraper) round(ctx context.Context, jobs chan<- *scrapeTarget) {
	s.mu.RLock()
	ts := make([]*scrapeTarget, 0, len(s.targets))
	for _, t := range s.targets {
		ts = append(ts, t)
	}
	s.mu.RUnlock()
	for _, t := range ts {
		t.mu.Lock()
		if t.busy {
			t.mu.Unlock()
			continue
		}
		t.busy = true
		t.mu.Unlock()
		select {
		case jobs <- t:
		case <-ctx.Done():
			t.mu.Lock()
			t.busy = false
			t.mu.Unlock()
			return
		}
	}
}

// scrape fetches t's metrics (and models when due) and records the
// outcome.
func (s *Scraper) scrape(ctx context.Context, t *scrapeTarget) {
	start := time.Now()
	t.mu.Lock()
	skipSlow := t.slow.NumGPUBlocks > 0 && start.Before(t.slowDue)
	mode := t.mode
	if mode == modeWhole && !start.Before(t.probeDue) {
		// Now and then ask for less again: the engine behind the dial may
		// have changed.
		mode, t.mode, t.probeDue = modeNamed, modeNamed, start.Add(wholeProbeIntervals*s.cfg.SlowInterval)
	}
	t.mu.Unlock()
	sig, err := s.fetchMetricsMode(ctx, t, mode, skipSlow)
	if err == nil {
		start = sig.ScrapedAt
	}
	if err != nil && ctx.Err() != nil {
		t.mu.Lock()
		t.busy = false
		t.mu.Unlock()
		return // shutting down: not the upstream's fault
	}

	t.mu.Lock()
	modelsDue := err == nil && s.cfg.ModelsInterval > 0 && !start.Before(t.modelsDue)
	if modelsDue {
		t.modelsDue = start.Add(s.cfg.ModelsInterval)
	}
	t.mu.Unlock()

	var models []ModelInfo
	var modelsErr error
	if modelsDue {
		models, modelsErr = s.fetchModels(ctx, t.modelsURL)
	}

	t.mu.Lock()
	defer t.mu.Unlock()
	t.busy = false
	st := &t.status
	if err != nil {
		st.Errors++
		st.ConsecutiveErrors++
		st.LastError, st.LastErrorAt = truncate(err.Error(), maxScrapeErrorMessages), time.Now()
		if st.ConsecutiveErrors == 1 {
			s.cfg.Logger.Debug("engine metrics scrape failing", zap.String("upstream", t.dial), zap.Error(err))
		}
		return
	}
	if st.ConsecutiveErrors > 0 {
		s.cfg.Logger.Debug("engine metrics scrape recovered", zap.String("upstream", t.dial),
			zap.Int("failures", st.ConsecutiveErrors))
	}
	st.Scrapes++
	st.ConsecutiveErrors = 0
	st.LastSuccess = start
	if modelsDue {
		if modelsErr != nil {
			st.ModelsError = truncate(modelsErr.Error(), maxScrapeErrorMessages)
		} else {
			st.ModelsError = ""
			t.models = models
		}
	}

	switch {
	case skipSlow && sig.Engine == t.slow.Engine:
		sig.carrySlow(t.slow)
	case skipSlow:
		// Another engine answers on this dial now: read everything from
		// it next time.
		t.slow = Signals{}
	default:
		if sig.Engine == engineVLLM && t.slow.Engine == engineVLLM {
			sig.PrefixHitRate = hitRateSince(t.slow, sig)
		}
		t.slow = sig
		t.slowDue = start.Add(s.cfg.SlowInterval)
	}
	sig.Models = t.models
	sig.Seq = st.Scrapes
	t.latest.Store(&sig)
}

// carrySlow copies the figures of the slow families from slow, the last
// scrape of the same engine that read them.
func (s *Signals) carrySlow(slow Signals) {
	if s.Engine == engineVLLM { // SGLang's capacity is read every scrape
		s.BlockSize, s.NumGPUBlocks = slow.BlockSize, slow.NumGPUBlocks
		s.PrefixQueries, s.PrefixHits = slow.PrefixQueries, slow.PrefixHits
		if s.KVKnown && len(slow.rankCapacity) > 0 {
			s.rankCapacity = slow.rankCapacity
			s.KVUsage = clamp01(s.kvByRank.weightedMean(s.rankCapacity))
		}
	}
	s.PrefixHitRate = slow.PrefixHitRate
}

// hitRateSince returns vLLM's prefix cache hit rate between two scrapes:
// the previous rate when no tokens were queried in between, -1 when the
// counters are missing or were reset.
func hitRateSince(prev, cur Signals) float64 {
	if prev.PrefixQueries < 0 || cur.PrefixQueries < 0 || prev.PrefixHits < 0 || cur.PrefixHits < 0 {
		return -1
	}
	dq, dh := cur.PrefixQueries-prev.PrefixQueries, cur.PrefixHits-prev.PrefixHits
	switch {
	case dq < 0 || dh < 0: // engine restarted
		return -1
	case dq == 0:
		return prev.PrefixHitRate
	}
	return clamp01(dh / dq)
}

// fetchMetricsMode fetches t's metrics asking as mode says, and moves the
// target to another mode when the engine's answer says so (see
// metricsMode): on to modeNamedBelow when it sent more than was asked for
// or redirected, and to modeWhole, asking again at once, when the
// filtered answer had no engine metrics or the path below was refused.
// Network errors, timeouts and 5xx answers say nothing about the query
// and change nothing. Each attempt takes its own charge mark and time.
func (s *Scraper) fetchMetricsMode(ctx context.Context, t *scrapeTarget, mode metricsMode, skipSlow bool) (Signals, error) {
	for {
		var mark Mark
		if s.cfg.Mark != nil {
			mark = s.cfg.Mark(t.dial)
		}
		sig, dropped, err := s.fetchMetricsQuery(ctx, t, metricsQuery{mode, skipSlow}, time.Now())
		sig.Mark = mark
		next := mode
		var status *statusError
		switch {
		case mode == modeWhole || ctx.Err() != nil:
		case err == nil && dropped > 0:
			// The engine ignored the query: a usable answer, but the
			// next scrape asks one level down (or for everything).
			next++
		case err == nil:
		case mode == modeNamed && errors.As(err, &status) && status.code/100 == 3:
			next = modeNamedBelow // /metrics redirects to /metrics/
		case errors.Is(err, errNoEngineMetrics) || errors.Is(err, errMalformedExposition),
			mode == modeNamedBelow && errors.As(err, &status) && status.code/100 != 5:
			next = modeWhole
		}
		if next != mode {
			t.mu.Lock()
			t.mode = next
			if next == modeWhole {
				t.probeDue = time.Now().Add(wholeProbeIntervals * s.cfg.SlowInterval)
			}
			t.mu.Unlock()
			s.cfg.Logger.Debug("engine metrics: asking differently", zap.String("upstream", t.dial),
				zap.String("path", metricsQuery{next, skipSlow}.path(s.cfg.MetricsPath)))
			if err != nil {
				mode = next
				continue // ask again, now
			}
		}
		return sig, err
	}
}

// statusError is a metrics answer other than 200.
type statusError struct {
	url  string
	code int
}

func (e *statusError) Error() string { return fmt.Sprintf("GET %s: status %d", e.url, e.code) }

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

// truncate shortens s to at most n bytes.
func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n]
}

// Latest returns dial's latest signals. ok is false when there are none
// or they are older than maxAge at now (maxAge ≤ 0 means three scrape
// intervals); the caller then relies on its own tracking. It never
// blocks on a fetch.
func (s *Scraper) Latest(dial string, now time.Time, maxAge time.Duration) (Signals, bool) {
	if s == nil {
		return Signals{}, false
	}
	s.mu.RLock()
	t := s.targets[dial]
	s.mu.RUnlock()
	if t == nil {
		return Signals{}, false
	}
	p := t.latest.Load()
	if p == nil {
		return Signals{}, false
	}
	if maxAge <= 0 {
		maxAge = defaultStaleIntervals * s.cfg.Interval
	}
	if now.Sub(p.ScrapedAt) > maxAge {
		return *p, false
	}
	return *p, true
}

// Seq returns how many successful scrapes of dial there have been,
// 0 when none: a cheap way to see that new signals arrived.
func (s *Scraper) Seq(dial string) uint64 {
	if s == nil {
		return 0
	}
	s.mu.RLock()
	t := s.targets[dial]
	s.mu.RUnlock()
	if t == nil {
		return 0
	}
	if p := t.latest.Load(); p != nil {
		return p.Seq
	}
	return 0
}

// StatusOf returns dial's scrape health.
func (s *Scraper) StatusOf(dial string) (Status, bool) {
	if s == nil {
		return Status{}, false
	}
	s.mu.RLock()
	t := s.targets[dial]
	s.mu.RUnlock()
	if t == nil {
		return Status{}, false
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.status, true
}

// Statuses returns every target's scrape health, ordered by dial.
func (s *Scraper) Statuses() []Status {
	if s == nil {
		return nil
	}
	s.mu.RLock()
	ts := make([]*scrapeTarget, 0, len(s.targets))
	for _, t := range s.targets {
		ts = append(ts, t)
	}
	s.mu.RUnlock()
	out := make([]Status, 0, len(ts))
	for _, t := range ts {
		t.mu.Lock()
		out = append(out, t.status)
		t.mu.Unlock()
	}
	slices.SortFunc(out, func(a, b Status) int { return strings.Compare(a.Dial, b.Dial) })
	return out
}
