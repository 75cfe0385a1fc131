package scrape

import (
	"math"
	"slices"

	dto "github.com/prometheus/client_model/go"
)

// engine is how one engine's exposition maps to Signals: a table with a
// row per metric family read, saying which figure it feeds and how its
// series combine, as llm-d's per-engine metric mappings do. Adding an
// engine is adding its table to engines.
type engine struct {
	// name is Signals.Engine.
	name string
	// prefix starts the name of every family the engine exposes.
	prefix string
	// rankLabel names the data parallel rank. An engine instance is a
	// model_name and a rank; figures are combined over instances.
	rankLabel string
	// metrics are the families read, in the order they are applied:
	// capacity before the KV usage it weighs, a family before its
	// fallback (the first to have a usable series feeds the figure).
	metrics []metric
}

// metric is one row of an engine's table.
type metric struct {
	// family is the metric family's name.
	family string
	// into is the figure it feeds.
	into figure
	// by says how the instances' values combine. Within an instance the
	// series' maximum is taken first: series that differ only in other
	// labels (SGLang's tp_rank) repeat one figure.
	by combine
	// labels, when set, reads the family instead: an info family whose
	// figures are in its labels. It says whether it found any.
	labels func(x *extraction, series []*dto.Metric) bool
	// identifies says a usable value in this family marks the exposition
	// as this engine's.
	identifies bool
	// slow families are read every Config.SlowInterval only and carried
	// over in between (see engineFamilies).
	slow bool
}

// figure is what a metric feeds in Signals.
type figure uint8

const (
	running       figure = iota // Running
	waiting                     // Waiting
	kvCapacity                  // BlockSize, NumGPUBlocks and the ranks' weights for kvUsage
	kvUsage                     // KVUsage and KVKnown
	prefixQueries               // PrefixQueries
	prefixHits                  // PrefixHits
	prefixHitRate               // PrefixHitRate
	maxLoRAs                    // MaxLoRAs
	adapters                    // AdaptersKnown, RunningAdapters, WaitingAdapters (and MaxLoRAs)
	numFigures                  // the number of figures
)

// combine is how a figure is made of the values of an engine's
// instances (data parallel ranks, models).
type combine uint8

const (
	bySum        combine = iota // counts: every rank has its own
	byMax                       // a setting every rank repeats
	byMean                      // a fraction, each rank counting alike
	byCapacity                  // a fraction of KV memory, each rank weighed by its capacity (alike while unknown)
	byRankTokens                // KV capacity in tokens per rank, in blocks of one token
)

// processStartTime is the Prometheus clients' process collector's gauge of
// the process's start time, in Unix seconds: Python's prometheus_client
// exports it from the default registry (vLLM's with one API server;
// multiprocess mode has none), Go's from its process collector. Not an
// engine's own family (no engine's prefix starts it), it is read beside
// the tables, from whichever engine's exposition (keepEngineLines).
const processStartTime = "process_start_time_seconds"

// engines are the engines understood, in the order an exposition is
// tested against them.
var engines = []*engine{&vllmEngine, &sglangEngine}

// engineNamed returns the engine called name, nil if none is.
func engineNamed(name string) *engine {
	for _, e := range engines {
		if e.name == name {
			return e
		}
	}
	return nil
}

// extraction is the state of one exposition's extraction.
type extraction struct {
	sig *Signals
	// capacity is the KV capacity in tokens by rank, once read.
	capacity map[string]float64
	// fed says which figures a family has fed already.
	fed [numFigures]bool
	// keepRanks says the KV usage's weights are kept in the signals, for
	// the scrapes that skip a slow capacity family (carrySlow).
	keepRanks bool
}

// identifies says whether families hold a usable value of one of e's
// identifying families.
func (e *engine) identifies(families map[string]*dto.MetricFamily) bool {
	for _, m := range e.metrics {
		if !m.identifies {
			continue
		}
		for _, s := range metricsOf(families[m.family]) {
			if _, ok := sampleValue(s); ok {
				return true
			}
		}
	}
	return false
}

// extract fills sig from families, row by row.
func (e *engine) extract(families map[string]*dto.MetricFamily, sig *Signals) {
	x := extraction{sig: sig, keepRanks: e.slowCapacity()}
	for _, m := range e.metrics {
		f := families[m.family]
		if f == nil || x.fed[m.into] {
			continue
		}
		if m.labels != nil {
			x.fed[m.into] = m.labels(&x, f.GetMetric())
			continue
		}
		if g := rankGroups(f, e.rankLabel); g != nil {
			x.feed(m.into, m.by, g)
			x.fed[m.into] = true
		}
	}
	setCapacity(sig, x.capacity)
}

// feed sets figure into from the instances' values g, combined by by.
func (x *extraction) feed(into figure, by combine, g groups) {
	var v float64
	switch by {
	case bySum:
		v = g.sum()
	case byMax:
		v = g.max()
	case byMean:
		v = g.weightedMean(nil)
	case byCapacity:
		v = g.weightedMean(x.capacity)
	case byRankTokens:
		x.capacity, x.sig.BlockSize = g.byRank(), 1
		return
	}
	if math.IsNaN(v) || math.IsInf(v, 0) {
		return // finite samples can still add up to nothing usable
	}
	s := x.sig
	switch into {
	case running:
		s.Running = countOf(v)
	case waiting:
		s.Waiting = countOf(v)
	case kvUsage:
		s.KVUsage, s.KVKnown = clamp01(v), true
		if x.keepRanks {
			s.kvByRank, s.rankCapacity = g, x.capacity
		}
	case prefixQueries:
		s.PrefixQueries = v
	case prefixHits:
		s.PrefixHits = v
	case prefixHitRate:
		s.PrefixHitRate = clamp01(v)
	case maxLoRAs:
		s.MaxLoRAs = countOf(v)
	}
}

// addCapacity records a rank's KV capacity, for the labels readers of
// kvCapacity families: tokens in blocks of blockSize. A rank seen twice
// keeps its larger figure.
func (x *extraction) addCapacity(rank string, blockSize, tokens int) {
	x.sig.BlockSize = max(x.sig.BlockSize, blockSize)
	if x.capacity == nil {
		x.capacity = map[string]float64{}
	}
	x.capacity[rank] = max(x.capacity[rank], float64(tokens))
}

// slowCapacity says whether e's KV capacity is read from a slow family.
func (e *engine) slowCapacity() bool {
	return slices.ContainsFunc(e.metrics, func(m metric) bool { return m.into == kvCapacity && m.slow })
}

// reads says whether one of e's families feeds f.
func (e *engine) reads(f figure) bool {
	return slices.ContainsFunc(e.metrics, func(m metric) bool { return m.into == f })
}

// carrySlow copies into s, a scrape of e that skipped the slow families,
// their figures from slow, the last scrape of e that read them, and the
// prefix hit rate (read, or derived from the counters by the scraper).
func (e *engine) carrySlow(s *Signals, slow Signals) {
	for _, m := range e.metrics {
		if !m.slow {
			continue
		}
		switch m.into {
		case kvCapacity:
			s.BlockSize, s.NumGPUBlocks = slow.BlockSize, slow.NumGPUBlocks
			if s.KVKnown && len(slow.rankCapacity) > 0 {
				s.rankCapacity = slow.rankCapacity
				s.KVUsage = clamp01(s.kvByRank.weightedMean(s.rankCapacity))
			}
		case prefixQueries:
			s.PrefixQueries = slow.PrefixQueries
		case prefixHits:
			s.PrefixHits = slow.PrefixHits
		}
	}
	s.PrefixHitRate = slow.PrefixHitRate
}

// familySet maps the name of every family read to whether it is slow.
func familySet() map[string]bool {
	set := map[string]bool{processStartTime: false}
	for _, e := range engines {
		for _, m := range e.metrics {
			set[m.family] = m.slow
		}
	}
	return set
}

// maxCount bounds the counts an engine reports (requests, adapters): far
// beyond any engine's, and small enough that the router's arithmetic on
// them cannot overflow.
const maxCount = 1 << 24

// countOf converts a finite sample to a count within 0..maxCount.
func countOf(v float64) int { return int(min(maxCount, max(0, v))) }
