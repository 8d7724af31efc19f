package daemon

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"syscall"

	"github.com/nixcage/nixcage/internal/bus"
	"github.com/nixcage/nixcage/internal/paths"
	"github.com/nixcage/nixcage/internal/term"
)

var _ bus.ConsoleBackend = (*Daemon)(nil)

// console is the terminal caged holds for an interactive agent. caged
// keeps the master and a slave open for as long as it runs, so the
// terminal outlives restarts of the agent (systemd reopens it through
// paths.ConsoleLink at each start) and never hangs up under it.
type console struct {
	agent         string
	master, slave *os.File

	mu       sync.Mutex
	backlog  []byte   // the newest output, replayed to whoever attaches
	attached *os.File // caged's end of the attached caller's socket
}

// backlogSize is how much recent output an attach replays.
const backlogSize = 64 << 10

// ensureConsoles gives every interactive agent of the config a terminal.
func (d *Daemon) ensureConsoles() {
	for _, a := range d.config().Agents {
		if a.Interactive {
			if err := d.ensureConsole(a.Name); err != nil {
				d.log.Error("console of an interactive agent", "agent", a.Name, "err", err)
			}
		}
	}
}

func (d *Daemon) ensureConsole(agent string) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.consoles == nil {
		d.consoles = map[string]*console{}
	}
	if _, ok := d.consoles[agent]; ok {
		return nil
	}
	master, slave, err := term.OpenPTY()
	if err != nil {
		return fmt.Errorf("console %s: %w", agent, err)
	}
	term.SetSize(master, 24, 80)
	link := d.qdirs.Host(paths.ConsoleLink(agent))
	fail := func(err error) error {
		master.Close()
		slave.Close()
		return fmt.Errorf("console %s: %w", agent, err)
	}
	if err := mkdirReadable(filepath.Dir(link)); err != nil {
		return fail(err)
	}
	tmp := link + ".new"
	os.Remove(tmp)
	if err := os.Symlink(slave.Name(), tmp); err != nil {
		return fail(err)
	}
	if err := os.Rename(tmp, link); err != nil {
		return fail(err)
	}
	c := &console{agent: agent, master: master, slave: slave}
	d.consoles[agent] = c
	go c.pump()
	return nil
}

// pump reads everything the agent writes: into the backlog, and to the
// attached caller if there is one. It never stops reading, so an agent
// nobody watches never blocks on a full terminal.
func (c *console) pump() {
	buf := make([]byte, 32<<10)
	for {
		n, err := c.master.Read(buf)
		if n > 0 {
			c.mu.Lock()
			c.backlog = append(c.backlog, buf[:n]...)
			if len(c.backlog) > backlogSize {
				c.backlog = append([]byte(nil), c.backlog[len(c.backlog)-backlogSize:]...)
			}
			if c.attached != nil {
				if _, werr := c.attached.Write(buf[:n]); werr != nil {
					c.attached.Close()
					c.attached = nil
				}
			}
			c.mu.Unlock()
		}
		// EIO needs every slave closed, and caged holds one.
		if err != nil && (errors.Is(err, os.ErrClosed) || errors.Is(err, syscall.EIO)) {
			return
		}
	}
}

// AttachConsole implements bus.ConsoleBackend.
func (d *Daemon) AttachConsole(ctx context.Context, agent, by string) (*os.File, error) {
	a := d.config().Agent(agent)
	if a == nil || !a.Interactive {
		return nil, fmt.Errorf("%w: %s is not an interactive agent (declare interactive = true)", bus.ErrInvalid, agent)
	}
	if err := d.ensureConsole(agent); err != nil {
		return nil, err
	}
	d.mu.RLock()
	c := d.consoles[agent]
	d.mu.RUnlock()
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM|syscall.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("console %s: %w", agent, err)
	}
	mine, theirs := os.NewFile(uintptr(fds[0]), "console"), os.NewFile(uintptr(fds[1]), "console")
	c.mu.Lock()
	if c.attached != nil {
		c.attached.Close() // a new attach takes the terminal over
	}
	mine.Write(c.backlog)
	c.attached = mine
	c.mu.Unlock()
	d.log.Info("console attached", "agent", agent, "by", by)
	go c.feed(mine, func() { d.log.Info("console detached", "agent", agent, "by", by) })
	return theirs, nil
}

// feed copies what the attached caller types to the agent's terminal
// until the caller detaches (closes its end).
func (c *console) feed(from *os.File, detached func()) {
	buf := make([]byte, 4096)
	for {
		n, err := from.Read(buf)
		if n > 0 {
			c.master.Write(buf[:n])
		}
		if err != nil {
			break
		}
	}
	c.mu.Lock()
	if c.attached == from {
		c.attached = nil
	}
	c.mu.Unlock()
	from.Close()
	detached()
}

// ResizeConsole implements bus.ConsoleBackend.
func (d *Daemon) ResizeConsole(ctx context.Context, agent string, rows, cols uint16) error {
	d.mu.RLock()
	c := d.consoles[agent]
	d.mu.RUnlock()
	if c == nil {
		return fmt.Errorf("%w: %s has no console", bus.ErrInvalid, agent)
	}
	return term.SetSize(c.master, rows, cols)
}
