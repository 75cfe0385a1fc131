// Command llmbench replays an LLM request workload (a Mooncake-format trace or a built-in
// generator) under each routing policy and reports time to first token, latency, throughput,
// prefix cache hit rate and load spread per policy.
//
// Run it with --help for every flag.
package main

import (
	"cmp"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"os/signal"
	"strings"
	"time"

	"github.com/schollz/progressbar/v3"

	"github.com/llmaffinity/caddy-llm-affinity/kvsim"
	"github.com/llmaffinity/caddy-llm-affinity/llmbench"
	"github.com/llmaffinity/caddy-llm-affinity/scorer"
	// --mode http: a real Caddy with the llm_affinity plugin in front of kvsim servers.
	_ "github.com/llmaffinity/caddy-llm-affinity/llmbench/httprun"
)

// progressDelay is how long a replay runs before a progress bar appears, so quick runs stay
// quiet.
const progressDelay = 2 * time.Second

type options struct {
	mode           string
	workload       string
	replicas       int
	policies       string
	speed          float64
	timeScale      float64
	requests       int
	rate           float64
	seed           uint64
	routerSeed     uint64
	routerSeeds    int
	evictionWeight float64
	jsonPath       string
	svgPath        string
	maxTokens      int
	kvBlocks       int
	maxNumSeqs     int
	queueTimeout   time.Duration
	queueLimit     int
	outputEstimate string
	outputTokens   int
	prefillRate    float64
	decodeRate     float64
	imposedWeight  float64
	decodeWeight   float64
	progress       bool
	routers        int
	spread         time.Duration
	sync           string
	syncDelay      time.Duration
	restartAt      time.Duration
	restartSnap    string
	routerKV       int
	gen            llmbench.GeneratorOptions
}

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

func newFlagSet(o *options, stderr io.Writer) *flag.FlagSet {
	fs := flag.NewFlagSet("llmbench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&o.mode, "mode", "sim", "`sim`: virtual-time simulation (router code + kvsim engine models, no network); http: a real in-process Caddy (the llm_affinity plugin, or Caddy's own lb_policy) in front of kvsim servers on loopback ports, each request streamed at its arrival time (see --time-scale)")
	fs.StringVar(&o.workload, "workload", "gsp", "a generator (gsp, mrqa, lora, noprefix) or the `path` of a Mooncake-format JSONL trace")
	fs.IntVar(&o.replicas, "replicas", 8, "number of engine replicas")
	fs.StringVar(&o.policies, "policies", "all", "comma-separated `list` of policies: "+strings.Join(llmbench.Policies(), ", ")+"; all = every one")
	fs.Float64Var(&o.speed, "speed", 1, "replay `factor`: arrival times are divided by it (2 = twice as fast, twice the load); applies to traces and generators, in both modes")
	fs.Float64Var(&o.timeScale, "time-scale", 1, "http: run the kvsim engines `N` times faster than wall clock: requests are sent at arrival/N wall seconds, the router's rates and timeouts are scaled to match, and times are reported in simulated seconds (wall × N), so they compare with sim mode; the workload and its load are unchanged (that is --speed). High values add HTTP and timer noise")
	fs.IntVar(&o.requests, "requests", 0, "keep only the first `N` requests of the workload (0 = all)")
	fs.Float64Var(&o.rate, "rate", 0, "generators: Poisson arrival rate in `requests/s` (0 = the generator's default: gsp 64, mrqa 24, lora 24, noprefix 40; inf = all at once); traces keep their timestamps (use --speed)")
	fs.Uint64Var(&o.seed, "seed", 1, "`seed` of the generators and of the router's random choices")
	fs.Uint64Var(&o.routerSeed, "router-seed", 0, "sim: `seed` of the llm_affinity routers' random choices alone (ties), to see how much they matter with the workload fixed (0 = --seed); Caddy's random and least_conn draw from Caddy's own unseeded source, and http mode's routers use their own random sources")
	fs.IntVar(&o.routerSeeds, "router-seeds", 1, "sim: replay each policy with `N` router seeds (--router-seed, or --seed, and the N-1 after it), the workload fixed; the table shows each figure's min–max over them and checks the default strategy's goals against the best policy")
	fs.StringVar(&o.jsonPath, "json", "", "write the run's parameters and each policy's figures as JSON to `file`")
	fs.StringVar(&o.svgPath, "svg", "", "write the TTFT distribution of each policy (CDF, log time axis) as SVG to `file`")
	fs.IntVar(&o.maxTokens, "max-tokens", 0, "max_tokens every request sends, as max(`N`, its output length): it bounds the router's output estimate, and is the estimate with --output-estimate max_tokens (0 = exactly the output length, as SGLang's and LMCache's clients send)")
	fs.IntVar(&o.kvBlocks, "kv-blocks", 0, "KV cache size of each replica in 16-token `blocks` (0 = kvsim's default, 8192 = 131,072 tokens)")
	fs.IntVar(&o.maxNumSeqs, "max-num-seqs", 0, "most sequences a replica runs at once (0 = kvsim's default, 256)")
	fs.IntVar(&o.queueLimit, "queue-limit", 0, "llm_affinity: how many requests may wait at the gateway at once, each router; one more is shed at once (0 = the plugin's default, 1024; negative = no limit; the plugin's queue_limit)")
	fs.DurationVar(&o.queueTimeout, "queue-timeout", llmbench.DefaultQueueTimeout, "llm_affinity: how long a request may wait to start: queued at a replica until the KV it needs frees (when expected within this), or at the gateway when no replica can start it in time, then shed; negative = only where it fits now, else shed at once (the plugin's queue_timeout)")
	fs.StringVar(&o.outputEstimate, "output-estimate", llmbench.OutputAverage, "llm_affinity: the router's estimate of a request's output: average (running mean per model, bounded by max_tokens), max_tokens, or fixed (the plugin's output_estimate)")
	fs.IntVar(&o.outputTokens, "output-tokens", llmbench.DefaultOutputTokens, "llm_affinity: the output estimate before any output was observed, and the fixed estimate (the plugin's output_tokens)")
	fs.Float64Var(&o.prefillRate, "prefill-rate", 0, "llm_affinity: prefill `tokens/s` the scorer assumes (0 = 1/per-prefill-token time of the engine)")
	fs.Float64Var(&o.decodeWeight, "decode-weight", 0, "llm_affinity/ttft: weight of the request's own generation time on a replica (0 = the default, 0.1; negative = off)")
	fs.Float64Var(&o.imposedWeight, "imposed-delay-weight", 0, "llm_affinity/ttft: weight of the delay a request's prefill imposes on the requests already on a replica (0 = the default, 0.1; negative = off)")
	fs.Float64Var(&o.evictionWeight, "eviction-weight", 0, "llm_affinity/ttft: weight of what a placement evicts: the prefill of cached prompts pushed out of a full prefix cache, and the reload of an adapter pushed out of full GPU slots (0 = the default; negative = off)")
	fs.Float64Var(&o.decodeRate, "decode-rate", 0, "llm_affinity: aggregate decode `tokens/s` the scorer assumes (0 = derived from the engine config at a batch of 64 and the workload's mean context)")
	fs.DurationVar(&o.spread, "spread", 0, "move each arrival forward by a random time below `d` (seeded by --seed), for traces whose timestamps are rounded (Mooncake's are on a 3s grid: --spread 3s)")
	fs.IntVar(&o.routers, "routers", 1, "sim: number of routers sharing the replicas; arrivals go to them in turn, per request, as an L4 balancer spreads them")
	fs.StringVar(&o.sync, "sync", "off", "sim, llm_affinity with --routers > 1: `on` shares the routers' state (each applies the others' routing events, as the plugin's sync option does over NATS), off keeps each router's own view")
	fs.DurationVar(&o.syncDelay, "sync-delay", 0, "sim with --sync on: how long an event takes to reach the other routers")
	fs.DurationVar(&o.restartAt, "restart-router-at", 0, "sim, llm_affinity: restart the first router at this time of the replay (`d`; 0 = never): a new process under a new name takes its arrivals while the old one finishes what it has in flight")
	fs.StringVar(&o.restartSnap, "restart-snapshot", "on", "sim with --sync on and --restart-router-at: `on` starts the restarted router with the next router's snapshot of the view (index and stored responses' homes), as the plugin's sync does; off starts it with an empty index")
	fs.IntVar(&o.routerKV, "router-kv-capacity", 0, "sim: the KV capacity in `tokens` the llm_affinity routers are told each replica has (0 = the engines' own, as kv_capacity set right or scraping gives the plugin; -1 = unknown, as the plugin is with neither)")
	fs.BoolVar(&o.progress, "progress", true, "show a progress bar on stderr when a replay runs longer than 2s")

	fs.IntVar(&o.gen.GSP.Groups, "gsp-groups", 64, "gsp: number of shared system prompts")
	fs.IntVar(&o.gen.GSP.PromptsPerGroup, "gsp-prompts-per-group", 16, "gsp: questions per system prompt")
	fs.IntVar(&o.gen.GSP.SystemTokens, "gsp-system-len", 2048, "gsp: system prompt `tokens`")
	fs.IntVar(&o.gen.GSP.QuestionTokens, "gsp-question-len", 128, "gsp: question `tokens`")
	fs.IntVar(&o.gen.GSP.OutputTokens, "gsp-output-len", 256, "gsp: output `tokens`")

	fs.IntVar(&o.gen.MRQA.Users, "mrqa-users", 64, "mrqa: concurrent users (each a session)")
	fs.IntVar(&o.gen.MRQA.Rounds, "mrqa-rounds", 8, "mrqa: questions per user")
	fs.IntVar(&o.gen.MRQA.SystemTokens, "mrqa-system-len", 1000, "mrqa: system prompt `tokens` shared by all users")
	fs.IntVar(&o.gen.MRQA.HistoryTokens, "mrqa-history-len", 2000, "mrqa: per-user history `tokens`")
	fs.IntVar(&o.gen.MRQA.QuestionTokens, "mrqa-question-len", 64, "mrqa: question `tokens`")
	fs.IntVar(&o.gen.MRQA.AnswerTokens, "mrqa-answer-len", 100, "mrqa: answer `tokens` (output, and appended to the next round's prompt)")

	fs.IntVar(&o.gen.LoRA.Adapters, "lora-adapters", 32, "lora: tenants, each with its own adapter (the request's model) and system prompt")
	fs.IntVar(&o.gen.LoRA.Requests, "lora-requests", 1024, "lora: number of requests")
	fs.IntVar(&o.gen.LoRA.SystemTokens, "lora-system-len", 1024, "lora: per-tenant system prompt `tokens`")
	fs.IntVar(&o.gen.LoRA.QuestionTokens, "lora-question-len", 256, "lora: question `tokens`")
	fs.IntVar(&o.gen.LoRA.OutputTokens, "lora-output-len", 128, "lora: output `tokens`")
	fs.Float64Var(&o.gen.LoRA.ZipfExponent, "lora-zipf", 1, "lora: Zipf `exponent` of tenant popularity (tenant k has weight 1/(k+1)^s)")

	fs.IntVar(&o.gen.NoPrefix.Requests, "noprefix-requests", 1024, "noprefix: number of requests (lengths from the Azure LLM inference trace 2023, conversation; no shared prefixes)")

	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), `Usage: llmbench [flags]

Replays an LLM workload under each routing policy and prints, per policy, the token-weighted
prefix cache hit rate, the cold requests (served with nothing from the prefix cache: a
prefix's first sight, or a copy of it onto another replica), TTFT p50/p90/p99, end-to-end
latency p50/p99, output throughput, goodput (requests served per second), load spread (max/mean requests and tokens per replica),
shed and errored requests. A shed or failed request is a failure, not a missing sample: the
percentiles are over every request, failures as infinite ("inf" in the table, "+Inf" in the
JSON, where null means no value at all).

Policies: llm_affinity/<strategy> (the plugin, with scorer strategies ttft, sglang, llmd,
dynamo, least_work) and Caddy's own round_robin, least_conn, random, first and header. header
hashes the request's session (mrqa: user, lora: tenant, a trace's "session" field) or, without
one, the id of the first prompt block (Mooncake: hash_ids[0], the same for every request of the
conversation trace).

In http mode each policy gets fresh replicas and a fresh in-process Caddy on 127.0.0.1 (no
admin endpoint, no HTTPS); the llm_affinity policy is configured as sim mode configures its
mirror of it, and header hashes an X-Session-Id header the client sets to the routing key above.
Times are simulated seconds in both modes.

Example:
  llmbench --mode sim --workload gsp --replicas 8 --json out.json --svg ttft.svg
  llmbench --mode http --workload gsp --replicas 4 --requests 200 --time-scale 2
  llmbench --workload /path/mooncake_conversation_trace.jsonl --policies llm_affinity/ttft,round_robin

Flags:
`)
		fs.PrintDefaults()
	}
	return fs
}

func run(args []string, stdout, stderr io.Writer) int {
	var o options
	fs := newFlagSet(&o, stderr)
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "llmbench: unexpected arguments %q\n", fs.Args())
		return 2
	}
	if err := bench(o, stdout, stderr); err != nil {
		if errors.Is(err, errHTTPUnavailable) {
			return 2
		}
		var usage usageError
		fmt.Fprintf(stderr, "llmbench: %v\n", err)
		if errors.As(err, &usage) {
			return 2
		}
		return 1
	}
	return 0
}

// errHTTPUnavailable: --mode http in a build where no package set llmbench.HTTPRunner.
var errHTTPUnavailable = errors.New("http mode unavailable")

// usageError is an error the user fixes by changing the command line (exit status 2).
type usageError struct{ error }

func bench(o options, stdout, stderr io.Writer) error {
	policies, err := llmbench.ParsePolicies(o.policies)
	if err != nil {
		return usageError{err}
	}
	if o.replicas < 1 {
		return usageError{fmt.Errorf("--replicas must be at least 1")}
	}
	// Counts whose 0 means a default: below it is a mistake, refused
	// before anything runs (the JSON would record the mistake).
	for name, n := range map[string]int{"requests": o.requests, "max-tokens": o.maxTokens, "kv-blocks": o.kvBlocks,
		"max-num-seqs": o.maxNumSeqs, "output-tokens": o.outputTokens} {
		if n < 0 {
			return usageError{fmt.Errorf("--%s must not be negative, got %d", name, n)}
		}
	}
	// The generators' counts and lengths: their flags default to what a
	// 0 would fall back to, so a 0 here is a mistake too.
	for name, n := range map[string]int{
		"gsp-groups": o.gen.GSP.Groups, "gsp-prompts-per-group": o.gen.GSP.PromptsPerGroup,
		"gsp-system-len": o.gen.GSP.SystemTokens, "gsp-question-len": o.gen.GSP.QuestionTokens, "gsp-output-len": o.gen.GSP.OutputTokens,
		"mrqa-users": o.gen.MRQA.Users, "mrqa-rounds": o.gen.MRQA.Rounds, "mrqa-system-len": o.gen.MRQA.SystemTokens,
		"mrqa-history-len": o.gen.MRQA.HistoryTokens, "mrqa-question-len": o.gen.MRQA.QuestionTokens, "mrqa-answer-len": o.gen.MRQA.AnswerTokens,
		"lora-adapters": o.gen.LoRA.Adapters, "lora-requests": o.gen.LoRA.Requests, "lora-system-len": o.gen.LoRA.SystemTokens,
		"lora-question-len": o.gen.LoRA.QuestionTokens, "lora-output-len": o.gen.LoRA.OutputTokens,
		"noprefix-requests": o.gen.NoPrefix.Requests,
	} {
		if n < 1 {
			return usageError{fmt.Errorf("--%s must be at least 1, got %d", name, n)}
		}
	}
	// The outputs are written after the replays, which may take minutes:
	// a path that cannot be written fails now.
	for _, path := range []string{o.jsonPath, o.svgPath} {
		if err := checkWritable(path); err != nil {
			return usageError{err}
		}
	}
	if o.routerKV < -1 {
		return usageError{fmt.Errorf("--router-kv-capacity must be -1 (unknown), 0 (the engines') or a number of tokens, got %d", o.routerKV)}
	}
	for name, v := range map[string]float64{"prefill-rate": o.prefillRate, "decode-rate": o.decodeRate, "lora-zipf": o.gen.LoRA.ZipfExponent} {
		if !(v >= 0) || math.IsInf(v, 0) {
			return usageError{fmt.Errorf("--%s must be a finite number, 0 or more, got %v", name, v)}
		}
	}
	switch o.outputEstimate {
	case llmbench.OutputAverage, llmbench.OutputMaxTokens, llmbench.OutputFixed:
	default:
		return usageError{fmt.Errorf("--output-estimate must be average, max_tokens or fixed, got %q", o.outputEstimate)}
	}
	// The runner reports progress to whichever policy's bar is current.
	var bar *progressBar
	cfg := llmbench.Config{
		Replicas: o.replicas,
		Engine:   kvsim.Config{NumGPUBlocks: o.kvBlocks, MaxNumSeqs: o.maxNumSeqs},
		Seed:     cmp.Or(o.routerSeed, o.seed),
		Progress: func(done, total int) {
			if bar != nil {
				bar.update(done, total)
			}
		},
	}
	for name, w := range map[string]float64{"imposed-delay-weight": o.imposedWeight, "decode-weight": o.decodeWeight, "eviction-weight": o.evictionWeight} {
		if math.IsNaN(w) || math.IsInf(w, 0) {
			return usageError{fmt.Errorf("--%s must be a finite number, got %v", name, w)}
		}
	}
	if o.routers < 1 || (o.routers > 1 && o.mode != "sim") {
		return usageError{fmt.Errorf("--routers must be at least 1, and above 1 only in sim mode, got %d", o.routers)}
	}
	if o.sync != "on" && o.sync != "off" {
		return usageError{fmt.Errorf("--sync must be on or off, got %q", o.sync)}
	}
	if o.routerSeeds < 1 || (o.routerSeeds > 1 && o.mode != "sim") {
		return usageError{fmt.Errorf("--router-seeds must be at least 1, and above 1 only in sim mode, got %d", o.routerSeeds)}
	}
	if o.syncDelay < 0 {
		return usageError{fmt.Errorf("--sync-delay must not be negative, got %v", o.syncDelay)}
	}
	if o.restartAt < 0 || (o.restartAt > 0 && o.mode != "sim") {
		return usageError{fmt.Errorf("--restart-router-at must not be negative, and is for sim mode only, got %v", o.restartAt)}
	}
	if o.restartSnap != "on" && o.restartSnap != "off" {
		return usageError{fmt.Errorf("--restart-snapshot must be on or off, got %q", o.restartSnap)}
	}
	// Both modes configure the llm_affinity policy from the same settings.
	settings := &llmbench.Sim{
		Routers:                o.routers,
		Sync:                   o.sync == "on",
		SyncDelay:              o.syncDelay,
		RestartAt:              o.restartAt,
		RestartSnapshot:        o.restartSnap == "on",
		KVCapacityTokens:       o.routerKV,
		Config:                 cfg,
		QueueTimeout:           o.queueTimeout,
		QueueLimit:             o.queueLimit,
		OutputEstimate:         o.outputEstimate,
		OutputTokens:           o.outputTokens,
		PrefillTokensPerSecond: o.prefillRate,
		DecodeTokensPerSecond:  o.decodeRate,
		Scorer:                 scorer.Options{ImposedDelayWeight: o.imposedWeight, DecodeWeight: o.decodeWeight, EvictionWeight: o.evictionWeight},
	}
	var runner llmbench.Runner
	switch o.mode {
	case "sim":
		runner = settings
	case "http":
		if llmbench.HTTPRunner == nil {
			fmt.Fprintln(stderr, "http mode needs the caddyllm plugin, which this build lacks")
			return errHTTPUnavailable
		}
		if o.timeScale <= 0 || math.IsNaN(o.timeScale) || math.IsInf(o.timeScale, 0) {
			return usageError{fmt.Errorf("--time-scale must be a positive number, got %v", o.timeScale)}
		}
		if runner, err = llmbench.HTTPRunner(settings, o.timeScale); err != nil {
			return err
		}
	default:
		return usageError{fmt.Errorf("--mode must be sim or http, got %q", o.mode)}
	}

	isGenerator := llmbench.IsGenerator(o.workload)
	if !isGenerator && o.rate != 0 {
		return usageError{errors.New("--rate applies to generators; a trace keeps its timestamps (use --speed)")}
	}
	o.gen.Seed = o.seed
	o.gen.Rate = o.rate
	w, err := llmbench.LoadWorkload(o.workload, o.gen)
	if err != nil {
		return err
	}
	w.Truncate(o.requests)
	if err := w.Spread(o.spread, o.seed); err != nil {
		return usageError{err}
	}
	if err := w.Speedup(o.speed); err != nil {
		return usageError{err}
	}
	w.SetMaxTokens(o.maxTokens)
	st := w.Stats()

	params := map[string]any{
		"mode": o.mode, "workload": o.workload, "replicas": o.replicas, "seed": o.seed,
		"speed": o.speed, "requests": st.Requests, "duration_s": st.DurationSeconds,
		"mean_prompt_tokens": st.MeanPromptTokens, "mean_output_tokens": st.MeanOutputTokens,
		"max_tokens": o.maxTokens, "kv_blocks": o.kvBlocks, "max_num_seqs": o.maxNumSeqs,
		"router_seed": cmp.Or(o.routerSeed, o.seed),
	}
	for k, v := range w.Params {
		if f, ok := v.(float64); ok && math.IsInf(f, 0) {
			v = "inf"
		}
		params[k] = v
	}
	prefill, decode := settings.Rates(w)
	params["queue_timeout_s"] = o.queueTimeout.Seconds()
	params["output_estimate"] = o.outputEstimate
	params["output_tokens"] = o.outputTokens
	params["prefill_tokens_per_s"] = prefill
	params["decode_tokens_per_s"] = decode
	// The weights the scorer used: the flag's 0 is the default, a
	// negative value turns the term off.
	params["imposed_delay_weight"] = scorer.Weight(o.imposedWeight, scorer.DefaultImposedDelayWeight)
	params["decode_weight"] = scorer.Weight(o.decodeWeight, scorer.DefaultDecodeWeight)
	params["eviction_weight"] = scorer.Weight(o.evictionWeight, scorer.DefaultEvictionWeight)
	params["router_kv_capacity"] = o.routerKV
	params["queue_limit"] = o.queueLimit
	params["routers"] = o.routers
	params["spread_s"] = o.spread.Seconds()
	params["sync"] = o.sync
	params["sync_delay_s"] = o.syncDelay.Seconds()
	if o.restartAt > 0 {
		// llm_affinity's routers only; a snapshot only from a peer.
		params["restart_router_at_s"] = o.restartAt.Seconds()
		snapshot := "off (no peer)"
		if o.sync == "on" && o.routers > 1 {
			snapshot = o.restartSnap
		}
		params["restart_snapshot"] = snapshot
		fmt.Fprintf(stderr, "llmbench: the first llm_affinity router restarts at %v, snapshot %s (Caddy's policies do not restart)\n", o.restartAt, snapshot)
	}
	if o.mode == "http" {
		params["time_scale"] = o.timeScale
	}
	fmt.Fprintf(stderr, "llmbench: %s, %d requests over %.1fs (prompt mean %.0f, output mean %.0f tokens), %d replicas, %d router(s), sync %s, %s mode\n",
		o.workload, st.Requests, st.DurationSeconds, st.MeanPromptTokens, st.MeanOutputTokens, o.replicas, o.routers, o.sync, o.mode)

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if o.routerSeeds > 1 {
		return benchSeeds(ctx, o, settings, w, policies, params, stdout, stderr)
	}
	var sums []llmbench.Summary
	for _, policy := range policies {
		bar = nil
		if o.progress {
			bar = newProgressBar(stderr, policy)
		}
		res, err := runner.Replay(ctx, w, policy)
		bar.finish()
		if err != nil {
			return fmt.Errorf("%s: %w", policy, err)
		}
		s := llmbench.Summarize(res)
		fmt.Fprintf(stderr, "llmbench: %-22s done in %.1fs wall\n", policy, s.WallSeconds)
		sums = append(sums, s)
	}

	if err := llmbench.WriteTable(stdout, sums); err != nil {
		return err
	}
	if o.jsonPath != "" {
		if err := writeFile(o.jsonPath, func(f io.Writer) error {
			return llmbench.WriteJSON(f, llmbench.Report{Parameters: params, Policies: sums})
		}); err != nil {
			return err
		}
	}
	if o.svgPath != "" {
		title := fmt.Sprintf("TTFT, %s, %d replicas (%s mode)", shortName(o.workload), o.replicas, o.mode)
		if err := writeFile(o.svgPath, func(f io.Writer) error { return llmbench.WriteSVG(f, title, sums) }); err != nil {
			return err
		}
	}
	return nil
}

// goalTarget is the policy whose goals --router-seeds checks: the plugin's
// default strategy.
const goalTarget = "llm_affinity/ttft"

// benchSeeds replays every policy once per router seed (sim mode) and
// reports each figure's spread, and the default strategy's goals.
func benchSeeds(ctx context.Context, o options, settings *llmbench.Sim, w *llmbench.Workload, policies []string, params map[string]any, stdout, stderr io.Writer) error {
	first := cmp.Or(o.routerSeed, o.seed)
	params["router_seeds"] = o.routerSeeds
	var all []llmbench.SeedRuns
	for _, policy := range policies {
		runs := llmbench.SeedRuns{Policy: policy}
		for i := range o.routerSeeds {
			settings.Config.Seed = first + uint64(i)
			res, err := settings.Replay(ctx, w, policy)
			if err != nil {
				return fmt.Errorf("%s, router seed %d: %w", policy, settings.Config.Seed, err)
			}
			runs.Runs = append(runs.Runs, llmbench.Summarize(res))
		}
		fmt.Fprintf(stderr, "llmbench: %-22s done, %d router seeds\n", policy, o.routerSeeds)
		all = append(all, runs)
	}
	if err := llmbench.WriteSpreadTable(stdout, all); err != nil {
		return err
	}
	goals := llmbench.CheckGoals(goalTarget, all)
	if err := llmbench.WriteGoals(stdout, goalTarget, goals); err != nil {
		return err
	}
	if o.jsonPath != "" {
		return writeFile(o.jsonPath, func(f io.Writer) error {
			return llmbench.WriteJSON(f, llmbench.Report{Parameters: params, SeedRuns: all, Goals: goals})
		})
	}
	return nil
}

func shortName(workload string) string {
	if i := strings.LastIndexAny(workload, `/\`); i >= 0 {
		return workload[i+1:]
	}
	return workload
}

// checkWritable reports whether a file can be written at path ("" is no
// file), leaving what is there as it was.
func checkWritable(path string) error {
	if path == "" {
		return nil
	}
	_, statErr := os.Stat(path)
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE, 0o666)
	if err != nil {
		return err
	}
	f.Close()
	if os.IsNotExist(statErr) {
		os.Remove(path)
	}
	return nil
}

func writeFile(path string, write func(io.Writer) error) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := write(f); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// progressBar shows a replay's progress once it has run for progressDelay; shorter replays
// print nothing.
type progressBar struct {
	out     io.Writer
	label   string
	started time.Time
	bar     *progressbar.ProgressBar
	calls   int
}

func newProgressBar(out io.Writer, label string) *progressBar {
	return &progressBar{out: out, label: label, started: time.Now()}
}

func (p *progressBar) update(done, total int) {
	p.calls++
	if p.bar == nil {
		// Reading the clock on every completion would cost more than the rest of the call.
		if p.calls%256 != 0 || time.Since(p.started) < progressDelay {
			return
		}
		p.bar = progressbar.NewOptions(total,
			progressbar.OptionSetWriter(p.out),
			progressbar.OptionSetDescription(fmt.Sprintf("%-22s", p.label)),
			progressbar.OptionShowCount(),
			progressbar.OptionSetWidth(30),
			progressbar.OptionThrottle(200*time.Millisecond),
			progressbar.OptionSetPredictTime(false),
			progressbar.OptionSetElapsedTime(false),
			progressbar.OptionClearOnFinish(),
		)
	}
	_ = p.bar.Set(done)
}

func (p *progressBar) finish() {
	if p != nil && p.bar != nil {
		_ = p.bar.Finish()
	}
}
