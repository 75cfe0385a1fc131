// Package caddykvsim provides the Caddy HTTP handler module http.handlers.kvsim, which serves
// a simulated vLLM-compatible inference engine (package kvsim) from a Caddy site, so that one
// Caddyfile can start a kvsim fleet beside the router.
package caddykvsim

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/http"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"

	"github.com/llmaffinity/caddy-llm-affinity/kvsim"
)

func init() {
	caddy.RegisterModule(Handler{})
}

// engines holds the running simulated engines across config reloads, keyed by replica name
// and configuration: a reload that keeps a replica's configuration keeps its engine, with its
// KV cache, queues and counters; a changed configuration starts a fresh engine.
var engines = caddy.NewUsagePool()

// Handler serves a simulated vLLM-compatible inference engine: the OpenAI API
// (/v1/completions, /v1/chat/completions, /v1/models, /v1/load_lora_adapter,
// /v1/unload_lora_adapter), /health, /metrics with vLLM's metric names, and kvsim's control
// endpoints /kvsim/state and /kvsim/faults. It answers every request itself (it never calls
// the next handler) and sets the X-Kvsim-Replica response header to its name.
//
// EXPERIMENTAL: for tests, benchmarks and demonstrations; it computes nothing real.
type Handler struct {
	// Name is the replica name reported in the X-Kvsim-Replica response header. It also
	// identifies the engine across config reloads. Default: "kvsim".
	Name string `json:"name,omitempty"`

	// Model is the served base model name. Default: meta-llama/Llama-3.1-8B-Instruct.
	Model string `json:"model,omitempty"`

	// Speed runs simulated time this many times faster than the wall clock. Default: 1.
	Speed float64 `json:"speed,omitempty"`

	// MaxModelLen is the longest context, prompt plus output tokens, that is accepted.
	// Default: 131072.
	MaxModelLen int `json:"max_model_len,omitempty"`

	// BlockSize is the number of tokens in one KV cache block. Default: 16.
	BlockSize int `json:"block_size,omitempty"`

	// NumGPUBlocks is the number of KV cache blocks; the KV capacity in tokens is
	// NumGPUBlocks times BlockSize. Default: 8192.
	NumGPUBlocks int `json:"num_gpu_blocks,omitempty"`

	// MaxNumSeqs is the largest number of sequences that run at once. Default: 256.
	MaxNumSeqs int `json:"max_num_seqs,omitempty"`

	// MaxNumBatchedTokens is the token budget of one engine step, which chunks long
	// prefills. Default: 8192.
	MaxNumBatchedTokens int `json:"max_num_batched_tokens,omitempty"`

	// BytesPerToken is the length of one token of the pseudo-tokenizer, in bytes (1 to 16).
	// Default: 4.
	BytesPerToken int `json:"bytes_per_token,omitempty"`

	// DefaultOutputTokens is the number of tokens generated when a request sets neither
	// max_tokens nor kvsim_output_tokens. Default: 128.
	DefaultOutputTokens int `json:"default_output_tokens,omitempty"`

	// DisablePrefixCaching turns the prefix cache off, so every prompt is computed in full.
	DisablePrefixCaching bool `json:"disable_prefix_caching,omitempty"`

	// StepOverhead is the fixed duration of one engine step. Default: 8ms.
	StepOverhead caddy.Duration `json:"step_overhead,omitempty"`

	// PerPrefillToken is the step time added for each prompt token computed.
	// Default: 1/15000 of a second (15k prefill tokens per second).
	PerPrefillToken caddy.Duration `json:"per_prefill_token,omitempty"`

	// PerDecodeSequence is the step time added for each sequence that decodes a token.
	// Default: 60µs.
	PerDecodeSequence caddy.Duration `json:"per_decode_sequence,omitempty"`

	// PerContextToken is the step time added for each context token that attention reads.
	// Default: 40ns.
	PerContextToken caddy.Duration `json:"per_context_token,omitempty"`

	// MaxLoRAs is the number of LoRA adapter slots on the simulated GPU. Default: 4.
	MaxLoRAs int `json:"max_loras,omitempty"`

	// MaxCPULoRAs is the number of LoRA adapters kept in host memory. Default: 16.
	MaxCPULoRAs int `json:"max_cpu_loras,omitempty"`

	// LoRAHostLoad is the time to load an adapter from host memory into a GPU slot.
	// Default: 30ms.
	LoRAHostLoad caddy.Duration `json:"lora_host_load,omitempty"`

	// LoRAStorageLoad is the time to load an adapter from storage. Default: 2s.
	LoRAStorageLoad caddy.Duration `json:"lora_storage_load,omitempty"`

	// Adapters names the LoRA adapters known at start; they start on storage, so the first
	// request for one pays the storage load time.
	Adapters []string `json:"adapters,omitempty"`

	// Faults are failures injected from the start; they can be changed at run time with
	// POST /kvsim/faults.
	Faults *kvsim.Faults `json:"faults,omitempty"`

	server  *kvsim.Server
	poolKey string
}

// CaddyModule returns the Caddy module information.
func (Handler) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.kvsim",
		New: func() caddy.Module { return new(Handler) },
	}
}

// engineConfig translates the handler's fields into the engine's configuration.
func (h *Handler) engineConfig() kvsim.Config {
	return kvsim.Config{
		Model:                h.Model,
		MaxModelLen:          h.MaxModelLen,
		BlockSize:            h.BlockSize,
		NumGPUBlocks:         h.NumGPUBlocks,
		MaxNumSeqs:           h.MaxNumSeqs,
		MaxNumBatchedTokens:  h.MaxNumBatchedTokens,
		BytesPerToken:        h.BytesPerToken,
		DefaultOutputTokens:  h.DefaultOutputTokens,
		DisablePrefixCaching: h.DisablePrefixCaching,
		StepOverhead:         time.Duration(h.StepOverhead),
		PerPrefillToken:      time.Duration(h.PerPrefillToken),
		PerDecodeSequence:    time.Duration(h.PerDecodeSequence),
		PerContextToken:      time.Duration(h.PerContextToken),
		MaxLoRAs:             h.MaxLoRAs,
		MaxCPULoRAs:          h.MaxCPULoRAs,
		LoRAHostLoad:         time.Duration(h.LoRAHostLoad),
		LoRAStorageLoad:      time.Duration(h.LoRAStorageLoad),
		Adapters:             h.Adapters,
	}
}

// pooledServer lets the usage pool stop an engine when no config uses it any more.
type pooledServer struct{ *kvsim.Server }

// Destruct stops the engine's driver.
func (p pooledServer) Destruct() error { return p.Close() }

// Provision starts the engine, or reuses the one a previous config started with the same
// name and configuration.
func (h *Handler) Provision(ctx caddy.Context) error {
	if h.Name == "" {
		h.Name = "kvsim"
	}
	if h.Speed < 0 {
		return fmt.Errorf("kvsim %s: speed must not be negative", h.Name)
	}
	cfg := h.engineConfig()
	if err := cfg.WithDefaults().Validate(); err != nil {
		return fmt.Errorf("kvsim %s: %w", h.Name, err)
	}
	// Faults are excluded from the key: they change at run time and must not restart the
	// engine; they are (re)applied below.
	fingerprint, err := json.Marshal(struct {
		Config kvsim.Config
		Speed  float64
	}{cfg, h.Speed})
	if err != nil {
		return err
	}
	sum := sha256.Sum256(fingerprint)
	h.poolKey = h.Name + "/" + hex.EncodeToString(sum[:8])
	logger := ctx.Logger().With(zap.String("replica", h.Name))
	value, loaded, err := engines.LoadOrNew(h.poolKey, func() (caddy.Destructor, error) {
		srv, err := kvsim.NewServer(kvsim.ServerConfig{Name: h.Name, Engine: cfg, Speed: h.Speed, Logger: logger})
		if err != nil {
			return nil, err
		}
		return pooledServer{srv}, nil
	})
	if err != nil {
		return fmt.Errorf("kvsim %s: %w", h.Name, err)
	}
	h.server = value.(pooledServer).Server
	if h.Faults != nil {
		h.server.SetFaults(*h.Faults)
	}
	logger.Debug("kvsim engine ready", zap.Bool("reused", loaded))
	return nil
}

// ServeHTTP serves the simulated engine's API; it never calls next.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request, _ caddyhttp.Handler) error {
	h.server.ServeHTTP(w, r)
	return nil
}

// Cleanup releases this config's use of the engine; the engine stops when no config uses it.
func (h *Handler) Cleanup() error {
	if h.poolKey == "" {
		return nil
	}
	_, err := engines.Delete(h.poolKey)
	return err
}

// Server returns the engine server the handler serves, after Provision.
func (h *Handler) Server() *kvsim.Server { return h.server }

// Interface guards
var (
	_ caddy.Provisioner           = (*Handler)(nil)
	_ caddy.CleanerUpper          = (*Handler)(nil)
	_ caddyhttp.MiddlewareHandler = (*Handler)(nil)
	_ caddy.Destructor            = pooledServer{}
)
