package kvsim

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"slices"
)

// TokenizeRequest is a POST /tokenize body, parsed: vLLM's
// TokenizeCompletionRequest ({model?, prompt, add_special_tokens?,
// return_token_strs?}) or TokenizeChatRequest ({model?, messages,
// add_generation_prompt?, continue_final_message?, add_special_tokens?,
// tools?, return_token_strs?}; vllm/entrypoints/serve/tokenize/protocol.py).
type TokenizeRequest struct {
	// Model is the requested model: a served name, an adapter, or empty
	// (the base model).
	Model string
	// Chat says the body is the chat form: Messages, rendered with Tools
	// and the template options as a chat completion renders them.
	Chat                 bool
	Prompt               string
	Messages             []ChatMessage
	Tools                json.RawMessage
	AddGenerationPrompt  bool
	ContinueFinalMessage bool
	// ReturnTokenStrs asks for each token's string as well.
	ReturnTokenStrs bool
}

// tokenizeBody is the JSON of both forms, each field kept raw until the
// form is known; other fields are ignored, as vLLM's request models
// ignore extra fields.
type tokenizeBody struct {
	Model                string          `json:"model"`
	Prompt               json.RawMessage `json:"prompt"`
	Messages             json.RawMessage `json:"messages"`
	Tools                json.RawMessage `json:"tools"`
	AddGenerationPrompt  json.RawMessage `json:"add_generation_prompt"`
	ContinueFinalMessage json.RawMessage `json:"continue_final_message"`
	AddSpecialTokens     json.RawMessage `json:"add_special_tokens"`
	ReturnTokenStrs      json.RawMessage `json:"return_token_strs"`
	// The chat form's fields kvsim does not model (its template is its
	// own), counted only to choose the form as pydantic does.
	ChatTemplate       json.RawMessage `json:"chat_template"`
	ChatTemplateKwargs json.RawMessage `json:"chat_template_kwargs"`
	MediaIOKwargs      json.RawMessage `json:"media_io_kwargs"`
	MMProcessorKwargs  json.RawMessage `json:"mm_processor_kwargs"`
}

var errFieldRequired = errors.New("Field required")

// decodeField reads a present field into dst, naming it in the error.
func decodeField(raw json.RawMessage, dst any, name string) error {
	if raw == nil {
		return nil
	}
	if err := json.Unmarshal(raw, dst); err != nil {
		return fmt.Errorf("%s: %v", name, err)
	}
	return nil
}

// completionForm reads b as a TokenizeCompletionRequest.
func (b *tokenizeBody) completionForm() (TokenizeRequest, error) {
	r := TokenizeRequest{Model: b.Model}
	if b.Prompt == nil {
		return r, fmt.Errorf("prompt: %w", errFieldRequired)
	}
	// str: pydantic's lax mode takes no number or list for it.
	if b.Prompt[0] != '"' {
		return r, errors.New("prompt: Input should be a valid string")
	}
	if err := decodeField(b.Prompt, &r.Prompt, "prompt"); err != nil {
		return r, err
	}
	var err error
	r.ReturnTokenStrs, err = b.options()
	return r, err
}

// options reads the fields both forms have, after each form's own (as
// pydantic reports the first field that fails, in the model's order):
// add_special_tokens, checked and unused (see Text), and
// return_token_strs.
func (b *tokenizeBody) options() (returnTokenStrs bool, err error) {
	var special strictBool
	if err := decodeField(b.AddSpecialTokens, &special, "add_special_tokens"); err != nil {
		return false, err
	}
	var strs laxBool
	err = decodeField(b.ReturnTokenStrs, &strs, "return_token_strs")
	return bool(strs), err
}

// chatForm reads b as a TokenizeChatRequest.
func (b *tokenizeBody) chatForm() (TokenizeRequest, error) {
	r := TokenizeRequest{Model: b.Model, Chat: true, Tools: b.Tools}
	if b.Messages == nil {
		return r, fmt.Errorf("messages: %w", errFieldRequired)
	}
	addGen, continueFinal := strictBool(true), strictBool(false)
	for _, err := range []error{
		decodeField(b.Messages, &r.Messages, "messages"),
		decodeField(b.AddGenerationPrompt, &addGen, "add_generation_prompt"),
		decodeField(b.ContinueFinalMessage, &continueFinal, "continue_final_message"),
	} {
		if err != nil {
			return r, err
		}
	}
	var err error
	if r.ReturnTokenStrs, err = b.options(); err != nil {
		return r, err
	}
	if r.Messages == nil {
		return r, errors.New("messages: Input should be a valid list")
	}
	r.AddGenerationPrompt, r.ContinueFinalMessage = bool(addGen), bool(continueFinal)
	return r, nil
}

// fieldsSet counts the fields of raw present, as pydantic counts a
// model's fields set.
func fieldsSet(raw ...json.RawMessage) int {
	n := 0
	for _, f := range raw {
		if f != nil {
			n++
		}
	}
	return n
}

// ParseTokenize parses a POST /tokenize body. As pydantic validates
// vLLM's union of the two forms (its smart mode): the form the body is
// valid as, and when it is valid as both, the one with more of its fields
// present, the completion form on a tie. Errors are 400 *APIErrors.
func ParseTokenize(body []byte) (*TokenizeRequest, error) {
	body, err := jsonText(body)
	if err != nil {
		return nil, err
	}
	var b tokenizeBody
	if err := json.Unmarshal(body, &b); err != nil {
		return nil, errBadRequestf("Invalid JSON body: %v", err)
	}
	completion, cErr := b.completionForm()
	chat, mErr := b.chatForm()
	switch {
	case cErr != nil && mErr != nil:
		return nil, errBadRequestf("The body is neither a TokenizeCompletionRequest (%v) nor a TokenizeChatRequest (%v)", cErr, mErr)
	case mErr != nil:
		return &completion, nil
	case cErr != nil:
	// model, in both, counts the same for each.
	case fieldsSet(b.Prompt, b.AddSpecialTokens, b.ReturnTokenStrs) >= fieldsSet(b.Messages, b.AddGenerationPrompt,
		b.ContinueFinalMessage, b.AddSpecialTokens, b.ReturnTokenStrs, b.Tools, b.ChatTemplate, b.ChatTemplateKwargs,
		b.MediaIOKwargs, b.MMProcessorKwargs):
		return &completion, nil
	}
	// TokenizeChatRequest's own check, before the handler's.
	if chat.AddGenerationPrompt && chat.ContinueFinalMessage && b.AddGenerationPrompt != nil {
		return nil, errBadRequest("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
	}
	return &chat, nil
}

// Text returns the text whose tokens the request counts: the prompt, or
// the chat rendered by chatPrompt, as a chat completion of the same
// messages, tools and options renders it, so that the count is the
// generation's usage.prompt_tokens. kvsim's pseudo-tokenizer has no
// special tokens (no BOS): add_special_tokens is read and adds none, as
// generation adds none.
func (r *TokenizeRequest) Text() ([]byte, error) {
	if !r.Chat {
		return []byte(r.Prompt), nil
	}
	addGen := r.AddGenerationPrompt
	return chatPrompt(r.Messages, r.Tools, nil, &addGen, r.ContinueFinalMessage)
}

// TokenizeResponse is vLLM's answer to POST /tokenize, its fields in
// vLLM's order.
type TokenizeResponse struct {
	Count       int     `json:"count"`
	MaxModelLen int     `json:"max_model_len"`
	Tokens      []int64 `json:"tokens"`
	// TokenStrs is null unless the request set return_token_strs.
	TokenStrs []string `json:"token_strs"`
}

// ParseDetokenize parses a POST /detokenize body, vLLM's
// DetokenizeRequest {model?, tokens}: its model and token ids, each an
// integer in 0..2^63-1 as pydantic reads one in lax mode (2.0 and "2"
// too). Errors are 400 *APIErrors.
func ParseDetokenize(body []byte) (model string, ids []int64, err error) {
	if body, err = jsonText(body); err != nil {
		return "", nil, err
	}
	var b struct {
		Model  string          `json:"model"`
		Tokens json.RawMessage `json:"tokens"`
	}
	if err := json.Unmarshal(body, &b); err != nil {
		return "", nil, errBadRequestf("Invalid JSON body: %v", err)
	}
	if b.Tokens == nil {
		return "", nil, errBadRequest("tokens: Field required")
	}
	var nums []laxInt
	if err := json.Unmarshal(b.Tokens, &nums); err != nil || nums == nil {
		return "", nil, errBadRequest("tokens: Input should be a valid list of integers")
	}
	ids = make([]int64, len(nums))
	for i, n := range nums {
		if n < 0 {
			return "", nil, errBadRequestf("tokens.%d: Input should be greater than or equal to 0", i)
		}
		ids[i] = int64(n)
	}
	return b.Model, ids, nil
}

// checkModel answers a model name a request may not give with vLLM's 404
// (its _check_model): one neither served nor a known adapter.
func (s *Server) checkModel(model string) error {
	if model == "" || slices.Contains(s.served, model) {
		return nil
	}
	var known bool
	s.driver.Do(func(e *Engine) { known = e.HasAdapter(model) })
	if !known {
		return errModelNotFound(model)
	}
	return nil
}

// handleTokenize answers POST /tokenize as vLLM's create_tokenize:
// kvsim's pseudo-tokens of the prompt or rendered chat, their count and
// max_model_len. As vLLM, it tokenizes a text longer than max_model_len
// and counts it all: tokenization has no context to fit.
func (s *Server) handleTokenize(w http.ResponseWriter, r *http.Request) {
	body, err := s.readJSON(w, r)
	if err != nil {
		writeError(w, err)
		return
	}
	req, err := ParseTokenize(body)
	if err == nil {
		err = s.checkModel(req.Model)
	}
	var text []byte
	if err == nil {
		text, err = req.Text()
	}
	if err == nil && !s.tok.HasTokenIDs() {
		err = newAPIError(http.StatusNotImplemented, fmt.Sprintf("kvsim has token ids with bytes_per_token up to %d, not %d: "+
			"a token's id is its bytes, which would not fit in 63 bits", maxExactBytesPerToken, s.tok.BytesPerToken))
	}
	if err != nil {
		writeError(w, err)
		return
	}
	resp := TokenizeResponse{Tokens: s.tok.TokenIDs(text), MaxModelLen: s.cfg.MaxModelLen}
	resp.Count = len(resp.Tokens)
	if req.ReturnTokenStrs {
		resp.TokenStrs = s.tok.TokenStrings(text)
	}
	writeJSON(w, http.StatusOK, resp)
}

// handleDetokenize answers POST /detokenize as vLLM's create_detokenize:
// {"prompt": the ids' text}, the text /tokenize took for ids it gave,
// and the text a prompt of these ids is. An id outside the vocabulary is
// dropped, as a Hugging Face tokenizer's decode drops one it does not
// know; bytes that are not UTF-8 are replaced as Python decodes them.
func (s *Server) handleDetokenize(w http.ResponseWriter, r *http.Request) {
	body, err := s.readJSON(w, r)
	if err != nil {
		writeError(w, err)
		return
	}
	model, ids, err := ParseDetokenize(body)
	if err == nil {
		err = s.checkModel(model)
	}
	if err != nil {
		writeError(w, err)
		return
	}
	writeJSON(w, http.StatusOK, map[string]string{"prompt": pyDecodeUTF8(s.tok.TokenIDsToText(ids))})
}
