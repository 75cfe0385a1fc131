// Package caddykvsim provides the Caddy HTTP handler module http.handlers.kvsim, which serves
// a simulated vLLM-compatible inference engine (package kvsim) from a Caddy site, so that one
// Caddyfile can start a kvsim fleet beside the router.
package caddykvsim

import (
	"bytes"
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
// /v1/unload_lora_adapter), /tokenize and /detokenize, /health and /ping, /metrics with vLLM's
// metric names, and kvsim's control endpoints /kvsim/state and /kvsim/faults. It answers every
// request itself (it never calls the next handler) and sets the X-Kvsim-Replica response
// header to its name.
//
// EXPERIMENTAL: for tests, benchmarks and demonstrations; it computes nothing real.
type Handler struct {
	// Name is the replica name reported in the X-Kvsim-Replica response header. It also
	// identifies the engine across config reloads. Default: "kvsim".
	Name string `json:"name,omitempty"`

	// Config configures the simulated engine. Its fields are inline in the handler's JSON
	// under their kvsim.Config names (model, max_model_len, num_gpu_blocks, step_overhead,
	// ...), and each one left unset takes the default documented on kvsim.Config. Durations
	// are nanoseconds or duration strings such as "8ms", as elsewhere in Caddy.
	kvsim.Config

	// Speed runs simulated time this many times faster than the wall clock. Unset, it runs
	// in real time (see kvsim.ServerConfig).
	Speed float64 `json:"speed,omitempty"`

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

// UnmarshalJSON decodes the handler as Caddy decodes any module, rejecting unknown fields,
// and accepts the engine's durations as caddy.Duration does: nanoseconds or a duration
// string. kvsim.Config keeps plain time.Duration fields so that the engine does not depend
// on Caddy; the strings are parsed here.
func (h *Handler) UnmarshalJSON(b []byte) error {
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(b, &fields); err != nil {
		return err
	}
	type duration struct {
		name  string
		field *time.Duration
		raw   json.RawMessage
	}
	var durations []duration
	for _, o := range h.Config.Options() {
		if p, ok := o.Field.(*time.Duration); ok {
			if raw, ok := fields[o.Name]; ok {
				durations = append(durations, duration{o.Name, p, raw})
				delete(fields, o.Name)
			}
		}
	}
	rest, err := json.Marshal(fields)
	if err != nil {
		return err
	}
	// plain has Handler's fields without this method, so decoding it does not recurse.
	type plain Handler
	dec := json.NewDecoder(bytes.NewReader(rest))
	dec.DisallowUnknownFields()
	if err := dec.Decode((*plain)(h)); err != nil {
		return err
	}
	for _, d := range durations {
		if err := (*caddy.Duration)(d.field).UnmarshalJSON(d.raw); err != nil {
			return fmt.Errorf("kvsim: %s: %w", d.name, err)
		}
	}
	return nil
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
	// kvsim.NewServer checks the speed; the faults are applied apart.
	if h.Faults != nil {
		if err := h.Faults.Validate(); err != nil {
			return fmt.Errorf("kvsim %s: fault_%w", h.Name, err)
		}
	}
	h.Config = h.Config.WithDefaults()
	if err := h.Config.Validate(); err != nil {
		return fmt.Errorf("kvsim %s: %w", h.Name, err)
	}
	// Faults are excluded from the key: they change at run time and must not restart the
	// engine; they are (re)applied below. The key is taken after defaults, so spelling a
	// default out does not restart the engine either.
	fingerprint, err := json.Marshal(struct {
		Config kvsim.Config
		Speed  float64
	}{h.Config, h.Speed})
	if err != nil {
		return err
	}
	sum := sha256.Sum256(fingerprint)
	h.poolKey = h.Name + "/" + hex.EncodeToString(sum[:8])
	logger := ctx.Logger().With(zap.String("replica", h.Name))
	value, loaded, err := engines.LoadOrNew(h.poolKey, func() (caddy.Destructor, error) {
		srv, err := kvsim.NewServer(kvsim.ServerConfig{Name: h.Name, Engine: h.Config, Speed: h.Speed, Logger: logger})
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
	_ json.Unmarshaler            = (*Handler)(nil)
	_ caddy.Provisioner           = (*Handler)(nil)
	_ caddy.CleanerUpper          = (*Handler)(nil)
	_ caddyhttp.MiddlewareHandler = (*Handler)(nil)
	_ caddy.Destructor            = pooledServer{}
)
