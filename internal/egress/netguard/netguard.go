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

	"github.com/nixcage/nixcage/internal/netclass"
)

// Class is the kind of an address (internal/netclass holds the table).
// Only Public may be dialed by default.
type Class = netclass.Class

// Classes, named so that audit reasons read well.
const (
	Public      = netclass.Public
	Loopback    = netclass.Loopback
	Private     = netclass.Private
	CGNAT       = netclass.CGNAT
	LinkLocal   = netclass.LinkLocal
	Metadata    = netclass.Metadata
	Multicast   = netclass.Multicast
	Unspecified = netclass.Unspecified
	Reserved    = netclass.Reserved
	Embedded    = netclass.Embedded
	Own         = netclass.Own
)

// Classify returns the class of ip (see netclass.Classify).
func Classify(ip netip.Addr) Class { return netclass.Classify(ip) }

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
