package kvsim

import (
	"fmt"
	"net/http"
)

// APIError is an error in vLLM's OpenAI error shape:
//
//	{"object":"error","message":"...","type":"BadRequestError","param":null,"code":400}
type APIError struct {
	Object  string  `json:"object"`
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    int     `json:"code"`
}

// Error returns the message.
func (e *APIError) Error() string { return e.Message }

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
	}
	return &APIError{Object: "error", Message: message, Type: typ, Code: code}
}

func errBadRequest(message string) *APIError {
	return newAPIError(http.StatusBadRequest, message)
}

func errBadRequestf(format string, args ...any) *APIError {
	return errBadRequest(fmt.Sprintf(format, args...))
}

// errModelNotFound is vLLM's error for a model name that is neither the base model nor a
// known adapter.
func errModelNotFound(model string) *APIError {
	e := newAPIError(http.StatusNotFound, fmt.Sprintf("The model `%s` does not exist.", model))
	param := "model"
	e.Param = &param
	return e
}
