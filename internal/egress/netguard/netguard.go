// Package netguard classifies IP addresses so the gateway dials only public
// internet addresses. The gateway resolves a name once, classifies every
// address it got, and dials exactly the address it vetted; the dialer's
// Control hook classifies again at connect(2) time so that no code path can
// dial an address this package has not seen.
package netguard

import (
	"fmt"
	"net"
	"net/netip"
	"syscall"
)

// Class is the kind of an address. Only Public may be dialed by default.
type Class string

// Classes, named so that audit reasons read well.
const (
	Public      Class = "public"
	Loopback    Class = "loopback"
	Private     Class = "private"
	CGNAT       Class = "cgnat"
	LinkLocal   Class = "link-local"
	Metadata    Class = "metadata"
	Multicast   Class = "multicast"
	Unspecified Class = "unspecified"
	Reserved    Class = "reserved"
	Embedded    Class = "ipv6-embeds-ipv4"
	Own         Class = "own-address"
)

type rng struct {
	p netip.Prefix
	c Class
}

func mp(s string, c Class) rng { return rng{netip.MustParsePrefix(s), c} }

// table is checked in order; the first match wins, so narrower prefixes come
// before the ranges that contain them (metadata before link-local).
// TEST-NET-1/2/3 and 2001:db8::/32 are deliberately absent (= public): they
// never route on the internet, and system tests place fake upstreams there.
var table = []rng{
	mp("169.254.169.254/32", Metadata), // AWS, GCP, Azure, OpenStack
	mp("100.100.100.200/32", Metadata), // Alibaba
	mp("192.0.0.192/32", Metadata),     // Oracle
	mp("fd00:ec2::254/128", Metadata),  // AWS IPv6
	mp("0.0.0.0/8", Unspecified),
	mp("10.0.0.0/8", Private),
	mp("100.64.0.0/10", CGNAT),
	mp("127.0.0.0/8", Loopback),
	mp("169.254.0.0/16", LinkLocal),
	mp("172.16.0.0/12", Private),
	mp("192.0.0.0/24", Reserved), // IETF protocol assignments
	mp("192.88.99.0/24", Reserved),
	mp("192.168.0.0/16", Private),
	mp("198.18.0.0/15", Reserved), // benchmarking
	mp("224.0.0.0/4", Multicast),
	mp("240.0.0.0/4", Reserved), // includes 255.255.255.255
	mp("::/128", Unspecified),
	mp("::1/128", Loopback),
	mp("::/96", Embedded), // IPv4-compatible (deprecated)
	mp("64:ff9b::/96", Embedded),
	mp("64:ff9b:1::/48", Embedded),
	mp("100::/64", Reserved),  // discard
	mp("2001::/32", Embedded), // Teredo
	mp("2002::/16", Embedded), // 6to4
	mp("fc00::/7", Private),
	mp("fe80::/10", LinkLocal),
	mp("fec0::/10", Private), // site-local (deprecated)
	mp("ff00::/8", Multicast),
}

// Classify returns the class of ip. IPv4-mapped IPv6 addresses are
// classified as the IPv4 address they carry.
func Classify(ip netip.Addr) Class {
	ip = ip.Unmap().WithZone("")
	if !ip.IsValid() {
		return Reserved
	}
	for _, r := range table {
		if r.p.Contains(ip) {
			return r.c
		}
	}
	return Public
}

// Guard decides which addresses may be dialed.
type Guard struct {
	// UnsafeAllowLoopback and UnsafeAllowPrivate weaken the guard for tests
	// (policy unsafe_allow_*). Private covers RFC 1918, ULA and CGNAT; it never
	// covers metadata, link-local, multicast or embedded forms.
	UnsafeAllowLoopback bool
	UnsafeAllowPrivate  bool
	// Own are addresses of this host's interfaces (other than loopback); a
	// cage must not reach services on the gateway's own host.
	Own map[netip.Addr]bool
	// Forbidden are exact endpoints never dialed: the gateway's own listeners,
	// so that a permissive test policy cannot make the proxy loop into itself.
	Forbidden map[netip.AddrPort]bool
}

// OwnAddrs lists the non-loopback addresses of this host's interfaces.
func OwnAddrs() map[netip.Addr]bool {
	own := map[netip.Addr]bool{}
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return own
	}
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok {
			if ip, ok := netip.AddrFromSlice(n.IP); ok && !ip.Unmap().IsLoopback() {
				own[ip.Unmap()] = true
			}
		}
	}
	return own
}

// Check returns the class of ip and an error if it may not be dialed.
func (g *Guard) Check(ip netip.Addr) (Class, error) {
	ip = ip.Unmap().WithZone("")
	c := Classify(ip)
	switch {
	case c == Public:
	case c == Loopback && g.UnsafeAllowLoopback:
	case (c == Private || c == CGNAT) && g.UnsafeAllowPrivate:
	default:
		return c, fmt.Errorf("address %s is %s", ip, c)
	}
	if g.Own[ip] {
		return Own, fmt.Errorf("address %s is one of the gateway's own addresses", ip)
	}
	return c, nil
}

// CheckEndpoint is Check plus the gateway's own listeners.
func (g *Guard) CheckEndpoint(ap netip.AddrPort) (Class, error) {
	c, err := g.Check(ap.Addr())
	if err != nil {
		return c, err
	}
	if g.Forbidden[netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())] {
		return Own, fmt.Errorf("address %s is the gateway's own listener", ap)
	}
	return c, nil
}

// Control is a net.Dialer Control hook: it re-checks the exact address the
// kernel is about to connect to, after all resolution, so a bug elsewhere
// cannot turn into a connection to a forbidden address.
func (g *Guard) Control(network, address string, _ syscall.RawConn) error {
	ap, err := netip.ParseAddrPort(address)
	if err != nil {
		return fmt.Errorf("netguard: dial address %q: %w", address, err)
	}
	if _, err := g.CheckEndpoint(ap); err != nil {
		return fmt.Errorf("netguard: %w", err)
	}
	return nil
}
