package egress

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/nixcage/nixcage/internal/auditlog"
	"github.com/nixcage/nixcage/internal/egress/audit"
	"github.com/nixcage/nixcage/internal/quarantine"
)

// Red team, issue 22 item 3: as the caged agent, one blocked CONNECT to the
// destination that matters, then 200 slightly smaller refused CONNECTs,
// then refused plain-HTTP requests with 14 KiB paths, each on a new
// connection. Before refusals were budgeted and fields bounded, 4,700 such
// requests wrote 69 MB of audit in 2.3 s and the blocked CONNECT was gone
// from the evidence excerpt and from the newest 1000 records. It must be in
// both, and the audit file must stay under the bound computed from the
// refusal budget and auditlog.MaxRecordBytes for the time the gateway ran
// (the bound grows with time, so a slow machine only loosens it).
func TestThreatRefusalFloodCannotHideBlockedRequest(t *testing.T) {
	started := time.Now()
	h := newHarness(t, nil)
	if _, code := h.connect("evil.attacker.test:443", ""); code != 403 {
		t.Fatalf("CONNECT evil: %d", code)
	}
	for range 200 {
		if _, code := h.connect("a.test:443", ""); code != 403 {
			t.Fatalf("CONNECT a.test: %d", code)
		}
	}
	pad := strings.Repeat("A", 14<<10)
	const flood = 5000 // 5000 * 14 KiB > quarantine.DefaultMaxAudit: enough to push it out before
	n := 0
	for n < flood {
		if fi, err := os.Stat(h.rt.AuditFile); err != nil {
			t.Fatal(err)
		} else if fi.Size() > quarantine.DefaultMaxAudit+(1<<20) {
			break // the excerpt's room is spent: the attack has worked
		}
		for range 100 {
			c, err := net.Dial("tcp", h.proxyAddr)
			if err != nil {
				t.Fatal(err)
			}
			fmt.Fprintf(c, "GET http://noise%d.attacker.test/%s HTTP/1.1\r\nHost: x\r\n\r\n", n, pad)
			io.Copy(io.Discard, c)
			c.Close()
			n++
		}
	}
	ran := time.Since(started)
	fi, _ := os.Stat(h.rt.AuditFile)
	t.Logf("%d refused requests in %v wrote %d bytes of audit (%d bytes per request)", 201+n, ran.Round(time.Millisecond), fi.Size(), fi.Size()/int64(201+n))

	var ex bytes.Buffer
	if err := auditlog.Excerpt(&ex, h.rt.AuditFile, "alice", quarantine.DefaultMaxAudit); err != nil {
		t.Fatal(err)
	}
	inExcerpt := strings.Contains(ex.String(), `"host":"evil.attacker.test"`)
	lines, _, err := auditlog.Read(h.rt.AuditFile, -1, 1000)
	if err != nil {
		t.Fatal(err)
	}
	inNewest := strings.Contains(strings.Join(lines, "\n"), `"host":"evil.attacker.test"`)
	if !inExcerpt || !inNewest {
		t.Fatalf("blocked CONNECT to evil.attacker.test: in the evidence excerpt %v, in the newest 1000 records %v", inExcerpt, inNewest)
	}

	// Every refusal here is rule default-deny: one summary key.
	bound := audit.RefusalBudget.MaxRecords(ran, 1) * auditlog.MaxRecordBytes
	if fi.Size() > bound {
		t.Fatalf("%d refusals in %v wrote %d bytes of audit, over the budget's bound of %d", 201+n, ran, fi.Size(), bound)
	}
	// The noise records are cut, and say so.
	for _, r := range h.records(t) {
		if strings.HasPrefix(r.Host, "noise") && r.Event == audit.EventRequest {
			if len(r.Path) > auditlog.MaxPath || !strings.Contains(r.Path, "…(+") {
				t.Fatalf("path of %d bytes not cut with a marker: %.80q", len(r.Path), r.Path)
			}
			break
		}
	}
	// Every refusal is counted: single records plus the summaries' counts
	// (written when the window ends or the gateway stops).
	h.stop()
	var counted int64
	for _, r := range h.records(t) {
		switch {
		case r.Event == audit.EventSummary && r.Rule == "audit-budget:refusal":
			counted += r.Count
		case r.Decision == audit.Blocked:
			counted++
		}
	}
	if counted != int64(201+n) {
		t.Fatalf("%d refusals counted in the log, want %d", counted, 201+n)
	}
}
