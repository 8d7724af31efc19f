// Package daemontest runs a real caged in-process against a fake systemd on
// a private dbus-daemon, with every host path under a temporary root, so
// tests of caged and cagectl exercise the whole stack without root or a
// booted systemd.
package daemontest

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/nixcage/nixcage/internal/bus"
	"github.com/nixcage/nixcage/internal/bus/bustest"
	"github.com/nixcage/nixcage/internal/daemon"
	"github.com/nixcage/nixcage/internal/paths"
	"github.com/nixcage/nixcage/internal/policy"
	"github.com/nixcage/nixcage/internal/reconcile"
	"github.com/nixcage/nixcage/internal/reconcile/fakesd"
)

// PollInterval is how often the test daemon reads audit logs: short, so
// tests see egress events quickly. Benchmarks set caged's production value.
var PollInterval = 20 * time.Millisecond

// Caged is a running test daemon.
type Caged struct {
	t      testing.TB
	Root   string
	Config string // path of the config file (under Root)
	Bus    *bustest.Bus
	SD     *fakesd.Systemd
	Users  bus.UserDB
	// Contained, if set, is called when a quarantined agent is down and
	// cut off, before its evidence is copied (daemon.Options.Contained).
	Contained func(agent string)
	cancel    context.CancelFunc
	done      chan error
}

// Start writes cfg (HCL) to a file and starts caged in render mode.
func Start(t testing.TB, cfg string) *Caged {
	t.Helper()
	root := t.TempDir()
	sd, _, b := fakesd.Start(t, root)
	c := &Caged{t: t, Root: root, Bus: b, SD: sd, Config: filepath.Join(root, "etc/nixcage/nixcage.hcl")}
	if err := os.MkdirAll(filepath.Dir(c.Config), 0o755); err != nil {
		t.Fatal(err)
	}
	c.WriteConfig(cfg)
	c.Restart()
	t.Cleanup(c.Stop)
	return c
}

// WriteConfig replaces the config file (caged reads it on Reload).
func (c *Caged) WriteConfig(cfg string) {
	if err := os.WriteFile(c.Config, []byte(cfg+callerAccount()), 0o644); err != nil {
		c.t.Fatal(err)
	}
}

// Restart stops caged if it runs and starts a new instance.
func (c *Caged) Restart() {
	c.t.Helper()
	c.Stop()
	ctx, cancel := context.WithCancel(context.Background())
	ready := make(chan struct{})
	c.cancel, c.done = cancel, make(chan error, 1)
	lg := slog.New(slog.NewTextHandler(io.Discard, nil))
	if testing.Verbose() {
		lg = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	o := daemon.Options{
		Config: c.Config, Units: reconcile.ModeRender, Bus: c.Bus.Address, Systemd: c.Bus.Address,
		Root: c.Root, BinDir: "/usr/local/bin", Users: c.Users, PollInterval: PollInterval,
		Ready: func() { close(ready) }, Log: lg,
		Contained: func(agent string) {
			if c.Contained != nil {
				c.Contained(agent)
			}
		},
	}
	go func() { c.done <- daemon.Serve(ctx, o) }()
	select {
	case <-ready:
	case err := <-c.done:
		c.cancel = nil
		c.t.Fatalf("caged exited: %v", err)
	case <-time.After(30 * time.Second):
		c.t.Fatal("caged did not become ready")
	}
}

// Stop stops caged and waits for it.
func (c *Caged) Stop() {
	if c.cancel == nil {
		return
	}
	c.cancel()
	if err := <-c.done; err != nil {
		c.t.Errorf("caged: %v", err)
	}
	c.cancel = nil
}

// Client connects a typed client.
func (c *Caged) Client() *bus.Client {
	c.t.Helper()
	cl, err := bus.Dial(context.Background(), c.Bus.Address)
	if err != nil {
		c.t.Fatal(err)
	}
	c.t.Cleanup(func() { cl.Close() })
	return cl
}

// CallerUID is the uid the tests' clients call caged as (this process's).
func CallerUID() int { return os.Geteuid() }

// callerAccount makes a non-root test process caged's admin, so the tests
// run unprivileged: as root the caller is admin implicitly (uid 0), as
// another user it is declared one. Appended to every config the tests
// write; empty as root, so root runs test the configs exactly as written.
func callerAccount() string {
	if CallerUID() == 0 {
		return ""
	}
	return fmt.Sprintf(`
# daemontest: the test process (not root) is declared admin.
account "daemontest-caller" {
  user = "%d"
  role = "admin"
}
`, CallerUID())
}

// Path maps a host path under the test root.
func (c *Caged) Path(p string) string { return filepath.Join(c.Root, p) }

// Pend writes p as the agent's gateway does (policy.WriteFileAtomic of a
// policy.Pending into its pending directory) and returns the directories
// the gateway reads the decision from (policy.LoadDecision).
func (c *Caged) Pend(p policy.Pending) *policy.Approval {
	c.t.Helper()
	ap := &policy.Approval{PendingDir: c.Path(paths.ApprovalPendingDir(p.Agent)), DecisionsDir: c.Path(paths.ApprovalDecisionsDir(p.Agent))}
	if err := os.MkdirAll(ap.PendingDir, 0o700); err != nil {
		c.t.Fatal(err)
	}
	b, err := policy.MarshalDoc(&p)
	if err == nil {
		err = policy.WriteFileAtomic(ap.PendingFile(p.ID), b)
	}
	if err != nil {
		c.t.Fatal(err)
	}
	return ap
}
