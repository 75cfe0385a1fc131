package integration

import (
	"encoding/json"
	"fmt"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/llmaffinity/caddy-llm-affinity/kvsim"
)

var promptEstimate = regexp.MustCompile(`prompt=(\d+)`)

// tokenTestRuns numbers TestPromptEstimateLearnsTokenizer's runs.
var tokenTestRuns atomic.Int64

// TestPromptEstimateLearnsTokenizer: behind engines whose tokenizer gives
// 2, 3 or 8 bytes a token (tiktoken's cl100k_base gives 2.8–3.0 for CJK
// text, 3.7–3.8 for Go code, 7.6 for JSON indented by eight spaces), the
// router's bytes_per_token 4 misjudges every prompt by the ratio; once
// three responses reported their usage it estimates from what they said.
// Behind kvsim's default 4 bytes the estimate starts close and stays so.
// (kvsim's tokenizer counts a fixed number of bytes a token, whatever the
// text: these are the ratios, not the texts.) (The router
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
		{3, [2]float64{-0.30, -0.20}}, // CJK text with cl100k_base: 2.8–3.0
		{4, [2]float64{-0.05, 0.05}},
		{8, [2]float64{0.90, 1.10}}, // JSON indented by eight spaces: 7.6
	} {
		t.Run(fmt.Sprint(tc.bytesPerToken, "-bytes-a-token"), func(t *testing.T) {
			// A model of its own: the router learns per model name, and
			// other tests in this process (or this one's earlier runs,
			// under -count) taught it theirs; its state outlives a config.
			model := fmt.Sprintf("acme/code-model-%d-run-%d", tc.bytesPerToken, tokenTestRuns.Add(1))
			fleet := startFleet(t, 2, 50, kvsim.Config{BytesPerToken: tc.bytesPerToken, Model: model})
			startCaddy(t, caddyfile(fleet, "", "", ""))
			errorOf := func(i int) float64 {
				convo := []msg{{"user", text(fmt.Sprint("snippet", i), 8000)}}
				body := chat(convo, 4)
				body["model"] = model
				c := post(t, "/v1/chat/completions", body)
				if c.status != 200 {
					t.Fatalf("request %d: %d %s", i, c.status, c.body)
				}
				est, counted, e := estimateError(t, c)
				t.Logf("request %d: estimated %d prompt tokens, engine counted %d (error %+.1f%%)", i, est, counted, 100*e)
				return e
			}
			within := func(e float64) bool { return e > -0.01 && e < 0.01 }

			if e := errorOf(0); e < tc.firstError[0] || e > tc.firstError[1] {
				t.Fatalf("before learning: error %+.1f%%, want within %v", 100*e, tc.firstError)
			}
			learned := -1
			for i := 1; i <= 12 && learned < 0; i++ {
				if within(errorOf(i)) && i >= 3 {
					learned = i
				}
			}
			if learned < 0 {
				t.Fatal("12 responses did not bring the estimate within 1% of the engine's count")
			}
			for i := learned + 1; i <= learned+3; i++ {
				if e := errorOf(i); !within(e) {
					t.Errorf("request %d, after learning: error %+.1f%%, want within 1%%", i, 100*e)
				}
			}
		})
	}
}

// TestAgentTurnsAndImagesAreNotRefused: what an agent sends besides text
// must not make an ordinary request look too long. Tool-calling turns
// (short, mostly tool calls and chat template) used to teach the model a
// ratio near 1 byte a token, after which a 60,000-token document was
// refused as over 160,000; an image's base64 bytes were counted as text, so a
// 500 KB photo was refused, and its usage (mostly the image's tokens)
// taught the ratio too. Each request here gets 200 from the engine, and a
// text prompt after the images is still estimated within 10%.
func TestAgentTurnsAndImagesAreNotRefused(t *testing.T) {
	model := fmt.Sprintf("acme/agent-model-run-%d", tokenTestRuns.Add(1))
	fleet := startFleet(t, 2, 50, kvsim.Config{Model: model})
	startCaddy(t, caddyfile(fleet, "", "scrape_interval 100ms", ""))
	for _, r := range fleet {
		eventually(t, 10*time.Second, "the engines' KV scraped", func() bool {
			v := listedEngine(t, r.dial())
			return v != nil && v.KVCapacity == 131_072
		})
	}
	completed := int64(0)
	send := func(what string, body map[string]any) completion {
		t.Helper()
		body["model"] = model
		c := post(t, "/v1/chat/completions", body)
		if c.status != 200 {
			t.Fatalf("%s: %d %s", what, c.status, c.body)
		}
		// The router learns from a response just after the client has it:
		// wait until it has, so the next request is decided after.
		completed++
		eventually(t, 10*time.Second, "the response learned from", func() bool {
			var n int64
			for _, u := range upstreams(t) {
				n += u.Completed
			}
			return n >= completed
		})
		return c
	}
	for i := range 3 {
		send(fmt.Sprint("tool-calling turn ", i), map[string]any{"max_tokens": 1, "messages": []any{
			map[string]any{"role": "user", "content": fmt.Sprint("What is the weather in Paris? (", i, ")")},
			map[string]any{"role": "assistant", "content": nil, "tool_calls": []any{map[string]any{
				"id": "call_1", "type": "function", "function": map[string]any{"name": "get_weather", "arguments": `{"city":"Paris"}`}}}},
			map[string]any{"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
		}})
	}
	send("a 60,000-token document", chat([]msg{{"user", "Summarize: " + text("document", 240_000)}}, 16))
	photo := strings.Repeat("QUJD", 125_000) // 500 KB of base64
	for i := range 4 {
		send(fmt.Sprint("a 500 KB photo ", i), map[string]any{"max_tokens": 4, "messages": []any{map[string]any{"role": "user", "content": []any{
			map[string]any{"type": "text", "text": fmt.Sprint("What is in this picture? (", i, ")")},
			map[string]any{"type": "image_url", "image_url": map[string]any{"url": "data:image/jpeg;base64," + photo}},
		}}}})
	}
	c := send("text after the photos", chat([]msg{{"user", text("after the photos", 4000)}}, 4))
	if est, counted, e := estimateError(t, c); e < -0.1 || e > 0.1 {
		t.Fatalf("after the photos a text prompt was estimated at %d tokens, the engine counted %d", est, counted)
	}
}

// estimateError reads a response's prompt estimate (the explanation
// header's prompt=) and the engine's count (usage.prompt_tokens), and the
// estimate's error relative to the count.
func estimateError(t *testing.T, c completion) (estimate, counted int, relative float64) {
	t.Helper()
	m := promptEstimate.FindStringSubmatch(c.explain)
	var usage struct {
		Usage struct {
			PromptTokens int `json:"prompt_tokens"`
		} `json:"usage"`
	}
	if m == nil || json.Unmarshal([]byte(c.body), &usage) != nil || usage.Usage.PromptTokens == 0 {
		t.Fatalf("no estimate in %q or no usage in %s", c.explain, c.body)
	}
	estimate, _ = strconv.Atoi(m[1])
	counted = usage.Usage.PromptTokens
	return estimate, counted, float64(estimate-counted) / float64(counted)
}

// TestTokenizeThroughTheRouter: vLLM's tokenizer endpoints go through
// the router to an engine serving the model, and the ids /tokenize gives
// are a prompt the router takes: sent back as a completion's prompt they
// count as many tokens as the text, and /detokenize on whichever replica
// gives the text back. kvsim's ids go past 2^31 (a text's last, shorter
// token, a token ending in a byte of a multi-byte character), which a
// router that judged ids by a vocabulary of its own refused with 400.
func TestTokenizeThroughTheRouter(t *testing.T) {
	fleet := startFleet(t, 2, 50, kvsim.Config{})
	startCaddy(t, caddyfile(fleet, "", "", ""))
	for _, text := range []string{"Hello, tokenizer", "Hello, tokenizer!", "naïve café — 東京"} {
		tok := post(t, "/tokenize", map[string]any{"model": kvsim.DefaultModel, "prompt": text})
		if tok.status != 200 {
			t.Fatalf("tokenize %q: %d %s", text, tok.status, tok.body)
		}
		var ids struct {
			Count  int     `json:"count"`
			Tokens []int64 `json:"tokens"`
		}
		if err := json.Unmarshal([]byte(tok.body), &ids); err != nil || ids.Count != len(ids.Tokens) || ids.Count == 0 {
			t.Fatalf("tokenize %q: %s (%v)", text, tok.body, err)
		}
		gen := post(t, "/v1/completions", map[string]any{"model": kvsim.DefaultModel, "prompt": ids.Tokens, "max_tokens": 1})
		if gen.status != 200 {
			t.Fatalf("the ids of %q as a prompt: %d %s", text, gen.status, gen.body)
		}
		var usage struct {
			Usage struct {
				Prompt int `json:"prompt_tokens"`
			} `json:"usage"`
		}
		if err := json.Unmarshal([]byte(gen.body), &usage); err != nil || usage.Usage.Prompt != ids.Count {
			t.Fatalf("the ids of %q counted %d prompt tokens, tokenize %d (%v)", text, usage.Usage.Prompt, ids.Count, err)
		}
		for range 2 { // either replica
			detok := post(t, "/detokenize", map[string]any{"model": kvsim.DefaultModel, "tokens": ids.Tokens})
			var back struct {
				Prompt string `json:"prompt"`
			}
			if detok.status != 200 || json.Unmarshal([]byte(detok.body), &back) != nil || back.Prompt != text {
				t.Fatalf("detokenize %q's ids: %d %s", text, detok.status, detok.body)
			}
		}
	}
	for _, method := range []string{"GET", "POST"} {
		req, _ := http.NewRequest(method, routerURL+"/ping", nil)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != 200 {
			t.Fatalf("%s /ping: %d", method, resp.StatusCode)
		}
	}
}
