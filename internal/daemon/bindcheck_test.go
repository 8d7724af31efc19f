package daemon

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"

	sysunix "golang.org/x/sys/unix"

	"github.com/nixcage/nixcage/internal/config"
	"github.com/nixcage/nixcage/internal/render"
)

// bindOf is a verified bind of dir, as caged makes it from the caller's
// descriptor.
func bindOf(t *testing.T, dir string) verifiedBind {
	t.Helper()
	var st syscall.Stat_t
	if err := syscall.Stat(dir, &st); err != nil {
		t.Fatal(err)
	}
	// nspawn: the check looks at Source in the process's root, which for
	// the test's children is the test's own.
	return verifiedBind{Bind: render.Bind{Source: dir, Dest: "/workspace"}, dev: uint64(st.Dev), ino: st.Ino}
}

// child starts a real process and pins it as caged pins a cage's.
func child(t *testing.T, args ...string) (*exec.Cmd, *pinnedProcess) {
	t.Helper()
	cmd := exec.Command(args[0], args[1:]...)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p, err := pinProcess(cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait(); p.Close() })
	return cmd, p
}

// waitExited waits, without reaping, until the process is a zombie.
func waitExited(t *testing.T, p *pinnedProcess) {
	t.Helper()
	fds := []sysunix.PollFd{{Fd: int32(p.fd), Events: sysunix.POLLIN}}
	if n, err := sysunix.Poll(fds, 10000); err != nil || n != 1 {
		t.Fatalf("process %d did not exit: %d %v", p.pid, n, err)
	}
}

func noUnverifiable(t *testing.T) func(verifiedBind, error) {
	return func(b verifiedBind, err error) { t.Errorf("bind %s reported unverifiable: %v", b.Source, err) }
}

// A cage whose command ended before caged looked: a zombie (not yet
// reaped by systemd) and a reaped process are gone, not a failed check.
// Before the fix the zombie case failed as the red team saw it: "cannot
// check what the cage sees at ...: no such file or directory".
func TestCheckBindsProcessGone(t *testing.T) {
	dir := t.TempDir()
	binds := []verifiedBind{bindOf(t, dir)}

	cmd, p := child(t, "true")
	waitExited(t, p)
	if _, err := os.Stat(filepath.Join("/proc", strconv.Itoa(p.pid))); err != nil {
		t.Fatalf("the zombie's /proc entry should still be there: %v", err)
	}
	if err := checkBindsOf(p, binds, config.BackendNspawn, noUnverifiable(t)); err != nil {
		t.Errorf("zombie: %v", err)
	}
	cmd.Wait()
	if err := checkBindsOf(p, binds, config.BackendNspawn, noUnverifiable(t)); err != nil {
		t.Errorf("reaped: %v", err)
	}
	if _, err := pinProcess(p.pid); !errors.Is(err, syscall.ESRCH) {
		t.Errorf("pinning a reaped process: %v, want ESRCH (checkBinds takes that as gone)", err)
	}
}

// The check is as strict as before while the process lives: a directory
// that is missing where the cage looks, or another one, is refused; the
// same one passes.
func TestCheckBindsAlive(t *testing.T) {
	dir := t.TempDir()
	good := bindOf(t, dir)
	_, p := child(t, "sleep", "60")

	if err := checkBindsOf(p, []verifiedBind{good}, config.BackendNspawn, noUnverifiable(t)); err != nil {
		t.Errorf("the opened directory itself: %v", err)
	}
	missing := good
	missing.Source = filepath.Join(dir, "gone")
	if err := checkBindsOf(p, []verifiedBind{missing}, config.BackendNspawn, noUnverifiable(t)); err == nil || !errors.Is(err, os.ErrNotExist) {
		t.Errorf("missing in a live cage: %v, want not-exist error", err)
	}
	other := good
	other.Source = t.TempDir()
	if err := checkBindsOf(p, []verifiedBind{other}, config.BackendNspawn, noUnverifiable(t)); !errors.Is(err, errReplaced) {
		t.Errorf("another directory in a live cage: %v, want replaced", err)
	}

}
