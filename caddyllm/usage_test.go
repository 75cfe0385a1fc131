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
func refUsageOfBody(body []byte, responses bool) (reportedUsage, bool) {
	rest, ok := refUsageValue(body)
	if !ok {
		return reportedUsage{}, false
	}
	u, ok := decodeUsage(rest, responses)
	if !ok {
		return reportedUsage{}, false
	}
	return u.reported(), true
}

// refUsageValue is usageValue as first written, finding the last "usage"
// key with bytes.LastIndex.
func refUsageValue(body []byte) ([]byte, bool) {
	body = bytes.TrimSpace(body)
	return valueAfterUsageKey(body, bytes.LastIndex(body, []byte(`"usage"`)))
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
	if string(rec.generated) != text || (text != "" || generatesOtherwise(data)) != (rec.tokens == 1) {
		t.Fatalf("%q: text %q, encoding/json %q", data, string(rec.generated), text)
	}
	if c.ID != "" && (rec.streamID != c.ID || rec.streamObject != c.Object || rec.streamModel != c.Model || rec.streamCreated != c.Created) {
		t.Fatalf("%q: identity %q %q %q %d, encoding/json %+v", data, rec.streamID, rec.streamObject, rec.streamModel, rec.streamCreated, c)
	}
	if rec.hasUsage != (c.Usage != nil) || (c.Usage != nil && rec.usage != c.Usage.reported()) {
		t.Fatalf("%q: usage %v %+v, encoding/json %+v", data, rec.hasUsage, rec.usage, c.Usage)
	}
}

// responseEventCorpus is Responses API stream events as vLLM and OpenAI
// send them, and odd ones.
var responseEventCorpus = []string{
	`{"type":"response.created","response":{"id":"resp_1","object":"response","status":"in_progress","output":[],"usage":null},"sequence_number":0}`,
	`{"type":"response.output_text.delta","item_id":"msg_1","output_index":0,"content_index":0,"delta":"caf\u00e9 \"q\"","logprobs":[],"sequence_number":4}`,
	`{"sequence_number":5,"delta":"x","type":"response.output_text.delta"}`,
	`{"type":"response.function_call_arguments.delta","item_id":"fc_1","output_index":1,"delta":"{\"a\":","sequence_number":6}`,
	`{"type":"response.reasoning_text.delta","delta":"","sequence_number":7}`,
	`{"response":{"id":"resp_1","output":[{"type":"message","content":[{"type":"output_text","text":"a \"usage\": {}"}]}],"usage":{"input_tokens":12,"input_tokens_details":{"cached_tokens":8},"output_tokens":3,"total_tokens":15}},"sequence_number":9,"type":"response.completed"}`,
	`{"type":"response.incomplete","response":{"incomplete_details":{"reason":"max_output_tokens"},"usage":{"input_tokens":4,"output_tokens":16}}}`,
	`{"type":"response.failed","response":{"error":{"code":"server_error","message":"x"},"usage":null}}`,
	`{"type":"error","code":"x","message":"y","param":null,"sequence_number":3}`,
	`{"type":"response.completed","response":null}`, `{"type":"response.completed","response":{"usage":{"Input_Tokens":1}}}`,
	`{"TYPE":"response.completed"}`, `{"type":"a","type":"b"}`, `{"type":5}`, `{"delta":{"a":1},"type":"x.delta"}`, `{"delta":null,"type":"x.delta"}`,
	`{"type":"response.output_text.delta","delta":"a"} x`, `{"type":"x"`, `null`, `[]`, `{"response":[]}`,
}

// wholeEvent gives rec a Responses stream event: its data, then its end.
func wholeEvent(rec *tokenRecorder, data []byte) {
	rec.responseEvent(data)
	rec.event(nil, false)
}

// sameEventAsDecode checks that when readResponseEvent reads an event,
// the recorder records what it records from encoding/json's decoding.
func sameEventAsDecode(t *testing.T, data []byte) {
	t.Helper()
	var ev responseEvent
	if !readResponseEvent(data, &ev) {
		return
	}
	if !json.Valid(data) {
		t.Fatalf("%q: read, but it is not JSON", data)
	}
	read := newTokenRecorder(nil, &requestState{req: &Request{Endpoint: EndpointResponses}})
	wholeEvent(read, data)
	// The same event with a key the reader gives up on goes to
	// encoding/json.
	decoded := newTokenRecorder(nil, &requestState{req: &Request{Endpoint: EndpointResponses}})
	wholeEvent(decoded, append([]byte(`{"Type":null,`), bytes.TrimPrefix(bytes.TrimSpace(data), []byte("{"))...))
	if read.tokens != decoded.tokens || read.done != decoded.done || read.failed != decoded.failed || !reflect.DeepEqual(read.usage, decoded.usage) ||
		read.responseID != decoded.responseID || read.lastSeq != decoded.lastSeq {
		t.Fatalf("%q: read %d %v %v %+v %q, encoding/json %d %v %v %+v %q", data, read.tokens, read.done, read.failed, read.usage, read.responseID,
			decoded.tokens, decoded.done, decoded.failed, decoded.usage, decoded.responseID)
	}
}

// TestResponseEvents: deltas are tokens, response.completed and
// response.incomplete end the stream with its usage, response.failed and
// error fail it; what the reader reads, encoding/json reads alike.
func TestResponseEvents(t *testing.T) {
	rec := newTokenRecorder(nil, &requestState{req: &Request{Endpoint: EndpointResponses}})
	for _, i := range []int{0, 1, 2, 3, 4, 5} {
		wholeEvent(rec, []byte(responseEventCorpus[i]))
	}
	if rec.tokens != 3 || !rec.done || rec.failed || !rec.hasUsage || rec.usage.promptTokens != 12 ||
		rec.usage.completionTokens != 3 || rec.cachedTokens() != 8 {
		t.Fatalf("tokens %d done %v failed %v usage %+v cached %d", rec.tokens, rec.done, rec.failed, rec.usage, rec.cachedTokens())
	}
	failed := newTokenRecorder(nil, &requestState{req: &Request{Endpoint: EndpointResponses}})
	wholeEvent(failed, []byte(responseEventCorpus[7]))
	if !failed.failed {
		t.Fatal("response.failed not recorded")
	}
	for _, e := range responseEventCorpus {
		sameEventAsDecode(t, []byte(e))
	}
}

// FuzzResponseEvent: what the reader reads of an event is what
// encoding/json decodes.
func FuzzResponseEvent(f *testing.F) {
	for _, e := range responseEventCorpus {
		f.Add([]byte(e))
	}
	f.Fuzz(func(t *testing.T, data []byte) { sameEventAsDecode(t, data) })
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

// sameAsWhole feeds template, then chunk, to a recorder that knows the
// template's shape and to one that reads every chunk whole, and fails when
// they record anything differently.
func sameAsWhole(t *testing.T, template, chunk []byte) {
	t.Helper()
	fast := newTokenRecorder(nil, &requestState{req: &Request{}})
	whole := newTokenRecorder(nil, &requestState{req: &Request{}})
	for _, data := range [][]byte{template, chunk} {
		line := append([]byte("data: "), data...)
		fast.event(line, false)
		whole.shape, whole.shapeText = whole.shape[:0], 0
		whole.event(line, false)
	}
	if fast.tokens != whole.tokens || string(fast.generated) != string(whole.generated) || fast.usage != whole.usage ||
		fast.hasUsage != whole.hasUsage || fast.streamID != whole.streamID || fast.streamObject != whole.streamObject ||
		fast.streamModel != whole.streamModel || fast.streamCreated != whole.streamCreated || fast.done != whole.done || fast.failed != whole.failed {
		t.Fatalf("%q then %q: recorded %d %q usage %v %+v, read whole %d %q usage %v %+v", template, chunk,
			fast.tokens, string(fast.generated), fast.hasUsage, fast.usage, whole.tokens, string(whole.generated), whole.hasUsage, whole.usage)
	}
}

// TestChunkOfTheSameShape: a token chunk that differs from the last one
// read whole only in its text is read by its shape (no scan), and
// recorded as if read whole; anything else around the text is read whole.
func TestChunkOfTheSameShape(t *testing.T) {
	template := `{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"a"},"logprobs":null,"finish_reason":null}]}`
	head, tail, _ := strings.Cut(template, `"a"`)
	for _, text := range []string{`b`, `caf\u00e9 \"q\" \ud83d\ude00\n`, "\xff", `\"},"x":{"`, `"`, `a"b`, `\q`, "\x01", `\`, ``, `a","b`} {
		sameAsWhole(t, []byte(template), []byte(head+`"`+text+`"`+tail))
	}
	rec := newTokenRecorder(nil, &requestState{req: &Request{}})
	rec.event([]byte("data: "+template), false)
	if !rec.sameShape([]byte(head+`"next"`+tail)) || string(rec.generated) != "anext" || rec.tokens != 2 {
		t.Fatalf("the same chunk with another text not read by its shape: %d %q", rec.tokens, string(rec.generated))
	}
	for _, other := range []string{
		strings.Replace(template, `"created":1`, `"created":2`, 1),
		strings.Replace(template, `"finish_reason":null`, `"finish_reason":"stop"`, 1),
		head + `""` + tail, // no text: a tool call or reasoning may be what it generates
		head + `"x"` + tail + ` `,
	} {
		if rec.sameShape([]byte(other)) {
			t.Errorf("%s read by its shape", other)
		}
		sameAsWhole(t, []byte(template), []byte(other))
	}
	// A chunk with usage is not a shape: the next one without it is read whole.
	withUsage := strings.Replace(template, `}]}`, `}],"usage":{"prompt_tokens":1,"completion_tokens":2,"total_tokens":3}}`, 1)
	sameAsWhole(t, []byte(withUsage), []byte(strings.Replace(withUsage, `"a"`, `"b"`, 1)))
}

// FuzzChunkOfTheSameShape: a chunk made of a token chunk's bytes around
// any text is recorded as if read whole, after that token chunk.
func FuzzChunkOfTheSameShape(f *testing.F) {
	for i, c := range chunkCorpus {
		f.Add([]byte(c), []byte(`x \"y\" \u00e9`), uint8(i))
	}
	f.Fuzz(func(t *testing.T, template, text []byte, cut uint8) {
		var fields chunkFields
		if !readChunk(template, &fields) || fields.text.end <= fields.text.start {
			// Not a template: any chunk after any other.
			if n := len(template); n > 0 {
				sameAsWhole(t, template[:int(cut)%n], template[int(cut)%n:])
			}
			return
		}
		chunk := append(append(append([]byte(nil), template[:fields.text.start]...), text...), template[fields.text.end:]...)
		sameAsWhole(t, template, chunk)
	})
}

// usageCorpus is completion bodies with and without usage.
var usageCorpus = []string{
	// A key ending in usage after the usage, and usage" at the start.
	`{"usage":{"prompt_tokens":3},"xusage":2}`, `usage":{}}`, `{"usage"usage":1}`,
	`{"choices":[{"text":"a \"usage\": 5"}],"usage":{"prompt_tokens":3,"completion_tokens":9}}`,
	`{"usage": {"completion_tokens": 4, "prompt_tokens_details": {"cached_tokens": 2}}, "id": "x"}`,
	`{"choices":[],"usage":{"completion_tokens":4`, `{"choices":[]}`, `not json "usage":{}`, `{"usage":null}`,
	`{"usage":{"completion_tokens":1.5}}`, `{"usage":{"Completion_Tokens":4}}`, `{"usage":{"completion_tokens":4,"completion_tokens":5}}`,
	`{"usage":{"completion_tokens":4} garbage}`, `{"usage":[1]}`, `{"usage":"x"}`, `{"usage":{"prompt_tokens_details":{"cached_tokens":null}}}`,
	`{"id":"cmpl","object":"text_completion","choices":[{"index":0,"text":"hello","finish_reason":"length"}],"usage":{"prompt_tokens":10,"total_tokens":26,"completion_tokens":16,"prompt_tokens_details":null}}`,
	// The Responses API's.
	`{"id":"resp_1","object":"response","status":"completed","output":[{"type":"message","content":[{"type":"output_text","text":"hi"}]}],"usage":{"input_tokens":12,"input_tokens_details":{"cached_tokens":8},"output_tokens":3,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":15}}`,
	`{"usage":{"input_tokens":1,"input_tokens_details":null}}`, `{"usage":{"Input_Tokens":1}}`, `{"usage":{"output_tokens":1,"output_tokens":2}}`,
}

func sameUsageAsDecode(t *testing.T, body []byte) {
	for _, responses := range []bool{false, true} {
		got, ok := usageOfBody(body, responses)
		want, refOK := refUsageOfBody(body, responses)
		if ok != refOK || !reflect.DeepEqual(got, want) {
			t.Fatalf("%q (responses %v): %+v %v, encoding/json %+v %v", body, responses, got, ok, want, refOK)
		}
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
			rec.generated = rec.generated[:0]
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
			if _, ok := usageOfBody(body, false); !ok {
				b.Fatal("no usage")
			}
		}
	})
	b.Run("body/decode", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			if _, ok := refUsageOfBody(body, false); !ok {
				b.Fatal("no usage")
			}
		}
	})
}

// modelBodies are request bodies for modelOfBody, with the model it reads.
var modelBodies = []struct{ body, model string }{
	{`{"model":"embed-B","input":"hello"}`, "embed-B"},
	{` {"input":["a","b"], "model" : "org\/m\u00e9"} `, "org/mé"},
	{`{"input":"hello"}`, ""},
	{`{"model":null,"input":"x"}`, ""},
	{`{"model":7}`, ""},
	{`{"model":"a","model":"b"}`, ""}, // twice: for the engine to read
	{`{"Model":"a"}`, ""},
	{`{"model":"a"`, ""},
	{`{"model":"a"} trailing`, ""},
	{`["model","a"]`, ""},
	{`{"input":` + strings.Repeat("[", 200) + strings.Repeat("]", 200) + `,"model":"deep"}`, ""},
	{`{"input":[[1,2]],"extra":{"model":"inner"},"model":"outer"}`, "outer"},
}

// TestModelOfBody: the model of a pass-through request, read without
// decoding the body.
func TestModelOfBody(t *testing.T) {
	for _, tc := range modelBodies {
		if got := modelOfBody([]byte(tc.body)); got != tc.model {
			t.Errorf("%.60s: %q, want %q", tc.body, got, tc.model)
		}
	}
}

// TestAdapterCallOfBody: the adapter a load or unload names and whether it
// asks for an in-place load, load_inplace read as vLLM's request model reads
// a boolean; a body the scanner does not read whole names no adapter.
func TestAdapterCallOfBody(t *testing.T) {
	for _, tc := range []struct {
		body    string
		name    string
		inplace bool
	}{
		{`{"lora_name":"tenant","lora_path":"/a"}`, "tenant", false},
		{`{"lora_name":"tenant","lora_path":"/a","load_inplace":true}`, "tenant", true},
		{`{"load_inplace":true,"lora_path":"/a","lora_name":"tenant"}`, "tenant", true},
		{`{"lora_name":"tenant","load_inplace":false}`, "tenant", false},
		{`{"lora_name":"tenant","load_inplace":"yes"}`, "tenant", true},
		{`{"lora_name":"tenant","load_inplace":1}`, "tenant", true},
		{`{"lora_name":"tenant","load_inplace":0}`, "tenant", false},
		{`{"lora_name":"tenant","load_inplace":null}`, "tenant", false},
		{`{"lora_name":"tenant","load_inplace":"maybe"}`, "tenant", false},
		{`{"lora_name":"tenant","load_inplace":{"x":true}}`, "tenant", false},
		{`{"lora_name":"t\u00e9","load_inplace":true}`, "té", true},
		{`{"lora_path":"/a","load_inplace":true}`, "", false},
		{`{"lora_name":"tenant","load_inplace":true,"load_inplace":false}`, "", false}, // twice: for the engine to read
		{`{"lora_name":"tenant","load_inplace":true`, "", false},
	} {
		name, inplace := adapterCallOfBody([]byte(tc.body))
		if name != tc.name || inplace != tc.inplace {
			t.Errorf("%s: %q %v, want %q %v", tc.body, name, inplace, tc.name, tc.inplace)
		}
	}
}

// FuzzModelOfBody: a model read from a body is the one encoding/json
// decodes from it.
func FuzzModelOfBody(f *testing.F) {
	for _, tc := range modelBodies {
		f.Add([]byte(tc.body))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		model := modelOfBody(body)
		if model == "" {
			return
		}
		var v struct{ Model *string }
		if err := json.Unmarshal(body, &v); err != nil || v.Model == nil || *v.Model != model {
			t.Fatalf("%q: read %q, encoding/json %v %v", body, model, v.Model, err)
		}
	})
}

// FuzzAdapterCallOfBody: the adapter a load or unload names is the
// lora_name encoding/json decodes from the body, and load_inplace is read
// from the member encoding/json finds.
func FuzzAdapterCallOfBody(f *testing.F) {
	for _, b := range []string{`{"lora_name":"tenant","lora_path":"/a","load_inplace":true}`,
		`{"load_inplace":"yes","lora_name":"t\u00e9"}`, `{"lora_name":"x","load_inplace":1,"extra":{"load_inplace":false}}`} {
		f.Add([]byte(b))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		name, inplace := adapterCallOfBody(body)
		if name == "" {
			if inplace {
				t.Fatalf("%q: in place without a name", body)
			}
			return
		}
		var members map[string]json.RawMessage
		var want string
		if err := json.Unmarshal(body, &members); err != nil || json.Unmarshal(members["lora_name"], &want) != nil || want != name {
			t.Fatalf("%q: read %q, encoding/json %q %v", body, name, want, err)
		}
		wantInplace := false
		if raw, ok := members["load_inplace"]; ok {
			wantInplace, _ = rawLaxBool(raw)
		}
		if inplace != wantInplace {
			t.Fatalf("%q: load_inplace read %v, want %v", body, inplace, wantInplace)
		}
	})
}

// FuzzIndexByRare: indexByRare finds what bytes.Index finds, for each key
// generatesOtherwise looks for, in a chunk or anything else.
func FuzzIndexByRare(f *testing.F) {
	for _, c := range chunkCorpus {
		f.Add([]byte(c))
	}
	for _, s := range []string{`"tool_calls":[{`, `x"tool_calls":[[{"tool_calls":[{`, `"reasoning":"`, `"reasoning_content":"x"`,
		`gg"reasoning":"g"reasoning":""`, `"reasoning`, `reasoning":"`, `[{`, `g`} {
		f.Add([]byte(s))
	}
	keys := []struct {
		key  string
		rare byte
	}{{`"tool_calls":[{`, '['}, {`"reasoning_content":"`, 'g'}, {`"reasoning":"`, 'g'}}
	f.Fuzz(func(t *testing.T, data []byte) {
		for _, k := range keys {
			if got, want := indexByRare(data, k.key, k.rare), bytes.Index(data, []byte(k.key)); got != want {
				t.Fatalf("indexByRare(%q, %q) = %d, bytes.Index %d", data, k.key, got, want)
			}
		}
	})
}
