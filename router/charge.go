package router

import (
	"math"
	"slices"
	"sort"
	"time"
)

// Charge is the work one routed request put on its upstream, from the
// decision until Complete or Release. Its methods are not safe for
// concurrent use on the same Charge; the fleet's are.
type Charge struct {
	up   *upstream
	dial string
	// id names the charge in events to peers.
	id uint64
	// Estimate is the ttft estimate made at the decision, in seconds.
	Estimate float64
	prefill  int // uncached prompt tokens still charged
	decode   int // expected output tokens still charged
	kv       int
	// promptBytes is the request's Request.PromptBytes, for learning
	// bytes per token at Complete; sequences its sequences (see
	// Request.Sequences), whose mean output Complete learns.
	promptBytes, sequences int32 // two halves of one word: a charge stays in its size class
	// Started is when the request was charged, FirstToken when its first
	// output token came back (zero until then).
	Started    time.Time
	FirstToken time.Time
	// Tokens counts the output tokens reported by Progress.
	Tokens int
	// chain is the request's blocks: the decision added chain[held:] to
	// the upstream's index, and the first kept of them another request's
	// prefill there has run through since (see Fleet.confirm). Only a
	// local charge has them, until its first token says the engine
	// prefilled them, or, for a router that shares its view, until it is
	// released (a peer's failure there must not forget what it holds:
	// see Fleet.applyForgot). A peer's charge has only held: the blocks
	// its routing event found in this router's index, -1 when the event
	// carried none (a restatement). listed is the charge's place in its
	// upstream's pending list, or prefilled list after its first token,
	// -1 when it is in neither.
	chain      []uint64
	held, kept int32
	listed     int32
	// maxTokens is the request's max_tokens, 0 when it set none or the
	// charge is a peer's; lengthBucket the bucket of output lengths its
	// output was in when its expected rest was last looked up, or
	// configuredOutput (see Fleet.progress).
	maxTokens    int32
	lengthBucket uint8
	// remote marks a peer's charge, applied from its events.
	remote bool
	// lost says a failure (or an engine restart) made the index forget
	// blocks of chain since the decision, which the first token says the
	// engine holds after all (see Fleet.confirm).
	lost bool
	// adapter is the LoRA adapter the decision presumed the upstream
	// would load, "" for none.
	adapter string
}

// Dial is the upstream the charge is on.
func (c *Charge) Dial() string { return c.dial }

// charge records a new request on u, in into when it is not nil and not
// held (see Request.Charge). Caller holds f.mu.
func (f *Fleet) charge(u *upstream, prefill, decode, kv int, now time.Time, into *Charge) *Charge {
	u.queuedPrefill += prefill
	u.queuedDecode += decode
	u.kvTokens += kv
	u.inFlight++
	u.lastUsed = now
	f.meanPrompt.add(float64(prefill))
	u.charged.Requests++
	u.charged.KVTokens += uint64(max(0, kv))
	c := into
	if c == nil || c.up != nil {
		c = new(Charge)
	} else {
		*c = Charge{} // cleared in place: a literal with fields set is built apart and copied
	}
	c.up, c.dial, c.Started, c.listed = u, u.dial, now, -1
	c.prefill, c.decode, c.kv = prefill, decode, kv
	return c
}

// progress is Progress; caller holds f.mu.
func (f *Fleet) progress(c *Charge, n int, now time.Time) {
	u := c.up
	if c.FirstToken.IsZero() {
		c.FirstToken = now
		if !c.remote {
			// A peer's first token is known only as the gap between two
			// of its events, and comes with no estimate.
			u.lastTTFT, u.lastEstimate = now.Sub(c.Started), c.Estimate
		}
		u.queuedPrefill -= c.prefill
		c.prefill = 0
		if !c.remote {
			f.confirm(u, c)
		}
	}
	c.Tokens += n
	d := min(n, c.decode)
	u.queuedDecode -= d
	c.decode -= d
	// What is still to come is what the responses that went beyond this
	// length generated beyond it (a response past the mean is not about
	// to end, one still short of it may be one of the long), no more than
	// max_tokens leaves: looked up as the output enters each bucket of
	// lengths, or once it reaches what was expected. The lengths are
	// every model's. Not where the estimate is the configured one (fixed,
	// or max_tokens). (A peer's charge counts one sequence and no
	// max_tokens; both take the lengths every router learns.)
	if c.lengthBucket == configuredOutput {
		return
	}
	sequences := max(1, int(c.sequences))
	k := c.Tokens / sequences
	b := outputBucket(k)
	if c.decode > 0 && b == int(c.lengthBucket) {
		return
	}
	c.lengthBucket = uint8(b)
	if left, ok := f.outputs.remaining(k); ok {
		more := tokensOf(math.Round(left))
		if c.maxTokens > 0 {
			more = min(more, max(0, int(c.maxTokens)-k))
		}
		more = tokensOf(float64(more) * float64(sequences))
		u.queuedDecode += more - c.decode
		c.decode = more
	}
}

// configuredOutput in a Charge's lengthBucket says its expected output is
// the configured one (OutputFixed, OutputMaxTokens), which the lengths
// learned do not replace.
const configuredOutput = math.MaxUint8

// confirm notes c's first token on u, which says the engine prefilled
// c's whole prompt there: the blocks a failed request made the index
// forget since c's decision are held after all (some may be c's: the
// peers, which forgot them too, learn them again), and the requests
// still waiting for their first token there keep, should they fail, the
// blocks c's prompt shares with theirs. Caller holds f.mu.
func (f *Fleet) confirm(u *upstream, c *Charge) {
	if c.lost && !u.forgotten && len(c.chain) > 0 {
		f.index.Insert(u.id, c.chain)
		f.publish(Event{Kind: EventPrefilled, ID: c.id, Dial: u.dial, Hashes: c.chain, At: c.FirstToken})
	}
	unlist(&u.pending, c)
	for _, other := range u.pending {
		other.kept = max(other.kept, int32(sharedBlocks(other.chain, c.chain)))
	}
	if f.local == nil || u.forgotten || len(c.chain) == 0 {
		c.chain = nil
		return
	}
	// Its peers' failures there forget blocks too (see applyForgot).
	c.listed = int32(len(u.prefilled))
	u.prefilled = append(u.prefilled, c)
}

// sharedBlocks is how many leading blocks two prompts share. Block hashes
// are chained, so prompts that share a block share every one before it:
// the count is found by bisection.
func sharedBlocks(a, b []uint64) int {
	n := min(len(a), len(b))
	if n == 0 || a[0] != b[0] {
		return 0 // the common case at a busy upstream: another prompt
	}
	return sort.Search(n, func(i int) bool { return a[i] != b[i] })
}

// unlist takes c off list, an upstream's pending or prefilled list.
// Caller holds f.mu.
func unlist(list *[]*Charge, c *Charge) {
	l, i := *list, int(c.listed)
	if i < 0 || i >= len(l) || l[i] != c {
		return
	}
	last := len(l) - 1
	l[i] = l[last]
	l[i].listed = int32(i)
	l[last] = nil
	*list = l[:last]
	c.listed = -1
}

// learn feeds a completed response of model into its estimates. Caller
// holds f.mu.
func (f *Fleet) learn(model string, promptBytes int, u Usage) {
	m := f.model(model, true)
	// An output no model can generate is a wrong report: one would
	// hold the estimate there for many requests.
	if u.OutputTokens >= 0 && u.OutputTokens <= MaxTokens {
		m.output.add(float64(u.OutputTokens))
		f.outputs.add(u.OutputTokens)
	}
	m.learnPrompt(promptBytes, u.PromptTokens)
}

// Usage is what the engine reported of a completed response.
type Usage struct {
	// PromptTokens is the prompt as the engine counted it (usage
	// .prompt_tokens), 0 when not reported.
	PromptTokens int
	// OutputTokens is the output generated.
	OutputTokens int
}

// Progress records n more output tokens of c's response at now: the first
// one ends the prefill charge, each one lowers the decode charge.
func (f *Fleet) Progress(c *Charge, n int, now time.Time) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if c.up == nil || n <= 0 {
		return
	}
	f.progress(c, n, now)
	f.publish(Event{Kind: EventProgressed, ID: c.id, Tokens: c.Tokens})
}

// Complete ends c after a response of model with usage u, which the
// output and prompt-length estimates learn, and releases what c still
// holds. It reports whether c's upstream was forgotten (Forget) while c
// ran there: no loaded configuration names it, and its requests run out
// as a drain's do.
func (f *Fleet) Complete(c *Charge, model string, u Usage, now time.Time) (forgotten bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if c.up == nil {
		return false // completed or released already: learned once
	}
	forgotten = c.up.forgotten
	if n := int(c.sequences); n > 1 && u.OutputTokens > 0 {
		// Usage counts every sequence's output: each one's is the mean,
		// rounded, computed so that an absurd count cannot wrap and pass
		// learn's check as a small one.
		mean := u.OutputTokens / n
		if 2*(u.OutputTokens%n) >= n {
			mean++
		}
		u.OutputTokens = max(1, mean)
	}
	f.learn(model, int(c.promptBytes), u)
	c.up.completed++
	// Peers learn the mean as well (an older router would not divide).
	f.publish(Event{Kind: EventCompleted, ID: c.id, Model: model, Tokens: u.OutputTokens, PromptBytes: int(c.promptBytes), PromptTokens: u.PromptTokens})
	f.release(c, now)
	return forgotten
}

// Release returns what c still holds, for a response that failed or was
// abandoned (nothing is learned). Releasing twice does nothing.
func (f *Fleet) Release(c *Charge, now time.Time) {
	if c == nil {
		return
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.failed(c, now)
}

// Refused is Release for a request its upstream refused outright (it
// answered 404: it does not serve the model or adapter asked for). The
// adapter the decision presumed it would load there is not presumed
// resident any more, and for refusalMemory the upstream does not count
// as serving it (unless an adapter load for it passes the router there:
// AdapterLoading), so the adapter's next requests go to another engine
// rather than back there, which, its slots freed, would look the
// cheapest place to load it; where no list of the engine's models says
// what it serves, nothing else would tell.
func (f *Fleet) Refused(c *Charge, now time.Time) {
	if c == nil {
		return
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if u := c.up; u != nil && c.adapter != "" {
		u.adapters = slices.DeleteFunc(u.adapters, func(a string) bool { return a == c.adapter })
		u.refuseAdapter(c.adapter, now)
	}
	f.failed(c, now)
}

// refusalMemory is how long an engine's 404 for an adapter keeps the
// adapter's requests away from it: then one more may try it.
const refusalMemory = time.Minute

// maxRefusedAdapters bounds the refusals an upstream remembers.
const maxRefusedAdapters = 8

// refusedAdapter is an adapter an upstream's engine answered 404 for.
type refusedAdapter struct {
	name  string
	until time.Time
}

// refuseAdapter notes that u's engine answered 404 for adapter at now.
// Caller holds f.mu.
func (u *upstream) refuseAdapter(adapter string, now time.Time) {
	u.refusedAdapters = slices.DeleteFunc(u.refusedAdapters, func(r refusedAdapter) bool {
		return r.name == adapter || !now.Before(r.until)
	})
	if len(u.refusedAdapters) >= maxRefusedAdapters {
		u.refusedAdapters = slices.Delete(u.refusedAdapters, 0, 1) // the oldest
	}
	u.refusedAdapters = append(u.refusedAdapters, refusedAdapter{name: adapter, until: now.Add(refusalMemory)})
}

// refuses says u's engine answered 404 for adapter within refusalMemory
// of now. Caller holds f.mu.
func (u *upstream) refuses(adapter string, now time.Time) bool {
	for _, r := range u.refusedAdapters {
		if r.name == adapter && now.Before(r.until) {
			return true
		}
	}
	return false
}

// AdaptersHeld is how many adapters the router presumes dial's engine
// holds, in GPU slots or host memory (those sent there, most recent
// first, as far as it remembers them), 0 for an upstream it does not
// know.
func (f *Fleet) AdaptersHeld(dial string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	if u := f.upstreams[dial]; u != nil {
		return len(u.adapters)
	}
	return 0
}

// AdapterLoading notes that a request to load adapter (vLLM's
// /v1/load_lora_adapter) went to dial: an earlier 404 there for it says
// nothing any more, and the engine holds it in host memory (a load there
// costs no load from storage), noted as the least recently used of the
// adapters sent there.
func (f *Fleet) AdapterLoading(dial, adapter string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if u := f.upstreams[dial]; u != nil {
		u.refusedAdapters = slices.DeleteFunc(u.refusedAdapters, func(r refusedAdapter) bool { return r.name == adapter })
		u.restoreAdapter(adapter)
	}
}

// failed is Release; caller holds f.mu.
func (f *Fleet) failed(c *Charge, now time.Time) {
	if c.up != nil {
		// It failed before its first token: the engine most likely did
		// not prefill what the decision added to the index, and the
		// conversation's next turn must not be sent there as warm. Except
		// the blocks another request's prompt ran through there since (it
		// had its first token: see confirm), which the engine holds.
		if u, from := c.up, int(max(c.held, c.kept)); c.FirstToken.IsZero() && len(c.chain) > 0 && !u.forgotten {
			if from < len(c.chain) {
				f.forget(u, from, c.chain[from:])
			}
			// The peers learned its blocks from its routing, each index
			// from its own depth, which may be less than this one's: they
			// hear of it before its release, while they still know the
			// charge (see applyForgot).
			f.publish(Event{Kind: EventForgot, ID: c.id, Dial: u.dial, From: from, Hashes: c.chain})
		}
		f.publish(Event{Kind: EventReleased, ID: c.id})
	}
	f.release(c, now)
}

// forget makes u's index forget hashes, a failed request's blocks from
// position from of its chain on. The requests there still waiting
// for their first token whose prompts share some of them re-insert their
// chains at it (see confirm), and those that counted them as held at
// their decision no longer do: should they fail too, they forget them as
// their own, also at the peers that learned them again from their
// routing. Caller holds f.mu.
func (f *Fleet) forget(u *upstream, from int, hashes []uint64) {
	if len(hashes) == 0 {
		return
	}
	for _, c := range u.pending {
		// Chained hashes: a chain holds one of them only at its place,
		// and only when it shares block from, and so all before it.
		if from < len(c.chain) && c.chain[from] == hashes[0] {
			c.lost = true
			c.held = min(c.held, int32(from))
		}
	}
	f.index.Forget(u.id, hashes)
}

// release returns what c holds; caller holds f.mu.
func (f *Fleet) release(c *Charge, now time.Time) {
	u := c.up
	if u == nil {
		return
	}
	u.queuedPrefill -= c.prefill
	u.queuedDecode -= c.decode
	u.kvTokens -= c.kv
	u.inFlight--
	u.lastUsed = now
	if !c.remote && f.local != nil {
		delete(f.local, c.id)
	}
	if c.FirstToken.IsZero() {
		unlist(&u.pending, c)
	} else {
		unlist(&u.prefilled, c)
	}
	c.up, c.prefill, c.decode, c.kv, c.chain = nil, 0, 0, 0, nil
	if u.forgotten && u.inFlight == 0 && f.upstreams[u.dial] == u {
		f.remove(u)
	}
	f.readyHolds(u, now, !c.remote)
}
