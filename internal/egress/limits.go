package egress

import (
	"sync"
	"time"

	"github.com/nixcage/nixcage/internal/policy"
)

// limiter is a token bucket per destination host. A zero rate disables it.
type limiter struct {
	rate, burst float64
	mu          sync.Mutex
	buckets     map[string]*bucket
	now         func() time.Time
}

type bucket struct {
	tokens float64
	last   time.Time
}

func newLimiter(r policy.RateLimit) *limiter {
	burst := float64(r.Burst)
	if burst < 1 {
		burst = max(1, r.PerSecond)
	}
	return &limiter{rate: r.PerSecond, burst: burst, buckets: map[string]*bucket{}, now: time.Now}
}

// allow takes one token for host.
func (l *limiter) allow(host string) bool {
	if l.rate <= 0 {
		return true
	}
	now := l.now()
	l.mu.Lock()
	defer l.mu.Unlock()
	b, ok := l.buckets[host]
	if !ok {
		if len(l.buckets) > 10000 { // hosts are policy-bounded; this bounds wildcards
			clear(l.buckets)
		}
		b = &bucket{tokens: l.burst, last: now}
		l.buckets[host] = b
	}
	b.tokens = min(l.burst, b.tokens+now.Sub(b.last).Seconds()*l.rate)
	b.last = now
	if b.tokens < 1 {
		return false
	}
	b.tokens--
	return true
}
