package procs

import (
	"runtime"
	"sync"
	"testing"
	"time"
)

// keepProcs restores the test binary's GOMAXPROCS after a test that
// governs it.
func keepProcs(t *testing.T) {
	n := runtime.GOMAXPROCS(0)
	t.Cleanup(func() { runtime.GOMAXPROCS(n) })
}

func waitProcs(t *testing.T, want int, within time.Duration) {
	t.Helper()
	deadline := time.Now().Add(within)
	for runtime.GOMAXPROCS(0) != want {
		if time.Now().After(deadline) {
			t.Fatalf("GOMAXPROCS %d after %v, want %d", runtime.GOMAXPROCS(0), within, want)
		}
		time.Sleep(time.Millisecond)
	}
}

func TestNothingToGovern(t *testing.T) {
	keepProcs(t)
	runtime.GOMAXPROCS(4)
	if g := newGovernor(1, "", Hold, nil); g != nil {
		t.Fatal("a governor for one CPU")
	}
	if g := newGovernor(4, "3", Hold, nil); g != nil {
		t.Fatal("a governor although GOMAXPROCS is set in the environment")
	}
	if n := runtime.GOMAXPROCS(0); n != 4 {
		t.Fatalf("GOMAXPROCS changed to %d with nothing to govern", n)
	}
	var g *Governor // nil governs nothing and does not panic
	g.Begin()
	g.End()
}

func TestOneWhileSerialAllWhileOverlapping(t *testing.T) {
	keepProcs(t)
	hold := 50 * time.Millisecond
	g := newGovernor(3, "", hold, nil)
	if g == nil || runtime.GOMAXPROCS(0) != 1 {
		t.Fatalf("after New: GOMAXPROCS %d, want 1", runtime.GOMAXPROCS(0))
	}
	// Serial work, however much of it, stays on one P.
	for range 100 {
		g.Begin()
		g.End()
	}
	if n := runtime.GOMAXPROCS(0); n != 1 {
		t.Fatalf("serial work: GOMAXPROCS %d, want 1", n)
	}
	// The second piece in flight has every P before Begin returns.
	g.Begin()
	g.Begin()
	if n := runtime.GOMAXPROCS(0); n != 3 {
		t.Fatalf("two in flight: GOMAXPROCS %d, want 3", n)
	}
	// Still overlapping after the hold: stays raised.
	time.Sleep(3 * hold)
	if n := runtime.GOMAXPROCS(0); n != 3 {
		t.Fatalf("two in flight after the hold: GOMAXPROCS %d, want 3", n)
	}
	g.End()
	// One left in flight: back to one P after the hold, not before.
	if n := runtime.GOMAXPROCS(0); n != 3 {
		t.Fatalf("right after the overlap: GOMAXPROCS %d, want 3 for the hold", n)
	}
	waitProcs(t, 1, 20*hold)
	g.End()
	// And raised again by the next overlap.
	g.Begin()
	g.Begin()
	if n := runtime.GOMAXPROCS(0); n != 3 {
		t.Fatalf("overlap after lowering: GOMAXPROCS %d, want 3", n)
	}
	g.End()
	g.End()
	waitProcs(t, 1, 20*hold)
}

// Begins racing the watcher's lowering: whenever two pieces of work are
// known to be in flight, the Ps are raised (a lowering never strands
// overlapping work on one P).
func TestOverlapNeverStrandedOnOneP(t *testing.T) {
	keepProcs(t)
	g := newGovernor(2, "", time.Microsecond, nil)
	for i := range 2000 {
		var start, check sync.WaitGroup
		start.Add(2)
		check.Add(1)
		for range 2 {
			go func() {
				g.Begin()
				start.Done()
				check.Wait()
				g.End()
			}()
		}
		start.Wait()
		if n := runtime.GOMAXPROCS(0); n != 2 {
			t.Fatalf("round %d: two in flight on GOMAXPROCS %d", i, n)
		}
		check.Done()
		if i%100 == 0 {
			time.Sleep(time.Millisecond) // let the watcher lower in between
		}
	}
}
