package dnsfilter

import (
	"context"
	"fmt"
	"net"
	"testing"

	"github.com/miekg/dns"
)

// TestResolverCacheBounded: the gateway's Resolver does not hold an answer
// of thousands of addresses (an upstream answering each name with 4000
// would hold 4096 of them, about 800 MB, in a gateway limited to 512 MiB);
// an ordinary answer is still cached. Red team: before the fix every such
// answer was kept.
func TestResolverCacheBounded(t *testing.T) {
	// One port for UDP and TCP (the Resolver retries a TC answer over
	// TCP at the same address); another process may hold the TCP one.
	var pc net.PacketConn
	var l net.Listener
	for i := 0; l == nil; i++ {
		var err error
		if pc, err = net.ListenPacket("udp", "127.0.0.1:0"); err != nil {
			t.Fatal(err)
		}
		if l, err = net.Listen("tcp", pc.LocalAddr().String()); err != nil {
			pc.Close()
			if i == 20 {
				t.Fatal(err)
			}
		}
	}
	handler := dns.HandlerFunc(func(w dns.ResponseWriter, r *dns.Msg) {
		m := new(dns.Msg)
		m.SetReply(r)
		q := r.Question[0]
		n := 1
		if q.Name != "small.example.com." {
			n = 4000
		}
		switch {
		case q.Qtype != dns.TypeA:
		case n > 1 && w.LocalAddr().Network() == "udp":
			m.Truncated = true
		default:
			for i := range n {
				m.Answer = append(m.Answer, &dns.A{Hdr: dns.RR_Header{Name: q.Name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: 300}, A: net.IPv4(198, 51, byte(i>>8), byte(i))})
			}
		}
		m.Compress = true
		_ = w.WriteMsg(m)
	})
	us, ts := &dns.Server{PacketConn: pc, Handler: handler}, &dns.Server{Listener: l, Handler: handler}
	go us.ActivateAndServe()
	go ts.ActivateAndServe()
	t.Cleanup(func() { us.Shutdown(); ts.Shutdown() })

	r := &Resolver{Server: pc.LocalAddr().String()}
	for i := range 5 {
		addrs, _, err := r.LookupChain(context.Background(), fmt.Sprintf("n%d.big.example.com", i))
		if err != nil || len(addrs) != 4000 {
			t.Fatalf("lookup %d: %d addresses, %v", i, len(addrs), err)
		}
	}
	if _, _, err := r.LookupChain(context.Background(), "small.example.com"); err != nil {
		t.Fatal(err)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	held := 0
	for _, e := range r.answers {
		held += len(e.addrs)
	}
	if held != 1 || len(r.answers) != 1 {
		t.Fatalf("the Resolver holds %d answers of %d addresses; want only small.example.com's one", len(r.answers), held)
	}
}
