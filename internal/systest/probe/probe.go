// Package probe is the program system tests run inside a cage to find out
// what the cage lets it do. Every check prints one JSON result line and the
// test asserts on it; a check never decides pass/fail itself, so the same
// probe serves "must work" and "must fail" scenarios.
//
// Checks are argv elements, comma-separated: op,arg1,arg2. In arguments,
// @env:NAME@ is replaced by the probe's environment variable NAME, so a test
// can send what the cage actually holds (a placeholder) without the unit's
// command line knowing it.
package probe

import (
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"regexp"
	"strings"
	"syscall"
	"time"

	"github.com/coreos/go-systemd/v22/activation"
)

// Result is one check's outcome.
type Result struct {
	Check  string `json:"check"`
	OK     bool   `json:"ok"`
	Errno  string `json:"errno,omitempty"`
	Error  string `json:"error,omitempty"`
	Detail string `json:"detail,omitempty"`
	Status int    `json:"status,omitempty"`
	Body   string `json:"body,omitempty"`
}

// Run executes checks, or serves socket-activated connections ("serve").
func Run(ctx context.Context, args []string, out io.Writer) error {
	if len(args) == 1 && args[0] == "serve" {
		return serve(ctx, out)
	}
	if len(args) == 0 {
		return errors.New("usage: cage-probe CHECK... | cage-probe serve (checks: id, env,NAME, dial,tcp|udp,ADDR, raw, ping,IP, packet, read,PATH, write,PATH, unix,PATH, dns,NAME, http,URL[,HEADER,VALUE], sleep,DURATION, limit,NAME, cgroup,FILE, socket,FAMILY, iouring,FAMILY, userns,clone|unshare, clone3, sys,NAME, ptrace,1|child, vmread,1|child, setid,SRC,DST, mknod,PATH, mount,PATH, mkdir,PATH, tree,PATH[,DEPTH])")
	}
	enc := json.NewEncoder(out)
	for _, a := range args {
		r := check(ctx, a)
		if err := enc.Encode(r); err != nil {
			return fmt.Errorf("write result: %w", err)
		}
	}
	return nil
}

var envRef = regexp.MustCompile(`@env:([A-Za-z_][A-Za-z0-9_]*)@`)

func expand(s string) string {
	return envRef.ReplaceAllStringFunc(s, func(m string) string {
		return os.Getenv(envRef.FindStringSubmatch(m)[1])
	})
}

func check(ctx context.Context, spec string) Result {
	parts := strings.Split(spec, ",")
	for i := range parts {
		parts[i] = expand(parts[i])
	}
	r := Result{Check: spec}
	op, a := parts[0], parts[1:]
	need := func(n int) bool {
		if len(a) < n {
			r.Error = fmt.Sprintf("%s needs %d arguments", op, n)
			return false
		}
		return true
	}
	var err error
	switch op {
	case "id":
		r.Detail, err = identity()
	case "env":
		if need(1) {
			v, ok := os.LookupEnv(a[0])
			r.Detail = v
			if !ok {
				err = fmt.Errorf("%s is not set", a[0])
			}
		}
	case "dial":
		if need(2) {
			r.Detail, err = dial(ctx, a[0], a[1])
		}
	case "raw":
		err = openSocket(syscall.AF_INET, syscall.SOCK_RAW, syscall.IPPROTO_ICMP)
	case "raw6":
		err = openSocket(syscall.AF_INET6, syscall.SOCK_RAW, syscall.IPPROTO_ICMPV6)
	case "packet":
		err = openSocket(syscall.AF_PACKET, syscall.SOCK_RAW, 0x0300) // htons(ETH_P_ALL)
	case "ping":
		if need(1) {
			err = ping(a[0])
		}
	case "read":
		if need(1) {
			var b []byte
			b, err = os.ReadFile(a[0])
			r.Detail = truncate(string(b), 8192)
		}
	case "ls":
		if need(1) {
			var ents []os.DirEntry
			ents, err = os.ReadDir(a[0])
			var names []string
			for _, e := range ents {
				names = append(names, e.Name())
			}
			r.Detail = strings.Join(names, " ")
		}
	case "write":
		if need(1) {
			err = os.WriteFile(a[0], []byte("written by cage-probe\n"), 0o644)
		}
	case "unix":
		if need(1) {
			var c net.Conn
			c, err = net.DialTimeout("unix", a[0], 3*time.Second)
			if err == nil {
				c.Close()
			}
		}
	case "dns":
		if need(1) {
			var addrs []string
			rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			addrs, err = net.DefaultResolver.LookupHost(rctx, a[0])
			cancel()
			r.Detail = strings.Join(addrs, " ")
		}
	case "limit":
		// limit,NAME: the soft and hard values of one /proc/self/limits row,
		// e.g. limit,Max core file size.
		if need(1) {
			r.Detail, err = limit(a[0])
		}
	case "cgroup":
		// cgroup,FILE: a file of the probe's own cgroup (v2), e.g. memory.max.
		if need(1) {
			r.Detail, err = cgroupFile(a[0])
		}
	case "socket":
		// socket,FAMILY: socket(2) of unix, inet, inet6, netlink, vsock, packet.
		if need(1) {
			err = socketOf(a[0])
		}
	case "socketpair":
		// socketpair,FAMILY: socketpair(2) of the same families. The kernel
		// creates the first socket (the family's code, and on a modular
		// host the autoload of its module) before it asks the family for a
		// pair, which only AF_UNIX and AF_TIPC make.
		if need(1) {
			err = socketPairOf(a[0])
		}
	case "iouring":
		// iouring,FAMILY: the same socket through io_uring (IORING_OP_SOCKET).
		if need(1) {
			err = ioURingSocket(a[0])
		}
	case "userns":
		// userns,clone|unshare: a child in a new user namespace.
		if need(1) {
			err = userns(a[0])
		}
	case "clone3":
		r.Detail, err = clone3()
	case "sys":
		// sys,NAME: keyctl, add_key, request_key, perf_event_open, bpf,
		// fsopen, setns (kernel.go).
		if need(1) {
			err = sysCall(a[0])
		}
	case "ptrace":
		// ptrace,1|child: attach to the cage's PID 1 or a child of the probe.
		if need(1) {
			err = ptraceAttach(a[0])
		}
	case "vmread":
		// vmread,1|child: process_vm_readv of that process's memory.
		if need(1) {
			r.Detail, err = vmRead(a[0])
		}
	case "procmem":
		// procmem,1|child: /proc/PID/mem opened for writing, a word read
		// and written back: the target's memory without ptrace(2) or
		// process_vm_writev(2), which a seccomp filter sees.
		if need(1) {
			r.Detail, err = procMem(a[0])
		}
	case "setid":
		// setid,SRC,DST: copy SRC to DST, chmod 4755 and 6755, open DST's
		// directory; succeeds when a setuid or setgid bit stuck.
		if need(2) {
			r.Detail, err = setID(a[0], a[1])
		}
	case "mknod":
		if need(1) {
			err = mknod(a[0])
		}
	case "mount":
		// mount,PATH: the options of the mount at PATH.
		if need(1) {
			r.Detail, err = mountOptions(a[0])
		}
	case "mkdir":
		if need(1) {
			err = os.Mkdir(a[0], 0o755)
		}
	case "tree":
		// tree,PATH[,DEPTH]: the directories under PATH (default depth 3).
		if need(1) {
			depth := 3
			if len(a) > 1 {
				fmt.Sscan(a[1], &depth)
			}
			r.Detail, err = tree(a[0], depth)
			r.Detail = truncate(r.Detail, 16384)
		}
	case "sleep":
		if need(1) {
			var d time.Duration
			if d, err = time.ParseDuration(a[0]); err == nil {
				select {
				case <-time.After(d):
				case <-ctx.Done():
				}
			}
		}
	case "http":
		if need(1) {
			r.Status, r.Body, err = httpGet(ctx, a[0], a[1:])
		}
	default:
		r.Error = "unknown check " + op
		return r
	}
	if r.Error != "" {
		return r
	}
	r.OK = err == nil
	if err != nil {
		r.Error = err.Error()
		var errno syscall.Errno
		if errors.As(err, &errno) {
			r.Errno = errnoName(errno)
		}
	}
	return r
}

func identity() (string, error) {
	data, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return "", err
	}
	var keep []string
	for _, line := range strings.Split(string(data), "\n") {
		for _, k := range []string{"Uid:", "Gid:", "Groups:", "CapEff:", "CapBnd:", "NoNewPrivs:", "Seccomp:"} {
			if strings.HasPrefix(line, k) {
				keep = append(keep, strings.Join(strings.Fields(line), " "))
			}
		}
	}
	if m, err := os.ReadFile("/proc/self/uid_map"); err == nil {
		keep = append(keep, "uid_map: "+strings.Join(strings.Fields(string(m)), " "))
	}
	return strings.Join(keep, "; "), nil
}

func limit(name string) (string, error) {
	data, err := os.ReadFile("/proc/self/limits")
	if err != nil {
		return "", err
	}
	for _, line := range strings.Split(string(data), "\n") {
		if strings.HasPrefix(line, name+" ") {
			f := strings.Fields(strings.TrimPrefix(line, name))
			if len(f) >= 2 {
				return f[0] + " " + f[1], nil
			}
		}
	}
	return "", fmt.Errorf("no limit %q", name)
}

func cgroupFile(name string) (string, error) {
	data, err := os.ReadFile("/proc/self/cgroup")
	if err != nil {
		return "", err
	}
	for _, line := range strings.Split(string(data), "\n") {
		if p, ok := strings.CutPrefix(line, "0::"); ok {
			b, err := os.ReadFile(cgroupRoot(p) + "/" + name)
			return strings.TrimSpace(string(b)), err
		}
	}
	return "", errNoCgroup
}

func dial(ctx context.Context, network, addr string) (string, error) {
	d := net.Dialer{Timeout: 3 * time.Second}
	c, err := d.DialContext(ctx, network, addr)
	if err != nil {
		return "", err
	}
	defer c.Close()
	if network == "udp" {
		// connect() on UDP only looks up a route; a send proves the datagram
		// would leave.
		_, err := c.Write([]byte("cage-probe"))
		return "", err
	}
	// A stream peer may greet; report what it says (servers that wait for the
	// client first just time out here, which is not an error).
	c.SetReadDeadline(time.Now().Add(time.Second))
	buf := make([]byte, 256)
	n, _ := c.Read(buf)
	return strings.TrimSpace(string(buf[:n])), nil
}

func openSocket(domain, typ, proto int) error {
	fd, err := syscall.Socket(domain, typ, proto)
	if err != nil {
		return err
	}
	syscall.Close(fd)
	return nil
}

// ping sends one ICMP echo from an unprivileged ICMP socket (allowed by
// net.ipv4.ping_group_range on many hosts): the kernel must still refuse to
// route it.
func ping(ip string) error {
	addr := net.ParseIP(ip).To4()
	if addr == nil {
		return fmt.Errorf("ping needs an IPv4 address, got %q", ip)
	}
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_DGRAM, syscall.IPPROTO_ICMP)
	if err != nil {
		return err
	}
	defer syscall.Close(fd)
	echo := []byte{8, 0, 0, 0, 0, 1, 0, 1}
	sa := &syscall.SockaddrInet4{}
	copy(sa.Addr[:], addr)
	return syscall.Sendto(fd, echo, 0, sa)
}

// httpGet uses the proxy from the environment (HTTPS_PROXY, as the cage sets
// it) and the CA bundle from SSL_CERT_FILE (read by Go's crypto/x509).
func httpGet(ctx context.Context, url string, header []string) (int, string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return 0, "", err
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	c := &http.Client{
		Timeout: 15 * time.Second,
		Transport: &http.Transport{
			Proxy:           http.ProxyFromEnvironment,
			TLSClientConfig: &tls.Config{},
		},
	}
	resp, err := c.Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 8192))
	return resp.StatusCode, string(b), nil
}

// serve answers every connection on its socket-activated listeners with one
// line naming the uid it runs as, which tells the test both that activation
// handed over the socket and which user got it.
func serve(ctx context.Context, out io.Writer) error {
	ls, err := activation.Listeners()
	if err != nil {
		return fmt.Errorf("socket activation: %w", err)
	}
	if len(ls) == 0 {
		return errors.New("socket activation: no listeners passed (LISTEN_FDS unset)")
	}
	fmt.Fprintf(out, "serving %d listeners as uid %d\n", len(ls), os.Getuid())
	errc := make(chan error, len(ls))
	for _, l := range ls {
		go func(l net.Listener) {
			for {
				c, err := l.Accept()
				if err != nil {
					errc <- err
					return
				}
				fmt.Fprintf(c, "hello from uid %d\n", os.Getuid())
				c.Close()
			}
		}(l)
	}
	select {
	case <-ctx.Done():
		return nil
	case err := <-errc:
		return err
	}
}

func errnoName(e syscall.Errno) string {
	names := map[syscall.Errno]string{
		syscall.ENETUNREACH:     "ENETUNREACH",
		syscall.EHOSTUNREACH:    "EHOSTUNREACH",
		syscall.ECONNREFUSED:    "ECONNREFUSED",
		syscall.EPERM:           "EPERM",
		syscall.EACCES:          "EACCES",
		syscall.ENOENT:          "ENOENT",
		syscall.EAFNOSUPPORT:    "EAFNOSUPPORT",
		syscall.EPROTONOSUPPORT: "EPROTONOSUPPORT",
		syscall.EROFS:           "EROFS",
		syscall.ETIMEDOUT:       "ETIMEDOUT",
		syscall.EADDRNOTAVAIL:   "EADDRNOTAVAIL",
		syscall.ENOTDIR:         "ENOTDIR",
		syscall.EINVAL:          "EINVAL",
		syscall.ENOSYS:          "ENOSYS",
		syscall.EEXIST:          "EEXIST",
	}
	if n, ok := names[e]; ok {
		return n
	}
	return fmt.Sprintf("errno %d", int(e))
}

func truncate(s string, n int) string {
	if len(s) > n {
		return s[:n] + "..."
	}
	return s
}

// Parse reads the result lines a probe printed.
func Parse(out string) ([]Result, error) {
	var rs []Result
	for _, line := range strings.Split(out, "\n") {
		line = strings.TrimSpace(line)
		if !strings.HasPrefix(line, "{") {
			continue
		}
		var r Result
		if err := json.Unmarshal([]byte(line), &r); err != nil {
			return nil, fmt.Errorf("parse probe result %q: %w", line, err)
		}
		rs = append(rs, r)
	}
	return rs, nil
}

// ParseByCheck reads the result lines a probe printed, keyed by check (a
// check run twice keeps its last result).
func ParseByCheck(out string) (map[string]Result, error) {
	rs, err := Parse(out)
	if err != nil {
		return nil, err
	}
	got := make(map[string]Result, len(rs))
	for _, r := range rs {
		got[r.Check] = r
	}
	return got, nil
}
