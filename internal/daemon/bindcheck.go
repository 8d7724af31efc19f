package daemon

import (
	"errors"
	"fmt"
	"os"
	"time"

	sysunix "golang.org/x/sys/unix"

	"github.com/nixcage/nixcage/internal/config"
	"github.com/nixcage/nixcage/internal/paths"
)

// The check that a throw-away cage got the directories its caller opened
// (docs/run.md, "Binds are descriptors too"). It looks at the cage's main
// process through /proc/PID/root, which races the process's exit: a
// command that ends quickly may be exiting, a zombie or reaped by the time
// caged looks (found by a red team: TestRunOnSystemd failed once in three
// runs with "cannot check what the cage sees ... no such file or
// directory"). A process that has exited sees nothing any more, so a look
// that fails because it is gone is not an error; one that fails while it
// lives still is, and a directory seen to differ always is.
//
// The look holds the process's mount namespace (/proc/PID/ns/mnt) while
// it looks: a mount namespace whose last process exits has its mounts
// detached (exit_task_namespaces), and a look that got the root a moment
// before then found the mount point under the bind, a directory that
// differs (seen in CI's TestRunOnSystemd: "is no longer the directory that
// was opened" for a `cat` that had already printed the bound file). Held,
// the namespace keeps its mounts until caged lets go, so what the look
// sees is what the cage had, dying or not. (Forgiving a difference seen
// as the process "died" instead let a cage whose main thread exits alone
// during the look, its other threads living on, keep a replaced directory:
// TestCheckBindsThreadedLeaderExitsDuringTheLook.)

// errReplaced: the cage sees another directory than the one opened.
var errReplaced = errors.New("it was replaced")

// pinnedProcess is a process held by a pidfd: whether it has exited is
// asked of the pidfd, which refers to this process alone (a PID reused
// after it is reaped is another process), and answers for a zombie, a
// process mid-exit whose /proc entries are half gone, and a reaped one.
type pinnedProcess struct {
	pid int
	fd  int
}

func pinProcess(pid int) (*pinnedProcess, error) {
	fd, err := sysunix.PidfdOpen(pid, 0)
	if err != nil {
		return nil, fmt.Errorf("pidfd_open: %w", err)
	}
	return &pinnedProcess{pid: pid, fd: fd}, nil
}

func (p *pinnedProcess) Close() error { return sysunix.Close(p.fd) }

// exitGrace is how long a look that failed waits for the process to
// finish exiting. The kernel drops a task's root (exit_fs) before the
// pidfd reports the exit (exit_notify), so a look can fail in that window
// while the pidfd still says "alive" (seen in CI's TestRunOnSystemd:
// "stat /proc/PID/root/workspace: no such file or directory" for a `cat`
// that had already printed). A process that really lives with the bind
// missing is still refused, one grace period later.
const exitGrace = time.Second

// exited: a pidfd polls readable once its process has terminated; it
// waits up to wait for that.
func (p *pinnedProcess) exited(wait time.Duration) bool {
	fds := []sysunix.PollFd{{Fd: int32(p.fd), Events: sysunix.POLLIN}}
	for {
		n, err := sysunix.Poll(fds, int(wait.Milliseconds()))
		if errors.Is(err, sysunix.EINTR) {
			continue
		}
		return err == nil && n > 0 && fds[0].Revents&(sysunix.POLLIN|sysunix.POLLHUP) != 0
	}
}

// checkBindsOf compares each bind with what p sees where the cage's
// backend makes it. unverifiable is told of a bind caged may not look at
// (a cage running as another user: caged has no CAP_SYS_PTRACE).
func checkBindsOf(p *pinnedProcess, binds []verifiedBind, backend string, unverifiable func(verifiedBind, error)) error {
	for i, b := range binds {
		at := b.Dest
		if backend == config.BackendNspawn {
			// Where systemd staged it in the unit's namespace and nspawn
			// binds it from (render's hostBinds): the binds are rendered
			// in this order.
			at = paths.RunBindStaged(i)
		}
		err := p.sees(b, at)
		switch {
		case err == nil:
		case errors.Is(err, errReplaced):
			return err // seen, and wrong: whether it has exited since or not
		case p.exited(exitGrace):
			return nil // gone: nothing left to look at, or to see
		case errors.Is(err, os.ErrPermission):
			unverifiable(b, err)
		default:
			return err
		}
	}
	return nil
}

// beforeLook runs between taking the process's namespace and root and
// looking inside; tests make the process die there, which no timing can
// do reliably.
var beforeLook = func() {}

// sees checks that the process sees the directory the caller opened at
// path at (absolute, in its root). Its mount namespace is held first: a
// process that has it still has its root in it (a cage cannot setns), and
// the namespace then keeps its mounts however the process ends.
func (p *pinnedProcess) sees(b verifiedBind, at string) error {
	ns, err := p.open(b, "ns/mnt", sysunix.O_RDONLY)
	if err != nil {
		return err
	}
	defer sysunix.Close(ns)
	root, err := p.open(b, "root", sysunix.O_PATH|sysunix.O_DIRECTORY)
	if err != nil {
		return err
	}
	defer sysunix.Close(root)
	beforeLook()
	var st sysunix.Stat_t
	if err := sysunix.Fstatat(root, "."+at, &st, 0); err != nil {
		return fmt.Errorf("cannot check what the cage sees at %s: %w", b.Source, &os.PathError{Op: "stat", Path: fmt.Sprintf("/proc/%d/root%s", p.pid, at), Err: err})
	}
	if st.Dev != b.dev || st.Ino != b.ino {
		return fmt.Errorf("%s is no longer the directory that was opened (%w); refusing to bind it", b.Source, errReplaced)
	}
	return nil
}

// open opens /proc/PID/link of the process, for looking at b.
func (p *pinnedProcess) open(b verifiedBind, link string, flags int) (int, error) {
	path := fmt.Sprintf("/proc/%d/%s", p.pid, link)
	fd, err := sysunix.Open(path, flags|sysunix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("cannot check what the cage sees at %s: %w", b.Source, &os.PathError{Op: "open", Path: path, Err: err})
	}
	return fd, nil
}
