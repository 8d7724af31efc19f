package seal

import (
	"runtime"
	"testing"

	"golang.org/x/sys/unix"
)

// TestProgramAnswers reads the filter as the kernel would, for calls
// nspawn's own filter refused a cage and cage-seal now refuses in its
// place, calls it refuses besides, and calls a cage needs.
func TestProgramAnswers(t *testing.T) {
	if runtime.GOARCH != "amd64" {
		t.Skip("the table is amd64's")
	}
	prog, err := Program()
	if err != nil {
		t.Fatal(err)
	}
	const x32 = 0x40000000
	cases := []struct {
		name string
		d    seccompData
		want string
	}{
		{"read", seccompData{nr: unix.SYS_READ}, "allow"},
		{"openat", seccompData{nr: unix.SYS_OPENAT}, "allow"},
		{"clone (fork)", seccompData{nr: unix.SYS_CLONE, args: [6]uint64{uint64(unix.SIGCHLD)}}, "allow"},
		{"clone CLONE_NEWUSER", seccompData{nr: unix.SYS_CLONE, args: [6]uint64{unix.CLONE_NEWUSER}}, "EPERM"},
		{"unshare CLONE_NEWNET", seccompData{nr: unix.SYS_UNSHARE, args: [6]uint64{unix.CLONE_NEWNET}}, "EPERM"},
		{"unshare CLONE_FILES", seccompData{nr: unix.SYS_UNSHARE, args: [6]uint64{unix.CLONE_FILES}}, "allow"},
		{"clone3", seccompData{nr: unix.SYS_CLONE3}, "ENOSYS"},
		{"socket AF_INET", seccompData{nr: unix.SYS_SOCKET, args: [6]uint64{unix.AF_INET}}, "allow"},
		{"socket AF_VSOCK", seccompData{nr: unix.SYS_SOCKET, args: [6]uint64{unix.AF_VSOCK}}, "EAFNOSUPPORT"},
		{"socket NETLINK_AUDIT", seccompData{nr: unix.SYS_SOCKET, args: [6]uint64{unix.AF_NETLINK, 0, unix.NETLINK_AUDIT}}, "EPROTONOSUPPORT"},
		{"fchmodat2 setuid", seccompData{nr: unix.SYS_FCHMODAT2, args: [6]uint64{0, 0, 0o4755}}, "ENOSYS"},
		{"fchmodat2", seccompData{nr: unix.SYS_FCHMODAT2, args: [6]uint64{0, 0, 0o755}}, "ENOSYS"},
		{"personality query", seccompData{nr: unix.SYS_PERSONALITY, args: [6]uint64{0xffffffff}}, "allow"},
		{"personality ADDR_NO_RANDOMIZE", seccompData{nr: unix.SYS_PERSONALITY, args: [6]uint64{0x0040000}}, "EPERM"},
		{"userfaultfd", seccompData{nr: unix.SYS_USERFAULTFD}, "EPERM"},
		// nspawn's refusals.
		{"ptrace", seccompData{nr: unix.SYS_PTRACE}, "EPERM"},
		{"keyctl", seccompData{nr: unix.SYS_KEYCTL}, "EPERM"},
		{"add_key", seccompData{nr: unix.SYS_ADD_KEY}, "EPERM"},
		{"request_key", seccompData{nr: unix.SYS_REQUEST_KEY}, "EPERM"},
		{"bpf", seccompData{nr: unix.SYS_BPF}, "EPERM"},
		{"perf_event_open", seccompData{nr: unix.SYS_PERF_EVENT_OPEN}, "EPERM"},
		{"kexec_load", seccompData{nr: unix.SYS_KEXEC_LOAD}, "EPERM"},
		{"finit_module", seccompData{nr: unix.SYS_FINIT_MODULE}, "EPERM"},
		{"swapon", seccompData{nr: unix.SYS_SWAPON}, "EPERM"},
		{"reboot", seccompData{nr: unix.SYS_REBOOT}, "EPERM"},
		{"open_by_handle_at", seccompData{nr: unix.SYS_OPEN_BY_HANDLE_AT}, "EPERM"},
		{"io_uring_setup", seccompData{nr: unix.SYS_IO_URING_SETUP}, "EPERM"},
		// Beyond nspawn's.
		{"mount", seccompData{nr: unix.SYS_MOUNT}, "EPERM"},
		{"fsopen", seccompData{nr: unix.SYS_FSOPEN}, "EPERM"},
		{"setns", seccompData{nr: unix.SYS_SETNS}, "EPERM"},
		{"process_vm_writev", seccompData{nr: unix.SYS_PROCESS_VM_WRITEV}, "EPERM"},
		{"a call newer than the list (cachestat)", seccompData{nr: 451}, "ENOSYS"},
		{"x32 read", seccompData{nr: x32 | unix.SYS_READ}, "EPERM"},
	}
	for _, c := range cases {
		if c.d.arch == 0 {
			c.d.arch = unix.AUDIT_ARCH_X86_64
		}
		got, err := run(prog, c.d)
		if err != nil {
			t.Fatal(err)
		}
		if describe(got) != c.want {
			t.Errorf("%s: %s, want %s", c.name, describe(got), c.want)
		}
	}
	got, _ := run(prog, seccompData{nr: unix.SYS_READ, arch: unix.AUDIT_ARCH_I386})
	if describe(got) != "EPERM" {
		t.Errorf("i386 read: %s, want EPERM", describe(got))
	}
}
