package integration

import (
	"encoding/json"
	"fmt"
	"regexp"
	"strconv"
	"sync/atomic"
	"testing"

	"github.com/llmaffinity/caddy-llm-affinity/kvsim"
)

var promptEstimate = regexp.MustCompile(`prompt=(\d+)`)

// tokenTestRuns numbers TestPromptEstimateLearnsTokenizer's runs.
var tokenTestRuns atomic.Int64

// TestPromptEstimateLearnsTokenizer: behind engines whose tokenizer gives
// 2 bytes a token (code, JSON and CJK text come close to that), the
// router's bytes_per_token 4 halves every prompt; once three responses
// reported their usage it estimates from what they said. Behind kvsim's
// default 4 bytes the estimate starts close and stays so. (The router
// learns when the handler completes, just after the client has its
// response, so the test allows a few requests before it must have
// learned rather than waiting on time.) It logs the estimate's error per
// request, the figures quoted in BENCHMARKS.md §11.
func TestPromptEstimateLearnsTokenizer(t *testing.T) {
	for _, tc := range []struct {
		bytesPerToken int
		firstError    [2]float64 // bounds of the error before learning
	}{
		{2, [2]float64{-0.55, -0.45}},
		{4, [2]float64{-0.05, 0.05}},
	} {
		t.Run(fmt.Sprint(tc.bytesPerToken, "-bytes-a-token"), func(t *testing.T) {
			// A model of its own: the router learns per model name, and
			// other tests in this process (or this one's earlier runs,
			// under -count) taught it theirs; its state outlives a config.
			model := fmt.Sprintf("acme/code-model-%d-run-%d", tc.bytesPerToken, tokenTestRuns.Add(1))
			fleet := startFleet(t, 2, 50, kvsim.Config{BytesPerToken: tc.bytesPerToken, Model: model})
			startCaddy(t, caddyfile(fleet, "", "", ""))
			estimateError := func(i int) float64 {
				convo := []msg{{"user", text(fmt.Sprint("snippet", i), 8000)}}
				body := chat(convo, 4)
				body["model"] = model
				c := post(t, "/v1/chat/completions", body)
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
				t.Logf("request %d: estimated %d prompt tokens, engine counted %d (error %+.1f%%)", i, est, usage.Usage.PromptTokens, 100*e)
				return e
			}
			within := func(e float64) bool { return e > -0.01 && e < 0.01 }

			if e := estimateError(0); e < tc.firstError[0] || e > tc.firstError[1] {
				t.Fatalf("before learning: error %+.1f%%, want within %v", 100*e, tc.firstError)
			}
			learned := -1
			for i := 1; i <= 12 && learned < 0; i++ {
				if within(estimateError(i)) && i >= 3 {
					learned = i
				}
			}
			if learned < 0 {
				t.Fatal("12 responses did not bring the estimate within 1% of the engine's count")
			}
			for i := learned + 1; i <= learned+3; i++ {
				if e := estimateError(i); !within(e) {
					t.Errorf("request %d, after learning: error %+.1f%%, want within 1%%", i, 100*e)
				}
			}
		})
	}
}
