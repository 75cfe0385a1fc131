package router

import (
	"cmp"
	"math"
	"slices"
	"time"

	"github.com/llmaffinity/caddy-llm-affinity/scorer"
	"github.com/llmaffinity/caddy-llm-affinity/scrape"
)

// Request is what the decision needs of a request.
type Request struct {
	// Hashes are the prompt's chained block hashes (package prefixindex).
	Hashes []uint64
	// BlockTokens is the number of tokens in one hashed block.
	BlockTokens int
	// PromptTokens is the prompt's (estimated) length in tokens.
	PromptTokens int
	// PromptBytes is the length of the text PromptTokens was estimated
	// from, 0 when it is exact (a prompt of token ids). Once the engines'
	// usage reports taught the model's bytes per token, the decision
	// estimates the prompt from it instead.
	PromptBytes int
	// LongestPromptTokens is, for a batch of prompts the engine runs as
	// a sequence each, the longest one's tokens (estimated as
	// PromptTokens is): what must fit in an upstream's KV. 0 for a single
	// prompt.
	LongestPromptTokens int
	// MaxTokens is the request's output limit, 0 when it sets none.
	MaxTokens int
	// Sequences is how many sequences the engine generates for the
	// request (a batch's prompts times n, the choices of each), 0 or 1
	// for one: each one's output is charged, and the output learned from
	// its usage, which counts them all, is their mean.
	Sequences int
	// MaxTokensCapped says the engine cuts MaxTokens to what its context
	// leaves after the prompt (vLLM does for the Responses API's
	// max_output_tokens) rather than refusing a request whose prompt and
	// MaxTokens exceed its context (as for chat and completions): it is
	// then no part of what the request surely needs.
	MaxTokensCapped bool
	// Model is the request's model field: a base model or an adapter.
	Model string
	// MaxWait is how long the request may still wait to start. An
	// upstream whose free KV is short of the request's needs is a
	// candidate when the KV it needs is expected to free within MaxWait
	// (the engine queues the request meanwhile, and the wait counts in
	// the estimate: scorer.KVWaitSeconds); 0 means the request must fit
	// now.
	MaxWait time.Duration
	// Home is the upstream that holds state only it can continue (the
	// stored response a Responses API request names: see
	// Fleet.ResponseHome). While it is a member, healthy, not draining
	// and serving the model asked for (its list says so, or says
	// nothing), it is the only candidate, tried before or not (when it is
	// full the request waits for it), unless nothing listens there
	// (Member.Down, Member.Unreached); otherwise the request is routed as
	// any other (and the engine it reaches answers for the state it
	// lacks).
	Home string
	// ReleasesBefore is Fleet.Releases read before the caller took its
	// view of the members (Caddy's availability), 0 when not read: a
	// release after it on a member the view showed full readies the
	// request's Hold at once, as a release after the decision does, since
	// the view may predate it.
	ReleasesBefore uint64
	// Charge, when not nil, is the caller's memory for the decision's
	// charge (Decision.Charge is then Charge): a caller that reuses one
	// request's memory for the next saves an allocation a request. A
	// charge still held there (not completed or released) is left alone,
	// and the decision's allocated.
	Charge *Charge
}

// Member is one upstream the request may go to, as the caller sees it now.
type Member struct {
	// Dial is the upstream's address, the key of its state.
	Dial string
	// Available is false when the upstream is down or full.
	Available bool
	// Healthy is the caller's health verdict, kept for the admin view.
	Healthy bool
	// Tried says an earlier attempt of this request went here: it is
	// avoided while any untried member is available.
	Tried bool
	// Unreached says an earlier attempt of this request found nothing
	// listening here (its connection refused: the engine is gone, or
	// restarting). It is no home: what it stored is gone with the
	// engine, and the request goes where an engine can answer for itself.
	Unreached bool
	// Draining upstreams take no new requests.
	Draining bool
	// Hardware is its profile; unset rates take the defaults.
	Hardware Hardware
	// Engine is what its engine last reported, nil when not scraped or
	// stale: then only the router's own accounting counts.
	Engine *scrape.Signals
	// Down says its engine's last scrape found nothing listening: it
	// does not run now a model it listed, nor can it be counted on to
	// serve one while its models are unknown. It is avoided while an
	// untried member that is not down is available, and is no home.
	Down bool
	// Models are the models its engine last listed (/v1/models), however
	// old, for a member whose Engine is stale; nil when never listed. A
	// stale scrape (an engine whose /metrics is slow or broken) stops the
	// engine's figures from counting, not the list of what it serves.
	Models []scrape.ModelInfo
	// Scraped says the caller reads the engine's signals, fresh or not
	// (implied by Engine): the KV capacity learned from them outlives a
	// stale scrape, and a caller that does not scrape uses the
	// configured capacity.
	Scraped bool
}

// Decision is the outcome of Decide.
type Decision struct {
	scorer.Decision
	// MatchedTokens is the prompt prefix the chosen upstream is expected
	// to hold in cache.
	MatchedTokens int
	// PromptTokens is the prompt length the decision used: the request's,
	// or its bytes over the model's learned bytes per token.
	PromptTokens int
	// Charge is the work charged to the chosen upstream, nil when none
	// was chosen; pass it to Progress, Complete or Release.
	Charge *Charge
	// releases counts the fleet's releases at the decision, so that a
	// Hold after it misses none; at is the decision's time.
	releases uint64
	at       time.Time
	// Unservable, when nothing was chosen, says no member serves the
	// request's model (every one lists its models, and none lists it):
	// waiting cannot help. NotRunning says the members that might serve
	// it (listing its model, or their models unknown) are all down,
	// nothing listening there (the whole fleet, it may be): a wait of a
	// few seconds is not likely to help either, but the model may exist
	// (an engine still starting).
	Unservable, NotRunning bool
	// ModelRequired says the request names no model while the members
	// serve more than one base model (by their lists): an engine serves
	// its own when none is named, so which model answers would depend on
	// the replica. The OpenAI API requires the model.
	ModelRequired bool
	// TooLong, when nothing was chosen, says the request surely needs
	// more KV than every member serving its model has, or more than the
	// model's context length there (each one's capacity or context length
	// known; see scorer.Request.LeastKVTokens): it can never run,
	// wherever it waits.
	TooLong bool
}

// Decisions counts the decisions made under the fleet's lock, every one
// of a request held at the gateway or looking again for its model
// included: what deciding has cost, as the lock serialises decisions.
func (f *Fleet) Decisions() uint64 { return f.decisions.Load() }

// Decide chooses where req goes among members, at now, and charges the
// choice: its uncached prompt as queued prefill, its expected output as
// queued decode and both as KV in use; its blocks join the chosen
// upstream's prefix index. rng breaks ties; explain, when non-nil, is
// filled in.
func (f *Fleet) Decide(now time.Time, req Request, members []Member, opts *Options, rng scorer.Rand, explain *scorer.Explanation) Decision {
	if req.Model == "" && severalBaseModels(members) {
		return Decision{Decision: scorer.Decision{Chosen: -1, Reason: scorer.Shed}, ModelRequired: true}
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.decisions.Add(1)
	if bt := req.BlockTokens; bt > 0 {
		// The first size is the one of most routers' every request.
		if own := f.ownBlockTokens.Load(); own == nil || (*own)[0] != bt && !slices.Contains(*own, bt) && len(*own) < maxOwnBlockTokens {
			f.noteBlockTokens(own, bt)
		}
	}
	sreq, cands, states := f.candidates(now, &req, members, opts, true)
	sd := chooseListedFirst(sreq, cands, members, opts, rng, explain)
	d := Decision{Decision: sd, PromptTokens: sreq.PromptTokens}
	if sd.Chosen < 0 {
		d.releases, d.at = f.releases.Load(), now
		d.Unservable = len(cands) > 0 && sd.Blocked == scorer.FilteredModel
		// Too long: larger than the KV of every upstream that may serve
		// the model, whatever else keeps each from taking it now (a drain,
		// Caddy's health checks, a full queue), none of which lasts.
		servers, tooSmall := 0, true
		serversDown := len(cands) > 0
		for i := range cands {
			c := &cands[i]
			byModel := scorer.Filter(sreq, c, opts.Scorer) == scorer.FilteredModel
			serversDown = serversDown && (byModel || members[i].Down || refused(&members[i]))
			d.Unservable = d.Unservable && byModel
			if !byModel {
				servers++
				tooSmall = tooSmall && (c.KVCapacityTokens > 0 && sreq.LeastKVTokens > c.KVCapacityTokens ||
					c.ContextTokens > 0 && sreq.LeastKVTokens > c.ContextTokens)
			}
		}
		d.TooLong = servers > 0 && tooSmall
		d.NotRunning = !d.Unservable && serversDown
		return d
	}
	u, cand := states[sd.Chosen], &cands[sd.Chosen]
	d.MatchedTokens = cand.MatchedTokens
	// Only the uncached prompt and the output need new KV blocks: the
	// matched prefix is in the engine's cache already, shared, and
	// charging it per request over-counts popular prefixes many times.
	uncached := sreq.PromptTokens - cand.MatchedTokens
	output := min(sreq.OutputKVTokens(), MaxTokens) // every sequence's
	c := f.charge(u, uncached, output, uncached+output, now, req.Charge)
	c.promptBytes, c.sequences = int32(min(max(0, req.PromptBytes), math.MaxInt32)), int32(sreq.Sequences)
	c.maxTokens = int32(min(max(0, req.MaxTokens), math.MaxInt32))
	if opts.OutputEstimate == OutputFixed || opts.OutputEstimate == OutputMaxTokens {
		c.lengthBucket = configuredOutput
	}
	f.nextID++
	c.id = f.nextID
	c.Estimate = sd.EstimatedTTFTSeconds
	if sreq.Adapter != "" {
		u.useAdapter(sreq.Adapter, opts.MaxLoras)
		c.adapter = sreq.Adapter
	}
	// The blocks beyond what the upstream held are the decision's own:
	// as Insert counts them, block by block (the match bisects, which a
	// failure's forget, leaving other chains' later blocks, can mislead).
	c.chain, c.held = req.Hashes, int32(f.index.Insert(u.id, req.Hashes))
	c.listed = int32(len(u.pending))
	u.pending = append(u.pending, c)
	if f.local != nil {
		f.local[c.id] = c
	}
	if f.publisher != nil { // publish checks too, but the event is built first
		f.publish(Event{
			Kind: EventRouted, ID: c.id, Dial: u.dial, Hashes: req.Hashes, BlockTokens: blockTokensOf(&req),
			Prefill: c.prefill, Decode: c.decode, KV: c.kv, Adapter: sreq.Adapter,
		})
	}
	d.Charge = c
	return d
}

// Fits reports whether req passes the decision's filters on m at now,
// without deciding: the check a release makes of each held request (see
// Hold), for callers that want it alone.
func (f *Fleet) Fits(now time.Time, req Request, m Member, opts *Options) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.fits(now, req, m, opts, true)
}

// servesNothing is the model list of a candidate known not to serve the
// model asked for: empty, not nil (nil is unknown).
var servesNothing = []string{}

// refused says an earlier attempt of this request found nothing listening
// at m: its connection was refused (Unreached), or it was tried while its
// last scrape found nothing listening (Caddy's own retries, lb_retries and
// lb_try_duration, do not tell the policy how an attempt failed).
func refused(m *Member) bool { return m.Unreached || m.Tried && m.Down }

// sequencesOf is how many sequences req generates, at least 1.
func sequencesOf(req *Request) int { return min(max(1, req.Sequences), scorer.MaxSequences) }

// blockTokensOf is req's block size, at least 1.
func blockTokensOf(req *Request) int { return max(1, req.BlockTokens) }

// candidates builds the scorer's view of req and of every member, in
// scratch space reused across decisions. observe says members are the
// caller's current view: their health, engine restarts and KV capacity
// are noted (and the index sized by it).
// Caller holds f.mu.
func (f *Fleet) candidates(now time.Time, req *Request, members []Member, opts *Options, observe bool) (scorer.Request, []scorer.Candidate, []*upstream) {
	bt := blockTokensOf(req)
	cands := slices.Grow(f.scratchCands[:0], len(members))[:len(members)]
	// states keeps the previous decision's upstreams until overwritten:
	// each is the hint for the member at its place.
	states := slices.Grow(f.scratchStates[:0], len(members))[:len(members)]
	f.scratchCands, f.scratchStates = cands, states
	// A member tried already is avoided while an untried one is
	// available; one whose engine was found not listening at its last
	// scrape (Down), while an untried listening one is (Caddy may still
	// count it healthy: it has no health checks of its own, or they have
	// not run yet). One an earlier attempt of this request found with
	// nothing listening (Unreached) is not tried again, its connection
	// refused a moment ago; nor are the Down ones once an attempt has
	// confirmed the scrapes' picture. With every member down the request
	// so makes one attempt (an engine may have started since its last
	// scrape) and then gets its 503 (Decision.NotRunning), rather than an
	// attempt at each and the proxy's 502.
	avoidTried, avoidDown, probed := false, false, false
	for i := range members {
		m := &members[i]
		states[i] = f.upstreamHinted(states[i], m.Dial, now)
		if observe {
			states[i].healthSeen, states[i].healthy = true, m.Healthy
			if m.Engine != nil {
				f.noteRestart(states[i], m.Engine.LastRestart)
			}
		}
		// A draining member is no alternative: it takes nothing new.
		open := m.Available && !m.Draining
		avoidTried = avoidTried || (open && !m.Tried)
		avoidDown = avoidDown || (open && !m.Tried && !m.Down)
		probed = probed || refused(m)
	}
	// Match after registering, so every upstream has a slot in depths.
	depths := f.index.Match(req.Hashes, f.scratchDepths)
	f.scratchDepths = depths
	adapter := opts.adapterOf(req.Model, members, states)
	// A learned bytes per token rescales the prompt and, alike, the
	// prefix each upstream holds (its blocks are runs of the same text).
	prompt, scale := f.promptTokens(req)
	sreq := scorer.Request{
		PromptTokens: prompt, Blocks: len(req.Hashes), BlockTokens: bt,
		OutputTokens: f.expectedOutput(req, opts), Sequences: sequencesOf(req), Model: req.Model, Adapter: adapter,
		MaxKVWaitSeconds: max(0, req.MaxWait.Seconds()),
		LeastKVTokens:    leastKVTokens(req, prompt),
		ContextTokens:    expectedContextTokens(req, prompt),
	}
	home := -1
	var loaders *adapterLoaders
	if adapter != "" && opts.Adapters[adapter] {
		loaders = &adapterLoaders{adapter: adapter, members: members}
	}
	for i := range members {
		m, u := &members[i], states[i]
		f.candidate(&cands[i], now, m, u, opts, adapter, bt, observe)
		if list := m.modelList(); list != nil { // none without scraping
			cands[i].ContextTokens = u.models(list).contextTokens(cmp.Or(adapter, req.Model))
		}
		if loaders != nil && loaders.mayLoad(cands[i].Models) {
			cands[i].Models = nil
		}
		if adapter != "" && len(u.refusedAdapters) > 0 && u.refuses(adapter, now) {
			cands[i].Models = servesNothing // its engine answered 404 for it
		}
		matched := depths[u.id] * bt
		if scale != 1 {
			matched = int(math.Round(float64(matched) * scale))
		}
		cands[i].MatchedTokens = min(matched, prompt)
		cands[i].Available = m.Available && !refused(m) && !(avoidTried && m.Tried) && !((avoidDown || probed) && m.Down)
		// A home that does not serve the model asked for cannot continue
		// the response either: routed as any other request, the request
		// gets the engine's 404 at once, where waiting for the home would
		// end in a shed 503 the client retries.
		if home < 0 && isHome(req, m) && scorer.ServesModel(&sreq, &cands[i]) {
			home = i
		}
	}
	if home >= 0 {
		for i := range cands {
			cands[i].Available = i == home && members[i].Available
		}
	}
	return sreq, cands, states
}

// adapterLoaders tells the engines that may load a configured adapter on
// its first request (vLLM's LoRA resolvers; kvsim's adapters on storage):
// those of its base model, which is its parent where a list names it.
type adapterLoaders struct {
	adapter   string
	members   []Member
	base      string
	baseKnown bool
}

// mayLoad says an engine whose list is models, known and lacking the
// adapter, may serve it, as one whose list is unknown may (those listing
// it come first). With no list naming it, any engine may while the lists
// name one base model.
func (l *adapterLoaders) mayLoad(models []string) bool {
	if models == nil || slices.Contains(models, l.adapter) {
		return false
	}
	if !l.baseKnown {
		l.base, l.baseKnown = adapterBase(l.adapter, l.members), true
	}
	if l.base != "" {
		return slices.Contains(models, l.base)
	}
	return !severalBaseModels(l.members)
}

// adapterBase is the base model some member's list names as adapter's
// parent, "" when none lists it.
func adapterBase(adapter string, members []Member) string {
	for i := range members {
		for _, m := range members[i].modelList() {
			if m.ID == adapter && m.Parent != "" {
				return m.Parent
			}
		}
	}
	return ""
}

// noteBlockTokens adds bt to own, the block sizes this router's requests
// were hashed with. Caller holds f.mu.
func (f *Fleet) noteBlockTokens(own *[]int, bt int) {
	sizes := []int{bt}
	if own != nil {
		sizes = append(slices.Clone(*own), bt)
	}
	f.ownBlockTokens.Store(&sizes)
}

// maxOwnBlockTokens bounds the block sizes Fleet.ownBlockTokens keeps.
const maxOwnBlockTokens = 8

// ForeignBlockTokens says a peer that routed with blocks of blockTokens
// tokens hashes its prompts unlike this router: it has routed requests,
// none with blocks of that size. Such peers' prefixes never match this
// router's (a prefix's hashes depend on its block size), so affinity
// across them is lost, silently but for this.
//
// A router of several sites with different block_tokens knows a size only
// once a request was routed with it: till then a peer of that size is
// warned of too.
func (f *Fleet) ForeignBlockTokens(blockTokens int) bool {
	own := f.ownBlockTokens.Load()
	return blockTokens > 0 && own != nil && !slices.Contains(*own, blockTokens)
}

// OwnBlockTokens returns the block sizes this router's requests were
// hashed with.
func (f *Fleet) OwnBlockTokens() []int {
	if own := f.ownBlockTokens.Load(); own != nil {
		return slices.Clone(*own)
	}
	return nil
}

// chooseListedFirst is scorer.Choose, first among the candidates whose
// model lists name the model asked for, when one of them is running and
// available and some other candidate's list is unknown (not fetched yet,
// or stale): such a one may not serve the model, and would answer 404.
// When none of the listing ones can take the request (whole: not only cut
// at its context), all are considered, as Choose alone does, so the
// request waits (is held) only when no candidate at all can take it.
func chooseListedFirst(sreq scorer.Request, cands []scorer.Candidate, members []Member, opts *Options, rng scorer.Rand, explain *scorer.Explanation) scorer.Decision {
	want := cmp.Or(sreq.Adapter, sreq.Model)
	// Every decision comes here: the lists are searched only when some
	// are known and some not.
	unknown, listed := false, false
	for i := 0; !unknown && i < len(cands); i++ {
		unknown = cands[i].Models == nil
	}
	for i := 0; unknown && want != "" && !listed && i < len(cands); i++ {
		listed = cands[i].Available && !members[i].Down && slices.Contains(cands[i].Models, want)
	}
	if !listed {
		return scorer.Choose(sreq, cands, opts.Scorer, rng, explain)
	}
	var buf [16]int
	hidden := buf[:0]
	for i := range cands {
		if cands[i].Models == nil && cands[i].Available {
			cands[i].Available = false
			hidden = append(hidden, i)
		}
	}
	sd := scorer.Choose(sreq, cands, opts.Scorer, rng, explain)
	for _, i := range hidden {
		cands[i].Available = true
	}
	if sd.Chosen >= 0 && !sd.CutAtContext {
		if explain != nil {
			// They were not filtered out, only left for later.
			explain.Filtered = slices.DeleteFunc(explain.Filtered, func(e scorer.Excluded) bool { return slices.Contains(hidden, e.Index) })
		}
		return sd
	}
	if explain != nil {
		explain.Top, explain.Filtered = explain.Top[:0], explain.Filtered[:0]
	}
	return scorer.Choose(sreq, cands, opts.Scorer, rng, explain)
}

// severalBaseModels says members' model lists name more than one base
// model: by root, as names of one model (vLLM's --served-model-name
// gives it several) share it.
func severalBaseModels(members []Member) bool {
	first := ""
	for i := range members {
		for _, m := range members[i].modelList() {
			root := cmp.Or(m.Root, m.ID)
			switch {
			case m.Parent != "":
			case first == "":
				first = root
			case root != first:
				return true
			}
		}
	}
	return false
}

// modelList is the models m's engine last listed: with its fresh signals,
// or alone (Models); nil when unknown.
func (m *Member) modelList() []scrape.ModelInfo {
	if m.Engine != nil {
		return m.Engine.Models
	}
	return m.Models
}

// isHome says m is req's home and can take it: healthy (a full upstream
// is waited for), not draining, and not found with nothing listening (by
// its last scrape, or by an earlier attempt): a home whose engine crashed
// holds the response no more (engines keep stored responses in memory),
// and retrying only it would end in the proxy's 502 where another engine
// answers 404 at once. A connection closed before an answer is not that:
// the engine may be alive (a kept-alive connection it had closed).
func isHome(req *Request, m *Member) bool {
	return req.Home != "" && m.Dial == req.Home && m.Healthy && !m.Draining && !m.Down && !m.Unreached
}

// leastKVTokens is the KV req surely takes (scorer.Request.LeastKVTokens),
// its prompt counted as prompt tokens. A prompt of text surely has at
// least a token for every maxBytesPerToken bytes of it, and no count
// nearer can be sure: a tokenizer's bytes per token depend on the text
// more than on the traffic (with tiktoken's cl100k_base, which Llama 3's
// tokenizer extends, measured: about 3 for CJK text, 3.6–4.8 for prose
// and code, 5.6 for JSON indented by four spaces, 7.6 by eight). Anything
// nearer its limit goes to the engine, which counts exactly and answers
// 400 at once if it is too long. It is at least 1, the first output
// token's: 0 would say the request does not tell (scorer.Request), and a
// short prompt without max_tokens whose expected output exceeds every
// replica's KV would wait for KV that never frees, where a longer one
// runs cut at its context.
func leastKVTokens(req *Request, prompt int) int {
	least := prompt
	if req.PromptBytes > 0 {
		least = min(prompt, req.PromptBytes/maxBytesPerToken)
	}
	if req.LongestPromptTokens > 0 && req.PromptTokens > 0 {
		// A batch: only its longest prompt must fit at once.
		least = int(float64(least) * min(1, float64(req.LongestPromptTokens)/float64(req.PromptTokens)))
	}
	if req.MaxTokensCapped {
		return max(1, least)
	}
	return max(1, least+min(max(0, req.MaxTokens), MaxTokens))
}

// expectedContextTokens is the context req is expected to take
// (scorer.Request.ContextTokens): its prompt as estimated, its longest
// prompt for a batch, and its max_tokens, which the engine checks
// against the model's context length (but for the Responses API, whose
// max_output_tokens vLLM cuts to what the context leaves).
func expectedContextTokens(req *Request, prompt int) int {
	if req.LongestPromptTokens > 0 && req.PromptTokens > 0 {
		prompt = int(float64(prompt) * min(1, float64(req.LongestPromptTokens)/float64(req.PromptTokens)))
	}
	if req.MaxTokensCapped {
		return prompt
	}
	return prompt + min(max(0, req.MaxTokens), MaxTokens)
}

// EngineRestarted is told by a scraper that dial's engine restarted at
// at (see noteRestart), as soon as it saw it.
func (f *Fleet) EngineRestarted(dial string, at time.Time) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if u := f.upstreams[dial]; u != nil {
		f.noteRestart(u, at)
	}
}

// noteRestart takes the time a scraper last saw u's engine restart: a
// restarted engine holds none of the prefixes the index says, so they are
// forgotten, as the scraper tells (EngineRestarted) or before a request
// is matched. A reload's new scraper inherits the old one's time, so the
// two report one restart once; scrapers of two sites see the same restart
// at two times, a scrape apart, and each time forgets (what was routed
// between the two too). An index with nothing in it has nothing to
// forget: an engine that was not listening yet when the router started
// is no reset. What this router's requests there held went with the
// cache: the ones in flight past their first token protect nothing from
// a peer's failure (see applyForgot), and the ones still waiting for it
// hold nothing from the index, and insert their chains again at it. Caller
// holds f.mu.
func (f *Fleet) noteRestart(u *upstream, at time.Time) {
	if !at.After(u.engineRestart) {
		return
	}
	u.engineRestart = at
	if f.index.Blocks(u.id) > 0 {
		f.index.Clear(u.id)
		u.indexResets++
	}
	for _, c := range u.prefilled {
		c.chain, c.listed = nil, -1
	}
	clear(u.prefilled)
	u.prefilled = u.prefilled[:0]
	for _, c := range u.pending {
		c.held, c.kept, c.lost = 0, 0, true
	}
	// Nor any adapter, in a GPU slot or in host memory: each is loaded
	// anew, and its slots are free.
	u.adapters = u.adapters[:0]
}

// candidate describes member m to the scorer in c (filled in place: a
// Candidate is large, and a decision makes one per member) at the
// decision's time at.
// Caller holds f.mu.
//
// Without engine signals it uses what the router itself knows: the work
// it charged there and the configured hardware. With them:
//   - KV capacity is the engine's, and free KV the smaller of what the
//     engine reports (plus what the router charged since the scrape) and
//     what the router's own charges leave;
//   - requests the engine has that the router did not send (another
//     router, direct clients) add to the queue, at the mean prompt and
//     output lengths the router has seen;
//   - the model list filters models, and the engine's running adapters say
//     which adapters are resident.
func (f *Fleet) candidate(c *scorer.Candidate, at time.Time, m *Member, u *upstream, opts *Options, adapter string, blockTokens int, observe bool) {
	hw := m.Hardware.WithDefaults()
	*c = scorer.Candidate{
		Name:                   m.Dial,
		Draining:               m.Draining,
		QueuedPrefillTokens:    max(0, u.queuedPrefill),
		QueuedDecodeTokens:     max(0, u.queuedDecode),
		InFlight:               u.inFlight,
		Waiting:                -1,
		PrefillTokensPerSecond: hw.PrefillTokensPerSecond,
		DecodeTokensPerSecond:  hw.DecodeTokensPerSecond,
		FreeKVTokens:           -1,
		UncachedRoomTokens:     -1,
		KVCapacityTokens:       hw.KVCapacityTokens,
		Adapter:                scorer.AdapterResident,
	}
	engineFree := -1 // the engine's free KV, with what was routed since its scrape
	if raw := m.Engine; raw != nil {
		requests, kv := u.charged.Since(raw.Mark)
		now := raw.PlusRouted(requests, kv)
		engineFree = now.FreeKVTokens()
		if capacity := now.KVCapacityTokens(); capacity > 0 && observe {
			u.engineCapacityTokens = capacity
		}
		c.Waiting = now.Waiting
		if raw.MaxLoRAs > 0 && observe {
			u.engineMaxLoras = min(raw.MaxLoRAs, maxEngineAdapterSlots)
		}
		c.Models = u.models(now.Models).ids
		// Foreign requests: what the engine had at the scrape beyond what
		// the router had in flight there at that moment. The requests it
		// routed there while the scrape was under way count as its own:
		// an engine that renders its gauges as it answers (kvsim does)
		// has them, and taken for foreign they would weigh twice, until
		// the next scrape, on the upstream a burst was going to. (One
		// that renders them from its last step, as vLLM, may not: the
		// foreign load is then under-counted by as many, for one scrape
		// interval; the window is one scrape's latency.)
		if raw.Running >= 0 && raw.Waiting >= 0 {
			during, _ := raw.MarkAfter.Since(raw.Mark) // 0 without a second mark
			if foreign := raw.Running + raw.Waiting - raw.Mark.InFlight - during; foreign > 0 {
				c.ForeignInFlight = foreign // they share the engine's steps too
				c.QueuedPrefillTokens += tokensOf(float64(min(foreign, raw.Waiting)) * f.meanPrompt.value)
				c.QueuedDecodeTokens += tokensOf(float64(foreign) * f.meanOutputAnyModel(opts))
			}
		}
	}
	if m.Engine == nil && m.Models != nil {
		c.Models = u.models(m.Models).ids
	}
	// The engine's own figure, also while a scrape is stale: falling
	// back to the configured one would shrink the index and evict what
	// the engine still holds.
	// A caller that does not scrape (a config reloaded without it, or
	// another site) uses its own figure.
	fromEngine := u.engineCapacityTokens > 0 && (m.Scraped || m.Engine != nil)
	if fromEngine {
		c.KVCapacityTokens = u.engineCapacityTokens
	}
	if c.KVCapacityTokens > 0 {
		// Sites that configure different capacities for one upstream
		// (without the engine's own figure) must not shrink the index
		// in turn: it keeps the largest, while a decision has used it
		// within capacityMemory. One not used for that long (a reload
		// lowered it) gives way to the figure in use.
		index := c.KVCapacityTokens
		if !fromEngine {
			switch {
			case index >= u.capacityTokens, at.Sub(u.capacitySeen) > capacityMemory:
				if observe {
					u.capacitySeen = at
				}
			default:
				index = u.capacityTokens
			}
		}
		if observe {
			if index == c.KVCapacityTokens {
				u.capacityFromPeer = false
			}
			f.sizeIndex(u, index, blockTokens, at)
		}
		c.FreeKVTokens = max(0, c.KVCapacityTokens-u.kvTokens)
		c.UncachedRoomTokens = max(0, f.index.Capacity(u.id)-f.index.Blocks(u.id)) * u.indexBlockTokens
		c.KVOvercommitTokens = max(0, u.kvTokens-c.KVCapacityTokens)
		if engineFree >= 0 {
			c.FreeKVTokens = min(c.FreeKVTokens, engineFree)
		}
	}
	if adapter != "" {
		c.Adapter, c.AdapterLoadSeconds, c.AdapterEvictedSeconds = opts.adapterCost(adapter, u, m)
	}
}

// capacityMemory is how long an upstream's index keeps the largest
// configured KV capacity after the last decision that used it.
const capacityMemory = time.Minute

// Configure gives dial the KV capacity the loaded configurations give it
// (the largest of theirs, 0 for none) at once, where a decision would
// size its index only when it next routes, and keep a larger figure for
// capacityMemory (it cannot tell a reload that lowered it from another
// site's smaller figure). When scraped, the engine's own figure wins once
// known, as in decisions. The caller calls it when the loaded
// configurations change: a reload shows in the index, and the admin view,
// as soon as it is done.
func (f *Fleet) Configure(dial string, capacityTokens int, scraped bool, now time.Time) {
	f.mu.Lock()
	defer f.mu.Unlock()
	u := f.upstreams[dial]
	if u == nil || u.forgotten {
		return
	}
	if scraped && u.engineCapacityTokens > 0 {
		capacityTokens = u.engineCapacityTokens
	}
	if capacityTokens <= 0 {
		if u.capacityTokens > 0 && !u.capacityFromPeer {
			// The figure the index was sized by is gone (a reload removed
			// kv_capacity, or the scraping that read the engine's): the
			// capacity is unknown again, to decisions and in the admin
			// view, and the index takes its default size, as at a fresh
			// start with this config.
			u.capacityTokens, u.capacitySeen = 0, time.Time{}
			f.index.SetCapacity(u.id, 0)
		}
		return // unknown: decisions size nothing either
	}
	u.capacitySeen, u.capacityFromPeer = now, false
	if u.indexBlockTokens == 0 {
		// No request hashed for it yet: the first decision sizes the
		// index, in its blocks.
		u.capacityTokens = capacityTokens
		return
	}
	f.sizeIndex(u, capacityTokens, u.indexBlockTokens, time.Time{})
}

// sizeIndex gives u's prefix index the capacity of its KV cache, when that
// changed or a smaller block size appeared: requests hashed with blocks of
// blockTokens used it at (zero when none did: a reload's figure). A
// smaller block size stays while a request used it within capacityMemory,
// so that sites (or routers) hashing with different sizes never shrink
// each other's share; one unused for longer gives way, so that a
// router's brief reload to smaller blocks does not leave every router
// modelling the engine's cache as twice its size until it restarts.
// Caller holds f.mu.
func (f *Fleet) sizeIndex(u *upstream, capacityTokens, blockTokens int, at time.Time) {
	switch {
	case at.IsZero(): // a reload's figure, in the blocks in use
	case u.indexBlockTokens > 0 && blockTokens > u.indexBlockTokens && at.Sub(u.blockSeen) <= capacityMemory:
		blockTokens = u.indexBlockTokens // the smaller, used lately, stays
	default:
		u.blockSeen = at
	}
	if u.capacityTokens == capacityTokens && u.indexBlockTokens == blockTokens {
		return
	}
	u.capacityTokens, u.indexBlockTokens = capacityTokens, blockTokens
	f.index.SetCapacity(u.id, max(1, capacityTokens/max(1, blockTokens)))
}

// adapterOf returns model when it names a LoRA adapter: listed in
// Adapters, or listed with a parent in some member's /v1/models (states
// are the members' upstreams). Caller holds f.mu.
func (o *Options) adapterOf(model string, members []Member, states []*upstream) string {
	if model == "" {
		return ""
	}
	if o.Adapters[model] {
		return model
	}
	for i := range members {
		list := members[i].modelList()
		if list == nil {
			continue
		}
		if m := states[i].models(list).find(model); m != nil && m.Parent != "" {
			return model
		}
	}
	return ""
}

// adapterCost says where u has adapter and what making it resident costs.
// Resident: a running request uses it on the engine, or it is among the
// last adapters the router sent there, as many as the engine has GPU
// slots (vLLM keeps recently used adapters in them): the count the engine
// reports (vLLM's lora_requests_info max_lora, its --max-loras), which
// outlives a stale scrape as its KV capacity does, else MaxLoras. m may be
// nil: no engine signals. Host: the router sent it there earlier, so
// the engine likely holds it in host memory. Otherwise it must be fetched
// from storage: being listed in /v1/models does not mean it was ever
// loaded. The cost is finite, so a busy replica holding the adapter loses
// to an idle one once its queue outweighs the load, and the second
// replica then holds it too: adapters replicate as far as the load needs.
//
// evicted is what a load there costs the adapter it pushes out: when
// every slot holds another adapter, the engine evicts the least recently
// used one (vLLM's LRU of max_loras slots), and that adapter's next
// request there reloads it from host memory. A free slot evicts nothing.
func (o *Options) adapterCost(adapter string, u *upstream, m *Member) (state scorer.AdapterState, load, evicted float64) {
	var engine *scrape.Signals
	slots := o.MaxLoras
	if m != nil {
		engine = m.Engine
		if u.engineMaxLoras > 0 && (m.Scraped || engine != nil) {
			slots = u.engineMaxLoras
		}
	}
	known := engine != nil && engine.AdaptersKnown
	running := known && slices.Contains(engine.RunningAdapters, adapter)
	i := slices.Index(u.adapters, adapter)
	if running || (i >= 0 && i < slots) {
		return scorer.AdapterResident, 0, 0
	}
	// The slots hold the adapters last sent here, and those running there
	// that this router did not send (another router's, a client's).
	sent := u.adapters[:min(len(u.adapters), slots)]
	held := len(sent)
	if known {
		for _, a := range engine.RunningAdapters {
			if !slices.Contains(sent, a) {
				held++
			}
		}
	}
	if held >= slots {
		evicted = o.AdapterLoadHost.Seconds()
	}
	if i >= 0 {
		return scorer.AdapterHost, o.AdapterLoadHost.Seconds(), evicted
	}
	return scorer.AdapterRemote, o.AdapterLoadRemote.Seconds(), evicted
}

// useAdapter records that adapter was charged to u by a decision whose
// MaxLoras is maxLoras (0 for a peer's charge). Caller holds f.mu.
func (u *upstream) useAdapter(adapter string, maxLoras int) {
	if maxLoras > 0 {
		u.configuredMaxLoras = maxLoras
	}
	u.adapters = slices.DeleteFunc(u.adapters, func(a string) bool { return a == adapter })
	u.adapters = slices.Insert(u.adapters, 0, adapter)
	if limit := u.rememberedAdapters(); len(u.adapters) > limit {
		u.adapters = u.adapters[:limit]
	}
}

// rememberedAdapters is how many adapters u's list keeps: those presumed
// in host memory, and at least as many as its engine has GPU slots (as it
// reports them, or as max_loras says), so that every slot can count as
// resident.
func (u *upstream) rememberedAdapters() int {
	return max(maxRememberedAdapters, min(max(u.engineMaxLoras, u.configuredMaxLoras), maxEngineAdapterSlots))
}

// restoreAdapter notes, from a peer's snapshot, that adapter was charged
// here: less recently than every adapter this router charged here itself.
func (u *upstream) restoreAdapter(adapter string) {
	if adapter == "" || slices.Contains(u.adapters, adapter) || len(u.adapters) >= u.rememberedAdapters() {
		return
	}
	u.adapters = append(u.adapters, adapter)
}

// expectedOutput estimates req's output length. Caller holds f.mu.
func (f *Fleet) expectedOutput(req *Request, opts *Options) int {
	est := opts.OutputTokens
	switch opts.OutputEstimate {
	case OutputFixed:
	case OutputMaxTokens:
		if req.MaxTokens > 0 {
			est = req.MaxTokens
		}
	default:
		if m := f.model(req.Model, false); m != nil && m.output.n > 0 {
			est = int(math.Round(m.output.value))
		}
		if req.MaxTokens > 0 {
			est = min(est, req.MaxTokens)
		}
	}
	return min(est, MaxTokens)
}

// MaxTokens bounds every token count the fleet takes from outside (a
// request's max_tokens, an engine's usage or queue, a peer's charge): far
// beyond any model's context, and small enough that sums of such counts
// cannot overflow. A client or an engine reporting more is wrong, and
// must not make the accounting wrap around.
const MaxTokens = 1 << 30

// tokensOf converts a token estimate to a count within 0..MaxTokens.
func tokensOf(v float64) int {
	if math.IsNaN(v) {
		return 0
	}
	return int(min(MaxTokens, max(0, v)))
}

// meanOutputAnyModel is the expected output of a request of unknown model,
// for sizing foreign load: the mean of the models' learned means. Caller
// holds f.mu.
func (f *Fleet) meanOutputAnyModel(opts *Options) float64 {
	var sum float64
	var n int
	for _, m := range f.models {
		if m.output.n > 0 {
			sum += m.output.value
			n++
		}
	}
	if n == 0 {
		return float64(opts.OutputTokens)
	}
	return sum / float64(n)
}
