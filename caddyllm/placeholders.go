package caddyllm

import (
	"slices"
	"strings"
	"sync"

	"github.com/caddyserver/caddy/v2"
)

// The placeholders of each parsed request, for access logs (log_append)
// and headers; a request passed through has some of them (see
// passThrough.placeholder). Every value is a count, a duration, a dial
// address, the model or a fixed word: none carries prompt text.
//
//	{http.llm_affinity.model}           the requested model
//	{http.llm_affinity.prompt_tokens}   prompt tokens: the parse's estimate, then the decision's
//	{http.llm_affinity.stream}          whether the response streams
//	{http.llm_affinity.upstream}        the chosen upstream's dial address
//	{http.llm_affinity.reason}          warm, cold, spill, adapter, fallback, shed or refused
//	{http.llm_affinity.matched_tokens}  prompt tokens expected cached there
//	{http.llm_affinity.estimated_ttft}  the decision's TTFT estimate, seconds
//	{http.llm_affinity.attempt}         the routing attempt (2 and up: retries)
//	{http.llm_affinity.ttft}            observed time to first token, seconds
//	{http.llm_affinity.blocked_by}      what blocked a shed or refused request
const placeholderPrefix = "http.llm_affinity."

// placeholderValues are what the placeholders report. They are kept as
// plain values and answered by a replacer provider when a log or header
// asks: setting them on every decision costs no allocation, where the
// replacer's Set would box each one.
type placeholderValues struct {
	mu           sync.Mutex
	model        string
	promptTokens int
	stream       bool
	// decided says upstream, reason, matched, estimate and attempt hold a
	// decision; shed that it gave up (blockedBy says why).
	decided, shed bool
	upstream      string
	reason        string
	matched       int
	estimate      float64
	attempt       int
	blockedBy     string
	// ttft is the observed time to first token in seconds, when hasTTFT.
	ttft    float64
	hasTTFT bool
}

// placeholder is the request's replacer provider for
// {http.llm_affinity.*}. A placeholder without a value (no decision yet,
// no first token) is known and nil: an access log field is null and a
// header empty, never the placeholder's own text. The values live apart
// from the request's state: an access log reads them after the handler
// returned, when the state may serve another request (see statePool).
func (v *placeholderValues) placeholder(key string) (any, bool) {
	name, ok := strings.CutPrefix(key, placeholderPrefix)
	if !ok {
		return nil, false
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	var val any
	var set bool
	switch name {
	case "model":
		val, set = v.model, true
	case "prompt_tokens":
		val, set = v.promptTokens, true
	case "stream":
		val, set = v.stream, true
	case "upstream":
		val, set = v.upstream, v.decided || v.shed
	case "reason":
		val, set = v.reason, v.decided || v.shed
	case "matched_tokens":
		val, set = v.matched, v.decided
	case "estimated_ttft":
		val, set = v.estimate, v.decided
	case "attempt":
		val, set = v.attempt, v.decided
	case "blocked_by":
		val, set = v.blockedBy, v.shed
	case "ttft":
		val, set = v.ttft, v.hasTTFT
	default:
		return nil, false
	}
	if !set {
		return nil, true
	}
	return val, true
}

// placeholderNames are the names after placeholderPrefix.
var placeholderNames = [...]string{"model", "prompt_tokens", "stream", "upstream", "reason",
	"matched_tokens", "estimated_ttft", "attempt", "blocked_by", "ttft"}

// noPlaceholders is the replacer provider for requests the handler
// answers itself without routing them (bodies it cannot read or parse):
// every {http.llm_affinity.*} is known and nil.
func noPlaceholders(key string) (any, bool) {
	name, ok := strings.CutPrefix(key, placeholderPrefix)
	return nil, ok && slices.Contains(placeholderNames[:], name)
}

// mapPlaceholders makes pt the request's provider of
// {http.llm_affinity.*}, when it has a replacer.
func (pt *passThrough) mapPlaceholders(repl *caddy.Replacer) {
	if repl != nil {
		repl.Map(pt.placeholder)
	}
}

// placeholder is the replacer provider of a request passed through. It
// reports what the router knows of it, which is no prompt: the body's
// model, when the handler read one, and the policy's last choice (reason
// fallback, as decisions_total counts it, with its upstream and attempt)
// or its refusal (reason refused, blocked_by model, as a routed request's
// 404 model_not_found), so that an access log counts what the metrics
// count. The rest (prompt_tokens, stream, matched_tokens, estimated_ttft,
// ttft) is the prompt's and nil, as is all of it before the policy chose.
func (pt *passThrough) placeholder(key string) (any, bool) {
	name, ok := strings.CutPrefix(key, placeholderPrefix)
	if !ok {
		return nil, false
	}
	pt.mu.Lock()
	model, refusedBy, chose := pt.model, pt.refusedBy, pt.attempts > 0
	refused := refusedBy != ""
	attempt, upstream := pt.attempts, pt.lastDial
	pt.mu.Unlock()
	switch name {
	case "model":
		if model != "" {
			return model, true
		}
	case "reason":
		if refused {
			return refusedReason, true
		}
		if chose {
			return fallbackReason, true
		}
	case "blocked_by":
		if refused {
			return refusedBy, true // as the routed refusal's
		}
	case "upstream":
		if refused {
			return "", true // an earlier attempt's, if any, did not answer
		}
		if chose {
			return upstream, true
		}
	case "attempt":
		if chose && !refused {
			return attempt, true
		}
	default:
		return noPlaceholders(key)
	}
	return nil, true
}

// setParsedPlaceholders records what the handler knows from the body.
func (st *requestState) setParsedPlaceholders() {
	v := st.ph
	if v == nil {
		return
	}
	v.mu.Lock()
	v.model, v.promptTokens, v.stream = st.req.Model, st.req.PromptTokens, st.req.Stream
	v.mu.Unlock()
}

// setDecisionPlaceholders records the last decision's; caller holds st.mu.
func (st *requestState) setDecisionPlaceholders(attempt int) {
	d := &st.decision
	v := st.ph
	if v == nil {
		return
	}
	v.mu.Lock()
	v.decided, v.upstream, v.reason, v.matched, v.estimate, v.attempt = true, d.upstream, d.reason, d.matched, d.estimate, attempt
	// The decision's prompt length: learned from the engines' usage once
	// they reported it, which may differ from the parse's estimate.
	if d.prompt > 0 {
		v.promptTokens = d.prompt
	}
	v.mu.Unlock()
}

// setShedPlaceholders marks a request the policy gave up on, with the
// prompt length its answer used (0: keep the one recorded); caller holds
// st.mu.
func (st *requestState) setShedPlaceholders(reason, blockedBy string, prompt int) {
	v := st.ph
	if v == nil {
		return
	}
	v.mu.Lock()
	v.shed, v.decided, v.upstream, v.reason, v.blockedBy = true, false, "", reason, blockedBy
	if prompt > 0 {
		v.promptTokens = prompt
	}
	v.mu.Unlock()
}

// setTTFTPlaceholder records the observed time to first token.
func (st *requestState) setTTFTPlaceholder(seconds float64) {
	v := st.ph
	if v == nil {
		return
	}
	v.mu.Lock()
	v.ttft, v.hasTTFT = seconds, true
	v.mu.Unlock()
}
