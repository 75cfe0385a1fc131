// Command kvsim runs one simulated vLLM-compatible inference engine, or a fleet of them on
// consecutive ports.
//
//	kvsim --listen 127.0.0.1:9001 --replicas 4
//
// serves replica-0 on port 9001 through replica-3 on port 9004. See kvsim --help.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"go.uber.org/zap"

	"github.com/llmaffinity/caddy-llm-affinity/kvsim"
)

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "kvsim:", err)
		os.Exit(1)
	}
}

func run(args []string) error {
	fs := flag.NewFlagSet("kvsim", flag.ContinueOnError)
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: kvsim [flags]\n\n"+
			"Runs simulated vLLM-compatible inference engines (OpenAI API, /health, /metrics,\n"+
			"/kvsim/state, /kvsim/faults). With --replicas N, replica i listens on the port of\n"+
			"--listen plus i and is named <--name-prefix>i.\n\nFlags:\n")
		fs.PrintDefaults()
	}
	var (
		cfg        kvsim.Config
		faults     kvsim.Faults
		listen     = fs.String("listen", "127.0.0.1:9001", "`address` of the first replica; further replicas use the following ports")
		replicas   = fs.Int("replicas", 1, "number of replicas to run")
		namePrefix = fs.String("name-prefix", "replica-", "replica names are this prefix followed by the replica index (sent in the X-Kvsim-Replica header)")
		speed      = fs.Float64("speed", 1, "simulated time runs this many times faster than wall clock")
		adapters   = fs.String("adapters", "", "comma-separated LoRA adapter names known at start (on storage)")
		verbose    = fs.Bool("verbose", false, "log every request (never prompt text)")
	)
	fs.StringVar(&cfg.Model, "model", kvsim.DefaultModel, "served base model name")
	fs.IntVar(&cfg.MaxModelLen, "max-model-len", 131072, "longest context (prompt plus output tokens) accepted")
	fs.IntVar(&cfg.BlockSize, "block-size", 16, "tokens per KV block")
	fs.IntVar(&cfg.NumGPUBlocks, "num-gpu-blocks", 8192, "number of KV blocks (KV capacity = blocks x block size tokens)")
	fs.IntVar(&cfg.MaxNumSeqs, "max-num-seqs", 256, "maximum number of running sequences")
	fs.IntVar(&cfg.MaxNumBatchedTokens, "max-num-batched-tokens", 8192, "token budget of one engine step (chunked prefill)")
	fs.IntVar(&cfg.BytesPerToken, "bytes-per-token", 4, "pseudo-tokenizer token length in bytes (1..16)")
	fs.IntVar(&cfg.DefaultOutputTokens, "default-output-tokens", 128, "tokens generated when a request sets neither max_tokens nor kvsim_output_tokens")
	fs.BoolVar(&cfg.DisablePrefixCaching, "disable-prefix-caching", false, "turn the prefix cache off")
	fs.DurationVar(&cfg.StepOverhead, "step-overhead", 8*time.Millisecond, "fixed time of one engine step")
	fs.DurationVar(&cfg.PerPrefillToken, "per-prefill-token", time.Second/15000, "step time per prompt token computed")
	fs.DurationVar(&cfg.PerDecodeSequence, "per-decode-sequence", 60*time.Microsecond, "step time per decoding sequence")
	fs.DurationVar(&cfg.PerContextToken, "per-context-token", 40*time.Nanosecond, "step time per context token read by attention")
	fs.IntVar(&cfg.MaxLoRAs, "max-loras", 4, "LoRA adapter slots on the GPU")
	fs.IntVar(&cfg.MaxCPULoRAs, "max-cpu-loras", 16, "LoRA adapters kept in host memory")
	fs.DurationVar(&cfg.LoRAHostLoad, "lora-host-load", 30*time.Millisecond, "time to load an adapter from host memory to the GPU")
	fs.DurationVar(&cfg.LoRAStorageLoad, "lora-storage-load", 2*time.Second, "time to load an adapter from storage")
	fs.BoolVar(&faults.Unhealthy, "fault-unhealthy", false, "answer 503 on /health")
	fs.Float64Var(&faults.ErrorRate, "fault-error-rate", 0, "probability (0..1) that a generation request fails with 500")
	fs.BoolVar(&faults.Stall, "fault-stall", false, "accept requests but produce nothing until unstalled via POST /kvsim/faults")
	fs.IntVar(&faults.CutAfterTokens, "fault-cut-after-tokens", 0, "close each generation response's connection after this many tokens (0: never)")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil
		}
		return err
	}
	if *replicas < 1 {
		return errors.New("--replicas must be at least 1")
	}
	if *adapters != "" {
		for _, a := range strings.Split(*adapters, ",") {
			if a = strings.TrimSpace(a); a != "" {
				cfg.Adapters = append(cfg.Adapters, a)
			}
		}
	}
	host, portText, err := net.SplitHostPort(*listen)
	if err != nil {
		return fmt.Errorf("--listen: %w", err)
	}
	port, err := strconv.Atoi(portText)
	if err != nil {
		return fmt.Errorf("--listen port: %w", err)
	}
	logger := zap.NewNop()
	if *verbose {
		if logger, err = zap.NewDevelopment(); err != nil {
			return err
		}
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	errc := make(chan error, *replicas)
	var servers []*http.Server
	for i := range *replicas {
		name := *namePrefix + strconv.Itoa(i)
		sim, err := kvsim.NewServer(kvsim.ServerConfig{Name: name, Engine: cfg, Speed: *speed, Faults: faults, Logger: logger.Named(name)})
		if err != nil {
			return err
		}
		defer sim.Close()
		addr := net.JoinHostPort(host, strconv.Itoa(port+i))
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			return err
		}
		srv := &http.Server{Handler: sim, ReadHeaderTimeout: 10 * time.Second}
		servers = append(servers, srv)
		fmt.Fprintf(os.Stderr, "kvsim: %s serving %s on http://%s\n", name, cfg.Model, ln.Addr())
		go func() { errc <- srv.Serve(ln) }()
	}
	select {
	case <-ctx.Done():
	case err := <-errc:
		return err
	}
	shutdownCtx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	for _, srv := range servers {
		_ = srv.Shutdown(shutdownCtx)
	}
	return nil
}
