package llmbench

import (
	"cmp"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"slices"
	"sort"
	"time"
)

// Generators names the built-in workload generators.
var Generators = []string{"gsp", "mrqa", "lora", "noprefix"}

// GSPParams shape SGLang's generated-shared-prefix workload: groups of prompts that share a
// system prompt, each followed by its own question. Zero fields take SGLang's defaults.
type GSPParams struct {
	// Groups is the number of distinct system prompts. Default 64.
	Groups int
	// PromptsPerGroup is the number of questions per system prompt. Default 16.
	PromptsPerGroup int
	// SystemTokens is the system prompt length. Default 2048.
	SystemTokens int
	// QuestionTokens is the question length. Default 128.
	QuestionTokens int
	// OutputTokens is the answer length. Default 256.
	OutputTokens int
}

func (p GSPParams) withDefaults() GSPParams {
	p.Groups = orInt(p.Groups, 64)
	p.PromptsPerGroup = orInt(p.PromptsPerGroup, 16)
	p.SystemTokens = orInt(p.SystemTokens, 2048)
	p.QuestionTokens = orInt(p.QuestionTokens, 128)
	p.OutputTokens = orInt(p.OutputTokens, 256)
	return p
}

// MRQAParams shape LMCache's multi-round QA workload: users in conversation, each round's
// prompt being the shared system prompt, the user's own history, and every earlier question
// and answer, so each user's prefix grows round after round. Zero fields take the defaults.
type MRQAParams struct {
	// Users is the number of concurrent users. Default 64.
	Users int
	// Rounds is the number of questions each user asks. Default 8.
	Rounds int
	// SystemTokens is the system prompt shared by every user. Default 1000.
	SystemTokens int
	// HistoryTokens is each user's own context, unique to the user. Default 2000.
	HistoryTokens int
	// QuestionTokens is the length of one question. Default 64.
	QuestionTokens int
	// AnswerTokens is the length of one answer. Default 100.
	AnswerTokens int
}

func (p MRQAParams) withDefaults() MRQAParams {
	p.Users = orInt(p.Users, 64)
	p.Rounds = orInt(p.Rounds, 8)
	p.SystemTokens = orInt(p.SystemTokens, 1000)
	p.HistoryTokens = orInt(p.HistoryTokens, 2000)
	p.QuestionTokens = orInt(p.QuestionTokens, 64)
	p.AnswerTokens = orInt(p.AnswerTokens, 100)
	return p
}

// LoRAParams shape a multi-tenant LoRA workload: each tenant has its own adapter (requests
// name it as their model) and its own system prompt; tenant popularity follows a Zipf law.
type LoRAParams struct {
	// Adapters is the number of tenants, one adapter each. Default 32.
	Adapters int
	// Requests is the number of requests. Default 1024.
	Requests int
	// SystemTokens is each tenant's system prompt length. Default 1024.
	SystemTokens int
	// QuestionTokens is the length of one question. Default 256.
	QuestionTokens int
	// OutputTokens is the answer length. Default 128.
	OutputTokens int
	// ZipfExponent skews tenant popularity: tenant k gets weight 1/(k+1)^s. 0 means the
	// default, 1; use a tiny positive value for nearly uniform.
	ZipfExponent float64
}

func (p LoRAParams) withDefaults() LoRAParams {
	p.Adapters = orInt(p.Adapters, 32)
	p.Requests = orInt(p.Requests, 1024)
	p.SystemTokens = orInt(p.SystemTokens, 1024)
	p.QuestionTokens = orInt(p.QuestionTokens, 256)
	p.OutputTokens = orInt(p.OutputTokens, 128)
	if p.ZipfExponent <= 0 {
		p.ZipfExponent = 1
	}
	return p
}

// NoPrefixParams shape a workload without prefix sharing, lengths drawn from the Azure LLM
// inference trace 2023 (conversation) distribution.
type NoPrefixParams struct {
	// Requests is the number of requests. Default 1024.
	Requests int
}

func (p NoPrefixParams) withDefaults() NoPrefixParams {
	p.Requests = orInt(p.Requests, 1024)
	return p
}

// Default arrival rates (requests per second) of the generators, chosen so that 8 default
// kvsim replicas are busy but not saturated by a cache-oblivious balancer.
var defaultRates = map[string]float64{
	"gsp":      64,
	"mrqa":     24,
	"lora":     24,
	"noprefix": 40,
}

// GeneratorOptions configure the built-in generators.
type GeneratorOptions struct {
	// Seed makes a workload reproducible: the same options give the same requests.
	Seed uint64
	// Rate is the mean arrival rate of the Poisson process in requests per second; 0 takes
	// the generator's default, +Inf sends everything at time zero.
	Rate     float64
	GSP      GSPParams
	MRQA     MRQAParams
	LoRA     LoRAParams
	NoPrefix NoPrefixParams
}

// DefaultRate returns the default arrival rate of a generator, 0 for an unknown name.
func DefaultRate(generator string) float64 { return defaultRates[generator] }

// IsGenerator reports whether name is a built-in generator.
func IsGenerator(name string) bool {
	_, ok := defaultRates[name]
	return ok
}

// LoadWorkload returns the workload a --workload value names: a built-in generator, or the
// path of a Mooncake-format trace file. Options apply to generators only.
func LoadWorkload(spec string, opts GeneratorOptions) (*Workload, error) {
	if IsGenerator(spec) {
		return Generate(spec, opts)
	}
	if _, err := os.Stat(spec); err != nil {
		return nil, fmt.Errorf("workload %q is neither a generator (%v) nor a readable trace file: %w", spec, Generators, err)
	}
	return ReadTraceFile(spec)
}

// Generate builds a workload with a built-in generator.
func Generate(generator string, opts GeneratorOptions) (*Workload, error) {
	rate := opts.Rate
	if rate == 0 {
		rate = defaultRates[generator]
	}
	if rate < 0 || math.IsNaN(rate) {
		return nil, fmt.Errorf("rate must be positive, got %v", rate)
	}
	// Separate streams for content and arrivals, so changing the rate keeps the requests.
	content := rand.New(rand.NewPCG(opts.Seed, 0x636f6e74656e74))
	arrivals := rand.New(rand.NewPCG(opts.Seed, 0x617272697661))
	var w *Workload
	var err error
	switch generator {
	case "gsp":
		w, err = generateGSP(opts.GSP.withDefaults(), opts.Seed, content)
	case "mrqa":
		w, err = generateMRQA(opts.MRQA.withDefaults(), opts.Seed, rate, arrivals)
	case "lora":
		w, err = generateLoRA(opts.LoRA.withDefaults(), opts.Seed, content)
	case "noprefix":
		w, err = generateNoPrefix(opts.NoPrefix.withDefaults(), opts.Seed, content)
	default:
		return nil, fmt.Errorf("unknown generator %q (want one of %v)", generator, Generators)
	}
	if err != nil {
		return nil, err
	}
	w.Name = generator
	w.Params["rate"] = rate
	w.Params["seed"] = opts.Seed
	if generator != "mrqa" { // mrqa times its users itself
		poissonArrivals(w.Requests, rate, arrivals)
	}
	w.finish()
	return w, nil
}

// poissonArrivals sets arrival times with exponential gaps of mean 1/rate, in request order.
func poissonArrivals(reqs []Request, rate float64, rng *rand.Rand) {
	var t float64
	for i := range reqs {
		if !math.IsInf(rate, 1) {
			t += rng.ExpFloat64() / rate
		}
		reqs[i].Arrival = time.Duration(t * float64(time.Second))
	}
}

func positive(name string, vals ...int) error {
	for _, v := range vals {
		if v < 1 {
			return fmt.Errorf("%s parameters must be positive", name)
		}
	}
	return nil
}

func generateGSP(p GSPParams, seed uint64, rng *rand.Rand) (*Workload, error) {
	if err := positive("gsp", p.Groups, p.PromptsPerGroup, p.SystemTokens, p.QuestionTokens, p.OutputTokens); err != nil {
		return nil, err
	}
	ns := fmt.Sprintf("gsp/%d/", seed)
	w := &Workload{Params: map[string]any{
		"gsp_groups": p.Groups, "gsp_prompts_per_group": p.PromptsPerGroup,
		"gsp_system_tokens": p.SystemTokens, "gsp_question_tokens": p.QuestionTokens,
		"gsp_output_tokens": p.OutputTokens,
	}}
	for g := range p.Groups {
		for q := range p.PromptsPerGroup {
			w.Requests = append(w.Requests, Request{
				Segments: []Segment{
					{ID: segmentID(ns+"system", int64(g), 0), Tokens: p.SystemTokens},
					{ID: segmentID(ns+"question", int64(g), int64(q)), Tokens: p.QuestionTokens},
				},
				OutputTokens: p.OutputTokens,
			})
		}
	}
	// SGLang shuffles the prompts unless --gsp-ordered.
	rng.Shuffle(len(w.Requests), func(i, j int) { w.Requests[i], w.Requests[j] = w.Requests[j], w.Requests[i] })
	return w, nil
}

// generateMRQA makes each user a Poisson process of rate/Users asking its rounds in order, so
// a user asks again about every Users/rate seconds, the schedule of LMCache's benchmark, and
// the superposition of the users is a Poisson process of the given rate. (A fixed user order
// would let round_robin pin every user to one replica whenever Users is a multiple of the
// replica count.) An answer is synthesised text standing for the model's reply: the next
// round's prompt contains it, so it is prompt prefix, not generated KV.
func generateMRQA(p MRQAParams, seed uint64, rate float64, arrivals *rand.Rand) (*Workload, error) {
	if err := positive("mrqa", p.Users, p.Rounds, p.SystemTokens, p.HistoryTokens, p.QuestionTokens, p.AnswerTokens); err != nil {
		return nil, err
	}
	ns := fmt.Sprintf("mrqa/%d/", seed)
	w := &Workload{Params: map[string]any{
		"mrqa_users": p.Users, "mrqa_rounds": p.Rounds, "mrqa_system_tokens": p.SystemTokens,
		"mrqa_history_tokens": p.HistoryTokens, "mrqa_question_tokens": p.QuestionTokens,
		"mrqa_answer_tokens": p.AnswerTokens,
	}}
	system := Segment{ID: segmentID(ns+"system", 0, 0), Tokens: p.SystemTokens}
	for round := range p.Rounds {
		for u := range p.Users {
			segs := make([]Segment, 0, 2+2*round+1)
			segs = append(segs, system, Segment{ID: segmentID(ns+"history", int64(u), 0), Tokens: p.HistoryTokens})
			for r := range round {
				segs = append(segs,
					Segment{ID: segmentID(ns+"question", int64(u), int64(r)), Tokens: p.QuestionTokens},
					Segment{ID: segmentID(ns+"answer", int64(u), int64(r)), Tokens: p.AnswerTokens})
			}
			segs = append(segs, Segment{ID: segmentID(ns+"question", int64(u), int64(round)), Tokens: p.QuestionTokens})
			w.Requests = append(w.Requests, Request{
				Segments:     segs,
				OutputTokens: p.AnswerTokens,
				Session:      fmt.Sprintf("user-%d", u),
			})
		}
	}
	// Requests are round-major: user u's round r is at r*Users+u.
	userRate := rate / float64(p.Users)
	for u := range p.Users {
		var t float64
		for round := range p.Rounds {
			if !math.IsInf(rate, 1) {
				t += arrivals.ExpFloat64() / userRate
			}
			w.Requests[round*p.Users+u].Arrival = time.Duration(t * float64(time.Second))
		}
	}
	slices.SortStableFunc(w.Requests, func(a, b Request) int { return cmp.Compare(a.Arrival, b.Arrival) })
	return w, nil
}

// AdapterName is the model name of tenant k's adapter in the lora workload.
func AdapterName(k int) string { return fmt.Sprintf("tenant-%02d-lora", k) }

func generateLoRA(p LoRAParams, seed uint64, rng *rand.Rand) (*Workload, error) {
	if err := positive("lora", p.Adapters, p.Requests, p.SystemTokens, p.QuestionTokens, p.OutputTokens); err != nil {
		return nil, err
	}
	ns := fmt.Sprintf("lora/%d/", seed)
	w := &Workload{Params: map[string]any{
		"lora_adapters": p.Adapters, "lora_requests": p.Requests, "lora_system_tokens": p.SystemTokens,
		"lora_question_tokens": p.QuestionTokens, "lora_output_tokens": p.OutputTokens,
		"lora_zipf_exponent": p.ZipfExponent,
	}}
	cdf := make([]float64, p.Adapters)
	var total float64
	for k := range cdf {
		total += 1 / math.Pow(float64(k+1), p.ZipfExponent)
		cdf[k] = total
	}
	for i := range p.Requests {
		k := sort.SearchFloat64s(cdf, rng.Float64()*total)
		k = min(k, p.Adapters-1)
		w.Requests = append(w.Requests, Request{
			Segments: []Segment{
				{ID: segmentID(ns+"system", int64(k), 0), Tokens: p.SystemTokens},
				{ID: segmentID(ns+"question", int64(i), 0), Tokens: p.QuestionTokens},
			},
			OutputTokens: p.OutputTokens,
			Model:        AdapterName(k),
			Session:      AdapterName(k),
		})
	}
	return w, nil
}

func generateNoPrefix(p NoPrefixParams, seed uint64, rng *rand.Rand) (*Workload, error) {
	if err := positive("noprefix", p.Requests); err != nil {
		return nil, err
	}
	ns := fmt.Sprintf("noprefix/%d/", seed)
	w := &Workload{Params: map[string]any{
		"noprefix_requests": p.Requests,
		"lengths":           "Azure LLM inference trace 2023 (conversation), Microsoft Azure, CC-BY-4.0",
	}}
	for i := range p.Requests {
		in := azureConv.input.sample(rng.Float64())
		out := azureConv.output.sample(rng.Float64())
		w.Requests = append(w.Requests, Request{
			Segments:     []Segment{{ID: segmentID(ns+"prompt", int64(i), 0), Tokens: in}},
			OutputTokens: out,
		})
	}
	return w, nil
}

func orInt(v, def int) int {
	if v != 0 {
		return v
	}
	return def
}
