package main

import (
	"encoding/json"
	"fmt"
	"io"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"

	"github.com/llmaffinity/caddy-llm-affinity/kvsim"
	"github.com/llmaffinity/caddy-llm-affinity/kvsim/caddykvsim"
)

// TestFlagDefaultsAreConfigDefaults checks that the engine flags take their defaults from
// kvsim.Config.WithDefaults rather than from literals of their own.
func TestFlagDefaultsAreConfigDefaults(t *testing.T) {
	s, err := parseFlags(nil, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if want := (kvsim.Config{}).WithDefaults(); !reflect.DeepEqual(s.engine, want) {
		t.Errorf("flag defaults give\n%+v, want kvsim.Config{}.WithDefaults()\n%+v", s.engine, want)
	}
	if s.faults != (kvsim.Faults{}) || s.speed != 1 || s.replicas != 1 {
		t.Errorf("defaults: faults %+v, speed %v, replicas %d", s.faults, s.speed, s.replicas)
	}
}

// TestFlagNames pins the flags that scripts use: the engine and fault flags are now built
// from kvsim's option tables, and must keep the names they had when they were written out.
func TestFlagNames(t *testing.T) {
	for _, flag := range []string{
		"listen", "replicas", "name-prefix", "speed", "adapters", "verbose",
		"model", "max-model-len", "block-size", "num-gpu-blocks", "max-num-seqs", "max-num-batched-tokens",
		"bytes-per-token", "default-output-tokens", "disable-prefix-caching", "step-overhead", "per-prefill-token",
		"per-decode-sequence", "per-context-token", "max-loras", "max-cpu-loras", "lora-host-load", "lora-storage-load",
		"fault-unhealthy", "fault-error-rate", "fault-stall", "fault-cut-after-tokens",
	} {
		if fs, _ := newFlags(io.Discard); fs.Lookup(flag) == nil {
			t.Errorf("flag -%s is gone", flag)
		}
	}
}

// TestFrontEndsSetTheSameFields gives every engine and fault setting a non-default value
// three ways: as kvsim's flags, as the Caddyfile directive's options and as the Caddy
// handler's JSON (which uses the struct tags, not the option tables). All three must build
// the same kvsim.Config and kvsim.Faults, and the Caddyfile's handler must survive a JSON
// round trip, as it does when Caddy adapts a Caddyfile.
func TestFrontEndsSetTheSameFields(t *testing.T) {
	var want kvsim.Config
	var wantFaults kvsim.Faults
	var args []string
	caddyfileText := "kvsim replica-0 {\n\tspeed 2.5\n"
	jsonFields := map[string]any{"name": "replica-0", "speed": 2.5}
	jsonFaults := map[string]any{}
	set := func(prefix string, o kvsim.Option, i int, jsonObject map[string]any) {
		// A value unlike any default, different for every option.
		var text string
		var jsonValue any
		switch p := o.Field.(type) {
		case *string:
			*p = fmt.Sprintf("value-%d", i)
			text, jsonValue = *p, *p
		case *int:
			*p = 1000 + i
			text, jsonValue = fmt.Sprint(*p), *p
		case *bool:
			*p = true
			jsonValue = true
		case *float64:
			*p = float64(i) / 100
			text, jsonValue = fmt.Sprint(*p), *p
		case *time.Duration:
			*p = time.Duration(i+1)*time.Millisecond + 7*time.Microsecond
			text, jsonValue = p.String(), p.String()
		case *[]string:
			*p = []string{fmt.Sprintf("a-%d", i), fmt.Sprintf("b-%d", i)}
			text, jsonValue = strings.Join(*p, ","), *p
		default:
			t.Fatalf("option %s: unsupported type %T", o.Name, o.Field)
		}
		flagName := strings.ReplaceAll(prefix+o.Name, "_", "-")
		caddyArgs := strings.ReplaceAll(text, ",", " ")
		if _, ok := o.Field.(*bool); ok {
			args = append(args, "-"+flagName)
		} else {
			args = append(args, "-"+flagName, text)
		}
		caddyfileText += fmt.Sprintf("\t%s %s\n", prefix+o.Name, caddyArgs)
		jsonObject[o.Name] = jsonValue
	}
	for i, o := range want.Options() {
		set("", o, i, jsonFields)
	}
	for i, o := range wantFaults.Options() {
		set("fault_", o, i, jsonFaults)
	}
	caddyfileText += "}"
	jsonFields["faults"] = jsonFaults
	args = append(args, "-speed", "2.5")

	flags, err := parseFlags(args, io.Discard)
	if err != nil {
		t.Fatalf("flags %q: %v", args, err)
	}
	var fromCaddyfile caddykvsim.Handler
	if err := fromCaddyfile.UnmarshalCaddyfile(caddyfile.NewTestDispenser(caddyfileText)); err != nil {
		t.Fatalf("Caddyfile:\n%s\n%v", caddyfileText, err)
	}
	jsonText, _ := json.Marshal(jsonFields)
	var fromJSON caddykvsim.Handler
	if err := json.Unmarshal(jsonText, &fromJSON); err != nil {
		t.Fatalf("JSON %s: %v", jsonText, err)
	}
	adapted, err := json.Marshal(&fromCaddyfile)
	if err != nil {
		t.Fatal(err)
	}
	var roundTrip caddykvsim.Handler
	if err := json.Unmarshal(adapted, &roundTrip); err != nil {
		t.Fatalf("adapted JSON %s: %v", adapted, err)
	}

	for name, got := range map[string]struct {
		engine kvsim.Config
		faults *kvsim.Faults
		speed  float64
	}{
		"flags":           {flags.engine, &flags.faults, flags.speed},
		"Caddyfile":       {fromCaddyfile.Config, fromCaddyfile.Faults, fromCaddyfile.Speed},
		"JSON":            {fromJSON.Config, fromJSON.Faults, fromJSON.Speed},
		"adapted to JSON": {roundTrip.Config, roundTrip.Faults, roundTrip.Speed},
	} {
		if !reflect.DeepEqual(got.engine, want) {
			t.Errorf("%s set\n%+v, want\n%+v", name, got.engine, want)
		}
		if got.faults == nil || *got.faults != wantFaults || got.speed != 2.5 {
			t.Errorf("%s set faults %+v and speed %v, want %+v and 2.5", name, got.faults, got.speed, wantFaults)
		}
	}
}
