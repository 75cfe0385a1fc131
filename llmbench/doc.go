// Package llmbench benchmarks routing policies by replaying LLM request workloads.
//
// A [Workload] is a list of requests whose prompts are made of [Segment]s: runs of tokens
// whose text is a pure function of the segment's ID, so requests that share segments share
// prompt text byte for byte and a prefix cache sees exactly the sharing the workload intends.
// Workloads come from Mooncake-format traces ([ReadTrace]) or from the built-in generators
// ([Generate]: gsp, mrqa, lora, noprefix), deterministic given a seed.
//
// A [Runner] replays a workload under one policy and returns [Results], one [RequestResult]
// per request and one [ReplicaResult] per replica. [Sim] is the runner that needs no network:
// it drives the router's own decision code (prefixindex, scorer) and N kvsim engine models
// from one virtual-time event loop. The HTTP runner (package llmbench/httprun), which replays
// against a real Caddy in front of kvsim servers, plugs in through [HTTPRunner], so that this
// package needs no Caddy, and shares everything after the replay: [Summarize], [WriteTable],
// [WriteJSON] and [WriteSVG].
//
// Prompt text is never printed: reports carry counts and times only.
package llmbench
