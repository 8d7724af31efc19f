package bus

import (
	"context"
	"os"
	"strconv"
	"strings"

	"github.com/godbus/dbus/v5"
)

// Shells in running cages (cagectl shell): an admin's debugging shell with
// the agent's view and walls. The caller's terminal (or pipes) crosses the
// bus as descriptors, as for cagectl run; caged starts the shell as a
// transient unit of its own and reports its end.

// Signals about shells. Both are scoped like the audit signals: addressed
// to subscribers allowed to view the agent, never broadcast.
const (
	SignalShellOpened = "ShellOpened" // (s agent, s by, s command, s unit)
	SignalShellClosed = "ShellClosed" // (s agent, s by, i exit_status, s unit)
)

// ShellRequest is what to run in which cage. Wire order: (sasbs).
type ShellRequest struct {
	Agent   string   `json:"agent"`
	Command []string `json:"command"` // empty: /bin/sh
	TTY     bool     `json:"tty"`     // the descriptors are a terminal
	Term    string   `json:"term"`    // TERM inside, with TTY
}

// ShellBackend is what caged implements for shells. The server has
// authorized the caller (admin, agent in scope); the backend owns the
// descriptors.
type ShellBackend interface {
	OpenShell(ctx context.Context, req ShellRequest, stdio [3]dbus.UnixFD, caller Identity, sender string) (unit string, err error)
}

// OpenShell starts a shell in a running cage attached to the caller's
// descriptors and returns the unit it runs as; ShellClosed tells when it
// ended and with which status. The shell also ends when the caller leaves
// the bus or the agent stops.
func (m *manager) OpenShell(sender dbus.Sender, req ShellRequest, stdin, stdout, stderr dbus.UnixFD) (string, *dbus.Error) {
	stdio := [3]dbus.UnixFD{stdin, stdout, stderr}
	sb, ok := m.s.be.(ShellBackend)
	if !ok {
		closeFDs(stdio, nil, nil)
		return "", newError(ErrorFailed, "this caged opens no shells")
	}
	id, derr := m.s.authorizeAgent(sender, ActShell, req.Agent, "OpenShell")
	if derr != nil {
		closeFDs(stdio, nil, nil)
		return "", derr
	}
	unit, err := sb.OpenShell(context.Background(), req, stdio, id, string(sender))
	if err != nil {
		return "", fail(err)
	}
	return unit, nil
}

// ShellEnd is a shell's end as ShellClosed reports it.
type ShellEnd struct {
	Agent, By, Unit string
	Exit            int32
}

// OpenShell asks caged for a shell in agent's cage on stdio. caged receives
// duplicates; the caller keeps and closes its own.
func (c *Client) OpenShell(ctx context.Context, req ShellRequest, stdio [3]*os.File) (string, error) {
	var unit string
	if req.Command == nil {
		req.Command = []string{}
	}
	err := c.call(ctx, "OpenShell", []any{&unit}, req, FD(stdio[0]), FD(stdio[1]), FD(stdio[2]))
	return unit, err
}

// WatchShells delivers the end of every shell from now on, until ctx ends.
// Subscribe before OpenShell, so a quick shell is not missed.
func (c *Client) WatchShells(ctx context.Context) (<-chan ShellEnd, error) {
	events, err := c.Events(ctx)
	if err != nil {
		return nil, err
	}
	out := make(chan ShellEnd, 16)
	go func() {
		defer close(out)
		for ev := range events {
			if ev.Kind != SignalShellClosed {
				continue
			}
			code, _ := strconv.ParseInt(ev.Data["exit_status"], 10, 32)
			select {
			case out <- ShellEnd{Agent: ev.Agent, By: ev.Data["by"], Unit: ev.Data["unit"], Exit: int32(code)}:
			case <-ctx.Done():
				return
			}
		}
	}()
	return out, nil
}

// FormatCommand is argv as one line a shell would read back the same:
// what the audit records of a shell's command.
func FormatCommand(argv []string) string {
	out := make([]string, len(argv))
	for i, a := range argv {
		if a != "" && strings.IndexFunc(a, func(r rune) bool {
			return !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || strings.ContainsRune("-_./=:,+@%", r))
		}) < 0 {
			out[i] = a
			continue
		}
		out[i] = "'" + strings.ReplaceAll(a, "'", `'\''`) + "'"
	}
	return strings.Join(out, " ")
}
