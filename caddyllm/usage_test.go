package caddyllm

import (
	"bytes"
	"encoding/json"
	"reflect"
	"strings"
	"testing"
)

// refUsageOfBody is usageOfBody as it was before the scanner read the
// usage: encoding/json decodes the value after the last "usage" key.
func refUsageOfBody(body []byte) (*usage, bool) {
	rest, ok := usageValue(body)
	if !ok {
		return nil, false
	}
	var u usage
	if err := json.NewDecoder(bytes.NewReader(rest)).Decode(&u); err != nil {
		return nil, false
	}
	return &u, true
}

// chunkCorpus is streamed chunks as engines send them, and odd ones.
var chunkCorpus = []string{
	`{"id":"cmpl-1","object":"text_completion","created":1700000000,"model":"m","choices":[{"index":0,"text":" a","logprobs":null,"finish_reason":null}],"usage":null}`,
	`{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}`,
	`{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"caf\u00e9 \"q\" \ud83d\ude00\n"},"finish_reason":null}]}`,
	`{"id":"x","choices":[{"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\"a\":1}"}}],"content":null}}]}`,
	`{"id":"x","choices":[],"usage":{"prompt_tokens":2000,"completion_tokens":3,"total_tokens":2003,"prompt_tokens_details":{"cached_tokens":1500}}}`,
	`{"id":"x","choices":[{"delta":{}}],"usage":{"prompt_tokens":1,"prompt_tokens_details":null}}`,
	`{"choices":[{"text":"a"},{"text":"b"}]}`, `{"choices":[null,{"text":"b"}]}`, `{"choices":[{"text":null,"delta":{"content":"c"}}]}`,
	`{"choices":[{"text":"a","delta":{"content":"c"}}]}`, `{"choices":null}`, `{"choices":[1]}`, `{"choices":[{"text":1}]}`,
	`{"Choices":[{"text":"a"}]}`, `{"choices":[{"TEXT":"a"}]}`, `{"id":"a","id":"b"}`, `{"choices":[{"text":"a","text":"b"}]}`,
	`{"created":1.5}`, `{"created":"1"}`, `{"created":null,"id":"a"}`, `{"usage":{"completion_tokens":1e3}}`, `{"usage":{"completion_tokens":null}}`,
	`{"usage":{"prompt_tokens_details":{"cached_tokens":7,"other":[1]}}}`, `{"usage":{"prompt_tokens_details":{"Cached_Tokens":7}}}`,
	`{"usage":{"completion_tokens":4},"usage":null}`, `{"usage":[]}`, `null`, `[]`, `{"choices":[{"text":"a"}]} x`, `{"choices":[{"text":"a"`,
	"{\"choices\":[{\"text\":\"bad \xff utf8\"}]}", `{"id":"\u0000","model":"\ud800"}`,
	`{"a":` + strings.Repeat("[", 200) + strings.Repeat("]", 200) + `,"choices":[{"text":"deep"}]}`,
}

// sameAsDecode checks that when readChunk reads a chunk, encoding/json
// decodes it to the same fields.
func sameAsDecode(t *testing.T, data []byte) {
	t.Helper()
	var f chunkFields
	if !readChunk(data, &f) {
		return
	}
	var c streamChunk
	if err := json.Unmarshal(data, &c); err != nil {
		t.Fatalf("%q: read, but encoding/json says %v", data, err)
	}
	rec := newTokenRecorder(nil, &requestState{req: &Request{}})
	rec.recordChunk(data, &f)
	text, _ := c.text()
	if rec.generated.String() != text || (text != "" || generatesOtherwise(data)) != (rec.tokens == 1) {
		t.Fatalf("%q: text %q, encoding/json %q", data, rec.generated.String(), text)
	}
	if c.ID != "" && (rec.streamID != c.ID || rec.streamObject != c.Object || rec.streamModel != c.Model || rec.streamCreated != c.Created) {
		t.Fatalf("%q: identity %q %q %q %d, encoding/json %+v", data, rec.streamID, rec.streamObject, rec.streamModel, rec.streamCreated, c)
	}
	if !reflect.DeepEqual(rec.usage, c.Usage) {
		t.Fatalf("%q: usage %+v, encoding/json %+v", data, rec.usage, c.Usage)
	}
}

func TestChunkMatchesDecode(t *testing.T) {
	read := 0
	for _, c := range chunkCorpus {
		sameAsDecode(t, []byte(c))
		if readChunk([]byte(c), new(chunkFields)) {
			read++
		}
	}
	if read < 10 {
		t.Fatalf("only %d chunks read without encoding/json", read)
	}
}

// FuzzChunkMatchesDecode: whatever the chunk, what readChunk reads is
// what encoding/json decodes.
func FuzzChunkMatchesDecode(f *testing.F) {
	for _, c := range chunkCorpus {
		f.Add([]byte(c))
	}
	f.Fuzz(func(t *testing.T, data []byte) { sameAsDecode(t, data) })
}

// usageCorpus is completion bodies with and without usage.
var usageCorpus = []string{
	`{"choices":[{"text":"a \"usage\": 5"}],"usage":{"prompt_tokens":3,"completion_tokens":9}}`,
	`{"usage": {"completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 2}}, "id": "x"}`,
	`{"choices":[],"usage":{"completion_tokens":4`, `{"choices":[]}`, `not json "usage":{}`, `{"usage":null}`,
	`{"usage":{"completion_tokens":1.5}}`, `{"usage":{"Completion_Tokens":4}}`, `{"usage":{"completion_tokens":4,"completion_tokens":5}}`,
	`{"usage":{"completion_tokens":4} garbage}`, `{"usage":[1]}`, `{"usage":"x"}`, `{"usage":{"prompt_tokens_details":{"cached_tokens":null}}}`,
	`{"id":"cmpl","object":"text_completion","choices":[{"index":0,"text":"hello","finish_reason":"length"}],"usage":{"prompt_tokens":10,"total_tokens":26,"completion_tokens":16,"prompt_tokens_details":null}}`,
}

func sameUsageAsDecode(t *testing.T, body []byte) {
	got, ok := usageOfBody(body)
	want, refOK := refUsageOfBody(body)
	if ok != refOK || !reflect.DeepEqual(got, want) {
		t.Fatalf("%q: %+v %v, encoding/json %+v %v", body, got, ok, want, refOK)
	}
}

func TestUsageOfBodyMatchesDecode(t *testing.T) {
	for _, b := range usageCorpus {
		sameUsageAsDecode(t, []byte(b))
	}
}

// FuzzUsageOfBody: the usage read from a body is the one encoding/json
// decodes.
func FuzzUsageOfBody(f *testing.F) {
	for _, b := range usageCorpus {
		f.Add([]byte(b))
	}
	f.Fuzz(func(t *testing.T, body []byte) { sameUsageAsDecode(t, body) })
}

// BenchmarkResponseUsage is the recorder's read of a response: a streamed
// chunk (read, and as encoding/json decoded it before), and a completion
// body's usage (read, and decoded).
func BenchmarkResponseUsage(b *testing.B) {
	chunk := []byte(`{"id":"chatcmpl-5f0c","object":"chat.completion.chunk","created":1732000000,"model":"meta-llama/Llama-3.1-8B-Instruct","choices":[{"index":0,"delta":{"content":" token"},"logprobs":null,"finish_reason":null}],"usage":null}`)
	body := []byte(`{"id":"cmpl-5f0c","object":"text_completion","created":1732000000,"model":"meta-llama/Llama-3.1-8B-Instruct","choices":[{"index":0,"text":"` +
		strings.Repeat("generated text ", 60) + `","logprobs":null,"finish_reason":"length","stop_reason":null}],"usage":{"prompt_tokens":130,"total_tokens":386,"completion_tokens":256,"prompt_tokens_details":null}}`)
	b.Run("chunk/read", func(b *testing.B) {
		b.ReportAllocs()
		rec := newTokenRecorder(nil, &requestState{req: &Request{}})
		rec.streamID = "known"
		for b.Loop() {
			var f chunkFields
			if !readChunk(chunk, &f) {
				b.Fatal("not read")
			}
			rec.recordChunk(chunk, &f)
			rec.generated.Reset()
		}
	})
	b.Run("chunk/decode", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			var c streamChunk
			if json.Unmarshal(chunk, &c) != nil {
				b.Fatal("not decoded")
			}
		}
	})
	b.Run("body/read", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, ok := usageOfBody(body); !ok {
				b.Fatal("no usage")
			}
		}
	})
	b.Run("body/decode", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, ok := refUsageOfBody(body); !ok {
				b.Fatal("no usage")
			}
		}
	})
}
