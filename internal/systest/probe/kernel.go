package probe

import (
	"fmt"
	"os"
	"runtime"
	"strconv"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Checks of kernel interfaces nspawn's own seccomp filter refused a cage
// and cage-seal's filter refuses in its place (issue 16, start latency).
// Each tries the call in the least invasive way that still reaches the
// kernel: without a filter the calls marked "no capability" work for the
// cage's uid as they are, so a refusal there is the filter's.

// sysCalls are the sys,NAME checks.
var sysCalls = map[string]func() error{
	// no capability: the session keyring's id (the keyring is not
	// namespaced: every cage and the host share it).
	"keyctl": func() error {
		_, _, e := unix.Syscall(unix.SYS_KEYCTL, unix.KEYCTL_GET_KEYRING_ID, uintptr(0xfffffffd) /* KEY_SPEC_SESSION_KEYRING */, 0)
		return errnoErr(e)
	},
	// no capability: a key in the probe's own process keyring.
	"add_key": func() error {
		_, err := unix.AddKey("user", "nixcage-probe", []byte("x"), unix.KEY_SPEC_PROCESS_KEYRING)
		return err
	},
	// no capability: ENOKEY when the kernel looked.
	"request_key": func() error {
		typ, _ := unix.BytePtrFromString("user")
		desc, _ := unix.BytePtrFromString("nixcage-probe-none")
		_, _, e := unix.Syscall6(unix.SYS_REQUEST_KEY, uintptr(unsafe.Pointer(typ)), uintptr(unsafe.Pointer(desc)), 0, 0, 0, 0)
		if e == unix.ENOKEY {
			return nil
		}
		return errnoErr(e)
	},
	// no capability (perf_event_paranoid <= 2): a software counter of the
	// probe itself, user space only.
	"perf_event_open": func() error {
		attr := unix.PerfEventAttr{Type: unix.PERF_TYPE_SOFTWARE, Config: unix.PERF_COUNT_SW_CPU_CLOCK, Bits: unix.PerfBitExcludeKernel | unix.PerfBitExcludeHv | unix.PerfBitDisabled}
		attr.Size = uint32(unsafe.Sizeof(attr))
		fd, err := unix.PerfEventOpen(&attr, 0, -1, -1, unix.PERF_FLAG_FD_CLOEXEC)
		if err == nil {
			unix.Close(fd)
		}
		return err
	},
	// a socket filter map: unprivileged bpf is off on most hosts, so this
	// is refused without capabilities anyway.
	"bpf": func() error {
		attr := [48]byte{}
		*(*uint32)(unsafe.Pointer(&attr[0])) = 2  // BPF_MAP_TYPE_ARRAY
		*(*uint32)(unsafe.Pointer(&attr[4])) = 4  // key size
		*(*uint32)(unsafe.Pointer(&attr[8])) = 4  // value size
		*(*uint32)(unsafe.Pointer(&attr[12])) = 1 // entries
		fd, _, e := unix.Syscall(unix.SYS_BPF, 0 /* BPF_MAP_CREATE */, uintptr(unsafe.Pointer(&attr[0])), unsafe.Sizeof(attr))
		if e == 0 {
			unix.Close(int(fd))
		}
		return errnoErr(e)
	},
	// needs CAP_SYS_ADMIN: a tmpfs context, never mounted.
	"fsopen": func() error {
		fd, err := unix.Fsopen("tmpfs", unix.FSOPEN_CLOEXEC)
		if err == nil {
			unix.Close(fd)
		}
		return err
	},
	// needs CAP_SYS_ADMIN: the probe's own network namespace again.
	"setns": func() error {
		fd, err := unix.Open("/proc/self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		return unix.Setns(fd, unix.CLONE_NEWNET)
	},
}

func errnoErr(e syscall.Errno) error {
	if e == 0 {
		return nil
	}
	return e
}

func sysCall(name string) error {
	f, ok := sysCalls[name]
	if !ok {
		return fmt.Errorf("unknown system call check %q", name)
	}
	return f()
}

// target is a ptrace,/vmread, target: "1" (the cage's PID 1) or "child" (a
// child of the probe's own, same uid, which the kernel lets any process
// trace); it returns the pid and a function that ends the child.
func target(which string) (int, func(), error) {
	if which != "child" {
		pid, err := strconv.Atoi(which)
		return pid, func() {}, err
	}
	pid, err := syscall.ForkExec("/proc/self/exe", []string{"cage-probe", "sleep,30s"}, &syscall.ProcAttr{})
	if err != nil {
		return 0, nil, err
	}
	return pid, func() {
		syscall.Kill(pid, syscall.SIGKILL)
		var ws syscall.WaitStatus
		syscall.Wait4(pid, &ws, 0, nil)
	}, nil
}

// ptraceAttach attaches to the target and detaches again: with it, the
// target's system calls are the tracer's to make.
func ptraceAttach(which string) error {
	pid, done, err := target(which)
	if err != nil {
		return err
	}
	defer done()
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := unix.PtraceAttach(pid); err != nil {
		return err
	}
	var ws unix.WaitStatus
	unix.Wait4(pid, &ws, unix.WALL, nil)
	return unix.PtraceDetach(pid)
}

// vmRead reads a word of the target's memory (its first mapping) with
// process_vm_readv. Where that works, its twin process_vm_writev can
// change what the target runs.
func vmRead(which string) (string, error) {
	pid, done, err := target(which)
	if err != nil {
		return "", err
	}
	defer done()
	lo, err := firstMapping(pid)
	if err != nil {
		return "", err
	}
	buf := make([]byte, 8)
	local := []unix.Iovec{{Base: &buf[0], Len: 8}}
	remote := []unix.RemoteIovec{{Base: uintptr(lo), Len: 8}}
	if _, err := unix.ProcessVMReadv(pid, local, remote, 0); err != nil {
		return "", err
	}
	return fmt.Sprintf("read %x at %#x of pid %d", buf, lo, pid), nil
}

// firstMapping is the start of the first mapping in /proc/PID/maps.
func firstMapping(pid int) (uint64, error) {
	maps, err := os.ReadFile(fmt.Sprintf("/proc/%d/maps", pid))
	if err != nil {
		return 0, err
	}
	var lo uint64
	if _, err := fmt.Sscanf(string(maps), "%x-", &lo); err != nil {
		return 0, fmt.Errorf("maps of %d: %w", pid, err)
	}
	return lo, nil
}

// procMem opens the target's /proc/PID/mem read-write and writes back the
// first word of its first mapping: the kernel's ptrace access check alone
// stands between a process and another's memory there.
func procMem(which string) (string, error) {
	pid, done, err := target(which)
	if err != nil {
		return "", err
	}
	defer done()
	f, err := os.OpenFile(fmt.Sprintf("/proc/%d/mem", pid), os.O_RDWR, 0)
	if err != nil {
		return "", err
	}
	defer f.Close()
	lo, err := firstMapping(pid)
	if err != nil {
		return "", err
	}
	buf := make([]byte, 8)
	if _, err := f.ReadAt(buf, int64(lo)); err != nil {
		return "", err
	}
	if _, err := f.WriteAt(buf, int64(lo)); err != nil {
		return "", err
	}
	return fmt.Sprintf("wrote %x back at %#x of pid %d", buf, lo, pid), nil
}
