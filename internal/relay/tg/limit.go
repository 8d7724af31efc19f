package tg

import (
	"sync"
	"time"
)

// Telegram's documented send limits (core.telegram.org/bots/faq, "My bot
// is hitting limits"): about one message per second in a chat, at most 20
// a minute in a group, about 30 a second in all. The Limiter schedules
// every send to respect all three; a 429 answer's retry_after blocks the
// chat on top of that.
const (
	ChatInterval  = time.Second
	GroupPerMin   = 20
	GlobalPerSec  = 30
	groupWindow   = time.Minute
	globalWindow  = time.Second
	maxRetryAfter = 5 * time.Minute
)

// Limiter reserves send slots. Reserve never sleeps: it books the earliest
// slot that keeps every limit and returns how long to wait for it, so
// concurrent senders are served in booking order and a test can drive it
// with a fake clock.
type Limiter struct {
	mu     sync.Mutex
	now    func() time.Time
	chats  map[int64]*chatSlots
	global []time.Time // booked slots of the last globalWindow
	// Limits, overridable for tests (zero: the documented values).
	ChatInterval time.Duration
	GroupPerMin  int
	GlobalPerSec int
}

type chatSlots struct {
	sent    []time.Time // booked slots of the last groupWindow
	blocked time.Time   // retry_after of a 429
}

// NewLimiter makes a limiter with Telegram's limits; now is the clock
// (time.Now when nil).
func NewLimiter(now func() time.Time) *Limiter {
	if now == nil {
		now = time.Now
	}
	return &Limiter{now: now, chats: map[int64]*chatSlots{}, ChatInterval: ChatInterval, GroupPerMin: GroupPerMin, GlobalPerSec: GlobalPerSec}
}

// Reserve books the next slot for a message to chat and returns the wait
// until it.
func (l *Limiter) Reserve(chat int64) time.Duration {
	l.mu.Lock()
	defer l.mu.Unlock()
	now := l.now()
	c := l.chat(chat)
	t := now
	if c.blocked.After(t) {
		t = c.blocked
	}
	for {
		moved := false
		// One message per ChatInterval in a chat.
		if n := len(c.sent); n > 0 && c.sent[n-1].Add(l.ChatInterval).After(t) {
			t, moved = c.sent[n-1].Add(l.ChatInterval), true
		}
		// At most GroupPerMin in any minute of a group (negative ids).
		if chat < 0 && len(c.sent) >= l.GroupPerMin {
			if first := c.sent[len(c.sent)-l.GroupPerMin]; first.Add(groupWindow).After(t) {
				t, moved = first.Add(groupWindow), true
			}
		}
		// At most GlobalPerSec in any second over all chats.
		if len(l.global) >= l.GlobalPerSec {
			if first := l.global[len(l.global)-l.GlobalPerSec]; first.Add(globalWindow).After(t) {
				t, moved = first.Add(globalWindow), true
			}
		}
		if !moved {
			break
		}
	}
	c.sent = insertSorted(c.sent, t)
	l.global = insertSorted(l.global, t)
	c.sent = dropBefore(c.sent, now.Add(-groupWindow))
	l.global = dropBefore(l.global, now.Add(-globalWindow))
	return t.Sub(now)
}

// TryReserve books a slot only if it is free now (chat actions: a typing
// indicator that would have to wait is not worth sending).
func (l *Limiter) TryReserve(chat int64) bool {
	l.mu.Lock()
	now := l.now()
	c := l.chat(chat)
	free := !c.blocked.After(now) &&
		(len(c.sent) == 0 || !c.sent[len(c.sent)-1].Add(l.ChatInterval).After(now)) &&
		(chat >= 0 || len(c.sent) < l.GroupPerMin || !c.sent[len(c.sent)-l.GroupPerMin].Add(groupWindow).After(now)) &&
		(len(l.global) < l.GlobalPerSec || !l.global[len(l.global)-l.GlobalPerSec].Add(globalWindow).After(now))
	l.mu.Unlock()
	if !free {
		return false
	}
	l.Reserve(chat)
	return true
}

// Block holds every send to chat for d (a 429's retry_after, capped so a
// bad answer cannot silence the relay for good).
func (l *Limiter) Block(chat int64, d time.Duration) {
	if d > maxRetryAfter {
		d = maxRetryAfter
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	c := l.chat(chat)
	if until := l.now().Add(d); until.After(c.blocked) {
		c.blocked = until
	}
}

func (l *Limiter) chat(id int64) *chatSlots {
	c := l.chats[id]
	if c == nil {
		c = &chatSlots{}
		l.chats[id] = c
	}
	return c
}

func insertSorted(ts []time.Time, t time.Time) []time.Time {
	i := len(ts)
	for i > 0 && ts[i-1].After(t) {
		i--
	}
	ts = append(ts, time.Time{})
	copy(ts[i+1:], ts[i:])
	ts[i] = t
	return ts
}

func dropBefore(ts []time.Time, t time.Time) []time.Time {
	i := 0
	for i < len(ts) && ts[i].Before(t) {
		i++
	}
	return ts[i:]
}
