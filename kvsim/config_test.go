package kvsim

import (
	"math"
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

// TestConfigBounds: values that would exhaust memory or time, or are not
// numbers, are refused with the option's name.
func TestConfigBounds(t *testing.T) {
	for name, c := range map[string]Config{
		"num_gpu_blocks": {NumGPUBlocks: MaxGPUBlocks + 1},
		"block_size":     {BlockSize: 1 << 13},
		"lora_host_load": {LoRAHostLoad: -time.Second},
	} {
		if err := c.WithDefaults().Validate(); err == nil || !strings.Contains(err.Error(), name) {
			t.Errorf("%s: %v", name, err)
		}
	}
	for _, sc := range []ServerConfig{
		{Speed: math.NaN()}, {Speed: math.Inf(1)}, {Speed: MaxSpeed + 1}, {Speed: -1},
		{Faults: Faults{ErrorRate: math.NaN()}}, {Faults: Faults{ErrorRate: 5}}, {Faults: Faults{CutAfterTokens: -1}},
	} {
		if s, err := NewServer(sc); err == nil {
			s.Close()
			t.Errorf("%+v accepted", sc)
		}
	}
}
