package config

import (
	"slices"
	"strings"

	"github.com/nixcage/nixcage/internal/policy"
)

// DefaultWebSocket: WebSocket is allowed on intercepted hosts, where every
// message is inspected and redacted like a request body (Codex opens one
// before falling back to HTTPS). Tunnelled hosts are opaque either way.
const DefaultWebSocket = true

// httpRules validates a policy's http_rule blocks. Rules are sorted by
// name: their meaning does not depend on order (deny wins; any matching
// allow rule allows), so the model does not either.
func (v *validator) httpRules(name string, rules []httpRuleV1, inspect []string) []policy.HTTPRule {
	var out []policy.HTTPRule
	seen := map[string]bool{}
	for _, r := range rules {
		rng := block(r.Body)
		if seen[r.Name] {
			v.errorf(rng, "Duplicate http_rule", "egress_policy %q declares http_rule %q twice. Merge them or rename one.", name, r.Name)
		}
		seen[r.Name] = true
		if !policyNameRE.MatchString(r.Name) {
			v.errorf(rng, "Invalid http_rule name", "egress_policy %q: http_rule %q: use lower-case letters, digits, - and _ (it appears in audit rules as http_rule:<name>).", name, r.Name)
		}
		hr := policy.HTTPRule{Name: r.Name, Hosts: r.Hosts, Paths: r.Paths, Action: r.Action}
		if r.Action != policy.ActionAllow && r.Action != policy.ActionDeny {
			v.errorf(at(r.Body, "action"), "Unknown http_rule action", "egress_policy %q: http_rule %q: action = %q; use \"allow\" or \"deny\".", name, r.Name, r.Action)
		}
		if len(r.Hosts) == 0 {
			v.errorf(at(r.Body, "hosts"), "http_rule names no host", "egress_policy %q: http_rule %q: list the intercepted hosts it applies to, e.g. hosts = [\"api.example.com\"].", name, r.Name)
		}
		for _, h := range r.Hosts {
			if err := policy.CheckPattern(h); err != nil {
				v.errorf(at(r.Body, "hosts"), "Invalid host pattern", "egress_policy %q: http_rule %q: %v.", name, r.Name, err)
				continue
			}
			if !inspected(inspect, h) {
				v.errorf(at(r.Body, "hosts"), "http_rule on a host that is not intercepted", "egress_policy %q: http_rule %q names %s, which inspect does not list; the gateway sees methods and paths only on intercepted hosts. Add %q to inspect.", name, r.Name, h, h)
			}
		}
		for _, m := range r.Methods {
			up := strings.ToUpper(m)
			if !slices.Contains(policy.HTTPMethods, up) {
				v.errorf(at(r.Body, "methods"), "Unknown method", "egress_policy %q: http_rule %q: method %q; use %s.", name, r.Name, m, strings.Join(policy.HTTPMethods, ", "))
			}
			hr.Methods = append(hr.Methods, up)
		}
		for _, p := range r.Paths {
			if err := policy.CheckPathPattern(p); err != nil {
				v.errorf(at(r.Body, "paths"), "Invalid path pattern", "egress_policy %q: http_rule %q: %v; write \"/exact/path\" or \"/prefix/*\".", name, r.Name, err)
			}
		}
		out = append(out, hr)
	}
	slices.SortFunc(out, func(a, b policy.HTTPRule) int { return strings.Compare(a.Name, b.Name) })
	return out
}

// inspected reports whether every host host pattern h matches is
// intercepted: an exact name matched by inspect, or a wildcard that inspect
// lists itself or that a broader inspect wildcard covers.
func inspected(inspect []string, h string) bool {
	suffix, wild := strings.CutPrefix(h, "*.")
	if !wild {
		return policy.MatchAny(inspect, h) != ""
	}
	for _, p := range inspect {
		if p == h {
			return true
		}
		if ps, ok := strings.CutPrefix(p, "*."); ok && strings.HasSuffix(suffix, "."+ps) {
			return true
		}
	}
	return false
}
