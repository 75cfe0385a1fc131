package drain

import (
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

func TestLifecycle(t *testing.T) {
	var drained atomic.Int32
	r := New(Events{Drained: func(string) { drained.Add(1) }})
	if r.IsDraining("a") || r.Phase("a") != Active {
		t.Fatal("unknown upstream not active")
	}
	end1 := r.Begin("a", func() {})
	end2 := r.Begin("a", func() {})
	r.Drain("a", time.Hour, Admin)
	if !r.IsDraining("a") || r.Phase("a") != Draining {
		t.Fatal("not draining")
	}
	end1()
	end1() // idempotent
	if r.Phase("a") != Draining {
		t.Fatal("drained with one request left")
	}
	end2()
	if r.Phase("a") != Drained {
		t.Fatalf("phase %v after the last request", r.Phase("a"))
	}
	if drained.Load() != 1 { // delivered before end returns
		t.Fatal("Drained event not delivered")
	}
	if !r.Undrain("a", Admin) || r.IsDraining("a") {
		t.Fatal("undrain failed")
	}
}

func TestDeadlineCutsWhatIsLeft(t *testing.T) {
	var cutEvents atomic.Int32
	r := New(Events{DeadlineCut: func(_ string, n int) { cutEvents.Add(int32(n)) }})
	var cut sync.WaitGroup
	cut.Add(2)
	var ends []func()
	for i := 0; i < 2; i++ {
		ends = append(ends, r.Begin("a", cut.Done))
	}
	other := r.Begin("b", func() { t.Error("cut a request on another upstream") })
	r.Drain("a", 20*time.Millisecond, Admin)
	done := make(chan struct{})
	go func() { cut.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(2 * time.Second):
		t.Fatal("deadline did not cut the requests")
	}
	for _, e := range ends {
		e()
	}
	other()
	if r.Phase("a") != Drained || cutEvents.Load() != 2 {
		t.Fatalf("phase %v, cut events %d", r.Phase("a"), cutEvents.Load())
	}
	if s := r.Snapshot(); len(s) != 1 || s[0].CutAtDeadline != 2 || s[0].Phase != "drained" {
		t.Fatalf("snapshot %+v", s)
	}
}

func TestUndrainBeforeDeadlineCutsNothing(t *testing.T) {
	r := New(Events{})
	end := r.Begin("a", func() { t.Error("cut after undrain") })
	r.Drain("a", 30*time.Millisecond, Hold{Cause: ByConfig, Owner: "site-a"})
	r.Undrain("a", Admin)
	// The deadline's timer was stopped: expire finds nothing to cut even
	// when called for that deadline.
	r.expire("a", time.Now())
	end()
}

var (
	healthA = Hold{Cause: ByHealth, Owner: "site-a"}
	healthB = Hold{Cause: ByHealth, Owner: "site-b"}
	configA = Hold{Cause: ByConfig, Owner: "site-a"}
	configB = Hold{Cause: ByConfig, Owner: "site-b"}
)

func TestOwnersOnlyLiftTheirOwnHolds(t *testing.T) {
	r := New(Events{})
	r.Drain("a", time.Hour, Admin)
	if r.Undrain("a", healthA) || !r.IsDraining("a") {
		t.Fatal("health lifted an admin drain")
	}
	r.Drain("b", time.Hour, healthA)
	if r.Undrain("b", configA) || r.Undrain("b", healthB) || !r.IsDraining("b") {
		t.Fatal("another cause or another site lifted site a's health drain")
	}
	if !r.Undrain("b", healthA) || r.IsDraining("b") {
		t.Fatal("site a's health drain not lifted by site a")
	}
	// Two sites hold: the upstream drains until both let go.
	r.Drain("c", time.Hour, configA)
	r.Drain("c", time.Hour, healthB)
	if r.Undrain("c", configA) || !r.IsDraining("c") {
		t.Fatal("site b's hold was lifted with site a's")
	}
	if s := r.Snapshot(); s[len(s)-1].Cause != ByHealth {
		t.Fatalf("causes %q after site a let go", s[len(s)-1].Cause)
	}
	if !r.Held("c", healthB) || r.Held("c", configA) {
		t.Fatal("Held disagrees with the holds")
	}
	r.ReleaseOwner("site-b")
	if r.IsDraining("c") {
		t.Fatal("ReleaseOwner left site b's hold")
	}
	// ReleaseOwner never lifts the admin's hold; Forget lifts all.
	r.Drain("d", time.Hour, Admin)
	r.Drain("d", time.Hour, configA)
	r.ReleaseOwner("site-a")
	if !r.IsDraining("d") {
		t.Fatal("ReleaseOwner lifted the admin's hold")
	}
	r.Forget("d")
	if r.IsDraining("d") || slices.ContainsFunc(r.Snapshot(), func(s Status) bool { return s.Key == "d" }) {
		t.Fatalf("Forget left %+v", r.Snapshot())
	}
}

// TestHealthVerdictsDoNotFlap: site a finds the upstream down, site b
// finds it up; b's watcher undrains with its own hold on every poll and
// the upstream stays draining, with one transition.
func TestHealthVerdictsDoNotFlap(t *testing.T) {
	var transitions int
	r := New(Events{
		Draining:  func(string, Cause, time.Duration) { transitions++ },
		Undrained: func(string, Cause) { transitions++ },
	})
	for range 10 {
		if !r.Held("x", healthA) {
			r.Drain("x", time.Hour, healthA)
		}
		r.Undrain("x", healthB)
	}
	if !r.IsDraining("x") || transitions != 1 {
		t.Fatalf("draining %v after %d transitions", r.IsDraining("x"), transitions)
	}
}

func TestEarlierDeadlineWins(t *testing.T) {
	r := New(Events{})
	r.Begin("a", func() {})
	r.Drain("a", 10*time.Millisecond, Admin)
	r.Drain("a", time.Hour, healthA)
	s := r.Snapshot()[0]
	if time.Until(s.Deadline) > time.Second || s.Cause != "admin,health" {
		t.Fatalf("later drain replaced an earlier deadline: %+v", s)
	}
}

// TestTransitionEvents: Draining and Undrained fire on real changes of
// phase only, whatever asked for them, in order, before the call returns.
func TestTransitionEvents(t *testing.T) {
	var got []string
	r := New(Events{
		Draining: func(key string, cause Cause, _ time.Duration) {
			got = append(got, "draining "+key+" "+string(cause))
		},
		Undrained: func(key string, cause Cause) {
			got = append(got, "undrained "+key+" "+string(cause))
		},
		Drained: func(key string) { got = append(got, "drained "+key) },
	})
	r.Undrain("a", Admin) // already active
	r.Drain("a", time.Hour, configA)
	r.Drain("a", time.Minute, Admin) // already draining: no event
	r.Undrain("a", healthA)          // not this hold: stays
	r.Undrain("a", Admin)
	r.Undrain("a", Admin) // already active
	end := r.Begin("b", func() {})
	r.Drain("b", time.Hour, configB)
	end()
	r.ReleaseOwner("site-b")
	want := []string{"draining a config", "drained a", "undrained a admin",
		"draining b config", "drained b", "undrained b config"}
	if !slices.Equal(got, want) {
		t.Fatalf("events %q, want %q", got, want)
	}
}

// TestEventsInOrderAcrossGoroutines: concurrent drains and undrains of
// one upstream deliver alternating events, never two of a kind in a row.
func TestEventsInOrderAcrossGoroutines(t *testing.T) {
	var mu sync.Mutex
	var got []string
	record := func(s string) {
		mu.Lock()
		got = append(got, s)
		mu.Unlock()
	}
	r := New(Events{
		Draining:  func(string, Cause, time.Duration) { record("draining") },
		Undrained: func(string, Cause) { record("undrained") },
	})
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			for range 200 {
				r.Drain("a", time.Hour, Admin)
				r.Undrain("a", Admin)
			}
		})
	}
	wg.Wait()
	for i := 1; i < len(got); i++ {
		if got[i] == got[i-1] {
			t.Fatalf("event %d repeats %q: delivered out of order", i, got[i])
		}
	}
}

// TestBeginOnDrainedIsCut: a request that starts on an upstream already
// drained (routed as the drain began) is in flight there again, and the
// deadline still cuts it.
func TestBeginOnDrainedIsCut(t *testing.T) {
	r := New(Events{})
	r.Drain("a", 20*time.Millisecond, Admin) // nothing in flight: drained at once
	if r.Phase("a") != Drained {
		t.Fatalf("phase %v", r.Phase("a"))
	}
	cut := make(chan struct{})
	end := r.Begin("a", func() { close(cut) })
	defer end()
	if r.Phase("a") != Draining {
		t.Fatalf("phase %v with a request in flight", r.Phase("a"))
	}
	select {
	case <-cut:
	case <-time.After(10 * time.Second):
		t.Fatal("the deadline never cut the late request")
	}
}

// TestBeginAfterTheDeadlineIsCut: a request that starts on an upstream
// whose deadline has cut the others, while they have not all ended (it is
// still draining, with no timer left), is cut at once and counted.
func TestBeginAfterTheDeadlineIsCut(t *testing.T) {
	r := New(Events{})
	firstCut := make(chan struct{})
	endFirst := r.Begin("a", func() { close(firstCut) }) // cut, slow to end
	r.Drain("a", 0, Admin)
	<-firstCut
	late := make(chan struct{})
	endLate := r.Begin("a", func() { close(late) })
	select {
	case <-late:
	case <-time.After(10 * time.Second):
		t.Fatalf("a request entering past the deadline was not cut (phase %v)", r.Phase("a"))
	}
	endFirst()
	endLate()
	if s := r.Snapshot(); len(s) != 1 || s[0].Phase != "drained" || s[0].CutAtDeadline != 2 {
		t.Fatalf("after both ended: %+v, want drained with 2 cut", s)
	}
}

// TestLiftRemovesOnlyThatHold: a peer operator's undrain lifts the
// operators' hold and leaves this router's config and health holds.
func TestLiftRemovesOnlyThatHold(t *testing.T) {
	r := New(Events{})
	r.Drain("a", time.Hour, Admin)
	r.Drain("a", time.Hour, configA)
	if r.Lift("a", Admin) || !r.IsDraining("a") || !r.Held("a", configA) || r.Held("a", Admin) {
		t.Fatal("Lift took more than the admin's hold")
	}
	if !r.HeldBy("a", ByConfig) || r.HeldBy("a", ByHealth) {
		t.Fatal("HeldBy disagrees with the holds")
	}
	if !r.Lift("a", configA) || r.IsDraining("a") {
		t.Fatal("the last hold lifted, still draining")
	}
}

// TestIsDrainingCountsClosedUpstreams: IsDraining's lock-free answer
// follows every way an upstream closes and reopens, also with two
// upstreams closed at once and one lifted.
func TestIsDrainingCountsClosedUpstreams(t *testing.T) {
	r := New(Events{})
	other := Hold{Cause: ByHealth, Owner: "site"}
	r.Drain("a", time.Hour, Admin)
	r.Drain("a", time.Minute, other) // a second hold: still one closed upstream
	r.Drain("b", time.Hour, Admin)
	if !r.IsDraining("a") || !r.IsDraining("b") || r.IsDraining("c") {
		t.Fatal("drains not seen")
	}
	r.Undrain("b", Admin)
	if !r.IsDraining("a") || r.IsDraining("b") {
		t.Fatal("b undrained, a still held")
	}
	r.Lift("a", other)
	if !r.IsDraining("a") {
		t.Fatal("a lost its admin hold with the other")
	}
	r.Forget("a")
	if r.IsDraining("a") || r.closed.Load() != 0 {
		t.Fatalf("closed count %d with every upstream active", r.closed.Load())
	}
	end := r.Begin("a", func() {})
	r.Drain("a", time.Hour, Admin)
	end() // drained
	r.ReleaseOwner("nobody")
	if !r.IsDraining("a") {
		t.Fatal("a drained upstream reported active")
	}
	r.Undrain("a", Admin)
	if r.closed.Load() != 0 {
		t.Fatalf("closed count %d after the last undrain", r.closed.Load())
	}
}

// TestEndReportsACutStillPending: a request the deadline took to cut
// reports so when it ends, also when its Cut has not run yet (it ran late,
// on the deadline's goroutine); one ended before the deadline, or on
// another upstream, does not.
func TestEndReportsACutStillPending(t *testing.T) {
	r := New(Events{})
	early := r.Enter("a", CutFunc(func() { t.Error("cut a request that had ended") }))
	elsewhere := r.Enter("b", CutFunc(func() { t.Error("cut a request on another upstream") }))
	taken := make(chan struct{})
	finish := make(chan struct{})
	late := r.Enter("a", CutFunc(func() { close(taken); <-finish }))
	if early.EndPending() {
		t.Fatal("a request ended before any drain reports a cut")
	}
	r.Drain("a", 0, Admin)
	<-taken // the deadline's Cut runs, and has not returned
	// Past the deadline, while what it cut has not all ended, a new
	// request is cut at once, on a goroutine that may not have run yet.
	past := r.Enter("a", CutFunc(func() {}))
	if !past.EndPending() {
		t.Fatal("a request cut on entering past the deadline does not report it")
	}
	if !late.EndPending() {
		t.Fatal("a request the deadline took to cut does not report it")
	}
	close(finish)
	if late.EndPending() {
		t.Fatal("a second end reports the cut again")
	}
	if elsewhere.EndPending() {
		t.Fatal("a request on an upstream that never drained reports a cut")
	}
}

// TestFlightsAcrossReuse: a flight ended twice, or ended after its slot
// and its upstream's record were reused, ends nothing else; the deadline
// cuts exactly the flights still in; the registry keeps at most maxIdle
// idle upstreams and lists none of them.
func TestFlightsAcrossReuse(t *testing.T) {
	counted := make(chan int, 1)
	r := New(Events{DeadlineCut: func(_ string, n int) { counted <- n }})
	cuts := make(chan int, 8)
	enter := func(i int) Flight {
		return r.Enter("a", CutFunc(func() { cuts <- i }))
	}
	f0 := enter(0)
	f0.End()
	f1 := enter(1) // takes f0's slot, in a record cleared as new
	f0.End()
	f2, f3 := enter(2), enter(3)
	f2.End()
	f2.End()
	if st := r.Snapshot(); len(st) != 1 || st[0].InFlight != 2 {
		t.Fatalf("want a with 2 in flight (f1, f3): %+v", st)
	}
	r.Drain("a", 0, Admin)
	// The deadline cuts on the timer's goroutine, counting them first.
	if n := <-counted; n != 2 {
		t.Fatalf("the deadline cut %d flights, want f1 and f3", n)
	}
	if got := []int{<-cuts, <-cuts}; !slices.Equal(got, []int{1, 3}) && !slices.Equal(got, []int{3, 1}) {
		t.Fatalf("cut flights %v, want f1 and f3", got)
	}
	if !f1.EndPending() || !f3.EndPending() || f1.EndPending() {
		t.Fatal("the cut flights' ends did not report their cuts once")
	}
	if r.Phase("a") != Drained {
		t.Fatalf("a is %s with nothing in flight", r.Phase("a"))
	}
	r.Undrain("a", Admin)

	for i := range 2 * maxIdle {
		r.Begin(string(rune('A'+i)), func() {})()
	}
	r.mu.Lock()
	n := len(r.upstreams)
	r.mu.Unlock()
	if n > maxIdle+1 {
		t.Fatalf("%d upstreams kept with nothing in flight, want at most %d", n, maxIdle+1)
	}
	if st := r.Snapshot(); len(st) != 0 {
		t.Fatalf("idle upstreams listed: %+v", st)
	}
}

// BenchmarkEnterEnd is one request's registration on an upstream with
// another in flight, as every routed request makes.
func BenchmarkEnterEnd(b *testing.B) {
	r := New(Events{})
	cut := CutFunc(func() {})
	r.Enter("b", cut)
	b.ReportAllocs()
	for b.Loop() {
		r.Enter("a", cut).End()
	}
}
