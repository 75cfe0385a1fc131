package llmbench

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"slices"
	"text/tabwriter"
)

// SeedRuns is one policy replayed once per router seed, the workload fixed:
// the spread of its figures is what the router's own random choices (ties,
// random, least_conn) account for.
type SeedRuns struct {
	Policy string    `json:"policy"`
	Runs   []Summary `json:"runs"`
}

// Goal tolerances (issue 17): the default strategy's TTFT p50 and p99 may
// be at most 3% above the best policy's, its E2E p99 5% above, its hit
// rate at least 95% of the best; and it may shed no more than any other
// policy.
const (
	GoalTTFTTolerance    = 1.03
	GoalE2ETolerance     = 1.05
	GoalHitRateTolerance = 0.95
)

// GoalCheck is one goal's verdict for the target policy.
type GoalCheck struct {
	// Metric names the figure: "TTFT p50", "TTFT p99", "E2E p99", "hit
	// rate" or "shed".
	Metric string `json:"metric"`
	// Best is the policy with the best median of that figure among the
	// others (empty when there are no others).
	Best string `json:"best"`
	// Target and BestRange are the [min, max] of the figure over the seeds.
	Target    [2]float64 `json:"target"`
	BestRange [2]float64 `json:"best_range"`
	// Met is true when the target's spread is within the tolerance of the
	// best's at both ends: its lowest value against the best's lowest and
	// its highest against the best's highest. Overlapping spreads where
	// the target's lie beyond the tolerance at either end do not count.
	Met bool `json:"met"`
}

// MarshalJSON writes the ranges with null where a figure has no value.
func (g GoalCheck) MarshalJSON() ([]byte, error) {
	return json.Marshal(struct {
		Metric    string       `json:"metric"`
		Best      string       `json:"best"`
		Target    [2]jsonFloat `json:"target"`
		BestRange [2]jsonFloat `json:"best_range"`
		Met       bool         `json:"met"`
	}{g.Metric, g.Best, [2]jsonFloat{jsonFloat(g.Target[0]), jsonFloat(g.Target[1])},
		[2]jsonFloat{jsonFloat(g.BestRange[0]), jsonFloat(g.BestRange[1])}, g.Met})
}

type goalMetric struct {
	name        string
	value       func(*Summary) float64
	tolerance   float64
	higherIsBet bool
}

var goalMetrics = []goalMetric{
	{"TTFT p50", func(s *Summary) float64 { return s.TTFTP50 }, GoalTTFTTolerance, false},
	{"TTFT p99", func(s *Summary) float64 { return s.TTFTP99 }, GoalTTFTTolerance, false},
	{"E2E p99", func(s *Summary) float64 { return s.E2EP99 }, GoalE2ETolerance, false},
	{"hit rate", func(s *Summary) float64 { return s.HitRate }, GoalHitRateTolerance, true},
	{"shed", func(s *Summary) float64 { return float64(s.Shed) }, 1, false},
}

// spread returns the [min, max] and the median of f over runs, treating a
// NaN (no value, e.g. nothing completed) as the worst value.
func spread(runs []Summary, f func(*Summary) float64, higherIsBetter bool) (lo, hi, median float64) {
	vs := make([]float64, 0, len(runs))
	for i := range runs {
		v := f(&runs[i])
		if math.IsNaN(v) {
			v = math.Inf(1)
			if higherIsBetter {
				v = math.Inf(-1)
			}
		}
		vs = append(vs, v)
	}
	if len(vs) == 0 {
		return math.NaN(), math.NaN(), math.NaN()
	}
	slices.Sort(vs)
	return vs[0], vs[len(vs)-1], vs[len(vs)/2]
}

// CheckGoals compares target's runs with every other policy's, one goal
// per figure. Sheds are compared with the least-shedding other policy
// (no tolerance); the rest with the policy of the best median.
func CheckGoals(target string, all []SeedRuns) []GoalCheck {
	var t *SeedRuns
	for i := range all {
		if all[i].Policy == target {
			t = &all[i]
		}
	}
	if t == nil {
		return nil
	}
	var checks []GoalCheck
	for _, m := range goalMetrics {
		tlo, thi, _ := spread(t.Runs, m.value, m.higherIsBet)
		g := GoalCheck{Metric: m.name, Target: [2]float64{tlo, thi}, Met: true}
		bestMedian := math.NaN()
		for i := range all {
			if all[i].Policy == target {
				continue
			}
			lo, hi, med := spread(all[i].Runs, m.value, m.higherIsBet)
			better := math.IsNaN(bestMedian) || med < bestMedian
			if m.higherIsBet {
				better = math.IsNaN(bestMedian) || med > bestMedian
			}
			if better {
				bestMedian, g.Best, g.BestRange = med, all[i].Policy, [2]float64{lo, hi}
			}
		}
		if g.Best != "" {
			blo, bhi := g.BestRange[0], g.BestRange[1]
			if m.higherIsBet {
				g.Met = tlo >= m.tolerance*blo && thi >= m.tolerance*bhi
			} else {
				g.Met = tlo <= m.tolerance*blo && thi <= m.tolerance*bhi
			}
		}
		checks = append(checks, g)
	}
	return checks
}

// WriteSpreadTable writes one line per policy like [WriteTable], each
// figure as min–max over the policy's seeds (one value when they agree).
func WriteSpreadTable(w io.Writer, all []SeedRuns) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "policy\tseeds\thit rate\tcold\tTTFT p50\tp90\tp99\tE2E p50\tp99\ttok/s\tmax/mean req\tshed\terrors\t")
	for _, p := range all {
		col := func(f func(*Summary) float64, format func(float64) string) string {
			lo, hi, _ := spread(p.Runs, f, false)
			a, b := format(lo), format(hi)
			if a == b {
				return a
			}
			return a + "–" + b
		}
		pct := func(v float64) string { return percent(v) }
		sec := func(v float64) string { return seconds(v) }
		num := func(d int) func(float64) string { return func(v float64) string { return number(v, d) } }
		fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t\n", p.Policy, len(p.Runs),
			col(func(s *Summary) float64 { return s.HitRate }, pct),
			col(func(s *Summary) float64 { return float64(s.Cold) }, num(0)),
			col(func(s *Summary) float64 { return s.TTFTP50 }, sec),
			col(func(s *Summary) float64 { return s.TTFTP90 }, sec),
			col(func(s *Summary) float64 { return s.TTFTP99 }, sec),
			col(func(s *Summary) float64 { return s.E2EP50 }, sec),
			col(func(s *Summary) float64 { return s.E2EP99 }, sec),
			col(func(s *Summary) float64 { return s.Throughput }, num(0)),
			col(func(s *Summary) float64 { return s.MaxMeanLoad }, num(2)),
			col(func(s *Summary) float64 { return float64(s.Shed) }, num(0)),
			col(func(s *Summary) float64 { return float64(s.Errors) }, num(0)))
	}
	return tw.Flush()
}

// WriteGoals writes the goal verdicts of target, one line each.
func WriteGoals(w io.Writer, target string, checks []GoalCheck) error {
	for _, g := range checks {
		verdict := "met"
		if !g.Met {
			verdict = "MISSED"
		}
		format := seconds
		switch g.Metric {
		case "hit rate":
			format = percent
		case "shed":
			format = func(v float64) string { return number(v, 0) }
		}
		rng := func(r [2]float64) string {
			if format(r[0]) == format(r[1]) {
				return format(r[0])
			}
			return format(r[0]) + "–" + format(r[1])
		}
		against := "against " + g.Best + " " + rng(g.BestRange)
		if g.Best == "" {
			against = "(no other policy to compare)"
		}
		if _, err := fmt.Fprintf(w, "goal %-8s %-6s %s %s %s\n", g.Metric, verdict, target, rng(g.Target), against); err != nil {
			return err
		}
	}
	return nil
}
