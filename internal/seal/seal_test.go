package seal

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/nixcage/nixcage/internal/testenv"
)

// attempts are what a sealed cage must be refused, and one it must keep.
// Each returns the errno it got (0: it worked).
var attempts = map[string]func() unix.Errno{
	"io_uring_setup": func() unix.Errno {
		var params [120]byte // struct io_uring_params
		fd, _, e := unix.Syscall(unix.SYS_IO_URING_SETUP, 1, uintptr(unsafe.Pointer(&params)), 0)
		if e == 0 {
			unix.Close(int(fd))
		}
		return e
	},
	// clone3 with a too-small size: EINVAL when the kernel sees it, ENOSYS
	// when the filter answers first. Nothing is ever cloned.
	"clone3": func() unix.Errno {
		_, _, e := unix.Syscall(unix.SYS_CLONE3, 0, 0, 0)
		return e
	},
	"socket AF_VSOCK": func() unix.Errno { return sock(unix.AF_VSOCK, unix.SOCK_STREAM) },
	"socket AF_INET":  func() unix.Errno { return sock(unix.AF_INET, unix.SOCK_STREAM) },
	"socket AF_UNIX":  func() unix.Errno { return sock(unix.AF_UNIX, unix.SOCK_STREAM) },
	// The host kernel's device events (and their global sequence number,
	// which counts every other cage's start) reach any socket of this
	// protocol in a network namespace the host's root made.
	"socket NETLINK_KOBJECT_UEVENT": func() unix.Errno {
		return sockProto(unix.AF_NETLINK, unix.SOCK_DGRAM, unix.NETLINK_KOBJECT_UEVENT)
	},
	"socket NETLINK_ROUTE":     func() unix.Errno { return sockProto(unix.AF_NETLINK, unix.SOCK_RAW, unix.NETLINK_ROUTE) },
	"socket NETLINK_SOCK_DIAG": func() unix.Errno { return sockProto(unix.AF_NETLINK, unix.SOCK_RAW, unix.NETLINK_SOCK_DIAG) },
	// A child in a new user namespace (clone), and a child that unshares
	// one after fork: the two ways a process gets one.
	"clone CLONE_NEWUSER":   func() unix.Errno { return child(&unix.SysProcAttr{Cloneflags: unix.CLONE_NEWUSER}) },
	"unshare CLONE_NEWUSER": func() unix.Errno { return child(&unix.SysProcAttr{Unshareflags: unix.CLONE_NEWUSER}) },
	"fork and exec":         func() unix.Errno { return child(&unix.SysProcAttr{}) },
	"fchmodat2 setuid":      func() unix.Errno { return fchmodat2(0o4755) },
	"fchmodat2 plain":       func() unix.Errno { return fchmodat2(0o755) },
}

// fchmodat2 changes the mode of a fresh file of this process's own.
func fchmodat2(mode uint32) unix.Errno {
	f, err := os.CreateTemp("", "seal-test-")
	if err != nil {
		return unix.EIO
	}
	f.Close()
	defer os.Remove(f.Name())
	p, _ := unix.BytePtrFromString(f.Name())
	atFDCWD := unix.AT_FDCWD
	_, _, e := unix.Syscall6(unix.SYS_FCHMODAT2, uintptr(atFDCWD), uintptr(unsafe.Pointer(p)), uintptr(mode), 0, 0, 0)
	return e
}

func sock(family, typ int) unix.Errno { return sockProto(family, typ, 0) }

func sockProto(family, typ, proto int) unix.Errno {
	fd, err := unix.Socket(family, typ, proto)
	if err != nil {
		return err.(unix.Errno)
	}
	unix.Close(fd)
	return 0
}

func child(attr *unix.SysProcAttr) unix.Errno {
	cmd := exec.Command("/proc/self/exe", "-test.run=^$")
	cmd.Env = []string{} // not a probe again
	cmd.SysProcAttr = attr
	if err := cmd.Run(); err != nil {
		var errno unix.Errno
		if e, ok := err.(interface{ Unwrap() error }); ok {
			if en, ok := e.Unwrap().(unix.Errno); ok {
				errno = en
			}
		}
		if errno == 0 {
			if pe, ok := err.(*os.PathError); ok {
				errno, _ = pe.Err.(unix.Errno)
			}
		}
		if errno == 0 {
			errno = unix.EIO // failed in an unexpected way
		}
		return errno
	}
	return 0
}

// TestMain lets a test re-run this binary as a probe, sealed or not, so the
// filter never lands on the test process itself.
func TestMain(m *testing.M) {
	if mode := os.Getenv("SEAL_TEST_PROBE"); mode == "run" {
		args := strings.Fields(os.Getenv("SEAL_TEST_ARGS"))
		if script := os.Getenv("SEAL_TEST_INIT_SCRIPT"); script != "" {
			args = []string{"--init", "--", "/bin/sh", "-c", script}
		}
		err := Run(args)
		os.Stderr.WriteString(err.Error() + "\n")
		os.Exit(127)
	} else if mode != "" {
		if mode == "sealed" {
			if err := Install(); err != nil {
				os.Stderr.WriteString(err.Error() + "\n")
				os.Exit(2)
			}
		}
		got := map[string]string{}
		for name, f := range attempts {
			got[name] = errnoName(f())
		}
		json.NewEncoder(os.Stdout).Encode(got)
		os.Exit(0)
	}
	os.Exit(m.Run())
}

func errnoName(e unix.Errno) string {
	if e == 0 {
		return "ok"
	}
	return unix.ErrnoName(e)
}

func probe(t *testing.T, mode string) map[string]string {
	t.Helper()
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), "SEAL_TEST_PROBE="+mode)
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("probe %s: %v", mode, err)
	}
	got := map[string]string{}
	if err := json.Unmarshal(out, &got); err != nil {
		t.Fatalf("probe %s: %v: %s", mode, err, out)
	}
	return got
}

// TestSeal runs the attempts unsealed (what this kernel allows: an attempt
// the kernel refuses anyway proves nothing and is skipped) and sealed.
func TestSeal(t *testing.T) {
	open := probe(t, "open")
	sealed := probe(t, "sealed")
	want := map[string]string{
		"io_uring_setup":                "EPERM",
		"clone3":                        "ENOSYS",
		"socket AF_VSOCK":               "EAFNOSUPPORT",
		"socket AF_INET":                "ok",
		"socket AF_UNIX":                "ok",
		"socket NETLINK_KOBJECT_UEVENT": "EPROTONOSUPPORT",
		"socket NETLINK_ROUTE":          "ok",
		"socket NETLINK_SOCK_DIAG":      "ok",
		"clone CLONE_NEWUSER":           "EPERM",
		"unshare CLONE_NEWUSER":         "EPERM",
		"fork and exec":                 "ok",
		"fchmodat2 setuid":              "ENOSYS",
		"fchmodat2 plain":               "ENOSYS",
	}
	for name, w := range want {
		t.Run(strings.ReplaceAll(name, " ", "_"), func(t *testing.T) {
			if w != "ok" && open[name] == w {
				t.Skipf("unsealed, this kernel already answers %s: the filter is not what refuses it here", open[name])
			}
			if w != "ok" && open[name] != "ok" && name != "clone3" {
				t.Skipf("unsealed, this host refuses it (%s): nothing to seal", open[name])
			}
			if sealed[name] != w {
				t.Errorf("sealed: %s = %s, want %s (unsealed: %s)", name, sealed[name], w, open[name])
			}
		})
	}
	if open["clone3"] != "EINVAL" {
		t.Logf("unsealed clone3 with size 0 = %s (EINVAL expected from the kernel)", open["clone3"])
	}
}

// Every jump lands inside the program, and the program fits the kernel's
// limit.
func TestProgramShape(t *testing.T) {
	p, err := Program()
	if err != nil {
		t.Skip(err)
	}
	if len(p) > 4096 {
		t.Fatalf("program has %d instructions", len(p))
	}
	for i, in := range p {
		if in.Code&0x07 == unix.BPF_JMP && (i+1+int(in.Jt) >= len(p) || i+1+int(in.Jf) >= len(p)) {
			t.Errorf("instruction %d jumps out of the program", i)
		}
	}
	if last := p[len(p)-1]; last.Code != unix.BPF_RET|unix.BPF_K {
		t.Errorf("program does not end in a return")
	}
}

// cage-seal --no-caps, as root with every capability (as a shell that
// joined an nspawn cage's user namespace is): what it execs has none in
// any set, runs in --chdir, and is sealed.
func TestRunNoCaps(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: the bounding set can be emptied only with CAP_SETPCAP")
	}
	dir := t.TempDir()
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), "SEAL_TEST_PROBE=run", "SEAL_TEST_ARGS=--no-caps --chdir "+dir+" -- /bin/sh -c pwd;grep${IFS}-E${IFS}'^(Cap|NoNewPrivs|Seccomp:)'${IFS}/proc/self/status")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("cage-seal --no-caps: %v\n%s", err, out)
	}
	for _, want := range []string{dir + "\n", "CapInh:\t0000000000000000", "CapPrm:\t0000000000000000", "CapEff:\t0000000000000000", "CapBnd:\t0000000000000000", "CapAmb:\t0000000000000000", "NoNewPrivs:\t1", "Seccomp:\t2"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	cmd = exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), "SEAL_TEST_PROBE=run", "SEAL_TEST_ARGS=--bogus -- /bin/true")
	if out, err := cmd.CombinedOutput(); err == nil || !strings.Contains(string(out), "unknown \"--bogus\"") {
		t.Errorf("an unknown flag: %v, %s", err, out)
	}
}

// initCage starts cage-seal --init -- /bin/sh -c script as PID 1 of a new
// PID namespace, as nspawn does; its stdin is a pipe the test writes to.
func initCage(t *testing.T, script string) (*exec.Cmd, *lockedOutput, func(string)) {
	t.Helper()
	testenv.RequireRoot(t, "a PID namespace of its own for cage-seal --init")
	cmd := exec.Command(os.Args[0])
	cmd.Env = append(os.Environ(), "SEAL_TEST_PROBE=run", "SEAL_TEST_INIT_SCRIPT="+script)
	cmd.SysProcAttr = &unix.SysProcAttr{Cloneflags: unix.CLONE_NEWPID}
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	out := &lockedOutput{}
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	return cmd, out, func(s string) { in.Write([]byte(s)) }
}

type lockedOutput struct {
	mu sync.Mutex
	b  strings.Builder
}

func (o *lockedOutput) Write(p []byte) (int, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.b.Write(p)
}

func (o *lockedOutput) String() string {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.b.String()
}

func (o *lockedOutput) wait(t *testing.T, want string) {
	t.Helper()
	for i := 0; i < 200; i++ {
		if strings.Contains(o.String(), want) {
			return
		}
		time.Sleep(25 * time.Millisecond)
	}
	t.Fatalf("never printed %q:\n%s", want, o.String())
}

// zombiesOf lists the host's zombie children of pid.
func zombiesOf(pid int) []string {
	var z []string
	dirs, _ := filepath.Glob("/proc/[0-9]*/status")
	for _, f := range dirs {
		b, _ := os.ReadFile(f)
		s := string(b)
		if strings.Contains(s, "\nState:\tZ") && strings.Contains(s, "\nPPid:\t"+strconv.Itoa(pid)+"\n") {
			z = append(z, f)
		}
	}
	return z
}

// cage-seal --init as PID 1: sealed itself (the host sees its filter),
// the command runs as its child, orphans reparented to it are reaped, and
// the command's exit status is the cage's.
func TestInitPID1(t *testing.T) {
	cmd, out, write := initCage(t, `echo ppid=$PPID; sh -c "sleep 0.1 &"; sleep 0.5; echo ready; read x; exit 7`)
	out.wait(t, "ready")
	if !strings.Contains(out.String(), "ppid=1\n") {
		t.Errorf("the command is not cage-seal's child in the cage (want ppid=1):\n%s", out)
	}
	status, _ := os.ReadFile(fmt.Sprintf("/proc/%d/status", cmd.Process.Pid))
	if !strings.Contains(string(status), "Seccomp:\t2") || !strings.Contains(string(status), "NoNewPrivs:\t1") {
		t.Errorf("the cage's PID 1 is not sealed:\n%s", status)
	}
	if z := zombiesOf(cmd.Process.Pid); len(z) > 0 {
		t.Errorf("orphans left unreaped: %v", z)
	}
	write("go\n")
	err := cmd.Wait()
	if code := cmd.ProcessState.ExitCode(); code != 7 {
		t.Errorf("exit %d (%v), want the command's 7:\n%s", code, err, out)
	}
}

// A SIGTERM to the cage's PID 1 from outside (nspawn's --kill-signal on
// stop) reaches the command; a command killed by a signal gives 128+N; one
// that ignores SIGTERM is ended StopGrace later with the whole cage.
func TestInitSignals(t *testing.T) {
	cmd, out, _ := initCage(t, `trap "echo got-term; exit 3" TERM; echo ready; while :; do sleep 0.05; done`)
	out.wait(t, "ready")
	cmd.Process.Signal(unix.SIGTERM)
	cmd.Wait()
	if code := cmd.ProcessState.ExitCode(); code != 3 || !strings.Contains(out.String(), "got-term") {
		t.Errorf("SIGTERM: exit %d, want the trap's 3:\n%s", code, out)
	}

	cmd, out, _ = initCage(t, `echo ready; exec sleep 60`)
	out.wait(t, "ready")
	cmd.Process.Signal(unix.SIGTERM)
	cmd.Wait()
	if code := cmd.ProcessState.ExitCode(); code != 128+int(unix.SIGTERM) {
		t.Errorf("SIGTERM to sleep: exit %d, want %d", code, 128+int(unix.SIGTERM))
	}

	cmd, out, _ = initCage(t, `trap "" TERM; echo ready; while :; do sleep 0.05; done`)
	out.wait(t, "ready")
	t0 := time.Now()
	cmd.Process.Signal(unix.SIGTERM)
	cmd.Wait()
	if code, took := cmd.ProcessState.ExitCode(), time.Since(t0); code != 128+int(unix.SIGKILL) || took < StopGrace || took > StopGrace+5*time.Second {
		t.Errorf("a command ignoring SIGTERM: exit %d after %s, want %d after %s", code, took, 128+int(unix.SIGKILL), StopGrace)
	}
}
