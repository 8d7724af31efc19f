package egress

import (
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"runtime/metrics"
	"strings"
	"testing"
)

// A plain tunnel starts three goroutines in the gateway and no more: the
// connection's (the front end's: the CONNECT, the decision, the 200, the
// dial and the SNI check), the relay's on a fresh stack (the connection's
// has grown parsing the ClientHello and ends), and the relay's other
// direction. Every goroutine start while a P is idle wakes an idle thread,
// a large share of a new tunnel's CPU (docs/performance.md, "New-tunnel
// CPU"), so none may creep in per tunnel: a lookup that bypasses the
// resolver's cache (its AAAA query runs on a goroutine), a dial racing
// addresses, a watcher per tunnel. Counted with runtime/metrics over
// sequential tunnels to the real upstream (CONNECT, TLS, GET, the
// upstream's close), as the agent with a raw client that starts none
// itself; the same exchange made directly with the upstream is
// subtracted (its server's goroutines per connection). The name's answer
// has a TTL, as a real one has, so the tunnels after the first reuse it.
func TestPlainTunnelGoroutineStarts(t *testing.T) {
	h := newHarness(t, nil)
	h.dns.ttl = 60
	h.dns.set("cached.example.com", "A", "127.0.0.1")
	authority := hostPort("cached.example.com", h.up.tlsPort)
	get := func(viaGateway bool) {
		var c net.Conn
		if viaGateway {
			var code int
			if c, code = h.connect(authority, ""); code != 200 {
				t.Fatalf("CONNECT %s: %d", authority, code)
			}
		} else {
			var err error
			if c, err = net.Dial("tcp", h.up.tlsAddr); err != nil {
				t.Fatal(err)
			}
		}
		tc := tls.Client(c, &tls.Config{ServerName: "cached.example.com", RootCAs: h.up.roots, NextProtos: []string{"http/1.1"}})
		defer tc.Close()
		fmt.Fprintf(tc, "GET /bench HTTP/1.1\r\nHost: cached.example.com\r\nConnection: close\r\n\r\n")
		b, err := io.ReadAll(tc)
		if err != nil || !strings.HasPrefix(string(b), "HTTP/1.1 200") {
			t.Fatalf("GET through the tunnel: %v %.60q", err, b)
		}
	}
	created := func() uint64 {
		s := []metrics.Sample{{Name: "/sched/goroutines-created:goroutines"}}
		metrics.Read(s)
		return s[0].Value.Uint64()
	}
	const n = 50
	per := func(viaGateway bool) float64 {
		get(viaGateway) // the first one fills the resolver's cache
		before := created()
		for range n {
			get(viaGateway)
		}
		return float64(created()-before) / n
	}
	direct, proxied := per(false), per(true)
	gw := proxied - direct
	t.Logf("goroutines started per exchange: %.2f direct, %.2f through the gateway: %.2f by the gateway per tunnel", direct, proxied, gw)
	// 3 per tunnel, with slack for a timer's or a watcher's goroutine in
	// the same window; 4 (one more per tunnel) fails.
	if gw > 3.5 {
		t.Fatalf("the gateway started %.2f goroutines per plain tunnel; want 3 (the connection's, the relay's and its other direction's)", gw)
	}
}
