package dnsfilter

import (
	"slices"
	"testing"

	"github.com/miekg/dns"

	"github.com/nixcage/nixcage/internal/egress/netguard"
)

// vetServiceBinding keeps mandatory, alpn, no-default-alpn and port, strips
// the rest, names the refused classes of the hints (public hints are
// stripped too, unnamed), and drops a record whose mandatory key it strips.
func TestVetServiceBinding(t *testing.T) {
	cases := []struct {
		rr       string
		kept     string // the record's params after vetting
		stripped []string
		refused  []string
		drop     bool
	}{
		{`x.example.com. 60 IN HTTPS 1 . mandatory=alpn alpn=h2 no-default-alpn port=8443 ipv4hint=192.0.2.1`,
			`mandatory="alpn" alpn="h2" no-default-alpn="" port="8443"`, []string{"ipv4hint"}, nil, false},
		{`x.example.com. 60 IN SVCB 1 svc.example.com. ipv6hint=::1,fe80::1 dohpath=/q{?dns} ohttp key65000=abc`,
			``, []string{"ipv6hint", "dohpath", "ohttp", "key65000"}, []string{"loopback", "link-local"}, false},
		{`x.example.com. 60 IN HTTPS 1 . mandatory=ipv4hint ipv4hint=169.254.169.254 alpn=h2`,
			``, []string{"ipv4hint"}, []string{"metadata"}, true},
	}
	for _, c := range cases {
		rr, err := dns.NewRR(c.rr)
		if err != nil {
			t.Fatal(err)
		}
		s := serviceBinding(rr)
		stripped, refused, drop := vetServiceBinding(s, &netguard.Guard{})
		var kept string
		for i, kv := range s.Value {
			if i > 0 {
				kept += " "
			}
			kept += kv.Key().String() + `="` + kv.String() + `"`
		}
		if !slices.Equal(stripped, c.stripped) || !slices.Equal(refused, c.refused) || drop != c.drop || (!drop && kept != c.kept) {
			t.Errorf("%s:\nkept %s stripped %v refused %v drop %v\nwant %s %v %v %v", c.rr, kept, stripped, refused, drop, c.kept, c.stripped, c.refused, c.drop)
		}
	}
}
