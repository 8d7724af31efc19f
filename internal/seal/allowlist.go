package seal

import (
	"sort"

	"golang.org/x/sys/unix"
)

// The allow list (allow_linux.go) is systemd-nspawn 252's own: the system
// calls nspawn lets a container with every capability dropped make, read
// from the real nspawn by TestAllowListCoversNspawn. nspawn builds it with
// libseccomp at every start, for x86-64, x86 and x32 (three programs of
// ~500 instructions: 60-75 ms of an nspawn cage's start, docs/performance.md);
// cage-seal assembles the same list for the native ABI only, in
// microseconds, and every process of the cage runs under it (nspawn is run
// with SYSTEMD_SECCOMP=0 and cage-seal is the cage's PID 1, see init.go).
//
// Refused, as by nspawn (EPERM): ptrace, the keyring (add_key, request_key,
// keyctl: not namespaced), bpf, perf_event_open, kexec_*, modules, swap,
// reboot, acct, clock setting, quotactl, fanotify, open_by_handle_at,
// pkeys, mlock, iopl/ioperm, landlock, pidfd_getfd, memfd_secret, ... and,
// beyond nspawn's list, io_uring (nspawn's deny of it), the mount family
// (mount, umount2, pivot_root, chroot, open_tree, move_mount, fsopen,
// fsconfig, fsmount, fspick, mount_setattr), setns, process_vm_readv and
// process_vm_writev (another process's memory, as ptrace), clone3 (ENOSYS,
// see seal.go) and the argument checks of Program; and what podman's
// default profile refuses a container without capabilities that nspawn's
// list allows, so that podman cages can do without that profile
// (docs/performance.md): userfaultfd, vmsplice, kcmp, migrate_pages,
// move_pages, process_madvise, io_pgetevents, futex_waitv,
// set_mempolicy_home_node, sethostname, setdomainname, fchmodat2 and
// personality but for the personas Program lists.
//
// newerThanList: numbers from here on are newer than systemd 252's table
// (cachestat, ..., mseal, the *xattrat calls). They get ENOSYS, what a
// kernel without them answers, so libc falls back to the older call; a new
// system call stays refused until it is reviewed and listed.
const newerThanList = 451

// span is a run of consecutive allowed system call numbers.
type span struct{ lo, hi uint32 }

func spans(nrs []uint32) []span {
	s := append([]uint32(nil), nrs...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	var out []span
	for _, n := range s {
		if k := len(out); k > 0 && (n == out[k-1].hi || n == out[k-1].hi+1) {
			out[k-1].hi = n
			continue
		}
		out = append(out, span{n, n})
	}
	return out
}

// allowTree is a binary search over the spans, the system call number in
// the accumulator: ALLOW inside a span, EPERM between them. Its depth is
// log2 of the spans (~6 tests for ~60 spans); kernels from 5.11 on cache
// the answer for every number that does not depend on an argument anyway.
func allowTree(s []span) []unix.SockFilter {
	jmp := func(op uint16, k uint32, jt, jf uint8) unix.SockFilter {
		return unix.SockFilter{Code: unix.BPF_JMP | op | unix.BPF_K, K: k, Jt: jt, Jf: jf}
	}
	ret := func(v uint32) unix.SockFilter { return unix.SockFilter{Code: unix.BPF_RET | unix.BPF_K, K: v} }
	if len(s) <= 2 {
		var out []unix.SockFilter
		for _, r := range s {
			// Above this span: the next one. Below it (the spans are
			// sorted, so below every later one too): refused.
			out = append(out,
				jmp(unix.BPF_JGT, r.hi, 3, 0),
				jmp(unix.BPF_JGE, r.lo, 1, 0),
				ret(retErrno(unix.EPERM)),
				ret(unix.SECCOMP_RET_ALLOW))
		}
		return append(out, ret(retErrno(unix.EPERM)))
	}
	mid := len(s) / 2
	left, right := allowTree(s[:mid]), allowTree(s[mid:])
	// At or above the middle span's start: over the left half (a 32-bit
	// jump; the conditional ones reach only 255 ahead).
	out := []unix.SockFilter{
		jmp(unix.BPF_JGE, s[mid].lo, 0, 1),
		{Code: unix.BPF_JMP | unix.BPF_JA, K: uint32(len(left))},
	}
	return append(append(out, left...), right...)
}
