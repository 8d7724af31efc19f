// Package netclass classifies IP addresses (public, loopback, private,
// link-local, cloud metadata, ...). It is the one table of address classes:
// the egress gateway's guard (internal/egress/netguard) and the release
// fetcher (internal/release, which the CLI links and so may not import the
// gateway's packages) both decide with it.
package netclass

import "net/netip"

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
