package kvsim_test

import (
	"fmt"
	"time"

	"github.com/llmaffinity/caddy-llm-affinity/kvsim"
)

// Example drives a small fleet of engines from one event loop in virtual time: no
// goroutines, no sleeps. A real simulator would keep engines in a heap keyed by
// NextEventTime; a linear scan keeps the example short.
func Example() {
	engines := make([]*kvsim.Engine, 4)
	for i := range engines {
		engines[i], _ = kvsim.NewEngine(kvsim.Config{NumGPUBlocks: 1024})
	}
	// Twelve requests sharing a system prompt, 10 ms apart, round-robin over the fleet.
	system := "You are a helpful assistant. Answer briefly and precisely. "
	for i := range 12 {
		req := &kvsim.Request{
			ID:           fmt.Sprint(i),
			Context:      []byte(fmt.Sprintf("%s%s question %d", system, system, i)),
			OutputTokens: 32,
		}
		if err := engines[i%len(engines)].Submit(req, time.Duration(i)*10*time.Millisecond); err != nil {
			panic(err)
		}
	}
	var events []kvsim.Event
	finished, cached := 0, 0
	for {
		next, which := time.Duration(-1), -1
		for i, e := range engines {
			if t, ok := e.NextEventTime(); ok && (which < 0 || t < next) {
				next, which = t, i
			}
		}
		if which < 0 {
			break
		}
		events = engines[which].AdvanceTo(next, events[:0])
		for _, ev := range events {
			if ev.Kind == kvsim.EventFinished {
				finished++
				cached += ev.CachedTokens
			}
		}
	}
	fmt.Println("finished:", finished, "cached tokens > 0:", cached > 0)
	// Output: finished: 12 cached tokens > 0: true
}
