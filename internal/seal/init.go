package seal

import (
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// forwarded are the signals cage-seal's init passes on to the agent.
// nspawn (--kill-signal=SIGTERM) turns the unit's stop into a SIGTERM to
// the cage's PID 1; signals from a terminal reach the agent's process
// group directly when it is the terminal's foreground group.
var forwarded = []os.Signal{unix.SIGTERM, unix.SIGINT, unix.SIGHUP, unix.SIGQUIT, unix.SIGUSR1, unix.SIGUSR2, unix.SIGWINCH}

// dropped are the signals Go's runtime turns into a crash of the process
// (exit 2, a goroutine dump) when another process sends them; they are
// caught and dropped, never passed on. The agent runs as the cage's uid,
// the init's own, so it may signal its PID 1, and the kernel spares a
// namespace's init only the signals it has no handler for: with these, the
// agent ended PID 1 at will and the cage's status was 2, not its own (red
// team). A real fault of the init's own still crashes it (the runtime
// tells one from a kill by its si_code).
var dropped = []os.Signal{unix.SIGABRT, unix.SIGSYS, unix.SIGTRAP, unix.SIGILL, unix.SIGSEGV, unix.SIGBUS, unix.SIGFPE, unix.SIGSTKFLT}

// StopGrace is how long the init waits for the agent after passing on a
// SIGTERM or SIGINT before it ends the cage itself: the kernel then kills
// every process left in the PID namespace. A stop stays as bounded as with
// nspawn's own stub init, which ended the cage at once, while an agent that
// handles SIGTERM gets to finish.
const StopGrace = 5 * time.Second

// runInit is cage-seal as the PID 1 of an nspawn cage (--init). Its
// filter is already on (Run installs it before anything else), so the
// cage's first process, and every process after it, runs under it: there
// is no process in the cage without it for the agent to take over (with
// nspawn's stub init as PID 1 there was, see allowlist.go). It starts the
// command as its child, reaps every process the PID namespace reparents to
// it, passes signals on, and exits with the command's status (128+N when a
// signal N killed it) as soon as the command ends.
func runInit(path string, argv []string) error {
	// Not dumpable: the agent has the init's uid, and the kernel's ptrace
	// access check, all that guards /proc/1/mem (no system call the filter
	// sees), let a process of the same uid write a dumpable one's memory
	// (red team). A process that is not dumpable needs CAP_SYS_PTRACE in
	// the cage's user namespace, which no process of the cage has. The
	// command is dumpable again: execve resets it.
	if err := unix.Prctl(unix.PR_SET_DUMPABLE, 0, 0, 0, 0); err != nil {
		return fmt.Errorf("seal: not dumpable: %w", err)
	}
	sigs := make(chan os.Signal, 64)
	signal.Notify(sigs, append([]os.Signal{unix.SIGCHLD}, forwarded...)...)
	signal.Notify(make(chan os.Signal, 1), dropped...)
	pid, err := syscall.ForkExec(path, argv, &syscall.ProcAttr{
		Env:   os.Environ(),
		Files: []uintptr{0, 1, 2},
		Sys:   childAttr(),
	})
	if err != nil {
		return fmt.Errorf("seal: start %s: %w", path, err)
	}
	var grace <-chan time.Time
	for {
		select {
		case <-grace:
			// The agent outlived its stop: end the cage (the kernel kills
			// what is left when a PID namespace's init exits).
			os.Exit(128 + int(unix.SIGKILL))
		case s := <-sigs:
			if s == unix.SIGCHLD {
				if status, done := reap(pid); done {
					os.Exit(status)
				}
				continue
			}
			_ = unix.Kill(pid, s.(syscall.Signal))
			if (s == unix.SIGTERM || s == unix.SIGINT) && grace == nil {
				grace = time.After(StopGrace)
			}
		}
	}
}

// reap collects every child that has ended; done when one was the command.
func reap(cmd int) (status int, done bool) {
	for {
		var ws unix.WaitStatus
		pid, err := unix.Wait4(-1, &ws, unix.WNOHANG, nil)
		if err == unix.EINTR {
			continue
		}
		if pid <= 0 || err != nil {
			return status, done
		}
		if pid != cmd {
			continue
		}
		done = true
		switch {
		case ws.Exited():
			status = ws.ExitStatus()
		case ws.Signaled():
			status = 128 + int(ws.Signal())
		default:
			status = 255
		}
	}
}

// childAttr puts the command where a shell would: with the terminal on
// stdin as the init's controlling terminal, in a process group of its own
// that is the terminal's foreground group (so Ctrl-C and job control reach
// it, not the init); with a terminal that is nobody's, in a session of its
// own with that terminal as its controlling one; without a terminal, in a
// session of its own, as under nspawn's stub init.
func childAttr() *syscall.SysProcAttr {
	if _, err := unix.IoctlGetInt(0, unix.TIOCGPGRP); err == nil {
		return &syscall.SysProcAttr{Setpgid: true, Foreground: true, Ctty: 0}
	}
	if _, err := unix.IoctlGetTermios(0, unix.TCGETS); err == nil {
		return &syscall.SysProcAttr{Setsid: true, Setctty: true, Ctty: 0}
	}
	return &syscall.SysProcAttr{Setsid: true}
}
