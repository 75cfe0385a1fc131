package kvsim

import (
	"bytes"
	"slices"
	"strings"
	"testing"
)

func TestFillerWordsCycle(t *testing.T) {
	for _, bpt := range []int{1, 2, 4, 7, 16} {
		tok := NewTokenizer(bpt)
		for i, w := range tok.words {
			if len(w) != bpt {
				t.Fatalf("bpt %d: word %q", bpt, w)
			}
			if j, ok := tok.wordIndex(w); !ok || j != i {
				t.Fatalf("bpt %d: word %q index %d, %v", bpt, w, j, ok)
			}
		}
		next := tok.NextToken(tok.words[len(tok.words)-1])
		if string(next) != string(tok.words[0]) {
			t.Fatalf("bpt %d: cycle does not wrap", bpt)
		}
	}
}

// TestTokenIDsInvertTokens: every text's token ids render back to the
// text, for each token length with ids (1..7 bytes), its last token
// partial or not; a partial token's id elsewhere in a prompt still
// renders as one whole token; whole tokens' ids are their bytes as kvsim
// always read a prompt's ids; and the ids fill the vocabulary, none past
// it.
func TestTokenIDsInvertTokens(t *testing.T) {
	texts := []string{"", "a", "Hello, world!", "héllo wörld ✓ 🙂", "\x00\x00\x00", "\xff\xfe\xfd\xfc\xfb", strings.Repeat("xyz\n\"", 9)}
	for bpt := 1; bpt <= maxExactBytesPerToken; bpt++ {
		tok := NewTokenizer(bpt)
		if !tok.HasTokenIDs() {
			t.Fatalf("%d bytes a token: no token ids", bpt)
		}
		for _, text := range texts {
			ids := tok.TokenIDs([]byte(text))
			if len(ids) != tok.CountTokens(len(text)) {
				t.Fatalf("%d bytes a token, %q: %d ids, %d tokens", bpt, text, len(ids), tok.CountTokens(len(text)))
			}
			for _, id := range ids {
				if id < 0 || id > tok.MaxTokenID() {
					t.Fatalf("%d bytes a token, %q: id %d outside 0..%d", bpt, text, id, tok.MaxTokenID())
				}
			}
			if got := string(tok.TokenIDsToText(ids)); got != text {
				t.Fatalf("%d bytes a token: %q rendered back as %q (ids %v)", bpt, text, got, ids)
			}
			if strs := tok.TokenStrings([]byte(text)); len(strs) != len(ids) {
				t.Fatalf("%d bytes a token, %q: %d token strings, %d ids", bpt, text, len(strs), len(ids))
			}
		}
		// The largest id is the longest partial token of 0xff bytes.
		if bpt > 1 {
			if id := tok.tokenID(bytes.Repeat([]byte{0xff}, bpt-1)); id != tok.vocabulary()-1 {
				t.Fatalf("%d bytes a token: last partial id %d, vocabulary %d", bpt, id, tok.vocabulary())
			}
			partial := tok.tokenID([]byte("a"))
			if got := tok.TokenIDsToText([]int64{partial, partial}); len(got) != bpt+1 || got[0] != 'a' || got[bpt] != 'a' {
				t.Fatalf("%d bytes a token: a partial id before the last rendered %q", bpt, got)
			}
		}
	}
	tok := NewTokenizer(4)
	if got := tok.TokenIDs([]byte("Hell")); got[0] != 0x6c6c6548 {
		t.Fatalf(`"Hell" is id %#x, want its bytes little-endian`, got[0])
	}
	if got := string(tok.TokenIDsToText([]int64{0x6c6c6548, 1 << 62, 0x6f})); got != "Hell\x6f\x00\x00\x00" {
		t.Fatalf("an id outside the vocabulary: %q, want it dropped and the id before it whole", got)
	}
	if NewTokenizer(8).HasTokenIDs() {
		t.Fatal("8 bytes a token have ids")
	}
}

// TestTokenStringsAreByteLevel: token strings are GPT-2's byte-level
// ones, as Llama 3's tokenizer's convert_ids_to_tokens gives them.
func TestTokenStringsAreByteLevel(t *testing.T) {
	got := NewTokenizer(4).TokenStrings([]byte("Hi there\n\xc3\xa9!"))
	want := []string{"HiĠt", "here", "ĊÃ©!"} // é is two bytes, Ã and ©
	if !slices.Equal(got, want) {
		t.Fatalf("token strings %q, want %q", got, want)
	}
}

// TestDecodeAsPython: invalid UTF-8 is replaced as Python's
// bytes.decode("utf-8", "replace") does, one U+FFFD a maximal subpart.
func TestDecodeAsPython(t *testing.T) {
	for in, want := range map[string]string{
		"abc":              "abc",
		"\xe2\x82":         "\ufffd",
		"\xe2\x82A":        "\ufffdA",
		"\xff\xfe":         "\ufffd\ufffd",
		"\xf0\x9f\x98":     "\ufffd",
		"\xf0\x9f\x98\x80": "😀",
		"\xed\xa0\x80":     "\ufffd\ufffd\ufffd",
		"\xe0\x80\xaf":     "\ufffd\ufffd\ufffd",
		"a\xc3":            "a\ufffd",
		"\xef\xbf\xbd":     "\ufffd",
	} {
		if got := pyDecodeUTF8([]byte(in)); got != want {
			t.Errorf("%q decoded as %q, want %q", in, got, want)
		}
	}
}
