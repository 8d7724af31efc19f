package egress

import (
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"

	"github.com/nixcage/nixcage/internal/egress/audit"
)

// The caged agent sends a secret as a request header NAME ("sk-ant-…: x")
// to an intercepted host, over HTTP/1.1 and HTTP/2, through the real
// gateway. net/http canonicalizes the name before the inspectors see it
// ("Sk-Ant-Api03-Zq9zq9…", HTTP/2 sends it lowered), so the name is
// inspected without ASCII case. Each secret is sent once as a header value
// and once as a name: the name must be refused exactly as the value is
// (status, decision, rule, inspectors, reason but for the part's label),
// and no record may quote the name. Before the fix names were not
// inspected at all: every name case came back 200, allowed.
func TestRedTeamSecretInRequestHeaderName(t *testing.T) {
	h := newHarness(t, nil)
	secrets := []struct{ name, s string }{
		{"aws-access-key-id", "AKIAIOSFODNN7EXAMPLE"},
		{"anthropic-key", "sk-ant-api03-" + strings.Repeat("Zq9", 20)},
		{"github-token", "ghp_" + strings.Repeat("aB3", 12)},
		{"slack-token", "xoxb-1234567890-AbCdEfGhIj"},
		{"google-api-key", "AIza" + strings.Repeat("Sy9", 11) + "Q_"},
		{"real value", realAnthropic},
		// The placeholder of a secret not bound to other.example.com.
		{"placeholder", h.ph["anthropic"]},
	}
	for _, h2 := range []bool{false, true} {
		c := h.client(h2)
		for i, sc := range secrets {
			t.Run(fmt.Sprintf("h2=%v/%s", h2, sc.name), func(t *testing.T) {
				send := func(as string, hdr http.Header) (int, audit.Record) {
					path := fmt.Sprintf("/hdrname/%v/%d/%s", h2, i, as)
					code, _, _, err := h.do(c, "GET", h.tlsURL("other.example.com", path), hdr, "")
					if err != nil {
						t.Fatalf("%s: %v", as, err)
					}
					return code, h.want(t, func(r audit.Record) bool { return r.Path == path }, audit.Blocked, "")
				}
				vcode, v := send("value", http.Header{"X-Probe": {sc.s}})
				ncode, n := send("name", http.Header{sc.s: {"x"}})
				if vcode != http.StatusForbidden || ncode != vcode {
					t.Errorf("status as a value %d, as a name %d; want 403 both", vcode, ncode)
				}
				if n.Decision != v.Decision || n.Rule != v.Rule || !slices.Equal(n.Inspectors, v.Inspectors) || !slices.Equal(n.SecretsInjected, v.SecretsInjected) ||
					n.Method != v.Method || n.Host != v.Host || n.Port != v.Port {
					t.Errorf("as a name the record differs from as a value:\nname  %+v\nvalue %+v", n, v)
				}
				if want := strings.ReplaceAll(v.Reason, "header X-Probe", "header name"); n.Reason != want {
					t.Errorf("as a name reason %q, want %q (as a value %q)", n.Reason, want, v.Reason)
				}
				low := strings.ToLower(sc.s)
				for _, f := range []string{n.Reason, n.Path, h.dump()} {
					if strings.Contains(strings.ToLower(f), low) {
						t.Errorf("an audit record quotes the name: %q", f)
					}
				}
			})
		}
	}
	// A name as ordinary as ones clients send still passes.
	code, _, _, err := h.do(h.client(false), "GET", h.tlsURL("other.example.com", "/hdrname/ok"), http.Header{"X-Request-Id": {"7"}, "Sec-Ch-Ua-Platform": {`"Linux"`}}, "")
	if err != nil || code != 200 {
		t.Fatalf("ordinary names: %d %v", code, err)
	}
	h.want(t, func(r audit.Record) bool { return r.Path == "/hdrname/ok" }, audit.Allowed, "")
}
