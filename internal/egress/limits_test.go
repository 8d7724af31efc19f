package egress

import (
	"testing"
	"time"

	"github.com/nixcage/nixcage/internal/policy"
)

func TestLimiter(t *testing.T) {
	now := time.Unix(1000, 0)
	l := newLimiter(policy.RateLimit{PerSecond: 2, Burst: 3})
	l.now = func() time.Time { return now }
	for i := range 3 {
		if !l.allow("a") {
			t.Fatalf("request %d within burst refused", i)
		}
	}
	if l.allow("a") {
		t.Fatal("request beyond burst allowed")
	}
	if !l.allow("b") {
		t.Fatal("buckets are not per host")
	}
	now = now.Add(500 * time.Millisecond) // one token at 2/s
	if !l.allow("a") || l.allow("a") {
		t.Fatal("refill is not rate-based")
	}
	if off := newLimiter(policy.RateLimit{}); !off.allow("a") {
		t.Fatal("zero rate must not limit")
	}
}
