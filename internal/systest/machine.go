package systest

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// sigPoweroff is SIGRTMIN+3 (glibc's SIGRTMIN is 34): systemd powers off on it.
const sigPoweroff = syscall.Signal(37)

// Machine is one booted systemd, disposable.
//
// Invariants that make teardown reliable even when a test times out or the
// test binary is killed:
//   - systemd-nspawn runs as PID 1 of a fresh PID namespace made by
//     `unshare --pid --fork --kill-child`, and unshare gets SIGKILL when its
//     parent (the test process) dies. When nspawn dies the kernel kills every
//     process of that namespace, the machine's included.
//   - it also runs in a private mount namespace with tmpfs over /tmp and
//     /run/systemd/nspawn, so the volatile overlay and nspawn's bookkeeping
//     vanish with it; the cached tree is only ever a read-only lower layer.
type Machine struct {
	Name string
	// Leader is the machine's PID 1 as the host sees it.
	Leader int
	// Console is the file holding the machine's console output.
	Console string

	cmd  *exec.Cmd
	done chan struct{}
	err  error
}

// Options tune a machine. The zero value boots the cached tree.
type Options struct {
	// Root is the tree to boot (lower layer). Required.
	Root string
	// Console receives the machine's console; empty discards it.
	Console string
	// Log receives progress lines.
	Log io.Writer
	// ExtraArgs go to systemd-nspawn before -b.
	ExtraArgs []string
	// Detach lets the machine outlive this process (the demo's --keep): no
	// parent-death signal, own session. Stop it with Machine.Close or
	// `kill -RTMIN+3 LEADER`.
	Detach bool
}

// NspawnArgs are the systemd-nspawn options every machine gets, and why:
//   - --register=no --keep-unit: the host has no systemd/machined to talk to.
//   - --private-network: only lo; the machine keeps CAP_NET_ADMIN so it can
//     make the cages' namespaces and its fake internet, and cannot reach ours.
//   - --volatile=overlay: writes land in a tmpfs overlay, so each boot starts
//     from the pristine cached tree and leaves it untouched.
//   - --tmpfs=/var/lib/containers: podman's overlay driver refuses to stack
//     on the overlay root; a tmpfs under it is fine.
//   - --tmpfs=/var/lib/nixcage: workspaces are bind-mounted with idmap by the
//     nspawn backend, which overlayfs refuses (EINVAL) but a host's real
//     /var (ext4, xfs, btrfs) and tmpfs support.
//   - --system-call-filter=@keyring bpf: runc joins a session keyring and
//     queries device cgroup BPF programs; nspawn's default seccomp filter
//     refuses both (EPERM).
//   - --resolv-conf=off --timezone=off: the harness owns /etc/resolv.conf.
//
// The environment sets SYSTEMD_NSPAWN_UNIFIED_HIERARCHY=1: on a host with
// hybrid cgroups nspawn would give the machine read-only v1 controllers, and
// runc (podman) then fails to create its cgroups. With a unified hierarchy
// it works, but the machine gets no controllers when the host binds them all
// to v1: memory/CPU/tasks limits are then not enforceable inside it (see
// CgroupControllers).
var NspawnArgs = []string{
	"--quiet",
	"--register=no",
	"--keep-unit",
	"--private-network",
	"--volatile=overlay",
	"--tmpfs=/var/lib/containers",
	"--tmpfs=/var/lib/nixcage",
	"--system-call-filter=@keyring bpf",
	"--resolv-conf=off",
	"--timezone=off",
	"--link-journal=no",
}

// Boot starts a machine and waits until systemd reports the boot finished
// (running or degraded). The caller must Close it; BootT does that for tests.
func Boot(ctx context.Context, opts Options) (*Machine, error) {
	if opts.Root == "" {
		return nil, errors.New("boot machine: no root tree given")
	}
	if opts.Log == nil {
		opts.Log = io.Discard
	}
	suffix := make([]byte, 4)
	rand.Read(suffix)
	m := &Machine{Name: "nixcage-systest-" + hex.EncodeToString(suffix), done: make(chan struct{})}

	nspawn := append([]string{"systemd-nspawn"}, NspawnArgs...)
	nspawn = append(nspawn, "--machine="+m.Name, "--directory="+opts.Root)
	nspawn = append(nspawn, opts.ExtraArgs...)
	nspawn = append(nspawn, "--boot")
	script := "mount -t tmpfs -o mode=1777 tmpfs /tmp && mkdir -p /run/systemd/nspawn && " +
		"mount -t tmpfs -o mode=0755 tmpfs /run/systemd/nspawn && exec " + shellJoin(nspawn)
	cmd := exec.Command("unshare", "--pid", "--fork", "--kill-child=SIGKILL", "--mount-proc",
		"--mount", "--propagation=private", "--", "/bin/sh", "-c", script)
	cmd.Env = append(cleanEnv(), "SYSTEMD_NSPAWN_UNIFIED_HIERARCHY=1")
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL, Setpgid: true}
	if opts.Detach {
		cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	}
	var console io.Writer = io.Discard
	if opts.Console != "" {
		f, err := os.Create(opts.Console)
		if err != nil {
			return nil, fmt.Errorf("create console log: %w", err)
		}
		defer f.Close()
		console = f
		m.Console = opts.Console
	}
	cmd.Stdout, cmd.Stderr = console, console
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start systemd-nspawn: %w", err)
	}
	m.cmd = cmd
	go func() {
		m.err = cmd.Wait()
		close(m.done)
	}()
	fmt.Fprintf(opts.Log, "systest: booting machine %s from %s\n", m.Name, opts.Root)
	start := time.Now()
	if err := m.waitBooted(ctx); err != nil {
		m.Close()
		return nil, fmt.Errorf("boot machine %s: %w%s", m.Name, err, m.consoleTail())
	}
	fmt.Fprintf(opts.Log, "systest: machine %s booted in %s (leader pid %d)\n", m.Name, time.Since(start).Round(time.Millisecond), m.Leader)
	return m, nil
}

func (m *Machine) consoleTail() string {
	if m.Console == "" {
		return ""
	}
	data, _ := os.ReadFile(m.Console)
	if len(data) > 4096 {
		data = data[len(data)-4096:]
	}
	return "\nconsole tail:\n" + string(data)
}

// waitBooted finds the machine's PID 1 and polls is-system-running.
func (m *Machine) waitBooted(ctx context.Context) error {
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	last := ""
	for {
		select {
		case <-ctx.Done():
			return fmt.Errorf("waiting for boot (last state %q): %w", last, ctx.Err())
		case <-m.done:
			return fmt.Errorf("systemd-nspawn exited during boot: %v", m.err)
		case <-tick.C:
		}
		if m.Leader == 0 {
			m.Leader = m.findLeader()
			continue
		}
		out, _ := m.run(ctx, nil, "systemctl", "is-system-running")
		last = strings.TrimSpace(string(out))
		switch last {
		case "running", "degraded":
			return nil
		}
	}
}

// findLeader returns the machine's init: the process that is PID 1 of a PID
// namespace two levels below ours (ours -> unshare's -> nspawn's machine).
func (m *Machine) findLeader() int {
	nspawn := m.cmd.Process.Pid // unshare; its only child is nspawn
	for _, child := range children(nspawn) {
		for _, init := range children(child) {
			if nsPIDs(init) == 3 {
				return init
			}
		}
	}
	return 0
}

func children(ppid int) []int {
	ents, _ := os.ReadDir("/proc")
	var out []int
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		data, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		// pid (comm) state ppid ...; comm may hold spaces and parens.
		i := bytes.LastIndexByte(data, ')')
		if i < 0 {
			continue
		}
		f := strings.Fields(string(data[i+1:]))
		if len(f) > 1 && f[1] == strconv.Itoa(ppid) {
			out = append(out, pid)
		}
	}
	return out
}

// nsPIDs is how many PID namespaces a process is visible in (NSpid fields).
func nsPIDs(pid int) int {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(data), "\n") {
		if v, ok := strings.CutPrefix(line, "NSpid:"); ok {
			f := strings.Fields(v)
			if len(f) > 0 && f[len(f)-1] == "1" {
				return len(f)
			}
			return 0
		}
	}
	return 0
}

// cleanEnv is the environment for commands run in a machine: nothing of the
// test process (GOFLAGS, proxies, HOME) leaks in.
func cleanEnv() []string {
	return []string{
		"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
		"HOME=/root",
		"LANG=C.UTF-8",
		"SYSTEMD_PAGER=",
		"SYSTEMD_COLORS=0",
		"TERM=dumb",
	}
}

// Command returns a command that runs inside the machine as its root, in all
// of its namespaces (nsenter). It runs outside the machine's cgroups and with
// the host's capability set: use it to act as the machine's administrator,
// and use systemd units (RunUnit) for anything that must be confined.
func (m *Machine) Command(ctx context.Context, args ...string) *exec.Cmd {
	full := append([]string{"--target", strconv.Itoa(m.Leader), "--all", "--"}, args...)
	cmd := exec.CommandContext(ctx, "nsenter", full...)
	cmd.Env = cleanEnv()
	cmd.Dir = "/"
	return cmd
}

func (m *Machine) run(ctx context.Context, stdin []byte, args ...string) ([]byte, error) {
	cmd := m.Command(ctx, args...)
	if stdin != nil {
		cmd.Stdin = bytes.NewReader(stdin)
	}
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	if err != nil {
		return stdout.Bytes(), &RunError{Args: args, Err: err, Stdout: stdout.String(), Stderr: stderr.String()}
	}
	return stdout.Bytes(), nil
}

// Run runs a command in the machine and returns its stdout. A failure carries
// the exit status and both outputs.
func (m *Machine) Run(ctx context.Context, args ...string) (string, error) {
	out, err := m.run(ctx, nil, args...)
	return string(out), err
}

// Shell runs a /bin/sh script in the machine.
func (m *Machine) Shell(ctx context.Context, script string) (string, error) {
	return m.Run(ctx, "/bin/sh", "-ec", script)
}

// RunError is a command that failed in a machine.
type RunError struct {
	Args           []string
	Err            error
	Stdout, Stderr string
}

func (e *RunError) Error() string {
	return fmt.Sprintf("in machine: %s: %v\nstdout: %s\nstderr: %s", shellJoin(e.Args), e.Err, e.Stdout, e.Stderr)
}

func (e *RunError) Unwrap() error { return e.Err }

// ExitCode is the command's exit status, or -1 if it did not exit normally.
func (e *RunError) ExitCode() int {
	var ee *exec.ExitError
	if errors.As(e.Err, &ee) {
		return ee.ExitCode()
	}
	return -1
}

// Path is where a machine path can be reached from the host, through the
// leader's root (valid while the machine runs).
func (m *Machine) Path(p string) string {
	return filepath.Join(fmt.Sprintf("/proc/%d/root", m.Leader), p)
}

// WriteFile creates or replaces a file in the machine, making parent
// directories (0755) as needed.
func (m *Machine) WriteFile(p string, data []byte, mode os.FileMode) error {
	hp := m.Path(p)
	if err := os.MkdirAll(filepath.Dir(hp), 0o755); err != nil {
		return fmt.Errorf("write %s in machine: %w", p, err)
	}
	tmp := hp + ".systest-tmp"
	if err := os.WriteFile(tmp, data, mode); err != nil {
		return fmt.Errorf("write %s in machine: %w", p, err)
	}
	if err := os.Chmod(tmp, mode); err != nil {
		return fmt.Errorf("write %s in machine: %w", p, err)
	}
	if err := os.Rename(tmp, hp); err != nil {
		return fmt.Errorf("write %s in machine: %w", p, err)
	}
	return nil
}

// CopyIn copies a host file into the machine.
func (m *Machine) CopyIn(hostPath, machinePath string, mode os.FileMode) error {
	data, err := os.ReadFile(hostPath)
	if err != nil {
		return fmt.Errorf("copy %s into machine: %w", hostPath, err)
	}
	return m.WriteFile(machinePath, data, mode)
}

// ReadFile reads a file in the machine.
func (m *Machine) ReadFile(p string) ([]byte, error) {
	data, err := os.ReadFile(m.Path(p))
	if err != nil {
		return nil, fmt.Errorf("read %s in machine: %w", p, err)
	}
	return data, nil
}

// Done is closed when the machine has stopped.
func (m *Machine) Done() <-chan struct{} { return m.done }

// Close powers the machine off (SIGRTMIN+3 to its systemd, which is what
// `poweroff` does) and, if it has not stopped within 10 s, kills it. Safe to
// call more than once.
func (m *Machine) Close() error {
	select {
	case <-m.done:
		return nil
	default:
	}
	if m.Leader != 0 {
		syscall.Kill(m.Leader, sigPoweroff)
	}
	select {
	case <-m.done:
		return nil
	case <-time.After(10 * time.Second):
	}
	// Killing unshare makes the kernel kill its child (--kill-child) and so
	// the whole PID namespace.
	syscall.Kill(-m.cmd.Process.Pid, syscall.SIGKILL)
	<-m.done
	return errors.New("machine did not power off within 10s; killed")
}

func shellJoin(args []string) string {
	q := make([]string, len(args))
	for i, a := range args {
		if a != "" && strings.Trim(a, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_=./:@,+%") == "" {
			q[i] = a
			continue
		}
		q[i] = "'" + strings.ReplaceAll(a, "'", `'\''`) + "'"
	}
	return strings.Join(q, " ")
}
