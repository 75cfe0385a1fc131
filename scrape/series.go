package scrape

import (
	"math"
	"slices"
	"strconv"

	dto "github.com/prometheus/client_model/go"
)

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
