package bus

import (
	"context"
	"os"
	"time"

	"github.com/godbus/dbus/v5"
)

// Consoles of interactive agents (interactive = true): caged holds the
// master of each one's terminal; AttachConsole hands the caller one end of
// a socket caged copies to and from it (what the agent printed while
// nobody was attached comes first), so the terminal never crosses into the
// caller's hands and the agent never notices who is attached.

// ConsoleBackend is what caged implements for consoles. The server has
// authorized the caller (operator, agent in scope) before calling.
type ConsoleBackend interface {
	AttachConsole(ctx context.Context, agent, by string) (*os.File, error)
	ResizeConsole(ctx context.Context, agent string, rows, cols uint16) error
}

// AttachConsole connects the caller to an interactive agent's terminal.
// One caller at a time: a new attach takes the terminal over.
func (m *manager) AttachConsole(sender dbus.Sender, name string) (dbus.UnixFD, *dbus.Error) {
	cb, ok := m.s.be.(ConsoleBackend)
	if !ok {
		return 0, newError(ErrorFailed, "this caged holds no consoles")
	}
	id, derr := m.s.authorizeAgent(sender, ActOperate, name, "AttachConsole")
	if derr != nil {
		return 0, derr
	}
	f, err := cb.AttachConsole(context.Background(), name, id.String())
	if err != nil {
		return 0, fail(err)
	}
	// godbus sends the descriptor with the reply and does not close it;
	// keep it open until the reply is surely out, then close caged's copy.
	go holdUntilSent(f)
	return dbus.UnixFD(f.Fd()), nil
}

// ResizeConsole sets an interactive agent's terminal size (the attached
// terminal's, on SIGWINCH).
func (m *manager) ResizeConsole(sender dbus.Sender, name string, rows, cols uint16) *dbus.Error {
	cb, ok := m.s.be.(ConsoleBackend)
	if !ok {
		return newError(ErrorFailed, "this caged holds no consoles")
	}
	if _, derr := m.s.authorizeAgent(sender, ActOperate, name, "ResizeConsole"); derr != nil {
		return derr
	}
	return fail(cb.ResizeConsole(context.Background(), name, rows, cols))
}

// AttachConsole returns the caller's end of an interactive agent's console.
func (c *Client) AttachConsole(ctx context.Context, agent string) (*os.File, error) {
	var fd dbus.UnixFD
	if err := c.call(ctx, "AttachConsole", []any{&fd}, agent); err != nil {
		return nil, err
	}
	return os.NewFile(uintptr(fd), "console "+agent), nil
}

// ResizeConsole sets an interactive agent's terminal size.
func (c *Client) ResizeConsole(ctx context.Context, agent string, rows, cols uint16) error {
	return c.call(ctx, "ResizeConsole", nil, agent, rows, cols)
}

// holdUntilSent closes caged's copy of a descriptor handed out in a reply.
// godbus writes the reply (and passes the descriptor) right after the
// method returns, on the same goroutine; ten seconds is ample.
func holdUntilSent(f *os.File) {
	time.Sleep(10 * time.Second)
	f.Close()
}
