// Package seal is the wall nspawn and podman cages put up around the agent
// from inside: cage-seal, the first program the container manager starts,
// installs a seccomp filter and then execs the agent's command (podman), or
// stays as the cage's PID 1 with the agent as its child (nspawn, init.go).
// The filter is inherited by every process of the cage and cannot be
// removed.
//
// It is systemd-nspawn 252's allow list (allowlist.go), which replaces
// nspawn's own filter, and it refuses besides what the managers' own
// filters let through (issue 16):
//   - io_uring: its opcodes (IORING_OP_SOCKET, ...) bypass per-syscall
//     filters such as the units' RestrictAddressFamilies=;
//   - new namespaces: unshare(2) and clone(2) with any CLONE_NEW* flag
//     (a user namespace is kernel attack surface and would give the agent
//     capabilities again), and clone3(2), whose flags sit behind a pointer
//     a filter cannot read, with ENOSYS so that libc falls back to clone;
//   - sockets other than AF_UNIX, AF_INET, AF_INET6 and AF_NETLINK: AF_VSOCK
//     is not network-namespaced and reaches the hypervisor of a VM host;
//   - netlink protocols other than NETLINK_ROUTE and NETLINK_SOCK_DIAG (the
//     cage's own interfaces and sockets): NETLINK_KOBJECT_UEVENT delivers
//     the host kernel's device events to every network namespace the
//     host's root made, the cage's included, with a global sequence number
//     that counts every other cage's start (red team, issue 21 item 4);
//   - fchmodat2(2) (ENOSYS, newer than the list, so libc falls back to
//     fchmodat): the units' RestrictSUIDSGID= (systemd 252) predates that
//     call (Linux 6.6) and does not see its setuid and setgid bits;
//   - personality(2) but for the queries and the 32-bit and uname26
//     personas (podman's default profile has the same list): no
//     ADDR_NO_RANDOMIZE or READ_IMPLIES_EXEC for what the agent execs;
//   - foreign-ABI system calls (x32, 32-bit compat), which would reach the
//     same kernel functions under numbers the filter does not check.
//
// The service backend gets the same walls from systemd itself
// (SystemCallFilter=, RestrictNamespaces=, RestrictAddressFamilies=).
package seal

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"runtime"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Flags no cage process may pass to clone or unshare. CLONE_NEWTIME (0x80)
// is only checked for unshare: in clone's flags the low byte is the exit
// signal.
const (
	cloneNewMask   = unix.CLONE_NEWNS | unix.CLONE_NEWCGROUP | unix.CLONE_NEWUTS | unix.CLONE_NEWIPC | unix.CLONE_NEWUSER | unix.CLONE_NEWPID | unix.CLONE_NEWNET
	unshareNewMask = cloneNewMask | unix.CLONE_NEWTIME
)

// Families are the socket address families a cage may open.
var Families = []int{unix.AF_UNIX, unix.AF_INET, unix.AF_INET6, unix.AF_NETLINK}

// NetlinkProtocols are the AF_NETLINK protocols a cage may open: its
// interfaces and addresses (getifaddrs, getaddrinfo's AI_ADDRCONFIG) and
// its sockets (ss), both of its own network namespace only.
var NetlinkProtocols = []int{unix.NETLINK_ROUTE, unix.NETLINK_SOCK_DIAG}

// personalities are the personality(2) arguments a cage may pass: query
// (0xffffffff), PER_LINUX, PER_LINUX32, and either with UNAME26.
var personalities = []uint32{0, 0x8, 0x20000, 0x20008, 0xffffffff}

// Offsets into struct seccomp_data.
const (
	offNr   = 0
	offArch = 4
	offArg0 = 16 // low 32 bits on little-endian machines (amd64, arm64)
	offArg2 = 32
)

func retErrno(e unix.Errno) uint32 { return unix.SECCOMP_RET_ERRNO | uint32(e)&unix.SECCOMP_RET_DATA }

// Program is the filter for this machine's architecture: the allow list
// (allowlist.go) with the argument checks above in front of it.
func Program() ([]unix.SockFilter, error) {
	if nativeArch == 0 || len(allowList) == 0 {
		return nil, fmt.Errorf("seal: no seccomp filter for %s", runtime.GOARCH)
	}
	var a asm
	a.ld(offArch)
	a.jne(nativeArch, "eperm")
	a.ld(offNr)
	if foreignNrBase != 0 {
		a.jge(foreignNrBase, "eperm")
	}
	a.jeq(unix.SYS_CLONE3, "enosys")
	a.jeq(unix.SYS_UNSHARE, "unshare")
	a.jeq(unix.SYS_CLONE, "clone")
	a.jeq(unix.SYS_SOCKET, "socket")
	a.jeq(unix.SYS_PERSONALITY, "personality")
	a.jge(newerThanList, "enosys")
	a.ja("list")

	a.label("personality")
	a.ld(offArg0 + 4) // the high word: none of these sets it
	a.jne(0, "eperm")
	a.ld(offArg0)
	for _, p := range personalities {
		a.jeq(p, "allow")
	}
	a.ret(retErrno(unix.EPERM))

	a.label("unshare")
	a.ld(offArg0)
	a.jset(unshareNewMask, "eperm")
	a.ret(unix.SECCOMP_RET_ALLOW)

	a.label("clone")
	a.ld(offArg0)
	a.jset(cloneNewMask, "eperm")
	a.ret(unix.SECCOMP_RET_ALLOW)

	a.label("socket")
	a.ld(offArg0)
	for _, f := range Families {
		if f == unix.AF_NETLINK {
			a.jeq(uint32(f), "netlink")
			continue
		}
		a.jeq(uint32(f), "allow")
	}
	a.ret(retErrno(unix.EAFNOSUPPORT))

	a.label("netlink")
	a.ld(offArg2)
	for _, p := range NetlinkProtocols {
		a.jeq(uint32(p), "allow")
	}
	a.ret(retErrno(unix.EPROTONOSUPPORT))

	a.label("allow")
	a.ret(unix.SECCOMP_RET_ALLOW)
	a.label("eperm")
	a.ret(retErrno(unix.EPERM))
	a.label("enosys")
	a.ret(retErrno(unix.ENOSYS))

	// Everything else: the list, the number still in the accumulator.
	a.label("list")
	prog, err := a.assemble()
	if err != nil {
		return nil, err
	}
	return append(prog, allowTree(spans(allowList))...), nil
}

// Install puts the filter on every thread of this process (and so on all it
// will exec). no_new_privs, which an unprivileged filter requires, is set
// here too; the managers already set it.
func Install() error {
	prog, err := Program()
	if err != nil {
		return err
	}
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		return fmt.Errorf("seal: no_new_privs: %w", err)
	}
	fprog := unix.SockFprog{Len: uint16(len(prog)), Filter: &prog[0]}
	_, _, errno := unix.Syscall(unix.SYS_SECCOMP, unix.SECCOMP_SET_MODE_FILTER, unix.SECCOMP_FILTER_FLAG_TSYNC, uintptr(unsafe.Pointer(&fprog)))
	runtime.KeepAlive(prog)
	if errno != 0 {
		return fmt.Errorf("seal: install seccomp filter: %w", errno)
	}
	return nil
}

// Run is cage-seal: `cage-seal [--init] [--no-caps] [--chdir DIR] -- COMMAND [ARG...]`
// installs the filter and replaces itself with COMMAND (looked up in PATH
// when not absolute), with the environment unchanged. It returns only on
// failure; the agent never runs unsealed.
//
// --init makes cage-seal the cage's PID 1 instead (nspawn cages, init.go):
// the filter goes on first, before anything else this process does, and
// COMMAND runs as its child.
//
// --no-caps also empties every capability set, the bounding set included,
// before sealing: caged's shells in nspawn cages (cagectl shell) join the
// cage's user namespace, which hands a joiner every capability in it; the
// agent itself got none from its container manager, and so must the shell.
// --chdir changes directory first (the shell's starts in the workspace).
func Run(args []string) error {
	noCaps, initMode, dir := false, false, ""
	for len(args) > 0 && args[0] != "--" {
		switch {
		case args[0] == "--init":
			initMode = true
			args = args[1:]
		case args[0] == "--no-caps":
			noCaps = true
			args = args[1:]
		case args[0] == "--chdir" && len(args) > 1:
			dir = args[1]
			args = args[2:]
		default:
			return fmt.Errorf("usage: cage-seal [--init] [--no-caps] [--chdir DIR] -- COMMAND [ARG...] (unknown %q)", args[0])
		}
	}
	if len(args) > 0 && args[0] == "--" {
		args = args[1:]
	}
	if len(args) == 0 {
		return errors.New("usage: cage-seal [--init] [--no-caps] [--chdir DIR] -- COMMAND [ARG...]")
	}
	if initMode && noCaps {
		// Capabilities are per thread; the init's are the container
		// manager's to drop (nspawn --drop-capability=all).
		return errors.New("usage: cage-seal: --init and --no-caps do not go together")
	}
	if initMode {
		// PID 1 of the cage: sealed before it does anything else.
		if err := Install(); err != nil {
			return err
		}
	}
	if dir != "" {
		if err := os.Chdir(dir); err != nil {
			return fmt.Errorf("seal: %w", err)
		}
	}
	path, err := exec.LookPath(args[0])
	if err != nil {
		return fmt.Errorf("seal: %w", err)
	}
	if initMode {
		return runInit(path, args)
	}
	// The filter goes on all threads (TSYNC), but execve replaces the
	// calling one: keep this goroutine on the thread that was filtered last
	// so no runtime thread races the exec. Capabilities are per thread
	// too: they are dropped on this one, the one that execs.
	runtime.LockOSThread()
	if noCaps {
		foregroundTTY()
	}
	if noCaps {
		if err := DropCapabilities(); err != nil {
			return err
		}
	}
	if err := Install(); err != nil {
		return err
	}
	if err := unix.Exec(path, args, os.Environ()); err != nil {
		return fmt.Errorf("seal: exec %s: %w", path, err)
	}
	return nil
}

// foregroundTTY makes this process's own group the foreground group of
// the terminal on stdin when the current one lies outside this PID
// namespace (the kernel then reports it as 0): nsenter, which joined the
// cage's PID namespace for its child, is the session leader systemd gave
// the terminal to. An interactive shell would otherwise fail to give the
// terminal back to that invisible group when it exits ("Cannot set tty
// process group"). Best effort: without a terminal nothing changes.
func foregroundTTY() {
	pgrp, err := unix.IoctlGetInt(0, unix.TIOCGPGRP)
	if err != nil || pgrp != 0 {
		return
	}
	if unix.Setpgid(0, 0) != nil {
		return
	}
	// tcsetpgrp from a background group raises SIGTTOU; the handler Go
	// installs again after Reset is replaced by the default at exec.
	signal.Ignore(syscall.SIGTTOU)
	unix.IoctlSetPointerInt(0, unix.TIOCSPGRP, unix.Getpid())
	signal.Reset(syscall.SIGTTOU)
}

// DropCapabilities empties the calling thread's bounding, ambient,
// inheritable, permitted and effective capability sets, and checks that
// they are empty: what it execs gets no capability, even as uid 0.
func DropCapabilities() error {
	for c := 0; c <= unix.CAP_LAST_CAP; c++ {
		in, err := unix.PrctlRetInt(unix.PR_CAPBSET_READ, uintptr(c), 0, 0, 0)
		if err != nil {
			break // beyond what this kernel knows
		}
		if in == 1 {
			if err := unix.Prctl(unix.PR_CAPBSET_DROP, uintptr(c), 0, 0, 0); err != nil {
				return fmt.Errorf("seal: drop capability %d from the bounding set: %w", c, err)
			}
		}
	}
	if err := unix.Prctl(unix.PR_CAP_AMBIENT, unix.PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0); err != nil {
		return fmt.Errorf("seal: clear ambient capabilities: %w", err)
	}
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var none [2]unix.CapUserData
	if err := unix.Capset(&hdr, &none[0]); err != nil {
		return fmt.Errorf("seal: drop capabilities: %w", err)
	}
	var got [2]unix.CapUserData
	if err := unix.Capget(&hdr, &got[0]); err != nil {
		return fmt.Errorf("seal: read capabilities: %w", err)
	}
	if got != none {
		return fmt.Errorf("seal: capabilities left after dropping them: %+v", got)
	}
	return nil
}

// asm assembles a classic BPF program with symbolic forward jumps.
type asm struct {
	ins    []unix.SockFilter
	jumps  []jump
	labels map[string]int
}

type jump struct {
	at     int
	target string
	onTrue bool // the jump is taken when the test is true (else when false)
	always bool // an unconditional jump (32-bit offset)
}

func (a *asm) ld(off uint32) {
	a.ins = append(a.ins, unix.SockFilter{Code: unix.BPF_LD | unix.BPF_W | unix.BPF_ABS, K: off})
}

func (a *asm) ret(v uint32) {
	a.ins = append(a.ins, unix.SockFilter{Code: unix.BPF_RET | unix.BPF_K, K: v})
}

func (a *asm) cond(op uint16, k uint32, target string, onTrue bool) {
	a.jumps = append(a.jumps, jump{at: len(a.ins), target: target, onTrue: onTrue})
	a.ins = append(a.ins, unix.SockFilter{Code: unix.BPF_JMP | op | unix.BPF_K, K: k})
}

func (a *asm) jeq(k uint32, target string)  { a.cond(unix.BPF_JEQ, k, target, true) }
func (a *asm) jne(k uint32, target string)  { a.cond(unix.BPF_JEQ, k, target, false) }
func (a *asm) jge(k uint32, target string)  { a.cond(unix.BPF_JGE, k, target, true) }
func (a *asm) jset(k uint32, target string) { a.cond(unix.BPF_JSET, k, target, true) }

func (a *asm) ja(target string) {
	a.jumps = append(a.jumps, jump{at: len(a.ins), target: target, always: true})
	a.ins = append(a.ins, unix.SockFilter{Code: unix.BPF_JMP | unix.BPF_JA})
}

func (a *asm) label(name string) {
	if a.labels == nil {
		a.labels = map[string]int{}
	}
	a.labels[name] = len(a.ins)
}

func (a *asm) assemble() ([]unix.SockFilter, error) {
	for _, j := range a.jumps {
		to, ok := a.labels[j.target]
		if !ok {
			return nil, fmt.Errorf("seal: jump to unknown label %q", j.target)
		}
		d := to - j.at - 1
		if j.always && d >= 0 {
			a.ins[j.at].K = uint32(d)
			continue
		}
		if d < 0 || d > 255 {
			return nil, fmt.Errorf("seal: jump to %q out of range (%d)", j.target, d)
		}
		if j.onTrue {
			a.ins[j.at].Jt = uint8(d)
		} else {
			a.ins[j.at].Jf = uint8(d)
		}
	}
	return a.ins, nil
}
