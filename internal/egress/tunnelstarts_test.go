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

// A plain tunnel starts two goroutines in the gateway: the connection's
// own (the front end's, which reads the CONNECT, decides, opens the tunnel
// and then relays one direction) and the relay's other direction. Every
// goroutine start while a P is idle wakes an idle thread, the largest
// share of a new tunnel's CPU (docs/performance.md, "New-tunnel CPU"); the
// relay ran on a third, fresh goroutine before issue 20's sixth pass.
// Counted with runtime/metrics over sequential tunnels to the real
// upstream (CONNECT, TLS, GET, the upstream's close), as the agent with a
// raw client that starts none itself; the same exchange made directly
// with the upstream is subtracted (its server's goroutines per
// connection). The name's answer has a TTL, as a real one has, so the
// tunnels after the first reuse it (a lookup starts the AAAA query's
// goroutine, and the fake resolver's own).
func TestPlainTunnelStartsTwoGoroutines(t *testing.T) {
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
	// 2 per tunnel, with slack for a timer's or a watcher's goroutine in
	// the same window; 3 (the relay on a goroutine of its own) fails.
	if gw > 2.5 {
		t.Fatalf("the gateway started %.2f goroutines per plain tunnel; want 2 (the connection's, which relays one direction, and the other direction's)", gw)
	}
}
