package netguard

import (
	"net/netip"
	"testing"
)

func TestClassify(t *testing.T) {
	cases := map[string]Class{
		"1.1.1.1":                Public,
		"192.0.2.10":             Public, // TEST-NET-1: system tests' fake internet
		"198.51.100.7":           Public, // TEST-NET-2
		"203.0.113.99":           Public, // TEST-NET-3
		"2001:db8::1":            Public,
		"2606:4700::1111":        Public,
		"127.0.0.1":              Loopback,
		"127.255.0.1":            Loopback,
		"::1":                    Loopback,
		"::ffff:127.0.0.1":       Loopback, // IPv4-mapped is the IPv4 address
		"10.0.0.1":               Private,
		"172.16.5.4":             Private,
		"172.31.255.255":         Private,
		"172.32.0.1":             Public,
		"192.168.1.1":            Private,
		"fd00::1":                Private,
		"fec0::1":                Private,
		"100.64.0.1":             CGNAT,
		"100.127.255.254":        CGNAT,
		"169.254.1.1":            LinkLocal,
		"fe80::1":                LinkLocal,
		"169.254.169.254":        Metadata,
		"fd00:ec2::254":          Metadata,
		"100.100.100.200":        Metadata,
		"224.0.0.1":              Multicast,
		"ff02::1":                Multicast,
		"0.0.0.0":                Unspecified,
		"::":                     Unspecified,
		"255.255.255.255":        Reserved,
		"240.0.0.1":              Reserved,
		"198.18.0.1":             Reserved,
		"64:ff9b::a9fe:a9fe":     Embedded, // NAT64 of the metadata address
		"64:ff9b:1::1":           Embedded,
		"2002:7f00:1::1":         Embedded, // 6to4 of 127.0.0.1
		"2001:0:4136:e378::1":    Embedded, // Teredo
		"::127.0.0.1":            Embedded, // IPv4-compatible
		"fe80::1%eth0":           LinkLocal,
		"::ffff:169.254.169.254": Metadata,
	}
	for s, want := range cases {
		t.Run(s, func(t *testing.T) {
			if got := Classify(netip.MustParseAddr(s)); got != want {
				t.Fatalf("Classify(%s) = %s, want %s", s, got, want)
			}
		})
	}
}

func TestGuard(t *testing.T) {
	own := netip.MustParseAddr("198.51.100.1")
	listener := netip.MustParseAddrPort("127.0.0.1:3128")
	cases := []struct {
		name      string
		g         Guard
		addr      string
		wantOK    bool
		wantClass Class
	}{
		{"public", Guard{}, "8.8.8.8:443", true, Public},
		{"loopback refused by default", Guard{}, "127.0.0.1:443", false, Loopback},
		{"loopback with unsafe setting", Guard{UnsafeAllowLoopback: true}, "127.0.0.1:443", true, Loopback},
		{"private refused by default", Guard{UnsafeAllowLoopback: true}, "10.0.0.1:443", false, Private},
		{"private with unsafe setting", Guard{UnsafeAllowPrivate: true}, "10.0.0.1:443", true, Private},
		{"cgnat with unsafe private", Guard{UnsafeAllowPrivate: true}, "100.64.0.1:443", true, CGNAT},
		{"metadata never", Guard{UnsafeAllowPrivate: true, UnsafeAllowLoopback: true}, "169.254.169.254:80", false, Metadata},
		{"embedded never", Guard{UnsafeAllowPrivate: true, UnsafeAllowLoopback: true}, "[64:ff9b::a00:1]:443", false, Embedded},
		{"own address", Guard{Own: map[netip.Addr]bool{own: true}}, "198.51.100.1:443", false, Own},
		{"own listener even with loopback allowed", Guard{UnsafeAllowLoopback: true, Forbidden: map[netip.AddrPort]bool{listener: true}}, "127.0.0.1:3128", false, Own},
		{"mapped own listener", Guard{UnsafeAllowLoopback: true, Forbidden: map[netip.AddrPort]bool{listener: true}}, "[::ffff:127.0.0.1]:3128", false, Own},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			ap := netip.MustParseAddrPort(c.addr)
			class, err := c.g.CheckEndpoint(ap)
			if (err == nil) != c.wantOK || class != c.wantClass {
				t.Fatalf("CheckEndpoint(%s) = %s, %v; want ok=%v class %s", c.addr, class, err, c.wantOK, c.wantClass)
			}
			// Control sees the same verdict at connect time.
			if cerr := c.g.Control("tcp4", ap.String(), nil); (cerr == nil) != c.wantOK {
				t.Fatalf("Control(%s) = %v", ap, cerr)
			}
		})
	}
}
