package policy

import (
	"fmt"
	"path"
	"slices"
	"strings"
)

// HTTPRule allows or denies requests to some intercepted hosts by method
// and path. Rules only narrow what the host patterns allowed: deny wins, and
// once any allow rule names a host, a request to it must match one.
type HTTPRule struct {
	Name  string   `json:"name"`
	Hosts []string `json:"hosts"`
	// Methods the rule matches, upper case; empty matches every method.
	// MethodWebSocket matches a WebSocket handshake only (which GET also
	// matches, being its method).
	Methods []string `json:"methods,omitempty"`
	// Paths the rule matches: "/exact" or "/prefix/*" (a trailing * matches
	// any rest, including none); empty matches every path.
	Paths  []string `json:"paths,omitempty"`
	Action string   `json:"action"` // ActionAllow or ActionDeny
}

// HTTP rule actions and the pseudo-method for WebSocket handshakes.
const (
	ActionAllow     = "allow"
	ActionDeny      = "deny"
	MethodWebSocket = "WEBSOCKET"
)

// HTTPMethods are the methods a rule may name.
var HTTPMethods = []string{"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", MethodWebSocket}

// CheckPathPattern reports why p is not a rule path pattern.
func CheckPathPattern(p string) error {
	if !strings.HasPrefix(p, "/") {
		return fmt.Errorf("path %q must start with /", p)
	}
	body := strings.TrimSuffix(p, "*")
	if strings.Contains(body, "*") {
		return fmt.Errorf("path %q: * may only end a path (as in \"/api/*\")", p)
	}
	if !canonical(body) {
		return fmt.Errorf("path %q is not canonical (no //, /./, /../ or %%-escapes)", p)
	}
	return nil
}

// canonical reports whether p is a clean absolute path: what a rule can
// match without guessing how the upstream would normalize it.
func canonical(p string) bool {
	// ';' starts path parameters that servlet containers (Tomcat, Jetty,
	// Spring) strip before routing: "/api;x/event_logging" reaches the
	// handler of "/api/event_logging".
	if strings.ContainsAny(p, "%\\;") {
		return false
	}
	c := path.Clean(p)
	return c == p || c+"/" == p
}

// rawOK reports whether a path as sent is one the rules can judge by its
// decoded form: escapes of '.', '\\', '%' and ';' (which upstreams disagree on)
// are refused; an escaped '/' (npm's "@scope%2fname") is judged decoded,
// as the more separating reading.
func rawOK(raw string) bool {
	l := strings.ToLower(raw)
	return !strings.Contains(raw, "\\") && !strings.Contains(l, "%2e") && !strings.Contains(l, "%5c") && !strings.Contains(l, "%25") && !strings.Contains(l, "%3b")
}

func matchPath(pattern, p string) bool {
	if prefix, ok := strings.CutSuffix(pattern, "*"); ok {
		return strings.HasPrefix(p, prefix)
	}
	return pattern == p
}

// matchDenyPath is matchPath read as widely as common upstreams route:
// case-insensitively (Express, ASP.NET, IIS), a trailing slash ignored
// (Express, Rails) and "/prefix/*" also covering "/prefix" itself. A deny
// rule must refuse every spelling some server maps to the path it names;
// allow rules keep the exact reading (the narrower one).
func matchDenyPath(pattern, p string) bool {
	pattern, p = strings.ToLower(pattern), strings.ToLower(p)
	if prefix, ok := strings.CutSuffix(pattern, "*"); ok {
		return strings.HasPrefix(p, prefix) || p+"/" == prefix
	}
	return pattern == p || pattern+"/" == p || (pattern != "/" && strings.TrimSuffix(pattern, "/") == p)
}

func (r *HTTPRule) matches(method, p string, websocket bool) bool {
	if len(r.Methods) > 0 && !slices.Contains(r.Methods, method) && !(websocket && slices.Contains(r.Methods, MethodWebSocket)) {
		return false
	}
	if len(r.Paths) == 0 {
		return true
	}
	match := matchPath
	if r.Action == ActionDeny {
		match = matchDenyPath
	}
	for _, pat := range r.Paths {
		if match(pat, p) {
			return true
		}
	}
	return false
}

// Rules match the decoded path, after refusing any path that does not
// read the same to every upstream.

// DecideHTTP applies the HTTP rules and the websocket setting to one
// request inside an allowed host. rawPath is the path as sent (escapes
// kept), p the decoded one. The zero Decision (Result "") means no rule
// names the host or an allow rule matched; Rule then names that rule.
func (p *Policy) DecideHTTP(host, method, rawPath, decoded string, websocket bool) Decision {
	if websocket && !p.WebSocket {
		return Decision{Result: Deny, Rule: "websocket", Reason: "WebSocket is not allowed by this policy (websocket = false)"}
	}
	var rules []*HTTPRule
	for i := range p.HTTPRules {
		if MatchAny(p.HTTPRules[i].Hosts, host) != "" {
			rules = append(rules, &p.HTTPRules[i])
		}
	}
	if len(rules) == 0 {
		return Decision{}
	}
	// A path the upstream might read differently from how a rule reads it
	// (/api//x, /api/./x, %2F, backslashes) is refused on hosts with rules.
	if !rawOK(rawPath) || !canonical(decoded) {
		return Decision{Result: Deny, Rule: "http-rule-path", Reason: fmt.Sprintf("path %q is not canonical; %s has http rules and they match clean paths only", rawPath, host)}
	}
	method = strings.ToUpper(method)
	var allow *HTTPRule
	hasAllow := false
	for _, r := range rules {
		if !r.matches(method, decoded, websocket) {
			if r.Action == ActionAllow {
				hasAllow = true
			}
			continue
		}
		if r.Action == ActionDeny {
			return Decision{Result: Deny, Rule: "http_rule:" + r.Name, Reason: fmt.Sprintf("%s %s on %s matches http_rule %q (deny)", method, decoded, host, r.Name)}
		}
		hasAllow = true
		if allow == nil {
			allow = r
		}
	}
	if allow != nil {
		return Decision{Result: Allow, Rule: "http_rule:" + allow.Name, Reason: "allowed by http_rule " + allow.Name}
	}
	if hasAllow {
		return Decision{Result: Deny, Rule: "http-rule-default", Reason: fmt.Sprintf("%s %s on %s matches none of the http_rule allow rules for that host", method, decoded, host)}
	}
	return Decision{}
}

// Check reports why r cannot be enforced.
func (r *HTTPRule) Check() error {
	if r.Name == "" {
		return fmt.Errorf("http rule without a name")
	}
	if r.Action != ActionAllow && r.Action != ActionDeny {
		return fmt.Errorf("http_rule %q: action %q, want %q or %q", r.Name, r.Action, ActionAllow, ActionDeny)
	}
	if len(r.Hosts) == 0 {
		return fmt.Errorf("http_rule %q names no hosts", r.Name)
	}
	for _, h := range r.Hosts {
		if err := CheckPattern(h); err != nil {
			return fmt.Errorf("http_rule %q: %w", r.Name, err)
		}
	}
	for _, m := range r.Methods {
		if !slices.Contains(HTTPMethods, m) {
			return fmt.Errorf("http_rule %q: method %q; use one of %s", r.Name, m, strings.Join(HTTPMethods, ", "))
		}
	}
	for _, p := range r.Paths {
		if err := CheckPathPattern(p); err != nil {
			return fmt.Errorf("http_rule %q: %w", r.Name, err)
		}
	}
	return nil
}
