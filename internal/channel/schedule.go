package channel

import (
	"context"
	"math/rand/v2"
	"sync"
	"time"
)

// Poll schedule (docs/fleet.md "Poll knobs"). The interval is the one
// knob (channel.interval, its default config.DefaultChannelInterval); the
// rest is fixed policy, so every host of a fleet behaves the same way and
// nobody tunes a retry storm into existence.
const (
	// MaxBackoff caps the wait after failures (or the interval, if that
	// is longer): a channel down for a day is retried hourly, not daily.
	MaxBackoff = time.Hour
	// Jitter spreads each wait uniformly over ±20%, so a fleet that
	// booted together does not poll in lockstep.
	Jitter = 0.2
	// FirstPollWithin: the first poll after caged starts comes within
	// this (or the interval, if shorter), spread uniformly.
	FirstPollWithin = 30 * time.Second
)

// Schedule computes waits between polls.
type Schedule struct{ Interval time.Duration }

// First is the wait before the first poll, for u uniform in [0, 1).
func (s Schedule) First(u float64) time.Duration {
	return time.Duration(u * float64(min(s.Interval, FirstPollWithin)))
}

// Delay is the wait after a poll that left failures consecutive failures
// (0: it succeeded), for u uniform in [0, 1): the interval, doubled per
// failure up to max(MaxBackoff, interval), then jittered by ±Jitter.
func (s Schedule) Delay(failures int, u float64) time.Duration {
	d := s.Interval
	ceiling := max(MaxBackoff, s.Interval)
	for i := 0; i < failures && d < ceiling; i++ {
		d *= 2
	}
	d = min(d, ceiling)
	return time.Duration(float64(d) * (1 + Jitter*(2*u-1)))
}

// Clock is the poller's view of time, injected by tests.
type Clock interface {
	Now() time.Time
	After(d time.Duration) <-chan time.Time
}

// SystemClock is the real clock.
type SystemClock struct{}

func (SystemClock) Now() time.Time                         { return time.Now() }
func (SystemClock) After(d time.Duration) <-chan time.Time { return time.After(d) }

// Status is what the poller reports (cagectl status, D-Bus, metrics).
type Status struct {
	LastPoll    time.Time // when the last poll finished (zero: none yet)
	LastSuccess time.Time // when a poll last succeeded
	NextPoll    time.Time // when the next poll is due
	// Published is the generation the channel's index named at the last
	// poll that read it (0: never read).
	Published uint64
	LastError string // "" after a successful poll
	Failures  int    // consecutive failed polls
}

// PollFunc is one poll: it returns the generation the index names (0 if
// the index could not be read) and what went wrong, if anything.
type PollFunc func(ctx context.Context) (published uint64, err error)

// Poller runs a PollFunc on a Schedule until its context ends.
type Poller struct {
	Poll PollFunc
	// Interval is read before every wait, so a reloaded configuration
	// takes effect at the next poll.
	Interval func() time.Duration
	Clock    Clock          // nil: SystemClock
	Rand     func() float64 // uniform in [0, 1); nil: math/rand/v2
	// OnStatus, if set, is called after every poll with the new status.
	OnStatus func(Status)

	mu sync.Mutex
	st Status
}

// Status is a copy of the current status.
func (p *Poller) Status() Status {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.st
}

// Run polls until ctx ends.
func (p *Poller) Run(ctx context.Context) {
	clock := p.Clock
	if clock == nil {
		clock = SystemClock{}
	}
	random := p.Rand
	if random == nil {
		random = rand.Float64
	}
	delay := Schedule{p.Interval()}.First(random())
	p.mu.Lock()
	p.st.NextPoll = clock.Now().Add(delay)
	p.mu.Unlock()
	for {
		select {
		case <-ctx.Done():
			return
		case <-clock.After(delay):
		}
		pub, err := p.Poll(ctx)
		if ctx.Err() != nil {
			return
		}
		var st Status
		delay, st = p.record(clock.Now(), pub, err, func(failures int) time.Duration {
			return Schedule{p.Interval()}.Delay(failures, random())
		})
		if p.OnStatus != nil {
			p.OnStatus(st)
		}
	}
}

// record notes a poll's outcome and when the next one is due.
func (p *Poller) record(now time.Time, pub uint64, err error, next func(failures int) time.Duration) (time.Duration, Status) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.st.LastPoll = now
	if pub != 0 {
		p.st.Published = pub
	}
	if err != nil {
		p.st.LastError = err.Error()
		p.st.Failures++
	} else {
		p.st.LastError = ""
		p.st.Failures = 0
		p.st.LastSuccess = now
	}
	d := next(p.st.Failures)
	p.st.NextPoll = now.Add(d)
	return d, p.st
}
