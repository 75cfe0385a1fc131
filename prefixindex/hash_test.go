package prefixindex

import (
	"bytes"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/zeebo/xxh3"

	"github.com/llmaffinity/caddy-llm-affinity/internal/cputime"
)

func randomText(n int, seed uint64) []byte {
	r := rand.New(rand.NewPCG(seed, 1))
	b := make([]byte, n)
	for i := range b {
		b[i] = byte('a' + r.IntN(26))
	}
	return b
}

func TestHashBytesBlocksAndTail(t *testing.T) {
	h := Hasher{BlockTokens: 4, BytesPerToken: 4} // 16-byte blocks
	seed := Seed("m", "", "")
	for _, tc := range []struct{ n, want int }{{0, 0}, {15, 0}, {16, 1}, {31, 1}, {32, 2}, {100, 6}} {
		got := h.HashBytes(nil, seed, randomText(tc.n, 1))
		if len(got) != tc.want {
			t.Errorf("len %d: %d blocks, want %d", tc.n, len(got), tc.want)
		}
	}
}

func TestHashChainIdentifiesPrefix(t *testing.T) {
	h := Hasher{BlockTokens: 4, BytesPerToken: 4}
	seed := Seed("m", "", "")
	a := randomText(160, 1)
	b := append([]byte(nil), a...)
	b[40] ^= 1 // differs inside block 2
	ha, hb := h.HashBytes(nil, seed, a), h.HashBytes(nil, seed, b)
	for i := range ha {
		if same := ha[i] == hb[i]; same != (i < 2) {
			t.Errorf("block %d: same=%v", i, same)
		}
	}
	// Equal blocks at different depths or after different parents differ.
	rep := bytes.Repeat([]byte("0123456789abcdef"), 4)
	hr := h.HashBytes(nil, seed, rep)
	if hr[0] == hr[1] || hr[1] == hr[2] {
		t.Error("repeated block content produced equal chained hashes")
	}
}

func TestSeedPartitionsModelsAndAdapters(t *testing.T) {
	seeds := map[uint64]string{}
	for _, s := range [][3]string{{"m", "", ""}, {"m", "a", ""}, {"m", "", "a"}, {"ma", "", ""}, {"m", "b", ""}, {"n", "", ""}} {
		v := Seed(s[0], s[1], s[2])
		if prev, dup := seeds[v]; dup {
			t.Fatalf("seed of %v equals that of %s", s, prev)
		}
		seeds[v] = strings.Join(s[:], "|")
	}
	h := Hasher{}
	p := randomText(1024, 2)
	if h.HashBytes(nil, Seed("m", "", ""), p)[0] == h.HashBytes(nil, Seed("m", "lora1", ""), p)[0] {
		t.Error("an adapter shares blocks with its base model")
	}
}

func TestBlocksInPiecesMatchWholeHash(t *testing.T) {
	h := Hasher{BlockTokens: 8, BytesPerToken: 4}
	seed := Seed("m", "", "")
	text := randomText(1000, 3)
	want := h.HashBytes(nil, seed, text)
	if got := h.HashString(nil, seed, string(text)); !equal(got, want) {
		t.Fatal("HashString differs from HashBytes")
	}
	r := rand.New(rand.NewPCG(4, 4))
	var c Blocks
	for trial := 0; trial < 50; trial++ {
		c.Reset(h, nil)
		for rest := text; len(rest) > 0; {
			n := min(len(rest), r.IntN(80))
			if trial%2 == 0 {
				c.Write(rest[:n])
			} else {
				c.WriteString(string(rest[:n]))
			}
			rest = rest[n:]
		}
		if !equal(c.Chain(seed), want) || c.Len() != len(text) {
			t.Fatalf("trial %d: chained pieces differ from the whole", trial)
		}
	}
}

func TestMaxBlocksCaps(t *testing.T) {
	h := Hasher{BlockTokens: 1, BytesPerToken: 4, MaxBlocks: 10}
	seed := Seed("m", "", "")
	text := randomText(400, 5)
	if n := len(h.HashBytes(nil, seed, text)); n != 10 {
		t.Fatalf("HashBytes gave %d blocks, want the cap 10", n)
	}
	var c Blocks
	c.Reset(h, nil)
	c.Write(text)
	if n := len(c.Chain(seed)); n != 10 || c.Len() != 400 {
		t.Fatalf("Blocks gave %d blocks (len %d), want 10 (400)", n, c.Len())
	}
	toks := make([]int32, 100)
	if n := len(h.HashTokens(nil, seed, toks)); n != 10 {
		t.Fatalf("HashTokens gave %d blocks, want 10", n)
	}
}

func TestHashTokens(t *testing.T) {
	h := Hasher{BlockTokens: 4}
	seed := Seed("m", "", "")
	a := []int32{1, 2, 3, 4, 5, 6, 7, 8, 9}
	b := []int32{1, 2, 3, 4, 5, 6, 7, 9}
	ha, hb := h.HashTokens(nil, seed, a), h.HashTokens(nil, seed, b)
	if len(ha) != 2 || len(hb) != 2 || ha[0] != hb[0] || ha[1] == hb[1] {
		t.Fatalf("token blocks: %x vs %x", ha, hb)
	}
}

func TestHashAllocations(t *testing.T) {
	h := Hasher{}
	seed := Seed("m", "", "")
	text := randomText(64<<10, 6)
	dst := make([]uint64, 0, 1024)
	if n := testing.AllocsPerRun(20, func() { h.HashBytes(dst[:0], seed, text) }); n != 0 {
		t.Errorf("HashBytes allocates %.0f times with room in dst", n)
	}
	var c Blocks
	c.Reset(h, dst)
	if n := testing.AllocsPerRun(20, func() {
		c.Reset(h, dst[:0])
		c.Write(text[:1000])
		c.Write(text[1000:])
		c.Chain(seed)
	}); n != 0 {
		t.Errorf("Blocks allocates %.0f times with room in dst", n)
	}
}

func equal(a, b []uint64) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

var sink uint64

// BenchmarkHashBlocks hashes a 64 KiB prompt into chained blocks.
func BenchmarkHashBlocks(b *testing.B) {
	h := Hasher{}
	seed := Seed("meta-llama/Llama-3.1-8B-Instruct", "", "")
	text := randomText(64<<10, 7)
	dst := make([]uint64, 0, 1024)
	b.SetBytes(int64(len(text)))
	b.ReportAllocs()
	cpu := cputime.Start()
	for b.Loop() {
		dst = h.HashBytes(dst[:0], seed, text)
	}
	cputime.Report(b, cpu)
	sink = dst[len(dst)-1]
}

// BenchmarkXXH3Raw is plain xxh3 over the same bytes: the memory-speed
// floor for BenchmarkHashBlocks.
func BenchmarkXXH3Raw(b *testing.B) {
	text := randomText(64<<10, 7)
	b.SetBytes(int64(len(text)))
	b.ReportAllocs()
	cpu := cputime.Start()
	for b.Loop() {
		sink = xxh3.Hash(text)
	}
	cputime.Report(b, cpu)
}

// TestBlocksEqualsHashBytes: hashing in pieces before the seed is known
// yields the hashes of the whole prompt, for text and token ids, and
// respects the block cap.
func TestBlocksEqualsHashBytes(t *testing.T) {
	h := Hasher{BlockTokens: 4, BytesPerToken: 4, MaxBlocks: 5}
	seed := Seed("m", "", "s")
	text := randomText(200, 3)
	var b Blocks
	for _, cuts := range [][]int{{0}, {1, 17, 18, 100}, {16, 32, 33}, {199}} {
		b.Reset(h, nil)
		prev := 0
		for _, c := range append(cuts, len(text)) {
			if c%2 == 0 {
				b.Write(text[prev:c])
			} else {
				b.WriteString(string(text[prev:c]))
			}
			prev = c
		}
		got, want := b.Chain(seed), h.HashBytes(nil, seed, text)
		if !slices.Equal(got, want) || b.Len() != len(text) {
			t.Fatalf("cuts %v: %x (len %d), want %x", cuts, got, b.Len(), want)
		}
	}
	tokens := []int32{1, -2, 3, 1 << 30, 5, 6, 7, 8, 9, 10, 11, 12, 13}
	b.ResetTokens(Hasher{BlockTokens: 4, BytesPerToken: 3}, nil)
	for _, tok := range tokens {
		b.WriteToken(tok)
	}
	if got, want := b.Chain(seed), h.HashTokens(nil, seed, tokens); !slices.Equal(got, want) || b.Len() != 4*len(tokens) {
		t.Fatalf("tokens: %x, want %x", got, want)
	}
	// The seed chained in later, from the blocks' own hashes.
	b.Reset(h, nil)
	b.Write(text)
	got := b.Hashes()
	Chain(seed, got)
	if want := h.HashBytes(nil, seed, text); !slices.Equal(got, want) {
		t.Fatalf("chained later: %x, want %x", got, want)
	}
}
