package prefixindex

import (
	"fmt"
	"math/rand/v2"
	"runtime"
	"sync"
	"testing"
)

// chainOf returns n synthetic chained hashes that extend base.
func chainOf(base []uint64, n int, salt uint64) []uint64 {
	out := append([]uint64(nil), base...)
	prev := uint64(0x1234)
	if len(base) > 0 {
		prev = base[len(base)-1]
	}
	for i := 0; i < n; i++ {
		prev = chain(prev, salt*1_000_003+uint64(i))
		out = append(out, prev)
	}
	return out
}

func TestMatchDepthPerUpstream(t *testing.T) {
	ix := New(0)
	a, b, c := ix.Register("a:1"), ix.Register("b:1"), ix.Register("c:1")
	full := chainOf(nil, 100, 1)
	ix.Insert(a, full[:40])
	ix.Insert(b, full[:100])
	ix.Insert(c, chainOf(nil, 50, 2)) // unrelated
	d := ix.Match(full, nil)
	if d[a] != 40 || d[b] != 100 || d[c] != 0 {
		t.Fatalf("depths a=%d b=%d c=%d, want 40 100 0", d[a], d[b], d[c])
	}
	// A request that diverges after block 10 matches 10 on both.
	other := chainOf(full[:10], 20, 3)
	d = ix.Match(other, d)
	if d[a] != 10 || d[b] != 10 || d[c] != 0 {
		t.Fatalf("diverging: a=%d b=%d c=%d, want 10 10 0", d[a], d[b], d[c])
	}
	if d = ix.Match(nil, d); d[a]+d[b]+d[c] != 0 {
		t.Fatal("empty request matched something")
	}
}

// TestMatchAgreesWithLinearWalk checks the bisecting walk against the
// obvious per-block walk on random insert patterns with many upstreams.
func TestMatchAgreesWithLinearWalk(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	ix := New(1 << 20)
	var ids []UpstreamID
	for i := 0; i < 150; i++ { // three groups
		ids = append(ids, ix.Register(fmt.Sprintf("10.0.0.%d:8000", i)))
	}
	trunk := chainOf(nil, 300, 9)
	held := map[UpstreamID]int{}
	for _, id := range ids {
		k := r.IntN(301)
		ix.Insert(id, trunk[:k])
		held[id] = k
	}
	for trial := 0; trial < 100; trial++ {
		n := r.IntN(301)
		d := ix.Match(trunk[:n], nil)
		for _, id := range ids {
			if want := min(held[id], n); d[id] != want {
				t.Fatalf("trial %d upstream %d: depth %d, want %d", trial, id, d[id], want)
			}
		}
	}
}

func TestLRUEvictsTailsFirst(t *testing.T) {
	ix := New(0)
	u := ix.Register("u:1")
	ix.SetCapacity(u, 10)
	a := chainOf(nil, 6, 1)
	b := chainOf(a[:3], 5, 2) // shares a[0:3], 8 blocks in all
	ix.Insert(u, a)
	ix.Insert(u, b) // 6 + 5 = 11 distinct blocks > 10: the oldest tail, a[5], goes
	if n := ix.Blocks(u); n != 10 {
		t.Fatalf("holds %d blocks, want 10", n)
	}
	if d := ix.Match(a, nil)[u]; d != 5 {
		t.Fatalf("chain a matched %d, want 5 (its tail evicted first)", d)
	}
	if d := ix.Match(b, nil)[u]; d != 8 {
		t.Fatalf("chain b matched %d, want 8", d)
	}
	// Shrinking keeps the shared trunk, the most recently touched.
	ix.SetCapacity(u, 3)
	if da, db := ix.Match(a, nil)[u], ix.Match(b, nil)[u]; da != 3 || db != 3 {
		t.Fatalf("after shrink: a=%d b=%d, want 3 3", da, db)
	}
	// A chain longer than the capacity keeps its leading blocks.
	long := chainOf(nil, 50, 5)
	ix.Insert(u, long)
	if d := ix.Match(long, nil)[u]; d != 3 {
		t.Fatalf("long chain matched %d, want 3", d)
	}
}

func TestRemoveAndReuseHandle(t *testing.T) {
	ix := New(0)
	a, b := ix.Register("a:1"), ix.Register("b:1")
	ix.SetCapacity(a, 64)
	ix.SetCapacity(b, 64)
	c := chainOf(nil, 20, 1)
	ix.Insert(a, c)
	ix.Insert(b, c)
	ix.Remove(a)
	if _, ok := ix.Lookup("a:1"); ok {
		t.Fatal("removed upstream still registered")
	}
	d := ix.Match(c, nil)
	if d[a] != 0 || d[b] != 20 {
		t.Fatalf("after remove: a=%d b=%d", d[a], d[b])
	}
	if id := ix.Register("c:1"); id != a {
		t.Fatalf("freed handle %d not reused, got %d", a, id)
	}
	if ix.Blocks(a) != 0 || ix.Key(a) != "c:1" {
		t.Fatal("reused handle carries old state")
	}
	// The new upstream was never sized: it gets the default, not a's 64.
	if got := ix.Capacity(a); got != DefaultCapacity {
		t.Fatalf("reused handle's capacity %d, want the default %d", got, DefaultCapacity)
	}
	ix.Clear(b)
	if ix.Blocks(b) != 0 || ix.Match(c, nil)[b] != 0 {
		t.Fatal("Clear left blocks")
	}
	if got := ix.Capacity(b); got != 64 { // an engine's restart keeps its size
		t.Fatalf("Clear changed the capacity to %d", got)
	}
	// Clearing twice, and removing an upstream that never held a block
	// (the fleet registers every pool member, inserts only for the chosen
	// one), must not panic.
	ix.Clear(b)
	never := ix.Register("never:1")
	ix.Remove(never)
	if _, ok := ix.Lookup("never:1"); ok {
		t.Fatal("removed upstream still registered")
	}
}

func TestConcurrentUse(t *testing.T) {
	ix := New(500)
	var wg sync.WaitGroup
	for w := 0; w < 8; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			r := rand.New(rand.NewPCG(uint64(w), 0))
			id := ix.Register(fmt.Sprintf("w%d:1", w%4))
			var dst []int
			for i := 0; i < 2000; i++ {
				c := chainOf(nil, 1+r.IntN(40), uint64(r.IntN(30)))
				switch r.IntN(10) {
				case 0:
					ix.SetCapacity(id, 100+r.IntN(500))
				case 1, 2, 3:
					ix.Insert(id, c)
				default:
					dst = ix.Match(c, dst)
				}
			}
		}(w)
	}
	wg.Wait()
	for i := 0; i < 4; i++ {
		id, _ := ix.Lookup(fmt.Sprintf("w%d:1", i))
		if ix.Blocks(id) > ix.Capacity(id) {
			t.Fatalf("upstream %d holds %d > capacity %d", id, ix.Blocks(id), ix.Capacity(id))
		}
	}
}

// TestMemoryPerEntry measures heap bytes per (block, upstream) entry with
// 1M blocks indexed: 8 upstreams holding 125k blocks each. Target ≤ 64 B.
func TestMemoryPerEntry(t *testing.T) {
	if testing.Short() {
		t.Skip("allocates ~100 MB")
	}
	const upstreams, perUpstream = 8, 125_000
	chains := make([][]uint64, upstreams)
	for u := range chains {
		chains[u] = chainOf(nil, perUpstream, uint64(u+1))
	}
	runtime.GC()
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	ix := New(perUpstream)
	for u := 0; u < upstreams; u++ {
		id := ix.Register(fmt.Sprintf("10.0.0.%d:8000", u))
		for off := 0; off < perUpstream; off += 1000 {
			ix.Insert(id, chains[u][off:off+1000])
		}
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	perEntry := float64(after.HeapAlloc-before.HeapAlloc) / (upstreams * perUpstream)
	t.Logf("%.1f heap bytes per (block, upstream) entry with %d entries", perEntry, upstreams*perUpstream)
	if perEntry > 64 {
		t.Errorf("%.1f B per entry, target ≤ 64", perEntry)
	}
	runtime.KeepAlive(ix)
}

// BenchmarkMatch: 1M blocks indexed across 64 upstreams, a request of
// 1,000 blocks that shares a long prefix with several of them.
func BenchmarkMatch(b *testing.B) {
	for _, upstreams := range []int{8, 64} {
		b.Run(fmt.Sprintf("upstreams=%d", upstreams), func(b *testing.B) {
			ix, req := buildBenchIndex(upstreams, 1_000_000, 1000)
			dst := ix.Match(req, nil)
			b.ReportAllocs()
			b.ResetTimer()
			for b.Loop() {
				dst = ix.Match(req, dst)
			}
		})
	}
}

// buildBenchIndex indexes total blocks spread over upstreams: a shared
// trunk of reqBlocks that each upstream holds to a different depth, and
// the rest in unrelated chains. It returns the index and a request that
// walks the trunk.
func buildBenchIndex(upstreams, total, reqBlocks int) (*Index, []uint64) {
	ix := New(total/upstreams + reqBlocks)
	trunk := chainOf(nil, reqBlocks, 999)
	r := rand.New(rand.NewPCG(1, 1))
	per := total / upstreams
	for u := 0; u < upstreams; u++ {
		id := ix.Register(fmt.Sprintf("10.0.%d.%d:8000", u/256, u%256))
		k := r.IntN(reqBlocks)
		ix.Insert(id, trunk[:k])
		for n := k; n < per; n += 500 {
			ix.Insert(id, chainOf(nil, min(500, per-n), uint64(u*10_000+n)))
		}
	}
	return ix, trunk
}

// TestForgetTakesBackOneChainsTail: forgetting the blocks one request
// added leaves what was held before, frees their room for new blocks, and
// leaves other upstreams alone; blocks not held are skipped.
func TestForgetTakesBackOneChainsTail(t *testing.T) {
	ix := New(0)
	u, v := ix.Register("u:1"), ix.Register("v:1")
	ix.SetCapacity(u, 10)
	trunk := chainOf(nil, 4, 1)
	turn := chainOf(trunk, 4, 2) // trunk + 4 blocks of its own
	if held := ix.Insert(u, trunk); held != 0 {
		t.Fatalf("a new trunk was held to depth %d", held)
	}
	if held := ix.Insert(u, turn); held != 4 {
		t.Fatalf("a turn on the trunk was held to depth %d, want the trunk's 4", held)
	}
	ix.Insert(v, turn)
	if n := ix.Forget(u, turn[4:]); n != 4 {
		t.Fatalf("forgetting u's 4-block tail dropped %d blocks", n)
	}
	if n := ix.Forget(u, chainOf(nil, 3, 9)); n != 0 { // never held
		t.Fatalf("forgetting blocks never held dropped %d", n)
	}
	if m := ix.Match(turn, nil); m[u] != 4 || m[v] != 8 || ix.Blocks(u) != 4 {
		t.Fatalf("after forgetting u's tail: u matched %d (holds %d), v %d; want 4 (4), 8", m[u], ix.Blocks(u), m[v])
	}
	// The freed room holds new blocks without evicting the trunk.
	other := chainOf(nil, 6, 3)
	ix.Insert(u, other)
	if m := ix.Match(trunk, nil); m[u] != 4 || ix.Blocks(u) != 10 {
		t.Fatalf("the trunk after 6 new blocks in a 10-block index: matched %d, holds %d", m[u], ix.Blocks(u))
	}
}

// TestRestoreCopiesHoldingsInOrder: another index restored from Entries,
// in pieces most recent first, holds the same blocks in the same recency
// order: what it evicts first is what the original would. Restoring into
// an index that learned something already puts the restored blocks
// behind it, never evicts, and keeps every piece's holdings
// prefix-closed.
func TestRestoreCopiesHoldingsInOrder(t *testing.T) {
	src := New(0)
	s := src.Register("u:1")
	src.SetCapacity(s, 64)
	r := rand.New(rand.NewPCG(3, 4))
	trunk := chainOf(nil, 20, 1)
	var chains [][]uint64
	for i := range 30 {
		c := chainOf(trunk[:r.IntN(len(trunk)+1)], 1+r.IntN(10), uint64(i+2))
		chains = append(chains, c)
		src.Insert(s, c)
	}
	entries := src.Entries("u:1", nil)
	if len(entries) != 64 || src.Blocks(s) != 64 || len(src.Entries("v:1", nil)) != 0 {
		t.Fatalf("%d entries of %d blocks, want 64", len(entries), src.Blocks(s))
	}

	dst := New(0)
	d := dst.Register("u:1")
	dst.SetCapacity(d, 64)
	for len(entries) > 0 {
		piece := entries[:min(7, len(entries))]
		entries = entries[len(piece):]
		dst.Restore(d, piece)
		for _, c := range chains { // prefix-closed: no held block after one missing
			gap := false
			for i, h := range c {
				switch held := holds(dst, d, h); {
				case !held:
					gap = true
				case gap:
					t.Fatalf("block %d of a chain held after a missing one", i)
				}
			}
		}
	}
	if got, want := dst.Entries("u:1", nil), src.Entries("u:1", nil); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("restored order differs:\n got %v\nwant %v", got, want)
	}
	// Both evict the same blocks next.
	extra := chainOf(nil, 10, 99)
	src.Insert(s, extra)
	dst.Insert(d, extra)
	if got, want := dst.Entries("u:1", nil), src.Entries("u:1", nil); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("after an insert, orders differ:\n got %v\nwant %v", got, want)
	}

	// Into an index that holds something: behind it, up to the capacity.
	live := New(0)
	l := live.Register("u:1")
	live.SetCapacity(l, 10)
	fresh := chainOf(nil, 4, 50)
	live.Insert(l, fresh)
	live.Restore(l, src.Entries("u:1", nil))
	got := live.Entries("u:1", nil)
	if len(got) != 10 || fmt.Sprint(got[:4]) != fmt.Sprint(fresh) {
		t.Fatalf("restore into a live index: %v, want the 4 fresh blocks first and 10 in all", got)
	}
	if want := src.Entries("u:1", nil)[:6]; fmt.Sprint(got[4:]) != fmt.Sprint(want) {
		t.Fatalf("restored part %v, want the 6 most recent %v", got[4:], want)
	}
}

// holds reports whether id holds h (Match of a one-block chain).
func holds(ix *Index, id UpstreamID, h uint64) bool { return ix.Match([]uint64{h}, nil)[id] == 1 }
