package policy

import (
	"fmt"
	"net/netip"
	"slices"
	"strconv"
)

// Result is the outcome of a policy decision.
type Result string

// Results. A request is allowed or denied by Decide; "flagged" is added later
// by inspectors and never comes out of Decide.
const (
	Allow Result = "allow"
	Deny  Result = "deny"
)

// Decision is a policy verdict as a value, so callers log and tests assert on
// the reason and the rule that produced it.
type Decision struct {
	Result Result
	Reason string
	// Rule names what decided: "allow:<pattern>", "deny:<pattern>",
	// "default-deny", "port", "ip-literal".
	Rule string
	// Intercept: the host is TLS-intercepted (listed in inspect or bound to a
	// secret), so requests are inspected and may carry injected credentials.
	Intercept bool
}

// Default ports: absolute-form HTTP may go to 80 and CONNECT to 443; any
// other port must be listed in Policy.Ports.
const (
	DefaultHTTPPort    = 80
	DefaultConnectPort = 443
)

// Decide says whether the cage may reach host:port with method (CONNECT for
// tunnels). host must already be normalized. Deny wins over allow; anything
// not allowed is denied. A deny entry covers the names below it (Covers). IP literals are never allowed: patterns name hosts,
// and a literal would bypass both the DNS view and the SNI check.
func (p *Policy) Decide(host string, port int, method string) Decision {
	if _, err := netip.ParseAddr(host); err == nil {
		return Decision{Result: Deny, Reason: "destination is an IP literal; policies allow host names only", Rule: "ip-literal"}
	}
	if d := MatchDeny(p.Deny, host); d != "" {
		return Decision{Result: Deny, Reason: fmt.Sprintf("host %s matches deny pattern %s", host, d), Rule: "deny:" + d}
	}
	a := MatchAny(p.Allow, host)
	if a == "" {
		return Decision{Result: Deny, Reason: fmt.Sprintf("host %s is not in the allow list", host), Rule: "default-deny"}
	}
	def := DefaultHTTPPort
	if method == "CONNECT" {
		def = DefaultConnectPort
	}
	if port != def && !slices.Contains(p.Ports, port) {
		return Decision{Result: Deny, Reason: fmt.Sprintf("port %d is not allowed for %s (allowed: %d and policy ports %v)", port, method, def, p.Ports), Rule: "port"}
	}
	return Decision{Result: Allow, Reason: "host " + host + ":" + strconv.Itoa(port) + " allowed", Rule: "allow:" + a, Intercept: MatchAny(p.Inspect, host) != ""}
}

// AllowsName reports whether DNS may answer for name: the same allow and deny
// patterns as Decide, without ports.
func (p *Policy) AllowsName(name string) (bool, string) {
	if d := MatchDeny(p.Deny, name); d != "" {
		return false, "deny:" + d
	}
	if a := MatchAny(p.Allow, name); a != "" {
		return true, "allow:" + a
	}
	return false, "default-deny"
}
