package channel

import (
	"context"
	"errors"
	"testing"
	"time"
)

func TestScheduleDelay(t *testing.T) {
	s := Schedule{Interval: 5 * time.Minute}
	for _, tc := range []struct {
		name     string
		failures int
		u        float64
		want     time.Duration
	}{
		{"success, no jitter (u=0.5)", 0, 0.5, 5 * time.Minute},
		{"success, earliest", 0, 0, 4 * time.Minute},
		{"success, latest", 0, 1, 6 * time.Minute},
		{"one failure doubles", 1, 0.5, 10 * time.Minute},
		{"three failures", 3, 0.5, 40 * time.Minute},
		{"capped at MaxBackoff", 4, 0.5, time.Hour},
		{"stays capped", 60, 0.5, time.Hour},
		{"cap jittered too", 60, 0, 48 * time.Minute},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := s.Delay(tc.failures, tc.u); got != tc.want {
				t.Fatalf("Delay(%d, %v) = %s, want %s", tc.failures, tc.u, got, tc.want)
			}
		})
	}
	// An interval above MaxBackoff is its own ceiling: failures never
	// make a host poll more often than it is told to.
	long := Schedule{Interval: 3 * time.Hour}
	if got := long.Delay(5, 0.5); got != 3*time.Hour {
		t.Fatalf("3h interval after failures: %s, want 3h", got)
	}
	if got := s.First(0.5); got != 15*time.Second {
		t.Fatalf("First(0.5) = %s, want 15s (half of FirstPollWithin)", got)
	}
	if got := (Schedule{Interval: 2 * time.Second}).First(0.5); got != time.Second {
		t.Fatalf("First with a 2s interval = %s, want 1s", got)
	}
}

// fakeClock hands every requested wait to the test, which fires it: the
// poller's timing is asserted as the sequence of waits it asked for, never
// by measuring time.
type fakeClock struct {
	now   time.Time
	waits chan time.Duration
	fire  chan time.Time
}

func (c *fakeClock) Now() time.Time { return c.now }
func (c *fakeClock) After(d time.Duration) <-chan time.Time {
	c.waits <- d
	return c.fire
}

func TestPollerBacksOffAndRecovers(t *testing.T) {
	clock := &fakeClock{now: time.Unix(1000, 0), waits: make(chan time.Duration), fire: make(chan time.Time)}
	errDown := errors.New("connection refused")
	// What each poll returns, in order.
	script := []struct {
		pub uint64
		err error
	}{
		{3, nil},     // ok
		{0, errDown}, // fails: backoff x2
		{0, errDown}, // x4
		{4, nil},     // recovers: back to the interval
		{4, errDown}, // index read, release refused: still a failure
	}
	polls := 0
	statuses := make(chan Status, len(script))
	p := &Poller{
		Clock:    clock,
		Rand:     func() float64 { return 0.5 }, // no jitter
		Interval: func() time.Duration { return time.Minute },
		Poll: func(context.Context) (uint64, error) {
			r := script[polls]
			polls++
			return r.pub, r.err
		},
		OnStatus: func(s Status) { statuses <- s },
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { p.Run(ctx); close(done) }()

	if d := <-clock.waits; d != 15*time.Second {
		t.Fatalf("first wait %s, want 15s", d)
	}
	want := []struct {
		wait     time.Duration
		failures int
		lastErr  string
		pub      uint64
		success  bool
	}{
		{time.Minute, 0, "", 3, true},
		{2 * time.Minute, 1, "connection refused", 3, false},
		{4 * time.Minute, 2, "connection refused", 3, false},
		{time.Minute, 0, "", 4, true},
		{2 * time.Minute, 1, "connection refused", 4, false},
	}
	for i, w := range want {
		clock.now = clock.now.Add(time.Minute)
		clock.fire <- clock.now
		st := <-statuses
		if d := <-clock.waits; d != w.wait {
			t.Fatalf("poll %d: next wait %s, want %s", i, d, w.wait)
		}
		if st.Failures != w.failures || st.LastError != w.lastErr || st.Published != w.pub {
			t.Fatalf("poll %d: status %+v, want failures %d, error %q, published %d", i, st, w.failures, w.lastErr, w.pub)
		}
		if !st.LastPoll.Equal(clock.now) {
			t.Fatalf("poll %d: LastPoll %s, want %s", i, st.LastPoll, clock.now)
		}
		if w.success != st.LastSuccess.Equal(clock.now) {
			t.Fatalf("poll %d: LastSuccess %s (now %s), success %v", i, st.LastSuccess, clock.now, w.success)
		}
		if !st.NextPoll.Equal(clock.now.Add(w.wait)) {
			t.Fatalf("poll %d: NextPoll %s, want %s", i, st.NextPoll, clock.now.Add(w.wait))
		}
	}
	cancel()
	<-done
	if polls != len(script) {
		t.Fatalf("%d polls, want %d", polls, len(script))
	}
}

// The interval is read before every wait: a reload takes effect at the
// next poll without restarting the poller.
func TestPollerFollowsIntervalChanges(t *testing.T) {
	clock := &fakeClock{now: time.Unix(0, 0), waits: make(chan time.Duration), fire: make(chan time.Time)}
	interval := time.Minute
	ivals := make(chan time.Duration, 1)
	p := &Poller{
		Clock: clock, Rand: func() float64 { return 0.5 },
		Interval: func() time.Duration {
			select {
			case interval = <-ivals:
			default:
			}
			return interval
		},
		Poll: func(context.Context) (uint64, error) { return 1, nil },
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { p.Run(ctx); close(done) }()
	<-clock.waits
	clock.fire <- clock.now
	if d := <-clock.waits; d != time.Minute {
		t.Fatalf("wait %s, want 1m", d)
	}
	ivals <- 10 * time.Minute
	clock.fire <- clock.now
	if d := <-clock.waits; d != 10*time.Minute {
		t.Fatalf("after the change: wait %s, want 10m", d)
	}
	cancel()
	<-done
}
