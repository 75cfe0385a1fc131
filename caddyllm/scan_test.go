package caddyllm

import (
	"bytes"
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
