package llmbench

import (
	"bytes"
	"math"
	"reflect"
	"slices"
	"testing"
	"time"

	"github.com/llmaffinity/caddy-llm-affinity/kvsim"
)

func TestSegmentTextIsAPrefixAndPlainASCII(t *testing.T) {
	long := AppendSegmentText(nil, 99, 512)
	short := AppendSegmentText(nil, 99, 37)
	if len(long) != 512*BytesPerToken || len(short) != 37*BytesPerToken {
		t.Fatalf("lengths %d, %d", len(long), len(short))
	}
	if !bytes.HasPrefix(long, short) {
		t.Error("a shorter segment is not a prefix of the longer one")
	}
	if other := AppendSegmentText(nil, 100, 512); bytes.Equal(other[:64], long[:64]) {
		t.Error("different ids give the same first block")
	}
	for i, c := range long {
		if c != ' ' && (c < 'a' || c > 'z') {
			t.Fatalf("byte %d is %q, want a space or a lowercase letter", i, c)
		}
	}
}

func TestCompletionBodyParsesInKvsim(t *testing.T) {
	w, err := Generate("gsp", GeneratorOptions{Seed: 3, GSP: GSPParams{Groups: 2, PromptsPerGroup: 2}})
	if err != nil {
		t.Fatal(err)
	}
	r := &w.Requests[0]
	body := r.CompletionBody(kvsim.DefaultModel, true)
	tok := kvsim.NewTokenizer(BytesPerToken)
	p, err := kvsim.ParseRequest(kvsim.EndpointCompletions, body, tok, 128)
	if err != nil {
		t.Fatal(err)
	}
	if tok.CountTokens(len(p.Context)) != r.PromptTokens || p.OutputTokens != r.OutputTokens || !p.Stream || !p.IncludeUsage {
		t.Errorf("kvsim parsed %d prompt tokens, %d output, stream %v; want %d, %d, true",
			tok.CountTokens(len(p.Context)), p.OutputTokens, p.Stream, r.PromptTokens, r.OutputTokens)
	}
	if !bytes.Equal(p.Context, r.AppendPrompt(nil)) {
		t.Error("kvsim's context differs from the prompt")
	}
}

func TestGeneratorsAreDeterministic(t *testing.T) {
	for _, g := range Generators {
		t.Run(g, func(t *testing.T) {
			opts := GeneratorOptions{Seed: 7, MRQA: MRQAParams{Users: 8, Rounds: 3}, LoRA: LoRAParams{Requests: 200}, NoPrefix: NoPrefixParams{Requests: 200}}
			a, err := Generate(g, opts)
			if err != nil {
				t.Fatal(err)
			}
			b, err := Generate(g, opts)
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(a, b) {
				t.Fatal("the same options gave different workloads")
			}
			opts.Seed = 8
			c, err := Generate(g, opts)
			if err != nil {
				t.Fatal(err)
			}
			if reflect.DeepEqual(a.Requests, c.Requests) {
				t.Error("a different seed gave the same workload")
			}
			for i := 1; i < len(a.Requests); i++ {
				if a.Requests[i].Arrival < a.Requests[i-1].Arrival {
					t.Fatalf("request %d arrives before request %d", i, i-1)
				}
				if a.Requests[i].Index != i {
					t.Fatalf("request %d has index %d", i, a.Requests[i].Index)
				}
			}
		})
	}
}

func TestGSPShape(t *testing.T) {
	w, err := Generate("gsp", GeneratorOptions{Seed: 1})
	if err != nil {
		t.Fatal(err)
	}
	if len(w.Requests) != 64*16 {
		t.Fatalf("requests = %d, want 1024 (SGLang's defaults)", len(w.Requests))
	}
	groups := map[uint64]int{}
	for _, r := range w.Requests {
		if r.PromptTokens != 2048+128 || r.OutputTokens != 256 {
			t.Fatalf("request has %d prompt and %d output tokens", r.PromptTokens, r.OutputTokens)
		}
		groups[r.Segments[0].ID]++
	}
	if len(groups) != 64 {
		t.Errorf("%d distinct system prompts, want 64", len(groups))
	}
	for id, n := range groups {
		if n != 16 {
			t.Errorf("system prompt %x used %d times, want 16", id, n)
		}
	}
	// Poisson arrivals at the default rate: the mean gap is close to 1/64 s.
	gap := w.Requests[len(w.Requests)-1].Arrival.Seconds() / float64(len(w.Requests))
	if want := 1 / DefaultRate("gsp"); math.Abs(gap-want) > 0.15*want {
		t.Errorf("mean gap %.4fs, want about %.4fs", gap, want)
	}
}

func TestMRQAPromptsGrowByRound(t *testing.T) {
	w, err := Generate("mrqa", GeneratorOptions{Seed: 1, MRQA: MRQAParams{Users: 4, Rounds: 3}})
	if err != nil {
		t.Fatal(err)
	}
	byUser := map[string][]Request{}
	for _, r := range w.Requests {
		byUser[r.Session] = append(byUser[r.Session], r)
	}
	if len(byUser) != 4 {
		t.Fatalf("%d sessions, want 4", len(byUser))
	}
	for user, rounds := range byUser {
		if len(rounds) != 3 {
			t.Fatalf("%s has %d rounds", user, len(rounds))
		}
		for i := 1; i < len(rounds); i++ {
			prev, cur := rounds[i-1], rounds[i]
			if !reflect.DeepEqual(cur.Segments[:len(prev.Segments)], prev.Segments) {
				t.Errorf("%s round %d does not extend round %d", user, i, i-1)
			}
			if cur.PromptTokens != prev.PromptTokens+100+64 {
				t.Errorf("%s round %d has %d tokens, want %d", user, i, cur.PromptTokens, prev.PromptTokens+164)
			}
		}
	}
}

func TestLoRAAndNoPrefixShape(t *testing.T) {
	w, err := Generate("lora", GeneratorOptions{Seed: 1, LoRA: LoRAParams{Adapters: 6, Requests: 600}})
	if err != nil {
		t.Fatal(err)
	}
	counts := map[string]int{}
	for _, r := range w.Requests {
		counts[r.Model]++
	}
	if len(w.Adapters) != 6 || len(counts) != 6 {
		t.Fatalf("adapters %v, counts %v", w.Adapters, counts)
	}
	if counts[AdapterName(0)] <= counts[AdapterName(5)] {
		t.Errorf("Zipf: tenant 0 has %d requests, tenant 5 %d", counts[AdapterName(0)], counts[AdapterName(5)])
	}

	n, err := Generate("noprefix", GeneratorOptions{Seed: 1, NoPrefix: NoPrefixParams{Requests: 4000}})
	if err != nil {
		t.Fatal(err)
	}
	st := n.Stats()
	// The Azure conversation trace: input mean 1,155, output mean 211.
	if math.Abs(st.MeanPromptTokens-1155) > 100 || math.Abs(st.MeanOutputTokens-211) > 25 {
		t.Errorf("means %.0f in, %.0f out; want about 1155 and 211", st.MeanPromptTokens, st.MeanOutputTokens)
	}
	seen := map[uint64]bool{}
	for _, r := range n.Requests {
		if seen[r.Segments[0].ID] {
			t.Fatal("two noprefix requests share a segment")
		}
		seen[r.Segments[0].ID] = true
	}
}

func TestWorkloadTransforms(t *testing.T) {
	w, err := Generate("gsp", GeneratorOptions{Seed: 1, Rate: 10, GSP: GSPParams{Groups: 2, PromptsPerGroup: 5}})
	if err != nil {
		t.Fatal(err)
	}
	last := w.Requests[9].Arrival
	if err := w.Speedup(2); err != nil {
		t.Fatal(err)
	}
	if w.Requests[9].Arrival != last/2 {
		t.Errorf("speedup 2: last arrival %v, want %v", w.Requests[9].Arrival, last/2)
	}
	if err := w.Speedup(0); err == nil {
		t.Error("speed 0 accepted")
	}
	w.SetMaxTokens(1000)
	if w.Requests[0].MaxTokens != 1000 || w.Requests[0].OutputTokens != 256 {
		t.Errorf("max_tokens %d, output %d", w.Requests[0].MaxTokens, w.Requests[0].OutputTokens)
	}
	w.Truncate(3)
	if len(w.Requests) != 3 {
		t.Errorf("truncate: %d requests", len(w.Requests))
	}
	all, err := Generate("gsp", GeneratorOptions{Seed: 1, Rate: math.Inf(1), GSP: GSPParams{Groups: 2, PromptsPerGroup: 5}})
	if err != nil {
		t.Fatal(err)
	}
	if all.Requests[9].Arrival != 0 {
		t.Errorf("rate inf: arrival %v, want 0", all.Requests[9].Arrival)
	}
}

func TestLoadWorkload(t *testing.T) {
	if _, err := LoadWorkload("no-such-generator-or-file", GeneratorOptions{}); err == nil {
		t.Error("unknown workload accepted")
	}
	w, err := LoadWorkload(sampleTrace, GeneratorOptions{})
	if err != nil || len(w.Requests) != 300 {
		t.Fatalf("trace: %v", err)
	}
}

// TestSpread: arrivals move forward by less than the quantum, stay in
// order, and simultaneous ones come apart; the same seed spreads alike.
func TestSpread(t *testing.T) {
	w := &Workload{}
	for i := range 100 {
		w.Requests = append(w.Requests, Request{Arrival: time.Duration(i/10) * 3 * time.Second, OutputTokens: 1})
	}
	w.finish()
	before := slices.Clone(w.Requests)
	if err := w.Spread(3*time.Second, 7); err != nil {
		t.Fatal(err)
	}
	seen := map[time.Duration]bool{}
	for i, r := range w.Requests {
		if r.Index != i || (i > 0 && r.Arrival < w.Requests[i-1].Arrival) {
			t.Fatalf("request %d out of order: %+v", i, r)
		}
		seen[r.Arrival] = true
	}
	if len(seen) < 95 {
		t.Fatalf("only %d distinct arrivals out of 100", len(seen))
	}
	// Each arrival moved forward by less than the quantum, so the i-th
	// earliest did too.
	for i := range before {
		if d := w.Requests[i].Arrival - before[i].Arrival; d < 0 || d >= 3*time.Second {
			t.Fatalf("the %d-th arrival moved by %v", i, d)
		}
	}
	again := &Workload{Requests: before}
	again.Spread(3*time.Second, 7)
	if !slices.EqualFunc(again.Requests, w.Requests, func(a, b Request) bool { return a.Arrival == b.Arrival }) {
		t.Fatal("the same seed spread differently")
	}
	if err := w.Spread(-1, 1); err == nil {
		t.Fatal("a negative spread was accepted")
	}
}
