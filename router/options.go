package router

import (
	"fmt"
	"math"
	"time"

	"github.com/llmaffinity/caddy-llm-affinity/scorer"
)

// Output estimates: how a request's output length is expected before it is
// known.
const (
	// OutputAverage expects the running average of observed outputs for
	// the model, bounded by max_tokens (the default).
	OutputAverage = "average"
	// OutputMaxTokens expects each request to generate its max_tokens, or
	// Options.OutputTokens when it sets none.
	OutputMaxTokens = "max_tokens"
	// OutputFixed expects Options.OutputTokens for every request.
	OutputFixed = "fixed"
)

// Defaults of the decision's options and of an upstream's hardware profile.
const (
	DefaultOutputTokens           = 256
	DefaultMaxLoras               = 4
	DefaultAdapterLoadHost        = 30 * time.Millisecond
	DefaultAdapterLoadRemote      = 2 * time.Second
	DefaultPrefillTokensPerSecond = 12_000
	DefaultDecodeTokensPerSecond  = 2_500
	// DefaultQueueTimeout is how long a request may wait to start (at an
	// engine for KV to free, or at the gateway) before it is shed.
	DefaultQueueTimeout = 5 * time.Second
)

// maxRememberedAdapters is how many adapters an upstream is presumed to
// keep in host memory (vLLM's --max-cpu-loras default is larger; this
// bounds the list).
const maxRememberedAdapters = 16

// maxEngineAdapterSlots bounds the adapter slots an engine's report is
// taken for: the list of an upstream's adapters grows to as many.
const maxEngineAdapterSlots = 256

// Options tune the decision. The zero value means every default.
type Options struct {
	// Scorer is the decision rule and its tuning.
	Scorer scorer.Options
	// OutputEstimate is OutputAverage (default), OutputMaxTokens or
	// OutputFixed.
	OutputEstimate string
	// OutputTokens is the output estimate before any output was observed,
	// and the fixed estimate. Default DefaultOutputTokens.
	OutputTokens int
	// Adapters names LoRA adapters known in advance: a request for one
	// pays the load cost where it is not resident. Adapters an engine
	// lists with a parent model in /v1/models count too.
	Adapters map[string]bool
	// MaxLoras is how many adapters an upstream keeps on the GPU (vLLM's
	// --max-loras): the last MaxLoras sent there are presumed resident,
	// unless its engine reports its own count (scrape.Signals.MaxLoRAs).
	// Default DefaultMaxLoras.
	MaxLoras int
	// AdapterLoadHost is the cost of loading an adapter the engine holds
	// in host memory. Default DefaultAdapterLoadHost.
	AdapterLoadHost time.Duration
	// AdapterLoadRemote is the cost of loading an adapter from storage.
	// Default DefaultAdapterLoadRemote.
	AdapterLoadRemote time.Duration
	// QueueLimit is how many requests decided with these options may wait
	// at the gateway at once (Fleet.Hold); one more is shed at once.
	// Default DefaultQueueLimit; negative means no limit.
	QueueLimit int
}

// QueueLimitValue is the number of holds o allows.
func (o *Options) QueueLimitValue() int {
	switch {
	case o.QueueLimit == 0:
		return DefaultQueueLimit
	case o.QueueLimit < 0:
		return math.MaxInt
	}
	return o.QueueLimit
}

// WithDefaults returns o with its zero values set to the defaults.
func (o Options) WithDefaults() Options {
	if o.OutputEstimate == "" {
		o.OutputEstimate = OutputAverage
	}
	if o.OutputTokens <= 0 {
		o.OutputTokens = DefaultOutputTokens
	}
	if o.MaxLoras <= 0 {
		o.MaxLoras = DefaultMaxLoras
	}
	if o.AdapterLoadHost <= 0 {
		o.AdapterLoadHost = DefaultAdapterLoadHost
	}
	if o.AdapterLoadRemote <= 0 {
		o.AdapterLoadRemote = DefaultAdapterLoadRemote
	}
	return o
}

// Validate reports options the decision cannot use.
func (o Options) Validate() error {
	switch o.OutputEstimate {
	case "", OutputAverage, OutputMaxTokens, OutputFixed:
		return nil
	}
	return fmt.Errorf("output_estimate must be average, max_tokens or fixed, got %q", o.OutputEstimate)
}

// Hardware is what an upstream can do, for the time estimates and the
// KV-fit filter.
type Hardware struct {
	// PrefillTokensPerSecond is its prompt processing throughput.
	// Default DefaultPrefillTokensPerSecond.
	PrefillTokensPerSecond float64
	// DecodeTokensPerSecond is its aggregate generation throughput over a
	// batch. Default DefaultDecodeTokensPerSecond.
	DecodeTokensPerSecond float64
	// KVCapacityTokens is its KV cache size in tokens; 0 means unknown
	// (no KV-fit filter unless the engine reports it).
	KVCapacityTokens int
}

// WithDefaults returns h with unset rates set to the defaults.
func (h Hardware) WithDefaults() Hardware {
	if h.PrefillTokensPerSecond <= 0 {
		h.PrefillTokensPerSecond = DefaultPrefillTokensPerSecond
	}
	if h.DecodeTokensPerSecond <= 0 {
		h.DecodeTokensPerSecond = DefaultDecodeTokensPerSecond
	}
	return h
}
