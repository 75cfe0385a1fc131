package main

import (
	"bytes"
	"encoding/json"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/llmaffinity/caddy-llm-affinity/llmbench"
)

func TestHelpDocumentsEveryFlag(t *testing.T) {
	var stdout, stderr bytes.Buffer
	if code := run([]string{"--help"}, &stdout, &stderr); code != 0 {
		t.Fatalf("exit %d", code)
	}
	var o options
	fs := newFlagSet(&o, &bytes.Buffer{})
	n := 0
	fs.VisitAll(func(f *flag.Flag) {
		n++
		if !strings.Contains(stderr.String(), "-"+f.Name) {
			t.Errorf("--help does not mention -%s", f.Name)
		}
		if strings.TrimSpace(f.Usage) == "" {
			t.Errorf("-%s has no description", f.Name)
		}
	})
	if n < 20 {
		t.Errorf("only %d flags", n)
	}
}

func TestHTTPModeUnavailable(t *testing.T) {
	saved := llmbench.HTTPRunner
	llmbench.HTTPRunner = nil
	t.Cleanup(func() { llmbench.HTTPRunner = saved })
	var stdout, stderr bytes.Buffer
	if code := run([]string{"--mode", "http"}, &stdout, &stderr); code != 2 {
		t.Fatalf("exit %d, want 2", code)
	}
	if got := strings.TrimSpace(stderr.String()); got != "http mode needs the caddyllm plugin, which this build lacks" {
		t.Errorf("stderr %q", got)
	}
}

func TestHTTPRunWritesReport(t *testing.T) {
	if testing.Short() {
		t.Skip("starts Caddy and kvsim servers")
	}
	jsonPath := filepath.Join(t.TempDir(), "out.json")
	var stdout, stderr bytes.Buffer
	code := run([]string{"--mode", "http", "--time-scale", "4", "--workload", "gsp", "--gsp-groups", "4",
		"--gsp-prompts-per-group", "4", "--gsp-system-len", "512", "--gsp-output-len", "8", "--replicas", "2",
		"--policies", "llm_affinity/ttft,header", "--json", jsonPath}, &stdout, &stderr)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
	raw, err := os.ReadFile(jsonPath)
	if err != nil {
		t.Fatal(err)
	}
	var rep struct {
		Parameters map[string]any `json:"parameters"`
		Policies   []struct {
			Policy    string `json:"policy"`
			Completed int    `json:"completed"`
			Errors    int    `json:"errors"`
		} `json:"policies"`
	}
	if err := json.Unmarshal(raw, &rep); err != nil {
		t.Fatal(err)
	}
	if rep.Parameters["mode"] != "http" || rep.Parameters["time_scale"] != 4.0 || len(rep.Policies) != 2 {
		t.Fatalf("report %s", raw)
	}
	for _, p := range rep.Policies {
		if p.Completed != 16 || p.Errors != 0 {
			t.Errorf("%s: %d completed, %d errors", p.Policy, p.Completed, p.Errors)
		}
	}
}

func TestSimRunWritesReports(t *testing.T) {
	dir := t.TempDir()
	jsonPath, svgPath := filepath.Join(dir, "out.json"), filepath.Join(dir, "ttft.svg")
	var stdout, stderr bytes.Buffer
	code := run([]string{"--workload", "gsp", "--gsp-groups", "4", "--gsp-prompts-per-group", "4",
		"--gsp-output-len", "8", "--replicas", "2", "--policies", "llm_affinity/ttft,round_robin",
		"--json", jsonPath, "--svg", svgPath}, &stdout, &stderr)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr.String())
	}
	if !strings.Contains(stdout.String(), "llm_affinity/ttft") || !strings.Contains(stdout.String(), "round_robin") {
		t.Errorf("table:\n%s", stdout.String())
	}
	raw, err := os.ReadFile(jsonPath)
	if err != nil {
		t.Fatal(err)
	}
	var rep struct {
		Parameters map[string]any   `json:"parameters"`
		Policies   []map[string]any `json:"policies"`
	}
	if err := json.Unmarshal(raw, &rep); err != nil {
		t.Fatal(err)
	}
	if len(rep.Policies) != 2 || rep.Parameters["workload"] != "gsp" || rep.Parameters["requests"] != 16.0 {
		t.Errorf("report %s", raw)
	}
	if svg, err := os.ReadFile(svgPath); err != nil || !strings.HasPrefix(string(svg), "<svg") {
		t.Errorf("svg: %v", err)
	}
}

func TestBadArguments(t *testing.T) {
	for _, args := range [][]string{
		{"--policies", "bogus"},
		{"--mode", "carrier-pigeon"},
		{"--mode", "http", "--time-scale", "0"},
		{"--workload", "llmbench/testdata/none.jsonl", "--rate", "5"},
		{"--replicas", "0"},
		{"--requests", "-5"}, {"--kv-blocks", "-1"}, {"--output-tokens", "-5"}, {"--router-kv-capacity", "-7"},
		{"--prefill-rate", "inf"}, {"--decode-rate", "NaN"}, {"--lora-zipf", "-1"}, {"--output-estimate", "bogus"},
		{"stray"},
		{"--restart-router-at", "-1s"}, {"--restart-snapshot", "maybe"}, {"--mode", "http", "--restart-router-at", "1s"},
		{"--policies", ""}, {"--gsp-groups", "0"}, {"--mrqa-users", "-1"}, {"--noprefix-requests", "0"},
		{"--json", filepath.Join(t.TempDir(), "missing", "out.json")}, {"--svg", t.TempDir()},
	} {
		var stdout, stderr bytes.Buffer
		if code := run(args, &stdout, &stderr); code != 2 {
			t.Errorf("%v: exit %d, want 2 (%s)", args, code, stderr.String())
		}
	}
}
