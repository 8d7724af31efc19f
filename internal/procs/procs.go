// Package procs runs a Go process on one P while its CPU-bound work is
// serial and on the runtime's default number of Ps while such work
// overlaps.
//
// Why: on a small machine a Go process that serves one thing at a time
// with idle Ps pays for them at every wake-up. The goroutine woken by the
// network poller readies an idle P's thread too (a "spinning" M, a futex
// wake-up and a context switch on another core) which then finds nothing
// to do and sleeps again. cage-egress's plain tunnels are kernel work
// (splice) and tiny decisions: with one P it spends a quarter less CPU and
// a third fewer context switches per new tunnel (docs/performance.md,
// "GOMAXPROCS governor"). Its intercepted requests are CPU work (two TLS
// legs, inspection); several at once need every core. So the count of
// such work in flight decides: one P while at most one runs, the default
// as soon as two overlap, and back to one after a quiet hold.
package procs

import (
	"log/slog"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"time"
)

// Hold is how long the Ps stay raised after work last overlapped: long
// enough that a client pausing between parallel requests does not make
// the process flap (each change stops the world for a few microseconds).
const Hold = time.Second

// Governor sets runtime.GOMAXPROCS from the CPU-bound work in flight. A
// nil *Governor governs nothing: Begin and End are no-ops.
type Governor struct {
	high int // the runtime's default GOMAXPROCS when New ran
	hold time.Duration

	busy atomic.Int64 // work in flight
	// last is when work last overlapped (UnixNano); raised says the Ps
	// are at high. Both are read lock-free on the hot path; every change
	// of GOMAXPROCS happens under mu.
	last   atomic.Int64
	raised atomic.Bool
	mu     sync.Mutex
	log    *slog.Logger
}

// New lowers the process to one P and returns its governor, or returns
// nil and changes nothing when there is nothing to govern: one CPU, or a
// GOMAXPROCS set in the environment (an operator's choice wins). Every
// change is logged at debug level.
func New(log *slog.Logger) *Governor {
	return newGovernor(runtime.GOMAXPROCS(0), os.Getenv("GOMAXPROCS"), Hold, log)
}

func newGovernor(high int, env string, hold time.Duration, log *slog.Logger) *Governor {
	if high <= 1 || env != "" {
		return nil
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	g := &Governor{high: high, hold: hold, log: log}
	g.set(1, "serial work")
	return g
}

// set changes GOMAXPROCS (under mu, or before the governor is shared).
func (g *Governor) set(n int, why string) {
	runtime.GOMAXPROCS(n)
	g.log.Debug("GOMAXPROCS set", "procs", n, "why", why)
}

// Begin marks one piece of CPU-bound work started; End marks it done.
// The second piece in flight raises the Ps before it runs.
func (g *Governor) Begin() {
	if g == nil {
		return
	}
	if g.busy.Add(1) < 2 {
		return
	}
	g.last.Store(time.Now().UnixNano())
	// Read after the count was raised: lower re-reads the count after it
	// cleared raised, so one of the two always sees the other (a lowering
	// never strands overlapping work on one P).
	if !g.raised.Load() {
		g.raise()
	}
}

// End marks one piece of work done.
func (g *Governor) End() {
	if g != nil {
		g.busy.Add(-1)
	}
}

func (g *Governor) raise() {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.raised.Load() {
		return
	}
	g.set(g.high, "work overlaps")
	g.raised.Store(true)
	go g.watch()
}

// watch runs while the Ps are raised: every hold it lowers them if
// nothing overlapped since the last look and at most one piece of work
// is in flight. An idle process at one P has no watcher and no timer.
func (g *Governor) watch() {
	for {
		time.Sleep(g.hold)
		if g.lower() {
			return
		}
	}
}

// lower reports whether the Ps are back at one.
func (g *Governor) lower() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	if time.Since(time.Unix(0, g.last.Load())) < g.hold {
		return false
	}
	g.raised.Store(false)
	if g.busy.Load() >= 2 {
		g.raised.Store(true)
		return false
	}
	g.set(1, "no overlap for "+g.hold.String())
	return true
}
