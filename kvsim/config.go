package kvsim

import (
	"fmt"
	"slices"
	"time"
)

// DefaultModel is the base model name served when none is configured.
const DefaultModel = "meta-llama/Llama-3.1-8B-Instruct"

// Config configures one simulated engine. The zero value of every field means its default;
// the defaults approximate an 8B model on one H100. They are documented here only: the Caddy
// handler (package kvsim/caddykvsim) embeds Config, and its Caddyfile options and cmd/kvsim's
// flags are built from [Config.Options], under the fields' JSON names.
type Config struct {
	// Model is the base model: its name, and its root in /v1/models (vLLM's --model, the
	// model's path). Default: meta-llama/Llama-3.1-8B-Instruct.
	Model string `json:"model,omitempty"`

	// ServedModelName lists the names the base model is served under, as vLLM's
	// --served-model-name: a request may name any of them (or none: the base model), all
	// share one prefix cache, /v1/models lists each with Model as its root, and responses,
	// metrics and adapters' parent give the first. Default: Model alone.
	ServedModelName []string `json:"served_model_name,omitempty"`

	// MaxModelLen is the longest context (prompt plus output tokens) accepted. Default 131072.
	MaxModelLen int `json:"max_model_len,omitempty"`

	// BlockSize is the number of tokens in one KV block. Default 16.
	BlockSize int `json:"block_size,omitempty"`

	// NumGPUBlocks is the number of KV blocks. Default 8192 (131072 tokens at block size 16).
	NumGPUBlocks int `json:"num_gpu_blocks,omitempty"`

	// MaxNumSeqs is the largest number of sequences running at once. Default 256.
	MaxNumSeqs int `json:"max_num_seqs,omitempty"`

	// MaxNumBatchedTokens is the token budget of one step (chunked prefill). Default 8192.
	MaxNumBatchedTokens int `json:"max_num_batched_tokens,omitempty"`

	// BytesPerToken is the pseudo-tokenizer's token length in bytes. Default 4, range 1..16.
	BytesPerToken int `json:"bytes_per_token,omitempty"`

	// DefaultOutputTokens is the generated length of a chat request that sets neither
	// max_tokens (nor max_completion_tokens) nor kvsim_output_tokens: the simulated
	// model's own length. (A completions request without them gets vLLM's 16.) Default 128.
	DefaultOutputTokens int `json:"default_output_tokens,omitempty"`

	// DisablePrefixCaching turns the prefix cache off (every prompt is computed in full).
	DisablePrefixCaching bool `json:"disable_prefix_caching,omitempty"`

	// StepOverhead is the fixed time of one engine step (weights read, launch). Default 8ms.
	StepOverhead time.Duration `json:"step_overhead,omitempty"`

	// PerPrefillToken is the step time added per prompt token computed. Default 1/15000 s.
	PerPrefillToken time.Duration `json:"per_prefill_token,omitempty"`

	// PerDecodeSequence is the step time added per sequence decoding one token. Default 60µs.
	PerDecodeSequence time.Duration `json:"per_decode_sequence,omitempty"`

	// PerContextToken is the step time added per context token read by attention for every
	// scheduled sequence (KV bandwidth). Default 40ns.
	PerContextToken time.Duration `json:"per_context_token,omitempty"`

	// MaxLoRAs is the number of LoRA adapter slots on the GPU. Default 4.
	MaxLoRAs int `json:"max_loras,omitempty"`

	// MaxCPULoRAs is the number of adapters kept in host memory. Default 16.
	MaxCPULoRAs int `json:"max_cpu_loras,omitempty"`

	// LoRAHostLoad is the time to move an adapter from host memory to a GPU slot. Default 30ms.
	LoRAHostLoad time.Duration `json:"lora_host_load,omitempty"`

	// LoRAStorageLoad is the time to load an adapter from storage. Default 2s.
	LoRAStorageLoad time.Duration `json:"lora_storage_load,omitempty"`

	// Adapters names the LoRA adapters known at start; they start on storage.
	Adapters []string `json:"adapters,omitempty"`
}

// WithDefaults returns a copy of c with every zero field set to its default.
func (c Config) WithDefaults() Config {
	setInt := func(v *int, d int) {
		if *v == 0 {
			*v = d
		}
	}
	setDur := func(v *time.Duration, d time.Duration) {
		if *v == 0 {
			*v = d
		}
	}
	if c.Model == "" {
		c.Model = DefaultModel
	}
	setInt(&c.MaxModelLen, 131072)
	setInt(&c.BlockSize, 16)
	setInt(&c.NumGPUBlocks, 8192)
	setInt(&c.MaxNumSeqs, 256)
	setInt(&c.MaxNumBatchedTokens, 8192)
	setInt(&c.BytesPerToken, 4)
	setInt(&c.DefaultOutputTokens, 128)
	setDur(&c.StepOverhead, 8*time.Millisecond)
	setDur(&c.PerPrefillToken, time.Second/15000)
	setDur(&c.PerDecodeSequence, 60*time.Microsecond)
	setDur(&c.PerContextToken, 40*time.Nanosecond)
	setInt(&c.MaxLoRAs, 4)
	setInt(&c.MaxCPULoRAs, 16)
	setDur(&c.LoRAHostLoad, 30*time.Millisecond)
	setDur(&c.LoRAStorageLoad, 2*time.Second)
	return c
}

// An Option is one setting of a [Config] or of [Faults], named for the front ends that set
// them one at a time: the Caddyfile directive of package kvsim/caddykvsim and the flags of
// cmd/kvsim. Building both from [Config.Options] and [Faults.Options] keeps their names,
// their types and, for flags, their defaults those of the struct fields.
type Option struct {
	// Name is the field's JSON name, which is also its Caddyfile option; its command-line
	// flag is Name with dashes for underscores.
	Name string

	// Usage describes the setting in one line, for flag help. Defaults are documented on
	// the fields, not here.
	Usage string

	// Field points at the field: a *string, *int, *bool, *float64, *time.Duration or
	// *[]string. A []string option is a list: each use of it appends.
	Field any
}

// Options returns c's settings, with Field pointing into c.
func (c *Config) Options() []Option {
	return []Option{
		{"model", "base model name, its root in /v1/models", &c.Model},
		{"served_model_name", "names the base model is served under (default: model)", &c.ServedModelName},
		{"max_model_len", "longest context (prompt plus output tokens) accepted", &c.MaxModelLen},
		{"block_size", "tokens per KV block", &c.BlockSize},
		{"num_gpu_blocks", "number of KV blocks (KV capacity = blocks x block size tokens)", &c.NumGPUBlocks},
		{"max_num_seqs", "maximum number of running sequences", &c.MaxNumSeqs},
		{"max_num_batched_tokens", "token budget of one engine step (chunked prefill)", &c.MaxNumBatchedTokens},
		{"bytes_per_token", "pseudo-tokenizer token length in bytes (1..16)", &c.BytesPerToken},
		{"default_output_tokens", "tokens generated when a request sets neither max_tokens nor kvsim_output_tokens", &c.DefaultOutputTokens},
		{"disable_prefix_caching", "turn the prefix cache off", &c.DisablePrefixCaching},
		{"step_overhead", "fixed time of one engine step", &c.StepOverhead},
		{"per_prefill_token", "step time per prompt token computed", &c.PerPrefillToken},
		{"per_decode_sequence", "step time per decoding sequence", &c.PerDecodeSequence},
		{"per_context_token", "step time per context token read by attention", &c.PerContextToken},
		{"max_loras", "LoRA adapter slots on the GPU", &c.MaxLoRAs},
		{"max_cpu_loras", "LoRA adapters kept in host memory", &c.MaxCPULoRAs},
		{"lora_host_load", "time to load an adapter from host memory to the GPU", &c.LoRAHostLoad},
		{"lora_storage_load", "time to load an adapter from storage", &c.LoRAStorageLoad},
		{"adapters", "LoRA adapter names known at start (on storage)", &c.Adapters},
	}
}

// Validate reports a configuration that cannot run.
func (c Config) Validate() error {
	switch {
	case c.BlockSize < 1:
		return fmt.Errorf("block_size must be positive, got %d", c.BlockSize)
	case c.NumGPUBlocks < 1 || c.NumGPUBlocks > MaxGPUBlocks:
		return fmt.Errorf("num_gpu_blocks must be in 1..%d, got %d", MaxGPUBlocks, c.NumGPUBlocks)
	case c.BlockSize > 1<<12:
		return fmt.Errorf("block_size must be at most %d, got %d", 1<<12, c.BlockSize)
	case c.MaxNumSeqs < 1:
		return fmt.Errorf("max_num_seqs must be positive, got %d", c.MaxNumSeqs)
	case c.MaxNumBatchedTokens < 1:
		return fmt.Errorf("max_num_batched_tokens must be positive, got %d", c.MaxNumBatchedTokens)
	case c.BytesPerToken < 1 || c.BytesPerToken > 16:
		return fmt.Errorf("bytes_per_token must be in 1..16, got %d", c.BytesPerToken)
	case c.MaxModelLen < 1:
		return fmt.Errorf("max_model_len must be positive, got %d", c.MaxModelLen)
	case c.DefaultOutputTokens < 1:
		return fmt.Errorf("default_output_tokens must be positive, got %d", c.DefaultOutputTokens)
	case c.MaxLoRAs < 1 || c.MaxCPULoRAs < 1:
		return fmt.Errorf("max_loras and max_cpu_loras must be positive")
	case c.StepOverhead < 0 || c.PerPrefillToken < 0 || c.PerDecodeSequence < 0 || c.PerContextToken < 0:
		return fmt.Errorf("step time coefficients must not be negative")
	case c.LoRAHostLoad < 0 || c.LoRAStorageLoad < 0:
		return fmt.Errorf("lora_host_load and lora_storage_load must not be negative")
	case slices.Contains(c.ServedModelName, ""):
		return fmt.Errorf("served_model_name must not be empty")
	}
	for _, a := range c.Adapters {
		if slices.Contains(c.ServedNames(), a) {
			return fmt.Errorf("adapter %q is a served name of the base model", a)
		}
	}
	return nil
}

// ServedNames returns the names the base model is served under: ServedModelName, or Model
// when none is given. The first is the one responses give.
func (c Config) ServedNames() []string {
	if len(c.ServedModelName) > 0 {
		return c.ServedModelName
	}
	return []string{c.Model}
}

// MaxGPUBlocks bounds num_gpu_blocks: the simulator keeps a record per
// block, and a real GPU's KV cache holds far fewer (an 80 GB H100 serving
// an 8B model holds about 30,000 blocks of 16 tokens).
const MaxGPUBlocks = 1 << 22
