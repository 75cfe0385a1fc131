package llmbench

import (
	"bytes"
	"strings"
	"testing"
)

const sampleTrace = "testdata/mooncake_conversation_head300.jsonl"

func TestReadTraceSample(t *testing.T) {
	w, err := ReadTraceFile(sampleTrace)
	if err != nil {
		t.Fatal(err)
	}
	if got := len(w.Requests); got != 300 {
		t.Fatalf("requests = %d, want 300", got)
	}
	first := w.Requests[0]
	if first.PromptTokens != 6758 || first.OutputTokens != 500 || len(first.Segments) != 14 {
		t.Fatalf("first request = %d prompt, %d output, %d segments; want 6758, 500, 14",
			first.PromptTokens, first.OutputTokens, len(first.Segments))
	}
	if first.Segments[13].Tokens != 6758-13*512 {
		t.Errorf("last segment has %d tokens, want %d", first.Segments[13].Tokens, 6758-13*512)
	}
	if first.MaxTokens != first.OutputTokens {
		t.Errorf("max_tokens = %d, want the output length %d", first.MaxTokens, first.OutputTokens)
	}
	for i := 1; i < len(w.Requests); i++ {
		if w.Requests[i].Arrival < w.Requests[i-1].Arrival {
			t.Fatalf("request %d arrives before request %d", i, i-1)
		}
	}

	// Requests 0 and 1 share hash id 0 only: their prompts share exactly one 512-token block.
	a := w.Requests[0].AppendPrompt(nil)
	b := w.Requests[1].AppendPrompt(nil)
	if len(a) != 6758*BytesPerToken {
		t.Fatalf("prompt is %d bytes, want %d", len(a), 6758*BytesPerToken)
	}
	common := 0
	for common < min(len(a), len(b)) && a[common] == b[common] {
		common++
	}
	if block := TraceBlockTokens * BytesPerToken; common < block || common >= block+BytesPerToken*8 {
		t.Errorf("prompts share %d bytes, want one block (%d) and almost nothing more", common, block)
	}
}

func TestReadTraceBadLineNamesTheLine(t *testing.T) {
	good := `{"timestamp": 0, "input_length": 600, "output_length": 10, "hash_ids": [1, 2]}`
	cases := []struct {
		name, line, want string
	}{
		{"syntax", `{"timestamp": 0, "input_length": 600,`, "invalid JSON"},
		{"not an object", `[1, 2, 3]`, "invalid JSON"},
		{"missing timestamp", `{"input_length": 600, "output_length": 10, "hash_ids": [1, 2]}`, "missing timestamp"},
		{"missing input", `{"timestamp": 0, "output_length": 10, "hash_ids": [1, 2]}`, "missing input_length"},
		{"zero output", `{"timestamp": 0, "input_length": 600, "output_length": 0, "hash_ids": [1, 2]}`, "output_length must be at least 1"},
		{"negative timestamp", `{"timestamp": -5, "input_length": 600, "output_length": 10, "hash_ids": [1, 2]}`, "timestamp"},
		{"too few ids", `{"timestamp": 0, "input_length": 1100, "output_length": 10, "hash_ids": [1, 2]}`, "hash_ids has 2 ids, want ceil(input_length/512) = 3"},
		{"fractional length", `{"timestamp": 0, "input_length": 60.5, "output_length": 10, "hash_ids": [1]}`, "invalid JSON"},
		{"bad session", `{"timestamp": 0, "input_length": 600, "output_length": 10, "hash_ids": [1, 2], "session": {}}`, "session"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			// Line 4: two good lines and a blank one come first.
			input := good + "\n" + good + "\n\n" + tc.line + "\n" + good + "\n"
			_, err := ReadTrace(strings.NewReader(input), "t.jsonl")
			if err == nil {
				t.Fatal("no error")
			}
			if !strings.HasPrefix(err.Error(), "t.jsonl:4: ") || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %q, want it to start with t.jsonl:4: and mention %q", err, tc.want)
			}
		})
	}
}

func TestReadTraceOptionalFields(t *testing.T) {
	input := `{"timestamp": 2000, "input_length": 10, "output_length": 3, "hash_ids": [7], "model": "tenant-a", "session": 42}
{"timestamp": 1000.5, "input_length": 10, "output_length": 3, "hash_ids": [7], "session": "s-1", "extra": true}
`
	w, err := ReadTrace(strings.NewReader(input), "opt.jsonl")
	if err != nil {
		t.Fatal(err)
	}
	// Sorted by timestamp.
	if w.Requests[0].Session != "s-1" || w.Requests[1].Session != "42" || w.Requests[1].Model != "tenant-a" {
		t.Errorf("got sessions %q, %q and model %q", w.Requests[0].Session, w.Requests[1].Session, w.Requests[1].Model)
	}
	if w.Requests[0].Arrival.Milliseconds() != 1000 {
		t.Errorf("arrival = %v, want 1000.5ms", w.Requests[0].Arrival)
	}
	if len(w.Adapters) != 1 || w.Adapters[0] != "tenant-a" {
		t.Errorf("adapters = %v", w.Adapters)
	}
}

func TestReadTraceEmpty(t *testing.T) {
	if _, err := ReadTrace(bytes.NewReader(nil), "empty.jsonl"); err == nil || !strings.Contains(err.Error(), "no requests") {
		t.Errorf("error = %v, want no requests", err)
	}
}
