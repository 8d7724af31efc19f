package bus_test

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/godbus/dbus/v5"

	"github.com/nixcage/nixcage/internal/bus"
	"github.com/nixcage/nixcage/internal/bus/bustest"
	"github.com/nixcage/nixcage/internal/config"
	"github.com/nixcage/nixcage/internal/control"
	"github.com/nixcage/nixcage/internal/paths"
	"github.com/nixcage/nixcage/internal/render"
	"github.com/nixcage/nixcage/internal/testenv"
)

var update = flag.Bool("update", false, "rewrite golden files")

// fakeBackend records what the server asked of it.
type fakeBackend struct {
	mu       sync.Mutex
	calls    []string
	agents   []bus.AgentStatus
	accounts []*config.Account
}

func (f *fakeBackend) rec(format string, args ...any) {
	f.mu.Lock()
	f.calls = append(f.calls, fmt.Sprintf(format, args...))
	f.mu.Unlock()
}

func (f *fakeBackend) Calls() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]string(nil), f.calls...)
}

func (f *fakeBackend) Status(ctx context.Context) (*bus.Status, error) {
	return &bus.Status{Version: "test", Mode: "render", Config: "/etc/nixcage/nixcage.json", Generation: 7, Channel: "stable", Agents: f.agents}, nil
}

func (f *fakeBackend) Agent(ctx context.Context, name string) (*bus.AgentStatus, error) {
	for _, a := range f.agents {
		if a.Name == name {
			return &a, nil
		}
	}
	return nil, bus.ErrNoSuchAgent
}

func (f *fakeBackend) Start(ctx context.Context, agent, by string) error {
	f.rec("start %s by %s", agent, by)
	return nil
}

func (f *fakeBackend) Stop(ctx context.Context, agent, by string) error {
	f.rec("stop %s by %s", agent, by)
	return nil
}

func (f *fakeBackend) Restart(ctx context.Context, agent, by string) error {
	f.rec("restart %s by %s", agent, by)
	return nil
}

func (f *fakeBackend) Kill(ctx context.Context, agent, by string) error {
	f.rec("kill %s by %s", agent, by)
	return nil
}

func (f *fakeBackend) Quarantine(ctx context.Context, agent, reason, by string) (string, error) {
	f.rec("quarantine %s %q by %s", agent, reason, by)
	return "/var/lib/nixcage/evidence/" + agent + "-x", nil
}

func (f *fakeBackend) Release(ctx context.Context, agent, by string) error {
	f.rec("release %s by %s", agent, by)
	return nil
}

func (f *fakeBackend) Apply(ctx context.Context, source, by string) (*bus.ApplyResult, error) {
	f.rec("apply %s by %s", source, by)
	if source == "bad" {
		return nil, errors.New("release refused: signature does not verify")
	}
	return &bus.ApplyResult{Generation: 8, Previous: 7, Channel: "stable", Top: "/nix/store/x-top", Added: 3}, nil
}

func (f *fakeBackend) Rollback(ctx context.Context, to uint64, force bool, by string) (uint64, uint64, error) {
	f.rec("rollback %d by %s", to, by)
	return 8, 7, nil
}

func (f *fakeBackend) Generations(ctx context.Context) ([]bus.Generation, error) {
	return []bus.Generation{{Number: 7, Channel: "stable"}, {Number: 8, Channel: "stable", Current: true}}, nil
}

func (f *fakeBackend) Reload(ctx context.Context, by string) error {
	f.rec("reload by %s", by)
	return nil
}

func (f *fakeBackend) ReadAudit(ctx context.Context, agent string, offset int64, max uint32) ([]string, int64, error) {
	f.rec("audit %s %d %d", agent, offset, max)
	return []string{`{"decision":"blocked"}`}, offset + 23, nil
}

func (f *fakeBackend) ApplyConfig(ctx context.Context, srcs []bus.ConfigSource, dryRun bool, by string) (*bus.ConfigPlan, error) {
	f.rec("apply-config %d file(s) dry-run=%v by %s", len(srcs), dryRun, by)
	return &bus.ConfigPlan{Added: []string{"new"}, Applied: !dryRun}, nil
}

func (f *fakeBackend) ReadLogs(ctx context.Context, agent string, lines uint32, cursor string) ([]string, string, error) {
	f.rec("logs %s %d %q", agent, lines, cursor)
	return []string{"line"}, "c1", nil
}

func (f *fakeBackend) RotateSecret(ctx context.Context, agent, name string, newPlaceholder bool, by string) (string, error) {
	f.rec("rotate %s %q %v by %s", agent, name, newPlaceholder, by)
	return "rotated", nil
}

func (f *fakeBackend) Accounts() []*config.Account { return f.accounts }

func (f *fakeBackend) HasAgent(agent string) bool {
	_, err := f.Agent(context.Background(), agent)
	return err == nil
}

// users maps the test's uids to names without touching /etc/passwd.
type users map[uint32]bus.Identity

func (u users) Lookup(uid uint32) bus.Identity {
	if id, ok := u[uid]; ok {
		id.UID = uid
		return id
	}
	return bus.Identity{UID: uid}
}

const (
	uidViewer   = 65534 // nobody: dbus-daemon refuses uids without a passwd entry
	uidOperator = 33    // www-data
	uidStranger = 34    // backup
)

var testUsers = users{
	0:           {User: "root"},
	uidViewer:   {User: "vera", Groups: []string{"auditors"}},
	uidOperator: {User: "otto"},
	uidStranger: {User: "sid"},
}

type harness struct {
	bus    *bustest.Bus
	srv    *bus.Server
	be     *fakeBackend
	client *bus.Client
}

// shippedPolicy is the D-Bus policy file exactly as the renderer ships it.
func shippedPolicy(t testing.TB, dir string) string {
	t.Helper()
	cfg, diags := config.NewLoader().Load(config.Source{Name: "t.hcl", Data: []byte(`agent "a" {
  backend = "service"
  command = ["/bin/true"]
}`)})
	if diags.HasErrors() {
		t.Fatal(diags.Error())
	}
	files, err := render.Render(cfg, render.DefaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range files {
		if strings.HasPrefix(f.Path, "dbus-1/system.d/") {
			p := filepath.Join(dir, filepath.Base(f.Path))
			if err := os.WriteFile(p, f.Data, 0o644); err != nil {
				t.Fatal(err)
			}
			return p
		}
	}
	t.Fatal("renderer ships no D-Bus policy")
	return ""
}

func start(t testing.TB, agents int) *harness {
	t.Helper()
	testenv.RequireRoot(t, "the shipped D-Bus policy lets only root own org.nixcage.*, and the tests call as root, caged's implicit admin")
	polDir := t.TempDir()
	b := bustest.Start(t, bustest.Options{Include: []string{shippedPolicy(t, polDir)}})
	be := &fakeBackend{accounts: []*config.Account{
		{Name: "auditors", Group: "auditors", Role: config.RoleViewer},
		{Name: "otto", User: "otto", Role: config.RoleOperator, Agents: []string{"alpha"}},
	}}
	names := []string{"alpha", "beta-2"}
	for i := 0; len(names) < agents; i++ {
		names = append(names, fmt.Sprintf("agent-%04d", i))
	}
	for _, n := range names[:max(agents, 0)] {
		be.agents = append(be.agents, bus.AgentStatus{Name: n, Backend: "service", Unit: paths.Instance(paths.AgentTemplate, n), LoadState: "loaded", ActiveState: "active", SubState: "running", EgressState: "active", Autostart: true, Allowed: 3, Blocked: 1})
	}
	srv := bus.NewServer(b.Conn(t), be, bus.ServerOptions{Users: testUsers})
	if err := srv.Export(bus.ManagerProps{Version: "test", Mode: "render", Config: "/etc/nixcage/nixcage.json", Channel: "stable", Generation: 7}); err != nil {
		t.Fatal(err)
	}
	if err := srv.SetAgents(be.agents); err != nil {
		t.Fatal(err)
	}
	c, err := bus.Dial(context.Background(), b.Address)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return &harness{bus: b, srv: srv, be: be, client: c}
}

func TestMethodsAsRoot(t *testing.T) {
	h := start(t, 2)
	ctx := context.Background()
	c := h.client

	st, err := c.Status(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if st.Generation != 7 || len(st.Agents) != 2 || st.Agents[1].Name != "beta-2" || st.Agents[0].Blocked != 1 {
		t.Errorf("status = %+v", st)
	}
	if err := c.Start(ctx, "alpha"); err != nil {
		t.Fatal(err)
	}
	if err := c.Stop(ctx, "alpha"); err != nil {
		t.Fatal(err)
	}
	if err := c.Restart(ctx, "beta-2"); err != nil {
		t.Fatal(err)
	}
	if err := c.Kill(ctx, "alpha"); err != nil {
		t.Fatal(err)
	}
	ev, err := c.Quarantine(ctx, "alpha", "exfiltration")
	if err != nil || ev != "/var/lib/nixcage/evidence/alpha-x" {
		t.Fatalf("quarantine = %q, %v", ev, err)
	}
	if _, err := c.Quarantine(ctx, "alpha", " "); err == nil {
		t.Error("quarantine without a reason accepted")
	}
	if err := c.Release(ctx, "alpha"); err != nil {
		t.Fatal(err)
	}
	lines, next, err := c.ReadAudit(ctx, "alpha", 5, 10)
	if err != nil || len(lines) != 1 || next != 28 {
		t.Fatalf("audit = %q %d %v", lines, next, err)
	}
	res, err := c.Apply(ctx, "/srv/release")
	if err != nil || res.Generation != 8 || res.Added != 3 {
		t.Fatalf("apply = %+v %v", res, err)
	}
	if _, err := c.Apply(ctx, "bad"); err == nil || !strings.Contains(err.Error(), "signature does not verify") {
		t.Errorf("failed apply reported as %v", err)
	}
	from, now, err := c.Rollback(ctx, 0, false)
	if err != nil || from != 8 || now != 7 {
		t.Fatalf("rollback = %d %d %v", from, now, err)
	}
	gens, err := c.Generations(ctx)
	if err != nil || len(gens) != 2 || !gens[1].Current {
		t.Fatalf("generations = %+v %v", gens, err)
	}
	if err := c.Reload(ctx); err != nil {
		t.Fatal(err)
	}
	if err := c.Start(ctx, "nope"); !errors.Is(err, bus.ErrNoSuchAgent) {
		t.Errorf("start of an unknown agent: %v", err)
	}
	// An empty name is no agent, even for root: it must never reach the
	// backend (where it would name the unit "nixcage-agent@.service").
	if err := c.Stop(ctx, ""); !errors.Is(err, bus.ErrNoSuchAgent) {
		t.Errorf("stop of the empty agent name: %v", err)
	}
	if _, err := c.Quarantine(ctx, "", "x"); !errors.Is(err, bus.ErrNoSuchAgent) {
		t.Errorf("quarantine of the empty agent name: %v", err)
	}
	if _, _, err := c.ReadAudit(ctx, "", 0, 1); !errors.Is(err, bus.ErrNoSuchAgent) {
		t.Errorf("audit of the empty agent name: %v", err)
	}
	if err := c.Ping(ctx); err != nil {
		t.Error(err)
	}
	// Per-agent object methods reach the same backend.
	obj := c.Conn().Object(bus.Name, bus.AgentPath("beta-2"))
	if err := obj.Call(bus.AgentIface+".Stop", 0).Err; err != nil {
		t.Fatal(err)
	}
	want := []string{
		"start alpha by root (uid 0)", "stop alpha by root (uid 0)", "restart beta-2 by root (uid 0)",
		"kill alpha by root (uid 0)", `quarantine alpha "exfiltration" by root (uid 0)`, "release alpha by root (uid 0)",
		"audit alpha 5 10", "apply /srv/release by root (uid 0)", "apply bad by root (uid 0)",
		"rollback 0 by root (uid 0)", "reload by root (uid 0)", "stop beta-2 by root (uid 0)",
	}
	if got := h.be.Calls(); !slices.Equal(got, want) {
		t.Errorf("backend calls:\n got %q\nwant %q", got, want)
	}
}

func TestPropertiesAndSignals(t *testing.T) {
	h := start(t, 2)
	conn := h.bus.Conn(t)
	path := bus.AgentPath("beta-2")
	if path != "/org/nixcage/cage1/agent/beta_2d2" {
		t.Errorf("agent path %s, want systemd-style escaping", path)
	}
	obj := conn.Object(bus.Name, path)
	v, err := obj.GetProperty(bus.AgentIface + ".ActiveState")
	if err != nil || v.Value() != "active" {
		t.Fatalf("ActiveState = %v, %v", v, err)
	}
	var all map[string]dbus.Variant
	if err := obj.Call("org.freedesktop.DBus.Properties.GetAll", 0, bus.AgentIface).Store(&all); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{"Name", "Backend", "Unit", "LoadState", "ActiveState", "SubState", "EgressState", "Autostart", "Quarantined", "QuarantineReason", "EgressAllowed", "EgressFlagged", "EgressBlocked"} {
		if _, ok := all[p]; !ok {
			t.Errorf("property %s missing", p)
		}
	}
	mgr := conn.Object(bus.Name, bus.Path)
	if g, err := mgr.GetProperty(bus.ManagerIface + ".Generation"); err != nil || g.Value() != uint64(7) {
		t.Errorf("Generation = %v %v", g, err)
	}
	if a, err := mgr.GetProperty(bus.ManagerIface + ".Agents"); err != nil || len(a.Value().([]dbus.ObjectPath)) != 2 {
		t.Errorf("Agents = %v %v", a, err)
	}
	// Writes are refused: properties are read-only.
	if err := obj.SetProperty(bus.AgentIface+".ActiveState", dbus.MakeVariant("inactive")); err == nil {
		t.Error("property write accepted")
	}

	if err := conn.AddMatchSignal(dbus.WithMatchInterface("org.freedesktop.DBus.Properties"), dbus.WithMatchObjectPath(path)); err != nil {
		t.Fatal(err)
	}
	sigs := make(chan *dbus.Signal, 16)
	conn.Signal(sigs)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	events, err := h.client.Events(ctx)
	if err != nil {
		t.Fatal(err)
	}

	st := h.be.agents[1]
	st.ActiveState, st.SubState = "failed", "failed"
	h.srv.UpdateAgent(st)
	sig := <-sigs
	if sig.Name != "org.freedesktop.DBus.Properties.PropertiesChanged" || sig.Body[0] != bus.AgentIface {
		t.Fatalf("signal %+v", sig)
	}
	changed := sig.Body[1].(map[string]dbus.Variant)
	if changed["ActiveState"].Value() != "failed" || len(changed) != 1 {
		// SubState arrives in its own signal: prop emits one per property.
		if changed["SubState"].Value() != "failed" {
			t.Errorf("changed = %v", changed)
		}
	}

	h.srv.Emit(bus.SignalAgentStateChanged, "beta-2", "failed", "failed")
	h.srv.Emit(bus.SignalReleaseApplied, uint64(8), uint64(7), "root (uid 0)")
	h.srv.Emit(bus.SignalEgressDecision, "alpha", "blocked", "evil.example", "host not allowed", "{}")
	var got []bus.Event
	for len(got) < 3 {
		got = append(got, <-events)
	}
	if got[0].Kind != bus.SignalAgentStateChanged || got[0].Agent != "beta-2" || got[0].Data["active_state"] != "failed" {
		t.Errorf("event 0 = %+v", got[0])
	}
	if got[1].Kind != bus.SignalReleaseApplied || got[1].Data["generation"] != "8" {
		t.Errorf("event 1 = %+v", got[1])
	}
	if got[2].Kind != bus.SignalEgressDecision || got[2].Data["host"] != "evil.example" {
		t.Errorf("event 2 = %+v", got[2])
	}

	// Agents that disappear lose their objects.
	if err := h.srv.SetAgents(h.be.agents[:1]); err != nil {
		t.Fatal(err)
	}
	if _, err := obj.GetProperty(bus.AgentIface + ".ActiveState"); err == nil {
		t.Error("removed agent still has properties")
	}
}

func TestIntrospection(t *testing.T) {
	h := start(t, 2)
	conn := h.bus.Conn(t)
	for _, p := range []string{"/", "/org/nixcage", paths.BusPath, paths.AgentPath, string(bus.AgentPath("alpha"))} {
		var xml string
		if err := conn.Object(bus.Name, dbus.ObjectPath(p)).Call("org.freedesktop.DBus.Introspectable.Introspect", 0).Store(&xml); err != nil {
			t.Fatalf("%s: %v", p, err)
		}
		name := strings.ReplaceAll(strings.Trim(p, "/"), "/", "_")
		if name == "" {
			name = "root"
		}
		golden := filepath.Join("testdata", "introspect", name+".xml")
		if *update {
			os.MkdirAll(filepath.Dir(golden), 0o755)
			os.WriteFile(golden, []byte(xml), 0o644)
		}
		want, err := os.ReadFile(golden)
		if err != nil {
			t.Fatalf("%v (run go test ./internal/bus -run TestIntrospection -update)", err)
		}
		if string(want) != xml {
			t.Errorf("%s introspection differs from %s:\n%s", p, golden, xml)
		}
	}
	// busctl, the tool operators use, must understand it.
	busctl := testenv.LookPath(t, "busctl")
	out, err := exec.Command(busctl, "--address="+h.bus.Address, "introspect", bus.Name, paths.BusPath).CombinedOutput()
	if err != nil {
		t.Fatalf("busctl introspect: %v\n%s", err, out)
	}
	for _, want := range []string{".QuarantineAgent", "ss", ".AgentStateChanged", ".Generation", "emits-change"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("busctl introspect lacks %q:\n%s", want, out)
		}
	}
	out, err = exec.Command(busctl, "--address="+h.bus.Address, "tree", bus.Name).CombinedOutput()
	if err != nil || !strings.Contains(string(out), "/org/nixcage/cage1/agent/beta_2d2") {
		t.Errorf("busctl tree: %v\n%s", err, out)
	}
}

// The helper process is the test binary re-executed as another uid: it
// makes one call and prints the D-Bus error name (or "ok").
func TestMain(m *testing.M) {
	if os.Getenv("NIXCAGE_BUS_HELPER") == "1" {
		os.Exit(helper(os.Args[len(os.Args)-2], os.Args[len(os.Args)-1]))
	}
	os.Exit(m.Run())
}

func helper(addr, what string) int {
	ctx := context.Background()
	if what == "watch" || what == "eavesdrop" {
		return streamHelper(addr, what)
	}
	if what == "own" {
		c, err := bustest.Dial(addr)
		if err != nil {
			fmt.Println("dial:", err)
			return 1
		}
		r, err := c.RequestName(bus.Name, dbus.NameFlagDoNotQueue)
		switch {
		case err != nil:
			fmt.Println(errName(err))
		case r != dbus.RequestNameReplyPrimaryOwner:
			fmt.Println("not-owner")
		default:
			fmt.Println("ok")
		}
		return 0
	}
	c, err := bus.Dial(ctx, addr)
	if err != nil {
		fmt.Println("dial:", err)
		return 1
	}
	if handled, rerr := relayHelper(ctx, c, what); handled {
		what, err = "", rerr
	}
	switch what {
	case "status":
		_, err = c.Status(ctx)
	case "introspect":
		err = c.Conn().Object(bus.Name, bus.Path).Call("org.freedesktop.DBus.Introspectable.Introspect", 0).Err
	case "audit-alpha":
		_, _, err = c.ReadAudit(ctx, "alpha", 0, 10)
	case "kill-alpha":
		err = c.Kill(ctx, "alpha")
	case "kill-beta":
		err = c.Kill(ctx, "beta-2")
	case "quarantine-alpha":
		_, err = c.Quarantine(ctx, "alpha", "test")
	case "apply":
		_, err = c.Apply(ctx, "/srv/release")
	case "rollback":
		_, _, err = c.Rollback(ctx, 0, false)
	case "reload":
		err = c.Reload(ctx)
	case "apply-config":
		_, err = c.ApplyConfig(ctx, []bus.ConfigSource{{Name: "c.hcl", Data: []byte("")}}, true)
	case "apply-dir":
		var d *os.File
		if d, err = os.Open("/"); err == nil {
			_, err = c.ApplyDir(ctx, d)
			d.Close()
		}
	case "rotate-alpha":
		_, err = c.RotateSecret(ctx, "alpha", "", false)
	case "rotate-beta":
		_, err = c.RotateSecret(ctx, "beta-2", "", false)
	case "logs-alpha":
		_, _, err = c.ReadLogs(ctx, "alpha", 10, "")
	case "allow-alpha":
		_, err = c.AllowHost(ctx, "alpha", "api.example.com", 0, time.Hour, "test")
	case "allow-alpha-wildcard":
		_, err = c.AllowHost(ctx, "alpha", "*.example.com", 0, time.Hour, "test")
	case "allow-beta":
		_, err = c.AllowHost(ctx, "beta-2", "api.example.com", 0, time.Hour, "test")
	case "grants-alpha":
		_, err = c.ListGrants(ctx, "alpha")
	case "revoke-g1":
		err = c.RevokeGrant(ctx, "g-1")
	case "apply-control":
		_, err = c.ApplyControl(ctx, []byte(`{"schema":1}`))
	case "control-acks":
		_, err = c.ControlAcks(ctx, 0)
	case "approvals-alpha":
		_, err = c.ListApprovals(ctx, "alpha")
	case "approve-alpha":
		_, err = c.Decide(ctx, "a-0123456789ab", "once")
	case "approve-bad-verdict":
		_, err = c.Decide(ctx, "a-0123456789ab", "always")
	}
	if err != nil {
		fmt.Println(errName(err))
		fmt.Fprintln(os.Stderr, err)
		return 0
	}
	fmt.Println("ok")
	return 0
}

func errName(err error) string {
	var re *bus.RemoteError
	if errors.As(err, &re) {
		return re.Name
	}
	var de dbus.Error
	if errors.As(err, &de) {
		return de.Name
	}
	return "error: " + err.Error()
}

// asUID runs the helper as uid and returns its first output line.
func asUID(t *testing.T, bin, addr string, uid uint32, what string) string {
	t.Helper()
	cmd := exec.Command(bin, "-test.run=^$", addr, what)
	cmd.Env = append(os.Environ(), "NIXCAGE_BUS_HELPER=1")
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uid, Gid: uid}}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("helper as uid %d: %v\n%s%s", uid, err, out, stderr.String())
	}
	line, _, _ := strings.Cut(string(out), "\n")
	return line
}

// helperBinary copies the test binary where other uids can run it.
func helperBinary(t *testing.T, dir string) string {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	dst := filepath.Join(dir, "helper")
	in, err := os.Open(self)
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_WRONLY, 0o755)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.Copy(out, in); err != nil {
		t.Fatal(err)
	}
	out.Close()
	return dst
}

func TestAuthorizationByRealUID(t *testing.T) {
	testenv.RequirePrivileged(t)
	h := start(t, 2)
	bin := helperBinary(t, h.bus.Dir)
	const denied = bus.ErrorAccessDenied
	cases := []struct {
		name string
		uid  uint32
		what string
		want string
	}{
		{"stranger reads status", uidStranger, "status", "ok"},
		{"stranger introspects", uidStranger, "introspect", "ok"},
		{"stranger cannot read audit", uidStranger, "audit-alpha", denied},
		{"stranger cannot kill", uidStranger, "kill-alpha", denied},
		{"viewer reads status", uidViewer, "status", "ok"},
		{"viewer reads audit through its group", uidViewer, "audit-alpha", "ok"},
		{"viewer is refused kill", uidViewer, "kill-alpha", denied},
		{"viewer is refused quarantine", uidViewer, "quarantine-alpha", denied},
		{"viewer is refused apply", uidViewer, "apply", denied},
		{"operator kills an agent in scope", uidOperator, "kill-alpha", "ok"},
		{"operator quarantines an agent in scope", uidOperator, "quarantine-alpha", "ok"},
		{"operator is refused an agent out of scope", uidOperator, "kill-beta", denied},
		{"operator is refused apply", uidOperator, "apply", denied},
		{"operator is refused rollback", uidOperator, "rollback", denied},
		{"operator is refused reload", uidOperator, "reload", denied},
		{"stranger is refused rollback", uidStranger, "rollback", denied},
		{"operator is refused apply-config", uidOperator, "apply-config", denied},
		{"viewer is refused apply-config", uidViewer, "apply-config", denied},
		{"operator is refused ApplyDir", uidOperator, "apply-dir", denied},
		{"viewer is refused secret rotation", uidViewer, "rotate-alpha", denied},
		{"operator rotates a secret in scope", uidOperator, "rotate-alpha", "ok"},
		{"operator is refused rotation out of scope", uidOperator, "rotate-beta", denied},
		{"viewer reads logs", uidViewer, "logs-alpha", "ok"},
		{"stranger is refused logs", uidStranger, "logs-alpha", denied},
		{"viewer is refused a grant", uidViewer, "allow-alpha", denied},
		{"viewer is refused a revoke", uidViewer, "revoke-g1", denied},
		{"viewer lists grants", uidViewer, "grants-alpha", "ok"},
		{"stranger is refused the grants list", uidStranger, "grants-alpha", denied},
		{"operator grants an exact name", uidOperator, "allow-alpha", "ok"},
		{"operator is refused a wildcard grant", uidOperator, "allow-alpha-wildcard", denied},
		{"operator is refused a grant out of scope", uidOperator, "allow-beta", denied},
		{"operator revokes a grant", uidOperator, "revoke-g1", "ok"},
		{"operator records a relay action in scope", uidOperator, "relay-alpha", "ok"},
		{"operator is refused a relay action out of scope", uidOperator, "relay-beta", denied},
		{"scoped operator is refused a relay action naming no agent", uidOperator, "relay-none", denied},
		{"stranger is refused a relay action", uidStranger, "relay-alpha", denied},
		{"viewer records a relay action", uidViewer, "relay-beta", "ok"},
		{"a relay action is one line", uidOperator, "relay-alpha-multiline", bus.ErrorInvalid},
		{"a relay action has a known outcome", uidOperator, "relay-alpha-outcome", bus.ErrorInvalid},
		{"viewer lists approvals", uidViewer, "approvals-alpha", "ok"},
		{"stranger is refused the approvals list", uidStranger, "approvals-alpha", denied},
		{"viewer is refused a decision", uidViewer, "approve-alpha", denied},
		{"stranger is refused a decision", uidStranger, "approve-alpha", denied},
		{"a verdict is once, host or deny", uidOperator, "approve-bad-verdict", bus.ErrorInvalid},
		{"operator decides an approval", uidOperator, "approve-alpha", "ok"},
		// Control commands (docs/fleet.md): handing one in is admin, as
		// apply is, whatever its signatures; the acks are viewer over all.
		{"operator (e.g. the chat relay) is refused a control command", uidOperator, "apply-control", denied},
		{"viewer is refused a control command", uidViewer, "apply-control", denied},
		{"stranger is refused a control command", uidStranger, "apply-control", denied},
		{"stranger is refused the ack list", uidStranger, "control-acks", denied},
		{"scoped operator is refused the ack list", uidOperator, "control-acks", denied},
		{"viewer over every agent lists the acks", uidViewer, "control-acks", "ok"},
		{"only root may own the name", uidOperator, "own", "org.freedesktop.DBus.Error.AccessDenied"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if got := asUID(t, bin, h.bus.Address, c.uid, c.what); got != c.want {
				t.Errorf("as uid %d %s: got %q, want %q", c.uid, c.what, got, c.want)
			}
		})
	}
	calls := h.be.Calls()
	want := []string{"audit alpha 0 10", "kill alpha by otto (uid 33)", `quarantine alpha "test" by otto (uid 33)`,
		`rotate alpha "" false by otto (uid 33)`, `logs alpha 10 ""`,
		"grants alpha", "allow alpha api.example.com:0 1h0m0s by otto (uid 33)", "revoke alpha g-1 by otto (uid 33)",
		"relay alpha stop ok stop done by otto (uid 33)", "relay beta-2 stop ok stop done by vera (uid 65534)",
		"approvals alpha", "decide alpha a-0123456789ab once by otto (uid 33)"}
	if !slices.Equal(calls, want) {
		t.Errorf("backend saw %q, want only %q", calls, want)
	}
}

func TestSecondServerCannotTakeTheName(t *testing.T) {
	h := start(t, 1)
	srv := bus.NewServer(h.bus.Conn(t), h.be, bus.ServerOptions{Users: testUsers})
	err := srv.Export(bus.ManagerProps{})
	if err == nil || !strings.Contains(err.Error(), "already running") {
		t.Errorf("second Export = %v", err)
	}
	_ = time.Second
}

func (f *fakeBackend) AllowHost(ctx context.Context, agent, host string, port int, d time.Duration, reason, by string) (bus.Grant, error) {
	f.rec("allow %s %s:%d %s by %s", agent, host, port, d, by)
	return bus.Grant{ID: "g-1", Agent: agent, Host: host, Port: int32(port), ExpiresUnix: time.Now().Add(d).Unix(), By: by, Reason: reason}, nil
}

func (f *fakeBackend) ListGrants(ctx context.Context, agent string) ([]bus.Grant, error) {
	f.rec("grants %s", agent)
	return []bus.Grant{{ID: "g-1", Agent: agent, Host: "a.example.com"}}, nil
}

func (f *fakeBackend) ApplyControl(ctx context.Context, raw []byte, by string) (control.Ack, error) {
	f.rec("control by %s", by)
	return control.Ack{Status: control.StatusRejected, Reason: "fake"}, nil
}

func (f *fakeBackend) ControlAcks(ctx context.Context, max uint32) ([]control.Ack, error) {
	return nil, nil
}

func (f *fakeBackend) RevokeGrant(ctx context.Context, agent, id, by string) error {
	f.rec("revoke %s %s by %s", agent, id, by)
	return nil
}

func (f *fakeBackend) GrantAgent(id string) (string, bool) { return "alpha", id == "g-1" }

func (f *fakeBackend) ListApprovals(ctx context.Context, agent string) ([]bus.Approval, error) {
	f.rec("approvals %s", agent)
	return []bus.Approval{{ID: "a-0123456789ab", Agent: agent, Host: "new.example.com", Port: 443, Method: "CONNECT"}}, nil
}

func (f *fakeBackend) DecideApproval(ctx context.Context, agent, id, verdict, by string) (string, error) {
	f.rec("decide %s %s %s by %s", agent, id, verdict, by)
	return "", nil
}

func (f *fakeBackend) ApprovalAgent(id string) (string, bool) { return "alpha", id == "a-0123456789ab" }
