package caddykvsim

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
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
