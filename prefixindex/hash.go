// Package prefixindex hashes prompts into chained block hashes and keeps
// the shared index of which upstream holds which prefix blocks.
//
// A block hash identifies its whole prefix: h_i = H(h_{i-1}, block_i), with
// h_{-1} the seed derived from the model, the adapter and an optional salt.
// Two requests therefore share block i exactly when they share every byte
// up to the end of block i, and different models or adapters never share
// blocks (vLLM keys its KV blocks by LoRA adapter too).
//
// The package knows nothing of HTTP or Caddy.
package prefixindex

import (
	"encoding/binary"
	"math/bits"

	"github.com/zeebo/xxh3"
)

// Defaults for Hasher.
const (
	DefaultBlockTokens   = 64
	DefaultBytesPerToken = 4
	// DefaultMaxBlocks caps hashing at 2048 blocks of 64 tokens (128k
	// tokens), so a huge prompt cannot stall the router.
	DefaultMaxBlocks = 2048
)

// Seed derives the chain's starting value from what partitions the cache:
// the model, the LoRA adapter (empty for the base model) and an optional
// salt (for tenant isolation). The parts are length-prefixed so that
// ("ab","c") and ("a","bc") differ.
func Seed(model, adapter, salt string) uint64 {
	var buf [256]byte
	b := buf[:0]
	for _, s := range [...]string{model, adapter, salt} {
		b = binary.LittleEndian.AppendUint32(b, uint32(len(s)))
		b = append(b, s...)
	}
	return xxh3.Hash(b)
}

// Hasher turns prompts into chained block hashes. The zero value uses the
// defaults.
type Hasher struct {
	// BlockTokens is the number of estimated tokens in one block.
	BlockTokens int
	// BytesPerToken is the estimate of prompt bytes per token used to size
	// blocks of text.
	BytesPerToken int
	// MaxBlocks caps how many blocks one prompt yields.
	MaxBlocks int
}

func (h Hasher) blockTokens() int {
	if h.BlockTokens > 0 {
		return h.BlockTokens
	}
	return DefaultBlockTokens
}

// BlockBytes is the number of prompt bytes in one block of text.
func (h Hasher) BlockBytes() int {
	bpt := h.BytesPerToken
	if bpt <= 0 {
		bpt = DefaultBytesPerToken
	}
	return h.blockTokens() * bpt
}

func (h Hasher) maxBlocks() int {
	if h.MaxBlocks > 0 {
		return h.MaxBlocks
	}
	return DefaultMaxBlocks
}

// chain combines the previous hash and the hash of the next block. xxh3's
// seeded variant re-derives its secret for inputs over 240 bytes, so we
// hash the block unseeded (the fast path) and fold the parent in with a
// full-avalanche 128-bit multiply, keeping the chain order-sensitive.
func chain(prev, block uint64) uint64 {
	hi, lo := bits.Mul64(prev^0x9E3779B97F4A7C15, block^0xC2B2AE3D27D4EB4F)
	return hi ^ lo ^ block
}

// HashBytes appends to dst one chained hash per full block of prompt and
// returns the extended slice. The partial tail block is not hashed:
// engines cache only full blocks. Apart from growing dst it does not
// allocate.
func (h Hasher) HashBytes(dst []uint64, seed uint64, prompt []byte) []uint64 {
	return hashBlocks(h, dst, seed, prompt, xxh3.Hash)
}

// HashString is HashBytes for a string, without copying it.
func (h Hasher) HashString(dst []uint64, seed uint64, prompt string) []uint64 {
	return hashBlocks(h, dst, seed, prompt, xxh3.HashString)
}

func hashBlocks[T string | []byte](h Hasher, dst []uint64, seed uint64, prompt T, hash func(T) uint64) []uint64 {
	size := h.BlockBytes()
	n := min(len(prompt)/size, h.maxBlocks())
	dst = grow(dst, n)
	prev := seed
	for i := 0; i < n; i++ {
		prev = chain(prev, hash(prompt[i*size:(i+1)*size]))
		dst = append(dst, prev)
	}
	return dst
}

// HashTokens appends one chained hash per full block of BlockTokens token
// ids (a prompt given as token ids, where the count is exact).
func (h Hasher) HashTokens(dst []uint64, seed uint64, tokens []int32) []uint64 {
	bt := h.blockTokens()
	n := min(len(tokens)/bt, h.maxBlocks())
	dst = grow(dst, n)
	// One scratch buffer per call, on the stack for usual block sizes.
	var stack [1024]byte
	var scratch []byte
	if bt*4 <= len(stack) {
		scratch = stack[:bt*4]
	} else {
		scratch = make([]byte, bt*4)
	}
	prev := seed
	for i := 0; i < n; i++ {
		for j, t := range tokens[i*bt : (i+1)*bt] {
			binary.LittleEndian.PutUint32(scratch[j*4:], uint32(t))
		}
		prev = chain(prev, xxh3.Hash(scratch))
		dst = append(dst, prev)
	}
	return dst
}

func grow(dst []uint64, n int) []uint64 {
	if cap(dst)-len(dst) < n {
		nd := make([]uint64, len(dst), len(dst)+n)
		copy(nd, dst)
		return nd
	}
	return dst
}

// Blocks hashes a prompt that arrives in pieces before its seed is known:
// a request body may name its model after its prompt. Each full block is
// hashed on its own as it fills, which is nearly all the work; its Chain
// method then folds in the seed and the chain. The result equals HashBytes over the
// concatenation of the pieces, or HashTokens when they are token ids
// written with WriteToken after ResetTokens. A Blocks is reusable: its
// buffer is kept across Resets.
type Blocks struct {
	size, max int
	buf       []byte
	total     int
	hashes    []uint64
}

// Reset starts a text prompt hashed with h, appending to dst.
func (b *Blocks) Reset(h Hasher, dst []uint64) { b.reset(h.BlockBytes(), h.maxBlocks(), dst) }

// ResetTokens starts a prompt of token ids hashed with h, appending to
// dst.
func (b *Blocks) ResetTokens(h Hasher, dst []uint64) {
	b.reset(h.blockTokens()*4, h.maxBlocks(), dst)
}

func (b *Blocks) reset(size, max int, dst []uint64) {
	b.size, b.max, b.total, b.hashes = size, max, 0, dst
	if cap(b.buf) < size {
		b.buf = make([]byte, 0, size)
	}
	b.buf = b.buf[:0]
}

// Write adds p to the prompt. It never fails.
func (b *Blocks) Write(p []byte) (int, error) {
	writeBlocks(b, p, xxh3.Hash)
	return len(p), nil
}

// WriteString adds s to the prompt.
func (b *Blocks) WriteString(s string) { writeBlocks(b, s, xxh3.HashString) }

// WriteToken adds one token id, as HashTokens encodes it.
func (b *Blocks) WriteToken(t int32) {
	b.total += 4
	if len(b.hashes) >= b.max {
		return
	}
	b.buf = binary.LittleEndian.AppendUint32(b.buf, uint32(t))
	if len(b.buf) == b.size {
		b.hashes = append(b.hashes, xxh3.Hash(b.buf))
		b.buf = b.buf[:0]
	}
}

func writeBlocks[T string | []byte](b *Blocks, p T, hash func(T) uint64) {
	b.total += len(p)
	for len(p) > 0 && len(b.hashes) < b.max {
		if len(b.buf) == 0 && len(p) >= b.size {
			// Whole blocks straight from the input, no copy.
			b.hashes = append(b.hashes, hash(p[:b.size]))
			p = p[b.size:]
			continue
		}
		n := min(b.size-len(b.buf), len(p))
		b.buf = append(b.buf, p[:n]...)
		p = p[n:]
		if len(b.buf) == b.size {
			b.hashes = append(b.hashes, xxh3.Hash(b.buf))
			b.buf = b.buf[:0]
		}
	}
}

// Len is the number of bytes written so far (4 per token id), including
// any beyond the block cap.
func (b *Blocks) Len() int { return b.total }

// Chain chains the block hashes from seed, in place, and returns them.
// Call it once, after the last Write.
func (b *Blocks) Chain(seed uint64) []uint64 {
	Chain(seed, b.hashes)
	return b.hashes
}

// Hashes returns the blocks' own hashes, not chained, for a caller that
// learns the seed after the last Write: Chain(seed, hashes) makes them
// what b.Chain(seed) would have. They are the slice Reset was given,
// extended, which the Blocks writes no more once Reset again.
func (b *Blocks) Hashes() []uint64 { return b.hashes }

// Chain chains hashes, the blocks' own hashes (Blocks.Hashes), from seed,
// in place: they become what HashBytes (or HashTokens) gives with seed.
func Chain(seed uint64, hashes []uint64) {
	prev := seed
	for i, h := range hashes {
		prev = chain(prev, h)
		hashes[i] = prev
	}
}
