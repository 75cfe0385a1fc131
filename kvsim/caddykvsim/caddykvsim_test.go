package caddykvsim

import (
	"context"
	"encoding/json"
	"maps"
	"net/http"
	"net/http/httptest"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"

	"github.com/llmaffinity/caddy-llm-affinity/kvsim"
)

func TestUnmarshalCaddyfile(t *testing.T) {
	d := caddyfile.NewTestDispenser(`kvsim replica-0 {
		model my-model
		speed 100
		num_gpu_blocks 1024
		block_size 32
		per_prefill_token 50us
		lora_storage_load 1s
		adapters a b
		adapters c
		disable_prefix_caching
		fault_error_rate 0.5
	}`)
	var h Handler
	if err := h.UnmarshalCaddyfile(d); err != nil {
		t.Fatal(err)
	}
	if h.Name != "replica-0" || h.Model != "my-model" || h.Speed != 100 || h.NumGPUBlocks != 1024 || h.BlockSize != 32 ||
		time.Duration(h.PerPrefillToken) != 50*time.Microsecond || time.Duration(h.LoRAStorageLoad) != time.Second ||
		strings.Join(h.Adapters, ",") != "a,b,c" || !h.DisablePrefixCaching || h.Faults == nil || h.Faults.ErrorRate != 0.5 {
		t.Fatalf("parsed %+v", h)
	}
	for _, bad := range []string{`kvsim a b`, `kvsim { bogus }`, `kvsim { block_size x }`, `kvsim { speed }`, `kvsim { step_overhead forever }`} {
		var h Handler
		if err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser(bad)); err == nil {
			t.Errorf("%q: no error", bad)
		}
	}
}

// TestEmptyBlockTakesConfigDefaults checks that the handler has no defaults of its own for the
// engine: an empty Caddyfile block, or an empty JSON object, provisions exactly
// kvsim.Config{}.WithDefaults(), in the handler and in the engine it starts.
func TestEmptyBlockTakesConfigDefaults(t *testing.T) {
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	var fromCaddyfile, fromJSON Handler
	if err := fromCaddyfile.UnmarshalCaddyfile(caddyfile.NewTestDispenser("kvsim {\n}")); err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal([]byte(`{}`), &fromJSON); err != nil {
		t.Fatal(err)
	}
	want := kvsim.Config{}.WithDefaults()
	for name, h := range map[string]*Handler{"Caddyfile": &fromCaddyfile, "JSON": &fromJSON} {
		if !reflect.DeepEqual(*h, Handler{}) {
			t.Errorf("%s: parsing an empty block set %+v", name, *h)
		}
		if err := h.Provision(ctx); err != nil {
			t.Fatal(err)
		}
		defer h.Cleanup()
		var engine kvsim.Config
		h.Server().Driver().Do(func(e *kvsim.Engine) { engine = e.Config() })
		if !reflect.DeepEqual(h.Config, want) || !reflect.DeepEqual(engine, want) {
			t.Errorf("%s: provisioned handler config\n%+v and engine config\n%+v, want\n%+v", name, h.Config, engine, want)
		}
		if h.Name != "kvsim" || h.Speed != 0 || h.Faults != nil {
			t.Errorf("%s: name %q, speed %v, faults %+v", name, h.Name, h.Speed, h.Faults)
		}
	}
}

// TestJSONNames pins the handler's JSON field names, which existing configs use: they are
// now kvsim.Config's, inline.
func TestJSONNames(t *testing.T) {
	h := Handler{Name: "n", Speed: 1, Faults: &kvsim.Faults{}}
	for _, o := range h.Config.Options() {
		switch p := o.Field.(type) {
		case *string:
			*p = "x"
		case *int:
			*p = 1
		case *bool:
			*p = true
		case *time.Duration:
			*p = time.Second
		case *[]string:
			*p = []string{"x"}
		}
	}
	b, err := json.Marshal(&h)
	if err != nil {
		t.Fatal(err)
	}
	var fields map[string]json.RawMessage
	if err := json.Unmarshal(b, &fields); err != nil {
		t.Fatal(err)
	}
	got := slices.Sorted(maps.Keys(fields))
	want := []string{"adapters", "block_size", "bytes_per_token", "default_output_tokens", "disable_prefix_caching",
		"faults", "lora_host_load", "lora_storage_load", "max_cpu_loras", "max_loras", "max_model_len",
		"max_num_batched_tokens", "max_num_seqs", "model", "name", "num_gpu_blocks", "per_context_token",
		"per_decode_sequence", "per_prefill_token", "served_model_name", "speed", "step_overhead"}
	if !slices.Equal(got, want) {
		t.Errorf("JSON fields %q, want %q", got, want)
	}
}

// TestUnmarshalJSON checks that durations are accepted as nanoseconds or as duration strings,
// as caddy.Duration fields accept them, and that the handler stays strict.
func TestUnmarshalJSON(t *testing.T) {
	var h Handler
	err := json.Unmarshal([]byte(`{"name":"r","step_overhead":"1.5ms","lora_storage_load":"1d","per_context_token":250,
		"num_gpu_blocks":64,"faults":{"stall":true}}`), &h)
	if err != nil {
		t.Fatal(err)
	}
	if h.Name != "r" || h.StepOverhead != 1500*time.Microsecond || h.LoRAStorageLoad != 24*time.Hour ||
		h.PerContextToken != 250 || h.NumGPUBlocks != 64 || h.Faults == nil || !h.Faults.Stall {
		t.Fatalf("decoded %+v", h)
	}
	for _, bad := range []string{`{"bogus":1}`, `{"faults":{"bogus":1}}`, `{"step_overhead":"soon"}`, `{"step_overhead":true}`,
		`{"block_size":"16"}`, `[]`} {
		if err := json.Unmarshal([]byte(bad), new(Handler)); err == nil {
			t.Errorf("%s: no error", bad)
		}
	}
}

func TestCaddyfileAdapts(t *testing.T) {
	input := `
http://127.0.0.1:9001 {
	kvsim {
		name replica-0
		model meta-llama/Llama-3.1-8B-Instruct
	}
}
http://127.0.0.1:9002 {
	kvsim replica-1
}`
	adapter := caddyfile.Adapter{ServerType: httpcaddyfile.ServerType{}}
	out, warnings, err := adapter.Adapt([]byte(input), nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(warnings) > 0 {
		t.Logf("warnings: %v", warnings)
	}
	if !strings.Contains(string(out), `"handler":"kvsim"`) || !strings.Contains(string(out), `"name":"replica-0"`) || !strings.Contains(string(out), `"name":"replica-1"`) {
		t.Fatalf("adapted JSON: %s", out)
	}
}

func TestEngineSurvivesReload(t *testing.T) {
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	provision := func(raw string) *Handler {
		var h Handler
		if err := json.Unmarshal([]byte(raw), &h); err != nil {
			t.Fatal(err)
		}
		if err := h.Provision(ctx); err != nil {
			t.Fatal(err)
		}
		return &h
	}
	old := provision(`{"name":"replica-r","speed":100,"num_gpu_blocks":512}`)
	rec := httptest.NewRecorder()
	req := httptest.NewRequest(http.MethodPost, "/v1/completions", strings.NewReader(`{"prompt":"hello","max_tokens":2}`))
	req.Header.Set("Content-Type", "application/json")
	if err := old.ServeHTTP(rec, req, nil); err != nil || rec.Code != 200 || rec.Header().Get(kvsim.ReplicaHeader) != "replica-r" {
		t.Fatalf("serve: %v %d %s", err, rec.Code, rec.Body)
	}
	// A reload provisions the new config before cleaning up the old one.
	same := provision(`{"name":"replica-r","speed":100,"num_gpu_blocks":512}`)
	changed := provision(`{"name":"replica-r","speed":100,"num_gpu_blocks":256}`)
	if err := old.Cleanup(); err != nil {
		t.Fatal(err)
	}
	if same.Server() != old.Server() || changed.Server() == old.Server() {
		t.Fatal("an unchanged config must keep its engine; a changed one must not")
	}
	if st := same.Server().State(); st.Finished != 1 {
		t.Fatalf("engine state lost across reload: %+v", st)
	}
	for _, h := range []*Handler{same, changed} {
		if err := h.Cleanup(); err != nil {
			t.Fatal(err)
		}
	}
	if _, ok := engines.References(old.poolKey); ok {
		t.Fatal("engine still pooled after the last cleanup")
	}
}
