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
)

// Over budget, records become one summary per decision and window; every
// decision is still counted, and unbudgeted records are all written.
func TestBudgetSummarizes(t *testing.T) {
	path := filepath.Join(t.TempDir(), "audit.jsonl")
	l, err := Open("alice", path, false)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Unix(1000, 0)
	l.bud.now = func() time.Time { return now }
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
	now = now.Add(3 * time.Second) // 3 more tokens
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
