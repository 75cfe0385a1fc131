package prefixindex

import (
	"math/rand/v2"
	"testing"
)

// TestSlotTableAgainstMap drives the table and a Go map with the same
// random adds and removes, with hashes crowded into few home cells so that
// probe runs wrap and backward shifts happen.
func TestSlotTableAgainstMap(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 3))
	slab := []lruEntry{{}}
	var tab slotTable
	want := map[uint64]int32{}
	for i := 0; i < 20000; i++ {
		h := uint64(r.IntN(64))<<32 | uint64(r.IntN(8)) // few distinct low bits
		if s, ok := want[h]; ok {
			if got := tab.find(h, slab); got != s {
				t.Fatalf("find %x = %d, want %d", h, got, s)
			}
			if r.IntN(2) == 0 {
				tab.remove(h, slab)
				delete(want, h)
			}
			continue
		}
		if tab.find(h, slab) != 0 {
			t.Fatalf("found absent %x", h)
		}
		slab = append(slab, lruEntry{hash: h})
		tab.add(h, int32(len(slab)-1), slab)
		want[h] = int32(len(slab) - 1)
	}
	if tab.len() != len(want) {
		t.Fatalf("len %d, want %d", tab.len(), len(want))
	}
	for h, s := range want {
		if got := tab.find(h, slab); got != s {
			t.Fatalf("final find %x = %d, want %d", h, got, s)
		}
	}
}

// TestChosenHashesDoNotCollide: hashes chosen to share their low bits
// (as a client picking prompts, or a peer router sending hashes, could
// choose them) still spread over the table's cells, so a probe stays
// short.
func TestChosenHashesDoNotCollide(t *testing.T) {
	var tab slotTable
	tab.resize(1<<13, nil)
	mask := uint64(len(tab.cells) - 1)
	homes := map[uint64]bool{}
	for i := range uint64(4096) {
		homes[tab.home(i<<40, mask)] = true // identical in their low 40 bits
	}
	// Uniform placement of 4,096 keys into 8,192 cells fills about 3,220.
	if len(homes) < 3000 {
		t.Fatalf("4,096 hashes sharing their low bits took %d of 8,192 cells", len(homes))
	}
}
