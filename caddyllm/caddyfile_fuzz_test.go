package caddyllm

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

const (
	handlerModuleID = "http.handlers.llm_affinity"
	policyModuleID  = "http.reverse_proxy.selection_policies.llm_affinity"
)

// goTypeSpellings are how Go types show in an error (encoding/json's,
// fmt's): an error for a config must speak of its options, not of them.
var goTypeSpellings = []string{
	"Go ", "of type ", "*string", "*int", "*float", "float64", "int64", "uint64", "struct {", "[]string", "[]float64",
	"map[", "json.RawMessage", "caddy.Duration", "caddyllm.", "HardwareProfile", "SyncConfig", "Policy.", "Handler.",
	"reflect.", "<nil>", "%!",
}

// checkConfigError fails t when err, the answer to the config in, is
// empty or names a Go type (one the input does not spell itself: an
// error may quote what it refuses).
func checkConfigError(t *testing.T, in []byte, err error) {
	t.Helper()
	msg := err.Error()
	if strings.TrimSpace(msg) == "" {
		t.Fatalf("%q: empty error", in)
	}
	for _, s := range goTypeSpellings {
		if strings.Contains(msg, s) && !bytes.Contains(in, []byte(s)) {
			t.Fatalf("%q: error names a Go type (%q): %v", in, s, err)
		}
	}
}

// loadModule loads the module id from its JSON config raw as Caddy does
// (strict decoding, Provision, Validate, Cleanup on a failure), then
// unloads it (the context's cancellation runs Cleanup), checking an error
// as the answer to in. A policy that syncs is not loaded: it would
// connect to NATS.
func loadModule(t *testing.T, in []byte, id string, raw []byte) {
	t.Helper()
	if id == policyModuleID && policySyncs(raw, 0) {
		return
	}
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	if _, err := ctx.LoadModuleByID(id, raw); err != nil {
		checkConfigError(t, in, err)
	}
}

// policySyncs says the policy config raw, or a fallback llm_affinity
// policy in it, has a sync block.
func policySyncs(raw []byte, depth int) bool {
	var p Policy
	if depth > 100 || caddy.StrictUnmarshalJSON(raw, &p) != nil {
		return false // refused before anything connects
	}
	if p.Sync != nil {
		return true
	}
	// Caddy reads the fallback's name from its "policy" key (the last
	// one), and decodes the rest into the module.
	var fb map[string]json.RawMessage
	if p.FallbackRaw == nil || json.Unmarshal(p.FallbackRaw, &fb) != nil {
		return false
	}
	var name string
	if json.Unmarshal(fb["policy"], &name) != nil || name != "llm_affinity" {
		return false
	}
	delete(fb, "policy")
	rest, err := json.Marshal(fb)
	return err == nil && policySyncs(rest, depth+1)
}

// caddyfileSeeds returns the llm_affinity blocks of README.md's
// Configuration section and of the example Caddyfiles: the handler's
// (policy false) or the reverse_proxy policy's, as their parsers get
// them (from the directive's or the policy's name on).
func caddyfileSeeds(tb testing.TB, policy bool) []string {
	readme, err := os.ReadFile("../README.md")
	if err != nil {
		tb.Fatal(err)
	}
	conf := string(readme)
	start := strings.Index(conf, "\n## Configuration\n")
	if start < 0 {
		tb.Fatal("README.md has no Configuration section")
	}
	conf = conf[start+1:]
	if end := strings.Index(conf[3:], "\n## "); end >= 0 {
		conf = conf[:end+3]
	}
	texts := []string{conf}
	files, err := filepath.Glob("../caddyfile-examples/*.Caddyfile")
	if err != nil || len(files) == 0 {
		tb.Fatalf("example Caddyfiles: %v %v", files, err)
	}
	for _, file := range files {
		b, err := os.ReadFile(file)
		if err != nil {
			tb.Fatal(err)
		}
		texts = append(texts, string(b))
	}
	var seeds []string
	for _, text := range texts {
		seeds = append(seeds, directiveBlocks(text, policy)...)
	}
	if len(seeds) < 3 {
		tb.Fatalf("found %d llm_affinity blocks (policy %v), want more", len(seeds), policy)
	}
	return seeds
}

// directiveBlocks cuts the llm_affinity blocks out of a Caddyfile text.
func directiveBlocks(text string, policy bool) []string {
	lines := strings.Split(text, "\n")
	var blocks []string
	for i := 0; i < len(lines); i++ {
		line := strings.TrimSpace(lines[i])
		if policy {
			rest, ok := strings.CutPrefix(line, "lb_policy ")
			if !ok || !strings.HasPrefix(strings.TrimSpace(rest), "llm_affinity") {
				continue
			}
			line = strings.TrimSpace(rest)
		} else if line != "llm_affinity" && !strings.HasPrefix(line, "llm_affinity ") {
			continue
		}
		block := []string{line}
		for depth := braces(line); depth > 0 && i+1 < len(lines); {
			i++
			block = append(block, lines[i])
			depth += braces(lines[i])
		}
		blocks = append(blocks, strings.Join(block, "\n"))
	}
	return blocks
}

// braces is how many more blocks a Caddyfile line opens than it closes,
// its comment aside.
func braces(line string) int {
	if i := strings.Index(line, "#"); i == 0 || i > 0 && (line[i-1] == ' ' || line[i-1] == '\t') {
		line = line[:i]
	}
	return strings.Count(line, "{") - strings.Count(line, "}")
}

// roundTrip checks that v's JSON decodes (strictly, as Caddy decodes a
// module) into a config whose JSON is the same; exact (v came from a
// Caddyfile, whose fallback is JSON encoding/json wrote) also wants the
// same config. v is a pointer to a module struct. It returns the JSON.
func roundTrip(t *testing.T, in []byte, v any, exact bool) []byte {
	t.Helper()
	raw, err := json.Marshal(v)
	if err != nil {
		t.Fatalf("%q: config %+v does not encode: %v", in, v, err)
	}
	back := reflect.New(reflect.TypeOf(v).Elem())
	if err := caddy.StrictUnmarshalJSON(raw, back.Interface()); err != nil {
		t.Fatalf("%q: its JSON %s does not decode: %v", in, raw, err)
	}
	again, err := json.Marshal(back.Interface())
	if err != nil || !bytes.Equal(again, raw) {
		t.Fatalf("%q: JSON %s decodes to a config whose JSON is %s (%v)", in, raw, again, err)
	}
	// encoding/json writes a string's invalid UTF-8 as U+FFFD.
	if exact && utf8.Valid(in) && !reflect.DeepEqual(back.Interface(), v) {
		t.Fatalf("%q: JSON %s decodes to %+v, not %+v", in, raw, back.Elem().Interface(), reflect.ValueOf(v).Elem().Interface())
	}
	return raw
}

// FuzzHandlerCaddyfile: the llm_affinity directive's parser never panics;
// what it refuses gets an error that names no Go type; what it takes
// comes back from its JSON as it was, and loads (Provision, Validate) or
// gets such an error.
func FuzzHandlerCaddyfile(f *testing.F) {
	for _, s := range caddyfileSeeds(f, false) {
		f.Add(s)
	}
	for _, s := range []string{"", "llm_affinity", "llm_affinity {\n}", "llm_affinity {\n max_body 1GiB\n}", "llm_affinity {\n max_body 1.5KB\n}",
		"llm_affinity {\n bytes_per_token 17\n}", "llm_affinity {\n block_tokens -1\n max_prefix_tokens 99999999999999999999\n}",
		"llm_affinity {\n salt \"\"\n}", "llm_affinity {\n salt {\n}", "llm_affinity {\n\tsalt a {\n\t\tb\n\t}\n}"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, in string) {
		var s StatusHandler
		if err := s.UnmarshalCaddyfile(caddyfile.NewTestDispenser(in)); err != nil {
			checkConfigError(t, []byte(in), err)
		}
		var h Handler
		if err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser(in)); err != nil {
			checkConfigError(t, []byte(in), err)
			return
		}
		raw := roundTrip(t, []byte(in), &h, true)
		loadModule(t, []byte(in), handlerModuleID, raw)
	})
}

// FuzzPolicyCaddyfile: lb_policy llm_affinity's parser never panics;
// what it refuses gets an error that names no Go type; what it takes
// comes back from its JSON as it was, and loads (Provision, Validate,
// Cleanup) or gets such an error.
func FuzzPolicyCaddyfile(f *testing.F) {
	for _, s := range caddyfileSeeds(f, true) {
		f.Add(s)
	}
	for _, s := range []string{"", "llm_affinity", "llm_affinity {\n}", "llm_affinity {\n upstream a:1\n}", "llm_affinity {\n upstream a:1 {\n }\n}",
		"llm_affinity {\n fallback llm_affinity {\n  fallback llm_affinity {\n   shed_status 200\n  }\n }\n}",
		"llm_affinity {\n fallback llm_affinity {\n  sync nats://a:1\n }\n}", "llm_affinity {\n fallback cookie\n}",
		"llm_affinity {\n fallback weighted_round_robin 1 x\n}", "llm_affinity {\n fallback nonesuch\n}",
		"llm_affinity {\n scrape_interval 100ms\n scrape_max_age 1ms\n drain a:1\n upstream b:2 {\n  kv_capacity 1\n }\n}",
		"llm_affinity {\n strategy least_work\n queue_timeout -1s\n queue_limit -1\n}", "llm_affinity {\n strategy nonesuch\n}",
		"llm_affinity {\n output_estimate fixed\n output_tokens 0\n}", "llm_affinity {\n tie 1e308\n sglang -1e308 0 0\n}",
		"llm_affinity {\n kv_capacity -1\n}", "llm_affinity {\n decode_rate 0.5\n}", "llm_affinity {\n metrics_path metrics\n}",
		"llm_affinity {\n sync {\n }\n}", "llm_affinity {\n upstream {\n }\n}"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, in string) {
		var p Policy
		if err := p.UnmarshalCaddyfile(caddyfile.NewTestDispenser(in)); err != nil {
			checkConfigError(t, []byte(in), err)
			return
		}
		raw := roundTrip(t, []byte(in), &p, true)
		loadModule(t, []byte(in), policyModuleID, raw)
	})
}

// jsonSeeds returns the configs of the module id in the example
// quickstart.json, and the JSON of each Caddyfile seed.
func jsonSeeds(tb testing.TB, policy bool) [][]byte {
	var seeds [][]byte
	b, err := os.ReadFile("../caddyfile-examples/quickstart.json")
	if err != nil {
		tb.Fatal(err)
	}
	var doc any
	if err := json.Unmarshal(b, &doc); err != nil {
		tb.Fatal(err)
	}
	key := "handler"
	if policy {
		key = "policy"
	}
	var walk func(v any)
	walk = func(v any) {
		switch v := v.(type) {
		case map[string]any:
			if v[key] == "llm_affinity" {
				m := make(map[string]any, len(v))
				for k, x := range v {
					if k != key {
						m[k] = x
					}
				}
				raw, _ := json.Marshal(m)
				seeds = append(seeds, raw)
			}
			for _, x := range v {
				walk(x)
			}
		case []any:
			for _, x := range v {
				walk(x)
			}
		}
	}
	walk(doc)
	for _, s := range caddyfileSeeds(tb, policy) {
		var v caddyfile.Unmarshaler = new(Handler)
		if policy {
			v = new(Policy)
		}
		if v.UnmarshalCaddyfile(caddyfile.NewTestDispenser(s)) == nil {
			raw, _ := json.Marshal(v)
			seeds = append(seeds, raw)
		}
	}
	return seeds
}

// FuzzHandlerJSON: the handler's JSON config never panics as Caddy loads
// it; what it refuses gets an error that names no Go type, and what
// decodes comes back from its own JSON as it was.
func FuzzHandlerJSON(f *testing.F) {
	fuzzModuleJSON[Handler](f, handlerModuleID, false, `{}`, `null`, `[]`, `{"block_tokens":"x"}`, `{"block_tokens":1.5}`, `{"max_body_bytes":1e400}`,
		`{"max_body_bytes":-1}`, `{"max_body_bytes":1073741825}`, `{"bytes_per_token":17}`, `{"salt":null}`, `{"salt":1}`,
		`{"Salt":"a","salt":"b"}`, `{"colour":"blue"}`, `{"block_tokens":65537}`, `{"block_tokens":1}{}`)
}

// FuzzPolicyJSON: the policy's JSON config never panics as Caddy loads
// it (Provision, Validate, Cleanup); what it refuses gets an error that
// names no Go type, and what decodes comes back from its own JSON as it
// was.
func FuzzPolicyJSON(f *testing.F) {
	fuzzModuleJSON[Policy](f, policyModuleID, true, `{}`, `null`, `[]`, `{"shed_status":"x"}`, `{"shed_status":1e400}`, `{"queue_timeout":"soon"}`,
		`{"queue_timeout":true}`, `{"queue_timeout":1.5}`, `{"hardware":null}`, `{"hardware":{"kv_capacity_tokens":-1}}`,
		`{"upstreams":{"a:1":null}}`, `{"upstreams":{"a:1":{}},"drain":["a:1"]}`, `{"llmd_weights":[1,2]}`, `{"llmd_weights":[]}`,
		`{"fallback":{"policy":"llm_affinity","fallback":{"policy":"first"}}}`, `{"fallback":{}}`, `{"fallback":null}`, `{"fallback":[]}`, `{"fallback":{"policy":1}}`, `{"fallback":{"Policy":"first"}}`, `{"fAllBACk":{"policy":""}}`,
		`{"fallback":{"policy":"nonesuch"}}`, `{"fallback":{"policy":"llm_affinity","sync":{"urls":["a:1"]}}}`,
		`{"sync":{"urls":[]}}`, `{"sync":null}`, `{"SYNC":{"urls":["nats://a:1"]}}`, `{"strategy":"nonesuch"}`,
		`{"scrape_interval":"1ms"}`, `{"scrape_interval":"100ms","scrape_max_age":"1ms","models_interval":"-1s"}`,
		`{"metrics_path":"m"}`, `{"tie_seconds":-1}`, `{"imposed_delay_weight":101}`, `{"kv_margin_tokens":-1}`,
		`{"adapters":["a",null]}`, `{"adapters":"a"}`, `{"output_estimate":"guess"}`, `{"max_loras":-1,"queue_limit":-1}`)
}

// fuzzModuleJSON fuzzes the JSON config of the module id, of type T (the
// policy's when policy), seeded with jsonSeeds and extra: what decodes
// comes back from its own JSON as it was, and whatever the input, Caddy's
// loading never panics and refuses it with an error that names no Go type.
func fuzzModuleJSON[T any](f *testing.F, id string, policy bool, extra ...string) {
	for _, s := range jsonSeeds(f, policy) {
		f.Add(s)
	}
	for _, s := range extra {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		var v T
		if caddy.StrictUnmarshalJSON(in, &v) == nil {
			roundTrip(t, in, &v, false)
		}
		loadModule(t, in, id, in)
	})
}
