package kvsim

import (
	"bytes"
	"encoding/json"
	"errors"
	"math"
	"strconv"
	"strings"
)

// laxInt is an integer field read as vLLM's request models (pydantic, in
// its lax mode) read one: a JSON number without a fractional part (16,
// 16.0, 1e3), also in a string ("16"), or a boolean (1, 0). null is no
// value (a nil *laxInt).
type laxInt int

var errNotInteger = errors.New("input should be a valid integer")

func (n *laxInt) UnmarshalJSON(raw []byte) error {
	switch string(raw) {
	case "true":
		*n = 1
		return nil
	case "false":
		*n = 0
		return nil
	}
	text := raw
	if len(raw) > 0 && raw[0] == '"' {
		var s string
		if err := json.Unmarshal(raw, &s); err != nil {
			return errNotInteger
		}
		text = []byte(strings.TrimSpace(s))
	} else if len(raw) == 0 || raw[0] != '-' && (raw[0] < '0' || raw[0] > '9') {
		return errNotInteger
	}
	if v, err := strconv.ParseInt(string(text), 10, 64); err == nil {
		*n = laxInt(v)
		return nil
	}
	f, err := strconv.ParseFloat(string(text), 64)
	if err != nil || f != math.Trunc(f) || math.Abs(f) > 1<<53 {
		return errNotInteger
	}
	*n = laxInt(f)
	return nil
}

// intOf is n as an *int, nil for none.
func intOf(n *laxInt) *int {
	if n == nil {
		return nil
	}
	v := int(*n)
	return &v
}

// laxBool is a boolean field read as pydantic's lax mode reads one:
// true and false, 0 and 1, and strings such as "true", "yes", "on", "1"
// (and their opposites), in any case. null leaves it false.
type laxBool bool

func (b *laxBool) UnmarshalJSON(raw []byte) error {
	switch {
	case bytes.Equal(raw, []byte("null")):
		return nil
	case bytes.Equal(raw, []byte("true")), bytes.Equal(raw, []byte("false")):
		*b = raw[0] == 't'
		return nil
	case len(raw) > 0 && raw[0] == '"':
		var s string
		if json.Unmarshal(raw, &s) == nil {
			switch strings.ToLower(s) {
			case "1", "on", "t", "true", "y", "yes":
				*b = true
				return nil
			case "0", "off", "f", "false", "n", "no":
				*b = false
				return nil
			}
		}
	default:
		var n laxInt
		if n.UnmarshalJSON(raw) == nil && (n == 0 || n == 1) {
			*b = n == 1
			return nil
		}
	}
	return errors.New("input should be a valid boolean")
}

// strictBool is a laxBool that refuses null, as pydantic does a field
// typed bool (not Optional[bool]) with a default, such as vLLM's
// LoadLoRAAdapterRequest.load_inplace.
type strictBool bool

func (b *strictBool) UnmarshalJSON(raw []byte) error {
	if bytes.Equal(raw, []byte("null")) {
		return errors.New("input should be a valid boolean")
	}
	return (*laxBool)(b).UnmarshalJSON(raw)
}
