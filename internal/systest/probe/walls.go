package probe

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Checks of the cage's walls below the network (issues 16 and 21): what
// the agent could leave on the host, which kernel interfaces it reaches,
// and what it sees of the host and the other cages.

// families names the socket families checks take, with a type and a
// protocol each opens. uevent is the netlink protocol that carries the host
// kernel's device events.
var families = map[string][3]int{
	"unix":    {unix.AF_UNIX, unix.SOCK_STREAM, 0},
	"inet":    {unix.AF_INET, unix.SOCK_STREAM, 0},
	"inet6":   {unix.AF_INET6, unix.SOCK_STREAM, 0},
	"netlink": {unix.AF_NETLINK, unix.SOCK_RAW, unix.NETLINK_ROUTE},
	"uevent":  {unix.AF_NETLINK, unix.SOCK_DGRAM, unix.NETLINK_KOBJECT_UEVENT},
	"vsock":   {unix.AF_VSOCK, unix.SOCK_STREAM, 0},
	"packet":  {unix.AF_PACKET, unix.SOCK_RAW, 0},
}

func family(name string) ([3]int, error) {
	f, ok := families[name]
	if !ok {
		return f, fmt.Errorf("unknown socket family %q", name)
	}
	return f, nil
}

// socketOf opens a socket of a named family with socket(2).
func socketOf(name string) error {
	f, err := family(name)
	if err != nil {
		return err
	}
	return openSocket(f[0], f[1], f[2])
}

// socketPairOf opens a pair of sockets of a named family with socketpair(2).
func socketPairOf(name string) error {
	f, err := family(name)
	if err != nil {
		return err
	}
	fds, err := unix.Socketpair(f[0], f[1], f[2])
	if err != nil {
		return err
	}
	unix.Close(fds[0])
	unix.Close(fds[1])
	return nil
}

// setID tries every system call that can give a file a setuid or setgid
// bit, each on a file of its own, and opens dst's directory to everyone:
// what an agent does to leave a privileged program for the host's users
// (issue 21). chmod works on dst, a copy of src; fchmod, fchmodat and
// fchmodat2 on copies named dst.CALL; open, openat and openat2 create empty
// files dst.CALL with the bits in their mode. The check succeeds when any
// bit stuck; Detail names the calls that set one and dst's final mode.
func setID(src, dst string) (string, error) {
	var stuck []string
	var lastErr error
	check := func(name, path string, err error) {
		var st unix.Stat_t
		if unix.Stat(path, &st) == nil && st.Mode&(unix.S_ISUID|unix.S_ISGID) != 0 {
			stuck = append(stuck, name)
			return
		}
		if err != nil {
			lastErr = err
		}
	}
	chmods := map[string]func(path string) error{
		"chmod": func(p string) error { return unix.Chmod(p, 0o6755) },
		"fchmod": func(p string) error {
			fd, err := unix.Open(p, unix.O_RDONLY, 0)
			if err != nil {
				return err
			}
			defer unix.Close(fd)
			return unix.Fchmod(fd, 0o6755)
		},
		"fchmodat": func(p string) error { return unix.Fchmodat(unix.AT_FDCWD, p, 0o6755, 0) },
		"fchmodat2": func(p string) error {
			b, err := unix.BytePtrFromString(p)
			if err != nil {
				return err
			}
			atFDCWD := unix.AT_FDCWD
			if _, _, e := unix.Syscall6(unix.SYS_FCHMODAT2, uintptr(atFDCWD), uintptr(unsafe.Pointer(b)), 0o6755, 0, 0, 0); e != 0 {
				return e
			}
			return nil
		},
	}
	creates := map[string]func(path string) (int, error){
		"open":   func(p string) (int, error) { return unix.Open(p, unix.O_CREAT|unix.O_WRONLY, 0o6755) },
		"openat": func(p string) (int, error) { return unix.Openat(unix.AT_FDCWD, p, unix.O_CREAT|unix.O_WRONLY, 0o6755) },
		"openat2": func(p string) (int, error) {
			return unix.Openat2(unix.AT_FDCWD, p, &unix.OpenHow{Flags: unix.O_CREAT | unix.O_WRONLY, Mode: 0o6755})
		},
	}
	for _, name := range []string{"chmod", "fchmod", "fchmodat", "fchmodat2"} {
		path := dst
		if name != "chmod" {
			path = dst + "." + name
		}
		if err := copyFile(src, path, 0o755); err != nil {
			return "", err
		}
		check(name, path, chmods[name](path))
	}
	for _, name := range []string{"open", "openat", "openat2"} {
		path := dst + "." + name
		fd, err := creates[name](path)
		if err == nil {
			unix.Close(fd)
		}
		check(name, path, err)
	}
	unix.Chmod(filepath.Dir(dst), 0o755)
	var st unix.Stat_t
	if err := unix.Stat(dst, &st); err != nil {
		return "", err
	}
	detail := fmt.Sprintf("mode %o uid %d gid %d", st.Mode&0o7777, st.Uid, st.Gid)
	if len(stuck) > 0 {
		return detail + "; set by " + strings.Join(stuck, " "), nil
	}
	if lastErr == nil {
		lastErr = errors.New("no call set a setuid or setgid bit")
	}
	return detail, lastErr
}

func copyFile(src, dst string, mode os.FileMode) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, mode)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

// mknod tries to create a character device (1:3, /dev/null's numbers).
func mknod(path string) error {
	err := unix.Mknod(path, unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3)))
	if err == nil {
		os.Remove(path)
	}
	return err
}

// userns starts a child of the probe in a new user namespace, created by
// clone ("clone") or by unshare after fork ("unshare").
func userns(how string) error {
	attr := &syscall.SysProcAttr{}
	switch how {
	case "clone":
		attr.Cloneflags = syscall.CLONE_NEWUSER
	case "unshare":
		attr.Unshareflags = syscall.CLONE_NEWUSER
	default:
		return fmt.Errorf("userns takes clone or unshare, not %q", how)
	}
	pid, err := syscall.ForkExec("/proc/self/exe", []string{"cage-probe", "sleep,0s"}, &syscall.ProcAttr{Sys: attr})
	if err != nil {
		return err
	}
	var ws syscall.WaitStatus
	if _, err := syscall.Wait4(pid, &ws, 0, nil); err != nil {
		return err
	}
	if !ws.Exited() || ws.ExitStatus() != 0 {
		return fmt.Errorf("child in a new user namespace ended %v", ws)
	}
	return nil
}

// clone3 calls clone3(2) with a size the kernel rejects (EINVAL), so it
// never clones: ENOSYS means a filter answered before the kernel did.
func clone3() (string, error) {
	_, _, e := unix.Syscall(unix.SYS_CLONE3, 0, 0, 0)
	if e == unix.EINVAL {
		return "reached the kernel", nil
	}
	return "", e
}

// ioURingSocket creates a socket through io_uring (IORING_OP_SOCKET), the
// way around filters on socket(2).
func ioURingSocket(name string) error {
	f, err := family(name)
	if err != nil {
		return err
	}
	var p [120]byte // struct io_uring_params
	ringFD, _, e := unix.Syscall(unix.SYS_IO_URING_SETUP, 1, uintptr(unsafe.Pointer(&p)), 0)
	if e != 0 {
		return fmt.Errorf("io_uring_setup: %w", e)
	}
	fd := int(ringFD)
	defer unix.Close(fd)
	u32 := func(off int) uint32 { return *(*uint32)(unsafe.Pointer(&p[off])) }
	sqEntries, cqEntries := u32(0), u32(4)
	const sqOff, cqOff = 40, 80 // struct io_sqring_offsets, io_cqring_offsets
	sqTail, sqMask, sqArray := u32(sqOff+4), u32(sqOff+8), u32(sqOff+24)
	cqHead, cqMask, cqCQEs := u32(cqOff+0), u32(cqOff+8), u32(cqOff+20)

	mmap := func(off int64, n uint32) ([]byte, error) {
		return unix.Mmap(fd, off, int(n), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_POPULATE)
	}
	sq, err := mmap(0, sqArray+sqEntries*4) // IORING_OFF_SQ_RING
	if err != nil {
		return fmt.Errorf("mmap sq ring: %w", err)
	}
	defer unix.Munmap(sq)
	cq, err := mmap(0x8000000, cqCQEs+cqEntries*16) // IORING_OFF_CQ_RING
	if err != nil {
		return fmt.Errorf("mmap cq ring: %w", err)
	}
	defer unix.Munmap(cq)
	sqes, err := mmap(0x10000000, sqEntries*64) // IORING_OFF_SQES
	if err != nil {
		return fmt.Errorf("mmap sqes: %w", err)
	}
	defer unix.Munmap(sqes)

	// io_uring_prep_socket: opcode, fd = domain, off = type, len = protocol.
	const opSocket = 45
	sqe := sqes[:64]
	for i := range sqe {
		sqe[i] = 0
	}
	sqe[0] = opSocket
	*(*int32)(unsafe.Pointer(&sqe[4])) = int32(f[0])
	*(*uint64)(unsafe.Pointer(&sqe[8])) = uint64(f[1])
	tail := (*uint32)(unsafe.Pointer(&sq[sqTail]))
	t := atomic.LoadUint32(tail)
	*(*uint32)(unsafe.Pointer(&sq[sqArray+(t&*(*uint32)(unsafe.Pointer(&sq[sqMask])))*4])) = 0
	atomic.StoreUint32(tail, t+1)

	const enterGetEvents = 1
	if _, _, e := unix.Syscall6(unix.SYS_IO_URING_ENTER, uintptr(fd), 1, 1, enterGetEvents, 0, 0); e != 0 {
		return fmt.Errorf("io_uring_enter: %w", e)
	}
	head := atomic.LoadUint32((*uint32)(unsafe.Pointer(&cq[cqHead])))
	cqe := cqCQEs + (head&*(*uint32)(unsafe.Pointer(&cq[cqMask])))*16
	res := *(*int32)(unsafe.Pointer(&cq[cqe+8]))
	if res < 0 {
		return fmt.Errorf("IORING_OP_SOCKET: %w", unix.Errno(-res))
	}
	unix.Close(int(res))
	return nil
}

// tree lists the directories under root, depth levels deep.
func tree(root string, depth int) (string, error) {
	var out []string
	var walk func(dir string, d int) error
	walk = func(dir string, d int) error {
		ents, err := os.ReadDir(dir)
		if err != nil {
			return err
		}
		for _, e := range ents {
			if !e.IsDir() {
				continue
			}
			p := filepath.Join(dir, e.Name())
			out = append(out, p)
			if d > 1 {
				walk(p, d-1)
			}
		}
		return nil
	}
	err := walk(root, depth)
	return strings.Join(out, " "), err
}

// cgroupRoot is where the probe's own cgroup is: /sys/fs/cgroup plus its
// path, or /sys/fs/cgroup itself when the cgroup is bound there (the
// mount's root in /proc/self/mountinfo is that path), as in service cages.
func cgroupRoot(path string) string {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return "/sys/fs/cgroup" + path
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fl := strings.Fields(sc.Text())
		if len(fl) > 4 && fl[4] == "/sys/fs/cgroup" && unescapeMount(fl[3]) == path {
			return "/sys/fs/cgroup"
		}
	}
	return "/sys/fs/cgroup" + path
}

func unescapeMount(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			var c byte
			if _, err := fmt.Sscanf(s[i+1:i+4], "%03o", &c); err == nil {
				b.WriteByte(c)
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

var errNoCgroup = errors.New("no cgroup v2 entry in /proc/self/cgroup")

// mountOptions are the per-mount options of the mount at path, as this
// process sees it.
func mountOptions(path string) (string, error) {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return "", err
	}
	opts, found := "", false
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) > 5 && unescapeMount(f[4]) == path {
			opts, found = f[5], true // the last one is on top
		}
	}
	if !found {
		return "", fmt.Errorf("%s is not a mount point", path)
	}
	return opts, nil
}
