package kvsim

import (
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
)

// metrics exposes an engine under vLLM's metric names in a per-server registry. Gauges and
// counters are read from the engine at scrape time; latency histograms are observed from
// engine events, in simulated seconds.
type metrics struct {
	registry  *prometheus.Registry
	driver    *Driver
	modelName string

	ttft, e2e, queue, itl *prometheus.HistogramVec

	running, waiting, kvUsage  *prometheus.Desc
	queries, hits, prompt, gen *prometheus.Desc
	success, preemptions       *prometheus.Desc
	cacheConfig, loraInfo      *prometheus.Desc
}

var engineLabels = []string{"model_name", "engine"}

func newMetrics(driver *Driver, modelName string) *metrics {
	m := &metrics{
		registry:  prometheus.NewRegistry(),
		driver:    driver,
		modelName: modelName,
		ttft: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "vllm:time_to_first_token_seconds",
			Help:    "Histogram of time to first token in seconds.",
			Buckets: []float64{0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0},
		}, engineLabels),
		e2e: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "vllm:e2e_request_latency_seconds",
			Help:    "Histogram of e2e request latency in seconds.",
			Buckets: []float64{0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0},
		}, engineLabels),
		// vLLM uses e2e's buckets for its request phase times.
		queue: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "vllm:request_queue_time_seconds",
			Help:    "Histogram of time spent in WAITING phase for request.",
			Buckets: []float64{0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0},
		}, engineLabels),
		// vLLM's time_per_output_token_seconds under its current name.
		itl: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "vllm:inter_token_latency_seconds",
			Help:    "Histogram of inter-token latency in seconds.",
			Buckets: []float64{0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0},
		}, engineLabels),
		running: prometheus.NewDesc("vllm:num_requests_running", "Number of requests in model execution batches.", engineLabels, nil),
		waiting: prometheus.NewDesc("vllm:num_requests_waiting", "Number of requests waiting to be processed.", engineLabels, nil),
		kvUsage: prometheus.NewDesc("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", engineLabels, nil),
		queries: prometheus.NewDesc("vllm:prefix_cache_queries_total", "Prefix cache queries, in terms of number of queried tokens.", engineLabels, nil),
		hits:    prometheus.NewDesc("vllm:prefix_cache_hits_total", "Prefix cache hits, in terms of number of cached tokens.", engineLabels, nil),
		prompt:  prometheus.NewDesc("vllm:prompt_tokens_total", "Number of prefill tokens processed.", engineLabels, nil),
		gen:     prometheus.NewDesc("vllm:generation_tokens_total", "Number of generation tokens processed.", engineLabels, nil),
		success: prometheus.NewDesc("vllm:request_success_total", "Count of successfully processed requests.", append(engineLabels[:2:2], "finished_reason"), nil),
		// kvsim never preempts: always 0, as vLLM's when nothing was.
		preemptions: prometheus.NewDesc("vllm:num_preemptions_total", "Cumulative number of preemption from the engine.", engineLabels, nil),
		// vLLM's labels are every field of its CacheConfig (metrics_info);
		// these are the ones that describe what kvsim models.
		cacheConfig: prometheus.NewDesc("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
			[]string{"block_size", "num_gpu_blocks", "num_cpu_blocks", "cache_dtype", "enable_prefix_caching", "prefix_caching_hash_algo", "gpu_memory_utilization", "kv_cache_size_tokens", "kv_cache_max_concurrency", "engine"}, nil),
		loraInfo: prometheus.NewDesc("vllm:lora_requests_info", "Running stats on lora requests.",
			[]string{"max_lora", "running_lora_adapters", "waiting_lora_adapters"}, nil),
	}
	m.registry.MustRegister(m, m.ttft, m.e2e, m.queue, m.itl,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

// observe records latency histograms from engine events (called under the driver lock).
func (m *metrics) observe(ev Event) {
	switch ev.Kind {
	case EventFirstToken:
		m.ttft.WithLabelValues(m.modelName, "0").Observe((ev.Time - ev.Request.Arrival).Seconds())
	case EventToken:
		m.itl.WithLabelValues(m.modelName, "0").Observe(ev.SincePrevious.Seconds())
	case EventFinished:
		m.e2e.WithLabelValues(m.modelName, "0").Observe((ev.Time - ev.Request.Arrival).Seconds())
		m.queue.WithLabelValues(m.modelName, "0").Observe((ev.Request.Scheduled - ev.Request.Arrival).Seconds())
	}
}

// Describe implements prometheus.Collector.
func (m *metrics) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{m.running, m.waiting, m.kvUsage, m.queries, m.hits, m.prompt, m.gen, m.success, m.preemptions, m.cacheConfig, m.loraInfo} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (m *metrics) Collect(ch chan<- prometheus.Metric) {
	var st Stats
	var cfg Config
	m.driver.Do(func(e *Engine) { st, cfg = e.Stats(), e.Config() })
	lv := []string{m.modelName, "0"}
	ch <- prometheus.MustNewConstMetric(m.running, prometheus.GaugeValue, float64(st.Running), lv...)
	ch <- prometheus.MustNewConstMetric(m.waiting, prometheus.GaugeValue, float64(st.Waiting), lv...)
	ch <- prometheus.MustNewConstMetric(m.kvUsage, prometheus.GaugeValue, st.KVCacheUsage, lv...)
	ch <- prometheus.MustNewConstMetric(m.queries, prometheus.CounterValue, float64(st.PrefixQueries), lv...)
	ch <- prometheus.MustNewConstMetric(m.hits, prometheus.CounterValue, float64(st.PrefixHits), lv...)
	ch <- prometheus.MustNewConstMetric(m.prompt, prometheus.CounterValue, float64(st.PromptTokens), lv...)
	ch <- prometheus.MustNewConstMetric(m.gen, prometheus.CounterValue, float64(st.GenerationTokens), lv...)
	ch <- prometheus.MustNewConstMetric(m.success, prometheus.CounterValue, float64(st.Finished-st.FinishedLength), m.modelName, "0", "stop")
	ch <- prometheus.MustNewConstMetric(m.success, prometheus.CounterValue, float64(st.FinishedLength), m.modelName, "0", "length")
	ch <- prometheus.MustNewConstMetric(m.success, prometheus.CounterValue, float64(st.Aborted), m.modelName, "0", "abort")
	// vLLM writes a series for each FinishReason (vllm/v1/engine/__init__.py);
	// kvsim finishes none for an internal error or a repetition detected.
	for _, reason := range []string{"error", "repetition"} {
		ch <- prometheus.MustNewConstMetric(m.success, prometheus.CounterValue, 0, m.modelName, "0", reason)
	}
	ch <- prometheus.MustNewConstMetric(m.preemptions, prometheus.CounterValue, 0, lv...)
	concurrency, tokens := kvCapacity(cfg)
	// The API server's CacheConfig as vLLM renders it: num_cpu_blocks is
	// set in the engine core only ("None" here), and the hash algorithm
	// and memory share are vLLM's defaults.
	ch <- prometheus.MustNewConstMetric(m.cacheConfig, prometheus.GaugeValue, 1,
		strconv.Itoa(cfg.BlockSize), strconv.Itoa(cfg.NumGPUBlocks), "None", "auto",
		pyBool(!cfg.DisablePrefixCaching), "sha256", "0.92",
		strconv.Itoa(tokens), pyFloat(concurrency), "0")
	ch <- prometheus.MustNewConstMetric(m.loraInfo, prometheus.GaugeValue, float64(time.Now().UnixNano())/1e9,
		strconv.Itoa(cfg.MaxLoRAs), strings.Join(st.RunningAdapters, ","), strings.Join(st.WaitingAdapters, ","))
}

// pyBool renders a boolean label as vLLM (Python) does.
func pyBool(b bool) string {
	if b {
		return "True"
	}
	return "False"
}

// kvCapacity returns vLLM's kv_cache_max_concurrency and
// kv_cache_size_tokens for cfg (vllm/v1/core/kv_cache_utils.py,
// get_max_concurrency_for_kv_cache_config): the requests of max_model_len
// tokens the blocks hold, each taking whole blocks, and that many times
// max_model_len, truncated.
func kvCapacity(cfg Config) (concurrency float64, tokens int) {
	perRequest := (cfg.MaxModelLen + cfg.BlockSize - 1) / cfg.BlockSize
	concurrency = float64(cfg.NumGPUBlocks) / float64(perRequest)
	return concurrency, int(concurrency * float64(cfg.MaxModelLen))
}

// pyFloat renders a float label as Python's str does: the shortest
// representation, with ".0" on a whole number, in exponent form below
// 1e-4 or from 1e16.
func pyFloat(f float64) string {
	if a := math.Abs(f); a != 0 && (a < 1e-4 || a >= 1e16) {
		return strconv.FormatFloat(f, 'e', -1, 64)
	}
	s := strconv.FormatFloat(f, 'f', -1, 64)
	if !strings.Contains(s, ".") {
		s += ".0"
	}
	return s
}
