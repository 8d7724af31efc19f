package cli

import (
	"fmt"
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

// --distinct, through caged as a viewer: the first blocked CONNECT stays on
// screen after a flood of repeats and budget summaries that fills any
// newest-N view, with how many decisions each line stands for.
func TestAuditDistinctShowsWhatAFloodHides(t *testing.T) {
	c := daemontest.Start(t, cliAgents)
	f := c.Path(filepath.Join(paths.AuditDir("alpha"), "audit.jsonl"))
	os.MkdirAll(filepath.Dir(f), 0o755)
	var b strings.Builder
	b.WriteString(`{"schema":2,"ts":"2026-11-30T10:00:00Z","agent":"alpha","method":"CONNECT","host":"evil.attacker.test","port":443,"decision":"blocked","rule":"default-deny"}` + "\n")
	for i := range 3000 {
		fmt.Fprintf(&b, `{"schema":2,"ts":"2026-11-30T10:00:01.%04dZ","agent":"alpha","method":"CONNECT","host":"a.test","port":443,"decision":"blocked","rule":"default-deny"}`+"\n", i)
	}
	b.WriteString(`{"schema":2,"ts":"2026-11-30T10:00:05Z","agent":"alpha","event":"summary","decision":"blocked","rule":"audit-budget:refusal","reason":"refusal: ...","count":5000}` + "\n")
	os.WriteFile(f, []byte(b.String()), 0o644)

	newest := mustRun(t, "audit", "alpha", "-n", "1000", "--bus", c.Bus.Address)
	if strings.Contains(newest, "evil.attacker.test") {
		t.Fatal("the newest 1000 records still hold the first one: the flood is too small to test --distinct")
	}
	got := strings.Split(strings.TrimSpace(mustRun(t, "audit", "alpha", "--distinct", "--bus", c.Bus.Address)), "\n")
	if len(got) != 3 || !strings.Contains(got[0], "evil.attacker.test:443") || !strings.HasSuffix(got[0], "[1 decisions like it]") ||
		!strings.Contains(got[1], "a.test:443") || !strings.HasSuffix(got[1], "[3000 decisions like it]") ||
		!strings.Contains(got[2], "audit-budget:refusal") || !strings.HasSuffix(got[2], "[5000 decisions like it]") {
		t.Fatalf("--distinct:\n%s", strings.Join(got, "\n"))
	}
	if got := strings.TrimSpace(mustRun(t, "audit", "alpha", "--distinct", "-n", "1", "--json", "--bus", c.Bus.Address)); !strings.Contains(got, `"host":"evil.attacker.test"`) || strings.Contains(got, "\n") {
		t.Fatalf("--distinct -n 1 --json: %s", got)
	}
}
