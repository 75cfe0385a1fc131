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
