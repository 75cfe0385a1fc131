package llmbench

import (
	"cmp"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"time"

	"github.com/zeebo/xxh3"
)

// BytesPerToken is the length of one synthesised token in bytes, matching the default of the
// kvsim pseudo-tokenizer and of the router's prefix hasher, so token counts survive the trip.
const BytesPerToken = 4

// Segment is a run of prompt tokens whose text is a pure function of ID: two prompts that
// contain the same segment at the same position share its text byte for byte, and a segment
// cut short is a prefix of the whole one.
type Segment struct {
	// ID names the text; segments of equal ID have equal text.
	ID uint64
	// Tokens is the segment's length in tokens.
	Tokens int
}

// Request is one request of a workload, before any routing.
type Request struct {
	// Index is the request's position in its workload, in arrival order.
	Index int
	// Arrival is when the request is sent, from the start of the workload.
	Arrival time.Duration
	// Segments make up the prompt, in order.
	Segments []Segment
	// PromptTokens is the prompt length in tokens (the sum of the segments).
	PromptTokens int
	// OutputTokens is the number of tokens the simulated model generates before stopping
	// (sent as kvsim_output_tokens).
	OutputTokens int
	// MaxTokens is the max_tokens the client sends, never below OutputTokens; the router
	// takes it as the expected output.
	MaxTokens int
	// Model is the LoRA adapter the request names, or empty for the base model.
	Model string
	// Session identifies the client conversation or tenant, or is empty.
	Session string
}

// Workload is an ordered list of requests plus what produced it.
type Workload struct {
	// Name is the generator name or the trace path.
	Name string
	// Params describes the generator parameters, for reports.
	Params map[string]any
	// Requests are sorted by Arrival.
	Requests []Request
	// Adapters lists the LoRA adapters the requests name, sorted.
	Adapters []string
}

// AppendPrompt appends the request's prompt text to dst and returns the extended slice.
func (r *Request) AppendPrompt(dst []byte) []byte {
	if need := r.PromptTokens * BytesPerToken; cap(dst)-len(dst) < need {
		grown := make([]byte, len(dst), len(dst)+need)
		copy(grown, dst)
		dst = grown
	}
	for _, s := range r.Segments {
		dst = AppendSegmentText(dst, s.ID, s.Tokens)
	}
	return dst
}

// Prompt returns the request's prompt text.
func (r *Request) Prompt() string { return string(r.AppendPrompt(nil)) }

// CompletionRequest is the canonical OpenAI /v1/completions body of a request.
type CompletionRequest struct {
	Model     string `json:"model"`
	Prompt    string `json:"prompt"`
	MaxTokens int    `json:"max_tokens"`
	// KvsimOutputTokens tells kvsim how many tokens to generate before it stops, so a replay
	// reproduces the recorded output length whatever max_tokens says.
	KvsimOutputTokens int  `json:"kvsim_output_tokens"`
	Stream            bool `json:"stream,omitempty"`
	StreamOptions     *struct {
		IncludeUsage bool `json:"include_usage"`
	} `json:"stream_options,omitempty"`
}

// Completion returns the request as an OpenAI completions request; baseModel is the model
// field for requests that name no adapter. A streamed request asks for usage in the last chunk.
func (r *Request) Completion(baseModel string, stream bool) CompletionRequest {
	c := CompletionRequest{
		Model:             baseModel,
		Prompt:            r.Prompt(),
		MaxTokens:         r.MaxTokens,
		KvsimOutputTokens: r.OutputTokens,
		Stream:            stream,
	}
	if r.Model != "" {
		c.Model = r.Model
	}
	if stream {
		c.StreamOptions = &struct {
			IncludeUsage bool `json:"include_usage"`
		}{IncludeUsage: true}
	}
	return c
}

// CompletionBody returns the JSON body of Completion.
func (r *Request) CompletionBody(baseModel string, stream bool) []byte {
	b, err := json.Marshal(r.Completion(baseModel, stream))
	if err != nil {
		panic(err) // plain strings and ints always marshal
	}
	return b
}

// AppendSegmentText appends the first tokens tokens of segment id's text to dst. Every token
// is a space and three lowercase letters (4 bytes, plain ASCII, so JSON escaping never changes
// it), drawn from a generator seeded by id alone.
func AppendSegmentText(dst []byte, id uint64, tokens int) []byte {
	state := id ^ 0x6c6c6d62656e6368 // "llmbench"
	for i := 0; i < tokens; i += 2 {
		x := splitmix64(&state)
		n := min(2, tokens-i)
		for j := range n {
			v := uint32(x >> (32 * j))
			dst = append(dst, ' ',
				'a'+byte(v%26), 'a'+byte((v/26)%26), 'a'+byte((v/676)%26))
		}
	}
	return dst
}

func splitmix64(state *uint64) uint64 {
	*state += 0x9E3779B97F4A7C15
	z := *state
	z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
	z = (z ^ (z >> 27)) * 0x94D049BB133111EB
	return z ^ (z >> 31)
}

// segmentID derives a segment ID from a namespace (the workload kind and the role of the
// segment) and up to two integers, so generators never collide with each other or with
// trace ids.
func segmentID(namespace string, a, b int64) uint64 {
	var buf [16]byte
	binary.LittleEndian.PutUint64(buf[:8], uint64(a))
	binary.LittleEndian.PutUint64(buf[8:], uint64(b))
	return xxh3.HashSeed(buf[:], xxh3.HashString(namespace))
}

// finish fills the derived fields of every request and sorts out the adapters list.
func (w *Workload) finish() {
	seen := map[string]bool{}
	w.Adapters = w.Adapters[:0]
	for i := range w.Requests {
		r := &w.Requests[i]
		r.Index = i
		r.PromptTokens = 0
		for _, s := range r.Segments {
			r.PromptTokens += s.Tokens
		}
		r.MaxTokens = max(r.MaxTokens, r.OutputTokens)
		if r.Model != "" && !seen[r.Model] {
			seen[r.Model] = true
			w.Adapters = append(w.Adapters, r.Model)
		}
	}
	slices.Sort(w.Adapters)
}

// Spread moves each request's arrival forward by a random time below
// quantum (seeded), then restores arrival order: a trace whose timestamps
// are rounded (the Mooncake traces put every arrival on a 3-second grid,
// up to 19 at the same instant) then arrives as the requests it recorded
// would have. Without it, separate routers see bursts of exactly
// simultaneous requests, which no sharing can order. quantum 0 does
// nothing.
func (w *Workload) Spread(quantum time.Duration, seed uint64) error {
	if quantum < 0 {
		return fmt.Errorf("spread must not be negative, got %v", quantum)
	}
	if quantum == 0 {
		return nil
	}
	r := rand.New(rand.NewPCG(seed, 0x737072656164))
	for i := range w.Requests {
		w.Requests[i].Arrival += time.Duration(r.Int64N(int64(quantum)))
	}
	slices.SortStableFunc(w.Requests, func(a, b Request) int { return cmp.Compare(a.Arrival, b.Arrival) })
	w.finish()
	return nil
}

// Truncate keeps the first n requests (all when n <= 0 or n is larger).
func (w *Workload) Truncate(n int) {
	if n > 0 && n < len(w.Requests) {
		w.Requests = w.Requests[:n]
		w.finish()
	}
}

// Speedup divides every arrival time by factor, replaying the workload factor times faster.
func (w *Workload) Speedup(factor float64) error {
	if factor <= 0 || math.IsNaN(factor) || math.IsInf(factor, 0) {
		return fmt.Errorf("speed must be a positive number, got %v", factor)
	}
	if factor == 1 {
		return nil
	}
	for i := range w.Requests {
		w.Requests[i].Arrival = time.Duration(float64(w.Requests[i].Arrival) / factor)
	}
	return nil
}

// SetMaxTokens makes every request send max_tokens = max(budget, its output length), a client
// that asks for a generous budget rather than the exact length; the router then overestimates
// the decode work. budget <= 0 restores max_tokens = output length, which is what SGLang's and
// LMCache's benchmark clients send.
func (w *Workload) SetMaxTokens(budget int) {
	for i := range w.Requests {
		r := &w.Requests[i]
		r.MaxTokens = max(budget, r.OutputTokens)
	}
}

// Stats summarises a workload's shape.
type Stats struct {
	Requests         int
	DurationSeconds  float64
	MeanPromptTokens float64
	MeanOutputTokens float64
}

// Stats returns the workload's size and mean lengths.
func (w *Workload) Stats() Stats {
	var st Stats
	st.Requests = len(w.Requests)
	if st.Requests == 0 {
		return st
	}
	var in, out float64
	for i := range w.Requests {
		r := &w.Requests[i]
		in += float64(r.PromptTokens)
		out += float64(r.OutputTokens)
	}
	st.MeanPromptTokens = in / float64(st.Requests)
	st.MeanOutputTokens = out / float64(st.Requests)
	st.DurationSeconds = (w.Requests[st.Requests-1].Arrival - w.Requests[0].Arrival).Seconds()
	return st
}
