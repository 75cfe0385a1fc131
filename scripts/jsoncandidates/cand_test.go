// Package jsoncandidates measures JSON libraries that could read the
// router's request bodies, against xxh3 over the same bytes (issue 16).
// It is a module of its own so that the router does not depend on them:
//
//	cd scripts/jsoncandidates && go test -bench . -benchmem -count 3
//
// Each reads a 64 KiB chat body as the router must at least: every
// message's content (as raw, escaped bytes where the library can),
// without hashing; the router's own reader, which also validates,
// extracts and hashes, is BenchmarkHandlerParse in package caddyllm.
package jsoncandidates

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"

	"github.com/bytedance/sonic"
	"github.com/bytedance/sonic/ast"
	jsontext "github.com/go-json-experiment/json/jsontext"
	"github.com/valyala/fastjson"
	"github.com/zeebo/xxh3"
)

// body is the chat-64KiB body of BenchmarkHandlerParse: 1 KiB user
// turns, short replies.
func body() []byte {
	var m []map[string]string
	for {
		m = append(m, map[string]string{"role": "user", "content": strings.Repeat("lorem ipsum dolor sit amet ", 38)},
			map[string]string{"role": "assistant", "content": "ok"})
		b, _ := json.Marshal(map[string]any{"model": "meta-llama/Llama-3.1-8B-Instruct", "messages": m, "max_tokens": 256, "stream": true})
		if len(b) >= 64<<10 {
			return b
		}
	}
}

var sink uint64

func BenchmarkXXH3Raw(b *testing.B) {
	d := body()
	b.SetBytes(int64(len(d)))
	for b.Loop() {
		sink = xxh3.Hash(d)
	}
}

type msg struct {
	Role    string          `json:"role"`
	Content json.RawMessage `json:"content"`
}
type req struct {
	Model    string          `json:"model"`
	Messages []msg           `json:"messages"`
	Tools    json.RawMessage `json:"tools"`
	Max      *int            `json:"max_tokens"`
}

func BenchmarkStdlibUnmarshal(b *testing.B) {
	d := body()
	b.SetBytes(int64(len(d)))
	b.ReportAllocs()
	for b.Loop() {
		var r req
		if err := json.Unmarshal(d, &r); err != nil {
			b.Fatal(err)
		}
		sink += uint64(len(r.Messages))
	}
}

// jsontext: walk every token; content read as a raw value (escaped bytes).
func BenchmarkJSONText(b *testing.B) {
	d := body()
	b.SetBytes(int64(len(d)))
	b.ReportAllocs()
	dec := jsontext.NewDecoder(bytes.NewReader(d))
	for b.Loop() {
		dec.Reset(bytes.NewReader(d))
		n := 0
		for {
			kind := dec.PeekKind()
			if kind == 0 {
				break
			}
			if kind == '"' {
				v, err := dec.ReadValue()
				if err != nil {
					b.Fatal(err)
				}
				n += len(v)
				continue
			}
			if _, err := dec.ReadToken(); err != nil {
				break
			}
		}
		sink += uint64(n)
	}
}

func BenchmarkFastjsonParse(b *testing.B) {
	d := body()
	b.SetBytes(int64(len(d)))
	b.ReportAllocs()
	var p fastjson.Parser
	for b.Loop() {
		v, err := p.ParseBytes(d)
		if err != nil {
			b.Fatal(err)
		}
		for _, m := range v.GetArray("messages") {
			sink += uint64(len(m.GetStringBytes("content")))
		}
	}
}

func BenchmarkFastjsonValidate(b *testing.B) {
	d := body()
	b.SetBytes(int64(len(d)))
	b.ReportAllocs()
	for b.Loop() {
		if err := fastjson.ValidateBytes(d); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkSonicUnmarshal(b *testing.B) {
	d := body()
	b.SetBytes(int64(len(d)))
	b.ReportAllocs()
	for b.Loop() {
		var r req
		if err := sonic.Unmarshal(d, &r); err != nil {
			b.Fatal(err)
		}
		sink += uint64(len(r.Messages))
	}
}

func BenchmarkSonicAST(b *testing.B) {
	d := body()
	s := string(d)
	b.SetBytes(int64(len(d)))
	b.ReportAllocs()
	for b.Loop() {
		root, err := sonic.GetFromString(s)
		if err != nil {
			b.Fatal(err)
		}
		msgs := root.Get("messages")
		n, _ := msgs.Len()
		for i := 0; i < n; i++ {
			raw, _ := msgs.Index(i).Get("content").Raw()
			sink += uint64(len(raw))
		}
		_ = ast.Node{}
	}
}
