package router

import (
	"cmp"
	"math"
	"math/bits"

	"github.com/llmaffinity/caddy-llm-affinity/scrape"
)

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
	if m := f.lastModel; m != nil && f.lastModelName == name {
		m.used = f.modelClock
		return m
	}
	if m := f.models[name]; m != nil {
		m.used = f.modelClock
		f.lastModelName, f.lastModel = name, m
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
	// The last found from now, so never one evicted.
	f.lastModelName, f.lastModel = name, m
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
	// A sample weighs its tokens, but no more than its bytes (a token is
	// at least minBytesPerToken of text): an engine's absurd count would
	// otherwise outweigh every later report for hundreds of them.
	m.bytesPerToken.add(min(max(ratio, minBytesPerToken), maxBytesPerToken), float64(min(promptTokens, promptBytes)))
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

// ModelNames maps the model a request names to the name its prompt's
// prefix hashes are seeded with (prefixindex.Seed): one name for all the
// names of one base model. An engine's prefix cache does not depend on
// the name its base model is asked for by: vLLM's --served-model-name
// gives it several, each listed in /v1/models with the model's path as
// its root, and serves a request that names no model with it too. A LoRA
// adapter has a cache of its own, and keeps its own name. The names are
// read from the engines' model lists, so every router reading the same
// lists seeds alike. A nil *ModelNames maps every name to itself.
type ModelNames struct {
	// canonical holds only the names seeded with another: a model served
	// under one name hashes as it always did.
	canonical map[string]string
	// omitted is the name of a request that names no model: the base
	// model's when the lists show exactly one, else "".
	omitted string
}

// NewModelNames reads the names of lists, each an engine's /v1/models.
// The names listed with one root (Root, or the ID when none is given)
// and no parent are one base model, seeded with the smallest of them in
// byte order, whatever the lists' order. A name the lists give two roots,
// or list as an adapter too, stays itself: they disagree on what it is.
func NewModelNames(lists ...[]scrape.ModelInfo) *ModelNames {
	roots := make(map[string]string) // a base model's name: its root, "" when disputed
	bases := make(map[string]bool)   // the roots
	adapters := make(map[string]bool)
	for _, list := range lists {
		for _, m := range list {
			if m.Parent != "" {
				adapters[m.ID] = true
				continue
			}
			root := cmp.Or(m.Root, m.ID)
			bases[root] = true
			if r, ok := roots[m.ID]; ok && r != root {
				root = ""
			}
			roots[m.ID] = root
		}
	}
	first := make(map[string]string) // a root: its smallest name
	for name, root := range roots {
		if root == "" || adapters[name] {
			continue
		}
		if f, ok := first[root]; !ok || name < f {
			first[root] = name
		}
	}
	n := new(ModelNames)
	for name, root := range roots {
		if c, ok := first[root]; ok && c != name && !adapters[name] {
			if n.canonical == nil {
				n.canonical = make(map[string]string)
			}
			n.canonical[name] = c
		}
	}
	if len(bases) == 1 {
		for root := range bases {
			n.omitted = first[root]
		}
	}
	return n
}

// Seed returns the name model's prefix hashes are seeded with: model
// itself unless the lists name it as one of several names of a base
// model (then that model's smallest name), or it is empty and the lists
// show one base model (then its name).
func (n *ModelNames) Seed(model string) string {
	if n == nil {
		return model
	}
	if model == "" {
		return n.omitted
	}
	if c, ok := n.canonical[model]; ok {
		return c
	}
	return model
}

// outputLengths is a histogram of completed responses' output lengths, in
// buckets a third of a doubling wide, each with the sum of its lengths,
// older ones weighing less: whenever outputLengthsWindow are counted,
// every count halves (so every 2,048 responses after the first halving).
// It says how much more a request that has generated k tokens is
// expected to generate: the mean of L − k over the lengths L seen beyond
// k. A running mean says nothing of that, and a request past the mean
// counted as about to end while it held its KV on (outputs of one
// workload spread from a few tokens to a thousand and more). It holds
// every model's lengths: peers' copies of a charge do not know its model.
type outputLengths struct {
	count, sum [outputBuckets]float64
	total      float64
}

const (
	// outputBuckets covers lengths up to 2^21 tokens, a third of a
	// doubling each; longer ones count in the last.
	outputBuckets       = 64
	outputLengthsWindow = 4096
)

// outputBucket is n's bucket: 3·⌊log2 n⌋, plus one from 2^(1/3) times
// that power of two on and two from 2^(2/3) (in integers: it is looked up
// as every streamed token is counted).
func outputBucket(n int) int {
	if n < 1 {
		return 0
	}
	l := bits.Len64(uint64(n)) - 1
	b, x, p := 3*l, uint64(n)<<10, uint64(1)<<l
	if x >= 1291*p { // 2^(1/3) = 1.2599 ≈ 1291/1024
		b++
	}
	if x >= 1626*p { // 2^(2/3) = 1.5874 ≈ 1626/1024
		b++
	}
	return min(outputBuckets-1, b)
}

// add counts a response of n output tokens.
func (h *outputLengths) add(n int) {
	if h.total >= outputLengthsWindow {
		for i := range h.count {
			h.count[i] /= 2
			h.sum[i] /= 2
		}
		h.total /= 2
	}
	b := outputBucket(n)
	h.count[b]++
	h.sum[b] += float64(n)
	h.total++
}

// remaining is the output still expected of a response that has
// generated k tokens: the mean of L − k over the lengths L seen beyond k
// (a bucket counts whole when its mean is beyond k). ok is false when no
// length beyond k was seen.
func (h *outputLengths) remaining(k int) (left float64, ok bool) {
	var n, sum float64
	for b := outputBucket(k); b < outputBuckets; b++ {
		if h.count[b] > 0 && h.sum[b] > float64(k)*h.count[b] {
			n += h.count[b]
			sum += h.sum[b] - float64(k)*h.count[b]
		}
	}
	if n == 0 {
		return 0, false
	}
	return sum / n, true
}
