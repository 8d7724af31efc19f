// Package ratelimit is the token bucket every gateway limit uses: per-host
// request rates, the cage's DNS lookups and the audit budget.
package ratelimit

import "time"

// Bucket holds up to Burst tokens and gains Rate per second. It is not
// safe for concurrent use; callers hold their own lock.
type Bucket struct {
	Rate, Burst float64
	tokens      float64
	last        time.Time
}

// New returns a full bucket.
func New(rate, burst float64) *Bucket { return &Bucket{Rate: rate, Burst: burst, tokens: burst} }

// Take takes one token at now if there is one.
func (b *Bucket) Take(now time.Time) bool {
	if !b.last.IsZero() {
		b.tokens = min(b.Burst, b.tokens+now.Sub(b.last).Seconds()*b.Rate)
	}
	b.last = now
	if b.tokens < 1 {
		return false
	}
	b.tokens--
	return true
}
