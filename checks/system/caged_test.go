package system

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

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
  command   = ["/bin/sh", "-c", "echo evidence > /workspace/work.txt; if [ -x /nix/tools/bin/hello ]; then /nix/tools/bin/hello; else echo no-tools; fi; exec sleep 600"]
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

// makeRelease builds a real Nix store path holding bin/hello that prints
// word, and a release of it signed with key at generation gen.
func makeRelease(t *testing.T, cagectl, key string, gen int, word string) string {
	t.Helper()
	nixStore := testenv.LookPath(t, "nix-store")
	src := filepath.Join(t.TempDir(), "hello-"+word)
	os.MkdirAll(filepath.Join(src, "bin"), 0o755)
	if err := os.WriteFile(filepath.Join(src, "bin/hello"), []byte("#!/bin/sh\necho "+word+"\n"), 0o755); err != nil {
		t.Fatal(err)
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
	cagectl := systest.BuildT(t, "./cmd/cagectl")
	bins := systest.Binaries{
		"cagectl":     cagectl,
		"caged":       systest.BuildT(t, "./cmd/caged"),
		"cage-egress": systest.BuildT(t, "./cmd/cage-egress"),
	}
	keys := filepath.Join(t.TempDir(), "rel")
	if b, err := exec.Command(cagectl, "key", "generate", "--out", keys).CombinedOutput(); err != nil {
		t.Fatalf("key generate: %v\n%s", err, b)
	}
	rel2 := makeRelease(t, cagectl, keys+".key", 2, "hello-from-generation-2")
	rel1 := makeRelease(t, cagectl, keys+".key", 1, "hello-from-generation-1")

	m := systest.BootT(t)
	systest.StartInternetT(t, m)
	cfg := filepath.Join(t.TempDir(), "caged.hcl")
	os.WriteFile(cfg, []byte(cagedConfig), 0o644)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	if err := m.CopyIn(keys+".pub", "/etc/nixcage/release.pub", 0o644); err != nil {
		t.Fatal(err)
	}
	if err := systest.InstallNixcage(ctx, m, bins, cfg, nil); err != nil {
		t.Fatal(err)
	}
	// caged sees neither /root nor /tmp (ProtectHome=, PrivateTmp=): releases
	// are handed to it from a system path.
	for _, r := range []struct{ src, dst string }{{rel2, "/srv/rel2"}, {rel1, "/srv/rel1"}} {
		if b, err := exec.Command("cp", "-a", r.src, m.Path(r.dst)).CombinedOutput(); err != nil {
			t.Fatalf("copy release: %v\n%s", err, b)
		}
	}
	sh := func(script string) string {
		t.Helper()
		out, err := m.Shell(ctx, script)
		if err != nil {
			t.Fatalf("%s: %v\n%s", script, err, out)
		}
		return out
	}
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
	sh("cagectl apply /srv/rel2")
	sh("cagectl start alpha")
	waitActive(systest.AgentUnit("alpha"), "active")
	deadline := time.Now().Add(20 * time.Second)
	for {
		j, _ := m.Journal(ctx, systest.AgentUnit("alpha"))
		if strings.Contains(j, "hello-from-generation-2") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("agent did not run generation 2's tool:\n%s", j)
		}
		time.Sleep(200 * time.Millisecond)
	}
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

	// The store changed behind apply's back: current/top now links to the
	// host's root. systemd's bind would follow that link on the host; the
	// unit's store check must refuse the start instead.
	agent := systest.AgentUnit("alpha")
	sh("cagectl stop alpha")
	waitActive(agent, "inactive")
	sh("cd /var/lib/nixcage/store/generations/2 && mv top top.saved && ln -s / top")
	if got := exitCode("cagectl store verify --store /var/lib/nixcage/store"); got == 0 {
		t.Fatal("store verify passed a store whose top links to /")
	}
	exitCode("cagectl start alpha")
	time.Sleep(time.Second)
	if st, _ := m.UnitState(ctx, agent); st.Active == "active" {
		t.Fatal("the agent started on a store whose top links to the host's root")
	}
	if j, _ := m.Journal(ctx, "nixcage-binds@alpha.service"); !strings.Contains(j, "does not resolve inside the store") {
		t.Fatalf("the refused start does not say why:\n%s", j)
	}
	sh("systemctl reset-failed nixcage-binds@alpha.service || true; cd /var/lib/nixcage/store/generations/2 && rm top && mv top.saved top")
	sh("cagectl start alpha")
	waitActive(agent, "active")

	// Quarantine: agent down, evidence that verifies, down across restarts.
	sh("cagectl quarantine alpha --reason system-test")
	waitActive(systest.AgentUnit("alpha"), "inactive")
	sums := sh("cd /var/lib/nixcage/evidence/alpha-* && sha256sum -c SHA256SUMS")
	if !strings.Contains(sums, "work.txt: OK") {
		t.Fatalf("evidence manifest does not cover the workspace:\n%s", sums)
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
}
