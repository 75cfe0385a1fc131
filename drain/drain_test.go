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
	r.Drain("a", time.Hour, ByAdmin)
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
	deadline := time.Now().Add(time.Second)
	for drained.Load() != 1 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	if drained.Load() != 1 {
		t.Fatal("Drained event not delivered")
	}
	if !r.Undrain("a", ByAdmin) || r.IsDraining("a") {
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
	r.Drain("a", 20*time.Millisecond, ByAdmin)
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
	r.Drain("a", 30*time.Millisecond, ByConfig)
	r.Undrain("a", ByAdmin)
	time.Sleep(60 * time.Millisecond)
	end()
}

func TestCausesOnlyLiftTheirOwnDrains(t *testing.T) {
	r := New(Events{})
	r.Drain("a", time.Hour, ByAdmin)
	if r.Undrain("a", ByHealth) || !r.IsDraining("a") {
		t.Fatal("health lifted an admin drain")
	}
	r.Drain("b", time.Hour, ByHealth)
	if r.Undrain("b", ByConfig) || !r.Undrain("b", ByHealth) || r.IsDraining("b") {
		t.Fatal("health's drain not lifted by health alone")
	}
}

func TestEarlierDeadlineWins(t *testing.T) {
	r := New(Events{})
	r.Begin("a", func() {})
	r.Drain("a", 10*time.Millisecond, ByAdmin)
	r.Drain("a", time.Hour, ByHealth)
	s := r.Snapshot()[0]
	if time.Until(s.Deadline) > time.Second || s.Cause != ByAdmin {
		t.Fatalf("later drain replaced an earlier deadline: %+v", s)
	}
}

// TestTransitionEvents: Draining and Undrained fire on real changes of
// phase only, whatever asked for them.
func TestTransitionEvents(t *testing.T) {
	var mu sync.Mutex
	var got []string
	r := New(Events{
		Draining: func(key string, cause Cause, _ time.Duration) {
			mu.Lock()
			got = append(got, "draining "+key+" "+string(cause))
			mu.Unlock()
		},
		Undrained: func(key string, cause Cause) {
			mu.Lock()
			got = append(got, "undrained "+key+" "+string(cause))
			mu.Unlock()
		},
	})
	r.Undrain("a", ByAdmin) // already active
	r.Drain("a", time.Hour, ByConfig)
	r.Drain("a", time.Minute, ByAdmin) // already draining: no event
	r.Undrain("a", ByHealth)           // not health's drain: stays
	r.Undrain("a", ByAdmin)
	r.Undrain("a", ByAdmin) // already active
	want := []string{"draining a config", "undrained a admin"}
	deadline := time.Now().Add(5 * time.Second)
	for {
		mu.Lock()
		n := len(got)
		mu.Unlock()
		if n >= len(want) || time.Now().After(deadline) {
			break
		}
		time.Sleep(time.Millisecond)
	}
	time.Sleep(20 * time.Millisecond) // let any stray event arrive
	mu.Lock()
	defer mu.Unlock()
	slices.Sort(got)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Fatalf("events %q, want %q", got, want)
	}
}
