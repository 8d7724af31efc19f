package egress

import (
	"fmt"
	"net/http"
	"net/netip"
	"slices"

	"github.com/nixcage/nixcage/internal/policy"
)

// The bench-only IP-literal path (cage-egress --unsafe-bench-ip-literals).
// bench/egress/run.sh gives every proxy the same kind of destination; its
// ip rows CONNECT to 127.0.0.1. In production a CONNECT to an IP literal is
// refused (policy.Decide, rule "ip-literal"): the policy is by name. With
// the switch, such a CONNECT is admitted on its address class alone and
// the policy then decides on the TLS SNI name the client sends: the tunnel
// still gets a policy decision by name, an address check, and its open and
// close records. The switch is no setting of any configuration document
// (policy.Parse and the config validator refuse the name), the rendered
// units never pass it, and cage-egress refuses it under systemd.

// ruleBenchLiteral prefixes the rule of every record of such a tunnel, so
// the audit shows the switch was on.
const ruleBenchLiteral = "unsafe-bench-ip-literal"

// benchLiteral reports whether host is an IP literal admitted by the
// bench switch, and its address.
func benchLiteral(enabled bool, host string) (netip.Addr, bool) {
	if !enabled {
		return netip.Addr{}, false
	}
	a, err := netip.ParseAddr(host)
	if err != nil {
		return netip.Addr{}, false
	}
	return a.Unmap(), true
}

// decideLiteralPort is the CONNECT-time decision of a literal tunnel: the
// port, as Decide checks it for a name (the name itself comes with the SNI).
func decideLiteralPort(st *state, port int) policy.Decision {
	if port != policy.DefaultConnectPort && !slices.Contains(st.pol.Ports, port) {
		return policy.Decision{Result: policy.Deny, Rule: "port", Reason: fmt.Sprintf("port %d is not allowed for CONNECT (allowed: %d and policy ports %v)", port, policy.DefaultConnectPort, st.pol.Ports)}
	}
	return policy.Decision{Result: policy.Allow, Rule: ruleBenchLiteral}
}

// checkLiteral classifies a literal's address as resolve does a name's.
func checkLiteral(st *state, a netip.Addr, port int) (netip.AddrPort, error) {
	ap := netip.AddrPortFrom(a, uint16(port))
	if _, err := st.guard.CheckEndpoint(ap); err != nil {
		return netip.AddrPort{}, errRefused{fmt.Errorf("%s is %w", a, err)}
	}
	return ap, nil
}

// decideBenchSNI is the policy decision of a literal tunnel, made on its
// SNI. An intercepted name is refused: interception is chosen by the
// CONNECT host, and a literal must not be a way around it.
func (g *Gateway) decideBenchSNI(t *target, sni string) (rule, reason string, ok bool) {
	if _, err := netip.ParseAddr(sni); err == nil {
		return "ip-literal", fmt.Sprintf("TLS SNI %q is an IP literal; policies allow host names only", sni), false
	}
	dec := g.decide(t.st, sni, t.port, http.MethodConnect)
	if dec.Result != policy.Allow {
		return dec.Rule, dec.Reason + " (TLS SNI of a CONNECT to " + t.host + ")", false
	}
	if t.st.intercepts(sni) {
		return ruleBenchLiteral, fmt.Sprintf("TLS SNI %q names an intercepted host; CONNECT to the name, not to %s", sni, t.host), false
	}
	return ruleBenchLiteral + ":" + dec.Rule, "", true
}
