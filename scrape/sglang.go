package scrape

import (
	dto "github.com/prometheus/client_model/go"
)

// engineSGLang is Signals.Engine for SGLang.
const engineSGLang = "sglang"

// SGLang metric names (python/sglang/srt/metrics/collector.py, now
// python/sglang/srt/observability/metrics_collector.py). Series carry
// {model_name, engine_type, tp_rank, pp_rank, moe_ep_rank} and, with data
// parallel attention, dp_rank. Only attention-TP rank 0 reports unless
// --enable-metrics-for-all-schedulers, in which case the other TP ranks
// repeat the same figures; with --enable-priority-scheduling the request
// counts also carry priority, the total under "" and a breakdown under each
// priority. Taking the maximum within a rank, never the sum, keeps figures
// from being counted more than once and reads the totals.
const (
	sglangRunning     = "sglang:num_running_reqs"
	sglangWaiting     = "sglang:num_queue_reqs"
	sglangKVUsage     = "sglang:token_usage"
	sglangMaxTokens   = "sglang:max_total_num_tokens"
	sglangCacheConfig = "sglang:cache_config_info" // {page_size, num_pages}; current SGLang has gauges sglang:page_size and sglang:num_pages instead, and max_total_num_tokens serves
	sglangHitRate     = "sglang:cache_hit_rate"
	sglangLoRASlots   = "sglang:lora_pool_slots_total"
	sglangRankLabel   = "dp_rank"
)

// sglangEngine maps SGLang's metrics. The KV capacity is each rank's
// token pool, max_total_num_tokens, which carries the rank; the pages of
// cache_config_info are read only without it: that family has no rank
// label, so with data parallelism its one series is one rank's pool (every
// scheduler writes the same labels, SchedulerMetricsCollector.
// emit_cache_config_info). It is cheap, so read on every scrape.
var sglangEngine = engine{
	name:      engineSGLang,
	prefix:    "sglang:",
	rankLabel: sglangRankLabel,
	metrics: []metric{
		{family: sglangRunning, into: running, by: bySum, identifies: true},
		{family: sglangWaiting, into: waiting, by: bySum, identifies: true},
		{family: sglangMaxTokens, into: kvCapacity, by: byRankTokens, identifies: true},
		{family: sglangCacheConfig, into: kvCapacity, labels: sglangPages},
		{family: sglangKVUsage, into: kvUsage, by: byCapacity, identifies: true},
		{family: sglangHitRate, into: prefixHitRate, by: byMean, slow: true},
		{family: sglangLoRASlots, into: maxLoRAs, by: byMax},
	},
}

// sglangPages reads the KV capacity from cache_config_info's labels.
func sglangPages(x *extraction, series []*dto.Metric) bool {
	found := false
	for _, m := range series {
		ps, pages := labelInt(m, "page_size"), labelInt(m, "num_pages")
		if ps <= 0 || pages <= 0 {
			continue
		}
		x.addCapacity(labelValue(m, sglangRankLabel), ps, ps*pages)
		found = true
	}
	return found
}
