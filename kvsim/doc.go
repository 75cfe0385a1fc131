// Package kvsim simulates a vLLM-compatible inference engine: a paged KV cache with
// vLLM-style prefix caching, a continuous-batching scheduler with chunked prefill, LoRA
// adapter slots, deterministic pseudo-tokenization and filler generation, and the OpenAI
// HTTP API and Prometheus metrics that vLLM serves.
//
// The engine model ([Engine]) has no goroutines, no clock and no HTTP: a caller submits
// requests at a virtual time and advances it with [Engine.AdvanceTo], collecting [Event]s.
// A discrete-event simulator can therefore drive thousands of engines from one event loop
// using [Engine.NextEventTime]. [Driver] runs one engine in real time (wall clock times a
// speed factor) and [Server] puts the vLLM HTTP API in front of a driver.
//
// Generation is a pure function of the rendered context: the text of the next token depends
// only on the bytes of the context so far. Generating n tokens from context C therefore
// produces the same text as generating k tokens, appending them to C and generating n-k more,
// which is what a router needs to resume an interrupted generation on another replica.
//
// Scheduling policy: admission waits rather than preempts. A waiting request is admitted
// (FCFS, head-of-line) only when free KV blocks cover its whole prompt and its whole planned
// output, so a running sequence never runs out of KV and nothing is ever preempted. A request
// that could never fit in the whole KV cache (or exceeds max_model_len) is rejected at
// submission with a 400 error, like vLLM.
package kvsim

// HTTP API ([Server]):
//
//	POST /v1/completions          prompt: string, token-id array, or a batch of either; n choices
//	POST /v1/chat/completions     messages (string or content-part content), tools,
//	                              add_generation_prompt (default true), continue_final_message
//	GET  /v1/models               the base model under each served name (root = model) and every
//	                              known adapter (parent = the first served name)
//	POST /v1/load_lora_adapter    {"lora_name":..., "lora_path":...}: registers the adapter in host memory
//	POST /v1/unload_lora_adapter  {"lora_name":...}
//	GET  /health                  200, or 503 with the unhealthy fault
//	GET, POST /ping               the same, as vLLM's
//	POST /tokenize                a prompt's or a chat's pseudo-token ids, their count and max_model_len
//	POST /detokenize              token ids' text: the inverse of /tokenize, on any replica
//	GET  /metrics                 vLLM metric names, labels model_name and engine="0"
//	GET  /metrics/                the same; a name[]=... query keeps only the families named
//	                              (as in vLLM, /metrics itself ignores the query)
//	GET  /kvsim/state             queue, KV and adapter state as JSON ([State])
//	GET  /kvsim/faults            the injected faults ([Faults])
//	POST /kvsim/faults            fields present in the JSON body replace the current faults
//
// Both generation endpoints honour stream, stream_options.include_usage and
// continuous_usage_stats, max_completion_tokens
// (or max_tokens) and kvsim's own field kvsim_output_tokens: the number of tokens the
// simulated model generates before it stops on its own (finish reason "stop"), so that trace
// replays reproduce recorded output lengths. The generated length is the smaller of
// max_tokens (finish reason "length") and kvsim_output_tokens; without either, 16 for a
// completions request (vLLM's default max_tokens) and the configured default
// (Config.DefaultOutputTokens) for a chat request. Every response carries the X-Kvsim-Replica header. Latency
// histograms are in simulated seconds.
//
// KV accounting: vllm:kv_cache_usage_perc counts referenced blocks, as vLLM does; blocks
// reserved for the rest of running sequences' outputs are not counted there but are shown as
// reserved_blocks in /kvsim/state.
