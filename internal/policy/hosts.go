package policy

import (
	"fmt"
	"net"
	"strings"
)

// Host patterns are either an exact DNS name ("api.example.com") or a
// wildcard for strict subdomains ("*.example.org" matches "a.example.org"
// and "a.b.example.org" but not "example.org"). Names are compared in lower
// case without a trailing dot. There is no other syntax: no regexps, no
// partial labels, so a pattern means what it reads.
//
// Allow and deny read an exact name differently, on purpose. An allowed
// exact name is that name only. A denied exact name is that name and every
// name below it ("evil.example.org" denies "x.evil.example.org" too): whoever
// runs evil.example.org runs its subdomains and its name servers, so a deny
// that stopped at one label would leave CONNECT, HTTP and DNS (data in the
// labels of <data>.evil.example.org) open to the party it names. Deny wins.

// CheckPattern reports why p is not a valid host pattern.
func CheckPattern(p string) error {
	name := strings.TrimPrefix(p, "*.")
	if isIPLiteral(name) {
		return fmt.Errorf("host pattern %q is an IP address; the gateway matches the names a cage asks for (CONNECT authority, Host, SNI, DNS), never addresses, so it would never match: allow the host's name instead (and set unsafe_allow_private_upstreams if that name resolves to a private address)", p)
	}
	if name != strings.ToLower(name) {
		return fmt.Errorf("host pattern %q: use lower case", p)
	}
	if err := CheckHostname(name); err != nil {
		return fmt.Errorf("host pattern %q: %v; write an exact name like \"api.example.com\" or a wildcard like \"*.example.com\"", p, err)
	}
	return nil
}

// isIPLiteral: an IPv4 or IPv6 address, bracketed or not, or a name whose
// last label is all digits (which no top-level domain is).
func isIPLiteral(s string) bool {
	s = strings.TrimSuffix(strings.TrimPrefix(s, "["), "]")
	if net.ParseIP(s) != nil {
		return true
	}
	last := s[strings.LastIndex(s, ".")+1:]
	return last != "" && strings.Trim(last, "0123456789") == ""
}

// CheckHostname reports why h is not a DNS hostname (letters, digits, hyphens,
// dots; labels of 1..63; at most 253 in all; at least two labels).
func CheckHostname(h string) error {
	if h == "" {
		return fmt.Errorf("empty name")
	}
	if len(h) > 253 {
		return fmt.Errorf("name longer than 253 characters")
	}
	labels := strings.Split(h, ".")
	if len(labels) < 2 {
		return fmt.Errorf("not a fully qualified name")
	}
	for _, l := range labels {
		if l == "" || len(l) > 63 {
			return fmt.Errorf("label %q must be 1 to 63 characters", l)
		}
		if l[0] == '-' || l[len(l)-1] == '-' {
			return fmt.Errorf("label %q starts or ends with a hyphen", l)
		}
		for _, c := range l {
			if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-' || c == '_' || c >= 'A' && c <= 'Z') {
				return fmt.Errorf("label %q has character %q", l, c)
			}
		}
	}
	return nil
}

// Normalize lower-cases a hostname and strips one trailing dot.
func Normalize(host string) string {
	return strings.TrimSuffix(strings.ToLower(host), ".")
}

// Match reports whether host matches pattern. Both must be normalized.
func Match(pattern, host string) bool {
	if suffix, ok := strings.CutPrefix(pattern, "*"); ok {
		return strings.HasSuffix(host, suffix) && len(host) > len(suffix)
	}
	return pattern == host
}

// Covers reports whether deny pattern covers host: an exact name covers
// itself and every name below it; a wildcard covers its strict subdomains.
// Both must be normalized.
func Covers(pattern, host string) bool {
	if strings.HasPrefix(pattern, "*.") {
		return Match(pattern, host)
	}
	return host == pattern || strings.HasSuffix(host, "."+pattern)
}

// MatchDeny returns the first deny pattern in list that covers host, or "".
func MatchDeny(list []string, host string) string {
	for _, p := range list {
		if Covers(p, host) {
			return p
		}
	}
	return ""
}

// MatchAny returns the first pattern in list that matches host, or "".
func MatchAny(list []string, host string) string {
	for _, p := range list {
		if Match(p, host) {
			return p
		}
	}
	return ""
}
