package cli

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/nixcage/nixcage/internal/daemon/daemontest"
	"github.com/nixcage/nixcage/internal/egress/audit"
	"github.com/nixcage/nixcage/internal/paths"
)

// An agent controls the path (and through the host and reasons, parts of
// other fields) of its audit records. A crafted path, written by the
// gateway's own audit logger, must show as one escaped line in `cagectl
// audit`: no fake second "allowed" line, no escape sequence erasing the
// real one, no bidi override reordering it.
func TestAuditEscapesAgentControlledFields(t *testing.T) {
	c := daemontest.Start(t, cliAgents)
	f := c.Path(filepath.Join(paths.AuditDir("alpha"), "audit.jsonl"))
	os.MkdirAll(filepath.Dir(f), 0o755)
	l, err := audit.Open("alpha", f, false)
	if err != nil {
		t.Fatal(err)
	}
	fake := "/x\r\n2026-12-01T00:00:00Z  allowed  GET     api.example.com:443/v1  host allowed"
	hide := "/y\x1b[2K\x1b[1A\rallowed\u202e\u009b2J"
	for _, p := range []string{fake, hide} {
		if err := l.Log(audit.Record{Method: "GET", Host: "evil.example.org", Port: 80, Path: p, Decision: audit.Blocked, Reason: "host evil.example.org matches deny pattern evil.example.org\x07", Rule: "deny:evil.example.org"}); err != nil {
			t.Fatal(err)
		}
	}
	l.Close()
	for _, mode := range [][]string{nil, {"--json"}} {
		out := mustRun(t, append([]string{"audit", "alpha", "--bus", c.Bus.Address}, mode...)...)
		lines := strings.Split(strings.TrimSuffix(out, "\n"), "\n")
		if len(lines) != 2 {
			t.Fatalf("audit %v: %d lines for 2 records:\n%s", mode, len(lines), out)
		}
		for _, l := range lines {
			if strings.ContainsAny(l, "\r\x1b\x07\u202e\u009b") {
				t.Fatalf("audit %v printed a control character: %q", mode, l)
			}
			if !strings.Contains(l, "blocked") || !strings.Contains(l, "evil.example.org") {
				t.Fatalf("audit %v: %q", mode, l)
			}
		}
		if mode == nil && (!strings.Contains(lines[0], `/x\r\n2026-12-01`) || !strings.Contains(lines[1], `/y\x1b[2K\x1b[1A\rallowed\u202e\u009b2J`)) {
			t.Fatalf("escapes not shown:\n%s", out)
		}
	}
}
