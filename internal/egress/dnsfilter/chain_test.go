package dnsfilter

import (
	"slices"
	"strings"
	"testing"

	"github.com/miekg/dns"

	"github.com/nixcage/nixcage/internal/policy"
)

func rrs(t *testing.T, lines ...string) []dns.RR {
	t.Helper()
	var out []dns.RR
	for _, l := range lines {
		rr, err := dns.NewRR(l)
		if err != nil {
			t.Fatalf("%q: %v", l, err)
		}
		out = append(out, rr)
	}
	return out
}

// FollowChain keeps the question's chain only, in any record order, and
// ends on chains an upstream could make endless (a DNAME renaming into
// its own subtree, CNAME loops).
func TestFollowChain(t *testing.T) {
	cases := []struct {
		name    string
		answer  []string
		aliases []string
		kept    int
	}{
		{"addresses only", []string{"A.example.com. 60 IN A 192.0.2.1"}, nil, 1},
		{"chain out of order", []string{
			"c.cdn.test. 60 IN A 192.0.2.1",
			"b.cdn.test. 60 IN CNAME c.cdn.test.",
			"a.example.com. 60 IN CNAME B.cdn.test.",
		}, []string{"b.cdn.test", "c.cdn.test"}, 3},
		{"strays dropped", []string{
			"a.example.com. 60 IN A 192.0.2.1",
			"evil.test. 60 IN A 192.0.2.2",
			"evil.test. 60 IN CNAME a.example.com.",
		}, nil, 1},
		{"DNAME", []string{
			"example.com. 60 IN DNAME example.net.",
			"a.example.net. 60 IN A 192.0.2.1",
		}, []string{"a.example.net"}, 2},
		{"CNAME loop", []string{
			"a.example.com. 60 IN CNAME b.example.com.",
			"b.example.com. 60 IN CNAME a.example.com.",
		}, []string{"b.example.com"}, 2},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			chain, kept, stray := FollowChain("a.example.com.", rrs(t, c.answer...))
			if !slices.Equal(chain.Aliases, c.aliases) || len(kept) != c.kept || stray != len(c.answer)-c.kept {
				t.Fatalf("aliases %v kept %d stray %d; want %v, %d", chain.Aliases, len(kept), stray, c.aliases, c.kept)
			}
		})
	}
	chain, _, _ := FollowChain("a.example.com.", rrs(t, "example.com. 60 IN DNAME x.example.com."))
	if len(chain.Aliases) != maxAliases {
		t.Fatalf("a DNAME into its own subtree: %d aliases, want the bound %d", len(chain.Aliases), maxAliases)
	}
}

// A ban beats a deny entry in the refusal's rule, and either covers the
// names below it.
func TestChainRefused(t *testing.T) {
	c := Chain{Qname: "a.example.com", Aliases: []string{"x.cdn.test", "y.bad.test"}}
	bans := []policy.Ban{{ID: "b-1", Host: "bad.test", Agent: "*", Command: "abc"}}
	d, ok := c.Refused([]string{"cdn.test"}, bans)
	if !ok || d.Rule != "ban:b-1" || !strings.Contains(d.Reason, "a.example.com is an alias of y.bad.test") {
		t.Fatalf("%+v %v", d, ok)
	}
	if d, ok := c.Refused([]string{"*.cdn.test"}, nil); !ok || d.Rule != "deny:*.cdn.test" {
		t.Fatalf("%+v %v", d, ok)
	}
	if _, ok := c.Refused([]string{"a.example.com"}, nil); ok {
		t.Fatal("the question itself is the policy's to judge, not the chain's")
	}
}
