package caddyllm

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"time"

	"github.com/caddyserver/caddy/v2"
)

// UnmarshalJSON decodes the handler's JSON config as Caddy does (an
// unknown field is an error), with errors that speak of its fields and
// of JSON's values rather than of Go's types.
func (h *Handler) UnmarshalJSON(b []byte) error {
	type plain Handler
	return decodeConfig(b, (*plain)(h))
}

// UnmarshalJSON decodes the policy's JSON config as Caddy does (an
// unknown field is an error), with errors that speak of its fields and
// of JSON's values rather than of Go's types. A null fallback is none,
// as a null hardware profile or sync block is.
func (p *Policy) UnmarshalJSON(b []byte) error {
	type plain Policy
	if err := decodeConfig(b, (*plain)(p)); err != nil {
		return err
	}
	if string(p.FallbackRaw) == "null" {
		p.FallbackRaw = nil
	}
	return nil
}

// decodeConfig decodes the JSON value b into v strictly, as
// caddy.StrictUnmarshalJSON does (it cannot reach a module's own
// decoding), and words encoding/json's type errors for the config's
// reader: "shed_status: want an integer, got a JSON string, at offset 15"
// rather than "cannot unmarshal string into Go struct field
// Policy.shed_status of type int".
func decodeConfig(b []byte, v any) error {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	err := dec.Decode(v)
	var te *json.UnmarshalTypeError
	if !errors.As(err, &te) {
		return err
	}
	want := "want " + jsonKind(te.Type)
	if te.Field != "" {
		want = te.Field + ": " + want
	}
	return fmt.Errorf("%s, got a JSON %s, at offset %d", want, te.Value, te.Offset)
}

// jsonKind says what JSON value a config field of type t takes.
func jsonKind(t reflect.Type) string {
	if t == nil {
		return "another value"
	}
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	switch {
	case t == reflect.TypeFor[time.Duration]() || t == reflect.TypeFor[caddy.Duration]():
		return `a duration ("5s", "1m30s") or an integer number of nanoseconds`
	case t.Kind() == reflect.Bool:
		return "true or false"
	case t.Kind() == reflect.String:
		return "a string"
	case t.Kind() >= reflect.Int && t.Kind() <= reflect.Uint64:
		return "an integer in range"
	case t.Kind() == reflect.Float32 || t.Kind() == reflect.Float64:
		return "a number in range"
	case t.Kind() == reflect.Slice || t.Kind() == reflect.Array:
		return "a list (JSON array)"
	case t.Kind() == reflect.Map || t.Kind() == reflect.Struct:
		return "an object"
	}
	return "another value"
}
