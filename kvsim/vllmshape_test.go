package kvsim

import (
	"encoding/json"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"
)

// TestCacheConfigInfoAsVLLM: vllm:cache_config_info carries the labels of
// vLLM's CacheConfig as its API server renders them (vllm/config/cache.py,
// metrics_info): kv_cache_size_tokens and kv_cache_max_concurrency computed
// as vLLM computes them (vllm/v1/core/kv_cache_utils.py,
// get_max_concurrency_for_kv_cache_config: whole blocks for each request of
// max_model_len, the token count truncated), Python's "None" for the CPU
// blocks the API server never learns, and vLLM's default hash algorithm;
// vllm:num_preemptions_total is exported, at 0, as vLLM's always is, and
// request_success_total has a series for each of vLLM's finish reasons.
func TestCacheConfigInfoAsVLLM(t *testing.T) {
	// 100 blocks of 16 tokens; a 1,000-token request takes 63 of them.
	_, srv := newTestServer(t, Config{NumGPUBlocks: 100, BlockSize: 16, MaxModelLen: 1000})
	families := metricFamilies(t, srv.URL+"/metrics")
	info := families["vllm:cache_config_info"]
	if info == nil || len(info.GetMetric()) != 1 {
		t.Fatalf("cache_config_info: %v", info)
	}
	labels := map[string]string{}
	for _, lp := range info.GetMetric()[0].GetLabel() {
		labels[lp.GetName()] = lp.GetValue()
	}
	for name, want := range map[string]string{
		"block_size": "16", "num_gpu_blocks": "100", "num_cpu_blocks": "None",
		"kv_cache_size_tokens": "1587", "kv_cache_max_concurrency": "1.5873015873015872",
		"enable_prefix_caching": "True", "prefix_caching_hash_algo": "sha256", "cache_dtype": "auto",
		"engine": "0",
	} {
		if labels[name] != want {
			t.Errorf("cache_config_info{%s=%q}, want %q", name, labels[name], want)
		}
	}
	p := families["vllm:num_preemptions_total"]
	if p == nil || p.GetType().String() != "COUNTER" || len(p.GetMetric()) != 1 || p.GetMetric()[0].GetCounter().GetValue() != 0 {
		t.Errorf("vllm:num_preemptions_total: %v", p)
	}
	var reasons []string
	for _, m := range families["vllm:request_success_total"].GetMetric() {
		for _, lp := range m.GetLabel() {
			if lp.GetName() == "finished_reason" {
				reasons = append(reasons, lp.GetValue())
			}
		}
	}
	if slices.Sort(reasons); !slices.Equal(reasons, []string{"abort", "error", "length", "repetition", "stop"}) {
		t.Errorf("request_success_total's finished_reason values %v, want vLLM's FinishReason strings", reasons)
	}
	for f, want := range map[float64]string{1: "1.0", 0.5: "0.5", 1234567: "1234567.0", 1e16: "1e+16", 1.5e-5: "1.5e-05", 0: "0.0"} {
		if got := pyFloat(f); got != want {
			t.Errorf("pyFloat(%v) = %q, want Python's %q", f, got, want)
		}
	}
}

// TestModelsAndVersionAsVLLM: each card of /v1/models carries one
// ModelPermission with vLLM's defaults (OpenAIServingModels.
// show_available_models builds each with permission=[ModelPermission()]),
// cards and permissions take the time of the request as created, and
// GET /version answers {"version": ...}, as vLLM's show_version.
func TestModelsAndVersionAsVLLM(t *testing.T) {
	_, srv := newTestServer(t, Config{Adapters: []string{"sql-lora"}})
	before := time.Now().Unix()
	object, cards := getModels(t, srv.URL)
	after := time.Now().Unix()
	if object != "list" || len(cards) != 2 {
		t.Fatalf("models: %s %+v", object, cards)
	}
	for _, card := range cards {
		if card.Object != "model" || card.OwnedBy != "vllm" || card.Created < before || card.Created > after {
			t.Errorf("card %s: object %q owned_by %q created %d, want a model card of the request's time (%d..%d)",
				card.ID, card.Object, card.OwnedBy, card.Created, before, after)
		}
		if len(card.Permission) != 1 {
			t.Fatalf("card %s: %d permissions, want vLLM's one", card.ID, len(card.Permission))
		}
		perm := card.Permission[0]
		id, _ := perm["id"].(string)
		if !strings.HasPrefix(id, "modelperm-") || len(id) != len("modelperm-")+32 {
			t.Errorf("permission id %q, want modelperm- and 32 hex digits", id)
		}
		for field, want := range map[string]any{
			"object": "model_permission", "allow_create_engine": false, "allow_sampling": true,
			"allow_logprobs": true, "allow_search_indices": false, "allow_view": true,
			"allow_fine_tuning": false, "organization": "*", "group": nil, "is_blocking": false,
		} {
			if got, ok := perm[field]; !ok || got != want {
				t.Errorf("card %s: permission %s = %v, want %v", card.ID, field, got, want)
			}
		}
		if c, _ := perm["created"].(float64); int64(c) < before || int64(c) > after {
			t.Errorf("card %s: permission created %v", card.ID, perm["created"])
		}
	}

	resp, err := http.Get(srv.URL + "/version")
	if err != nil {
		t.Fatal(err)
	}
	var version map[string]string
	err = json.NewDecoder(resp.Body).Decode(&version)
	resp.Body.Close()
	if resp.StatusCode != 200 || err != nil || len(version) != 1 || version["version"] != Version ||
		resp.Header.Get("Content-Type") != "application/json" {
		t.Fatalf("/version: %d %v %v", resp.StatusCode, version, err)
	}
}

// modelCard is a card of /v1/models as the tests read it.
type modelCard struct {
	ID, Object, Root string
	Parent           *string
	Created          int64
	OwnedBy          string `json:"owned_by"`
	MaxModelLen      *int   `json:"max_model_len"`
	Permission       []map[string]any
}

// getModels GETs /v1/models from the server at url: the list's object
// and its cards.
func getModels(t *testing.T, url string) (object string, cards []modelCard) {
	t.Helper()
	resp, err := http.Get(url + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var list struct {
		Object string
		Data   []modelCard
	}
	if err := json.NewDecoder(resp.Body).Decode(&list); err != nil {
		t.Fatal(err)
	}
	return list.Object, list.Data
}
