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
// DNS queries, connections beyond the cap or refused requests far faster
// than anyone reads records: one record each would let it push the
// decisions that matter out of every bounded window of the log (the
// evidence excerpt, `cagectl audit -n`). So such classes of records have a
// budget: Burst records at once and PerSecond after that; decisions beyond
// it are counted, per class, decision (and rule, for ByRule classes), into
// one summary record per Window ("dns: 48211 queries for 4103 names ..."),
// so the log stays honest (every decision is counted) and small. A class
// with a Distinct bucket writes the first record of every distinct
// (decision, rule, host) whole even when its budget is spent, as long as
// that second bucket lasts: an operator sees every refused destination,
// not only a count, unless the agent makes up new names faster than that.
// Records outside a budgeted class (allowed requests, tunnels) are always
// written. With every field bounded (auditlog.MaxRecordBytes), a class
// writes at most MaxRecords(d) records in d, whatever the agent sends.

// Budgeted classes.
const (
	// ClassDNS is every DNS query's record.
	ClassDNS = "dns"
	// ClassCap is connections refused at the max_tunnels cap.
	ClassCap = "max-tunnels"
	// ClassRefusal is every other refusal the gateway makes at once
	// (policy, protocol, limits): every blocked record but a tunnel's
	// close.
	ClassRefusal = "refusal"
)

// Budget is a token bucket for one class of records.
type Budget struct {
	PerSecond float64
	Burst     int
	// Window is how long decisions over budget are gathered into one
	// summary record.
	Window time.Duration
	// ByRule gathers decisions over budget per (decision, rule), one
	// summary each, instead of per decision.
	ByRule bool
	// DistinctPerSecond and DistinctBurst, if set, are a second bucket
	// for the first record of each distinct (decision, rule, host).
	DistinctPerSecond float64
	DistinctBurst     int
}

// DefaultBudget is the gateway's budget for DNS records and for
// connections refused at the cap.
var DefaultBudget = Budget{PerSecond: 20, Burst: 200, Window: 5 * time.Second}

// RefusalBudget is the gateway's budget for refusals: 200 at once, then
// 10 a second, summaries per rule; the first refusal of each distinct
// (rule, host) is written whole within a second bucket of 200 at once,
// then 10 a second.
var RefusalBudget = Budget{PerSecond: 10, Burst: 200, Window: 5 * time.Second, ByRule: true, DistinctPerSecond: 10, DistinctBurst: 200}

// MaxRecords bounds the records the class writes in d when its decisions
// fall under keys summary keys (decisions, times rules for ByRule): both
// buckets full at the start, their rates after, and one summary per key
// and window (plus the last, partial window).
func (b Budget) MaxRecords(d time.Duration, keys int) int64 {
	s := d.Seconds()
	n := float64(b.Burst) + b.PerSecond*s + float64(b.DistinctBurst) + b.DistinctPerSecond*s
	windows := int64(d/b.Window) + 1
	return int64(n) + 1 + int64(keys)*windows
}

// maxNames bounds the distinct names one summary remembers; maxDistinct
// the (decision, rule, host) keys a Distinct class remembers (after that,
// new ones are budgeted like repeats); maxKeys the rules that get a
// summary of their own (the rules in force bound them; beyond that they
// share one).
const (
	maxNames    = 4096
	maxDistinct = 16384
	maxKeys     = 256
)

type class struct {
	b        Budget
	tokens   *ratelimit.Bucket
	distinct *ratelimit.Bucket   // nil unless b.DistinctBurst > 0
	seen     map[string]bool     // (decision, rule, host) written whole
	pending  map[string]*summary // by summaryKey
}

type summary struct {
	first, last time.Time
	decision    string
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
	c := &class{b: b, tokens: ratelimit.New(b.PerSecond, float64(b.Burst)), pending: map[string]*summary{}}
	if b.DistinctBurst > 0 {
		c.distinct = ratelimit.New(b.DistinctPerSecond, float64(b.DistinctBurst))
		c.seen = map[string]bool{}
	}
	l.bud.classes[name] = c
}

// firstOfItsKind reports whether r is the first record of its (decision,
// rule, host) in a Distinct class and the distinct bucket allows writing
// it whole (then it is remembered).
func (c *class) firstOfItsKind(r Record, now time.Time) bool {
	if c.distinct == nil {
		return false
	}
	k := r.Decision + "\x00" + r.Rule + "\x00" + r.Host
	if c.seen[k] || len(c.seen) >= maxDistinct || !c.distinct.Take(now) {
		return false
	}
	c.seen[k] = true
	return true
}

// summaryKey is where a decision over budget is counted.
func (c *class) summaryKey(r Record) string {
	if !c.b.ByRule {
		return r.Decision
	}
	k := r.Decision + "\x00" + r.Rule
	if c.pending[k] == nil && len(c.pending) >= maxKeys {
		return r.Decision + "\x00(other rules)"
	}
	return k
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
	// Bounded first, so the distinct key is the host as written.
	r.Bound()
	if c.firstOfItsKind(r, now) || c.tokens.Take(now) {
		l.bud.mu.Unlock()
		return l.Log(r)
	}
	key := c.summaryKey(r)
	s := c.pending[key]
	if s == nil {
		s = &summary{first: now, decision: r.Decision, method: r.Method, names: map[string]bool{}, rules: map[string]int64{}}
		c.pending[key] = s
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
		keys := make([]string, 0, len(c.pending))
		for k, s := range c.pending {
			if force || now.Sub(s.first) >= c.b.Window {
				keys = append(keys, k)
			}
		}
		sort.Strings(keys)
		for _, k := range keys {
			out = append(out, c.pending[k].record(name, c.b))
			delete(c.pending, k)
		}
	}
	l.bud.mu.Unlock()
	for _, r := range out {
		_ = l.Log(r)
	}
}

func (s *summary) record(class string, b Budget) Record {
	decision := s.decision
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
