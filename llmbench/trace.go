package llmbench

import (
	"bufio"
	"bytes"
	"cmp"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"slices"
	"strconv"
	"time"
)

// TraceBlockTokens is the block size of Mooncake's hash_ids: one id per 512 prompt tokens.
const TraceBlockTokens = 512

// maxTraceLine bounds one trace line (a 128k-token prompt has 256 ids, a few kB).
const maxTraceLine = 16 << 20

// traceRecord is one line of a Mooncake-format trace.
type traceRecord struct {
	Timestamp    *float64        `json:"timestamp"`
	InputLength  *int            `json:"input_length"`
	OutputLength *int            `json:"output_length"`
	HashIDs      []int64         `json:"hash_ids"`
	Model        string          `json:"model"`
	Session      json.RawMessage `json:"session"`
}

// ReadTraceFile reads a Mooncake-format trace file; see [ReadTrace].
func ReadTraceFile(path string) (*Workload, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return ReadTrace(f, path)
}

// ReadTrace reads a trace in the Mooncake format: JSON Lines, one request a line, with
// timestamp (arrival in ms), input_length and output_length (tokens), hash_ids (one id per
// 512-token prompt block, prefix-chained: equal ids mean equal prefixes) and, optionally, model
// (a LoRA adapter name) and session (a string or a number). Blank lines are skipped. name is
// used in errors, which name the offending line: "trace.jsonl:17: ...".
//
// Each hash id becomes a 512-token segment (the last one cut to the input length), so requests
// that share ids share prompt text exactly. Requests are sorted by timestamp, keeping file
// order among equal timestamps.
func ReadTrace(r io.Reader, name string) (*Workload, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), maxTraceLine)
	w := &Workload{Name: name, Params: map[string]any{"trace": name, "block_tokens": TraceBlockTokens}}
	line := 0
	for sc.Scan() {
		line++
		text := bytes.TrimSpace(sc.Bytes())
		if len(text) == 0 {
			continue
		}
		req, err := parseTraceLine(text)
		if err != nil {
			return nil, fmt.Errorf("%s:%d: %w", name, line, err)
		}
		w.Requests = append(w.Requests, req)
	}
	if err := sc.Err(); err != nil {
		if err == bufio.ErrTooLong {
			return nil, fmt.Errorf("%s:%d: line longer than %d bytes", name, line+1, maxTraceLine)
		}
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	if len(w.Requests) == 0 {
		return nil, fmt.Errorf("%s: no requests in trace", name)
	}
	slices.SortStableFunc(w.Requests, func(a, b Request) int { return cmp.Compare(a.Arrival, b.Arrival) })
	w.finish()
	return w, nil
}

func parseTraceLine(text []byte) (Request, error) {
	var rec traceRecord
	dec := json.NewDecoder(bytes.NewReader(text))
	if err := dec.Decode(&rec); err != nil {
		return Request{}, fmt.Errorf("invalid JSON: %v", err)
	}
	if dec.More() {
		return Request{}, fmt.Errorf("invalid JSON: more than one value on the line")
	}
	switch {
	case rec.Timestamp == nil:
		return Request{}, fmt.Errorf("missing timestamp")
	case rec.InputLength == nil:
		return Request{}, fmt.Errorf("missing input_length")
	case rec.OutputLength == nil:
		return Request{}, fmt.Errorf("missing output_length")
	}
	ts, in, out := *rec.Timestamp, *rec.InputLength, *rec.OutputLength
	switch {
	case ts < 0 || math.IsNaN(ts) || ts > float64(math.MaxInt64/int64(time.Millisecond)):
		return Request{}, fmt.Errorf("timestamp %v out of range (milliseconds since the start, >= 0)", ts)
	case in < 1:
		return Request{}, fmt.Errorf("input_length must be at least 1, got %d", in)
	case out < 1:
		return Request{}, fmt.Errorf("output_length must be at least 1, got %d", out)
	}
	blocks := (in + TraceBlockTokens - 1) / TraceBlockTokens
	if len(rec.HashIDs) != blocks {
		return Request{}, fmt.Errorf("hash_ids has %d ids, want ceil(input_length/%d) = %d",
			len(rec.HashIDs), TraceBlockTokens, blocks)
	}
	req := Request{
		Arrival:      time.Duration(ts * float64(time.Millisecond)),
		OutputTokens: out,
		Model:        rec.Model,
		Segments:     make([]Segment, blocks),
	}
	for i, id := range rec.HashIDs {
		tokens := TraceBlockTokens
		if i == blocks-1 {
			tokens = in - TraceBlockTokens*(blocks-1)
		}
		req.Segments[i] = Segment{ID: segmentID("trace", id, 0), Tokens: tokens}
	}
	session, err := sessionString(rec.Session)
	if err != nil {
		return Request{}, err
	}
	req.Session = session
	return req, nil
}

// sessionString accepts a session given as a JSON string or number.
func sessionString(raw json.RawMessage) (string, error) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || bytes.Equal(raw, []byte("null")) {
		return "", nil
	}
	if raw[0] == '"' {
		var s string
		if err := json.Unmarshal(raw, &s); err != nil {
			return "", fmt.Errorf("session: %v", err)
		}
		return s, nil
	}
	var n json.Number
	if err := json.Unmarshal(raw, &n); err != nil {
		return "", fmt.Errorf("session must be a string or a number")
	}
	if _, err := strconv.ParseFloat(n.String(), 64); err != nil {
		return "", fmt.Errorf("session must be a string or a number")
	}
	return n.String(), nil
}
