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
