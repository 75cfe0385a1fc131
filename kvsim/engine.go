package kvsim

import (
	"fmt"
	"slices"
	"sort"
	"time"

	"github.com/zeebo/xxh3"
)

// Request is one generation request submitted to an [Engine]. The caller fills the exported
// input fields; the engine owns the rest until the request finishes or is aborted.
type Request struct {
	// ID identifies the request in events and logs.
	ID string

	// Adapter names the LoRA adapter to use; empty means the base model.
	Adapter string

	// CacheSalt is vLLM's cache_salt: a salted prompt's blocks match only
	// those of prompts with the same salt (vLLM's first block takes it).
	CacheSalt string

	// Context is the rendered prompt text. The engine appends generated text to its own
	// copy, never to this slice.
	Context []byte

	// OutputTokens is the number of tokens to generate (at least 1).
	OutputTokens int

	// LengthLimited reports that OutputTokens came from max_tokens, so the finish reason is
	// "length" rather than "stop".
	LengthLimited bool

	// CapOutput cuts OutputTokens to what the context (max_model_len, and
	// the KV cache) leaves after the prompt, where it would otherwise be
	// refused: vLLM does so for the Responses API's max_output_tokens.
	CapOutput bool

	// Arrival is set by Submit to the virtual time the request arrived.
	Arrival time.Duration

	// Scheduled is set by the engine to the virtual time the request left
	// the waiting queue (vLLM's queue time is Scheduled − Arrival).
	Scheduled time.Duration

	seq *sequence
}

// PromptTokens returns the number of prompt tokens; valid after Submit.
func (r *Request) PromptTokens() int {
	if r.seq == nil {
		return 0
	}
	return r.seq.promptTokens
}

// EventKind tells what happened to a request.
type EventKind uint8

// The kinds of events an engine emits.
const (
	// EventFirstToken: prefill finished and the first token was generated (Text).
	EventFirstToken EventKind = iota + 1
	// EventToken: one more token was generated (Text).
	EventToken
	// EventFinished: the request generated all its tokens and released its KV blocks.
	// It always follows the request's last token event in the same batch of events.
	EventFinished
)

func (k EventKind) String() string {
	switch k {
	case EventFirstToken:
		return "first_token"
	case EventToken:
		return "token"
	case EventFinished:
		return "finished"
	}
	return "unknown"
}

// Event is something that happened to a request at a virtual time.
type Event struct {
	Kind    EventKind
	Request *Request
	Time    time.Duration
	// Text is the generated token's text (token events). It aliases engine memory that is
	// never rewritten; callers must not modify it.
	Text []byte
	// PromptTokens and CachedTokens (prompt tokens served from the prefix cache) are set on
	// every event; GeneratedTokens counts tokens generated so far.
	PromptTokens    int
	CachedTokens    int
	GeneratedTokens int
	// FinishReason is "stop" or "length" on EventFinished.
	FinishReason string
	// SincePrevious is, on EventToken, the virtual time since the
	// request's previous token (vLLM's inter-token latency).
	SincePrevious time.Duration
}

type seqState uint8

const (
	seqWaiting seqState = iota
	seqRunning
	seqDone
)

// sequence is the engine's state of one request.
type sequence struct {
	req          *Request
	state        seqState
	adapter      *adapterState
	ctx          []byte
	promptTokens int
	target       int
	hashes       []uint64 // chained hashes of the full blocks of ctx computed so far
	blocks       []int32
	registered   int // blocks whose hash is registered in the cache
	computed     int // tokens whose KV has been computed
	generated    int
	cachedTokens int
	reserved     int // blocks promised to this sequence, not yet allocated
	chunk        int // tokens scheduled in the current step
	lastToken    time.Duration
}

// Stats is a snapshot of an engine's state and counters.
type Stats struct {
	Now              time.Duration
	Running          int
	Waiting          int
	TotalBlocks      int
	UsedBlocks       int
	CachedBlocks     int
	ReservedBlocks   int
	KVCacheUsage     float64
	PrefixQueries    uint64
	PrefixHits       uint64
	PromptTokens     uint64
	GenerationTokens uint64
	Finished         uint64
	FinishedLength   uint64
	Aborted          uint64
	Steps            uint64
	// StorageLoads and HostLoads count the adapter loads into a GPU slot started from
	// storage and from host memory.
	StorageLoads    uint64
	HostLoads       uint64
	RunningAdapters []string
	WaitingAdapters []string
	GPUAdapters     []string
	HostAdapters    []string
	LoadingAdapters []string
}

// Engine is the virtual-time model of one inference engine. It is not safe for concurrent
// use; it never blocks, sleeps or starts goroutines. Time is a [time.Duration] since an
// arbitrary epoch and must never go backwards.
type Engine struct {
	cfg   Config
	tok   *Tokenizer
	pool  *blockPool
	seeds map[string]uint64

	now      time.Duration
	busy     bool
	stepEnd  time.Duration
	batch    []*sequence
	waiting  []*sequence
	running  []*sequence
	reserved int

	adapters map[string]*adapterState
	gpuCount int

	prefixQueries, prefixHits uint64
	storageLoads, hostLoads   uint64
	promptTokens, genTokens   uint64
	finished, aborted, steps  uint64
	finishedLength            uint64

	scratch []int32
}

// NewEngine returns an engine with cfg (zero fields defaulted).
func NewEngine(cfg Config) (*Engine, error) {
	cfg = cfg.WithDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	e := &Engine{
		cfg:      cfg,
		tok:      NewTokenizer(cfg.BytesPerToken),
		pool:     newBlockPool(cfg.NumGPUBlocks),
		seeds:    make(map[string]uint64),
		adapters: make(map[string]*adapterState),
	}
	for _, name := range cfg.Adapters {
		e.RegisterAdapter(name, name)
	}
	return e, nil
}

// Config returns the engine's configuration with defaults applied.
func (e *Engine) Config() Config { return e.cfg }

// Tokenizer returns the engine's pseudo-tokenizer.
func (e *Engine) Tokenizer() *Tokenizer { return e.tok }

// Now returns the engine's current virtual time.
func (e *Engine) Now() time.Duration { return e.now }

// seed returns the first link of the hash chain of an adapter and a cache
// salt, so blocks of different adapters or salts never match (vLLM keys
// blocks by LoRA name, and its first block by the salt too). Salts, which
// clients choose, are not kept.
func (e *Engine) seed(adapter, salt string) uint64 {
	if salt != "" {
		return xxh3.HashString("kvsim\x00" + adapter + "\x00salt\x00" + salt)
	}
	s, ok := e.seeds[adapter]
	if !ok {
		s = xxh3.HashString("kvsim\x00" + adapter)
		e.seeds[adapter] = s
	}
	return s
}

// BlockHashes returns the chained hashes of the full blocks of text as adapter would key them
// (unsalted).
func (e *Engine) BlockHashes(adapter string, text []byte) []uint64 {
	return e.blockHashes(adapter, "", text)
}

// blockHashes is BlockHashes for a prompt salted with salt ("" for none).
func (e *Engine) blockHashes(adapter, salt string, text []byte) []uint64 {
	return e.extendHashes(nil, adapter, salt, text, len(text)/(e.cfg.BlockSize*e.cfg.BytesPerToken))
}

func (e *Engine) extendHashes(hashes []uint64, adapter, salt string, text []byte, blocks int) []uint64 {
	blockBytes := e.cfg.BlockSize * e.cfg.BytesPerToken
	parent := e.seed(adapter, salt)
	if len(hashes) > 0 {
		parent = hashes[len(hashes)-1]
	}
	for j := len(hashes); j < blocks; j++ {
		parent = xxh3.HashSeed(text[j*blockBytes:(j+1)*blockBytes], parent)
		hashes = append(hashes, parent)
	}
	return hashes
}

// CheckFits returns a 400 APIError when a request of promptTokens and outputTokens can never
// run on this engine (longer than max_model_len, or more KV blocks than the whole cache).
func (e *Engine) CheckFits(promptTokens, outputTokens int) error {
	total := promptTokens + outputTokens
	if total > e.cfg.MaxModelLen {
		return errBadRequestf("This model's maximum context length is %d tokens. However, you requested %d tokens (%d in the messages, %d in the completion). Please reduce the length of the messages or completion.",
			e.cfg.MaxModelLen, total, promptTokens, outputTokens)
	}
	if blocks := e.blocksFor(total); blocks > e.cfg.NumGPUBlocks {
		return errBadRequestf("The request needs %d tokens (%d in the prompt, %d in the completion), which exceeds the KV cache capacity of %d tokens (%d blocks of %d).",
			total, promptTokens, outputTokens, e.cfg.NumGPUBlocks*e.cfg.BlockSize, e.cfg.NumGPUBlocks, e.cfg.BlockSize)
	}
	return nil
}

func (e *Engine) blocksFor(tokens int) int {
	return (tokens + e.cfg.BlockSize - 1) / e.cfg.BlockSize
}

// Submit queues req at virtual time now (clamped to the engine's time). It returns an
// *APIError for an unknown adapter (404), an empty prompt, or a request that can never fit
// (400). A request may be submitted once.
func (e *Engine) Submit(req *Request, now time.Duration) error {
	if req.seq != nil {
		return errBadRequest("request already submitted")
	}
	if req.OutputTokens < 1 {
		return errBadRequest("output tokens must be at least 1")
	}
	var ad *adapterState
	if req.Adapter != "" {
		ad = e.adapters[req.Adapter]
		if ad == nil || ad.removed {
			return errModelNotFound(req.Adapter)
		}
	}
	promptTokens := e.tok.CountTokens(len(req.Context))
	if promptTokens == 0 {
		return errBadRequest("The prompt must not be empty.")
	}
	if room := min(e.cfg.MaxModelLen, e.cfg.NumGPUBlocks*e.cfg.BlockSize) - promptTokens; req.CapOutput && room >= 1 && req.OutputTokens > room {
		req.OutputTokens, req.LengthLimited = room, true
	}
	if err := e.CheckFits(promptTokens, req.OutputTokens); err != nil {
		return err
	}
	e.now = max(e.now, now)
	req.Arrival = e.now
	s := &sequence{
		req:          req,
		adapter:      ad,
		ctx:          slices.Clip(req.Context),
		promptTokens: promptTokens,
		target:       req.OutputTokens,
	}
	s.hashes = e.blockHashes(req.Adapter, req.CacheSalt, s.ctx)
	req.seq = s
	e.waiting = append(e.waiting, s)
	if ad != nil {
		ad.waiting++
		ad.lastUsed = e.now
	}
	if !e.busy {
		e.startStep()
	}
	return nil
}

// Abort removes req from the engine and frees its KV blocks. It is a no-op for a request
// that finished or was never submitted. No event is emitted.
func (e *Engine) Abort(req *Request, now time.Duration) {
	s := req.seq
	if s == nil || s.state == seqDone {
		return
	}
	e.now = max(e.now, now)
	switch s.state {
	case seqWaiting:
		e.waiting = slices.DeleteFunc(e.waiting, func(x *sequence) bool { return x == s })
		if s.adapter != nil {
			s.adapter.waiting--
		}
	case seqRunning:
		e.running = slices.DeleteFunc(e.running, func(x *sequence) bool { return x == s })
		e.releaseSequence(s)
	}
	s.state = seqDone
	e.aborted++
}

// NextEventTime returns the virtual time at which the engine next has something to do (a
// step ends or an adapter load completes), and false when it is idle until a Submit.
func (e *Engine) NextEventTime() (time.Duration, bool) {
	var next time.Duration
	ok := false
	if e.busy {
		next, ok = e.stepEnd, true
	}
	for _, a := range e.adapters {
		if a.gpu == gpuLoading && (!ok || a.loadDoneAt < next) {
			next, ok = a.loadDoneAt, true
		}
	}
	return next, ok
}

// AdvanceTo runs the engine up to virtual time t, appending the events that happened to out
// in time order, and returns out. Steps ending exactly at t are completed.
func (e *Engine) AdvanceTo(t time.Duration, out []Event) []Event {
	for {
		next, ok := e.NextEventTime()
		if !ok || next > t {
			break
		}
		e.now = max(e.now, next)
		e.completeLoads()
		if e.busy && e.stepEnd <= e.now {
			out = e.finishStep(out)
		}
		if !e.busy {
			e.startStep()
		}
	}
	e.now = max(e.now, t)
	return out
}

// startStep schedules a batch at e.now: running sequences first (one decode token each, or
// their next prefill chunk), then waiting ones FCFS while sequences, tokens and KV allow.
func (e *Engine) startStep() {
	budget := e.cfg.MaxNumBatchedTokens
	e.batch = e.batch[:0]
	var prefill, decode, context int
	for _, s := range e.running {
		if budget == 0 {
			break
		}
		if s.computed < s.promptTokens {
			s.chunk = min(s.promptTokens-s.computed, budget)
			prefill += s.chunk
		} else {
			s.chunk = 1
			decode++
		}
		budget -= s.chunk
		context += s.computed + s.chunk
		e.batch = append(e.batch, s)
	}
	if budget > 0 && len(e.waiting) > 0 {
		kept := e.waiting[:0]
		blocked := false
		for _, s := range e.waiting {
			if blocked || budget == 0 || len(e.running) >= e.cfg.MaxNumSeqs {
				kept = append(kept, s)
				continue
			}
			if s.adapter != nil && !e.adapterReady(s.adapter) {
				kept = append(kept, s) // waits for its adapter; others may pass it
				continue
			}
			if !e.admit(s) {
				blocked = true // FCFS: nobody overtakes a request waiting for KV
				kept = append(kept, s)
				continue
			}
			s.chunk = min(s.promptTokens-s.computed, budget)
			budget -= s.chunk
			prefill += s.chunk
			context += s.computed + s.chunk
			e.batch = append(e.batch, s)
		}
		clear(e.waiting[len(kept):])
		e.waiting = kept
	}
	if len(e.batch) == 0 {
		e.busy = false
		return
	}
	e.busy = true
	e.steps++
	e.stepEnd = e.now + e.cfg.StepOverhead +
		time.Duration(prefill)*e.cfg.PerPrefillToken +
		time.Duration(decode)*e.cfg.PerDecodeSequence +
		time.Duration(context)*e.cfg.PerContextToken
	if e.stepEnd == e.now {
		e.stepEnd++ // time always moves forward
	}
}

// admit moves a waiting sequence to running if KV blocks cover its prompt and its whole
// planned output: cached prefix blocks are shared, the rest allocated or reserved.
func (e *Engine) admit(s *sequence) bool {
	bs := e.cfg.BlockSize
	hits := e.scratch[:0]
	if !e.cfg.DisablePrefixCaching {
		// As in vLLM, at least the last prompt token is always computed.
		maxHitBlocks := min(len(s.hashes), (s.promptTokens-1)/bs)
		hits = e.pool.lookup(s.hashes[:maxHitBlocks], hits)
	}
	e.scratch = hits
	idleHits := 0
	for _, b := range hits {
		if e.pool.refs[b] == 0 {
			idleHits++
		}
	}
	promptBlocks := e.blocksFor(s.promptTokens)
	totalBlocks := e.blocksFor(s.promptTokens + s.target)
	need := idleHits + totalBlocks - len(hits)
	if e.pool.numFree-e.reserved < need {
		return false
	}
	for _, b := range hits {
		e.pool.acquire(b)
	}
	s.blocks = append(make([]int32, 0, totalBlocks), hits...)
	for len(s.blocks) < promptBlocks {
		s.blocks = append(s.blocks, e.pool.allocate())
	}
	s.reserved = totalBlocks - promptBlocks
	e.reserved += s.reserved
	s.registered = len(hits)
	s.cachedTokens = len(hits) * bs
	s.computed = s.cachedTokens
	s.state = seqRunning
	s.req.Scheduled = e.now
	e.running = append(e.running, s)
	e.prefixQueries += uint64(s.promptTokens)
	e.prefixHits += uint64(s.cachedTokens)
	e.promptTokens += uint64(s.promptTokens)
	if s.adapter != nil {
		s.adapter.waiting--
		s.adapter.running++
		s.adapter.lastUsed = e.now
	}
	return true
}

// finishStep applies the step that ends now: prefill progress, one generated token per
// sequence that completed its prompt or decoded, and finished sequences.
func (e *Engine) finishStep(out []Event) []Event {
	e.busy = false
	finishedAny := false
	for _, s := range e.batch {
		if s.state != seqRunning {
			continue // aborted during the step
		}
		s.computed += s.chunk
		s.chunk = 0
		if s.computed < s.promptTokens {
			e.registerComputed(s)
			continue
		}
		kind := EventToken
		if s.generated == 0 {
			kind = EventFirstToken
		}
		start := len(s.ctx)
		s.ctx = append(s.ctx, e.tok.NextToken(s.ctx)...)
		s.generated++
		e.genTokens++
		e.registerComputed(s)
		for len(s.blocks) < e.blocksFor(e.tok.CountTokens(len(s.ctx))) && s.reserved > 0 {
			s.blocks = append(s.blocks, e.pool.allocate())
			s.reserved--
			e.reserved--
		}
		ev := Event{
			Kind: kind, Request: s.req, Time: e.now, Text: s.ctx[start:len(s.ctx):len(s.ctx)],
			PromptTokens: s.promptTokens, CachedTokens: s.cachedTokens, GeneratedTokens: s.generated,
		}
		if kind == EventToken {
			ev.SincePrevious = e.now - s.lastToken
		}
		s.lastToken = e.now
		out = append(out, ev)
		if s.generated >= s.target {
			reason := "stop"
			if s.req.LengthLimited {
				reason = "length"
				e.finishedLength++
			}
			out = append(out, Event{
				Kind: EventFinished, Request: s.req, Time: e.now,
				PromptTokens: s.promptTokens, CachedTokens: s.cachedTokens, GeneratedTokens: s.generated,
				FinishReason: reason,
			})
			e.releaseSequence(s)
			s.state = seqDone
			e.finished++
			finishedAny = true
		}
	}
	if finishedAny {
		e.running = slices.DeleteFunc(e.running, func(s *sequence) bool { return s.state == seqDone })
	}
	return out
}

// registerComputed caches the hashes of full blocks whose every token has been computed.
func (e *Engine) registerComputed(s *sequence) {
	if e.cfg.DisablePrefixCaching {
		return
	}
	full := min(s.computed/e.cfg.BlockSize, len(s.ctx)/(e.cfg.BlockSize*e.cfg.BytesPerToken), len(s.blocks))
	if full <= s.registered {
		return
	}
	s.hashes = e.extendHashes(s.hashes, s.req.Adapter, s.req.CacheSalt, s.ctx, full)
	for ; s.registered < full; s.registered++ {
		e.pool.register(s.blocks[s.registered], s.hashes[s.registered])
	}
}

// releaseSequence returns a sequence's blocks, tail first so that the tail of a chain is
// evicted before its prefix, and its unused reservation.
func (e *Engine) releaseSequence(s *sequence) {
	for i := len(s.blocks) - 1; i >= 0; i-- {
		e.pool.release(s.blocks[i])
	}
	s.blocks = nil
	e.reserved -= s.reserved
	s.reserved = 0
	if s.adapter != nil {
		s.adapter.running--
		s.adapter.lastUsed = e.now
	}
}

// Stats returns a snapshot of the engine's state and counters.
func (e *Engine) Stats() Stats {
	st := Stats{
		Now:              e.now,
		Running:          len(e.running),
		Waiting:          len(e.waiting),
		TotalBlocks:      e.cfg.NumGPUBlocks,
		UsedBlocks:       e.pool.used(),
		CachedBlocks:     len(e.pool.cached),
		ReservedBlocks:   e.reserved,
		PrefixQueries:    e.prefixQueries,
		PrefixHits:       e.prefixHits,
		PromptTokens:     e.promptTokens,
		GenerationTokens: e.genTokens,
		Finished:         e.finished,
		FinishedLength:   e.finishedLength,
		Aborted:          e.aborted,
		Steps:            e.steps,
		StorageLoads:     e.storageLoads,
		HostLoads:        e.hostLoads,
	}
	st.KVCacheUsage = float64(st.UsedBlocks) / float64(st.TotalBlocks)
	for name, a := range e.adapters {
		if a.running > 0 {
			st.RunningAdapters = append(st.RunningAdapters, name)
		}
		if a.waiting > 0 {
			st.WaitingAdapters = append(st.WaitingAdapters, name)
		}
		switch a.gpu {
		case gpuReady:
			st.GPUAdapters = append(st.GPUAdapters, name)
		case gpuLoading:
			st.LoadingAdapters = append(st.LoadingAdapters, name)
		}
		if a.onHost {
			st.HostAdapters = append(st.HostAdapters, name)
		}
	}
	for _, l := range [][]string{st.RunningAdapters, st.WaitingAdapters, st.GPUAdapters, st.HostAdapters, st.LoadingAdapters} {
		sort.Strings(l)
	}
	return st
}

// String describes the engine briefly, for logs.
func (e *Engine) String() string {
	return fmt.Sprintf("kvsim engine %s (%d blocks of %d tokens)", e.cfg.Model, e.cfg.NumGPUBlocks, e.cfg.BlockSize)
}
