package scrape

import (
	"math"
	"strings"

	dto "github.com/prometheus/client_model/go"
)

// vLLM metric names (vllm/v1/metrics/loggers.py). Every per-engine series
// carries {model_name, engine}, engine being the data parallel rank.
const (
	vllmRunning       = "vllm:num_requests_running"
	vllmWaiting       = "vllm:num_requests_waiting"
	vllmKVUsage       = "vllm:kv_cache_usage_perc"
	vllmKVUsageLegacy = "vllm:gpu_cache_usage_perc" // before 0.9.2; removed in 0.12
	vllmPrefixQueries = "vllm:prefix_cache_queries_total"
	vllmPrefixHits    = "vllm:prefix_cache_hits_total"
	vllmCacheConfig   = "vllm:cache_config_info"
	vllmLoRAInfo      = "vllm:lora_requests_info"
	vllmRankLabel     = "engine"
)

// vllmSignals fills sig from vLLM's families.
func vllmSignals(families map[string]*dto.MetricFamily, sig *Signals) {
	if g := rankGroups(families[vllmRunning], vllmRankLabel); g != nil {
		sig.Running = int(g.sum())
	}
	if g := rankGroups(families[vllmWaiting], vllmRankLabel); g != nil {
		sig.Waiting = int(g.sum())
	}
	if g := rankGroups(families[vllmPrefixQueries], vllmRankLabel); g != nil {
		sig.PrefixQueries = g.sum()
	}
	if g := rankGroups(families[vllmPrefixHits], vllmRankLabel); g != nil {
		sig.PrefixHits = g.sum()
	}

	// Capacity: one cache_config_info series per engine, the figures in
	// its labels. num_gpu_blocks is "None" before the engine profiled.
	var capacity map[string]float64 // tokens by rank; none when cache_config_info was skipped
	for _, m := range metricsOf(families[vllmCacheConfig]) {
		bs := labelInt(m, "block_size")
		tokens := labelInt(m, "num_gpu_blocks") * bs
		if tokens <= 0 {
			tokens = labelInt(m, "kv_cache_size_tokens")
		}
		if bs <= 0 || tokens <= 0 {
			continue
		}
		sig.BlockSize = max(sig.BlockSize, bs)
		rank := labelValue(m, vllmRankLabel)
		if capacity == nil {
			capacity = map[string]float64{}
		}
		capacity[rank] = max(capacity[rank], float64(tokens))
	}
	setCapacity(sig, capacity)

	usage := rankGroups(families[vllmKVUsage], vllmRankLabel)
	if usage == nil {
		usage = rankGroups(families[vllmKVUsageLegacy], vllmRankLabel)
	}
	if usage != nil {
		sig.KVUsage, sig.KVKnown = clamp01(usage.weightedMean(capacity)), true
		sig.kvByRank, sig.rankCapacity = usage, capacity
	}

	// LoRA: the series' value is the time it was set; the newest wins.
	// Only emitted with --enable-lora.
	var newest *dto.Metric
	newestAt := math.Inf(-1)
	for _, m := range metricsOf(families[vllmLoRAInfo]) {
		if v, ok := sampleValue(m); ok && v > newestAt {
			newest, newestAt = m, v
		}
	}
	if newest != nil {
		sig.AdaptersKnown = true
		sig.MaxLoRAs = labelInt(newest, "max_lora")
		sig.RunningAdapters = splitAdapters(labelValue(newest, "running_lora_adapters"))
		sig.WaitingAdapters = splitAdapters(labelValue(newest, "waiting_lora_adapters"))
	}
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
