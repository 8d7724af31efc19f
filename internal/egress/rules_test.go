package egress

// Issue 11 item 8: per-host method and path rules on intercepted hosts,
// against the real gateway, with the refusal a program reads and the audit
// record.

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"

	"github.com/nixcage/nixcage/internal/egress/audit"
	"github.com/nixcage/nixcage/internal/policy"
)

func TestThreatHTTPRules(t *testing.T) {
	h := newHarness(t, func(rt *policy.Runtime) {
		rt.Policy.HTTPRules = []policy.HTTPRule{
			{Name: "telemetry", Hosts: []string{"api.example.com"}, Paths: []string{"/api/event_logging/*", "/api/claude_code/metrics"}, Action: policy.ActionDeny},
			{Name: "read-only", Hosts: []string{"other.example.com"}, Methods: []string{"GET", "HEAD"}, Action: policy.ActionAllow},
		}
	})
	c := h.client(false)
	ph := h.ph["anthropic"]
	api := http.Header{"X-Api-Key": {ph}, "Content-Type": {"application/json"}}
	cases := []struct {
		name, method, host, path string
		code                     int
		decision, rule           string
	}{
		{"telemetry denied", "POST", "api.example.com", "/api/event_logging/batch", 403, audit.Blocked, "http_rule:telemetry"},
		{"metrics denied", "POST", "api.example.com", "/api/claude_code/metrics", 403, audit.Blocked, "http_rule:telemetry"},
		{"path trick refused", "POST", "api.example.com", "/api//event_logging/batch", 403, audit.Blocked, "http-rule-path"},
		{"escaped path judged decoded", "POST", "api.example.com", "/api/%65vent_logging/batch", 403, audit.Blocked, "http_rule:telemetry"},
		{"model API allowed", "POST", "api.example.com", "/v1/messages", 200, audit.Allowed, "allow:*.example.com"},
		{"GET on read-only host", "GET", "other.example.com", "/pkg", 200, audit.Allowed, "http_rule:read-only"},
		{"POST on read-only host", "POST", "other.example.com", "/pkg-up", 403, audit.Blocked, "http-rule-default"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			hdr := http.Header{"Content-Type": {"application/json"}}
			if tc.host == "api.example.com" {
				hdr = api
			}
			code, rh, body, err := h.do(c, tc.method, h.tlsURL(tc.host, tc.path), hdr, `{"events":[]}`)
			if err != nil || code != tc.code {
				t.Fatalf("got %d %v %q, want %d", code, err, body, tc.code)
			}
			decoded := strings.ReplaceAll(tc.path, "%65", "e")
			r := h.want(t, func(r audit.Record) bool { return r.Path == decoded && r.Method == tc.method }, tc.decision, tc.rule)
			if tc.code != 403 {
				return
			}
			if len(r.SecretsInjected) != 0 {
				t.Fatalf("key injected into a denied request: %+v", r)
			}
			if s := h.up.lastSeen(); s != nil && s.Path == decoded {
				t.Fatal("denied request reached the upstream")
			}
			var d denial
			if err := json.Unmarshal([]byte(body), &d); err != nil || d.Error.Rule != tc.rule || rh.Get("X-Nixcage-Rule") != tc.rule || !strings.Contains(d.Error.Fix, "http_rule") && !strings.Contains(d.Error.Fix, "path") {
				t.Fatalf("refusal body %q: %v", body, err)
			}
		})
	}
}

// A deny rule refuses every spelling a common upstream routes to the path
// it names: other letter case (Express, ASP.NET), a trailing slash
// (Express, Rails), the prefix itself, and ";" path parameters (Tomcat,
// Spring strip them). The agent sends each with its placeholder; none may
// reach the upstream or get the key injected.
func TestThreatHTTPRuleSpellings(t *testing.T) {
	h := newHarness(t, func(rt *policy.Runtime) {
		rt.Policy.HTTPRules = []policy.HTTPRule{
			{Name: "telemetry", Hosts: []string{"api.example.com"}, Paths: []string{"/api/event_logging/*", "/api/claude_code/metrics"}, Action: policy.ActionDeny},
		}
	})
	c := h.client(false)
	api := http.Header{"X-Api-Key": {h.ph["anthropic"]}, "Accept": {"application/json"}}
	for _, tc := range []struct{ path, rule string }{
		{"/API/event_logging/batch", "http_rule:telemetry"},
		{"/api/Event_Logging/batch", "http_rule:telemetry"},
		{"/api/event_logging", "http_rule:telemetry"},
		{"/api/claude_code/metrics/", "http_rule:telemetry"},
		{"/api/claude_code/METRICS", "http_rule:telemetry"},
		{"/api;x=1/event_logging/batch", "http-rule-path"},
		{"/api/claude_code/metrics;", "http-rule-path"},
		{"/api/event_logging%3b/batch", "http-rule-path"},
	} {
		code, _, body, err := h.do(c, "POST", h.tlsURL("api.example.com", tc.path), api, `{"events":[]}`)
		if err != nil || code != 403 {
			t.Errorf("POST %s: got %d %v %.80q, want 403 (%s)", tc.path, code, err, body, tc.rule)
			continue
		}
		decoded := strings.ReplaceAll(tc.path, "%3b", ";")
		r := h.want(t, func(r audit.Record) bool { return r.Path == decoded && r.Method == "POST" }, audit.Blocked, tc.rule)
		if len(r.SecretsInjected) != 0 {
			t.Errorf("key injected into a denied request: %+v", r)
		}
		if s := h.up.lastSeen(); s != nil && s.Path == decoded {
			t.Errorf("denied request %s reached the upstream", tc.path)
		}
	}
	// The model API itself still passes.
	if code, _, body, err := h.do(c, "POST", h.tlsURL("api.example.com", "/v1/messages"), api, `{}`); err != nil || code != 200 {
		t.Fatalf("model API: %d %v %q", code, err, body)
	}
}

// Issue 11 item 9 through the real gateway: a CONNECT refusal and a plain
// HTTP refusal carry the rule and the fix, as a line or as JSON.
func TestThreatRefusalsReadable(t *testing.T) {
	h := newHarness(t, nil)
	conn, err := net.Dial("tcp", h.proxyAddr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	fmt.Fprintf(conn, "CONNECT evil.test:443 HTTP/1.1\r\nHost: evil.test:443\r\n\r\n")
	resp, err := http.ReadResponse(bufio.NewReader(conn), &http.Request{Method: http.MethodConnect})
	if err != nil {
		t.Fatal(err)
	}
	line, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 403 || !strings.HasPrefix(string(line), "nixcage egress: blocked by rule default-deny: ") || !strings.Contains(string(line), "operator: add the host to the egress policy's allow list") {
		t.Fatalf("CONNECT refusal %d %q", resp.StatusCode, line)
	}
	h.want(t, is("CONNECT", "evil.test", 443), audit.Blocked, "default-deny")
	code, rh, body, err := h.do(h.client(false), "GET", h.httpURL("denied.example.com", "/x"), http.Header{"Accept": {"application/json"}}, "")
	var d denial
	if err != nil || code != 403 || json.Unmarshal([]byte(body), &d) != nil || d.Error.Rule != "deny:denied.example.com" || d.Type != "error" || !strings.Contains(d.Error.Message, "deny list") || rh.Get("Content-Type") != "application/json" {
		t.Fatalf("plain HTTP refusal %d %q %v", code, body, err)
	}
}
