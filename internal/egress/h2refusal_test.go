package egress

// Red team finding (h2refuse): a refusal inside an intercepted HTTP/2
// connection set Connection: close, which net/http's HTTP/2 server turns
// into a graceful GOAWAY for the agent's whole connection, so the streams
// the agent opened after one refusal failed unserved. A refusal ends its
// own stream only.

import (
	"bufio"
	"crypto/tls"
	"io"
	"net"
	"net/http"
	"net/http/httptrace"
	"strconv"
	"strings"
	"testing"
	"time"

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
	// An honest client's stream reset after a refusal is no protocol
	// refusal (TestRedTeamH2ProtocolRefusalAudited).
	for _, r := range h.records(t) {
		if r.Rule == "http-protocol" {
			t.Fatalf("http-protocol record for an honest client: %+v", r)
		}
	}
}

func countDistinct(cs []net.Conn) int {
	seen := map[net.Conn]bool{}
	for _, c := range cs {
		seen[c] = true
	}
	return len(seen)
}

// What net/http's HTTP/2 server refuses itself inside an intercepted
// tunnel (a protocol error: GOAWAY; a malformed request: its stream reset)
// gets one http-protocol record with the tunnel's host, as the HTTP/1.1
// refusals do (TestTunnelRefusalAudited). The agent writes raw frames.
func TestRedTeamH2ProtocolRefusalAudited(t *testing.T) {
	h := newHarness(t, nil)
	host := "other.example.com"
	authority := host + ":" + strconv.Itoa(h.up.tlsPort)
	for _, tc := range []struct {
		name   string
		send   func(c *h2Conn) error
		frame  byte   // what the gateway answers: GOAWAY or RST_STREAM
		reason string // in the record's reason
	}{
		{"ping-on-stream", func(c *h2Conn) error { return c.write(h2Ping, 0, 1, make([]byte, 8)) }, h2GoAway, "frame_ping_has_stream"},
		{"request-without-path", func(c *h2Conn) error {
			return c.write(h2Headers, h2EndHeaders|h2EndStream, 1, hpackLiterals(":method", "GET", ":scheme", "https", ":authority", authority))
		}, h2RSTStream, "stream_PROTOCOL_ERROR_bad_path_method"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			raw, _ := h.connect(authority, "")
			if raw == nil {
				t.Fatalf("CONNECT %s refused", authority)
			}
			defer raw.Close()
			_ = raw.SetDeadline(time.Now().Add(20 * time.Second))
			tc2 := tls.Client(raw, &tls.Config{RootCAs: h.cagePool, ServerName: host, NextProtos: []string{"h2"}})
			if err := tc2.Handshake(); err != nil || tc2.ConnectionState().NegotiatedProtocol != "h2" {
				t.Fatalf("TLS with the gateway: %v, ALPN %q", err, tc2.ConnectionState().NegotiatedProtocol)
			}
			c := &h2Conn{c: tc2, br: bufio.NewReader(tc2)}
			if _, err := io.WriteString(tc2, "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"); err != nil {
				t.Fatal(err)
			}
			if err := c.write(h2Settings, 0, 0, nil); err != nil {
				t.Fatal(err)
			}
			if err := tc.send(c); err != nil {
				t.Fatal(err)
			}
			for {
				f, err := readH2Frame(c.br)
				if err != nil {
					t.Fatalf("no %#x frame from the gateway: %v", tc.frame, err)
				}
				if f.typ == tc.frame {
					break
				}
			}
			h.wantOneProtocolRefusal(t, host, tc.reason)
		})
	}
}

const h2Ping = 0x6 // RFC 9113 §6.7
