package seal

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/nixcage/nixcage/internal/testenv"
)

// nspawnOldArgs are the nspawn options of an nspawn cage before cage-seal
// became its init (nixcage's render until issue 16's start-latency cut):
// nspawn's own seccomp filter on, for the capabilities the cage keeps
// (none), plus its deny of io_uring, and nspawn's stub init as PID 1.
var nspawnOldArgs = []string{
	"--quiet", "--register=no", "--keep-unit", "--directory=/", "--volatile=yes",
	"--private-users=pick", "--private-users-ownership=off",
	"--resolv-conf=off", "--timezone=off", "--link-journal=no",
	"--drop-capability=all", "--no-new-privileges=yes",
	"--system-call-filter=~io_uring_setup io_uring_enter io_uring_register",
	"--as-pid2", "--console=pipe",
}

// nspawnFilters starts the real systemd-nspawn with nspawnOldArgs and
// returns the seccomp filters its payload runs under, read with
// PTRACE_SECCOMP_GET_FILTER (root, unfiltered tracer).
func nspawnFilters(t *testing.T) [][]unix.SockFilter {
	t.Helper()
	testenv.RequirePrivileged(t)
	nspawn := testenv.LookPath(t, "systemd-nspawn")
	if s, _ := os.ReadFile("/proc/self/status"); !strings.Contains(string(s), "Seccomp:\t0") {
		testenv.MachineLacks(t, "an unfiltered root", "run the privileged tier outside any seccomp filter (PTRACE_SECCOMP_GET_FILTER refuses a filtered tracer)")
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	name := fmt.Sprintf("sealtest%d", os.Getpid())
	cmd := exec.CommandContext(ctx, nspawn, append(nspawnOldArgs, "--machine="+name, "--", "/bin/sleep", "300")...)
	cmd.Dir = t.TempDir()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		cmd.Process.Signal(unix.SIGTERM)
		cmd.Wait()
	}()
	var pid int
	for i := 0; i < 200 && pid == 0; i++ {
		time.Sleep(25 * time.Millisecond)
		pid = descendant(cmd.Process.Pid, "sleep")
	}
	if pid == 0 {
		t.Fatalf("nspawn's payload never started")
	}
	progs, err := dumpFilters(pid)
	if err != nil {
		t.Fatalf("read nspawn's filters: %v", err)
	}
	if len(progs) == 0 {
		t.Fatal("nspawn's payload has no seccomp filter")
	}
	return progs
}

// podmanOldArgs are what nixcage's podman cages ran with before cage-seal
// took over podman's default seccomp profile: no capabilities, no new
// privileges (the rest of the rendered options do not change the filter).
var podmanOldArgs = []string{"--runtime", "runc", "--network=none", "--cap-drop=all", "--security-opt=no-new-privileges",
	"--ulimit=nofile=1024:1024", "--ulimit=nproc=1024:1024", "--volume=/usr:/usr:ro"}

// podmanFilters starts the real podman with podmanOldArgs in a skeleton
// root and returns the seccomp filters its container runs under.
func podmanFilters(t *testing.T) [][]unix.SockFilter {
	t.Helper()
	testenv.RequirePrivileged(t)
	podman := testenv.LookPath(t, "podman")
	root := t.TempDir()
	for _, d := range []string{"proc", "sys", "dev", "etc", "tmp", "run", "usr"} {
		os.Mkdir(filepath.Join(root, d), 0o755)
	}
	for _, l := range []string{"bin", "lib", "lib64", "sbin"} {
		os.Symlink("usr/"+l, filepath.Join(root, l))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	name := fmt.Sprintf("sealtest-%d", os.Getpid())
	var out lockedOutput
	cmd := exec.CommandContext(ctx, podman, append(append([]string{"run", "--rm", "--name", name}, podmanOldArgs...), "--rootfs", root, "/usr/bin/sleep", "300")...)
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	defer func() {
		exec.Command(podman, "rm", "--force", "--ignore", name).Run()
		cancel()
		<-exited
	}()
	// Wait for the container, or for podman to give up: a first run in a
	// new machine sets up podman's storage and can take a while (seen
	// past 15 s in checks/fresh.sh's tree while CI ran beside it).
	var pid int
	for pid == 0 {
		select {
		case err := <-exited:
			exited <- err
			if strings.Contains(out.String(), "cgroup") {
				t.Skipf("podman cannot start a container on this machine (%v): %s", err, out.String())
			}
			t.Fatalf("podman ended before its container started (%v): %s", err, out.String())
		case <-ctx.Done():
			t.Fatalf("podman's container never started in %v: %s", 3*time.Minute, out.String())
		case <-time.After(100 * time.Millisecond):
		}
		b, _ := exec.Command(podman, "inspect", "--format", "{{.State.Pid}}", name).Output()
		pid, _ = strconv.Atoi(strings.TrimSpace(string(b)))
	}
	progs, err := dumpFilters(pid)
	if err != nil {
		t.Fatalf("read podman's filters: %v", err)
	}
	if len(progs) == 0 {
		t.Fatal("podman's container has no seccomp filter")
	}
	return progs
}

// descendant finds a process below pid whose comm is comm.
func descendant(pid int, comm string) int {
	tasks, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/children", pid))
	for _, f := range tasks {
		b, _ := os.ReadFile(f)
		for _, c := range strings.Fields(string(b)) {
			n, _ := strconv.Atoi(c)
			if got, _ := os.ReadFile(fmt.Sprintf("/proc/%d/comm", n)); strings.TrimSpace(string(got)) == comm {
				return n
			}
			if d := descendant(n, comm); d != 0 {
				return d
			}
		}
	}
	return 0
}

// dumpFilters attaches to pid and reads every seccomp filter it runs
// under, newest first.
func dumpFilters(pid int) ([][]unix.SockFilter, error) {
	runtime.LockOSThread() // ptrace belongs to the thread that attached
	defer runtime.UnlockOSThread()
	if err := unix.PtraceAttach(pid); err != nil {
		return nil, fmt.Errorf("attach: %w", err)
	}
	defer unix.PtraceDetach(pid)
	var ws unix.WaitStatus
	if _, err := unix.Wait4(pid, &ws, unix.WALL, nil); err != nil {
		return nil, err
	}
	const getFilter = 0x420c // PTRACE_SECCOMP_GET_FILTER
	var progs [][]unix.SockFilter
	for i := 0; ; i++ {
		n, _, e := unix.Syscall6(unix.SYS_PTRACE, getFilter, uintptr(pid), uintptr(i), 0, 0, 0)
		if e == unix.ENOENT {
			return progs, nil
		}
		if e != 0 {
			return nil, fmt.Errorf("filter %d: %w", i, e)
		}
		prog := make([]unix.SockFilter, n)
		if _, _, e := unix.Syscall6(unix.SYS_PTRACE, getFilter, uintptr(pid), uintptr(i), uintptr(unsafe.Pointer(&prog[0])), 0, 0); e != 0 {
			return nil, fmt.Errorf("filter %d: %w", i, e)
		}
		progs = append(progs, prog)
	}
}

// syscallNames reads this machine's system call names (linux-libc-dev's
// unistd_64.h), for messages; empty where the header is missing.
func syscallNames() map[uint32]string {
	names := map[uint32]string{}
	f, err := os.Open("/usr/include/x86_64-linux-gnu/asm/unistd_64.h")
	if err != nil {
		return names
	}
	defer f.Close()
	s := bufio.NewScanner(f)
	for s.Scan() {
		var name string
		var nr uint32
		if n, _ := fmt.Sscanf(s.Text(), "#define __NR_%s %d", &name, &nr); n == 2 {
			names[nr] = name
		}
	}
	return names
}

// argVariants are the arguments each system call number is tried with:
// none, and those the argument checks of the filters look at (a netlink
// audit socket, AF_VSOCK, a user namespace, a persona that turns off
// address randomization, personality's query, every bit set).
var argVariants = [][6]uint64{
	{},
	{unix.AF_NETLINK, unix.SOCK_RAW, unix.NETLINK_AUDIT},
	{unix.AF_VSOCK, unix.SOCK_STREAM},
	{unix.CLONE_NEWUSER},
	{0x0040000},
	{0xffffffff},
	{^uint64(0), ^uint64(0), ^uint64(0), ^uint64(0), ^uint64(0), ^uint64(0)},
}

// coversFilters: cage-seal's filter refuses every system call the
// manager's filters refuse, on every ABI this machine has, with each
// argument set; what cage-seal refuses besides is logged.
func coversFilters(t *testing.T, manager string, theirs [][]unix.SockFilter) {
	t.Helper()
	ours, err := Program()
	if err != nil {
		t.Fatal(err)
	}
	names := syscallNames()
	name := func(nr uint32) string {
		if n := names[nr]; n != "" {
			return n
		}
		return strconv.Itoa(int(nr))
	}
	abis := []struct {
		name string
		arch uint32
		base uint32
	}{{"x86-64", unix.AUDIT_ARCH_X86_64, 0}, {"x32", unix.AUDIT_ARCH_X86_64, 0x40000000}, {"i386", unix.AUDIT_ARCH_I386, 0}}
	var stricter []string
	for _, abi := range abis {
		for nr := uint32(0); nr < 1024; nr++ {
			for _, args := range argVariants {
				d := seccompData{nr: abi.base + nr, arch: abi.arch, args: args}
				them, err := runAll(theirs, d)
				if err != nil {
					t.Fatalf("%s's filter: %v", manager, err)
				}
				us, err := run(ours, d)
				if err != nil {
					t.Fatalf("cage-seal's filter: %v", err)
				}
				switch {
				case !allowed(them) && allowed(us):
					t.Errorf("%s %s(%#x, %#x, %#x): %s refuses it (%s), cage-seal allows it", abi.name, name(nr), args[0], args[1], args[2], manager, describe(them))
				case allowed(them) && !allowed(us) && abi.base == 0 && abi.arch == unix.AUDIT_ARCH_X86_64 && args == argVariants[0]:
					stricter = append(stricter, name(nr)+"="+describe(us))
				}
			}
		}
	}
	t.Logf("refused by cage-seal, allowed by %s (x86-64, no arguments): %s", manager, strings.Join(stricter, " "))
}

// TestAllowListCoversNspawn: cage-seal refuses what the real
// systemd-nspawn's own filter refused an nspawn cage (nixcage's nspawn
// options before cage-seal replaced that filter).
func TestAllowListCoversNspawn(t *testing.T) {
	if runtime.GOARCH != "amd64" {
		t.Skip("the x86 ABIs are checked on amd64")
	}
	coversFilters(t, "nspawn", nspawnFilters(t))
}

// TestAllowListCoversPodman: cage-seal refuses what the real podman's
// default profile refused a podman cage (before podman cages ran with
// seccomp=unconfined and cage-seal's filter alone).
func TestAllowListCoversPodman(t *testing.T) {
	if runtime.GOARCH != "amd64" {
		t.Skip("the x86 ABIs are checked on amd64")
	}
	coversFilters(t, "podman", podmanFilters(t))
}
