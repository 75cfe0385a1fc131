package scrape

import (
	dto "github.com/prometheus/client_model/go"
)

// SGLang metric names (python/sglang/srt/metrics/collector.py). Series
// carry {model_name, engine_type, tp_rank, pp_rank, moe_ep_rank} and, with
// data parallel attention, dp_rank. Only attention-TP rank 0 reports
// unless --enable-metrics-for-all-schedulers, in which case the other TP
// ranks repeat the same figures; taking the maximum within a rank, never
// the sum, keeps them from being counted more than once.
const (
	sglangRunning     = "sglang:num_running_reqs"
	sglangWaiting     = "sglang:num_queue_reqs"
	sglangKVUsage     = "sglang:token_usage"
	sglangMaxTokens   = "sglang:max_total_num_tokens"
	sglangCacheConfig = "sglang:cache_config_info" // {page_size, num_pages}, as llm-d reads it
	sglangHitRate     = "sglang:cache_hit_rate"
	sglangLoRASlots   = "sglang:lora_pool_slots_total"
	sglangRankLabel   = "dp_rank"
)

// sglangSignals fills sig from SGLang's families.
func sglangSignals(families map[string]*dto.MetricFamily, sig *Signals) {
	if g := rankGroups(families[sglangRunning], sglangRankLabel); g != nil {
		sig.Running = int(g.sum())
	}
	if g := rankGroups(families[sglangWaiting], sglangRankLabel); g != nil {
		sig.Waiting = int(g.sum())
	}

	// Capacity: pages when cache_config_info reports them, else the token
	// pool size (SGLang's default page size is 1).
	capacity := make(map[string]float64)
	for _, m := range metricsOf(families[sglangCacheConfig]) {
		ps, pages := labelInt(m, "page_size"), labelInt(m, "num_pages")
		if ps <= 0 || pages <= 0 {
			continue
		}
		sig.BlockSize = max(sig.BlockSize, ps)
		rank := labelValue(m, sglangRankLabel)
		capacity[rank] = max(capacity[rank], float64(ps*pages))
	}
	if len(capacity) == 0 {
		if g := rankGroups(families[sglangMaxTokens], sglangRankLabel); g != nil {
			sig.BlockSize = 1
			capacity = g.byRank()
		}
	}
	setCapacity(sig, capacity)

	if g := rankGroups(families[sglangKVUsage], sglangRankLabel); g != nil {
		sig.KVUsage, sig.KVKnown = clamp01(g.weightedMean(capacity)), true
	}
	if g := rankGroups(families[sglangHitRate], sglangRankLabel); g != nil {
		sig.PrefixHitRate = clamp01(g.weightedMean(nil))
	}
	if g := rankGroups(families[sglangLoRASlots], sglangRankLabel); g != nil {
		sig.MaxLoRAs = int(g.max())
	}
}
