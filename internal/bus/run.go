package bus

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"strings"

	"github.com/godbus/dbus/v5"
)

// Throw-away cages (cagectl run). The caller's terminal and every directory
// or secret it names cross the bus as file descriptors the caller opened
// itself: caged's own sandbox (ProtectHome=, PrivateTmp=) and its root
// privileges never decide what a user may hand to a cage.

// Signals about throw-away cages.
const (
	SignalRunStarted  = "RunStarted"  // (s name, s backend, s by)
	SignalRunFinished = "RunFinished" // (s name, i exit_status, s summary) summary is RunSummary as JSON
)

// MaxRunFDs bounds the descriptors of one StartRun: the system bus refuses
// messages with more than 16 (dbus-daemon's max_message_unix_fds), and three
// are the terminal.
const MaxRunFDs = 16

// RunRequest is what a throw-away cage runs and under which policy. Wire
// order: (sssasasbsbx).
type RunRequest struct {
	Name    string   `json:"name"`    // "" lets caged generate one
	Backend string   `json:"backend"` // "service" or "nspawn"
	Policy  string   `json:"policy"`  // a named policy (declared or shipped); "" with no Allow means "none"
	Allow   []string `json:"allow"`   // hosts of an inline policy, instead of Policy
	Command []string `json:"command"`
	TTY     bool     `json:"tty"`  // the descriptors are a terminal
	Term    string   `json:"term"` // TERM inside the cage, with TTY
	// Learn runs the cage in learn mode (docs/grants.md) for LearnSeconds
	// (0: the default window).
	Learn        bool  `json:"learn"`
	LearnSeconds int64 `json:"learn_seconds"`
}

// RunBind is a directory the caller opened, to be mounted at Dest.
// (hsb)
type RunBind struct {
	FD       dbus.UnixFD
	Dest     string
	ReadOnly bool
}

// RunSecret is a secret file the caller opened; the cage sees a placeholder
// in Env, the gateway injects the value for the hosts the policy binds Name
// to. (ssh)
type RunSecret struct {
	Name string
	Env  string
	FD   dbus.UnixFD
}

// RunSummary is what a run did, as caged reports it when it ends.
type RunSummary struct {
	Name         string   `json:"name"`
	Exit         int32    `json:"exit"`   // the command's exit status (128+N for signal N)
	Result       string   `json:"result"` // systemd's Result= of the cage, "success", "exit-code", "signal", ...
	Allowed      uint64   `json:"allowed"`
	Flagged      uint64   `json:"flagged"`
	Blocked      uint64   `json:"blocked"`
	BlockedHosts []string `json:"blocked_hosts"`
	Audit        string   `json:"audit"` // the audit log, kept after teardown
	Error        string   `json:"error,omitempty"`
}

// RunBackend is what caged implements for throw-away cages. The server
// authorizes before calling; it passes ownership of the descriptors (the
// backend closes them).
type RunBackend interface {
	StartRun(ctx context.Context, req RunRequest, stdio [3]dbus.UnixFD, binds []RunBind, secrets []RunSecret, caller Identity, sender string) (string, error)
	SignalRun(ctx context.Context, name string, signal int32, caller Identity) error
}

// FD is f as a D-Bus descriptor argument (f stays the caller's to close).
func FD(f *os.File) dbus.UnixFD { return dbus.UnixFD(f.Fd()) }

func closeFDs(stdio [3]dbus.UnixFD, binds []RunBind, secrets []RunSecret) {
	for _, fd := range stdio {
		closeFD(fd)
	}
	for _, b := range binds {
		closeFD(b.FD)
	}
	for _, s := range secrets {
		closeFD(s.FD)
	}
}

func closeFD(fd dbus.UnixFD) {
	if fd >= 0 {
		os.NewFile(uintptr(fd), "").Close()
	}
}

// StartRun starts a throw-away cage attached to the caller's descriptors
// and returns its name. It returns once the command runs; RunFinished tells
// when it ended and how. A run also ends when the caller leaves the bus.
func (m *manager) StartRun(sender dbus.Sender, req RunRequest, stdin, stdout, stderr dbus.UnixFD, binds []RunBind, secrets []RunSecret) (string, *dbus.Error) {
	stdio := [3]dbus.UnixFD{stdin, stdout, stderr}
	rb, ok := m.s.be.(RunBackend)
	if !ok {
		closeFDs(stdio, binds, secrets)
		return "", newError(ErrorFailed, "this caged does not run throw-away cages")
	}
	id, derr := m.s.authorize(sender, ActRun, "StartRun")
	if derr != nil {
		closeFDs(stdio, binds, secrets)
		return "", derr
	}
	name, err := rb.StartRun(context.Background(), req, stdio, binds, secrets, id, string(sender))
	if err != nil {
		return "", fail(err)
	}
	return name, nil
}

// SignalRun sends a signal to a run's command (its owner's Ctrl-C when
// there is no terminal). The run's owner, root and operators may.
func (m *manager) SignalRun(sender dbus.Sender, name string, signal int32) *dbus.Error {
	rb, ok := m.s.be.(RunBackend)
	if !ok {
		return newError(ErrorFailed, "this caged does not run throw-away cages")
	}
	id, err := m.s.caller(sender)
	if err != nil {
		return newError(ErrorAccessDenied, "%v", err)
	}
	return fail(rb.SignalRun(context.Background(), name, signal, id))
}

// StartRun asks caged for a throw-away cage. stdio are the terminal (or
// pipes) the command gets; binds and secrets are descriptors this process
// opened. caged receives duplicates; the caller keeps and closes its own.
func (c *Client) StartRun(ctx context.Context, req RunRequest, stdio [3]*os.File, binds []RunBind, secrets []RunSecret) (string, error) {
	var name string
	fd := FD
	if req.Allow == nil {
		req.Allow = []string{}
	}
	if binds == nil {
		binds = []RunBind{}
	}
	if secrets == nil {
		secrets = []RunSecret{}
	}
	err := c.call(ctx, "StartRun", []any{&name}, req, fd(stdio[0]), fd(stdio[1]), fd(stdio[2]), binds, secrets)
	return name, err
}

// SignalRun sends signal to a run's command.
func (c *Client) SignalRun(ctx context.Context, name string, signal int32) error {
	return c.call(ctx, "SignalRun", nil, name, signal)
}

// WatchRuns delivers the summary of every run that finishes from now on,
// until ctx ends. Subscribe before StartRun, so a quick run is not missed.
func (c *Client) WatchRuns(ctx context.Context) (<-chan RunSummary, error) {
	events, err := c.Events(ctx)
	if err != nil {
		return nil, err
	}
	out := make(chan RunSummary, 16)
	go func() {
		defer close(out)
		for ev := range events {
			var sum RunSummary
			if ev.Kind != SignalRunFinished || json.Unmarshal([]byte(ev.Data["summary"]), &sum) != nil {
				continue
			}
			select {
			case out <- sum:
			case <-ctx.Done():
				return
			}
		}
	}()
	return out, nil
}

// Owner is the unique bus name that owns caged's name now ("" if none):
// a run's caller compares it over time to notice caged restarting.
func (c *Client) Owner(ctx context.Context) string {
	var owner string
	if err := c.conn.BusObject().CallWithContext(ctx, "org.freedesktop.DBus.GetNameOwner", 0, Name).Store(&owner); err != nil {
		return ""
	}
	return owner
}

// Connected reports whether the connection to the bus is still up.
func (c *Client) Connected() bool { return c.conn.Connected() }

// FormatSummary is the short report cagectl prints when a run ends.
func FormatSummary(s RunSummary) string {
	var b strings.Builder
	fmt.Fprintf(&b, "cagectl: cage %s exited with status %d; egress: %d allowed, %d flagged, %d blocked", s.Name, s.Exit, s.Allowed, s.Flagged, s.Blocked)
	if len(s.BlockedHosts) > 0 {
		fmt.Fprintf(&b, " (blocked: %s)", strings.Join(s.BlockedHosts, ", "))
	}
	fmt.Fprintf(&b, "\ncagectl: audit kept in %s; everything else is being torn down", s.Audit)
	if s.Error != "" {
		fmt.Fprintf(&b, "\ncagectl: %s", s.Error)
	}
	return b.String()
}
