package egress

import (
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nixcage/nixcage/internal/egress/audit"
	"github.com/nixcage/nixcage/internal/policy"
)

// A plain tunnel's upstream is dialled while the agent sends its
// ClientHello (openTunnel's early dial). A tunnel refused at the SNI check
// (fronting, plain bytes) must still send the upstream nothing: the early
// connection is closed unused, and no byte of the agent's reaches it.
// The upstream here is a raw TCP listener that records what it receives.
func TestEarlyDialOfRefusedTunnelCarriesNothing(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	port := l.Addr().(*net.TCPAddr).Port
	// Connections the upstream accepted, those closed, and the bytes they
	// carried. A refusal made before the dial reached connect(2) cancels it
	// and the upstream sees no connection at all, which is fine too.
	var accepted, done, carried atomic.Int64
	serveEach(l, func(c net.Conn) {
		accepted.Add(1)
		c.SetReadDeadline(time.Now().Add(20 * time.Second))
		b, _ := io.ReadAll(c)
		carried.Add(int64(len(b)))
		done.Add(1)
	})
	h := newHarness(t, func(rt *policy.Runtime) { rt.Policy.Ports = append(rt.Policy.Ports, port) })
	auth := "plain.example.com:" + strconv.Itoa(port)
	for _, c := range []struct {
		name, rule string
		send       func(net.Conn)
	}{
		{"fronted SNI", "sni-mismatch", func(conn net.Conn) {
			tls.Client(conn, &tls.Config{ServerName: "denied.example.com", InsecureSkipVerify: true}).Handshake()
		}},
		{"plain bytes", "not-tls", func(conn net.Conn) {
			fmt.Fprintf(conn, "GET / HTTP/1.1\r\nHost: plain.example.com\r\n\r\n")
			io.ReadAll(conn)
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			conn, code := h.connect(auth, "")
			if code != http.StatusOK {
				t.Fatalf("CONNECT: %d", code)
			}
			conn.SetDeadline(time.Now().Add(10 * time.Second))
			c.send(conn)
			conn.Close()
			h.want(t, is("CONNECT", "plain.example.com", port), audit.Blocked, c.rule)
			// A moment for the upstream to accept what the kernel queued.
			settle, deadline := time.Now().Add(300*time.Millisecond), time.Now().Add(10*time.Second)
			for (done.Load() < accepted.Load() || time.Now().Before(settle)) && time.Now().Before(deadline) {
				time.Sleep(10 * time.Millisecond)
			}
			if a, d := accepted.Load(), done.Load(); d < a {
				t.Fatalf("%d early upstream connections of refused tunnels were never closed", a-d)
			}
			if n := carried.Load(); n != 0 {
				t.Fatalf("upstream received %d bytes of a refused tunnel", n)
			}
		})
	}
}
