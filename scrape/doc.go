// Package scrape reads the engines' own view of their load: the queue, the
// running batch, KV memory in use and its size, resident LoRA adapters and
// prefix cache hits, from vLLM's or SGLang's Prometheus /metrics, and the
// served models from /v1/models. The router's own accounting (package router)
// knows only what it routed; the engine also sees work that came another
// way (another router replica, a direct client) and what it actually holds.
//
// How the policy combines the two, without counting anything twice: a
// scrape is a snapshot of the engine at (about) Signals.ScrapedAt, the
// moment the request was sent. Work the router charged before that moment
// is in the snapshot (it reached the engine, or finished); work it charged
// since is not. So the current estimate is the snapshot plus the charges
// made since ScrapedAt (Signals.PlusRouted). Comparing times works;
// cumulative counters work without clocks: give the scraper a Mark
// function (Config.Mark) returning the router's cumulative charges to a
// dial (requests and KV tokens, a Mark), which it samples just before
// each request, and the charges since the scrape are the current counters
// minus Signals.Mark (Mark.Since). Either way the window in which a
// request can be counted twice (routed after the request was sent, and
// rendered into the exposition) is one scrape latency, milliseconds; a
// second mark, once the answer is read (Signals.MarkAfter), tells how
// many were routed in it, so that they are never taken for another
// router's.
//
// Failures never block routing: Scraper.Latest reads an atomic pointer,
// fetches run on the scraper's own goroutines with a timeout, and a
// target that fails simply ages until Latest reports it stale, at which
// point the policy falls back to its own tracking.
//
// The files: signals.go holds what a scrape yields; exposition.go cuts an
// exposition down to the families read and parses them; vllm.go and
// sglang.go map each engine's families to Signals (mapping.go, series.go
// apply the tables); query.go chooses how metrics are asked for;
// scraper.go runs the scrapes; conn.go fetches plain HTTP metrics on a
// kept connection per target (a client of its own, cheaper than
// net/http), fetch.go makes the other requests (net/http); config.go and
// status.go are the scraper's settings and read side.
package scrape
