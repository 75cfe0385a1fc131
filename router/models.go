package router

import "math"

// maxModels bounds the per-model table. Clients choose the model string,
// and an upstream that answers 200 to any name (a catch-all proxy, an
// engine with many adapters) would otherwise grow it with every name sent.
const maxModels = 256

// modelStats is what the router learned of one model from its completed
// responses. Guarded by Fleet.mu.
type modelStats struct {
	// output is the running mean of output tokens.
	output runningMean
	// bytesPerToken is the mean of prompt bytes per token as the engine
	// counted them (usage.prompt_tokens), over text prompts, weighted by
	// their tokens.
	bytesPerToken weightedMean
	// used is Fleet.modelClock at the last use, for evicting the least
	// recently used model when the table is full.
	used uint64
}

// Bounds of the learned prompt bytes per token. Real text gives about
// 1.5 (emoji) to 8 (JSON indented by eight spaces); outside these the
// responses are not what the estimate should learn from. The upper bound
// is also the most a prompt's text is taken to hold a token for when it
// is refused as too long (see leastKVTokens).
const (
	minBytesPerToken = 1.0
	maxBytesPerToken = 16.0
	// minLearnTokens: shorter prompts are mostly chat template, whose
	// tokens have no bytes in the request.
	minLearnTokens = 32
	// learnedAfter is how many responses, and learnedAfterTokens how
	// many of their prompt tokens (weighted as the mean weighs them), the
	// ratio needs before it replaces the configured bytes_per_token: a
	// few short agent turns, whose chat template is much of their tokens,
	// do not decide it alone.
	learnedAfter       = 3
	learnedAfterTokens = 1024
)

// weightedMean is a mean of samples weighted by their size, recent ones
// counting more: each older sample's weight decays by 5% per sample (as
// runningMean's share of a new sample floors at 5%). A prompt's bytes per
// token so counts by its tokens: a long prompt, in which the chat
// template's own tokens are few, says more than a short one.
type weightedMean struct {
	value, weight float64
	n             int
}

func (m *weightedMean) add(x, w float64) {
	m.n++
	m.weight = m.weight*0.95 + w
	m.value += w / m.weight * (x - m.value)
}

// learned says enough was seen to use the mean.
func (m *weightedMean) learned() bool {
	return m.n >= learnedAfter && m.weight >= learnedAfterTokens
}

// model returns name's statistics, created (evicting the least recently
// used model when the table is full) when create is set, else nil if
// unknown. Caller holds f.mu.
func (f *Fleet) model(name string, create bool) *modelStats {
	f.modelClock++
	if m := f.models[name]; m != nil {
		m.used = f.modelClock
		return m
	}
	if !create {
		return nil
	}
	if len(f.models) >= maxModels {
		oldest, at := "", uint64(math.MaxUint64)
		for n, m := range f.models {
			if m.used < at {
				oldest, at = n, m.used
			}
		}
		delete(f.models, oldest)
	}
	m := &modelStats{used: f.modelClock}
	f.models[name] = m
	return m
}

// learnPrompt feeds one response's prompt length into model's bytes per
// token: promptBytes is what the router estimated from, promptTokens what
// the engine counted. Each sample is held within half and twice the
// current estimate, so one odd response (a prompt of repeated emoji, a
// usage field from a proxy that rewrote the prompt) moves it little.
func (m *modelStats) learnPrompt(promptBytes, promptTokens int) {
	if promptBytes <= 0 || promptTokens < minLearnTokens {
		return
	}
	ratio := float64(promptBytes) / float64(promptTokens)
	if m.bytesPerToken.learned() {
		ratio = min(max(ratio, m.bytesPerToken.value/2), m.bytesPerToken.value*2)
	}
	m.bytesPerToken.add(min(max(ratio, minBytesPerToken), maxBytesPerToken), float64(promptTokens))
}

// promptTokens is req's prompt length in tokens and the factor its
// estimate was scaled by: for a text prompt of a model whose bytes per
// token the router learned, its bytes over the learned ratio, else the
// caller's estimate. Caller holds f.mu.
func (f *Fleet) promptTokens(req *Request) (tokens int, scale float64) {
	if req.PromptBytes <= 0 || req.PromptTokens <= 0 {
		return req.PromptTokens, 1
	}
	m := f.model(req.Model, false)
	if m == nil || !m.bytesPerToken.learned() {
		return req.PromptTokens, 1
	}
	tokens = max(1, int(math.Ceil(float64(req.PromptBytes)/m.bytesPerToken.value)))
	return tokens, float64(tokens) / float64(req.PromptTokens)
}

// BytesPerToken is the prompt bytes per token learned for model from its
// engines' usage reports, and whether enough were seen to use it.
func (f *Fleet) BytesPerToken(model string) (float64, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	m := f.models[model]
	if m == nil || !m.bytesPerToken.learned() {
		return 0, false
	}
	return m.bytesPerToken.value, true
}
