package system

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nixcage/nixcage/internal/events"
	"github.com/nixcage/nixcage/internal/systest"
	"github.com/nixcage/nixcage/internal/testenv"
)

// cagedConfig: one service agent running the current tool generation's
// hello, a store trusting one release key, and a viewer account for nobody.
const cagedConfig = `
egress_policy "p" {
  allow   = ["api.example.com"]
  inspect = ["api.example.com"]
}
agent "alpha" {
  backend   = "service"
  command   = ["/bin/sh", "-c", "echo evidence > /workspace/work.txt; if [ -x /nix/tools/bin/hello ]; then /nix/tools/bin/hello; else echo no-tools; fi; ${agentAttack}; exec sleep 600"]
  egress    = "p"
  autostart = false
}
account "viewers" {
  user = "nobody"
  role = "viewer"
}
store {
  channel = "stable"
  keys    = ["/etc/nixcage/release.pub"]
}
`

// agentAttack is what the agent does to its workspace to defeat the
// evidence (issue 22): a 5 GiB sparse file, a name that rewrites the
// operator's terminal line when sha256sum -c prints it, and a directory
// chain deeper than PATH_MAX (mkdir -p: a restart of the agent goes on
// where a stop interrupted it). It runs in the cage, as the agent.
const agentAttack = `truncate -s 5G /workspace/big; ` +
	`printf trap > \"/workspace/$(printf 'esc\\033[2K\\rall fine')\"; ` +
	`cd /workspace && i=0 && while [ $i -lt 2100 ]; do mkdir -p d && cd d || break; i=$((i+1)); done; ` +
	`touch /workspace/attack-done`

// makeRelease builds a real Nix store path holding bin/hello that prints
// word (and links out of it), and a release of it signed with key at
// generation gen.
func makeRelease(t *testing.T, cagectl, key string, gen int, word string) string {
	t.Helper()
	nixStore := testenv.LookPath(t, "nix-store")
	src := filepath.Join(t.TempDir(), "hello-"+word)
	os.MkdirAll(filepath.Join(src, "bin"), 0o755)
	if err := os.WriteFile(filepath.Join(src, "bin/hello"), []byte("#!/bin/sh\necho "+word+"\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	// A publisher's links out of the closure: to the root, to /etc, above
	// the store root. A cage resolves them in its own root
	// (storeSeesNoHost).
	for name, target := range map[string]string{"host-root": "/", "host-etc": "/etc", "up": "../../../../../../var/lib"} {
		if err := os.Symlink(target, filepath.Join(src, name)); err != nil {
			t.Fatal(err)
		}
	}
	out, err := exec.Command(nixStore, "--add", src).Output()
	if err != nil {
		t.Fatalf("nix-store --add: %v", err)
	}
	rel := filepath.Join(t.TempDir(), "release")
	cmd := exec.Command(cagectl, "release", "create", strings.TrimSpace(string(out)), "--key", key,
		"--channel", "stable", "--generation", itoa(gen), "--expires", "30d", "--compression", "none", "--out", rel)
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("release create: %v\n%s", err, b)
	}
	return rel
}

// cagedBinaries builds what a machine running caged needs; cagectl's host
// path is returned too (tests sign releases with it).
func cagedBinaries(t *testing.T) (string, systest.Binaries) {
	cagectl := systest.BuildT(t, "./cmd/cagectl")
	return cagectl, systest.Binaries{
		"cagectl":     cagectl,
		"caged":       systest.BuildT(t, "./cmd/caged"),
		"cage-egress": systest.BuildT(t, "./cmd/cage-egress"),
	}
}

// releaseKey makes a release key pair with cagectl and returns its path
// prefix (PREFIX.key, PREFIX.pub).
func releaseKey(t *testing.T, cagectl string) string {
	keys := filepath.Join(t.TempDir(), "rel")
	if b, err := exec.Command(cagectl, "key", "generate", "--out", keys).CombinedOutput(); err != nil {
		t.Fatalf("key generate: %v\n%s", err, b)
	}
	return keys
}

func itoa(n int) string { return strings.TrimSpace(strings.Repeat(" ", 0) + fmtInt(n)) }

func fmtInt(n int) string {
	b, _ := json.Marshal(n)
	return string(b)
}

// TestCagedOnSystemd drives caged over the machine's real system bus:
// status for everyone, control refused to a viewer, a signed release
// applied and seen by the agent after restart, an older one refused,
// quarantine with verifiable evidence that keeps the agent down across a
// caged restart until it is released.
func TestCagedOnSystemd(t *testing.T) {
	testenv.RequireSystem(t)
	cagectl, bins := cagedBinaries(t)
	keys := releaseKey(t, cagectl)
	rel2 := makeRelease(t, cagectl, keys+".key", 2, "hello-from-generation-2")
	rel1 := makeRelease(t, cagectl, keys+".key", 1, "hello-from-generation-1")

	// 5 minutes: eight cage starts look at the store (storeSeesNoHost), at
	// load averages up to 30 on two cores.
	m, _, ctx := nixcageMachine(t, 5*time.Minute, bins, strings.Replace(cagedConfig, "${agentAttack}", agentAttack, 1), nil, func(m *systest.Machine) {
		if err := m.CopyIn(keys+".pub", "/etc/nixcage/release.pub", 0o644); err != nil {
			t.Fatal(err)
		}
	})
	// caged sees neither /root nor /tmp (ProtectHome=, PrivateTmp=); cagectl
	// hands it the directory as a descriptor, so /root works (rel2).
	for _, r := range []struct{ src, dst string }{{rel2, "/srv/rel2"}, {rel2, "/root/rel2"}, {rel1, "/srv/rel1"}} {
		if b, err := exec.Command("cp", "-a", r.src, m.Path(r.dst)).CombinedOutput(); err != nil {
			t.Fatalf("copy release: %v\n%s", err, b)
		}
	}
	sh, _ := machineScripts(t, ctx, m)
	exitCode := func(script string) int {
		out, err := m.Shell(ctx, script)
		var re *systest.RunError
		if errors.As(err, &re) {
			t.Logf("%s -> exit %d: %s", script, re.ExitCode(), strings.TrimSpace(out))
			return re.ExitCode()
		}
		if err != nil {
			t.Fatalf("%s: %v", script, err)
		}
		return 0
	}
	waitActive := func(unit, want string) {
		t.Helper()
		for i := 0; ; i++ {
			st, _ := m.UnitState(ctx, unit)
			if st.Active == want {
				return
			}
			if i > 100 {
				t.Fatalf("%s is %s/%s, want %s", unit, st.Active, st.Sub, want)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}

	// The rendered policy file and unit, as an operator installs them.
	sh("systemctl reload dbus && systemctl start nixcage-caged.service")
	waitActive("nixcage-caged.service", "active")

	status := sh("cagectl status")
	if !strings.Contains(status, "alpha") {
		t.Fatalf("status does not list alpha:\n%s", status)
	}
	if got := exitCode("setpriv --reuid=65534 --regid=65534 --clear-groups cagectl status"); got != 0 {
		t.Fatalf("a viewer could not read status (exit %d)", got)
	}
	if got := exitCode("setpriv --reuid=65534 --regid=65534 --clear-groups cagectl start alpha"); got != 3 {
		t.Fatalf("a viewer starting an agent: exit %d, want 3 (denied)", got)
	}
	if got := exitCode("setpriv --reuid=65534 --regid=65534 --clear-groups cagectl apply /srv/rel2"); got != 3 {
		t.Fatalf("a viewer applying a release: exit %d, want 3 (denied)", got)
	}

	// A signed release through caged; the agent sees it after (re)start.
	if out := sh("cd /root && cagectl apply -v ./rel2"); !strings.Contains(out, "  unpack ") || !strings.Contains(out, "  switch ") {
		t.Fatalf("apply -v through caged does not time its phases:\n%s", out)
	}
	agent := systest.AgentUnit("alpha")
	sh("cagectl start alpha")
	waitActive(agent, "active")
	deadline := time.Now().Add(20 * time.Second)
	for {
		j, _ := m.Journal(ctx, agent)
		if strings.Contains(j, "hello-from-generation-2") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("agent did not run generation 2's tool:\n%s", j)
		}
		time.Sleep(200 * time.Millisecond)
	}
	storeSeesNoHost(t, ctx, m, sh, exitCode)
	if out, err := m.Shell(ctx, "cagectl apply /srv/rel1"); err == nil || !strings.Contains(err.Error(), "generation 1") {
		t.Fatalf("an older generation was not refused with its reason: %v\n%s", err, out)
	} else {
		t.Logf("rollback refused: %v", err)
	}
	if gens := sh("cagectl generations --store /var/lib/nixcage/store"); !strings.Contains(gens, "2") || strings.Contains(gens, "hello-from-generation-1") {
		t.Fatalf("generations after refused rollback:\n%s", gens)
	}
	if js := sh("cagectl status --json"); !strings.Contains(js, `"alpha"`) {
		t.Fatalf("status --json: %s", js)
	}

	// Who hears about it: a stranger's dbus-monitor on the system bus, and
	// the declared viewer's cagectl events.
	sh("setpriv --reuid=34 --regid=34 --clear-groups dbus-monitor --system >/run/stranger.mon 2>&1 & echo $! >/run/stranger.pid")
	sh("setpriv --reuid=65534 --regid=65534 --clear-groups cagectl events >/run/viewer.events 2>&1 & echo $! >/run/viewer.pid")
	defer m.Shell(context.Background(), "kill $(cat /run/stranger.pid) $(cat /run/viewer.pid)")
	// dbus-monitor prints its own NameAcquired once its match rules are in.
	// A deadline, not a count of tries: under CI load (load average 30 on
	// two cores) one m.Shell round trip alone can take seconds, and the
	// agent's attack below makes 2100 directories.
	waitFor := func(what, script string) {
		t.Helper()
		deadline := time.Now().Add(2 * time.Minute)
		for {
			if _, err := m.Shell(ctx, script); err == nil {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: never true within 2m: %s", what, script)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	waitFor("stranger's monitor listens", "grep -q NameAcquired /run/stranger.mon")
	// The viewer is subscribed once it prints a broadcast caged sends.
	waitFor("viewer's events stream", "cagectl reload >/dev/null; grep -q Reconciled /run/viewer.events")

	// Quarantine (issue 22, issue 14): the agent attacked its evidence; the
	// verb still exits 0 and says where the evidence is.
	waitFor("the agent's attack", "test -e /var/lib/nixcage/agents/alpha/attack-done")
	out := sh("cagectl quarantine alpha --reason system-test")
	if !strings.Contains(out, "alpha: quarantined, evidence in /var/lib/nixcage/evidence/alpha-") {
		t.Fatalf("quarantine output: %q", out)
	}
	waitActive(systest.AgentUnit("alpha"), "inactive")
	for _, u := range []string{"cage-egress@alpha.service", "cage-egress@alpha.socket", "cage-egress-dns@alpha.socket"} {
		if st, _ := m.UnitState(ctx, u); st.Active == "active" {
			t.Errorf("%s still active after quarantine", u)
		}
	}
	if j, _ := m.Journal(ctx, "nixcage-caged.service"); strings.Contains(j, "freeze unavailable") {
		t.Log("this machine cannot freeze (cgroup v1 controllers on the host): quarantine took the SIGKILL path")
	} else {
		t.Log("the agent was frozen before its egress was cut")
	}
	sums := sh("cd /var/lib/nixcage/evidence/alpha-* && sha256sum --strict -c SHA256SUMS")
	if !strings.Contains(sums, "work.txt: OK") {
		t.Fatalf("evidence manifest does not cover the workspace:\n%s", sums)
	}
	if strings.ContainsAny(sums, "\x1b\r") {
		t.Errorf("sha256sum -c printed the agent's control bytes to the operator: %q", sums)
	}
	du := sh("du -s --block-size=1 /var/lib/nixcage/evidence/alpha-* | cut -f1")
	if n, err := strconv.ParseInt(strings.TrimSpace(du), 10, 64); err != nil || n > 64<<20 {
		t.Errorf("evidence occupies %s bytes on disk (a 5 GiB sparse file must stay sparse)", du)
	}
	omitted := sh("cat /var/lib/nixcage/evidence/alpha-*/omitted.txt")
	for _, want := range []string{`"workspace/big": truncated: kept the first `, "name longer than 3072 bytes, not copied"} {
		if !strings.Contains(omitted, want) {
			t.Errorf("omitted.txt lacks %q:\n%.1500s", want, omitted)
		}
	}
	t.Logf("evidence: %s bytes on disk; omitted.txt (%d lines) names big: %v", strings.TrimSpace(du), strings.Count(omitted, "\n"), strings.Contains(omitted, `"workspace/big"`))

	// The viewer heard of the quarantine; the stranger heard only the
	// public broadcasts, up to the one that follows it.
	waitFor("viewer hears the quarantine", "grep -q AgentQuarantined /run/viewer.events")
	before := strings.Count(sh("cat /run/stranger.mon"), "member=Reconciled")
	sh("cagectl reload")
	waitFor("the broadcast after the quarantine", fmt.Sprintf("[ $(grep -c member=Reconciled /run/stranger.mon) -gt %d ]", before))
	// (The reason itself is public: status shows it to everyone.)
	if mon := sh("cat /run/stranger.mon"); strings.Contains(mon, "member=AgentQuarantined") || strings.Contains(mon, "/var/lib/nixcage/evidence/") {
		t.Errorf("an undeclared user's dbus-monitor saw the quarantine:\n%s", mon)
	}
	sh("systemctl restart nixcage-caged.service")
	waitActive("nixcage-caged.service", "active")
	sh("systemctl start " + systest.AgentUnit("alpha") + " || true")
	if st, _ := m.UnitState(ctx, systest.AgentUnit("alpha")); st.Active == "active" {
		t.Fatal("a quarantined agent started after caged restarted")
	}
	if got := exitCode("cagectl start alpha"); got == 0 {
		t.Fatal("caged started a quarantined agent")
	}
	sh("cagectl release alpha && cagectl start alpha")
	waitActive(systest.AgentUnit("alpha"), "active")

	// Every event above is in the journal under its kind's MESSAGE_ID with
	// its fields, from caged's unit (issue 18): what a journald-based
	// shipper selects on.
	journalEvents(t, ctx, m, []journalWant{
		{kind: events.ReleaseApplied, fields: map[string]string{"NIXCAGE_GENERATION": "2", "NIXCAGE_PREVIOUS_GENERATION": "0", "NIXCAGE_BY": "root (uid 0)"}},
		{kind: events.ReleaseRefused, fields: map[string]string{"NIXCAGE_OP": "apply", "NIXCAGE_BY": "root (uid 0)"}},
		{kind: events.AgentQuarantined, fields: map[string]string{"NIXCAGE_AGENT": "alpha", "NIXCAGE_REASON": "system-test", "NIXCAGE_BY": "root (uid 0)", "PRIORITY": "4"}},
		{kind: events.AgentReleased, fields: map[string]string{"NIXCAGE_AGENT": "alpha", "NIXCAGE_BY": "root (uid 0)"}},
		{kind: events.AgentStateChanged, fields: map[string]string{"NIXCAGE_AGENT": "alpha", "NIXCAGE_ACTIVE_STATE": "active", "NIXCAGE_SUB_STATE": "running"}},
		{kind: events.Reconciled, fields: map[string]string{"NIXCAGE_ERROR": "", "MESSAGE": "configuration reconciled"}},
	})
}

type journalWant struct {
	kind   events.Kind
	fields map[string]string
	unit   string // the unit that wrote it; "" is nixcage-caged.service
}

// journalEvents waits for an entry of each kind that carries the fields,
// written by caged's unit, found as a shipper would: by MESSAGE_ID.
func journalEvents(t *testing.T, ctx context.Context, m *systest.Machine, wants []journalWant) {
	t.Helper()
	for _, w := range wants {
		deadline := time.Now().Add(20 * time.Second)
		for {
			out, _ := m.Shell(ctx, "journalctl --no-pager -o json MESSAGE_ID="+w.kind.ID)
			found, n := false, 0
			for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
				var e map[string]any
				if json.Unmarshal([]byte(line), &e) != nil {
					continue
				}
				n++
				unit := w.unit
				if unit == "" {
					unit = "nixcage-caged.service"
				}
				ok := e["_SYSTEMD_UNIT"] == unit && e["NIXCAGE_EVENT"] == w.kind.Name && e["SYSLOG_IDENTIFIER"] == events.Identifier
				for k, v := range w.fields {
					ok = ok && e[k] == v
				}
				if ok {
					t.Logf("journal %s: %v", w.kind.Name, e["MESSAGE"])
					found = true
					break
				}
			}
			if found {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("no journal entry MESSAGE_ID=%s (%s) with %v from %s (%d entries of that id):\n%s", w.kind.ID, w.kind.Name, w.fields, w.unit, n, out)
			}
			time.Sleep(200 * time.Millisecond)
		}
	}
}
