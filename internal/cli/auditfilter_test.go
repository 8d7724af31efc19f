package cli

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/nixcage/nixcage/internal/daemon/daemontest"
	"github.com/nixcage/nixcage/internal/paths"
)

// Filters by decision, host and time, all agents at once, one line per
// record, DNS rows readable; read through caged as a viewer would.
func TestAuditFiltersAllAgents(t *testing.T) {
	c := daemontest.Start(t, cliAgents)
	write := func(agent string, lines ...string) {
		f := c.Path(filepath.Join(paths.AuditDir(agent), "audit.jsonl"))
		os.MkdirAll(filepath.Dir(f), 0o755)
		os.WriteFile(f, []byte(strings.Join(lines, "\n")+"\n"), 0o644)
	}
	write("alpha",
		`{"schema":2,"ts":"2026-11-30T10:00:00Z","agent":"alpha","method":"CONNECT","host":"api.example.com","port":443,"decision":"allowed"}`,
		`{"schema":2,"ts":"2026-11-30T11:00:00Z","agent":"alpha","method":"DNS","host":"nope.example.org","port":53,"path":"AAAA","decision":"blocked","reason":"name not allowed:\nNXDOMAIN"}`,
		`{"schema":2,"ts":"2026-11-30T12:00:00Z","agent":"alpha","method":"CONNECT","host":"evil.example.org","port":443,"decision":"blocked","reason":"host not allowed"}`,
	)
	write("beta-2",
		`{"schema":2,"ts":"2026-11-30T10:30:00Z","agent":"beta-2","method":"GET","host":"docs.example.com","port":443,"path":"/x","decision":"flagged","reason":"entropy"}`,
	)
	a := c.Bus.Address
	lines := func(args ...string) []string {
		t.Helper()
		out := mustRun(t, append(append([]string{"audit"}, args...), "--bus", a)...)
		return strings.Split(strings.TrimSpace(out), "\n")
	}
	all := lines()
	if len(all) != 4 || !strings.HasPrefix(all[0], "alpha ") || !strings.HasPrefix(all[1], "beta-2 ") {
		t.Errorf("all agents, in time order with an agent column:\n%s", strings.Join(all, "\n"))
	}
	if got := lines("alpha", "--decision", "blocked"); len(got) != 2 || !strings.Contains(got[0], "DNS     nope.example.org AAAA") || strings.Contains(got[0], ":53") {
		t.Errorf("--decision blocked, DNS row:\n%s", strings.Join(got, "\n"))
	}
	if got := lines("--host", "*.example.com"); len(got) != 2 || !strings.Contains(got[0], "api.example.com") || !strings.Contains(got[1], "docs.example.com") {
		t.Errorf("--host *.example.com:\n%s", strings.Join(got, "\n"))
	}
	if got := lines("--since", "2026-11-30T10:15:00Z", "--until", "2026-11-30T11:30:00Z"); len(got) != 2 || !strings.Contains(got[0], "docs.example.com") || !strings.Contains(got[1], "nope.example.org") {
		t.Errorf("--since/--until:\n%s", strings.Join(got, "\n"))
	}
	if got := lines("--decision", "flagged,allowed", "-n", "1"); len(got) != 1 || !strings.Contains(got[0], "docs.example.com") {
		t.Errorf("--decision flagged,allowed -n 1 (newest):\n%s", strings.Join(got, "\n"))
	}
	if code, _, errs := run(t, "audit", "--decision", "denied", "--bus", a); code != ExitUsage || !strings.Contains(errs, "allowed, flagged or blocked") {
		t.Errorf("bad --decision: exit %d %s", code, errs)
	}
	if code, _, errs := run(t, "audit", "--since", "yesterday", "--bus", a); code != ExitUsage || !strings.Contains(errs, "RFC 3339") {
		t.Errorf("bad --since: exit %d %s", code, errs)
	}
}
