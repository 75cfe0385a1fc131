package kvsim

import (
	"reflect"
	"strings"
	"testing"
	"time"
)

// TestOptionsNameEveryField checks the option tables against the structs: one option per
// field, named by the field's JSON name and pointing at that field, so that the Caddyfile and
// the flags built from them reach every field by the name its JSON uses.
func TestOptionsNameEveryField(t *testing.T) {
	var c Config
	checkOptions(t, reflect.ValueOf(&c).Elem(), c.Options())
	var f Faults
	checkOptions(t, reflect.ValueOf(&f).Elem(), f.Options())
}

func checkOptions(t *testing.T, v reflect.Value, options []Option) {
	t.Helper()
	byField := map[uintptr]Option{}
	for _, o := range options {
		switch o.Field.(type) {
		case *string, *int, *bool, *float64, *time.Duration, *[]string:
		default:
			t.Errorf("%s option %s: unsupported field type %T", v.Type(), o.Name, o.Field)
		}
		if o.Usage == "" {
			t.Errorf("%s option %s has no usage", v.Type(), o.Name)
		}
		byField[reflect.ValueOf(o.Field).Pointer()] = o
	}
	if len(options) != v.NumField() || len(byField) != v.NumField() {
		t.Errorf("%s: %d options on %d distinct fields, want one per field (%d)", v.Type(), len(options), len(byField), v.NumField())
	}
	for i := range v.NumField() {
		field := v.Type().Field(i)
		name, _, _ := strings.Cut(field.Tag.Get("json"), ",")
		o, ok := byField[v.Field(i).Addr().Pointer()]
		switch {
		case !ok:
			t.Errorf("%s.%s has no option", v.Type(), field.Name)
		case o.Name != name || reflect.TypeOf(o.Field).Elem() != field.Type:
			t.Errorf("%s.%s (JSON %q, %s) has option %q (%T)", v.Type(), field.Name, name, field.Type, o.Name, o.Field)
		}
	}
}
