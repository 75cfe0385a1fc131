// Package scrape reads the engines' own view of their load: the queue, the
// running batch, KV memory in use and its size, resident LoRA adapters and
// prefix cache hits, from vLLM's or SGLang's Prometheus /metrics, and the
// served models from /v1/models. The router's own accounting (package router)
// knows only what it routed; the engine also sees work that came another
// way (another router replica, a direct client) and what it actually holds.
//
// How the policy combines the two, without counting anything twice: a
// scrape is a snapshot of the engine at (about) EngineSignals.ScrapedAt,
// the moment the request was sent. Work the router charged before that
// moment is in the snapshot (it reached the engine, or finished); work it
// charged since is not. So the current estimate is the snapshot plus the
// charges made since ScrapedAt (EngineSignals.plusRouted). Comparing
// times works; cumulative counters work without clocks: give the scraper
// a Mark function returning the router's cumulative charges to a dial
// (requests and KV tokens, a chargeMark), which it samples just before
// each request, and the charges since the scrape are the current counters
// minus EngineSignals.Mark (chargeMark.since). Either way the window in
// which a request can be counted twice (routed after the request was
// sent, and rendered into the exposition) is one scrape latency,
// milliseconds.
//
// Failures never block routing: signals reads an atomic pointer, fetches
// run on the scraper's own goroutines with a timeout, and a target that
// fails simply ages until signals reports it stale, at which point the
// policy falls back to its own tracking.
package scrape
