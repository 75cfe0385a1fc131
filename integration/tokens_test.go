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
// router's bytes_per_token 4 halves every prompt; once three responses
// reported their usage it estimates from what they said. (The router
// learns when the handler completes, just after the client has its
// response, so the test allows a few requests before it must have
// learned rather than waiting on time.) It logs the estimate's error per
// request, the figures quoted in BENCHMARKS.md §10.
func TestPromptEstimateLearnsTokenizer(t *testing.T) {
	// A model of its own: the router learns per model name, and other
	// tests in this process taught it the default model's 4 bytes.
	const model = "acme/code-model"
	fleet := startFleet(t, 2, 50, kvsim.Config{BytesPerToken: 2, Model: model})
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
	within := func(e float64) bool { return e > -0.05 && e < 0.05 }

	if e := estimateError(0); e > -0.45 {
		t.Fatalf("before learning the estimate should be about half the engine's count, error %+.1f%%", 100*e)
	}
	learned := -1
	for i := 1; i <= 12 && learned < 0; i++ {
		if within(estimateError(i)) {
			learned = i
		}
	}
	switch {
	case learned < 0:
		t.Fatal("12 responses did not teach the estimate the engine's tokenizer")
	case learned < 3:
		t.Fatalf("learned after %d responses; it should need three", learned)
	}
	for i := learned + 1; i <= learned+3; i++ {
		if e := estimateError(i); !within(e) {
			t.Errorf("request %d, after learning: error %+.1f%%, want within 5%%", i, 100*e)
		}
	}
}
