package audit

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nixcage/nixcage/internal/auditlog"
)

// openFakeClock opens a logger on a temporary file whose budgets read the
// time from *now.
func openFakeClock(t *testing.T) (*Logger, string, *time.Time) {
	path := filepath.Join(t.TempDir(), "audit.jsonl")
	l, err := Open("alice", path, false)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Unix(1000, 0)
	l.bud.now = func() time.Time { return now }
	return l, path, &now
}

// Over budget, records become one summary per decision and window; every
// decision is still counted, and unbudgeted records are all written.
func TestBudgetSummarizes(t *testing.T) {
	l, path, now := openFakeClock(t)
	l.SetBudget("dns", Budget{PerSecond: 1, Burst: 5, Window: time.Hour})
	for i := range 1000 {
		d := Blocked
		if i%10 == 0 {
			d = Allowed
		}
		l.LogBudgeted("dns", Record{Method: "DNS", Host: fmt.Sprintf("n%d.example.com", i%300), Decision: d, Rule: "default-deny"})
		if i == 500 {
			l.Log(Record{Method: "GET", Host: "evil.example.org", Decision: Blocked, Rule: "deny:evil.example.org"})
		}
	}
	*now = now.Add(3 * time.Second) // 3 more tokens
	for range 3 {
		l.LogBudgeted("dns", Record{Method: "DNS", Host: "late.example.com", Decision: Allowed})
	}
	l.Close()
	f, _ := os.Open(path)
	defer f.Close()
	var recs []Record
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		var r Record
		if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
			t.Fatal(err)
		}
		recs = append(recs, r)
	}
	var counted, one int64
	var http, summaries int
	for _, r := range recs {
		switch {
		case r.Method == "GET":
			http++
		case r.Event == EventSummary:
			summaries++
			counted += r.Count
			if r.Rule != "audit-budget:dns" || !strings.Contains(r.Reason, "names") {
				t.Errorf("summary %+v", r)
			}
		default:
			one++
		}
	}
	if http != 1 || one != 8 || summaries != 2 || counted+one != 1003 {
		t.Fatalf("http %d, single %d, summaries %d counting %d; want 1, 8, 2 and 1003 in all:\n%+v", http, one, summaries, counted, recs)
	}
}

// The most an agent can make the gateway write with refusals: 20,000
// refusals over 60 (simulated) seconds, every one to a new made-up name with
// a 14 KiB path of characters JSON escapes six-fold, under three rules. The
// file stays within the bound computed from RefusalBudget and
// auditlog.MaxRecordBytes; the first refusal (the one that mattered) and the
// first of each distinct name within the distinct burst are written whole;
// every refusal is counted.
func TestRefusalBudgetBoundsWhatAFloodWrites(t *testing.T) {
	l, path, now := openFakeClock(t)
	b := RefusalBudget
	b.Window = time.Hour // no flusher tick during the test: summaries at Close
	l.SetBudget(ClassRefusal, b)
	const n, span = 20000, 60 * time.Second
	pad := strings.Repeat("<", 14<<10)
	rules := []string{"default-deny", "port", "http-protocol"}
	l.LogBudgeted(ClassRefusal, Record{Method: "CONNECT", Host: "evil.attacker.test", Decision: Blocked, Rule: "default-deny"})
	for i := range n {
		*now = now.Add(span / n)
		l.LogBudgeted(ClassRefusal, Record{Method: pad, Host: fmt.Sprintf("noise%d.%s", i, pad), Path: pad, Decision: Blocked, Rule: rules[i%3], Reason: pad})
	}
	l.Close()
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	bound := RefusalBudget.MaxRecords(span, len(rules)) * auditlog.MaxRecordBytes
	t.Logf("%d refusals in %v (simulated) wrote %d bytes (%d per refusal); bound %d", n+1, span, fi.Size(), fi.Size()/(n+1), bound)
	if fi.Size() > bound {
		t.Fatalf("%d bytes written, over the budget's bound of %d", fi.Size(), bound)
	}
	f, _ := os.Open(path)
	defer f.Close()
	var counted int64
	var evil bool
	hosts := map[string]bool{}
	sc := bufio.NewScanner(f)
	sc.Buffer(nil, auditlog.MaxRecordBytes)
	for sc.Scan() {
		var r Record
		if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
			t.Fatal(err)
		}
		switch {
		case r.Event == EventSummary:
			counted += r.Count
		default:
			counted++
			evil = evil || r.Host == "evil.attacker.test"
			hosts[r.Host] = true
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatalf("a record over MaxRecordBytes: %v", err)
	}
	if !evil || counted != n+1 {
		t.Fatalf("first refusal written %v; %d refusals counted, want %d", evil, counted, n+1)
	}
	// The distinct burst (less the evil one) went to the first noise names.
	for i := range b.DistinctBurst - 1 {
		if h := auditlog.Clip(fmt.Sprintf("noise%d.%s", i, pad), auditlog.MaxHost); !hosts[h] {
			t.Fatalf("first refusal to distinct name %d not written", i)
		}
	}
}
