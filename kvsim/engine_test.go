package kvsim

import (
	"bytes"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"
)

// runToCompletion drives e in virtual time until it is idle, returning all events.
func runToCompletion(t testing.TB, e *Engine) []Event {
	t.Helper()
	var out []Event
	for range 10_000_000 {
		next, ok := e.NextEventTime()
		if !ok {
			return out
		}
		out = e.AdvanceTo(next, out)
	}
	t.Fatal("engine did not become idle")
	return nil
}

func newTestEngine(t testing.TB, cfg Config) *Engine {
	t.Helper()
	e, err := NewEngine(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return e
}

func eventsOf(events []Event, r *Request) (first, finished *Event, text string) {
	var b strings.Builder
	for i := range events {
		ev := &events[i]
		if ev.Request != r {
			continue
		}
		switch ev.Kind {
		case EventFirstToken:
			first = ev
			b.Write(ev.Text)
		case EventToken:
			b.Write(ev.Text)
		case EventFinished:
			finished = ev
		}
	}
	return first, finished, b.String()
}

func TestPrefixCacheMakesSecondPrefillFaster(t *testing.T) {
	e := newTestEngine(t, Config{})
	prompt := bytes.Repeat([]byte("system prompt shared by all. "), 2000) // ~14.5k tokens
	r1 := &Request{ID: "a", Context: append([]byte(nil), prompt...), OutputTokens: 4}
	if err := e.Submit(r1, 0); err != nil {
		t.Fatal(err)
	}
	ev1 := runToCompletion(t, e)
	first1, fin1, _ := eventsOf(ev1, r1)
	if first1 == nil || fin1 == nil {
		t.Fatal("first request did not finish")
	}
	ttft1 := first1.Time - r1.Arrival

	start := e.Now() + time.Second
	r2 := &Request{ID: "b", Context: append(append([]byte(nil), prompt...), " and a new question?"...), OutputTokens: 4}
	if err := e.Submit(r2, start); err != nil {
		t.Fatal(err)
	}
	ev2 := runToCompletion(t, e)
	first2, _, _ := eventsOf(ev2, r2)
	ttft2 := first2.Time - r2.Arrival
	if first2.CachedTokens < first1.PromptTokens-16 {
		t.Errorf("cached tokens = %d, want about %d", first2.CachedTokens, first1.PromptTokens)
	}
	if ttft2*5 > ttft1 {
		t.Errorf("TTFT with cached prefix %v, without %v: want at least 5x faster", ttft2, ttft1)
	}
	st := e.Stats()
	if st.PrefixHits != uint64(first2.CachedTokens) || st.PrefixQueries != uint64(first1.PromptTokens+first2.PromptTokens) {
		t.Errorf("stats hits=%d queries=%d", st.PrefixHits, st.PrefixQueries)
	}
	if st.UsedBlocks != 0 || st.CachedBlocks == 0 {
		t.Errorf("after completion used=%d cached=%d", st.UsedBlocks, st.CachedBlocks)
	}
}

func TestDifferentAdaptersDoNotShareBlocks(t *testing.T) {
	e := newTestEngine(t, Config{Adapters: []string{"lora-a"}})
	prompt := bytes.Repeat([]byte("0123456789abcdef"), 200)
	r1 := &Request{Context: prompt, OutputTokens: 1}
	_ = e.Submit(r1, 0)
	runToCompletion(t, e)
	r2 := &Request{Adapter: "lora-a", Context: prompt, OutputTokens: 1}
	_ = e.Submit(r2, e.Now())
	ev := runToCompletion(t, e)
	if first, _, _ := eventsOf(ev, r2); first.CachedTokens != 0 {
		t.Errorf("adapter request hit %d base-model tokens", first.CachedTokens)
	}
}

func TestGenerationIsAutoregressiveAndDeterministic(t *testing.T) {
	tok := NewTokenizer(4)
	ctx := []byte("Hello there, tell me a story")
	full := string(tok.Generate(append([]byte(nil), ctx...), 50))
	for _, k := range []int{0, 1, 7, 49, 50} {
		part := tok.Generate(append([]byte(nil), ctx...), k)
		resumed := string(tok.Generate(part, 50-k))
		if resumed != full {
			t.Fatalf("k=%d: resumed generation differs", k)
		}
	}
	gen := full[len(ctx):]
	if len(gen) != 50*4 || tok.CountTokens(len(gen)) != 50 {
		t.Fatalf("generated %d bytes", len(gen))
	}

	// The engine generates the same text as the tokenizer, and resuming through the engine
	// gives the same text byte for byte.
	e := newTestEngine(t, Config{})
	r := &Request{Context: ctx, OutputTokens: 50}
	_ = e.Submit(r, 0)
	_, fin, text := eventsOf(runToCompletion(t, e), r)
	if text != gen || fin.GeneratedTokens != 50 {
		t.Fatalf("engine text differs from tokenizer text")
	}
	r2 := &Request{Context: []byte(string(ctx) + gen[:20*4]), OutputTokens: 30}
	_ = e.Submit(r2, e.Now())
	_, _, text2 := eventsOf(runToCompletion(t, e), r2)
	if gen[:80]+text2 != gen {
		t.Fatalf("continued text differs")
	}
}

func TestChatContinuationRendersSameContext(t *testing.T) {
	msgs := []ChatMessage{
		{Role: "system", Content: []byte(`"You are terse."`)},
		{Role: "user", Content: []byte(`[{"type":"text","text":"Hi "},{"type":"text","text":"there"}]`)},
	}
	tools := []byte(`[ {"type": "function", "function": {"name": "f"}} ]`)
	orig, err := RenderChat(msgs, tools, true, false)
	if err != nil {
		t.Fatal(err)
	}
	tok := NewTokenizer(4)
	full := tok.Generate(append([]byte(nil), orig...), 40)
	partial := string(full[len(orig) : len(orig)+13*4])
	cont := append(append([]ChatMessage(nil), msgs...), ChatMessage{Role: "assistant", Content: []byte(fmt.Sprintf("%q", partial))})
	resumed, err := RenderChat(cont, tools, false, true)
	if err != nil {
		t.Fatal(err)
	}
	if string(resumed) != string(orig)+partial {
		t.Fatalf("continuation context differs:\n%q\n%q", resumed, string(orig)+partial)
	}
	if string(tok.Generate(resumed, 27)) != string(full) {
		t.Fatal("continued generation differs")
	}
	// Turn n+1 extends turn n.
	next := append(cont[:len(cont):len(cont)], ChatMessage{Role: "user", Content: []byte(`"more"`)})
	turn2, _ := RenderChat(next, tools, true, false)
	if !bytes.HasPrefix(turn2, resumed) {
		t.Fatal("turn n+1 does not extend turn n")
	}
}

func TestPromptLargerThanFreeKVWaits(t *testing.T) {
	e := newTestEngine(t, Config{NumGPUBlocks: 100, BlockSize: 16, MaxModelLen: 4096})
	// Each request needs 60 blocks (900 prompt + 60 output tokens), so the second waits.
	mk := func(id string) *Request {
		return &Request{ID: id, Context: bytes.Repeat([]byte(id), 3600), OutputTokens: 60}
	}
	r1, r2 := mk("a"), mk("b")
	_ = e.Submit(r1, 0)
	_ = e.Submit(r2, 0)
	e.AdvanceTo(time.Millisecond, nil)
	if st := e.Stats(); st.Running != 1 || st.Waiting != 1 {
		t.Fatalf("running=%d waiting=%d, want 1 and 1", st.Running, st.Waiting)
	}
	ev := runToCompletion(t, e)
	_, fin1, _ := eventsOf(ev, r1)
	first2, _, _ := eventsOf(ev, r2)
	if fin1 == nil || first2 == nil || first2.Time < fin1.Time {
		t.Fatal("second request should start after the first finishes")
	}
	// A request that could never fit is rejected at submission.
	big := &Request{Context: bytes.Repeat([]byte("x"), 4*1700), OutputTokens: 1}
	err := e.Submit(big, e.Now())
	if ae, ok := err.(*APIError); !ok || ae.Code != 400 {
		t.Fatalf("oversized prompt: err = %v, want 400", err)
	}
}

func TestLoRALoadLatencyPaidOnce(t *testing.T) {
	e := newTestEngine(t, Config{Adapters: []string{"sql"}, LoRAStorageLoad: 2 * time.Second})
	ttft := func(adapter string) time.Duration {
		r := &Request{Adapter: adapter, Context: []byte("select something from somewhere please"), OutputTokens: 2}
		if err := e.Submit(r, e.Now()+time.Second); err != nil {
			t.Fatal(err)
		}
		first, _, _ := eventsOf(runToCompletion(t, e), r)
		return first.Time - r.Arrival
	}
	cold, warm := ttft("sql"), ttft("sql")
	if cold < 2*time.Second || warm > 100*time.Millisecond {
		t.Fatalf("cold TTFT %v, warm %v", cold, warm)
	}
	if err := e.Submit(&Request{Adapter: "nope", Context: []byte("x"), OutputTokens: 1}, e.Now()); err == nil ||
		err.Error() != "The model `nope` does not exist." {
		t.Fatalf("unknown adapter: %v", err)
	}
}

// TestLoRALoadsCounted: with one GPU slot, two adapters in turn each
// evict the other; the first load of each comes from storage, a later one
// from host memory, and Stats counts both kinds.
func TestLoRALoadsCounted(t *testing.T) {
	e := newTestEngine(t, Config{Adapters: []string{"a", "b"}, MaxLoRAs: 1, LoRAStorageLoad: 2 * time.Second, LoRAHostLoad: 30 * time.Millisecond})
	for _, adapter := range []string{"a", "b", "a", "a"} {
		r := &Request{Adapter: adapter, Context: []byte("select something from somewhere please"), OutputTokens: 2}
		if err := e.Submit(r, e.Now()+time.Second); err != nil {
			t.Fatal(err)
		}
		runToCompletion(t, e)
	}
	if st := e.Stats(); st.StorageLoads != 2 || st.HostLoads != 1 {
		t.Fatalf("loads from storage %d, from host %d; want 2 and 1", st.StorageLoads, st.HostLoads)
	}
}

// TestLoadInplaceKeepsResidency: an in-place load of an adapter in a GPU
// slot swaps its weights there (vLLM reloads and reactivates it at once), so
// its next request pays no load; without inplace the load is refused.
func TestLoadInplaceKeepsResidency(t *testing.T) {
	e := newTestEngine(t, Config{LoRAStorageLoad: 2 * time.Second})
	if err := e.LoadAdapterToHost("sql", "/v1", false); err != nil {
		t.Fatal(err)
	}
	ttft := func() time.Duration {
		r := &Request{Adapter: "sql", Context: []byte("select something from somewhere please"), OutputTokens: 2}
		if err := e.Submit(r, e.Now()+time.Second); err != nil {
			t.Fatal(err)
		}
		first, _, _ := eventsOf(runToCompletion(t, e), r)
		return first.Time - r.Arrival
	}
	ttft() // on the GPU now
	if err := e.LoadAdapterToHost("sql", "/v2", false); err == nil || err.(*APIError).Code != 400 {
		t.Fatalf("second load without inplace: %v", err)
	}
	if err := e.LoadAdapterToHost("sql", "/v2", true); err != nil {
		t.Fatal(err)
	}
	if a := e.Adapters(); len(a) != 1 || a[0].Path != "/v2" {
		t.Fatalf("adapters after an in-place load: %+v", a)
	}
	if st := e.Stats(); !slices.Contains(st.GPUAdapters, "sql") || !slices.Contains(st.HostAdapters, "sql") {
		t.Fatalf("in-place load left the adapter off the GPU or host: gpu %v host %v", st.GPUAdapters, st.HostAdapters)
	}
	if warm := ttft(); warm > 100*time.Millisecond {
		t.Fatalf("TTFT after an in-place load %v: it reloaded from storage", warm)
	}
}

func TestAbortFreesBlocks(t *testing.T) {
	e := newTestEngine(t, Config{})
	r := &Request{Context: bytes.Repeat([]byte("abcd"), 5000), OutputTokens: 1000}
	_ = e.Submit(r, 0)
	e.AdvanceTo(500*time.Millisecond, nil)
	if st := e.Stats(); st.UsedBlocks == 0 || st.Running != 1 {
		t.Fatalf("used=%d running=%d", st.UsedBlocks, st.Running)
	}
	e.Abort(r, e.Now())
	if st := e.Stats(); st.UsedBlocks != 0 || st.Running != 0 || st.ReservedBlocks != 0 {
		t.Fatalf("after abort used=%d running=%d reserved=%d", st.UsedBlocks, st.Running, st.ReservedBlocks)
	}
	runToCompletion(t, e)
}

// BenchmarkEngineVirtualTime measures how many simulated requests one engine completes per
// wall-clock second when driven in virtual time (multi-turn chat-like prompts with shared
// prefixes, 1k-token prompts, 128-token outputs, arriving at 20 req/s).
func BenchmarkEngineVirtualTime(b *testing.B) {
	e := newTestEngine(b, Config{})
	systems := make([][]byte, 8)
	for i := range systems {
		systems[i] = bytes.Repeat([]byte(fmt.Sprintf("system %d. ", i)), 300)
	}
	var events []Event
	arrival := time.Duration(0)
	b.ResetTimer()
	start := time.Now()
	for i := range b.N {
		ctx := append(append([]byte(nil), systems[i%len(systems)]...), fmt.Sprintf("question %d", i)...)
		arrival += 50 * time.Millisecond
		for {
			next, ok := e.NextEventTime()
			if !ok || next > arrival {
				break
			}
			events = e.AdvanceTo(next, events[:0])
		}
		if err := e.Submit(&Request{Context: ctx, OutputTokens: 128}, arrival); err != nil {
			b.Fatal(err)
		}
	}
	runToCompletion(b, e)
	b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "sim-req/s")
	b.ReportMetric(e.Stats().Now.Seconds()/float64(b.N), "sim-s/req")
}
