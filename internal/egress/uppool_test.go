package egress

import (
	"fmt"
	"net"
	"net/netip"
	"testing"
)

// The idle list of upstream connections is bounded over all hosts, not only
// per host: an agent allowed a wildcard cannot park a connection for every
// name it resolves. Connections over the bound are closed, not kept.
func TestUpstreamPoolBoundedOverAllHosts(t *testing.T) {
	var p upPool
	var ends []net.Conn
	defer func() {
		for _, c := range ends {
			c.Close()
		}
	}()
	dst := netip.MustParseAddrPort("192.0.2.1:443")
	for i := range maxIdleTotal + 20 {
		a, b := net.Pipe()
		ends = append(ends, a, b)
		p.put(&upConn{key: upKey{host: fmt.Sprintf("h%d.example.com", i), dst: dst}, tc: a})
	}
	if p.n != maxIdleTotal {
		t.Fatalf("idle connections over all hosts: %d, want the bound %d", p.n, maxIdleTotal)
	}
	// A connection put over the bound was closed: its peer reads EOF.
	last := ends[len(ends)-1]
	if _, err := last.Read(make([]byte, 1)); err == nil {
		t.Fatal("a connection over the bound was kept open")
	}
	// Taking one frees a place.
	if c := p.get(upKey{host: "h0.example.com", dst: dst}); c == nil {
		t.Fatal("the first host's connection is not in the idle list")
	}
	if p.n != maxIdleTotal-1 {
		t.Fatalf("after get: %d idle, want %d", p.n, maxIdleTotal-1)
	}
	a, b := net.Pipe()
	ends = append(ends, a, b)
	p.put(&upConn{key: upKey{host: "again.example.com", dst: dst}, tc: a})
	if p.n != maxIdleTotal {
		t.Fatalf("after a put into the freed place: %d idle, want %d", p.n, maxIdleTotal)
	}
	p.mu.Lock()
	for _, cs := range p.idle {
		for _, c := range cs {
			c.timer.Stop()
		}
	}
	p.mu.Unlock()
}
