package prefixindex

import (
	"math/bits"
	"slices"
	"sync"
	"sync/atomic"
)

// UpstreamID is a small integer handle for an upstream, issued by an
// Index's registry and keyed by the upstream's dial address. Handles of
// removed upstreams are reused, lowest first, so handles stay dense.
type UpstreamID int32

// groupSize is the number of upstreams whose holdings share one bitset.
const groupSize = 64

// DefaultCapacity is the per-upstream capacity in blocks when none is
// set: 2048 blocks of 64 tokens, 128k tokens, a small GPU's KV cache.
const DefaultCapacity = 2048

// Index records which upstreams hold which prefix blocks. Upstreams are
// grouped 64 to a group; a group maps each block hash to a 64-bit set of
// the members that hold it, so one walk over a request's hashes yields the
// matched depth of every member at once. Each upstream keeps its own LRU
// list and capacity.
//
// Index is safe for concurrent use. Match takes only read locks, so
// readers never serialise each other; Insert, Remove and SetCapacity lock
// the one group they touch.
type Index struct {
	defaultCapacity int

	regMu  sync.Mutex
	ids    map[string]UpstreamID
	names  []string // by UpstreamID; "" for a free handle
	groups atomic.Pointer[[]*group]
}

type group struct {
	mu      sync.RWMutex
	holders map[uint64]uint64 // block hash -> bitset of members holding it
	lrus    [groupSize]lru
}

// lru is one upstream's blocks in recency order: an intrusive doubly
// linked list over a slab of entries, with entry 0 as the sentinel
// (next = most recent, prev = least recent).
type lru struct {
	capacity int
	slots    slotTable
	entries  []lruEntry
	free     int32 // head of the free list threaded through next; 0 = none
}

type lruEntry struct {
	hash       uint64
	prev, next int32
}

// New returns an empty index. defaultCapacity is the capacity in blocks of
// an upstream whose capacity was never set; zero means DefaultCapacity.
func New(defaultCapacity int) *Index {
	if defaultCapacity <= 0 {
		defaultCapacity = DefaultCapacity
	}
	ix := &Index{defaultCapacity: defaultCapacity, ids: make(map[string]UpstreamID)}
	ix.groups.Store(&[]*group{})
	return ix
}

// Register returns the handle of the upstream with the given key (its dial
// address), issuing a new one if needed.
func (ix *Index) Register(key string) UpstreamID {
	ix.regMu.Lock()
	defer ix.regMu.Unlock()
	if id, ok := ix.ids[key]; ok {
		return id
	}
	id := UpstreamID(len(ix.names))
	for i, n := range ix.names {
		if n == "" {
			id = UpstreamID(i)
			break
		}
	}
	if int(id) == len(ix.names) {
		ix.names = append(ix.names, key)
	} else {
		ix.names[id] = key
	}
	ix.ids[key] = id
	groups := *ix.groups.Load()
	if int(id)/groupSize >= len(groups) {
		// Copy on write: readers keep walking the old slice.
		grown := append(append([]*group(nil), groups...), ix.newGroup())
		ix.groups.Store(&grown)
	}
	return id
}

func (ix *Index) newGroup() *group {
	g := &group{holders: make(map[uint64]uint64)}
	for i := range g.lrus {
		g.lrus[i].capacity = ix.defaultCapacity
	}
	return g
}

// Lookup returns the handle of key, if registered.
func (ix *Index) Lookup(key string) (UpstreamID, bool) {
	ix.regMu.Lock()
	defer ix.regMu.Unlock()
	id, ok := ix.ids[key]
	return id, ok
}

// Key returns the key an upstream was registered with, or "" for a free
// handle.
func (ix *Index) Key(id UpstreamID) string {
	ix.regMu.Lock()
	defer ix.regMu.Unlock()
	if int(id) < 0 || int(id) >= len(ix.names) {
		return ""
	}
	return ix.names[id]
}

// Handles is the number of handle slots in use or free; Match results are
// indexed by UpstreamID below this bound.
func (ix *Index) Handles() int {
	return len(*ix.groups.Load()) * groupSize
}

func (ix *Index) slot(id UpstreamID) (*group, *lru, uint64) {
	groups := *ix.groups.Load()
	gi := int(id) / groupSize
	if id < 0 || gi >= len(groups) {
		return nil, nil, 0
	}
	g := groups[gi]
	m := int(id) % groupSize
	return g, &g.lrus[m], 1 << m
}

// Match returns, in dst resized to Handles(), the number of leading blocks
// of hashes each upstream holds. Because an upstream's holdings are
// prefix-closed (a parent is never evicted before its children), the set
// of holders can only shrink along the chain, so the walk bisects between
// points where the set changes: about log2(len(hashes)) lookups per
// distinct depth instead of one per block.
func (ix *Index) Match(hashes []uint64, dst []int) []int {
	groups := *ix.groups.Load()
	n := len(groups) * groupSize
	if cap(dst) < n {
		dst = make([]int, n)
	}
	dst = dst[:n]
	clear(dst)
	if len(hashes) == 0 {
		return dst
	}
	for gi, g := range groups {
		g.mu.RLock()
		g.match(hashes, dst[gi*groupSize:(gi+1)*groupSize])
		g.mu.RUnlock()
	}
	return dst
}

func (g *group) match(hashes []uint64, depth []int) {
	first := g.holders[hashes[0]]
	if first == 0 {
		return
	}
	last := len(hashes) - 1
	end := first & g.holders[hashes[last]]
	setDepth(depth, end, len(hashes))
	g.bisect(hashes, depth, 0, last, first, end)
}

// bisect assigns depths to the members of atLo that are not in atHi,
// where atLo and atHi are the holder sets of blocks lo and hi.
func (g *group) bisect(hashes []uint64, depth []int, lo, hi int, atLo, atHi uint64) {
	if atLo&^atHi == 0 {
		return
	}
	if hi == lo+1 {
		setDepth(depth, atLo&^atHi, lo+1)
		return
	}
	mid := int(uint(lo+hi) >> 1)
	// Clamp to the bounds so a hole (a hash collision, say) cannot break
	// the monotonicity the bisection relies on.
	atMid := g.holders[hashes[mid]]&atLo | atHi
	g.bisect(hashes, depth, lo, mid, atLo, atMid)
	g.bisect(hashes, depth, mid, hi, atMid, atHi)
}

func setDepth(depth []int, members uint64, d int) {
	for members != 0 {
		m := bits.TrailingZeros64(members)
		depth[m] = d
		members &= members - 1
	}
}

// Insert records that upstream id now holds the chain hashes (a request
// routed there will leave its prompt in that engine's cache). It touches
// the chain from the tail to the root, so each parent is at least as
// recent as its children and eviction takes tails first, as the engines'
// own caches do. A chain longer than the capacity keeps its leading part.
// It returns how many leading hashes of the chain it held already.
func (ix *Index) Insert(id UpstreamID, hashes []uint64) int {
	g, l, bit := ix.slot(id)
	if g == nil {
		return 0
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	hashes = hashes[:min(len(hashes), l.capacity)]
	held := len(hashes)
	for i := len(hashes) - 1; i >= 0; i-- {
		h := hashes[i]
		if s := l.slots.find(h, l.entries); s != 0 {
			l.moveToFront(s)
			continue
		}
		held = i
		if l.slots.len() >= l.capacity {
			g.evictOldest(l, bit)
		}
		l.slots.add(h, l.pushFront(h), l.entries)
		g.holders[h] |= bit
	}
	return held
}

// Entries appends to dst the blocks the upstream registered as key holds,
// most recently used first, and returns it: what Restore takes, to give
// another index (a router that starts) the same holdings in the same
// order. The group's lock is held only to copy the list, which is walked
// after: a long list must not hold up the inserts of the group's other
// members.
func (ix *Index) Entries(key string, dst []uint64) []uint64 {
	id, ok := ix.Lookup(key)
	if !ok {
		return dst
	}
	g, l, _ := ix.slot(id)
	if g == nil {
		return dst
	}
	g.mu.RLock()
	// The handle may have gone to another upstream since the lookup.
	if ix.Key(id) != key || len(l.entries) == 0 {
		g.mu.RUnlock()
		return dst
	}
	entries := slices.Clone(l.entries)
	g.mu.RUnlock()
	for s := entries[0].next; s != 0; s = entries[s].next {
		dst = append(dst, entries[s].hash)
	}
	return dst
}

// Restore records that upstream id holds hashes, each less recently used
// than the one before and than all it holds already, as far as its
// capacity allows: it never evicts. hashes are another index's Entries
// (in pieces, most recent first): a parent is more recent than its
// children there, so it is restored before them and the holdings stay
// prefix-closed at every step. Hashes it holds already keep their place.
func (ix *Index) Restore(id UpstreamID, hashes []uint64) {
	g, l, bit := ix.slot(id)
	if g == nil {
		return
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, h := range hashes {
		if l.slots.len() >= l.capacity {
			return
		}
		if l.slots.find(h, l.entries) != 0 {
			continue
		}
		l.slots.add(h, l.pushBack(h), l.entries)
		g.holders[h] |= bit
	}
}

// Forget forgets that upstream id holds hashes (a request routed there
// failed before the engine prefilled them), and returns how many it held.
// Hashes it does not hold are skipped.
func (ix *Index) Forget(id UpstreamID, hashes []uint64) int {
	g, l, bit := ix.slot(id)
	if g == nil {
		return 0
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	n := 0
	for _, h := range hashes {
		if s := l.slots.find(h, l.entries); s != 0 {
			g.drop(l, s, bit)
			n++
		}
	}
	return n
}

// Remove forgets everything upstream id holds and frees its handle. The
// handle goes back to the default capacity before it is freed: the next
// upstream registered reuses it and must not inherit a size it never had.
func (ix *Index) Remove(id UpstreamID) {
	ix.clear(id, ix.defaultCapacity)
	ix.regMu.Lock()
	if int(id) >= 0 && int(id) < len(ix.names) && ix.names[id] != "" {
		delete(ix.ids, ix.names[id])
		ix.names[id] = ""
	}
	ix.regMu.Unlock()
}

// Clear forgets everything upstream id holds but keeps its handle and
// capacity (the engine restarted with an empty cache).
func (ix *Index) Clear(id UpstreamID) {
	ix.clear(id, 0)
}

// clear forgets everything upstream id holds and sets its capacity to
// blocks, or keeps it when blocks is 0.
func (ix *Index) clear(id UpstreamID, blocks int) {
	g, l, bit := ix.slot(id)
	if g == nil {
		return
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if len(l.entries) > 0 { // nothing was ever inserted, or cleared already
		for s := l.entries[0].next; s != 0; s = l.entries[s].next {
			g.clearBit(l.entries[s].hash, bit)
		}
	}
	if blocks == 0 {
		blocks = l.capacity
	}
	*l = lru{capacity: blocks}
}

// SetCapacity sets how many blocks upstream id can hold, evicting the
// least recently used blocks beyond it. blocks <= 0 restores the default.
func (ix *Index) SetCapacity(id UpstreamID, blocks int) {
	g, l, bit := ix.slot(id)
	if g == nil {
		return
	}
	if blocks <= 0 {
		blocks = ix.defaultCapacity
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	l.capacity = blocks
	for l.slots.len() > l.capacity {
		g.evictOldest(l, bit)
	}
}

// Blocks is the number of blocks upstream id holds.
func (ix *Index) Blocks(id UpstreamID) int {
	g, l, _ := ix.slot(id)
	if g == nil {
		return 0
	}
	g.mu.RLock()
	defer g.mu.RUnlock()
	return l.slots.len()
}

// Capacity is upstream id's capacity in blocks.
func (ix *Index) Capacity(id UpstreamID) int {
	g, l, _ := ix.slot(id)
	if g == nil {
		return 0
	}
	g.mu.RLock()
	defer g.mu.RUnlock()
	return l.capacity
}

func (g *group) clearBit(h, bit uint64) {
	if rest := g.holders[h] &^ bit; rest != 0 {
		g.holders[h] = rest
	} else {
		delete(g.holders, h)
	}
}

func (g *group) evictOldest(l *lru, bit uint64) {
	if s := l.entries[0].prev; s != 0 {
		g.drop(l, s, bit)
	}
}

// drop removes the entry at slab position s from l, whose member bit it
// is, and frees its slot. Caller holds g.mu.
func (g *group) drop(l *lru, s int32, bit uint64) {
	h := l.entries[s].hash
	l.slots.remove(h, l.entries)
	l.unlink(s)
	l.entries[s].next = l.free
	l.free = s
	g.clearBit(h, bit)
}

func (l *lru) pushFront(h uint64) int32 {
	s := l.newEntry(h)
	l.linkFront(s)
	return s
}

// pushBack adds h as the least recently used entry.
func (l *lru) pushBack(h uint64) int32 {
	s := l.newEntry(h)
	tail := &l.entries[0]
	e := &l.entries[s]
	e.next, e.prev = 0, tail.prev
	l.entries[tail.prev].next = s
	tail.prev = s
	return s
}

// newEntry takes a free slab position for h, unlinked.
func (l *lru) newEntry(h uint64) int32 {
	if l.entries == nil {
		// Sentinel first; size the first allocation for a typical load.
		n := min(l.capacity, 1024) + 1
		l.entries = make([]lruEntry, 1, n)
	}
	var s int32
	if l.free != 0 {
		s = l.free
		l.free = l.entries[s].next
	} else {
		s = int32(len(l.entries))
		l.entries = append(l.entries, lruEntry{})
	}
	l.entries[s] = lruEntry{hash: h}
	return s
}

func (l *lru) linkFront(s int32) {
	head := &l.entries[0]
	e := &l.entries[s]
	e.prev, e.next = 0, head.next
	l.entries[head.next].prev = s
	head.next = s
}

func (l *lru) unlink(s int32) {
	e := l.entries[s]
	l.entries[e.prev].next = e.next
	l.entries[e.next].prev = e.prev
}

func (l *lru) moveToFront(s int32) {
	if l.entries[0].next == s {
		return
	}
	l.unlink(s)
	l.linkFront(s)
}
