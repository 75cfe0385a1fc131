package scrape

import (
	"math"
	"slices"
	"strings"

	dto "github.com/prometheus/client_model/go"
)

// engineVLLM is Signals.Engine for vLLM.
const engineVLLM = "vllm"

// vLLM metric names (vllm/v1/metrics/loggers.py). Every per-engine series
// carries {model_name, engine}, engine being the data parallel rank.
const (
	vllmRunning       = "vllm:num_requests_running"
	vllmWaiting       = "vllm:num_requests_waiting"
	vllmKVUsage       = "vllm:kv_cache_usage_perc"
	vllmKVUsageLegacy = "vllm:gpu_cache_usage_perc" // before 0.9.2; removed in 0.12
	vllmPrefixQueries = "vllm:prefix_cache_queries_total"
	vllmPrefixHits    = "vllm:prefix_cache_hits_total"
	// The counters' names in vLLM 0.8 (renamed in 0.9, the old names
	// kept while deprecated); the V0 engine exported only a hit rate
	// gauge, not read: the rate is derived from the counters.
	vllmPrefixQueriesLegacy = "vllm:gpu_prefix_cache_queries_total"
	vllmPrefixHitsLegacy    = "vllm:gpu_prefix_cache_hits_total"
	vllmCacheConfig         = "vllm:cache_config_info"
	vllmLoRAInfo            = "vllm:lora_requests_info"
	vllmRankLabel           = "engine"
)

// vllmEngine maps vLLM's metrics. Its prefix cache hit rate is not a
// metric: the scraper derives it from the counters (hitRateSince).
var vllmEngine = engine{
	name:      engineVLLM,
	prefix:    "vllm:",
	rankLabel: vllmRankLabel,
	metrics: []metric{
		{family: vllmRunning, into: running, by: bySum, identifies: true},
		{family: vllmWaiting, into: waiting, by: bySum, identifies: true},
		{family: vllmCacheConfig, into: kvCapacity, labels: vllmBlocks, identifies: true, slow: true},
		{family: vllmKVUsage, into: kvUsage, by: byCapacity, identifies: true},
		{family: vllmKVUsageLegacy, into: kvUsage, by: byCapacity, identifies: true},
		// The old names first: where both are exported the current
		// ones, read later, stand.
		{family: vllmPrefixQueriesLegacy, into: prefixQueries, by: bySum, slow: true},
		{family: vllmPrefixHitsLegacy, into: prefixHits, by: bySum, slow: true},
		{family: vllmPrefixQueries, into: prefixQueries, by: bySum, slow: true},
		{family: vllmPrefixHits, into: prefixHits, by: bySum, slow: true},
		{family: vllmLoRAInfo, into: adapters, labels: vllmAdapters},
	},
}

// vllmBlocks reads the KV capacity from cache_config_info: one series
// per engine (data parallel rank), the figures in its labels, which are
// the API server's CacheConfig (vllm/config/cache.py, metrics_info;
// vllm/v1/metrics/loggers.py, PrometheusStatLogger.log_metrics_info).
//
// kv_cache_size_tokens, from vLLM 0.24 on (PR #42206), is one engine's
// capacity in tokens, group-aware: for a hybrid model (sliding window,
// Mamba, DeepSeek-V4's compressed groups) num_gpu_blocks × block_size is
// not the capacity, and block_size is the smallest group's. It is read
// first. Without it the capacity is num_gpu_blocks × block_size, where
// num_gpu_blocks is the sum over the engines the API server started
// (vllm/v1/engine/utils.py, wait_for_engine_startup: "Sum values from all
// engines in DP case") and every engine's series repeats it: each of the n
// series gets an n-th. num_gpu_blocks is "None" before the engine
// profiled; kv_cache_size_tokens "None" before 0.24 has it.
func vllmBlocks(x *extraction, series []*dto.Metric) bool {
	var ranks []string
	for _, m := range series {
		if labelInt(m, "block_size") > 0 && labelInt(m, "num_gpu_blocks") > 0 {
			if r := labelValue(m, vllmRankLabel); !slices.Contains(ranks, r) {
				ranks = append(ranks, r)
			}
		}
	}
	found := false
	for _, m := range series {
		bs := labelInt(m, "block_size")
		tokens := labelInt(m, "kv_cache_size_tokens")
		if tokens <= 0 && len(ranks) > 0 {
			tokens = labelInt(m, "num_gpu_blocks") * bs / len(ranks)
		}
		if bs <= 0 || tokens <= 0 {
			continue
		}
		x.addCapacity(labelValue(m, vllmRankLabel), bs, tokens)
		found = true
	}
	return found
}

// vllmAdapters reads the adapters from lora_requests_info, only emitted
// with --enable-lora. The series' value is the time it was set; the
// newest wins.
func vllmAdapters(x *extraction, series []*dto.Metric) bool {
	var newest *dto.Metric
	newestAt := math.Inf(-1)
	for _, m := range series {
		if v, ok := sampleValue(m); ok && v > newestAt {
			newest, newestAt = m, v
		}
	}
	if newest == nil {
		return false
	}
	s := x.sig
	s.AdaptersKnown = true
	s.MaxLoRAs = labelInt(newest, "max_lora")
	s.RunningAdapters = splitAdapters(labelValue(newest, "running_lora_adapters"))
	s.WaitingAdapters = splitAdapters(labelValue(newest, "waiting_lora_adapters"))
	return true
}

// splitAdapters splits vLLM's comma-joined adapter list, dropping empty
// names.
func splitAdapters(s string) []string {
	if s == "" {
		return []string{}
	}
	parts := strings.Split(s, ",")
	out := parts[:0]
	for _, p := range parts {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}
