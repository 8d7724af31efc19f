package egress

// Red team finding (h2refuse): a refusal inside an intercepted HTTP/2
// connection set Connection: close, which net/http's HTTP/2 server turns
// into a graceful GOAWAY for the agent's whole connection, so the streams
// the agent opened after one refusal failed unserved. A refusal ends its
// own stream only.

import (
	"io"
	"net"
	"net/http"
	"net/http/httptrace"
	"strings"
	"testing"

	"github.com/nixcage/nixcage/internal/egress/audit"
	"github.com/nixcage/nixcage/internal/policy"
)

func TestRedTeamH2RefusalKeepsTheConnection(t *testing.T) {
	h := newHarness(t, func(rt *policy.Runtime) {
		rt.Policy.HTTPRules = []policy.HTTPRule{
			{Name: "h2refuse", Hosts: []string{"other.example.com"}, Paths: []string{"/h2refuse/denied"}, Action: policy.ActionDeny},
		}
	})
	c := h.client(true)
	// conns records the connection each request went out on, as the
	// agent's HTTP/2 client reports it.
	var conns []net.Conn
	send := func(method, path, body string) (int, string) {
		t.Helper()
		req, err := http.NewRequest(method, h.tlsURL("other.example.com", path), strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		req = req.WithContext(httptrace.WithClientTrace(req.Context(), &httptrace.ClientTrace{
			GotConn: func(i httptrace.GotConnInfo) { conns = append(conns, i.Conn) },
		}))
		resp, err := c.Do(req)
		if err != nil {
			t.Fatalf("%s %s: %v", method, path, err)
		}
		defer resp.Body.Close()
		if resp.ProtoMajor != 2 {
			t.Fatalf("%s %s answered over %s, want HTTP/2", method, path, resp.Proto)
		}
		b, err := io.ReadAll(resp.Body)
		if err != nil {
			t.Fatalf("%s %s: body: %v", method, path, err)
		}
		return resp.StatusCode, string(b)
	}

	if code, body := send("GET", "/h2refuse/first", ""); code != http.StatusOK {
		t.Fatalf("first request: %d %q, want 200", code, body)
	}
	// The refused request carries a body the gateway never reads: HTTP/2
	// ends that stream (RST_STREAM), the connection stays.
	if code, body := send("POST", "/h2refuse/denied", strings.Repeat("x", 64<<10)); code != http.StatusForbidden || !strings.Contains(body, "http_rule:h2refuse") {
		t.Fatalf("denied request: %d %q, want 403 by http_rule:h2refuse", code, body)
	}
	if code, body := send("GET", "/h2refuse/after", ""); code != http.StatusOK || !strings.Contains(body, "proto=HTTP/2.0") {
		t.Fatalf("request after the refusal: %d %q, want 200 from the upstream", code, body)
	}
	if len(conns) != 3 || conns[1] != conns[0] || conns[2] != conns[0] {
		t.Fatalf("the requests went out on %d connections (%v), want one: the refusal ended the agent's HTTP/2 connection (GOAWAY)", countDistinct(conns), conns)
	}

	// Both are audited as before: the refusal with its rule, the request
	// after it as allowed.
	r := h.want(t, func(r audit.Record) bool { return r.Path == "/h2refuse/denied" }, audit.Blocked, "http_rule:h2refuse")
	if r.Method != "POST" || r.Host != "other.example.com" || r.Port != h.up.tlsPort {
		t.Fatalf("refusal record %+v", r)
	}
	if s := h.up.lastSeen(); s == nil || s.Path != "/h2refuse/after" {
		t.Fatalf("upstream last saw %+v, want /h2refuse/after (and never the denied path)", s)
	}
	h.want(t, func(r audit.Record) bool { return r.Path == "/h2refuse/after" }, audit.Allowed, "")
}

func countDistinct(cs []net.Conn) int {
	seen := map[net.Conn]bool{}
	for _, c := range cs {
		seen[c] = true
	}
	return len(seen)
}
