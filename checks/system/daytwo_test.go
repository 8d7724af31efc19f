package system

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nixcage/nixcage/internal/systest"
	"github.com/nixcage/nixcage/internal/testenv"
)

// Day-two keys: B has A's length (the placeholder the cage holds still
// fits), C is longer (a new placeholder is needed).
const (
	dayTwoKeyA = "sk-daytwo-AAAA-0123456789abcdef"
	dayTwoKeyB = "sk-daytwo-BBBB-0123456789abcdef"
	dayTwoKeyC = "sk-daytwo-CCCC-0123456789abcdef-longer"
	dayTwoKeyD = "sk-daytwo-DDDD-0123456789abcdef-longer"
)

// dayTwoConfig declares agents by name: "probe" makes one request with the
// API key and exits; every other agent sleeps (autostart).
func dayTwoConfig(sleepers ...string) string {
	var b strings.Builder
	b.WriteString(`egress_policy "p" {
  allow   = ["api.example.com"]
  inspect = ["api.example.com"]
}
account "viewers" {
  user = "nobody"
  role = "viewer"
}
agent "probe" {
  backend   = "service"
  egress    = "p"
  autostart = false
  command   = ["/usr/local/bin/cage-probe", "http,https://api.example.com/v1/echo,Authorization,Bearer @env:API_KEY@"]
  secret "api" {
    source = "/etc/nixcage/secrets/api"
    env    = "API_KEY"
    hosts  = ["api.example.com"]
  }
}
`)
	// holder keeps running and asks api.example.com/v1/holder twice a
	// second with its placeholder: what the gateway injects is what the
	// upstream logs.
	b.WriteString(`agent "holder" {
  backend = "service"
  egress  = "p"
  command = ["/bin/sh", "-c", "while :; do /usr/local/bin/cage-probe 'http,https://api.example.com/v1/holder,Authorization,Bearer @env:API_KEY@' >/dev/null; sleep 0.5; done"]
  secret "api" {
    source = "/etc/nixcage/secrets/api"
    env    = "API_KEY"
    hosts  = ["api.example.com"]
  }
}
`)
	for _, s := range sleepers {
		fmt.Fprintf(&b, `agent %q {
  backend = "service"
  egress  = "p"
  command = ["/bin/sh", "-c", "exec sleep 600"]
}
`, s)
	}
	return b.String()
}

// dayTwo is a booted machine with nixcage installed as the README says and
// caged running, plus helpers that fail the test.
type dayTwo struct {
	t   *testing.T
	ctx context.Context
	m   *systest.Machine
	in  *systest.Internet
}

func bootDayTwo(t *testing.T, cfg string, secrets map[string]string) *dayTwo {
	t.Helper()
	testenv.RequireSystem(t)
	_, bins := cagedBinaries(t)
	bins["cage-probe"] = systest.BuildT(t, probePkg)
	m, in, ctx := nixcageMachine(t, 5*time.Minute, bins, cfg, secrets, nil)
	d := &dayTwo{t: t, ctx: ctx, m: m, in: in}
	d.sh("systemctl reload dbus && systemctl start nixcage-caged.service")
	return d
}

func (d *dayTwo) sh(script string) string {
	d.t.Helper()
	out, err := d.m.Shell(d.ctx, script)
	if err != nil {
		d.t.Fatalf("%s: %v\n%s", script, err, out)
	}
	return out
}

// code runs script and returns its exit status and output.
func (d *dayTwo) code(script string) (int, string) {
	d.t.Helper()
	out, err := d.m.Shell(d.ctx, script)
	var re *systest.RunError
	if errors.As(err, &re) {
		return re.ExitCode(), out
	}
	if err != nil {
		d.t.Fatalf("%s: %v", script, err)
	}
	return 0, out
}

func (d *dayTwo) prop(unit, p string) string {
	d.t.Helper()
	return strings.TrimSpace(d.sh("systemctl show -P " + p + " " + unit))
}

func (d *dayTwo) waitState(unit string, want ...string) {
	d.t.Helper()
	for i := 0; ; i++ {
		st, _ := d.m.UnitState(d.ctx, unit)
		for _, w := range want {
			if st.Active == w {
				return
			}
		}
		if i > 200 {
			d.t.Fatalf("%s is %s/%s (result %s), want %v\n%s", unit, st.Active, st.Sub, st.Result, want, d.sh("journalctl -b --no-pager -n 40"))
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// runProbe runs the probe agent once (start, wait until it exits) and
// returns the Authorization the upstream received on its newest request.
func (d *dayTwo) runProbe(verb string) string {
	d.t.Helper()
	before, _ := d.in.Requests()
	d.sh("cagectl " + verb + " probe")
	if _, err := d.m.WaitInactive(d.ctx, systest.AgentUnit("probe")); err != nil {
		d.t.Fatal(err)
	}
	reqs, err := d.in.Requests()
	if err != nil {
		d.t.Fatal(err)
	}
	for i := len(reqs) - 1; i >= len(before); i-- {
		r := reqs[i]
		if r.Kind == "https" && r.Host == "api.example.com" && r.Path == "/v1/echo" {
			return strings.Join(r.Headers["Authorization"], ",")
		}
	}
	d.t.Fatalf("probe (%s) made no request upstream\n%s", verb, d.sh("journalctl -b --no-pager -n 60 -u nixcage-agent@probe -u cage-egress@probe -u nixcage-prep@probe"))
	return ""
}

// waitHolderKey waits until the upstream logs holder's request with key.
func (d *dayTwo) waitHolderKey(key string) {
	d.t.Helper()
	for i := 0; ; i++ {
		reqs, err := d.in.Requests()
		if err != nil {
			d.t.Fatal(err)
		}
		for j := len(reqs) - 1; j >= 0 && j >= len(reqs)-20; j-- {
			if reqs[j].Path == "/v1/holder" && strings.Join(reqs[j].Headers["Authorization"], ",") == "Bearer "+key {
				return
			}
		}
		if i > 150 {
			d.t.Fatalf("the upstream never saw holder's request with %s\n%s", key, d.sh("journalctl -b --no-pager -n 40 -u cage-egress@holder -u nixcage-agent@holder"))
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// TestApplyConfigAndRotateSecret is a day-two change on the booted
// systemd, through caged over the real system bus: one agent removed and one
// added with `cagectl apply-config` (plan first, then installed), the removed
// agent's units pruned and stopped, the new one in status without a
// reload, the unchanged one not restarted (same InvocationID); then a
// secret edited on disk reaches the upstream after `cagectl restart`, and
// after `cagectl secret rotate` with a value that needs a new placeholder.
func TestApplyConfigAndRotateSecret(t *testing.T) {
	d := bootDayTwo(t, dayTwoConfig("keep", "gone"), map[string]string{"/etc/nixcage/secrets/api": dayTwoKeyA})
	for _, a := range []string{"keep", "gone"} {
		d.waitState(systest.AgentUnit(a), "active")
	}
	// Every binary carries the stamped version; caged's status shows its own.
	for _, c := range []string{"cagectl --version", "caged --version", "cage-egress --version"} {
		if out := d.sh(c); !strings.Contains(out, systest.Version) {
			t.Errorf("%s: %q, want %s", c, out, systest.Version)
		}
	}
	if st := d.sh("cagectl status"); !strings.Contains(st, "caged "+systest.Version) {
		t.Errorf("status does not show caged's version:\n%s", st)
	}
	keepID := d.prop(systest.AgentUnit("keep"), "InvocationID")
	d.sh("systemctl start " + systest.ProxySocket("gone")) // a gateway socket that must go too

	// The new config lives under /root: caged (ProtectHome=) cannot see it,
	// and does not need to.
	d.m.MustWriteFile(t, "/root/cage-v2.hcl", []byte(dayTwoConfig("keep", "fresh")), 0o644)
	plan := d.sh("cagectl apply-config /root/cage-v2.hcl --dry-run")
	t.Logf("dry run:\n%s", plan)
	row := func(label, v string) string { return fmt.Sprintf("%-20s %s\n", label+":", v) }
	for _, want := range []string{row("agents added", "fresh"), row("agents changed", "-"), row("agents removed", "gone"), row("units to restart", "-"), "units to stop:", systest.AgentUnit("gone"), "dry run: nothing was changed"} {
		if !strings.Contains(plan, want) {
			t.Errorf("dry-run plan lacks %q", want)
		}
	}
	if st, _ := d.m.UnitState(d.ctx, systest.AgentUnit("gone")); st.Active != "active" {
		t.Fatalf("--dry-run stopped gone: %+v", st)
	}

	// Then operations.md's day-two block, verbatim, on that file.
	d.sh("cp /root/cage-v2.hcl /root/cage.hcl")
	out := d.sh("cd /root && " + docBlock(t, "docs/operations.md", "day-two"))
	t.Logf("apply-config (docs block):\n%s", out)
	if !strings.Contains(out, "configuration applied") || !strings.Contains(out, "fresh") {
		t.Errorf("the documented day-two block did not apply the config:\n%s", out)
	}
	for _, u := range []string{systest.AgentUnit("gone"), systest.EgressUnit("gone"), systest.ProxySocket("gone"), systest.DNSSocket("gone"), "nixcage-netns@gone.service"} {
		if st, _ := d.m.UnitState(d.ctx, u); st.Active == "active" || st.Active == "activating" {
			t.Errorf("%s of the removed agent is still %s", u, st.Active)
		}
	}
	for _, f := range []string{"/etc/systemd/system/" + systest.AgentUnit("gone"), "/etc/systemd/system/nixcage.target.wants/" + systest.AgentUnit("gone"), "/etc/nixcage/agents/gone"} {
		if code, _ := d.code("test -e " + f + " || test -L " + f); code == 0 {
			t.Errorf("%s of the removed agent is still installed", f)
		}
	}
	if lf := d.prop(systest.AgentUnit("gone"), "LoadState"); lf == "loaded" {
		t.Errorf("systemd still has the removed agent's unit loaded")
	}
	status := d.sh("cagectl status")
	if !strings.Contains(status, "fresh") || strings.Contains(status, "gone") {
		t.Errorf("status after apply-config (no reload):\n%s", status)
	}
	d.waitState(systest.AgentUnit("fresh"), "active")
	if id := d.prop(systest.AgentUnit("keep"), "InvocationID"); id != keepID {
		t.Errorf("unchanged agent keep was restarted (InvocationID %s -> %s)", keepID, id)
	}
	again := d.sh("cagectl apply-config /root/cage-v2.hcl --dry-run")
	for _, label := range []string{"agents added", "agents changed", "agents removed", "files to write", "files to remove", "units to stop", "units to restart", "units to start"} {
		if !strings.Contains(again, row(label, "-")) {
			t.Errorf("the same config again plans %s:\n%s", label, again)
		}
	}
	if code, out := d.code("setpriv --reuid=65534 --regid=65534 --clear-groups cagectl apply-config /etc/nixcage/nixcage.json 2>&1"); code != 3 {
		t.Errorf("apply-config by an unprivileged user: exit %d, want 3 (denied)\n%s", code, out)
	}

	// Secret rotation: the gateway must send what the file says now.
	if got := d.runProbe("start"); got != "Bearer "+dayTwoKeyA {
		t.Fatalf("first run: upstream got %q, want key A", got)
	}
	d.m.MustWriteFile(t, "/etc/nixcage/secrets/api", []byte(dayTwoKeyB+"\n"), 0o600)
	if got := d.runProbe("restart"); got != "Bearer "+dayTwoKeyB {
		t.Errorf("after editing the secret and `cagectl restart`: upstream got %q, want the new key B", got)
	}
	d.m.MustWriteFile(t, "/etc/nixcage/secrets/api", []byte(dayTwoKeyC+"\n"), 0o600)
	msg := d.sh("cagectl secret rotate probe api")
	t.Logf("rotate: %s", msg)
	if got := d.runProbe("start"); got != "Bearer "+dayTwoKeyC {
		t.Errorf("after `cagectl secret rotate` with a longer key: upstream got %q, want key C", got)
	}
	// A running agent: a value of another length needs a new placeholder,
	// so the cage restarts; one of the same length only restarts the
	// gateway, and the agent keeps running (same InvocationID).
	holder := systest.AgentUnit("holder")
	if msg := d.sh("cagectl secret rotate holder api"); !strings.Contains(msg, "new placeholder") {
		t.Errorf("rotate holder to a longer key: %s", msg)
	}
	d.waitHolderKey(dayTwoKeyC)
	holderID := d.prop(holder, "InvocationID")
	gatewayID := d.prop(systest.EgressUnit("holder"), "InvocationID")
	d.m.MustWriteFile(t, "/etc/nixcage/secrets/api", []byte(dayTwoKeyD+"\n"), 0o600)
	if msg := d.sh("cagectl secret rotate holder"); !strings.Contains(msg, "keeps its placeholder") {
		t.Errorf("rotate holder to a key of the same length: %s", msg)
	}
	d.waitHolderKey(dayTwoKeyD)
	if id := d.prop(holder, "InvocationID"); id != holderID {
		t.Errorf("a same-length rotation restarted the agent (InvocationID %s -> %s)", holderID, id)
	}
	if id := d.prop(systest.EgressUnit("holder"), "InvocationID"); id == gatewayID {
		t.Errorf("the gateway was not restarted by the rotation")
	}
	if code, out := d.code("cagectl secret rotate probe nosuch 2>&1"); code != 1 || !strings.Contains(out, "no secret") {
		t.Errorf("rotate of an undeclared secret: exit %d: %s", code, out)
	}

	// A viewer (nobody, who cannot read the journal) reads the agent's logs
	// through caged.
	if out := d.sh("setpriv --reuid=65534 --regid=65534 --clear-groups cagectl logs probe -n 50 2>&1"); !strings.Contains(out, "prepared agent probe") || strings.Contains(out, "own rights") {
		t.Errorf("cagectl logs as a viewer:\n%s", out)
	}

	// Host checks on this booted systemd: all pass as installed (warnings,
	// such as the missing cgroup controllers here, do not fail).
	if code, out := d.code("cagectl doctor 2>&1"); code != 0 || strings.Contains(out, "FAIL") {
		t.Errorf("cagectl doctor on a good install: exit %d\n%s", code, out)
	} else {
		t.Logf("doctor:\n%s", out)
	}
	// A missing secret source is named by validate --host-checks, by start
	// (instead of systemd's "job dependency"), and by doctor, with the fix.
	d.sh("rm /etc/nixcage/secrets/api && systemctl stop nixcage-prep@probe.service")
	missing := "/etc/nixcage/secrets/api does not exist"
	if code, out := d.code("cagectl validate --host-checks /etc/nixcage/nixcage.json 2>&1"); code != 1 || !strings.Contains(out, missing) || !strings.Contains(out, "fix: create /etc/nixcage/secrets/api") {
		t.Errorf("validate --host-checks with a missing secret: exit %d\n%s", code, out)
	}
	if code, out := d.code("cagectl start probe 2>&1"); code != 1 || !strings.Contains(out, missing) {
		t.Errorf("start with a missing secret: exit %d\n%s", code, out)
	}
	if code, out := d.code("cagectl doctor 2>&1"); code != 1 || !strings.Contains(out, missing) {
		t.Errorf("doctor with a missing secret: exit %d\n%s", code, out)
	}
}
