package main

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"unsafe"

	"github.com/cilium/ebpf"
	"golang.org/x/sys/unix"
)

// The bpf(2) commands the child tries, by number (include/uapi/linux/bpf.h).
const (
	bpfMapCreate     = 0
	bpfMapUpdateElem = 2
	bpfMapDeleteElem = 3
	bpfProgLoad      = 5
	bpfProgAttach    = 8
	bpfProgDetach    = 9
	bpfObjGetInfo    = 15
)

// unprivResult is what the child reports: per operation, "ok" or the
// error.
type unprivResult struct {
	UID, CapEff string
	Ops         map[string]string
	Relay       string // a pair joined and relayed by the child itself
}

// TestUnprivilegedMapFD: which BPF operations a process with no
// capabilities, in a user namespace of its own (as the gateway runs:
// PrivateUsers=yes, an empty capability bounding set), can still do on
// BPF objects a privileged process created and handed it as fds. The
// child is this test binary as uid 65534; its report is logged, and the
// answers this kernel gives are asserted only where the sysctl decides
// them (map create, prog load).
func TestUnprivilegedMapFD(t *testing.T) {
	k := needBPF(t)
	var files []*os.File
	for _, fd := range []int{k.targets.FD(), k.verdict.FD(), k.peers.FD(), k.prog.FD()} {
		d, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
		if err != nil {
			t.Fatal(err)
		}
		f := os.NewFile(uintptr(d), "bpf")
		defer f.Close()
		files = append(files, f)
	}
	// The test binary sits in go's 0700 build directory: a copy uid
	// 65534 can run.
	dir, err := os.MkdirTemp("", "sockmap-unpriv-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	bin, err := os.ReadFile(os.Args[0])
	if err == nil {
		err = os.WriteFile(dir+"/child.test", bin, 0o755)
	}
	if err == nil {
		err = os.Chmod(dir, 0o755)
	}
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(dir+"/child.test", "-test.run", "^TestUnprivilegedChild$", "-test.v")
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "SOCKMAP_UNPRIV_CHILD=1")
	cmd.ExtraFiles = files // fds 3 targets, 4 verdict, 5 peers, 6 prog
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Cloneflags:  syscall.CLONE_NEWUSER,
		UidMappings: []syscall.SysProcIDMap{{ContainerID: 65534, HostID: 65534, Size: 1}},
		GidMappings: []syscall.SysProcIDMap{{ContainerID: 65534, HostID: 65534, Size: 1}},
		Credential:  &syscall.Credential{Uid: 65534, Gid: 65534},
	}
	out, err := cmd.CombinedOutput()
	var res unprivResult
	for _, l := range strings.Split(string(out), "\n") {
		if j, ok := strings.CutPrefix(l, "RESULT "); ok {
			if err := json.Unmarshal([]byte(j), &res); err != nil {
				t.Fatal(err)
			}
		}
	}
	if res.Ops == nil {
		t.Fatalf("child reported nothing (%v):\n%s", err, out)
	}
	t.Logf("child uid %s, CapEff %s", res.UID, res.CapEff)
	for _, op := range []string{"map create", "prog load", "obj get info (map)", "map update targets (own socket)", "map update verdict (own socket)", "map delete targets", "map delete verdict", "prog attach", "prog detach"} {
		t.Logf("  %-32s %s", op, res.Ops[op])
	}
	t.Logf("  %-32s %s", "relay a pair (own sockets)", res.Relay)
	if b, _ := os.ReadFile("/proc/sys/kernel/unprivileged_bpf_disabled"); strings.TrimSpace(string(b)) != "0" {
		for _, op := range []string{"map create", "prog load"} {
			if res.Ops[op] == "ok" {
				t.Errorf("%s succeeded without privileges although kernel.unprivileged_bpf_disabled=%s", op, strings.TrimSpace(string(b)))
			}
		}
	}
}

// TestUnprivilegedChild is the child of TestUnprivilegedMapFD.
func TestUnprivilegedChild(t *testing.T) {
	if os.Getenv("SOCKMAP_UNPRIV_CHILD") == "" {
		t.Skip("the child of TestUnprivilegedMapFD, run by it")
	}
	res := unprivResult{UID: fmt.Sprint(os.Getuid()), Ops: map[string]string{}}
	if b, err := os.ReadFile("/proc/self/status"); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(l, "CapEff:"); ok {
				res.CapEff = strings.TrimSpace(v)
			}
		}
	}
	const targets, verdict, peers, prog = 3, 4, 5, 6
	report := func(op string, err error) {
		res.Ops[op] = "ok"
		if err != nil {
			res.Ops[op] = err.Error()
		}
	}
	attr := func(fields ...uint64) []byte { // 32-bit fields, except where put64 says
		b := make([]byte, 128)
		for i, f := range fields {
			binary.LittleEndian.PutUint32(b[4*i:], uint32(f))
		}
		return b
	}
	put64 := func(b []byte, off int, v uint64) []byte { binary.LittleEndian.PutUint64(b[off:], v); return b }
	ptr := func(b []byte) uint64 { return uint64(uintptr(unsafe.Pointer(&b[0]))) }

	// map create: a hash map, 8-byte keys and values, 1 entry.
	fd, err := bpf(bpfMapCreate, attr(uint64(ebpf.Hash), 8, 8, 1))
	if err == nil {
		unix.Close(fd)
	}
	report("map create", err)
	// prog load: a socket filter "r0 = 0; exit".
	insns := []byte{0xb7, 0, 0, 0, 0, 0, 0, 0, 0x95, 0, 0, 0, 0, 0, 0, 0}
	lic := []byte("GPL\x00")
	a := attr(uint64(ebpf.SocketFilter), 2)
	put64(a, 8, ptr(insns))
	put64(a, 16, ptr(lic))
	fd, err = bpf(bpfProgLoad, a)
	runtime.KeepAlive(insns)
	runtime.KeepAlive(lic)
	if err == nil {
		unix.Close(fd)
	}
	report("prog load", err)
	info := make([]byte, 128)
	a = attr(targets, uint64(len(info)))
	put64(a, 8, ptr(info))
	_, err = bpf(bpfObjGetInfo, a)
	report("obj get info (map)", err)

	// A socket of the child's own, into the two sockmaps and out again.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	c, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	sock, err := detach(c.(*net.TCPConn))
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(sock)
	key := make([]byte, 4)
	binary.LittleEndian.PutUint32(key, 2*maxPairs-1) // a slot the parent never uses
	val := make([]byte, 4)
	binary.LittleEndian.PutUint32(val, uint32(sock))
	for _, m := range []struct {
		name string
		fd   uint64
	}{{"targets", targets}, {"verdict", verdict}} {
		a = attr(m.fd)
		put64(a, 8, ptr(key))
		put64(a, 16, ptr(val))
		_, err = bpf(bpfMapUpdateElem, a)
		report("map update "+m.name+" (own socket)", err)
		a = attr(m.fd)
		put64(a, 8, ptr(key))
		_, err = bpf(bpfMapDeleteElem, a)
		report("map delete "+m.name, err)
	}
	// prog attach: the verdict program to the targets map (it has none);
	// detached again at once so the parent's relay is unchanged.
	_, err = bpf(bpfProgAttach, attr(targets, prog, uint64(ebpf.AttachSkSKBStreamVerdict)))
	report("prog attach", err)
	_, err = bpf(bpfProgDetach, attr(targets, prog, uint64(ebpf.AttachSkSKBStreamVerdict)))
	report("prog detach", err)

	res.Relay = childRelay(t, targets, verdict, peers)
	j, _ := json.Marshal(res)
	fmt.Println("RESULT " + string(j))
}

// childRelay relays one pair of the child's own sockets through the maps
// it was handed: the gateway's part, were a privileged helper to create
// and attach the objects.
func childRelay(t *testing.T, targets, verdict, peers int) string {
	var k kernel
	var err error
	for _, m := range []struct {
		fd  int
		dst **ebpf.Map
	}{{targets, &k.targets}, {verdict, &k.verdict}, {peers, &k.peers}} {
		if *m.dst, err = ebpf.NewMapFromFD(m.fd); err != nil {
			return fmt.Sprintf("map from fd %d: %v", m.fd, err)
		}
	}
	r, err := newRelay(&k, false)
	if err != nil {
		return err.Error()
	}
	defer r.Close()
	c := pairUp(t, r, nil)
	up, down := payload(11, 1<<20), payload(12, 1<<20)
	var wg sync.WaitGroup
	var cs, ss side
	exchange(c.client, up, 0, &wg, &cs)
	exchange(c.server, down, 0, &wg, &ss)
	wg.Wait()
	if cs.err != nil || ss.err != nil {
		return fmt.Sprintf("client: %v, server: %v", cs.err, ss.err)
	}
	if !bytes.Equal(ss.got, up) || !bytes.Equal(cs.got, down) {
		return fmt.Sprintf("bytes differ: %d of %d up, %d of %d down", len(ss.got), len(up), len(cs.got), len(down))
	}
	return "ok: 1 MiB each way, byte-exact, with half-close"
}

func bpf(cmd int, attr []byte) (int, error) {
	r, _, e := unix.Syscall(unix.SYS_BPF, uintptr(cmd), uintptr(unsafe.Pointer(&attr[0])), uintptr(len(attr)))
	runtime.KeepAlive(attr)
	if e != 0 {
		return -1, e
	}
	return int(r), nil
}
