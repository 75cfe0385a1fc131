package llmbench

import (
	"bytes"
	"encoding/json"
	"math"
	"strings"
	"testing"
)

func runs(policy string, ttftP99 ...float64) SeedRuns {
	r := SeedRuns{Policy: policy}
	for _, v := range ttftP99 {
		r.Runs = append(r.Runs, Summary{Policy: policy, TTFTP50: 0.1, TTFTP99: v, E2EP99: 1, HitRate: 0.5})
	}
	return r
}

func goal(t *testing.T, checks []GoalCheck, metric string) GoalCheck {
	t.Helper()
	for _, g := range checks {
		if g.Metric == metric {
			return g
		}
	}
	t.Fatalf("no %q goal in %+v", metric, checks)
	return GoalCheck{}
}

func TestCheckGoals(t *testing.T) {
	for _, tc := range []struct {
		name   string
		target SeedRuns
		others []SeedRuns
		want   bool
	}{
		{"within 3% at both ends", runs("t", 1.00, 1.02), []SeedRuns{runs("a", 0.99, 1.00), runs("b", 2, 2)}, true},
		{"worst seed beyond the tolerance", runs("t", 1.00, 1.10), []SeedRuns{runs("a", 0.99, 1.00)}, false},
		{"best seed beyond the tolerance", runs("t", 1.05, 1.05), []SeedRuns{runs("a", 0.90, 1.05)}, false},
		{"no value counts as worst", runs("t", math.NaN(), 1), []SeedRuns{runs("a", 1, 1)}, false},
		{"no other policy", runs("t", 5, 5), nil, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := goal(t, CheckGoals("t", append([]SeedRuns{tc.target}, tc.others...)), "TTFT p99")
			if g.Met != tc.want {
				t.Errorf("met = %v, want %v (%+v)", g.Met, tc.want, g)
			}
		})
	}

	// Hit rate: higher is better; sheds: no tolerance.
	target := SeedRuns{Policy: "t", Runs: []Summary{{HitRate: 0.91, Shed: 1}, {HitRate: 0.96, Shed: 0}}}
	other := SeedRuns{Policy: "o", Runs: []Summary{{HitRate: 0.95}, {HitRate: 1.0}}}
	checks := CheckGoals("t", []SeedRuns{target, other})
	if g := goal(t, checks, "hit rate"); !g.Met || g.Best != "o" {
		t.Errorf("hit rate 91–96%% against 95–100%% should meet the 95%% goal: %+v", g)
	}
	if g := goal(t, checks, "shed"); g.Met {
		t.Errorf("one shed against none should miss: %+v", g)
	}

	var buf bytes.Buffer
	if err := WriteGoals(&buf, "t", checks); err != nil || !strings.Contains(buf.String(), "goal shed     MISSED t 0–1 against o 0") {
		t.Errorf("WriteGoals: %v\n%s", err, buf.String())
	}
	buf.Reset()
	if err := WriteGoals(&buf, "t", CheckGoals("t", []SeedRuns{target})); err != nil || !strings.Contains(buf.String(), "goal shed     met    t 0–1 (no other policy to compare)") {
		t.Errorf("WriteGoals with nothing to compare: %v\n%s", err, buf.String())
	}
	if err := json.NewEncoder(&buf).Encode(CheckGoals("t", []SeedRuns{runs("t", math.NaN()), runs("o", 1)})); err != nil {
		t.Errorf("a goal without a value must still encode: %v", err)
	}
}
