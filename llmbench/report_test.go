package llmbench

import (
	"bytes"
	"encoding/json"
	"encoding/xml"
	"io"
	"math"
	"strings"
	"testing"
	"time"
)

func sampleResults() *Results {
	return &Results{
		Policy: "llm_affinity/ttft",
		Replicas: []ReplicaResult{
			{Name: "a", Requests: 3, PromptTokens: 300, OutputTokens: 30, PrefixQueries: 300, PrefixHits: 150},
			{Name: "b", Requests: 1, PromptTokens: 100, OutputTokens: 10, PrefixQueries: 100, PrefixHits: 50},
		},
		Requests: []RequestResult{
			{Index: 0, Replica: 0, Arrival: 0, TTFT: 100 * time.Millisecond, E2E: time.Second, PromptTokens: 100, OutputTokens: 10},
			{Index: 1, Replica: 0, Arrival: time.Second, TTFT: 200 * time.Millisecond, E2E: 2 * time.Second, PromptTokens: 100, CachedTokens: 100, OutputTokens: 10},
			{Index: 2, Replica: 0, Arrival: time.Second, TTFT: 300 * time.Millisecond, E2E: time.Second, PromptTokens: 100, CachedTokens: 50, OutputTokens: 10},
			{Index: 3, Replica: 1, Arrival: 2 * time.Second, TTFT: 400 * time.Millisecond, E2E: 2 * time.Second, PromptTokens: 100, OutputTokens: 10},
			{Index: 4, Replica: -1, Arrival: 2 * time.Second, Shed: true},
			{Index: 5, Replica: 1, Arrival: 2 * time.Second, Err: "boom"},
		},
	}
}

func TestSummarize(t *testing.T) {
	s := Summarize(sampleResults())
	check := func(name string, got, want float64) {
		t.Helper()
		if got != want && math.Abs(got-want) > 1e-9 {
			t.Errorf("%s = %v, want %v", name, got, want)
		}
	}
	check("hit rate", s.HitRate, 0.5)
	// Over all six requests, the shed and the failed one as +Inf: 0.1 0.2 0.3 0.4 inf inf.
	check("ttft p50", s.TTFTP50, 0.3)
	check("ttft p90", s.TTFTP90, math.Inf(1))
	check("ttft p99", s.TTFTP99, math.Inf(1))
	check("ttft mean", s.TTFTMean, 0.25) // over the four served
	check("e2e p50", s.E2EP50, 2)        // 1 1 2 2 inf inf
	check("e2e p99", s.E2EP99, math.Inf(1))
	check("throughput", s.Throughput, 40.0/4) // 40 tokens from t=0 to t=4s
	check("goodput", s.Goodput, 4.0/4)        // 4 served from t=0 to t=4s
	check("max/mean load", s.MaxMeanLoad, 1.5)
	check("max/mean tokens", s.MaxMeanTokens, 330.0/220)
	// Requests 0 and 3 found nothing of their prompts cached; the shed and the failed one
	// were not served.
	if s.Shed != 1 || s.Errors != 1 || s.Completed != 4 || s.Requests != 6 || s.Cold != 2 {
		t.Errorf("counts: %+v", s)
	}
}

func TestWriteTableAndJSON(t *testing.T) {
	sums := []Summary{Summarize(sampleResults()), Summarize(&Results{Policy: "round_robin"})}
	var table bytes.Buffer
	if err := WriteTable(&table, sums); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"policy", "hit rate", "cold", "TTFT p50", "goodput req/s", "llm_affinity/ttft", "50.0%", "inf", "round_robin"} {
		if !strings.Contains(table.String(), want) {
			t.Errorf("table lacks %q:\n%s", want, table.String())
		}
	}

	var out bytes.Buffer
	if err := WriteJSON(&out, Report{Parameters: map[string]any{"replicas": 2}, Policies: sums}); err != nil {
		t.Fatal(err)
	}
	var back struct {
		Parameters map[string]any   `json:"parameters"`
		Policies   []map[string]any `json:"policies"`
	}
	if err := json.Unmarshal(out.Bytes(), &back); err != nil {
		t.Fatalf("%v\n%s", err, out.String())
	}
	if back.Parameters["replicas"] != 2.0 || len(back.Policies) != 2 {
		t.Fatalf("parsed %+v", back)
	}
	for _, key := range []string{"hit_rate", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "e2e_p50_s", "e2e_p99_s", "throughput_tok_s", "goodput_req_s", "max_mean_load", "cold", "shed", "errors"} {
		if _, ok := back.Policies[0][key]; !ok {
			t.Errorf("policy entry lacks %s", key)
		}
	}
	// A percentile that failed requests reach is the string "+Inf"; a served one a number.
	if v := back.Policies[0]["ttft_p99_s"]; v != "+Inf" {
		t.Errorf("ttft_p99_s = %#v, want \"+Inf\"", v)
	}
	if v := back.Policies[0]["ttft_p50_s"]; v != 0.3 {
		t.Errorf("ttft_p50_s = %#v, want 0.3", v)
	}
	// An empty replay has no percentiles: null, not a JSON error.
	if v, ok := back.Policies[1]["ttft_p50_s"]; !ok || v != nil {
		t.Errorf("empty replay ttft_p50_s = %v, want null", v)
	}
}

func TestWriteSVG(t *testing.T) {
	sums := []Summary{Summarize(sampleResults()), Summarize(&Results{Policy: "round<robin>"})}
	var out bytes.Buffer
	if err := WriteSVG(&out, "TTFT & friends", sums); err != nil {
		t.Fatal(err)
	}
	dec := xml.NewDecoder(&out)
	lines, texts := 0, []string{}
	for {
		tok, err := dec.Token()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatalf("not well-formed XML: %v", err)
		}
		switch el := tok.(type) {
		case xml.StartElement:
			if el.Name.Local == "polyline" {
				lines++
			}
		case xml.CharData:
			texts = append(texts, string(el))
		}
	}
	if lines != 1 {
		t.Errorf("%d CDF lines, want 1 (the empty replay has none)", lines)
	}
	all := strings.Join(texts, "|")
	for _, want := range []string{"TTFT & friends", "time to first token", "llm_affinity/ttft", "round<robin>", "100ms"} {
		if !strings.Contains(all, want) {
			t.Errorf("SVG text lacks %q: %s", want, all)
		}
	}
}

func TestParsePolicies(t *testing.T) {
	all, err := ParsePolicies("all")
	if err != nil || len(all) != 10 || all[0] != "llm_affinity/ttft" {
		t.Fatalf("all = %v, %v", all, err)
	}
	got, err := ParsePolicies(" round_robin, llm_affinity/llmd,round_robin")
	if err != nil || len(got) != 2 || got[1] != "llm_affinity/llmd" {
		t.Errorf("got %v, %v", got, err)
	}
	for _, bad := range []string{"llm_affinity/bogus", "weighted", "llm_affinity/", "", " , "} {
		if _, err := ParsePolicies(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
	if s, ok := AffinityStrategy("llm_affinity"); !ok || s != "ttft" {
		t.Errorf("llm_affinity alone = %v, %v", s, ok)
	}
}
