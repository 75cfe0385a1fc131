package llmbench

import (
	"fmt"
	"strings"

	"github.com/llmaffinity/caddy-llm-affinity/scorer"
)

// AffinityPolicyPrefix starts the names of the llm_affinity policies: "llm_affinity/ttft".
const AffinityPolicyPrefix = "llm_affinity/"

// CaddyPolicies are Caddy's own reverse_proxy selection policies that the benchmark compares
// against: they see no prompt, only the request (and, for header, a routing key).
var CaddyPolicies = []string{"round_robin", "least_conn", "random", "first", "header"}

// Policies lists every policy name, llm_affinity strategies first.
func Policies() []string {
	var names []string
	for _, s := range scorer.Strategies {
		names = append(names, AffinityPolicyPrefix+string(s))
	}
	return append(names, CaddyPolicies...)
}

// AffinityStrategy returns the scorer strategy of an llm_affinity policy name, and false for
// any other policy. "llm_affinity" alone means the default strategy.
func AffinityStrategy(policy string) (scorer.Strategy, bool) {
	if policy == "llm_affinity" {
		return scorer.TTFT, true
	}
	name, ok := strings.CutPrefix(policy, AffinityPolicyPrefix)
	if !ok {
		return "", false
	}
	s, err := scorer.ParseStrategy(name)
	if err != nil || name == "" {
		return "", false
	}
	return s, true
}

// ParsePolicies splits a comma-separated list of policy names and checks each; "all" means
// every policy, and a list with no name in it is an error.
func ParsePolicies(list string) ([]string, error) {
	list = strings.TrimSpace(list)
	if list == "all" {
		return Policies(), nil
	}
	var out []string
	seen := map[string]bool{}
	for _, p := range strings.Split(list, ",") {
		p = strings.TrimSpace(p)
		if p == "" || seen[p] {
			continue
		}
		if !ValidPolicy(p) {
			return nil, fmt.Errorf("unknown policy %q (want one of %s)", p, strings.Join(Policies(), ", "))
		}
		seen[p] = true
		out = append(out, p)
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("no policy in %q", list)
	}
	return out, nil
}

// ValidPolicy reports whether name is a known policy.
func ValidPolicy(name string) bool {
	if _, ok := AffinityStrategy(name); ok {
		return true
	}
	for _, p := range CaddyPolicies {
		if p == name {
			return true
		}
	}
	return false
}
