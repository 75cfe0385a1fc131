// Package examples holds the example Caddyfiles; its test adapts each one to JSON, exactly as
// `caddy adapt` would, without starting anything.
package examples

import (
	"bytes"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/caddyconfig"
	_ "github.com/caddyserver/caddy/v2/modules/standard"

	_ "github.com/llmaffinity/caddy-llm-affinity/caddyllm"
	_ "github.com/llmaffinity/caddy-llm-affinity/kvsim/caddykvsim"
)

var update = flag.Bool("update", false, "rewrite the golden *.json files from the Caddyfiles")

// golden lists the examples whose adapted JSON is checked in beside them.
var golden = map[string]bool{"quickstart.Caddyfile": true}

// TestExamplesAdapt adapts every *.Caddyfile in this directory and fails on an error or a
// warning (the adapter warns, for instance, when a file is not formatted as `caddy fmt`
// would write it, or when a directive is deprecated).
func TestExamplesAdapt(t *testing.T) {
	files, err := filepath.Glob("*.Caddyfile")
	if err != nil {
		t.Fatal(err)
	}
	if len(files) < 5 {
		t.Fatalf("found %d example Caddyfiles, want at least 5: %v", len(files), files)
	}
	for name := range golden {
		if _, err := os.Stat(name); err != nil {
			t.Errorf("golden example %s: %v", name, err)
		}
	}
	adapter := caddyconfig.GetAdapter("caddyfile")
	if adapter == nil {
		t.Fatal("no caddyfile adapter registered")
	}
	for _, file := range files {
		t.Run(strings.TrimSuffix(file, ".Caddyfile"), func(t *testing.T) {
			body, err := os.ReadFile(file)
			if err != nil {
				t.Fatal(err)
			}
			out, warnings, err := adapter.Adapt(body, map[string]any{"filename": file})
			for _, w := range warnings {
				t.Errorf("warning: %s", w.String())
			}
			if err != nil {
				t.Fatalf("adapt: %v", err)
			}
			got, err := normalize(out)
			if err != nil {
				t.Fatalf("adapted JSON: %v", err)
			}
			if !golden[file] {
				return
			}
			goldenFile := strings.TrimSuffix(file, ".Caddyfile") + ".json"
			if *update {
				if err := os.WriteFile(goldenFile, got, 0o644); err != nil {
					t.Fatal(err)
				}
				return
			}
			raw, err := os.ReadFile(goldenFile)
			if err != nil {
				t.Fatalf("%v (run go test ./caddyfile-examples -update to create it)", err)
			}
			want, err := normalize(raw)
			if err != nil {
				t.Fatalf("%s: %v", goldenFile, err)
			}
			if !bytes.Equal(got, want) {
				t.Errorf("adapted %s differs from %s (if the change is intended, run go test ./caddyfile-examples -update):\n%s",
					file, goldenFile, lineDiff(string(want), string(got)))
			}
		})
	}
}

// TestExamplesUseThePlugin keeps the examples about this plugin: each routes with the
// llm_affinity handler and lb_policy.
func TestExamplesUseThePlugin(t *testing.T) {
	files, err := filepath.Glob("*.Caddyfile")
	if err != nil {
		t.Fatal(err)
	}
	for _, file := range files {
		body, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		for _, want := range []string{"\tllm_affinity", "lb_policy llm_affinity"} {
			if !bytes.Contains(body, []byte(want)) {
				t.Errorf("%s does not use %q", file, strings.TrimSpace(want))
			}
		}
	}
}

// normalize re-encodes JSON with sorted keys and tab indentation, so that golden files
// compare by content, not layout.
func normalize(data []byte) ([]byte, error) {
	var v any
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	if err := dec.Decode(&v); err != nil {
		return nil, err
	}
	out, err := json.MarshalIndent(v, "", "\t")
	if err != nil {
		return nil, err
	}
	return append(out, '\n'), nil
}

// lineDiff lists the lines that differ between want and got, position by position (at most
// 20); enough to see what changed in a golden file.
func lineDiff(want, got string) string {
	w, g := strings.Split(want, "\n"), strings.Split(got, "\n")
	var b strings.Builder
	shown := 0
	for i := 0; i < max(len(w), len(g)) && shown < 20; i++ {
		var wl, gl string
		if i < len(w) {
			wl = w[i]
		}
		if i < len(g) {
			gl = g[i]
		}
		if wl != gl {
			shown++
			fmt.Fprintf(&b, "line %d:\n  - %s\n  + %s\n", i+1, wl, gl)
		}
	}
	return b.String()
}

// TestProductionChecksTheKeyFirst: in production.Caddyfile a client without the API key gets
// the 401 before llm_affinity reads its body (the handler's directive order comes before
// respond's, so outside a route its 400, 413 or 415 answered first, and its 404 named models).
func TestProductionChecksTheKeyFirst(t *testing.T) {
	body, err := os.ReadFile("production.Caddyfile")
	if err != nil {
		t.Fatal(err)
	}
	out, _, err := caddyconfig.GetAdapter("caddyfile").Adapt(body, map[string]any{"filename": "production.Caddyfile"})
	if err != nil {
		t.Fatal(err)
	}
	var config any
	if err := json.Unmarshal(out, &config); err != nil {
		t.Fatal(err)
	}
	// The handlers in the order a request meets them: depth first, arrays in order.
	var order []string
	var walk func(v any)
	walk = func(v any) {
		switch v := v.(type) {
		case map[string]any:
			if h, ok := v["handler"].(string); ok {
				if code, ok := v["status_code"]; ok {
					h = fmt.Sprintf("%s %v", h, code)
				}
				order = append(order, h)
			}
			for _, k := range []string{"routes", "handle"} { // a route's handlers, a subroute's routes
				walk(v[k])
			}
			for k, e := range v {
				if k != "routes" && k != "handle" {
					walk(e)
				}
			}
		case []any:
			for _, e := range v {
				walk(e)
			}
		}
	}
	walk(config)
	key, router := -1, -1
	for i, h := range order {
		if h == "static_response 401" && key < 0 {
			key = i
		}
		if h == "llm_affinity" && router < 0 {
			router = i
		}
	}
	if key < 0 || router < 0 || key > router {
		t.Fatalf("handlers in order %v: want the 401 before llm_affinity", order)
	}
}
