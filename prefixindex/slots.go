package prefixindex

import "math/rand/v2"

// slotTable maps block hashes to slab positions of one upstream's LRU. It
// is open addressing with linear probing over int32 cells that point into
// the slab, where the hash itself already lives: 4 bytes a cell at most
// 3/4 full, against about 26 bytes an entry for a Go map[uint64]int32.
// A hash's home cell comes from the hash mixed with a secret key of the
// table: block hashes are uniform for honest input, but a client who
// chooses prompts (the hash seed is the model name), or a peer router
// sending hashes of its choosing, could otherwise make them collide in
// the low bits and turn each probe into a walk of the table under the
// router's lock. Deletion shifts later cells back, so there are no
// tombstones.
type slotTable struct {
	cells []int32 // slab position, 0 = empty (slab 0 is the sentinel)
	n     int
	key   uint64 // drawn when the table first grows
}

// home returns h's home cell under mask.
func (t *slotTable) home(h, mask uint64) uint64 {
	// The finalizer of splitmix64: every bit of h reaches the low ones.
	x := h ^ t.key
	x = (x ^ x>>30) * 0xbf58476d1ce4e5b9
	x = (x ^ x>>27) * 0x94d049bb133111eb
	return (x ^ x>>31) & mask
}

func (t *slotTable) len() int { return t.n }

// find returns the slab position of h, or 0.
func (t *slotTable) find(h uint64, slab []lruEntry) int32 {
	if t.n == 0 {
		return 0
	}
	mask := uint64(len(t.cells) - 1)
	for i := t.home(h, mask); ; i = (i + 1) & mask {
		s := t.cells[i]
		if s == 0 || slab[s].hash == h {
			return s
		}
	}
}

// add records that slab position s holds h, which must be absent.
func (t *slotTable) add(h uint64, s int32, slab []lruEntry) {
	if (t.n+1)*4 > len(t.cells)*3 {
		t.resize(max(16, len(t.cells)*2), slab)
	}
	mask := uint64(len(t.cells) - 1)
	i := t.home(h, mask)
	for t.cells[i] != 0 {
		i = (i + 1) & mask
	}
	t.cells[i] = s
	t.n++
}

// remove deletes h, which must be present.
func (t *slotTable) remove(h uint64, slab []lruEntry) {
	mask := uint64(len(t.cells) - 1)
	i := t.home(h, mask)
	for slab[t.cells[i]].hash != h {
		i = (i + 1) & mask
	}
	// Backward-shift: move later cells of the probe run into the hole
	// when their home position allows it.
	for j := (i + 1) & mask; t.cells[j] != 0; j = (j + 1) & mask {
		home := t.home(slab[t.cells[j]].hash, mask)
		if (j-home)&mask >= (j-i)&mask {
			t.cells[i] = t.cells[j]
			i = j
		}
	}
	t.cells[i] = 0
	t.n--
}

func (t *slotTable) resize(size int, slab []lruEntry) {
	old := t.cells
	if old == nil {
		t.key = rand.Uint64()
	}
	t.cells = make([]int32, size)
	t.n = 0
	mask := uint64(size - 1)
	for _, s := range old {
		if s == 0 {
			continue
		}
		i := t.home(slab[s].hash, mask)
		for t.cells[i] != 0 {
			i = (i + 1) & mask
		}
		t.cells[i] = s
		t.n++
	}
}
