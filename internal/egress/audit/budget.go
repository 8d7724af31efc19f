package audit

import (
	"fmt"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/nixcage/nixcage/internal/egress/ratelimit"
)

// What the agent can make the gateway write is bounded. A cage can send
// DNS queries (or connections beyond the cap) far faster than anyone reads
// records: one record each would let it push the decisions that matter out
// of every bounded window of the log (the evidence excerpt, `cagectl audit
// -n`). So such classes of records have a budget: Burst records at once and
// PerSecond after that; decisions beyond it are counted, per class and
// decision, into one summary record per Window ("dns: 48211 queries for 4103
// names ..."), so the log stays honest (every decision is counted, by
// decision) and small. Records outside a budgeted class (every HTTP
// request, tunnel and refusal the policy makes) are always written.

// Budgeted classes.
const (
	// ClassDNS is every DNS query's record.
	ClassDNS = "dns"
	// ClassCap is connections refused at the max_tunnels cap.
	ClassCap = "max-tunnels"
)

// Budget is a token bucket for one class of records.
type Budget struct {
	PerSecond float64
	Burst     int
	// Window is how long decisions over budget are gathered into one
	// summary record.
	Window time.Duration
}

// DefaultBudget is the gateway's budget for DNS records and for
// connections refused at the cap.
var DefaultBudget = Budget{PerSecond: 20, Burst: 200, Window: 5 * time.Second}

// maxNames bounds the distinct names one summary remembers.
const maxNames = 4096

type class struct {
	b       Budget
	tokens  *ratelimit.Bucket
	pending map[string]*summary // by decision
}

type summary struct {
	first, last time.Time
	n           int64
	method      string
	names       map[string]bool
	namesOver   bool
	rules       map[string]int64
}

type budgets struct {
	mu      sync.Mutex
	classes map[string]*class
	now     func() time.Time
	stop    chan struct{}
	done    chan struct{}
}

// SetBudget puts records logged with LogBudgeted(name, ...) under b, and
// starts the flusher that writes summaries when their window ends.
func (l *Logger) SetBudget(name string, b Budget) {
	l.bud.mu.Lock()
	defer l.bud.mu.Unlock()
	if l.bud.classes == nil {
		l.bud.classes = map[string]*class{}
		if l.bud.now == nil {
			l.bud.now = time.Now
		}
		l.bud.stop, l.bud.done = make(chan struct{}), make(chan struct{})
		go l.flusher(b.Window, l.bud.stop, l.bud.done)
	}
	l.bud.classes[name] = &class{b: b, tokens: ratelimit.New(b.PerSecond, float64(b.Burst)), pending: map[string]*summary{}}
}

// LogBudgeted logs r if class name has budget left, else counts it into the
// class's summary. A class without a budget logs everything.
func (l *Logger) LogBudgeted(name string, r Record) error {
	l.bud.mu.Lock()
	c := l.bud.classes[name]
	if c == nil {
		l.bud.mu.Unlock()
		return l.Log(r)
	}
	now := l.bud.now()
	if c.tokens.Take(now) {
		l.bud.mu.Unlock()
		return l.Log(r)
	}
	s := c.pending[r.Decision]
	if s == nil {
		s = &summary{first: now, method: r.Method, names: map[string]bool{}, rules: map[string]int64{}}
		c.pending[r.Decision] = s
	}
	s.n++
	s.last = now
	if !s.names[r.Host] {
		if len(s.names) < maxNames {
			s.names[r.Host] = true
		} else {
			s.namesOver = true
		}
	}
	s.rules[r.Rule]++
	l.bud.mu.Unlock()
	return nil
}

func (l *Logger) flusher(every time.Duration, stop <-chan struct{}, done chan<- struct{}) {
	defer close(done)
	t := time.NewTicker(max(every/4, 10*time.Millisecond))
	defer t.Stop()
	for {
		select {
		case <-stop:
			return
		case <-t.C:
			l.flush(false)
		}
	}
}

// flush writes the summaries whose window ended (all of them if force).
func (l *Logger) flush(force bool) {
	l.bud.mu.Lock()
	now := l.bud.now()
	var out []Record
	names := make([]string, 0, len(l.bud.classes))
	for n := range l.bud.classes {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, name := range names {
		c := l.bud.classes[name]
		for _, decision := range []string{Blocked, Flagged, Allowed} {
			s := c.pending[decision]
			if s == nil || (!force && now.Sub(s.first) < c.b.Window) {
				continue
			}
			delete(c.pending, decision)
			out = append(out, s.record(name, decision, c.b))
		}
	}
	l.bud.mu.Unlock()
	for _, r := range out {
		_ = l.Log(r)
	}
}

func (s *summary) record(class, decision string, b Budget) Record {
	distinct := fmt.Sprint(len(s.names))
	if s.namesOver {
		distinct = "more than " + distinct
	}
	rules := make([]string, 0, len(s.rules))
	for r, n := range s.rules {
		rules = append(rules, fmt.Sprintf("%s %d", r, n))
	}
	sort.Strings(rules)
	span := s.last.Sub(s.first).Round(time.Second)
	return Record{
		Event:    EventSummary,
		Method:   s.method,
		Decision: decision,
		Rule:     "audit-budget:" + class,
		Reason: fmt.Sprintf("%s: %d %s decisions for %s names in %s not recorded one by one (over the audit budget of %d records then %g/s); by rule: %s",
			class, s.n, decision, distinct, span, b.Burst, b.PerSecond, strings.Join(rules, ", ")),
		Count:      s.n,
		DurationMS: s.last.Sub(s.first).Milliseconds(),
	}
}

// stopBudgets ends the flusher and writes every pending summary.
func (l *Logger) stopBudgets() {
	l.bud.mu.Lock()
	stop := l.bud.stop
	l.bud.stop = nil
	l.bud.mu.Unlock()
	if stop == nil {
		return
	}
	close(stop)
	<-l.bud.done
	l.flush(true)
}
