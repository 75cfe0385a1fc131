package kvsim

import "testing"

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
