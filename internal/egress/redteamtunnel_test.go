package egress

import (
	"bufio"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/nixcage/nixcage/internal/egress/audit"
	"github.com/nixcage/nixcage/internal/egress/ca"
	"github.com/nixcage/nixcage/internal/policy"
	"github.com/nixcage/nixcage/internal/testenv"
)

// Red team of the plain-tunnel copy loop (tunnel.go, splicer.go), as the
// caged agent: a process in the cage's network namespace whose only way
// out is the real gateway (a separate, socket-activated process), against
// an allowed TLS upstream on loopback.

// streamingUpstream is a TLS server (the harness's upstream CA) that, once
// the handshake is done, writes to each connection until the write fails,
// and reads from it only if read is set.
func streamingUpstream(t *testing.T, caDir string, read bool) int {
	t.Helper()
	l := upstreamListener(t, caDir)
	serveEach(l, func(c net.Conn) {
		tc := c.(*tls.Conn)
		if tc.Handshake() != nil {
			return
		}
		if read {
			go io.Copy(io.Discard, tc)
		}
		buf := []byte(strings.Repeat("stream ", 4096))
		for {
			if _, err := tc.Write(buf); err != nil {
				return
			}
		}
	})
	return l.Addr().(*net.TCPAddr).Port
}

// countedConn counts the bytes read from and written to a connection.
type countedConn struct {
	net.Conn
	read, written atomic.Int64
}

func (c *countedConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	c.read.Add(int64(n))
	return n, err
}

func (c *countedConn) Write(p []byte) (int, error) {
	n, err := c.Conn.Write(p)
	c.written.Add(int64(n))
	return n, err
}

// cageTunnel is the agent's side of a plain tunnel: a TCP connection
// dialled from inside the cage's network namespace, a CONNECT to host:port, then a TLS handshake
// with the upstream through it. raw counts the bytes that crossed the
// agent's socket after the CONNECT answer, which are what the close record
// must count.
func cageTunnel(t *testing.T, h *harness, host string, port int) (raw *countedConn, tc *tls.Conn) {
	t.Helper()
	var c net.Conn
	if err := inNetns(h.cageNetns, func() (err error) {
		c, err = net.DialTimeout("tcp", "127.0.0.1:3128", 10*time.Second)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	auth := host + ":" + strconv.Itoa(port)
	fmt.Fprintf(c, "CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n", auth, auth)
	// Read the answer byte by byte: nothing past it may be consumed here.
	br := bufio.NewReaderSize(oneByte{c}, 16)
	resp, err := http.ReadResponse(br, &http.Request{Method: http.MethodConnect})
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("CONNECT %s from the cage: %v %v", auth, resp, err)
	}
	raw = &countedConn{Conn: c}
	tc = tls.Client(raw, &tls.Config{ServerName: host, RootCAs: h.up.roots})
	tc.SetDeadline(time.Now().Add(10 * time.Second))
	if err := tc.Handshake(); err != nil {
		t.Fatalf("TLS through the tunnel to %s: %v", auth, err)
	}
	tc.SetDeadline(time.Time{})
	return raw, tc
}

// oneByte reads at most one byte per Read.
type oneByte struct{ io.Reader }

func (r oneByte) Read(p []byte) (int, error) { return r.Reader.Read(p[:min(1, len(p))]) }

// noClose fails if a close record for host:port appears within d.
func noClose(t *testing.T, h *harness, host string, port int, d time.Duration, why string) {
	t.Helper()
	for end := time.Now().Add(d); ; time.Sleep(100 * time.Millisecond) {
		for _, r := range h.records(t) {
			if closed("CONNECT", host, port)(r) {
				t.Fatalf("%s: the tunnel was closed: %+v", why, r)
			}
		}
		if !time.Now().Before(end) {
			return
		}
	}
}

// closeWithin waits up to d for the close record of the tunnel to host:port.
func closeWithin(t *testing.T, h *harness, host string, port int, d time.Duration, why string) audit.Record {
	t.Helper()
	for end := time.Now().Add(d); ; time.Sleep(100 * time.Millisecond) {
		for _, r := range h.records(t) {
			if closed("CONNECT", host, port)(r) {
				return r
			}
		}
		if time.Now().After(end) {
			t.Fatalf("%s: no close record %v later; audit:\n%s", why, d, h.dump())
		}
	}
}

// tunnelCage runs a cage whose policy tunnels (never intercepts)
// plain.example.com, to an upstream made by up (its port is returned),
// with an idle timeout of idle seconds, and returns the gateway's process.
func tunnelCage(t *testing.T, idle int, mutate func(*policy.Runtime), up func(caDir string) int) (*harness, int, *exec.Cmd) {
	testenv.RequirePrivileged(t)
	var port int
	h := setupHarness(t, func(rt *policy.Runtime) {
		if mutate != nil {
			mutate(rt)
		}
		rt.Policy.Inspect = nil
		rt.Secrets = nil
		rt.Policy.Limits.IdleTimeoutSeconds = idle
		port = up(filepath.Join(filepath.Dir(rt.AuditFile), "upstream-ca"))
		rt.Policy.Ports = append(rt.Policy.Ports, port)
	})
	_, gw := startCage(t, h)
	return h, port, gw
}

// TestRedTeamTunnelIdleWhileThePumpWaits: the idle timeout ("tunnels
// close when no byte moved either way for idle_timeout_seconds",
// docs/egress.md) must hold while the copy loop waits to write, not only
// while it waits to read. Before the fix the write had no deadline:
//   - an agent that half-closed its side and stopped reading, under an
//     upstream that streams, kept its tunnel (its slot, a kernel pipe full of
//     bytes, both sockets' buffers) forever: the direction that could time
//     out had ended at the agent's FIN, the other waited to write forever;
//   - an agent that writes and never reads, to an upstream that does the
//     same, did too: both directions waited to write, neither to read.
//
// The close record's byte counts are what really crossed the agent's
// socket, for a tunnel cut by the idle timeout too.
func TestRedTeamTunnelIdleWhileThePumpWaits(t *testing.T) {
	const idle = 2
	t.Run("half-closed and not reading", func(t *testing.T) {
		h, port, _ := tunnelCage(t, idle, nil, func(dir string) int { return streamingUpstream(t, dir, false) })
		raw, _ := cageTunnel(t, h, "plain.example.com", port)
		// Half-close and stop reading: nothing moves either way now.
		if err := raw.Conn.(*net.TCPConn).CloseWrite(); err != nil {
			t.Fatal(err)
		}
		r := closeWithin(t, h, "plain.example.com", port, idle*time.Second+10*time.Second, "half-closed agent that stopped reading")
		if !strings.Contains(r.Reason, "idle timeout") {
			t.Errorf("close reason %q, want the idle timeout", r.Reason)
		}
		// Everything the gateway counted reaches the agent, then EOF.
		raw.SetReadDeadline(time.Now().Add(20 * time.Second))
		if _, err := io.Copy(io.Discard, raw); err != nil {
			t.Fatalf("reading the rest after the cut: %v", err)
		}
		if r.BytesIn != raw.read.Load() || r.BytesOut != raw.written.Load() {
			t.Errorf("close record bytes_out %d bytes_in %d; the agent sent %d and received %d", r.BytesOut, r.BytesIn, raw.written.Load(), raw.read.Load())
		}
	})
	t.Run("neither side reads", func(t *testing.T) {
		h, port, _ := tunnelCage(t, idle, nil, func(dir string) int { return streamingUpstream(t, dir, false) })
		_, tc := cageTunnel(t, h, "plain.example.com", port)
		go func() {
			buf := []byte(strings.Repeat("upload ", 4096))
			for {
				if _, err := tc.Write(buf); err != nil {
					return
				}
			}
		}()
		r := closeWithin(t, h, "plain.example.com", port, idle*time.Second+10*time.Second, "tunnel whose both ends stopped reading")
		if !strings.Contains(r.Reason, "idle timeout") {
			t.Errorf("close reason %q, want the idle timeout", r.Reason)
		}
	})
}

// holdingUpstream is a TLS server (the harness's upstream CA) that, once
// the handshake is done, neither reads nor writes: it hands each
// connection, counting the raw bytes read from it, to conns and holds it
// until the test ends.
func holdingUpstream(t *testing.T, caDir string, conns chan<- *countedConn) int {
	t.Helper()
	a, err := ca.Load(filepath.Join(caDir, ca.KeyFile), filepath.Join(caDir, ca.CertFile))
	if err != nil {
		t.Fatal(err)
	}
	cfg := &tls.Config{GetCertificate: func(h *tls.ClientHelloInfo) (*tls.Certificate, error) { return a.Leaf(h.ServerName) }}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	ctx := t.Context()
	serveEach(l, func(c net.Conn) {
		cc := &countedConn{Conn: c}
		if tls.Server(cc, cfg).Handshake() != nil {
			return
		}
		select {
		case conns <- cc:
		case <-ctx.Done():
			return
		}
		<-ctx.Done()
	})
	return l.Addr().(*net.TCPAddr).Port
}

// TestRedTeamBanCutsTunnelWaitingToWrite: a ban closes the open tunnel to
// the banned host at once (docs/fleet.md), also while the copy loop waits
// to write to an upstream that does not read. Before the fix the ban
// closed only the agent's connection, which neither direction was waiting
// on (one waited to write to the upstream, the other to read from it): the
// tunnel stayed open until the idle timeout, its upstream connection too,
// and the close record came that late. The close record names the ban and
// counts what reached the upstream, which gets EOF right after.
func TestRedTeamBanCutsTunnelWaitingToWrite(t *testing.T) {
	var bfile, gfile string
	conns := make(chan *countedConn, 1)
	h, port, _ := tunnelCage(t, 60, banPolicy(t, &bfile, &gfile), func(dir string) int { return holdingUpstream(t, dir, conns) })
	_, tc := cageTunnel(t, h, "plain.example.com", port)
	upc := <-conns
	go func() {
		buf := []byte(strings.Repeat("upload ", 4096))
		for {
			if _, err := tc.Write(buf); err != nil {
				return
			}
		}
	}()
	// Let the gateway fill the upstream's socket and wait to write.
	time.Sleep(time.Second)
	writeBans(t, bfile, policy.Ban{ID: "b-0123456789ab", Host: "plain.example.com", Agent: "alice", CreatedUnix: time.Now().Unix(), Command: strings.Repeat("ab", 32), Reason: "exfiltration endpoint"})
	r := closeWithin(t, h, "plain.example.com", port, 10*time.Second, "tunnel to a banned host waiting to write")
	if !strings.Contains(r.Reason, "banned by b-0123456789ab") {
		t.Errorf("close record reason %q does not name the ban", r.Reason)
	}
	// The upstream's connection ends: it gets what the record counts, then
	// EOF (or a reset), and nothing more of the agent's.
	upc.SetReadDeadline(time.Now().Add(10 * time.Second))
	_, err := io.Copy(io.Discard, upc)
	if ne, ok := err.(net.Error); ok && ne.Timeout() {
		t.Fatalf("the banned upstream's connection is still open after the ban (read %d bytes)", upc.read.Load())
	}
	if err == nil && upc.read.Load() != r.BytesOut {
		t.Errorf("the upstream read %d bytes; the close record says bytes_out %d", upc.read.Load(), r.BytesOut)
	}
}

// TestRedTeamTunnelAtTheDescriptorLimit: a gateway out of file
// descriptors keeps carrying its open tunnels. Before the fix a tunnel
// whose bytes found the pipe pool empty (the agent's tunnels that nobody
// reads each hold a pipe full of bytes) asked the kernel for a pipe, got
// EMFILE and was closed; io.Copy's splice before it fell back to
// read/write, and so does the copy loop now. As the agent: 20 tunnels
// that stop reading, the gateway held at its descriptor limit (lowered to
// what it has open), then requests in an open tunnel.
func TestRedTeamTunnelAtTheDescriptorLimit(t *testing.T) {
	h, port, gw := tunnelCage(t, 30, nil, func(dir string) int { return streamingUpstream(t, dir, false) })
	_, tc := cageTunnel(t, h, "plain.example.com", h.up.tlsPort)
	br := bufio.NewReader(tc)
	if st := tlsGet(t, tc, br, "plain.example.com"); st != http.StatusOK {
		t.Fatalf("open tunnel: %d", st)
	}
	// Each holds the pipe of the upstream's bytes the agent does not read.
	for range 20 {
		raw, _ := cageTunnel(t, h, "plain.example.com", port)
		raw.Conn.(*net.TCPConn).CloseWrite()
	}
	time.Sleep(time.Second)
	pid := gw.Process.Pid
	fds, err := os.ReadDir("/proc/" + strconv.Itoa(pid) + "/fd")
	if err != nil {
		t.Fatal(err)
	}
	var was unix.Rlimit
	if err := unix.Prlimit(pid, unix.RLIMIT_NOFILE, nil, &was); err != nil {
		t.Fatal(err)
	}
	if err := unix.Prlimit(pid, unix.RLIMIT_NOFILE, &unix.Rlimit{Cur: uint64(len(fds)), Max: was.Max}, nil); err != nil {
		t.Fatal(err)
	}
	defer unix.Prlimit(pid, unix.RLIMIT_NOFILE, &was, nil)
	for i := range 3 {
		tc.SetDeadline(time.Now().Add(10 * time.Second))
		fmt.Fprintf(tc, "GET /g HTTP/1.1\r\nHost: plain.example.com\r\n\r\n")
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatalf("request %d in the open tunnel at the descriptor limit: %v; audit:\n%s", i, err, h.dump())
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
}
