package integration

import (
	"encoding/json"
	"fmt"
	"regexp"
	"strconv"
	"testing"

	"github.com/llmaffinity/caddy-llm-affinity/kvsim"
)

var promptEstimate = regexp.MustCompile(`prompt=(\d+)`)

// TestPromptEstimateLearnsTokenizer: behind engines whose tokenizer gives
// 2 bytes a token (code, JSON and CJK text come close to that), the
// router's bytes_per_token 4 halves every prompt; after three responses
// it estimates from what their usage reported. The test logs the
// estimate's error per request, the figures quoted in BENCHMARKS.md §10.
func TestPromptEstimateLearnsTokenizer(t *testing.T) {
	fleet := startFleet(t, 2, 50, kvsim.Config{BytesPerToken: 2})
	startCaddy(t, caddyfile(fleet, "", "", ""))

	var errs []float64
	for i := range 6 {
		convo := []msg{{"user", text(fmt.Sprint("snippet", i), 8000)}}
		c := post(t, "/v1/chat/completions", chat(convo, 4))
		if c.status != 200 {
			t.Fatalf("request %d: %d %s", i, c.status, c.body)
		}
		m := promptEstimate.FindStringSubmatch(c.explain)
		var usage struct {
			Usage struct {
				PromptTokens int `json:"prompt_tokens"`
			} `json:"usage"`
		}
		if m == nil || json.Unmarshal([]byte(c.body), &usage) != nil || usage.Usage.PromptTokens == 0 {
			t.Fatalf("request %d: no estimate in %q or no usage in %s", i, c.explain, c.body)
		}
		est, _ := strconv.Atoi(m[1])
		e := float64(est-usage.Usage.PromptTokens) / float64(usage.Usage.PromptTokens)
		errs = append(errs, e)
		t.Logf("request %d: estimated %d prompt tokens, engine counted %d (error %+.1f%%)", i, est, usage.Usage.PromptTokens, 100*e)
	}
	if errs[0] > -0.45 {
		t.Errorf("before learning the estimate should be about half the engine's count, error %+.1f%%", 100*errs[0])
	}
	for i := 3; i < len(errs); i++ {
		if errs[i] < -0.05 || errs[i] > 0.05 {
			t.Errorf("request %d, after three responses: error %+.1f%%, want within 5%%", i, 100*errs[i])
		}
	}
}
