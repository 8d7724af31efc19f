package system

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nixcage/nixcage/internal/systest"
	"github.com/nixcage/nixcage/internal/systest/probe"
	"github.com/nixcage/nixcage/internal/testenv"
)

// A gateway crash loop (issue 22 item 4) on a real systemd: a config the
// gateway refuses makes every restart fail until systemd's start limit
// stops it and fails its sockets. The cage is cut off (fail closed); the
// operator is told, by `cagectl status` and by an EgressFailed event, and
// recovers as docs/operations.md says (`cagectl restart AGENT`). The same
// machine then runs the signed control commands' checks (control_test.go).
func TestGatewayStartLimit(t *testing.T) {
	testenv.RequireSystem(t)
	_, bins := cagedBinaries(t)
	bins["cage-probe"] = systest.BuildT(t, probePkg)
	m, in, ctx := nixcageMachine(t, 5*time.Minute, bins, `
egress_policy "p" {
  allow = ["api.example.com"]
}
agent "sl" {
  backend   = "service"
  command   = ["/bin/sleep", "infinity"]
  egress    = "p"
  autostart = false
}
agent "ap" {
  backend   = "service"
  command   = ["/bin/sleep", "infinity"]
  egress    = "p"
  autostart = false
  approval {
    wait = "60s"
  }
}
`+controlBlock, nil, nil)
	sh, _ := machineScripts(t, ctx, m)
	waitFor := func(what, script string) {
		t.Helper()
		for i := 0; ; i++ {
			if _, err := m.Shell(ctx, script); err == nil {
				return
			}
			if i > 300 {
				t.Fatalf("%s: never true: %s\nstatus:\n%s", what, script, sh("cagectl status; systemctl status --no-pager cage-egress@sl.service cage-egress@sl.socket || true"))
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	sh("systemctl reload dbus && systemctl start nixcage-caged.service")
	sh("cagectl start sl")
	waitFor("the gateway's sockets", "systemctl is-active -q cage-egress@sl.socket")
	sh("cagectl events >/run/operator.events 2>&1 & echo $! >/run/events.pid")
	waitFor("the events stream", "cagectl reload >/dev/null; grep -q Reconciled /run/operator.events")

	checkGrantUnderSandbox(t, &cageEnv{m: m, in: in}, "sl", sh)
	checkApprovalUnderSandbox(t, &cageEnv{m: m, in: in}, "ap", sh, waitFor)

	cfgFile := "/etc/nixcage/agents/sl/egress.json"
	sh("cp " + cfgFile + " /run/egress.json.good && echo '{broken' > " + cfgFile)
	sh("systemctl restart cage-egress@sl.service || true")
	// systemd 252 records the start limit on the socket (Result
	// service-start-limit-hit); the service keeps Result exit-code.
	waitFor("the gateway's start limit", `[ "$(systemctl show -P Result cage-egress@sl.socket)" = service-start-limit-hit ]`)
	waitFor("caged status names the start limit", "cagectl status | grep '^sl ' | grep -q 'failed: start limit hit'")
	waitFor("the event names it", "grep EgressFailed /run/operator.events | grep -q 'gateway failed: start limit hit'")
	ev := sh("grep EgressFailed /run/operator.events")
	if !strings.Contains(ev, "cagectl restart sl") {
		t.Errorf("the event does not say how to recover: %s", ev)
	}
	t.Logf("status with the gateway down:\n%s\nevent: %s", sh("cagectl status"), ev)

	// Recovery as documented.
	sh("cp /run/egress.json.good " + cfgFile + " && cagectl restart sl")
	waitFor("the gateway's sockets again", "systemctl is-active -q cage-egress@sl.socket")
	waitFor("caged status recovers", "! cagectl status | grep '^sl ' | grep -q 'failed'")
	sh("kill $(cat /run/events.pid) || true")

	checkControlCommands(ctx, t, &cageEnv{m: m, in: in}, "sl", bins["cagectl"], sh)
}

// checkGrantUnderSandbox (issue 19): a time-bound grant reaches the
// rendered gateway (DynamicUser, PrivateUsers=yes, ProtectSystem=) through
// the root-owned grants file in /run/nixcage/cage/AGENT, and a revoke takes
// it away, as requests from the cage's network namespace see it.
// other.example.net is in the fake internet but not in the agent's policy.
func checkGrantUnderSandbox(t *testing.T, e *cageEnv, agent string, sh func(string) string) {
	t.Helper()
	const check = "http,https://other.example.net/granted"
	audit := "/var/log/nixcage-egress/" + agent + "/audit.jsonl"
	try := func() probe.Result { return e.probeInCageNetns(t, agent, check)[check] }
	upstreamSaw := func() int {
		reqs, err := e.in.Requests()
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		for _, r := range reqs {
			if r.Host == "other.example.net" && r.Path == "/granted" {
				n++
			}
		}
		return n
	}
	if r := try(); r.OK && r.Status == 200 {
		t.Fatalf("other.example.net reachable before any grant: %+v", r)
	}
	if n := upstreamSaw(); n != 0 {
		t.Fatalf("other.example.net received %d requests before any grant", n)
	}
	out := sh("cagectl allow " + agent + " other.example.net --for 1m --reason systest")
	id, _, ok := strings.Cut(strings.TrimPrefix(strings.TrimSpace(out), "grant "), ":")
	if !ok || !strings.HasPrefix(id, "g-") {
		t.Fatalf("cagectl allow printed no grant id: %q", out)
	}
	granted := time.Now()
	var r probe.Result
	for deadline := time.Now().Add(15 * time.Second); ; {
		if r = try(); r.OK && r.Status == 200 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("grant %s never let the cage reach other.example.net: %+v\ngateway journal:\n%s", id, r,
				sh("journalctl --no-pager -n 30 -u cage-egress@"+agent+".service; ls -la /run/nixcage/cage/"+agent))
		}
		time.Sleep(200 * time.Millisecond)
	}
	t.Logf("grant %s: the cage reached other.example.net %s after cagectl allow", id, time.Since(granted).Round(time.Millisecond))
	if n := upstreamSaw(); n == 0 {
		t.Fatal("the cage got 200 but other.example.net logged no request")
	}
	sh(fmt.Sprintf("grep -F '\"grant:%s\"' %s | grep -q other.example.net", id, audit))
	if ls := sh("cagectl grants list"); !strings.Contains(ls, id) {
		t.Errorf("grants list does not show %s:\n%s", id, ls)
	}

	sh("cagectl grants revoke " + id)
	revoked := time.Now()
	for deadline := time.Now().Add(15 * time.Second); ; {
		if r = try(); !r.OK || r.Status != 200 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("other.example.net still reachable after revoking %s: %+v", id, r)
		}
		time.Sleep(200 * time.Millisecond)
	}
	t.Logf("revoked %s: refused again %s later (%+v)", id, time.Since(revoked).Round(time.Millisecond), r)
	before := upstreamSaw()
	if r = try(); r.OK && r.Status == 200 {
		t.Fatalf("other.example.net reachable again after revoke: %+v", r)
	}
	if n := upstreamSaw(); n != before {
		t.Errorf("other.example.net received a request after the revoke (%d -> %d)", before, n)
	}
	sh("tail -n 5 " + audit + " | grep other.example.net | tail -n 1 | grep -q default-deny")
}

// checkApprovalUnderSandbox (issue 19): the approval queue under the
// rendered gateway (DynamicUser, PrivateUsers=yes, ProtectSystem=): a
// request from the cage's network namespace to a host outside the policy
// waits; the pending request the gateway wrote in its RuntimeDirectory
// reaches `cagectl approvals` (caged, root) and the operator's event
// stream; `cagectl approve ID once` lets it through (the upstream sees it,
// the audit names the approver), `cagectl approve ID deny` refuses the next
// one with a readable 403.
func checkApprovalUnderSandbox(t *testing.T, e *cageEnv, agent string, sh func(string) string, waitFor func(what, script string)) {
	t.Helper()
	sh("cagectl start " + agent)
	waitFor("the approval agent's sockets", "systemctl is-active -q cage-egress@"+agent+".socket")
	audit := "/var/log/nixcage-egress/" + agent + "/audit.jsonl"
	// A probe as a fresh dynamic user in the cage's namespace, in the
	// background: its request waits for the operator.
	probeBG := func(check, out string) {
		sh("nohup systemd-run --quiet --wait --pipe -p DynamicUser=yes -p NetworkNamespacePath=/run/netns/nixcage-" + agent +
			" -p Environment=HTTPS_PROXY=http://127.0.0.1:3128 -p Environment=HTTP_PROXY=http://127.0.0.1:3128" +
			" -p Environment=SSL_CERT_FILE=/var/lib/nixcage/egress/" + agent + "/bundle.crt /usr/local/bin/cage-probe " + check +
			" >" + out + " 2>&1 </dev/null &")
	}
	result := func(check, out string) probe.Result {
		t.Helper()
		waitFor("the probe's result", "grep -q '\"check\"' "+out)
		got, err := probe.ParseByCheck(sh("cat " + out))
		if err != nil {
			t.Fatal(err)
		}
		return got[check]
	}
	pendingID := func(path string) string {
		t.Helper()
		waitFor("a pending approval for "+path, "cagectl approvals "+agent+" | grep -F other.example.net | grep -qF "+path)
		for _, line := range strings.Split(sh("cagectl approvals "+agent), "\n") {
			if strings.Contains(line, path) {
				return strings.Fields(line)[0]
			}
		}
		t.Fatalf("no approval id for %s", path)
		return ""
	}

	const once = "http,http://other.example.net/approved"
	probeBG(once, "/run/ap-once.out")
	id := pendingID("/approved")
	waitFor("the ApprovalPending signal", "grep ApprovalPending /run/operator.events | grep -q "+id)
	asked := time.Now()
	if out := sh("cagectl approve " + id + " once"); !strings.Contains(out, "approved "+id+" once") {
		t.Fatalf("cagectl approve: %q", out)
	}
	if r := result(once, "/run/ap-once.out"); !r.OK || r.Status != 200 {
		t.Fatalf("approved request: %+v\ngateway journal:\n%s", r, sh("journalctl --no-pager -n 30 -u cage-egress@"+agent+".service; ls -la /run/nixcage-egress/"+agent+" /run/nixcage/cage/"+agent+"/approvals || true"))
	}
	t.Logf("approval %s: the waiting request went through %s after cagectl approve", id, time.Since(asked).Round(time.Millisecond))
	reqs, err := e.in.Requests()
	if err != nil {
		t.Fatal(err)
	}
	seen := false
	for _, r := range reqs {
		seen = seen || (r.Host == "other.example.net" && r.Path == "/approved")
	}
	if !seen {
		t.Fatal("the cage got 200 but other.example.net logged no /approved request")
	}
	sh(fmt.Sprintf("grep -F '\"approval:%s\"' %s | grep -F 'approved once by root' | grep -q /approved", id, audit))
	sh("journalctl --no-pager -o cat MESSAGE_ID=8d00a7ad6c0d4f1b9afbfdc6634df75f | grep -q " + id)

	const denied = "http,http://other.example.net/denied"
	probeBG(denied, "/run/ap-deny.out")
	id = pendingID("/denied")
	sh("cagectl approve " + id + " deny")
	r := result(denied, "/run/ap-deny.out")
	if r.Status != 403 || !strings.Contains(r.Body, "denied by root") {
		t.Fatalf("denied request: %+v", r)
	}
	sh(fmt.Sprintf("grep -F '\"approval-denied\"' %s | grep -q /denied", audit))
	if out := sh("cagectl approvals " + agent); !strings.Contains(out, "no requests waiting") {
		t.Errorf("approvals after the decisions:\n%s", out)
	}
	sh("cagectl stop " + agent)
}
