package dnsfilter

import (
	"net"
	"net/netip"

	"github.com/miekg/dns"

	"github.com/nixcage/nixcage/internal/egress/netguard"
)

// HTTPS and SVCB records (RFC 9460) carry parameters besides the service's
// name and priority. The filter keeps only those a client behind the
// gateway can use and strips the rest (docs/egress.md, "DNS"):
//
//   - ipv4hint and ipv6hint are addresses the client may connect to
//     directly. A cage has no route and the gateway resolves every CONNECT
//     name itself, so they are of no use there, and an allowed name's hints
//     may name loopback, private or metadata addresses (the rebinding half
//     A records are vetted for). Stripped always; a hint the proxy would
//     refuse flags the answer as such an A record does.
//   - ech hides the real server name inside the TLS ClientHello, behind the
//     outer public_name: the gateway's check that the SNI names the CONNECT
//     host (tunnelled hosts have no other) would judge the public name, and
//     intercepted hosts' handshakes would fail. Stripped, so clients send a
//     plain ClientHello.
//   - dohpath, ohttp and unknown keys (keyNNNNN) are opaque data or other
//     transports, nothing an HTTP client behind a proxy needs. Stripped.
//
// mandatory, alpn, no-default-alpn and port stay. A record whose mandatory
// list names a stripped key is dropped whole: RFC 9460 §8 says a client
// that cannot use a mandatory key must ignore the record, and one left
// without its mandatory key would be malformed.

// keptServiceKeys are the SvcParams a vetted record may keep.
var keptServiceKeys = map[dns.SVCBKey]bool{
	dns.SVCB_MANDATORY:       true,
	dns.SVCB_ALPN:            true,
	dns.SVCB_NO_DEFAULT_ALPN: true,
	dns.SVCB_PORT:            true,
}

// serviceBinding returns the SVCB part of an HTTPS or SVCB record.
func serviceBinding(rr dns.RR) *dns.SVCB {
	switch x := rr.(type) {
	case *dns.SVCB:
		return x
	case *dns.HTTPS:
		return &x.SVCB
	}
	return nil
}

// vetServiceBinding strips s's parameters to keptServiceKeys, in place. It
// returns the keys stripped, the classes of hint addresses the proxy would
// refuse, and drop: the record must go (a mandatory key was stripped).
func vetServiceBinding(s *dns.SVCB, guard *netguard.Guard) (stripped []string, refused []string, drop bool) {
	var mandatory []dns.SVCBKey
	kept := s.Value[:0:0]
	for _, kv := range s.Value {
		if m, ok := kv.(*dns.SVCBMandatory); ok {
			mandatory = m.Code
		}
		if keptServiceKeys[kv.Key()] {
			kept = append(kept, kv)
			continue
		}
		stripped = append(stripped, kv.Key().String())
		var hints []net.IP
		switch h := kv.(type) {
		case *dns.SVCBIPv4Hint:
			hints = h.Hint
		case *dns.SVCBIPv6Hint:
			hints = h.Hint
		}
		for _, ip := range hints {
			if addr, ok := netip.AddrFromSlice(ip); ok {
				if c, err := guard.Check(addr.Unmap()); err != nil {
					refused = append(refused, string(c))
				}
			}
		}
	}
	for _, k := range mandatory {
		if !keptServiceKeys[k] {
			return stripped, refused, true
		}
	}
	s.Value = kept
	return stripped, refused, false
}
