package kvsim

import (
	"encoding/json"
	"fmt"
	"net/http"
)

// APIError is an error of vLLM's OpenAI-compatible server, which answers
// in the OpenAI API's shape (vLLM 0.10.1 on; earlier releases sent the
// same fields flat, with "object":"error"):
//
//	{"error":{"message":"...","type":"BadRequestError","param":null,"code":400}}
type APIError struct {
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    int     `json:"code"`
}

// Error returns the message.
func (e *APIError) Error() string { return e.Message }

// MarshalJSON writes the error inside its "error" object.
func (e *APIError) MarshalJSON() ([]byte, error) {
	type fields APIError // without this method
	return json.Marshal(struct {
		Error *fields `json:"error"`
	}{(*fields)(e)})
}

// UnmarshalJSON reads the error from its "error" object.
func (e *APIError) UnmarshalJSON(b []byte) error {
	type fields APIError
	var wrapped struct {
		Error *fields `json:"error"`
	}
	wrapped.Error = (*fields)(e)
	return json.Unmarshal(b, &wrapped)
}

// newAPIError returns an APIError of the given HTTP status.
func newAPIError(code int, message string) *APIError {
	typ := "BadRequestError"
	switch code {
	case http.StatusNotFound:
		typ = "NotFoundError"
	case http.StatusInternalServerError:
		typ = "InternalServerError"
	case http.StatusServiceUnavailable:
		typ = "ServiceUnavailableError"
	case http.StatusNotImplemented:
		// vLLM's answer to a NotImplementedError, named after it.
		typ = "NotImplementedError"
	}
	return &APIError{Message: message, Type: typ, Code: code}
}

func errBadRequest(message string) *APIError {
	return newAPIError(http.StatusBadRequest, message)
}

func errBadRequestf(format string, args ...any) *APIError {
	return errBadRequest(fmt.Sprintf(format, args...))
}

// errModelNotFound is vLLM's error for a model name that is neither the base model nor a
// known adapter. Current vLLM names the field at fault (OpenAIServing._check_model,
// vllm/entrypoints/openai/engine/serving.py: param="model"); releases before it sent null.
func errModelNotFound(model string) *APIError {
	e := newAPIError(http.StatusNotFound, fmt.Sprintf("The model `%s` does not exist.", model))
	param := "model"
	e.Param = &param
	return e
}

// errResponseNotFound is vLLM's answer for a stored response it does not
// hold (OpenAIServingResponses._make_not_found_error).
func errResponseNotFound(id string) *APIError {
	return &APIError{Code: http.StatusNotFound, Type: "invalid_request_error",
		Message: fmt.Sprintf("Response with id '%s' not found.", id)}
}

// errInvalidUserInput is the 400 vLLM's adapter API (OpenAIServingModels, its
// load_lora_adapter and unload_lora_adapter checks) answers a request it refuses: its type
// is "InvalidUserInput", not "BadRequestError".
func errInvalidUserInput(message string) *APIError {
	e := errBadRequest(message)
	e.Type = "InvalidUserInput"
	return e
}

// errAdapterLoaded is vLLM's answer to loading, without load_inplace, an adapter already
// loaded (OpenAIServingModels._check_load_lora_adapter_request).
func errAdapterLoaded(name string) *APIError {
	return errInvalidUserInput(fmt.Sprintf("The lora adapter '%s' has already been loaded. "+
		"If you want to load the adapter in place, set 'load_inplace' to True.", name))
}
