package cli

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/nixcage/nixcage/internal/daemon/daemontest"
	"github.com/nixcage/nixcage/internal/paths"
	"github.com/nixcage/nixcage/internal/policy"
	"github.com/nixcage/nixcage/internal/testenv"
)

// TestApprovalsThroughCaged: cagectl approvals and approve against a real
// caged on a real dbus-daemon, the test in the gateway's place writing a
// pending file as the gateway does (policy.WriteFileAtomic of a
// policy.Pending) and reading the decision with the gateway's reader
// (policy.LoadDecision). A viewer and an operator of another agent are
// refused (exit 3), so nothing in a cage's reach approves; the agent's
// words (path) are shown escaped; `host` makes a grant; a decision leaves
// with its pending request.
func TestApprovalsThroughCaged(t *testing.T) {
	testenv.RequirePrivileged(t)
	c := daemontest.Start(t, cliAgents+`
account "ops" {
  user   = "www-data"
  role   = "operator"
  agents = ["beta-2"]
}
`)
	bus := []string{"--bus", c.Bus.Address}
	id, _ := policy.NewApprovalID()
	now := time.Now()
	ap := c.Pend(policy.Pending{Schema: policy.ApprovalSchema, ID: id, Agent: "alpha", Method: "GET", Host: "registry.npmjs.org", Port: 80,
		Path: "/pkg\x1b[31mred", SinceUnix: now.Unix(), ExpiresUnix: now.Add(time.Minute).Unix()})
	// A file that is not a pending request (a gateway's, so the agent's,
	// input) is skipped, not shown.
	os.WriteFile(filepath.Join(ap.PendingDir, "a-000000000000.json"), []byte(`{"schema":1,"id":"a-000000000000","agent":"alpha","method":"GET","host":"10.0.0.1","port":80,"since_unix":1,"expires_unix":99999999999}`), 0o644)

	out := mustRun(t, append([]string{"approvals"}, bus...)...)
	if !strings.Contains(out, id) || !strings.Contains(out, "registry.npmjs.org:80") || strings.Contains(out, "\x1b") || !strings.Contains(out, `\x1b[31mred`) {
		t.Fatalf("approvals:\n%q", out)
	}
	if strings.Contains(out, "a-000000000000") || strings.Contains(out, "10.0.0.1") {
		t.Fatalf("a malformed pending file was listed:\n%s", out)
	}

	run := asOtherUID(t, c)
	for _, uid := range []uint32{65534, 33} { // a viewer; an operator of beta-2 only
		if code, out := run(uid, "approve", id, "once"); code != ExitDenied || !strings.Contains(out, "access denied") {
			t.Errorf("uid %d approve: exit %d:\n%s", uid, code, out)
		}
	}
	if d, err := policy.LoadDecision(ap, "alpha", id); err != nil || d != nil {
		t.Fatalf("a refused caller left a decision: %+v %v", d, err)
	}

	out = mustRun(t, append([]string{"approve", id, "host"}, bus...)...)
	m := regexp.MustCompile(`approved ` + id + `: grant (g-[0-9a-f]+) for 1h0m0s`).FindStringSubmatch(out)
	if m == nil {
		t.Fatalf("approve host: %q", out)
	}
	d, err := policy.LoadDecision(ap, "alpha", id)
	if err != nil || d == nil || d.Verdict != policy.VerdictHost || d.Grant != m[1] || d.By != "root (uid 0)" {
		t.Fatalf("decision as the gateway reads it: %+v %v", d, err)
	}
	doc, err := policy.LoadGrants(c.Path(paths.GrantsFile("alpha")), "alpha")
	if err != nil || len(doc.Grants) != 1 || doc.Grants[0].Host != "registry.npmjs.org" || doc.Grants[0].Port != 0 || doc.Grants[0].ExpiresUnix-doc.Grants[0].CreatedUnix != int64(policy.DefaultGrantDuration/time.Second) {
		t.Fatalf("grant from approve host: %+v %v", doc, err)
	}

	// The gateway removes its pending file once decided; caged then
	// removes the decision.
	os.Remove(ap.PendingFile(id))
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if _, err := os.Stat(ap.DecisionFile(id)); os.IsNotExist(err) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("decision file left after its request ended")
		}
	}
	if code, out := run(0, "approve", id, "deny"); code == ExitOK || !strings.Contains(out, "no request "+id+" is waiting") {
		t.Errorf("approve of a finished request: exit %d:\n%s", code, out)
	}
	if code, _ := run(0, "approve", "a-nothex", "once"); code != ExitUsage {
		t.Errorf("bad id: exit %d", code)
	}
}

// TestLearnStatusThroughCaged: caged reads the learn window the prepare
// step stamps (root-owned, as the gateway reads it) and cagectl status
// says LEARNING with the time left; a stamp others may write is ignored.
func TestLearnStatusThroughCaged(t *testing.T) {
	testenv.RequireRoot(t, "caged trusts only a root-owned learn window")
	c := daemontest.Start(t, `
agent "gamma" {
  backend = "service"
  command = ["/bin/sleep", "infinity"]
  learn   = true
}
`)
	file := c.Path(paths.LearnFile("gamma"))
	if err := os.MkdirAll(filepath.Dir(file), 0o755); err != nil {
		t.Fatal(err)
	}
	os.Chmod(filepath.Dir(file), 0o755)
	now := time.Now()
	b, _ := policy.MarshalDoc(&policy.LearnWindow{Schema: policy.LearnSchema, Agent: "gamma", StartedUnix: now.Unix(), UntilUnix: now.Add(20 * time.Minute).Unix()})
	if err := policy.WriteFileAtomic(file, b); err != nil {
		t.Fatal(err)
	}
	out := mustRun(t, "status", "--bus", c.Bus.Address)
	if !regexp.MustCompile(`gamma .*LEARNING \((19m5\d|20m0)s left\)`).MatchString(out) || !strings.Contains(out, "LEARNING: gamma allows requests outside its policy") {
		t.Fatalf("status does not show learn mode:\n%s", out)
	}
	os.Chmod(file, 0o666)
	if out := mustRun(t, "status", "--bus", c.Bus.Address); strings.Contains(out, "LEARNING") {
		t.Fatalf("status trusts a learn window others may write:\n%s", out)
	}
}
