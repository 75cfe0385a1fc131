package caddyllm

// The placeholders the handler and the policy set on each parsed
// request's replacer, for access logs (log_append) and headers. Every
// value is a count, a duration, a dial address or a fixed word: none
// carries prompt text.
//
//	{http.llm_affinity.model}           the requested model
//	{http.llm_affinity.prompt_tokens}   estimated prompt tokens
//	{http.llm_affinity.stream}          whether the response streams
//	{http.llm_affinity.upstream}        the chosen upstream's dial address
//	{http.llm_affinity.reason}          warm, cold, spill, adapter or shed
//	{http.llm_affinity.matched_tokens}  prompt tokens expected cached there
//	{http.llm_affinity.estimated_ttft}  the decision's TTFT estimate, seconds
//	{http.llm_affinity.attempt}         the routing attempt (2 and up: retries)
//	{http.llm_affinity.ttft}            observed time to first token, seconds
//	{http.llm_affinity.blocked_by}      what blocked a shed request
const placeholderPrefix = "http.llm_affinity."

// setPlaceholder sets one placeholder, when the request has a replacer.
func (st *requestState) setPlaceholder(name string, value any) {
	if st.repl != nil {
		st.repl.Set(placeholderPrefix+name, value)
	}
}

// setParsedPlaceholders sets what the handler knows from the body.
func (st *requestState) setParsedPlaceholders() {
	st.setPlaceholder("model", st.req.Model)
	st.setPlaceholder("prompt_tokens", st.req.PromptTokens)
	st.setPlaceholder("stream", st.req.Stream)
}

// setDecisionPlaceholders sets the last decision's; caller holds st.mu.
func (st *requestState) setDecisionPlaceholders(attempt int) {
	d := st.decision
	st.setPlaceholder("upstream", d.upstream)
	st.setPlaceholder("reason", d.reason)
	st.setPlaceholder("matched_tokens", d.matched)
	// The decision's prompt length: learned from the engines' usage once
	// they reported it, which may differ from the parse's estimate.
	st.setPlaceholder("prompt_tokens", d.prompt)
	st.setPlaceholder("estimated_ttft", d.estimate)
	st.setPlaceholder("attempt", attempt)
}

// setShedPlaceholders marks a request the policy gave up on; caller holds
// st.mu.
func (st *requestState) setShedPlaceholders(blockedBy string) {
	st.setPlaceholder("upstream", "")
	st.setPlaceholder("reason", "shed")
	st.setPlaceholder("blocked_by", blockedBy)
}
