package quarantine_test

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nixcage/nixcage/internal/config"
	"github.com/nixcage/nixcage/internal/paths"
	"github.com/nixcage/nixcage/internal/quarantine"
	"github.com/nixcage/nixcage/internal/reconcile"
	"github.com/nixcage/nixcage/internal/reconcile/fakesd"
	"github.com/nixcage/nixcage/internal/render"
	"github.com/nixcage/nixcage/internal/testenv"
)

const cfgSrc = `
agent "mallory" {
  backend = "service"
  command = ["/bin/sleep", "infinity"]
}
`

type fixture struct {
	root  string
	sd    *fakesd.Systemd
	units reconcile.Units
	dirs  quarantine.Dirs
	agent *config.Agent
}

func setup(t *testing.T, noFreeze bool) *fixture {
	t.Helper()
	root := t.TempDir()
	sd, conn, _ := fakesd.Start(t, root)
	sd.NoFreeze = noFreeze
	cfg, diags := config.NewLoader().Load(config.Source{Name: "t.hcl", Data: []byte(cfgSrc)})
	if diags.HasErrors() {
		t.Fatal(diags.Error())
	}
	o := render.DefaultOptions()
	o.Prefix = "/run"
	r := &reconcile.Reconciler{Units: reconcile.Units{SD: conn}, Mode: reconcile.ModeRender, Root: root, Options: o}
	if _, err := r.Apply(context.Background(), cfg); err != nil {
		t.Fatal(err)
	}
	f := &fixture{root: root, sd: sd, units: reconcile.Units{SD: conn}, dirs: quarantine.Dirs{Root: root}, agent: cfg.Agent("mallory")}
	// What the agent left behind, including things meant to trick a root
	// process copying it.
	ws := filepath.Join(root, f.agent.Workspace)
	must(t, os.MkdirAll(filepath.Join(ws, "src/deep"), 0o755))
	must(t, os.WriteFile(filepath.Join(ws, "notes.txt"), []byte("exfil plan\n"), 0o644))
	must(t, os.WriteFile(filepath.Join(ws, "src/deep/main.py"), []byte("print('hi')\n"), 0o600))
	must(t, os.WriteFile(filepath.Join(ws, "odd\nname\\x"), []byte("odd"), 0o644))
	must(t, os.Symlink("/etc/shadow", filepath.Join(ws, "shadow-link")))
	must(t, os.Symlink("../../../../../etc", filepath.Join(ws, "src/escape")))
	audit := f.dirs.AuditFile("mallory")
	must(t, os.MkdirAll(filepath.Dir(audit), 0o755))
	must(t, os.WriteFile(audit, []byte(`{"schema":1,"agent":"mallory","host":"evil.example","decision":"blocked"}`+"\n"), 0o644))
	sd.Reset()
	return f
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func (f *fixture) quarantine(t *testing.T) *quarantine.Result {
	t.Helper()
	res, err := quarantine.Run(context.Background(), f.units, f.dirs, quarantine.Request{
		Agent: "mallory", Reason: "blocked exfiltration", By: "root (uid 0)",
		Workspace: f.agent.Workspace, Status: map[string]string{"active": "active"},
		Now: func() time.Time { return time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC) },
	})
	if err != nil {
		t.Fatalf("quarantine: %v", err)
	}
	return res
}

func TestQuarantineEvidenceVerifies(t *testing.T) {
	f := setup(t, false)
	res := f.quarantine(t)
	agentUnit := paths.Instance(paths.AgentTemplate, "mallory")
	cut := []string{
		"StopUnit " + paths.Instance(paths.EgressTemplate, "mallory"),
		"StopUnit " + paths.Instance(paths.ProxySocketTpl, "mallory"),
		"StopUnit " + paths.Instance(paths.DNSSocketTpl, "mallory"),
	}
	// Freeze, cut, stop; no thaw: cutting the sockets stopped the agent
	// (Requires=), and systemd refuses to thaw an inactive unit. The cut
	// is repeated after the copy.
	want := slices.Concat([]string{"FreezeUnit " + agentUnit}, cut, []string{"StopUnit " + agentUnit}, cut)
	if got := f.sd.Calls(); !slices.Equal(got, want) {
		t.Errorf("systemd calls:\n got %q\nwant %q", got, want)
	}
	if !res.Frozen {
		t.Error("not frozen although the freezer works")
	}
	dir := res.Evidence.Dir
	if filepath.Base(dir) != "mallory-20261130T120000Z" {
		t.Errorf("evidence dir %s", dir)
	}
	// The real tool must accept the manifest.
	sha := testenv.LookPath(t, "sha256sum")
	cmd := exec.Command(sha, "--strict", "-c", quarantine.ManifestName)
	cmd.Dir = dir
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("sha256sum -c: %v\n%s", err, out)
	} else if n := strings.Count(string(out), ": OK"); n != res.Evidence.Files {
		t.Errorf("sha256sum checked %d files, manifest has %d:\n%s", n, res.Evidence.Files, out)
	}
	if err := quarantine.Verify(dir); err != nil {
		t.Errorf("Verify: %v", err)
	}
	man, _ := os.ReadFile(filepath.Join(dir, quarantine.ManifestName))
	for _, name := range []string{"workspace/notes.txt", "workspace/src/deep/main.py", "audit.jsonl", "status.json", "quarantine.json", "symlinks.txt", "omitted.txt", "names.txt", "evidence.json", `workspace/odd%0Aname\\x`} {
		if !strings.Contains(string(man), "  "+name+"\n") {
			t.Errorf("manifest lacks %s:\n%s", name, man)
		}
	}
	// Symlinks are kept as links, never followed.
	if target, err := os.Readlink(filepath.Join(dir, "workspace/shadow-link")); err != nil || target != "/etc/shadow" {
		t.Errorf("shadow-link: %q %v", target, err)
	}
	if strings.Contains(string(man), "shadow-link") || strings.Contains(string(man), "escape/") {
		t.Errorf("manifest follows symlinks:\n%s", man)
	}
	audit, _ := os.ReadFile(filepath.Join(dir, "audit.jsonl"))
	if !strings.Contains(string(audit), "evil.example") {
		t.Errorf("audit excerpt missing: %q", audit)
	}

	// Tampering is detected, by the real tool and by Verify.
	must(t, os.WriteFile(filepath.Join(dir, "workspace/notes.txt"), []byte("innocent\n"), 0o600))
	cmd = exec.Command(sha, "-c", quarantine.ManifestName)
	cmd.Dir = dir
	if err := cmd.Run(); err == nil {
		t.Error("sha256sum -c accepted a tampered file")
	}
	if err := quarantine.Verify(dir); err == nil {
		t.Error("Verify accepted a tampered file")
	}
}

func TestQuarantinedAgentDoesNotStartUntilReleased(t *testing.T) {
	f := setup(t, false)
	f.quarantine(t)
	ctx := context.Background()
	agentUnit := paths.Instance(paths.AgentTemplate, "mallory")
	// systemd itself (here: the fake honouring ConditionPathExists=) keeps
	// it down, whoever asks.
	must(t, f.units.Start(ctx, agentUnit))
	if a, _ := f.sd.State(agentUnit); a != "inactive" {
		t.Fatalf("quarantined agent is %s after a start", a)
	}
	if _, err := quarantine.Run(ctx, f.units, f.dirs, quarantine.Request{Agent: "mallory"}); !errors.Is(err, quarantine.ErrAlreadyQuarantined) {
		t.Errorf("second quarantine: %v", err)
	}
	m, err := quarantine.Release(f.dirs, "mallory")
	if err != nil || m.Reason != "blocked exfiltration" {
		t.Fatalf("release: %+v %v", m, err)
	}
	must(t, f.units.Start(ctx, agentUnit))
	if a, _ := f.sd.State(agentUnit); a != "active" {
		t.Fatalf("released agent is %s after a start", a)
	}
	if _, err := quarantine.Release(f.dirs, "mallory"); err == nil {
		t.Error("releasing an agent that is not quarantined succeeded")
	}
}

func TestQuarantineWithoutFreezerStopsFirst(t *testing.T) {
	f := setup(t, true)
	res := f.quarantine(t)
	agentUnit := paths.Instance(paths.AgentTemplate, "mallory")
	calls := f.sd.Calls()
	// SIGKILL, not a stop: SIGTERM would let the agent's handler touch
	// the workspace before the copy.
	if len(calls) < 2 || calls[0] != "FreezeUnit "+agentUnit || calls[1] != "KillUnit "+agentUnit+" all 9" {
		t.Errorf("calls %q: want a failed freeze then SIGKILL of the agent before anything else", calls)
	}
	if res.Frozen {
		t.Error("reported frozen")
	}
	if err := quarantine.Verify(res.Evidence.Dir); err != nil {
		t.Error(err)
	}
}
