package caddyllm

import (
	"bytes"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// shapeTexts are token texts that test a shape's edges: escapes, invalid
// UTF-8, quotes, line breaks, JSON and SSE inside the text.
var shapeTexts = []string{
	"a", " tok", `\"`, `\\`, `\u00e9`, `\ud83d\ude00`, `\ud83d`, "\xff", "é", `"`, `a"b`, `\q`, "\x01", `\`, "",
	`\n`, `","x":"`, `"},"usage":{"completion_tokens":5},"y":{"z":"`, "a longer text of more than sixteen bytes",
	"x\ny", "\t", `\u12`, `\/`, "data: ", `abc\`, "0123456789abcdef", "0123456789abcde\"", `\u0000`, "\r",
	`"}]}` + "\n\n" + `data: {"choices":[{"text":"`,
}

const (
	shapeHeadA = `{"id":"chatcmpl-5f0c","object":"chat.completion.chunk","created":1732000000,"model":"m","choices":[{"index":0,"delta":`
	shapeTailA = `,"logprobs":null,"finish_reason":null}],"usage":null}`
	shapeHeadB = `{"id":"cmpl-1","object":"text_completion","created":1,"model":"m","choices":[{"index":0,"text":`
	shapeTailB = `,"logprobs":null,"finish_reason":null}]}`
)

// A Responses delta event's data around its text and sequence number.
const (
	responsesHead = `{"content_index":0,"delta":`
	responsesMid  = `,"item_id":"msg_1","logprobs":[],"output_index":0,"sequence_number":`
	responsesTail = `,"type":"response.output_text.delta"}`
)

// seqText is a sequence number from c, now and then one no plain JSON
// integer is (a leading zero, a sign, a fraction, too many digits).
func seqText(c byte) string {
	switch c % 16 {
	case 0:
		return "07"
	case 1:
		return "-3"
	case 2:
		return "4.0"
	case 3:
		return "1234567890123456789"
	case 4:
		return "0"
	}
	return fmt.Sprint(int(c) * 1000003)
}

// shapeStream builds an SSE stream from prog, each byte choosing the next
// event (token chunks of two shapes and their variants, role, tool-call,
// reasoning and usage chunks, [DONE], errors, comments, other line
// endings, raw bytes, a mutated copy of the last event) and its text.
func shapeStream(prog []byte) []byte {
	var b bytes.Buffer
	var last []byte
	next := func(i *int) byte {
		if *i >= len(prog) {
			return 0
		}
		c := prog[*i]
		*i++
		return c
	}
	text := func(i *int) string {
		c := next(i)
		if c >= 200 {
			n := int(c-200) % 8
			var s []byte
			for k := 0; k < n; k++ {
				s = append(s, next(i))
			}
			return string(s)
		}
		return shapeTexts[int(c)%len(shapeTexts)]
	}
	for i := 0; i < len(prog); {
		start := b.Len()
		op := next(&i)
		switch op % 31 {
		case 0, 1, 2, 3:
			fmt.Fprintf(&b, "data: %s{\"content\":\"%s\"}%s\n\n", shapeHeadA, text(&i), shapeTailA)
		case 4:
			fmt.Fprintf(&b, "data: %s\"%s\"%s\n\n", shapeHeadB, text(&i), shapeTailB)
		case 5:
			fmt.Fprintf(&b, "data: %s{\"content\":\"%s\"}%s\n\n", strings.Replace(shapeHeadA, "1732000000", "1732000001", 1), text(&i), shapeTailA)
		case 6:
			fmt.Fprintf(&b, "data: %s{\"role\":\"assistant\",\"content\":\"\"}%s\n\n", shapeHeadA, shapeTailA)
		case 7:
			fmt.Fprintf(&b, "data: %s{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"%s\"}}]}%s\n\n", shapeHeadA, text(&i), shapeTailA)
		case 8:
			fmt.Fprintf(&b, "data: %s{\"reasoning_content\":\"%s\",\"content\":null}%s\n\n", shapeHeadA, text(&i), shapeTailA)
		case 9:
			fmt.Fprintf(&b, "data: {\"id\":\"chatcmpl-5f0c\",\"choices\":[],\"usage\":{\"prompt_tokens\":%d,\"completion_tokens\":%d,\"prompt_tokens_details\":{\"cached_tokens\":1}}}\n\n", next(&i), next(&i))
		case 10:
			b.WriteString("data: [DONE]\n\n")
		case 11:
			b.WriteString(`data: {"error":{"message":"x"}}` + "\n\n")
		case 12:
			b.WriteString(": ping\n\n")
		case 13:
			b.WriteString("event: message\n")
		case 14:
			fmt.Fprintf(&b, "data: %s{\"content\":\"%s\"}%s\n\n", strings.Replace(shapeHeadA, `"index":0`, `"index":1`, 1), text(&i), shapeTailA)
		case 15:
			fmt.Fprintf(&b, "data:%s{\"content\":\"%s\"}%s\n\n", shapeHeadA, text(&i), shapeTailA)
		case 16:
			fmt.Fprintf(&b, "data: %s{\"content\":\"%s\"}%s\r\n\r\n", shapeHeadA, text(&i), shapeTailA)
		case 17:
			n := int(next(&i)) % 16
			for k := 0; k < n; k++ {
				b.WriteByte(next(&i))
			}
		case 18:
			fmt.Fprintf(&b, "data: %s{\"content\":\"%s\"}%s\n\n", shapeHeadA, text(&i), strings.Replace(shapeTailA, `"usage":null`, `"usage":{"prompt_tokens":3,"completion_tokens":4}`, 1))
		case 19:
			fmt.Fprintf(&b, "data: %s{\"content\":\"%s\"}%s\ndata: %s{\"content\":\"%s\"}%s\n\n", shapeHeadA, text(&i), shapeTailA, shapeHeadA, text(&i), shapeTailA)
		case 20:
			fmt.Fprintf(&b, "data: %s{\"content\":\"%s\"}%s\n\n", strings.Replace(shapeHeadA, "chatcmpl-5f0c", "", 1), text(&i), shapeTailA)
		case 21:
			fmt.Fprintf(&b, "data: %s{\"content\":\"%s\"}%s\n", shapeHeadA, text(&i), shapeTailA)
		case 22:
			b.WriteString("\n")
		case 23:
			fmt.Fprintf(&b, "data: %s{\"content\":\"%s\"}%s \n\n", shapeHeadA, text(&i), shapeTailA)
		case 24:
			if len(last) > 0 {
				m := append([]byte(nil), last...)
				k := int(next(&i)) % len(m)
				m[k] = next(&i)
				b.Write(m)
			}
		case 25:
			// Several choices.
			fmt.Fprintf(&b, "data: {\"choices\":[{\"index\":0,\"text\":\"%s\"},{\"index\":1,\"text\":\"%s\"}]}\n\n", text(&i), text(&i))
		case 26, 27, 28:
			// A Responses delta, as vLLM sends it: the sequence number
			// after the text, changing at every event.
			fmt.Fprintf(&b, "event: response.output_text.delta\ndata: %s\"%s\"%s%s%s\n\n", responsesHead, text(&i), responsesMid, seqText(next(&i)), responsesTail)
		case 29:
			// Its variants: another event name, no space, a reasoning delta.
			switch next(&i) % 3 {
			case 0:
				fmt.Fprintf(&b, "event:response.output_text.delta\ndata: %s\"%s\"%s%d%s\n\n", responsesHead, text(&i), responsesMid, next(&i), responsesTail)
			case 1:
				fmt.Fprintf(&b, "event: response.reasoning_text.delta\ndata: %s\"%s\"%s%d%s\n\n", responsesHead, text(&i), responsesMid, next(&i),
					strings.Replace(responsesTail, "output_text", "reasoning_text", 1))
			case 2:
				fmt.Fprintf(&b, "data: %s\"%s\"%s%d%s\n\n", responsesHead, text(&i), responsesMid, next(&i), responsesTail)
			}
		case 30:
			fmt.Fprintf(&b, "event: response.created\ndata: {\"response\":{\"id\":\"resp_1\",\"status\":\"in_progress\",\"usage\":null},\"sequence_number\":%d,\"type\":\"response.created\"}\n\n", next(&i))
			if next(&i)%2 == 0 {
				fmt.Fprintf(&b, "event: response.completed\ndata: {\"response\":{\"id\":\"resp_1\",\"status\":\"completed\",\"usage\":{\"input_tokens\":3,\"output_tokens\":%d,\"total_tokens\":9}},\"sequence_number\":%d,\"type\":\"response.completed\"}\n\n", next(&i), next(&i))
			}
		}
		if b.Len() > start {
			last = append(last[:0], b.Bytes()[start:]...)
		}
	}
	return b.Bytes()
}

// shapeRun is what a recorder passed on and held after each Write.
type shapeRun struct {
	rec    *tokenRecorder
	w      *httptest.ResponseRecorder
	bodies []string
	rets   []string
}

// recordStream writes stream to a new recorder in the pieces splits says,
// through one buffer as Caddy's proxy does, with a continuation's splice
// or a restart before write opAt (by op), every chunk read whole when
// readWhole is set.
func recordStream(stream []byte, splits []byte, endpoint Endpoint, readWhole bool, opAt int, op byte) *shapeRun {
	w := httptest.NewRecorder()
	w.Header().Set("Content-Type", "text/event-stream")
	rec := newTokenRecorder(w, &requestState{req: &Request{Endpoint: endpoint, Stream: true}})
	rec.readWhole = readWhole
	rec.WriteHeader(http.StatusOK)
	r := &shapeRun{rec: rec, w: w}
	writeInPieces(rec, stream, splits, func(k int) {
		if k == opAt {
			switch op % 3 {
			case 1:
				beginSplice(rec)
			case 2:
				rec.restart()
			}
		}
	}, func(wn int, err error) {
		r.bodies = append(r.bodies, w.Body.String())
		r.rets = append(r.rets, fmt.Sprint(wn, err, recorderState(rec), rec.sentText, rec.sentTokens))
	})
	rec.flushHeld()
	r.bodies = append(r.bodies, w.Body.String())
	return r
}

// writeInPieces writes stream to rec in the pieces splits says (a split
// k bytes long, or over 200 a multiple of 37; the rest in one piece),
// through one buffer as Caddy's proxy does, calling before(k) ahead of
// write k and after with what it returned.
func writeInPieces(rec *tokenRecorder, stream, splits []byte, before func(k int), after func(wn int, err error)) {
	rest := stream
	buf := make([]byte, len(stream)+1)
	for k := 0; len(rest) > 0; k++ {
		before(k)
		n := len(rest)
		if k < len(splits) {
			n = min(n, int(splits[k])+1)
			if splits[k] > 200 {
				n = min(len(rest), int(splits[k]-200)*37+1)
			}
		}
		nb := copy(buf, rest[:n])
		wn, err := rec.Write(buf[:nb])
		rest = rest[n:]
		after(wn, err)
	}
}

// beginSplice starts splicing a continuation into rec's stream, as the
// handler does after a cut: what was held back and the line being read go.
func beginSplice(rec *tokenRecorder) {
	rec.held, rec.line, rec.skipLine = rec.held[:0], rec.line[:0], false
	rec.splice = &spliceState{priorTokens: rec.tokens}
}

// recorderState is all a recorder records, as text.
func recorderState(t *tokenRecorder) string {
	return fmt.Sprintf("tokens=%d gen=%q usage=%+v has=%v id=%q obj=%q cr=%d model=%q done=%v failed=%v held=%q he=%d line=%q skip=%v rid=%q seq=%d/%v out=%v pend=%q unrep=%d",
		t.tokens, string(t.generated), t.usage, t.hasUsage, t.streamID, t.streamObject, t.streamCreated, t.streamModel,
		t.done, t.failed, t.held, t.heldEvents, t.line, t.skipLine, t.responseID, t.lastSeq, t.seenSeq, t.outputStarted, t.pendingEvent, t.unreported)
}

// sameAsReadWhole fails when shapes change what the recorder records or
// passes on, after any Write.
func sameAsReadWhole(t *testing.T, stream, splits []byte, endpoint Endpoint, opAt int, op byte) {
	fast := recordStream(stream, splits, endpoint, false, opAt, op)
	slow := recordStream(stream, splits, endpoint, true, opAt, op)
	if a, b := recorderState(fast.rec), recorderState(slow.rec); a != b {
		t.Fatalf("stream %q splits %v ep %v op %d@%d\nfast %s\nslow %s", stream, splits, endpoint, op, opAt, a, b)
	}
	for k := range fast.bodies {
		if fast.bodies[k] != slow.bodies[k] {
			t.Fatalf("stream %q splits %v: body after write %d differs:\nfast %q\nslow %q", stream, splits, k, fast.bodies[k], slow.bodies[k])
		}
	}
	for k := range fast.rets {
		if fast.rets[k] != slow.rets[k] {
			t.Fatalf("stream %q splits %v: state after write %d differs:\nfast %q\nslow %q", stream, splits, k, fast.rets[k], slow.rets[k])
		}
	}
}

// FuzzShapesReadAsWhole: whatever the stream, however split, with a
// splice or a restart anywhere, on any endpoint, the recorder records and
// passes on with shapes what it does reading every chunk whole (helper-85's
// differential test).
func FuzzShapesReadAsWhole(f *testing.F) {
	f.Add([]byte{0, 1, 0, 2, 0, 3, 4, 5, 5, 6, 0, 7, 9, 10, 10}, []byte{255, 255, 10, 3}, uint8(0), uint8(0), uint8(0))
	f.Add([]byte{0, 1, 0, 2, 15, 3, 16, 4, 19, 5, 6, 21, 7, 22, 0, 8, 23, 9, 0, 10}, []byte{5, 7, 250, 2, 1}, uint8(1), uint8(2), uint8(1))
	f.Add([]byte{4, 1, 4, 2, 4, 3, 25, 1, 2, 4, 17, 5, 1, 2, 3, 4, 5, 4, 6, 24, 3, 65, 4, 7}, []byte{}, uint8(2), uint8(0), uint8(0))
	f.Add([]byte{0, 1, 0, 2, 0, 29, 0, 3, 24, 50, 34, 0, 200, 14, 9, 10, 0}, []byte{30, 255}, uint8(0), uint8(1), uint8(1))
	f.Add([]byte{30, 1, 26, 1, 9, 26, 2, 10, 27, 3, 0, 28, 16, 5, 26, 15, 6, 29, 0, 1, 7, 29, 1, 2, 8, 26, 17, 1, 30, 0, 5, 6}, []byte{255, 40, 3}, uint8(2), uint8(0), uint8(0))
	f.Add([]byte{30, 1, 26, 1, 9, 26, 2, 10, 26, 3, 11, 26, 4, 12, 29, 2, 3, 4, 26, 5, 20, 24, 9, 65, 26, 6, 21}, []byte{60, 7, 250, 1}, uint8(2), uint8(3), uint8(2))
	// helper-86's: a duplicate key that the scanner gives up on and
	// encoding/json reads (the last one wins) must teach no shape.
	f.Add([]byte("event: response.output_text.delta\ndata: {\"delta\":\"a\",\"sequence_number\":1,\"type\":\"response.output_text.delta\",\"sequence_number\":5}\n\n"+
		"event: response.output_text.delta\ndata: {\"delta\":\"b\",\"sequence_number\":2,\"type\":\"response.output_text.delta\",\"sequence_number\":5}\n\n"), []byte{}, uint8(2), uint8(7), uint8(0))
	f.Fuzz(func(t *testing.T, prog, splits []byte, ep, opAt, op uint8) {
		stream := shapeStream(prog)
		if len(stream) > 1<<16 {
			return
		}
		endpoint := []Endpoint{EndpointChatCompletions, EndpointCompletions, EndpointResponses}[int(ep)%3]
		sameAsReadWhole(t, stream, splits, endpoint, int(opAt)%8, op)
		// The raw bytes as a stream too.
		sameAsReadWhole(t, prog, splits, endpoint, int(opAt)%8, op)
	})
}
