package policy

import "testing"

func TestDecide(t *testing.T) {
	p := &Policy{
		Allow:   []string{"*.example.com", "api.anthropic.com", "*.internal.example.com"},
		Deny:    []string{"evil.example.com", "*.internal.example.com"},
		Ports:   []int{8443},
		Inspect: []string{"api.anthropic.com"},
	}
	cases := []struct {
		name, host, method string
		port               int
		result             Result
		rule               string
		intercept          bool
	}{
		{"allowed wildcard", "a.example.com", "CONNECT", 443, Allow, "allow:*.example.com", false},
		{"wildcard excludes apex", "example.com", "CONNECT", 443, Deny, "default-deny", false},
		{"deny wins over allow", "evil.example.com", "CONNECT", 443, Deny, "deny:evil.example.com", false},
		{"deny wildcard wins", "db.internal.example.com", "GET", 80, Deny, "deny:*.internal.example.com", false},
		{"not listed", "example.org", "CONNECT", 443, Deny, "default-deny", false},
		{"intercepted", "api.anthropic.com", "CONNECT", 443, Allow, "allow:api.anthropic.com", true},
		{"CONNECT port 22", "a.example.com", "CONNECT", 22, Deny, "port", false},
		{"CONNECT port 80 not implied", "a.example.com", "CONNECT", 80, Deny, "port", false},
		{"listed port", "a.example.com", "CONNECT", 8443, Allow, "allow:*.example.com", false},
		{"plain HTTP 80", "a.example.com", "GET", 80, Allow, "allow:*.example.com", false},
		{"plain HTTP to 443 not implied", "a.example.com", "GET", 443, Deny, "port", false},
		{"IPv4 literal", "93.184.216.34", "CONNECT", 443, Deny, "ip-literal", false},
		{"IPv6 literal", "2001:db8::1", "CONNECT", 443, Deny, "ip-literal", false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			d := p.Decide(c.host, c.port, c.method)
			if d.Result != c.result || d.Rule != c.rule || d.Intercept != c.intercept || d.Reason == "" {
				t.Fatalf("Decide(%s, %d, %s) = %+v, want %s %s intercept=%v", c.host, c.port, c.method, d, c.result, c.rule, c.intercept)
			}
		})
	}
}

func TestAllowsName(t *testing.T) {
	p := &Policy{Allow: []string{"*.example.com"}, Deny: []string{"x.example.com"}}
	for name, want := range map[string]bool{"a.example.com": true, "x.example.com": false, "example.com": false, "a.example.org": false} {
		if got, rule := p.AllowsName(name); got != want || rule == "" {
			t.Errorf("AllowsName(%s) = %v %q, want %v", name, got, rule, want)
		}
	}
}

// A deny entry covers its name and every name below it, whatever allow
// says; an allowed exact name stays exactly that name.
func TestDenyCoversNamesBelow(t *testing.T) {
	p := &Policy{Allow: []string{"*.example.org", "a.evil.example.net", "api.example.com"}, Deny: []string{"evil.example.org", "evil.example.net", "*.bad.example.org"}}
	cases := []struct {
		host, rule string
		allowed    bool
	}{
		{"evil.example.org", "deny:evil.example.org", false},
		{"x.evil.example.org", "deny:evil.example.org", false},
		{"c2VjcmV0.a.b.evil.example.org", "deny:evil.example.org", false},
		{"notevil.example.org", "allow:*.example.org", true},
		{"evil.example.org.example.org", "allow:*.example.org", true},
		{"a.evil.example.net", "deny:evil.example.net", false},
		{"x.bad.example.org", "deny:*.bad.example.org", false},
		{"bad.example.org", "allow:*.example.org", true}, // a wildcard deny means strict subdomains
		{"x.api.example.com", "default-deny", false},     // an exact allow does not extend
	}
	for _, c := range cases {
		for _, m := range []string{"CONNECT", "GET"} {
			port := DefaultConnectPort
			if m == "GET" {
				port = DefaultHTTPPort
			}
			d := p.Decide(c.host, port, m)
			if (d.Result == Allow) != c.allowed || d.Rule != c.rule {
				t.Errorf("Decide(%s, %s) = %+v, want allowed=%v rule %s", c.host, m, d, c.allowed, c.rule)
			}
		}
		if ok, rule := p.AllowsName(c.host); ok != c.allowed || rule != c.rule {
			t.Errorf("AllowsName(%s) = %v %s, want %v %s", c.host, ok, rule, c.allowed, c.rule)
		}
	}
}

func TestDecideHTTP(t *testing.T) {
	p := &Policy{WebSocket: true, HTTPRules: []HTTPRule{
		{Name: "telemetry", Hosts: []string{"api.example.com"}, Paths: []string{"/api/event_logging/*", "/api/claude_code/metrics"}, Action: ActionDeny},
		{Name: "read-only", Hosts: []string{"registry.example.org"}, Methods: []string{"GET", "HEAD"}, Action: ActionAllow},
		{Name: "no-ws", Hosts: []string{"registry.example.org"}, Methods: []string{MethodWebSocket}, Action: ActionDeny},
	}}
	cases := []struct {
		name, host, method, raw, path string
		ws                            bool
		result                        Result
		rule                          string
	}{
		{"no rule for host", "other.example.com", "POST", "/x", "/x", false, "", ""},
		{"deny by prefix", "api.example.com", "POST", "/api/event_logging/batch", "/api/event_logging/batch", false, Deny, "http_rule:telemetry"},
		{"deny exact", "api.example.com", "POST", "/api/claude_code/metrics", "/api/claude_code/metrics", false, Deny, "http_rule:telemetry"},
		{"other path on the host", "api.example.com", "POST", "/v1/messages", "/v1/messages", false, "", ""},
		{"double slash refused", "api.example.com", "POST", "/api//event_logging/batch", "/api//event_logging/batch", false, Deny, "http-rule-path"},
		{"dot segment refused", "api.example.com", "POST", "/v1/../api/event_logging/batch", "/v1/../api/event_logging/batch", false, Deny, "http-rule-path"},
		{"escaped dot refused", "api.example.com", "POST", "/v1/%2e%2e/api/x", "/v1/../api/x", false, Deny, "http-rule-path"},
		{"escaped letter judged decoded", "api.example.com", "POST", "/api/%65vent_logging/batch", "/api/event_logging/batch", false, Deny, "http_rule:telemetry"},
		{"escaped slash judged decoded", "api.example.com", "POST", "/api%2fevent_logging/batch", "/api/event_logging/batch", false, Deny, "http_rule:telemetry"},
		{"lower-case method", "registry.example.org", "post", "/pkg", "/pkg", false, Deny, "http-rule-default"},
		{"allowed GET", "registry.example.org", "GET", "/@types%2fnode", "/@types/node", false, Allow, "http_rule:read-only"},
		{"POST not allowed", "registry.example.org", "POST", "/pkg", "/pkg", false, Deny, "http-rule-default"},
		{"websocket denied wins over GET allow", "registry.example.org", "GET", "/ws", "/ws", true, Deny, "http_rule:no-ws"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			d := p.DecideHTTP(c.host, c.method, c.raw, c.path, c.ws)
			if d.Result != c.result || d.Rule != c.rule {
				t.Fatalf("got %s %q (%s), want %s %q", d.Result, d.Rule, d.Reason, c.result, c.rule)
			}
		})
	}
	if d := (&Policy{}).DecideHTTP("a.example.com", "GET", "/", "/", true); d.Rule != "websocket" {
		t.Fatalf("websocket = false: %+v", d)
	}
}
