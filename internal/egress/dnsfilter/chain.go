package dnsfilter

import (
	"fmt"
	"slices"
	"strings"

	"github.com/miekg/dns"

	"github.com/nixcage/nixcage/internal/policy"
)

// An answer for an allowed name may go through other names: the upstream
// resolver follows CNAME (and DNAME) records and returns the whole chain,
// "api.example.com CNAME edge.cdn.example, edge.cdn.example A 192.0.2.1".
// The names after the first are the chain's aliases. The filter and the
// gateway's resolver hold an answer to them (docs/egress.md, "DNS"):
//
//   - only records owned by the question or one of its aliases are used:
//     anything else in the answer section is an answer to a question the
//     agent did not ask, possibly for a name the policy refuses;
//   - a ban or a deny entry covering any alias refuses the whole name, as it
//     would the alias itself: an allowed name pointing at a banned one is
//     the banned host under another name. Aliases the policy merely does
//     not list are not refused: that is how CDNs serve allowed names, and
//     their addresses are the allowed name's own.

// maxAliases bounds a chain (resolvers give up after 8 to 16 links).
const maxAliases = 16

// Chain is the CNAME/DNAME chain of an answer to Qname.
type Chain struct {
	Qname   string
	Aliases []string // normalized, in chain order, without Qname
}

// Names is Qname and its aliases.
func (c Chain) Names() []string { return append([]string{c.Qname}, c.Aliases...) }

// FollowChain follows the chain from qname through the answer section and
// returns it, with the records owned by a chain name (CNAME and DNAME
// records making the chain included) and the number of records left out.
func FollowChain(qname string, answer []dns.RR) (Chain, []dns.RR, int) {
	c := Chain{Qname: policy.Normalize(qname)}
	in := map[string]bool{c.Qname: true}
	used := make([]bool, len(answer))
	add := func(name string) bool {
		if in[name] || len(c.Aliases) >= maxAliases {
			return false
		}
		in[name] = true
		c.Aliases = append(c.Aliases, name)
		return true
	}
	// Each pass extends the chain by at least one name or ends; the set of
	// names is bounded (maxAliases), so a DNAME renaming into its own
	// subtree ends too.
	for grew := true; grew; {
		grew = false
		for i, rr := range answer {
			owner := policy.Normalize(rr.Header().Name)
			switch x := rr.(type) {
			case *dns.CNAME:
				if in[owner] {
					used[i] = true
					grew = add(policy.Normalize(x.Target)) || grew
				}
			case *dns.DNAME:
				// DNAME owner renames every name below it: the
				// synthesized name of each chain name under it joins.
				target := policy.Normalize(x.Target)
				for _, n := range c.Names() {
					if prefix, ok := strings.CutSuffix(n, "."+owner); ok {
						used[i] = true
						grew = add(prefix+"."+target) || grew
					}
				}
			}
		}
	}
	var kept []dns.RR
	for i, rr := range answer {
		if used[i] || in[policy.Normalize(rr.Header().Name)] {
			kept = append(kept, rr)
		}
	}
	return c, kept, len(answer) - len(kept)
}

// ChainDeny is the deny list a chain is judged by: the policy's, and for
// a name learn mode let through (rule policy.RuleLearn) the shipped deny
// lists learn mode never passes (policy.Learning.Deny) as well, or an
// unlisted name CNAMEd to a shipped-denied one would be that host under
// another name.
func ChainDeny(p *policy.Policy, l *policy.Learning, rule string) []string {
	if rule != policy.RuleLearn || l == nil || len(l.Deny) == 0 {
		return p.Deny
	}
	return append(slices.Clip(p.Deny), l.Deny...)
}

// Refused is the decision refusing the chain's first name when an alias is
// banned or covered by a deny pattern, or ok false. Bans come first, as
// everywhere.
func (c Chain) Refused(deny []string, bans []policy.Ban) (policy.Decision, bool) {
	for _, a := range c.Aliases {
		if b := policy.BanFor(bans, a); b != nil {
			d := policy.Banned(b, a)
			d.Reason = c.Qname + " is an alias of " + a + ": " + d.Reason
			return d, true
		}
	}
	for _, a := range c.Aliases {
		if p := policy.MatchDeny(deny, a); p != "" {
			return policy.Decision{Result: policy.Deny, Rule: "deny:" + p,
				Reason: fmt.Sprintf("%s is an alias of %s, which matches deny pattern %s", c.Qname, a, p)}, true
		}
	}
	return policy.Decision{}, false
}
