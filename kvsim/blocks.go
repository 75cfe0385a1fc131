package kvsim

// blockPool is the paged KV cache: a fixed array of blocks, a reference count per block,
// and vLLM's free queue. Blocks whose count drops to zero keep their hash and join the tail
// of the free queue; allocation takes the head (least recently freed) and only then forgets
// its hash. A cached block is therefore reusable until it is actually evicted.
type blockPool struct {
	refs   []int32
	hashes []uint64
	hashed []bool
	prev   []int32
	next   []int32
	head   int32
	tail   int32

	numFree int
	cached  map[uint64]int32
}

const noBlock = -1

func newBlockPool(n int) *blockPool {
	p := &blockPool{
		refs:   make([]int32, n),
		hashes: make([]uint64, n),
		hashed: make([]bool, n),
		prev:   make([]int32, n),
		next:   make([]int32, n),
		head:   noBlock,
		tail:   noBlock,
		cached: make(map[uint64]int32),
	}
	for i := range n {
		p.pushTail(int32(i))
	}
	return p
}

func (p *blockPool) pushTail(b int32) {
	p.prev[b], p.next[b] = p.tail, noBlock
	if p.tail != noBlock {
		p.next[p.tail] = b
	} else {
		p.head = b
	}
	p.tail = b
	p.numFree++
}

func (p *blockPool) unlink(b int32) {
	if p.prev[b] != noBlock {
		p.next[p.prev[b]] = p.next[b]
	} else {
		p.head = p.next[b]
	}
	if p.next[b] != noBlock {
		p.prev[p.next[b]] = p.prev[b]
	} else {
		p.tail = p.prev[b]
	}
	p.prev[b], p.next[b] = noBlock, noBlock
	p.numFree--
}

// allocate takes the least recently freed block, evicting its cached hash. The caller must
// have checked numFree > 0.
func (p *blockPool) allocate() int32 {
	b := p.head
	p.unlink(b)
	if p.hashed[b] {
		if p.cached[p.hashes[b]] == b {
			delete(p.cached, p.hashes[b])
		}
		p.hashed[b] = false
	}
	p.refs[b] = 1
	return b
}

// acquire adds a reference to a cached block, taking it off the free queue if idle.
func (p *blockPool) acquire(b int32) {
	if p.refs[b] == 0 {
		p.unlink(b)
	}
	p.refs[b]++
}

// release drops a reference; an unreferenced block keeps its hash and becomes evictable.
func (p *blockPool) release(b int32) {
	p.refs[b]--
	if p.refs[b] == 0 {
		p.pushTail(b)
	}
}

// register records that block b holds the prefix whose chained hash is h. A hash that is
// already cached keeps its block (the duplicate stays unhashed, as in vLLM).
func (p *blockPool) register(b int32, h uint64) {
	if p.hashed[b] {
		return
	}
	if _, ok := p.cached[h]; ok {
		return
	}
	p.cached[h] = b
	p.hashes[b] = h
	p.hashed[b] = true
}

// lookup returns the cached blocks of the longest cached prefix of hashes, appended to out.
func (p *blockPool) lookup(hashes []uint64, out []int32) []int32 {
	for _, h := range hashes {
		b, ok := p.cached[h]
		if !ok {
			break
		}
		out = append(out, b)
	}
	return out
}

// used returns the number of referenced blocks.
func (p *blockPool) used() int { return len(p.refs) - p.numFree }
