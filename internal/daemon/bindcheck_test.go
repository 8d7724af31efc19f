package daemon

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	sysunix "golang.org/x/sys/unix"

	"github.com/nixcage/nixcage/internal/config"
	"github.com/nixcage/nixcage/internal/paths"
	"github.com/nixcage/nixcage/internal/render"
	"github.com/nixcage/nixcage/internal/testenv"
)

// bindOf is a verified bind of dir, as caged makes it from the caller's
// descriptor.
func bindOf(t *testing.T, dir string) verifiedBind {
	t.Helper()
	var st syscall.Stat_t
	if err := syscall.Stat(dir, &st); err != nil {
		t.Fatal(err)
	}
	return verifiedBind{Bind: render.Bind{Source: dir, Dest: "/workspace"}, dev: uint64(st.Dev), ino: st.Ino}
}

// onHost is b looked at where the test's children, whose root is the
// test's own, see it: at its source (the service backend looks at Dest in
// the cage's root).
func onHost(b verifiedBind) verifiedBind {
	b.Dest = b.Source
	return b
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
	for {
		n, err := sysunix.Poll(fds, 10000)
		if err == sysunix.EINTR {
			continue // a signal to the test process (the Go runtime's preemption): poll again
		}
		if err != nil || n != 1 {
			t.Fatalf("process %d did not exit: %d %v", p.pid, n, err)
		}
		return
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
	binds := []verifiedBind{onHost(bindOf(t, dir))}

	cmd, p := child(t, "true")
	waitExited(t, p)
	if _, err := os.Stat(filepath.Join("/proc", strconv.Itoa(p.pid))); err != nil {
		t.Fatalf("the zombie's /proc entry should still be there: %v", err)
	}
	if err := checkBindsOf(p, binds, config.BackendService, noUnverifiable(t)); err != nil {
		t.Errorf("zombie: %v", err)
	}
	cmd.Wait()
	if err := checkBindsOf(p, binds, config.BackendService, noUnverifiable(t)); err != nil {
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
	good := onHost(bindOf(t, dir))
	_, p := child(t, "sleep", "60")

	if err := checkBindsOf(p, []verifiedBind{good}, config.BackendService, noUnverifiable(t)); err != nil {
		t.Errorf("the opened directory itself: %v", err)
	}
	missing := good
	missing.Source = filepath.Join(dir, "gone")
	missing = onHost(missing)
	if err := checkBindsOf(p, []verifiedBind{missing}, config.BackendService, noUnverifiable(t)); err == nil || !errors.Is(err, os.ErrNotExist) {
		t.Errorf("missing in a live cage: %v, want not-exist error", err)
	}
	other := good
	other.Source = t.TempDir()
	other = onHost(other)
	if err := checkBindsOf(p, []verifiedBind{other}, config.BackendService, noUnverifiable(t)); !errors.Is(err, errReplaced) {
		t.Errorf("another directory in a live cage: %v, want replaced", err)
	}

}

// A cage whose command dies as caged looks: its mount namespace goes with
// its last process, which detaches the namespace's mounts, so a look that
// took the root just before finds the directory under the bind, not the
// bind. A real cage stands in: a process in its own mount namespace,
// chrooted into a skeleton with /usr and the opened directory bound in
// (as the service backend makes it); it is killed between the look
// taking its root and looking inside. Before the fix caged refused such a
// run as "no longer the directory that was opened" (CI's TestRunOnSystemd,
// for a `cat` that had printed the bound file). While the cage lives, a
// directory seen to differ is still refused.
func TestCheckBindsCageDyingDuringTheLook(t *testing.T) {
	testenv.RequirePrivileged(t)
	for _, tool := range []string{"unshare", "mount", "chroot"} {
		testenv.LookPath(t, tool)
	}
	base := t.TempDir()
	opened := filepath.Join(base, "opened")
	skel := filepath.Join(base, "skel")
	for _, d := range []string{opened, filepath.Join(skel, "usr"), filepath.Join(skel, "workspace")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	// Debian's merged /usr: these are links into it.
	for _, l := range []string{"bin", "lib", "lib64"} {
		if target, err := os.Readlink("/" + l); err == nil {
			if err := os.Symlink(target, filepath.Join(skel, l)); err != nil {
				t.Fatal(err)
			}
		}
	}
	good := bindOf(t, opened)
	other := bindOf(t, base)

	start := func(t *testing.T) *pinnedProcess {
		cmd := exec.Command("unshare", "--mount", "--propagation", "private", "sh", "-c",
			`mount --bind /usr "$1/usr" && mount --bind "$2" "$1/workspace" && exec chroot "$1" sleep 60`, "cage", skel, opened)
		cmd.Stderr = os.Stderr
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
		// Its binds are made once sleep runs in the skeleton: /proc/PID/exe
		// is then the skeleton's view of sleep.
		for i := 0; ; i++ {
			if exe, _ := os.Readlink(fmt.Sprintf("/proc/%d/exe", cmd.Process.Pid)); strings.HasSuffix(exe, "/sleep") {
				break
			}
			if i == 500 {
				t.Fatal("the cage never ran sleep")
			}
			time.Sleep(10 * time.Millisecond)
		}
		p, err := pinProcess(cmd.Process.Pid)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { p.Close() })
		return p
	}

	t.Run("alive", func(t *testing.T) {
		p := start(t)
		if err := checkBindsOf(p, []verifiedBind{good}, config.BackendService, noUnverifiable(t)); err != nil {
			t.Errorf("the opened directory in a live cage: %v", err)
		}
		if err := checkBindsOf(p, []verifiedBind{other}, config.BackendService, noUnverifiable(t)); !errors.Is(err, errReplaced) {
			t.Errorf("another directory in a live cage: %v, want replaced", err)
		}
	})
	t.Run("dying", func(t *testing.T) {
		p := start(t)
		beforeLook = func() {
			syscall.Kill(p.pid, syscall.SIGKILL)
			waitExited(t, p)
		}
		defer func() { beforeLook = func() {} }()
		if err := checkBindsOf(p, []verifiedBind{good}, config.BackendService, noUnverifiable(t)); err != nil {
			t.Errorf("the opened directory, looked at as the cage died: %v (want no error: what a dying namespace shows proves nothing)", err)
		}
		// The premise: the look did see something else. If a kernel ever
		// keeps a dying namespace's mounts, this test proves nothing.
		beforeLook = func() {}
		var st syscall.Stat_t
		if err := syscall.Stat(filepath.Join(skel, "workspace"), &st); err != nil || st.Ino == good.ino {
			t.Fatalf("the skeleton's own mount point should differ from the opened directory: %v", err)
		}
	})
}

// An nspawn cage's binds are checked where systemd staged them in the
// unit's namespace (paths.RunBindStaged), not at the caller's path: that
// path follows renames on the host, and a caller who swapped it after the
// check had nspawn bind another directory (checks/system TestRunOnSystemd,
// "swapped after caged's check"). A process in a mount namespace of its
// own (a private /run, so nothing is left on the host), with a tmpfs at
// the stage and the opened directory bound at its
// first entry as the unit has them, stands in for nspawn: the opened
// directory passes there, and after the caller's path is renamed away and
// another directory put in its place, the check still answers for the
// staged one; a stage holding another directory is refused.
func TestCheckBindsNspawnLooksAtTheStage(t *testing.T) {
	testenv.RequirePrivileged(t)
	for _, tool := range []string{"unshare", "mount"} {
		testenv.LookPath(t, tool)
	}
	base := t.TempDir()
	opened := filepath.Join(base, "proj")
	if err := os.Mkdir(opened, 0o755); err != nil {
		t.Fatal(err)
	}
	good := bindOf(t, opened)
	other := bindOf(t, base)
	cmd := exec.Command("unshare", "--mount", "--propagation", "private", "sh", "-c",
		`mount -t tmpfs tmpfs /run && mkdir -p "$1" && mount -t tmpfs -o mode=0700 tmpfs "$1" && mkdir "$1/0" && mount --bind "$2" "$1/0" && echo staged && exec sleep 60`, "unit", paths.RunBindStage, opened)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	if line, err := bufio.NewReader(out).ReadString('\n'); err != nil || line != "staged\n" {
		t.Fatalf("staging the bind: %q %v", line, err)
	}
	p, err := pinProcess(cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })

	if err := checkBindsOf(p, []verifiedBind{good}, config.BackendNspawn, noUnverifiable(t)); err != nil {
		t.Errorf("the opened directory at the stage: %v", err)
	}
	// The caller swaps its path; the stage still holds what was opened.
	if err := os.Rename(opened, filepath.Join(base, "old")); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(opened, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := checkBindsOf(p, []verifiedBind{good}, config.BackendNspawn, noUnverifiable(t)); err != nil {
		t.Errorf("the opened directory at the stage, its host path swapped: %v", err)
	}
	if err := checkBindsOf(p, []verifiedBind{other}, config.BackendNspawn, noUnverifiable(t)); !errors.Is(err, errReplaced) {
		t.Errorf("another directory than the staged one: %v, want replaced", err)
	}
}

// leaderExitsEnv makes the test binary the attacker's cage command of
// TestCheckBindsThreadedLeaderExitsDuringTheLook: a process whose main
// thread (the PID caged pins) exits alone when a byte arrives on stdin,
// while another thread lives on, as pthread_exit in main does.
const leaderExitsEnv = "NIXCAGE_TEST_BINDCHECK_LEADER_EXITS"

func init() {
	if os.Getenv(leaderExitsEnv) != "1" {
		return
	}
	runtime.LockOSThread() // init runs on the main thread: keep it there
	go func() {
		time.Sleep(time.Minute) // a safety net: the test kills it sooner
		os.Exit(0)
	}()
	os.Stdin.Read(make([]byte, 1))
	// exit(2), not exit_group(2): only this thread ends; the thread group
	// (and systemd's unit) goes on with the other threads.
	syscall.RawSyscall(syscall.SYS_EXIT, 0, 0, 0)
}

// The attacker is the caller of cagectl run who swapped their directory
// for another between opening it and systemd binding it, and whose cage
// command (their own program) makes the look find a dying process while
// the cage lives on: its main thread exits alone as caged looks, the other
// threads keep the cage, its mount namespace and the bind. A real process
// in its own mount namespace with another directory than the opened one
// bound in stands in; its main thread exits between the look taking its
// root and looking inside. Before the fix the check took "the root no
// longer resolves" for a dying cage and let the replaced directory pass.
func TestCheckBindsThreadedLeaderExitsDuringTheLook(t *testing.T) {
	testenv.RequirePrivileged(t)
	for _, tool := range []string{"unshare", "mount"} {
		testenv.LookPath(t, tool)
	}
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	base := t.TempDir()
	opened, other, at := filepath.Join(base, "opened"), filepath.Join(base, "other"), filepath.Join(base, "workspace")
	for _, d := range []string{opened, other, at} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	want := bindOf(t, opened)
	want.Dest = at // the service backend looks at Dest in the cage's root

	cmd := exec.Command("unshare", "--mount", "--propagation", "private", "sh", "-c",
		`mount --bind "$1" "$2" && exec "$3" -test.run=^$`, "cage", other, at, self)
	cmd.Env = append(os.Environ(), leaderExitsEnv+"=1")
	cmd.Stderr = os.Stderr
	exit, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	pid := cmd.Process.Pid
	for i := 0; ; i++ { // the bind is made once the helper runs
		if exe, _ := os.Readlink(fmt.Sprintf("/proc/%d/exe", pid)); exe == self {
			break
		}
		if i == 500 {
			t.Fatal("the cage never ran its command")
		}
		time.Sleep(10 * time.Millisecond)
	}
	p, err := pinProcess(pid)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()

	beforeLook = func() {
		exit.Write([]byte{1})
		leader := fmt.Sprintf("/proc/%d/task/%d/stat", pid, pid)
		for i := 0; ; i++ {
			if b, err := os.ReadFile(leader); err == nil && strings.Contains(string(b), ") Z ") {
				break
			}
			if i == 500 {
				t.Fatal("the cage's main thread did not exit")
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	defer func() { beforeLook = func() {} }()
	err = checkBindsOf(p, []verifiedBind{want}, config.BackendService, noUnverifiable(t))
	beforeLook = func() {}

	// The premise: the cage lives on (its other threads) with the other
	// directory bound, its main thread gone.
	if p.exited(0) {
		t.Fatal("the whole cage exited; the test proves nothing")
	}
	if threads, _ := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid)); len(threads) < 2 {
		t.Fatalf("the cage has %d threads, want its main thread (a zombie) and others", len(threads))
	}
	if !errors.Is(err, errReplaced) {
		t.Errorf("another directory bound in a cage that lives on: %v, want refused as replaced", err)
	}
	// And once the main thread is gone before the look, the cage is not
	// "gone" either: it cannot be checked, so it is refused.
	if err := checkBindsOf(p, []verifiedBind{want}, config.BackendService, noUnverifiable(t)); err == nil {
		t.Error("a cage whose main thread exited before the look, its other threads living: no error, want a refusal")
	}
}
