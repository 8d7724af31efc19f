package ratelimit

import (
	"testing"
	"time"
)

func TestBucket(t *testing.T) {
	b := New(2, 3)
	now := time.Unix(0, 0)
	for i := range 3 {
		if !b.Take(now) {
			t.Fatalf("token %d of a full burst of 3 refused", i)
		}
	}
	if b.Take(now) {
		t.Fatal("fourth token at once granted")
	}
	now = now.Add(time.Second) // +2 tokens
	if !b.Take(now) || !b.Take(now) || b.Take(now) {
		t.Fatal("refill of 2/s not 2 tokens after 1s")
	}
	now = now.Add(time.Hour) // capped at the burst
	n := 0
	for b.Take(now) {
		n++
	}
	if n != 3 {
		t.Fatalf("after an hour %d tokens, want the burst of 3", n)
	}
}
