package bus_test

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/godbus/dbus/v5"

	"github.com/nixcage/nixcage/internal/bus"
	"github.com/nixcage/nixcage/internal/bus/bustest"
	"github.com/nixcage/nixcage/internal/config"
	"github.com/nixcage/nixcage/internal/paths"
	"github.com/nixcage/nixcage/internal/render"
	"github.com/nixcage/nixcage/internal/testenv"
)

// endMarker is the Reconciled signal that ends a streaming helper: caged
// broadcasts it after the signals under test, and dbus-daemon delivers one
// sender's messages to each receiver in order, so a helper that sees the
// marker has seen everything it was going to see before it.
const endMarker = "end-of-test"

// streamHelper runs as another uid and prints one line per caged signal it
// receives ("Kind agent"), after "ready", until the end marker.
//
//	watch:     what `cagectl events` does (bus.Client.Events)
//	eavesdrop: a raw connection that asks to become a monitor, then adds
//	           eavesdropping match rules, as dbus-monitor does
func streamHelper(addr, what string) int {
	ctx := context.Background()
	switch what {
	case "watch":
		c, err := bus.Dial(ctx, addr)
		if err != nil {
			fmt.Println("dial:", err)
			return 1
		}
		events, err := c.Events(ctx)
		if err != nil {
			fmt.Println("events:", err)
			return 1
		}
		fmt.Println("ready")
		for ev := range events {
			if ev.Kind == bus.SignalReconciled && ev.Data["error"] == endMarker {
				fmt.Println("end")
				return 0
			}
			fmt.Println(ev.Kind, ev.Agent)
		}
		return 1
	case "eavesdrop":
		c, err := bustest.Dial(addr)
		if err != nil {
			fmt.Println("dial:", err)
			return 1
		}
		err = c.BusObject().Call("org.freedesktop.DBus.Monitoring.BecomeMonitor", 0, []string{}, uint32(0)).Err
		fmt.Println("become-monitor:", errName(err))
		// dbus-daemon 1.14 refuses eavesdropping rules to unprivileged
		// callers; older ones obey the policy's eavesdrop rules. Either
		// way the plain rule below must not deliver audit signals.
		for _, rule := range []string{"eavesdrop='true'", "eavesdrop='true',type='signal'"} {
			err := c.BusObject().Call("org.freedesktop.DBus.AddMatch", 0, rule).Err
			fmt.Println("eavesdrop:", errName(err))
		}
		if err := c.BusObject().Call("org.freedesktop.DBus.AddMatch", 0, "interface='"+bus.ManagerIface+"'").Err; err != nil {
			fmt.Println("addmatch:", err)
			return 1
		}
		sigs := make(chan *dbus.Signal, 64)
		c.Signal(sigs)
		fmt.Println("ready")
		for sig := range sigs {
			member := strings.TrimPrefix(sig.Name, bus.ManagerIface+".")
			if member == bus.SignalReconciled && len(sig.Body) == 1 && sig.Body[0] == endMarker {
				fmt.Println("end")
				return 0
			}
			if member != sig.Name {
				agent := ""
				if len(sig.Body) > 0 {
					agent = fmt.Sprint(sig.Body[0])
				}
				fmt.Println(member, agent)
			}
		}
	}
	return 1
}

// streamer is a running process as another uid whose stdout lines are
// collected until it prints "end".
type streamer struct {
	name  string
	cmd   *exec.Cmd
	lines chan string
}

func startStreamer(t *testing.T, name string, uid uint32, argv ...string) *streamer {
	t.Helper()
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Env = append(os.Environ(), "NIXCAGE_BUS_HELPER=1")
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uid, Gid: uid, Groups: []uint32{uid}}}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	s := &streamer{name: name, cmd: cmd, lines: make(chan string, 1024)}
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			s.lines <- sc.Text()
		}
		close(s.lines)
	}()
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
		if t.Failed() {
			t.Logf("%s stderr: %s", name, stderr.String())
		}
	})
	return s
}

// until reads lines until one satisfies f, returning those before it.
func (s *streamer) until(t *testing.T, f func(string) bool) []string {
	t.Helper()
	var got []string
	timeout := time.After(30 * time.Second)
	for {
		select {
		case l, ok := <-s.lines:
			if !ok {
				t.Fatalf("%s exited after %q", s.name, got)
			}
			if f(l) {
				return got
			}
			got = append(got, l)
		case <-timeout:
			t.Fatalf("%s: no expected line after %q", s.name, got)
		}
	}
}

// An undeclared local user must not see egress decisions (host, path,
// rule, sizes) that only viewers may read with ReadAudit: neither through
// `cagectl events`, nor with eavesdropping match rules, nor with the real
// dbus-monitor. A viewer sees them all, an operator scoped to one agent
// only that agent's. Run against the real dbus-daemon with the policy file
// exactly as rendered, and real uids resolved by the host's user database.
func TestAuditSignalsReachOnlyAuthorizedSubscribers(t *testing.T) {
	testenv.RequirePrivileged(t)
	cfg, diags := config.NewLoader().Load(config.Source{Name: "t.hcl", Data: []byte(`
agent "alpha" {
  backend = "service"
  command = ["/bin/true"]
}
agent "beta-2" {
  backend = "service"
  command = ["/bin/true"]
}
account "watchers" {
  group = "nogroup"
  role  = "viewer"
}
account "ops-alpha" {
  user   = "33"
  role   = "operator"
  agents = ["alpha"]
}
`)})
	if diags.HasErrors() {
		t.Fatal(diags.Error())
	}
	files, err := render.Render(cfg, render.DefaultOptions())
	if err != nil {
		t.Fatal(err)
	}
	polDir := t.TempDir()
	var policy string
	for _, f := range files {
		if strings.HasPrefix(f.Path, "dbus-1/system.d/") {
			policy = polDir + "/nixcage.conf"
			if err := os.WriteFile(policy, f.Data, 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	b := bustest.Start(t, bustest.Options{Include: []string{policy}})
	be := &fakeBackend{accounts: cfg.Accounts}
	for _, a := range cfg.Agents {
		be.agents = append(be.agents, bus.AgentStatus{Name: a.Name, Backend: "service", Unit: paths.Instance(paths.AgentTemplate, a.Name)})
	}
	srv := bus.NewServer(b.Conn(t), be, bus.ServerOptions{Users: bus.SystemUsers{}})
	if err := srv.Export(bus.ManagerProps{Version: "test"}); err != nil {
		t.Fatal(err)
	}
	bin := helperBinary(t, b.Dir)
	monitor := testenv.LookPath(t, "dbus-monitor")

	watchers := map[string]*streamer{
		"viewer (group nogroup)":     startStreamer(t, "viewer", uidViewer, bin, "-test.run=^$", b.Address, "watch"),
		"operator of alpha (uid 33)": startStreamer(t, "operator", uidOperator, bin, "-test.run=^$", b.Address, "watch"),
		"stranger":                   startStreamer(t, "stranger", uidStranger, bin, "-test.run=^$", b.Address, "watch"),
	}
	eaves := startStreamer(t, "eavesdropper", uidStranger, bin, "-test.run=^$", b.Address, "eavesdrop")
	mon := startStreamer(t, "dbus-monitor", uidStranger, monitor, "--address", b.Address)
	for _, s := range watchers {
		s.until(t, func(l string) bool { return l == "ready" })
	}
	if pre := eaves.until(t, func(l string) bool { return l == "ready" }); !slices.Contains(pre, "become-monitor: org.freedesktop.DBus.Error.AccessDenied") {
		t.Errorf("an undeclared user may become a monitor: %q", pre)
	}
	// dbus-monitor falls back to eavesdropping match rules once
	// BecomeMonitor is refused; broadcast until it shows it listens.
	for synced := false; !synced; {
		srv.Emit(bus.SignalReconciled, "sync")
		select {
		case l, ok := <-mon.lines:
			if !ok {
				t.Fatal("dbus-monitor exited")
			}
			synced = strings.Contains(l, "member=Reconciled")
		case <-time.After(100 * time.Millisecond):
		}
	}

	// The agents misbehave; caged reports it.
	srv.Emit(bus.SignalEgressDecision, "alpha", "blocked", "evil.example", "host not allowed", `{"host":"evil.example","path":"/upload"}`)
	srv.Emit(bus.SignalEgressDecision, "beta-2", "flagged", "api.example.com", "high entropy body", `{"host":"api.example.com"}`)
	srv.Emit(bus.SignalAgentKilled, "alpha", "root (uid 0)")
	srv.Emit(bus.SignalAgentStateChanged, "alpha", "failed", "failed")
	// A throw-away cage's summary names the hosts it was refused.
	srv.Emit(bus.SignalRunFinished, "run-7", int32(1), `{"name":"run-7","blocked_hosts":["evil.example"]}`)
	// The chat relay reports what it did on beta-2.
	srv.Emit(bus.SignalRelayAction, "beta-2", "telegram:1 (@x)", "stop", "ok", "stop done", "cage-relay (uid 990)")
	srv.Emit(bus.SignalReconciled, endMarker)

	want := map[string][]string{
		"viewer (group nogroup)":     {"EgressDecision alpha", "EgressDecision beta-2", "AgentKilled alpha", "AgentStateChanged alpha", "RunFinished run-7", "RelayAction beta-2"},
		"operator of alpha (uid 33)": {"EgressDecision alpha", "AgentKilled alpha", "AgentStateChanged alpha"},
		"stranger":                   {"AgentStateChanged alpha"},
	}
	for who, s := range watchers {
		got := s.until(t, func(l string) bool { return l == "end" })
		// Public signals (state) may also include the sync broadcasts.
		got = slices.DeleteFunc(got, func(l string) bool { return l == "Reconciled " })
		if !slices.Equal(got, want[who]) {
			t.Errorf("%s received %q, want %q", who, got, want[who])
		}
	}
	if got := eaves.until(t, func(l string) bool { return l == "end" }); slices.ContainsFunc(got, isAuditLine) {
		t.Errorf("an eavesdropping stranger received audit signals: %q", got)
	}
	seen := mon.until(t, func(l string) bool { return strings.Contains(l, endMarker) })
	for _, l := range seen {
		if strings.Contains(l, "evil.example") || strings.Contains(l, "member=EgressDecision") || strings.Contains(l, "member=AgentKilled") || strings.Contains(l, "member=RunFinished") || strings.Contains(l, "member=RelayAction") {
			t.Fatalf("dbus-monitor as a stranger printed audit data: %q", seen)
		}
	}
}

func isAuditLine(l string) bool {
	member, _, _ := strings.Cut(l, " ")
	return slices.Contains(paths.BusAuditSignals, member)
}
