package caddyllm

import (
	"bytes"
	"strconv"
	"strings"
	"testing"
)

// TestHasControl: a control character is found at every position of
// strings of every length across the word-at-a-time loops' boundaries,
// and the bytes next to the range (0x20, 0x7f, 0x80, 0xff) are not.
func TestHasControl(t *testing.T) {
	for n := 0; n <= 200; n++ {
		for _, fill := range []byte{' ', 'a', 0x7f, 0x80, 0xff} {
			p := bytes.Repeat([]byte{fill}, n)
			if hasControl(p) {
				t.Fatalf("%d bytes of %#x: control found", n, fill)
			}
			for i := range n {
				for _, c := range []byte{0x00, 0x0a, 0x1f} {
					p[i] = c
					if !hasControl(p) {
						t.Fatalf("%d bytes of %#x, %#x at %d: not found", n, fill, c, i)
					}
				}
				p[i] = fill
			}
		}
	}
}

// TestSyntaxErrorsDoNotQuoteTheBody: the 400 for malformed JSON says where
// and what kind of byte, never the byte itself (encoding/json's errors
// quote it), but for JSON's own punctuation.
func TestSyntaxErrorsDoNotQuoteTheBody(t *testing.T) {
	p := testParser()
	for _, body := range []string{
		`QZXW not json`, `{"model":QZXW}`, `{"messages":[{"role":"user","content":"\Q"}]}`, `{"model" Q}`,
		`{"model":"m"} Q`, `[1 Q]`, "{\"model\":\"m\x01Q\"}", "{\"model\":\xffQ}", `{"max_tokens":1Q}`,
	} {
		_, err := p.parse(EndpointChatCompletions, []byte(body))
		if err == nil || strings.Contains(err.Error(), "Q") || strings.Contains(err.Error(), "\xff") || !strings.Contains(err.Error(), "at byte") {
			t.Errorf("%q: %v", body, err)
		}
	}
	_, err := p.parse(EndpointChatCompletions, []byte(`{"model":"m",}`))
	if err == nil || !strings.Contains(err.Error(), "'}'") {
		t.Errorf("JSON's own punctuation not named: %v", err)
	}
}

// TestDecodingNeverWritesIntoTheBody: a string that needs no decoding is
// used where it lies, in the request body; the next one that does is
// decoded into the parser's own space, never over the body (which is sent
// to the engine as it came).
func TestDecodingNeverWritesIntoTheBody(t *testing.T) {
	p := testParser()
	body := `{"model":"m","messages":[{"role":"usér","content":"a"},{"role":"\u0075ser","content":"b"},{"role":"\u00fc","content":"c"}]}`
	raw := []byte(body)
	for range 3 { // the parser's space is pooled: again, with what the last parse left
		if _, err := p.parse(EndpointChatCompletions, raw); err != nil {
			t.Fatal(err)
		}
		if string(raw) != body {
			t.Fatalf("the body changed: %s", raw)
		}
	}
}

// FuzzStringAt: stringAt reads what the scanner's str reads, wherever the
// string starts.
func FuzzStringAt(f *testing.F) {
	for _, s := range []string{`" ok","x"`, `"ab\"c"`, "\"a\x01b\"", `"12345678"`, `"1234567"`, `""`, `"\u00e9"`, `"caf` + "\xc3\xa9" + `"`} {
		f.Add([]byte(s), uint8(1))
	}
	f.Fuzz(func(t *testing.T, data []byte, at uint8) {
		start := int(at)%(len(data)+1) + 1 // the contents begin after a quote at start-1
		if start > len(data) {
			return
		}
		s := scanner{buf: data, pos: start - 1}
		_, wantEnd, wantEscaped, wantOK := s.str()
		end, escaped, ok := stringAt(data, start)
		if end != wantEnd || escaped != wantEscaped || ok != wantOK {
			t.Fatalf("stringAt(%q, %d) = %d, %v, %v; str %d, %v, %v", data, start, end, escaped, ok, wantEnd, wantEscaped, wantOK)
		}
	})
}

// TestParseIntMatchesStrconv: parseInt reads an optional minus and
// digits as strconv.ParseInt does, within int64, up to eighteen digits
// (where it skips the overflow checks) and past them.
func TestParseIntMatchesStrconv(t *testing.T) {
	cases := []string{"", "-", "0", "-0", "7", "016", "-16", "1x", "x", "1.0", "1e3", " 1", "+1",
		"999999999999999999", "-999999999999999999", "1000000000000000000", "9223372036854775807",
		"9223372036854775808", "-9223372036854775808", "-9223372036854775809", "00000000000000000001",
		"18446744073709551616", "99999999999999999999"}
	for digits := 1; digits <= 21; digits++ {
		cases = append(cases, strings.Repeat("9", digits), "-"+strings.Repeat("9", digits), "1"+strings.Repeat("0", digits-1))
	}
	for _, c := range cases {
		got, ok := parseInt([]byte(c))
		want, err := strconv.ParseInt(c, 10, 64)
		if c != "" && c[0] == '+' {
			err = strconv.ErrSyntax // parseInt reads JSON numbers, which have no plus
		}
		if ok != (err == nil) || ok && got != want {
			t.Errorf("parseInt(%q) = %d, %v; strconv: %d, %v", c, got, ok, want, err)
		}
	}
}
