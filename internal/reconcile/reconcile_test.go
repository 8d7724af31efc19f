package reconcile_test

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"testing"

	sdbus "github.com/coreos/go-systemd/v22/dbus"
	"github.com/google/go-cmp/cmp"

	"github.com/nixcage/nixcage/internal/config"
	"github.com/nixcage/nixcage/internal/paths"
	"github.com/nixcage/nixcage/internal/reconcile"
	"github.com/nixcage/nixcage/internal/reconcile/fakesd"
	"github.com/nixcage/nixcage/internal/render"
)

// env is a fake systemd on a private dbus-daemon, driven through the real
// go-systemd client.
type env struct {
	sd   *fakesd.Systemd
	conn *sdbus.Conn
	root string
}

func newEnv(t *testing.T) *env {
	t.Helper()
	root := t.TempDir()
	sd, conn, _ := fakesd.Start(t, root)
	return &env{sd: sd, conn: conn, root: root}
}

func (e *env) reconciler() *reconcile.Reconciler {
	o := render.DefaultOptions()
	o.Prefix = "/run"
	return &reconcile.Reconciler{
		Units: reconcile.Units{SD: e.conn}, Mode: reconcile.ModeRender, Root: e.root, Options: o,
		Quarantined: func(a string) bool {
			_, err := os.Stat(filepath.Join(e.root, paths.QuarantineMark(a)))
			return err == nil
		},
	}
}

func load(t *testing.T, src string) *config.Config {
	t.Helper()
	cfg, diags := config.NewLoader().Load(config.Source{Name: "test.hcl", Data: []byte(src)})
	if diags.HasErrors() {
		t.Fatal(diags.Error())
	}
	return cfg
}

const base = `
agent "alpha" {
  backend = "service"
  command = ["/bin/sleep", "infinity"]
}
agent "beta" {
  backend = "service"
  command   = ["/bin/sleep", "1000"]
  autostart = false
}
`

func TestReconcileRender(t *testing.T) {
	e := newEnv(t)
	r := e.reconciler()
	ctx := context.Background()
	agentA := paths.Instance(paths.AgentTemplate, "alpha")

	steps := []struct {
		name  string
		cfg   string
		setup func()
		calls []string
		check func(t *testing.T, res *reconcile.Result)
	}{
		{
			name:  "first apply installs, reloads and starts autostart agents only",
			cfg:   base,
			calls: []string{"Reload", "StartUnit " + agentA},
			check: func(t *testing.T, res *reconcile.Result) {
				if a, _ := e.sd.State(agentA); a != "active" {
					t.Errorf("alpha is %s, want active", a)
				}
				if a, _ := e.sd.State(paths.Instance(paths.AgentTemplate, "beta")); a != "inactive" {
					t.Errorf("beta (autostart = false) is %s, want inactive", a)
				}
				if _, err := os.Stat(filepath.Join(e.root, "run/systemd/system", agentA)); err != nil {
					t.Errorf("agent unit not installed under /run: %v", err)
				}
				if _, err := os.Stat(filepath.Join(e.root, "run/systemd/system", paths.CagedUnit)); err == nil {
					t.Errorf("caged's own unit was installed into /run")
				}
			},
		},
		{
			name:  "same config again does nothing",
			cfg:   base,
			calls: nil,
			check: func(t *testing.T, res *reconcile.Result) {
				if res.Changed() {
					t.Errorf("second apply changed things: %+v", res)
				}
			},
		},
		{
			name: "a policy no agent uses changes no unit",
			cfg: base + `
egress_policy "p" {
  allow = ["example.com"]
}
`,
			calls: nil,
		},
		{
			name: "an agent's own unit change restarts only that agent",
			cfg: `
agent "alpha" {
  backend = "service"
  command = ["/bin/sleep", "2000"]
}
agent "beta" {
  backend = "service"
  command   = ["/bin/sleep", "1000"]
  autostart = false
}
`,
			calls: []string{"Reload", "RestartUnit " + agentA},
		},
		{
			name: "egress change of a running agent restarts its prepare step and keeps it running",
			cfg: `
egress_policy "p" {
  allow = ["example.com"]
}
agent "alpha" {
  backend = "service"
  command = ["/bin/sleep", "2000"]
  egress  = "p"
}
agent "beta" {
  backend = "service"
  command   = ["/bin/sleep", "1000"]
  autostart = false
}
`,
			calls: []string{"RestartUnit " + paths.Instance(paths.PrepTemplate, "alpha")},
			check: func(t *testing.T, res *reconcile.Result) {
				if a, _ := e.sd.State(agentA); a != "active" {
					t.Errorf("alpha is %s after its prepare step restarted, want active", a)
				}
			},
		},
		{
			name: "a stopped autostart agent is started again",
			cfg: `
egress_policy "p" {
  allow = ["example.com"]
}
agent "alpha" {
  backend = "service"
  command = ["/bin/sleep", "2000"]
  egress  = "p"
}
agent "beta" {
  backend = "service"
  command   = ["/bin/sleep", "1000"]
  autostart = false
}
`,
			setup: func() { e.sd.SetState(agentA, "failed", "failed") },
			calls: []string{"StartUnit " + agentA},
		},
		{
			name: "a removed agent is stopped, its files removed, systemd reloaded",
			cfg: `
agent "beta" {
  backend = "service"
  command   = ["/bin/sleep", "1000"]
  autostart = false
}
`,
			calls: append(stopAll("alpha"), "Reload"),
			check: func(t *testing.T, res *reconcile.Result) {
				for _, p := range []string{"run/systemd/system/" + agentA, "run/nixcage/agents/alpha"} {
					if _, err := os.Stat(filepath.Join(e.root, p)); err == nil {
						t.Errorf("%s still exists", p)
					}
				}
				if a, _ := e.sd.State(agentA); a != "inactive" {
					t.Errorf("removed agent is %s", a)
				}
			},
		},
		{
			name: "a quarantined autostart agent is not started",
			cfg: `
agent "gamma" {
  backend = "service"
  command = ["/bin/true"]
}
`,
			setup: func() {
				mark := filepath.Join(e.root, paths.QuarantineMark("gamma"))
				os.MkdirAll(filepath.Dir(mark), 0o755)
				os.WriteFile(mark, []byte("{}"), 0o644)
			},
			calls: append(stopAll("beta"), "Reload"),
			check: func(t *testing.T, res *reconcile.Result) {
				if !slices.Contains(res.Skipped, paths.Instance(paths.AgentTemplate, "gamma")) {
					t.Errorf("gamma not reported as skipped: %+v", res)
				}
			},
		},
	}
	for _, st := range steps {
		t.Run(st.name, func(t *testing.T) {
			if st.setup != nil {
				st.setup()
			}
			e.sd.Reset()
			res, err := r.Apply(ctx, load(t, st.cfg))
			if err != nil {
				t.Fatalf("apply: %v", err)
			}
			if diff := cmp.Diff(st.calls, e.sd.Calls(), cmp.Comparer(func(a, b []string) bool { return slices.Equal(a, b) })); diff != "" {
				t.Errorf("systemd calls (-want +got):\n%s", diff)
			}
			if st.check != nil {
				st.check(t, res)
			}
		})
	}
}

// stopAll is the order units of a removed agent are stopped in.
func stopAll(agent string) []string {
	us := reconcile.AgentUnits(agent)
	var out []string
	for i := len(us) - 1; i >= 0; i-- {
		out = append(out, "StopUnit "+us[i])
	}
	return out
}

func TestReconcileOSModeOnlyDrivesLifecycle(t *testing.T) {
	e := newEnv(t)
	// Units provided by "the OS": rendered once into the unit dir by hand.
	o := render.DefaultOptions()
	files, err := render.Render(load(t, base), o)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := render.Write(filepath.Join(e.root, "run"), files); err != nil {
		t.Fatal(err)
	}
	e.sd.Reset()
	if err := e.conn.ReloadContext(context.Background()); err != nil {
		t.Fatal(err)
	}
	r := e.reconciler()
	r.Mode = reconcile.ModeOS
	e.sd.Reset()
	if _, err := r.Apply(context.Background(), load(t, base)); err != nil {
		t.Fatal(err)
	}
	want := []string{"StartUnit " + paths.Instance(paths.AgentTemplate, "alpha")}
	if got := e.sd.Calls(); !slices.Equal(got, want) {
		t.Errorf("calls = %q, want %q", got, want)
	}
}

func TestReconcileReportsFailures(t *testing.T) {
	e := newEnv(t)
	r := e.reconciler()
	r.Mode = reconcile.ModeOS // no unit files at all: starting must fail
	res, err := r.Apply(context.Background(), load(t, base))
	if err == nil {
		t.Fatalf("apply with missing units succeeded: %+v", res)
	}
	if !reconcile.IsNoSuchUnit(err) {
		t.Errorf("error %v does not name the missing unit", err)
	}
}

func TestReconcileReportsUnitsShadowedByEtc(t *testing.T) {
	e := newEnv(t)
	agentA := paths.Instance(paths.AgentTemplate, "alpha")
	etc := filepath.Join(e.root, "etc/systemd/system")
	if err := os.MkdirAll(etc, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(etc, agentA), []byte("[Service]\nExecStart=/bin/true\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	res, err := e.reconciler().Apply(context.Background(), load(t, base))
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(res.Shadowed, []string{agentA}) {
		t.Errorf("Shadowed = %q, want [%s]", res.Shadowed, agentA)
	}
}

// TestPlanAndPruneEtcTree installs into an /etc tree first written by
// `cagectl render --out /etc` (no reconcile has run there), then plans and
// applies a config that removes one agent and adds another: the plan names
// them, the removed agent's units and autostart link go, the unchanged one is
// not restarted.
func TestPlanAndPruneEtcTree(t *testing.T) {
	e := newEnv(t)
	ctx := context.Background()
	o := render.DefaultOptions() // prefix /etc
	r := &reconcile.Reconciler{Units: reconcile.Units{SD: e.conn}, Mode: reconcile.ModeRender, Root: e.root, Options: o}
	first := load(t, `
agent "alpha" {
  backend = "service"
  command = ["/bin/sleep", "infinity"]
}
agent "gamma" {
  backend = "nspawn"
  command = ["/bin/sleep", "infinity"]
}
`)
	files, err := render.Render(first, o)
	if err != nil {
		t.Fatal(err)
	}
	etc := filepath.Join(e.root, "etc")
	if _, err := render.Write(etc, files); err != nil {
		t.Fatal(err)
	}
	if err := e.conn.ReloadContext(ctx); err != nil { // the installer's daemon-reload
		t.Fatal(err)
	}
	if _, err := r.Apply(ctx, first); err != nil { // starts both (autostart)
		t.Fatal(err)
	}
	e.sd.Reset()
	next := load(t, `
agent "alpha" {
  backend = "service"
  command = ["/bin/sleep", "infinity"]
}
agent "delta" {
  backend = "service"
  command = ["/bin/sleep", "infinity"]
}
`)
	p, err := r.Plan(ctx, next)
	if err != nil {
		t.Fatal(err)
	}
	agentG := paths.Instance(paths.AgentTemplate, "gamma")
	agentD := paths.Instance(paths.AgentTemplate, "delta")
	if !slices.Equal(p.Added, []string{"delta"}) || !slices.Equal(p.Removed, []string{"gamma"}) || len(p.Changed) != 0 {
		t.Errorf("plan agents: added %q changed %q removed %q", p.Added, p.Changed, p.Removed)
	}
	if len(p.Restart) != 0 || !slices.Equal(p.Start, []string{agentD}) || !slices.Contains(p.Stop, agentG) {
		t.Errorf("plan units: restart %q start %q stop %q", p.Restart, p.Start, p.Stop)
	}
	if !slices.Contains(p.Stop, "var-lib-nixcage-agents-gamma.mount") || slices.Index(p.Stop, "var-lib-nixcage-agents-gamma.mount") < slices.Index(p.Stop, agentG) {
		t.Errorf("plan does not stop gamma's workspace mount after gamma: %q", p.Stop)
	}
	if !slices.Contains(p.Remove, "systemd/system/"+paths.TargetUnit+".wants/"+agentG) {
		t.Errorf("plan does not remove gamma's autostart link: %q", p.Remove)
	}
	if calls := e.sd.Calls(); len(calls) != 0 {
		t.Errorf("planning called systemd to change things: %q", calls)
	}
	res, err := r.Apply(ctx, next)
	if err != nil {
		t.Fatal(err)
	}
	if slices.Contains(res.Restarted, paths.Instance(paths.AgentTemplate, "alpha")) {
		t.Errorf("unchanged alpha was restarted: %+v", res)
	}
	for _, f := range []string{"systemd/system/" + agentG, "systemd/system/" + paths.TargetUnit + ".wants/" + agentG, "nixcage/agents/gamma/egress.json"} {
		if _, err := os.Lstat(filepath.Join(etc, f)); err == nil {
			t.Errorf("%s was not pruned", f)
		}
	}
	if a, _ := e.sd.State(agentG); a == "active" {
		t.Errorf("removed gamma still active")
	}
	if a, _ := e.sd.State(agentD); a != "active" {
		t.Errorf("new delta is %s, want active", a)
	}
	if m := render.ReadManifest(etc); m.Options == nil || m.Options.Prefix != "/etc" || slices.Contains(m.Files, "systemd/system/"+agentG) {
		t.Errorf("manifest after apply: %+v", m)
	}
}
