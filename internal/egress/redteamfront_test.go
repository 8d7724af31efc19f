package egress

import (
	"bufio"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nixcage/nixcage/internal/egress/audit"
	"github.com/nixcage/nixcage/internal/policy"
)

// A proxy-chaining header is refused whatever its first line says: an
// empty (or blank) first line hid a second one from Header.Get, so a
// CONNECT carrying "Via:" then "Via: 1.1 other-proxy" was tunnelled, and a
// plain request's "X-Forwarded-Host:" then "X-Forwarded-Host: evil.test"
// reached the upstream as "X-Forwarded-Host: ,evil.test" (the upstream
// joins both lines). Sent raw, as the agent would, to the real gateway:
// by the CONNECT front end, by net/http (a CONNECT after a plain request
// on the same connection) and on the plain-HTTP path; each refusal is
// audited and the upstream sees nothing.
func TestThreatChainingHeaderBehindEmptyLine(t *testing.T) {
	h := newHarness(t, nil)
	tp, hp := strconv.Itoa(h.up.tlsPort), strconv.Itoa(h.up.httpPort)
	plainGET := func(path, extra string) string {
		return "GET http://plain.example.com:" + hp + path + " HTTP/1.1\r\nHost: plain.example.com:" + hp + "\r\n" + extra + "\r\n"
	}
	// send writes each request on one connection and returns the last
	// response's status, rule and whether the gateway then closed.
	send := func(t *testing.T, reqs ...string) (int, string) {
		t.Helper()
		c, err := net.Dial("tcp", h.proxyAddr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(15 * time.Second))
		br := bufio.NewReader(c)
		var resp *http.Response
		for _, r := range reqs {
			io.WriteString(c, r)
			method := "GET"
			if strings.HasPrefix(r, "CONNECT ") {
				method = "CONNECT"
			}
			if resp, err = http.ReadResponse(br, &http.Request{Method: method}); err != nil {
				t.Fatalf("%q: %v", r, err)
			}
			if method == "CONNECT" && resp.StatusCode == http.StatusOK {
				return resp.StatusCode, ""
			}
			io.Copy(io.Discard, resp.Body)
		}
		return resp.StatusCode, resp.Header.Get("X-Nixcage-Rule")
	}
	for _, hdr := range []string{"Via", "Forwarded", "X-Forwarded-For", "X-Forwarded-Host", "Max-Forwards"} {
		for _, first := range []string{hdr + ":", hdr + ": \t "} {
			extra := first + "\r\n" + hdr + ": evil.test\r\n"
			connect := "CONNECT plain.example.com:" + tp + " HTTP/1.1\r\nHost: plain.example.com:" + tp + "\r\n" + extra + "\r\n"
			t.Run(fmt.Sprintf("%q", first), func(t *testing.T) {
				if code, rule := send(t, connect); code != http.StatusForbidden || rule != "proxy-chaining" {
					t.Errorf("front end: CONNECT with %q: %d %q, want 403 proxy-chaining", extra, code, rule)
				}
				if code, rule := send(t, plainGET("/before", ""), connect); code != http.StatusForbidden || rule != "proxy-chaining" {
					t.Errorf("net/http: CONNECT with %q after a plain request: %d %q, want 403 proxy-chaining", extra, code, rule)
				}
				path := "/chain-" + strings.ToLower(hdr)
				if code, rule := send(t, plainGET(path, extra)); code != http.StatusForbidden || rule != "proxy-chaining" {
					s := h.up.lastSeen()
					t.Errorf("plain GET with %q: %d %q, want 403 proxy-chaining (upstream saw %s: %q)", extra, code, rule, hdr, s.Header.Values(hdr))
				}
				// Inside an intercepted tunnel, where the gateway forwards
				// the request itself.
				conn, code := h.connect("api.example.com:"+tp, "")
				if conn == nil {
					t.Fatalf("CONNECT api.example.com: %d", code)
				}
				defer conn.Close()
				tc := tls.Client(conn, &tls.Config{RootCAs: h.cagePool, ServerName: "api.example.com", NextProtos: []string{"http/1.1"}})
				tc.SetDeadline(time.Now().Add(15 * time.Second))
				ipath := path + "-intercepted"
				fmt.Fprintf(tc, "GET %s HTTP/1.1\r\nHost: api.example.com:%s\r\n%s\r\n", ipath, tp, extra)
				resp, err := http.ReadResponse(bufio.NewReader(tc), nil)
				if err != nil {
					t.Fatal(err)
				}
				if resp.StatusCode != http.StatusForbidden || resp.Header.Get("X-Nixcage-Rule") != "proxy-chaining" {
					t.Errorf("intercepted GET with %q: %d %q, want 403 proxy-chaining", extra, resp.StatusCode, resp.Header.Get("X-Nixcage-Rule"))
				}
				h.want(t, func(r audit.Record) bool { return r.Path == path }, audit.Blocked, "proxy-chaining")
				h.want(t, func(r audit.Record) bool { return r.Path == ipath }, audit.Blocked, "proxy-chaining")
				h.want(t, is("CONNECT", "plain.example.com", h.up.tlsPort), audit.Blocked, "proxy-chaining")
			})
		}
	}
}

// Connections that hold the front end without finishing a head (half-open
// ones that send nothing, and ones stalled inside a 60 KiB header line)
// are bounded by max_tunnels (one more gets a 503), dropped by the
// gateway itself at the header deadline, and leave nothing behind: the
// gateway's goroutines return to their count before, and each connection
// that sent bytes has its header-timeout record. As the agent: raw TCP to
// the real gateway's listener.
func TestFrontEndHeldHeadsLeaveNothing(t *testing.T) {
	const half, stalled = 40, 40
	h := newHarness(t, func(rt *policy.Runtime) {
		rt.Policy.Limits.IdleTimeoutSeconds = 2
		rt.Policy.Limits.MaxTunnels = half + stalled
		rt.Policy.Limits.MaxHeaderBytes = 64 << 10
	})
	settle := func(want int) int {
		n := runtime.NumGoroutine()
		for deadline := time.Now().Add(15 * time.Second); n > want && time.Now().Before(deadline); n = runtime.NumGoroutine() {
			time.Sleep(50 * time.Millisecond)
		}
		return n
	}
	time.Sleep(100 * time.Millisecond) // the harness's servers start their goroutines
	before := runtime.NumGoroutine()
	var cs []net.Conn
	for i := 0; i < half+stalled; i++ {
		c, err := net.Dial("tcp", h.proxyAddr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if i >= half {
			io.WriteString(c, "CONNECT plain.example.com:443 HTTP/1.1\r\nX-Pad: "+strings.Repeat("a", 60<<10))
		}
		cs = append(cs, c)
	}
	// Every slot is held: one more connection is answered 503 at once.
	over, err := net.Dial("tcp", h.proxyAddr)
	if err != nil {
		t.Fatal(err)
	}
	defer over.Close()
	over.SetDeadline(time.Now().Add(10 * time.Second))
	io.WriteString(over, "CONNECT plain.example.com:443 HTTP/1.1\r\n\r\n")
	if resp, err := http.ReadResponse(bufio.NewReader(over), &http.Request{Method: http.MethodConnect}); err != nil || resp.StatusCode != http.StatusServiceUnavailable {
		t.Fatalf("connection over max_tunnels: %v %v, want 503", resp, err)
	}
	for i, c := range cs {
		c.SetReadDeadline(time.Now().Add(20 * time.Second))
		if b, err := io.ReadAll(c); err != nil || len(b) != 0 {
			t.Fatalf("held connection %d: read %q, %v; want the gateway to close it without an answer", i, b, err)
		}
	}
	// A little slack: the fake DNS and upstream servers share the process.
	if after := settle(before + 2); after > before+2 {
		t.Fatalf("goroutines: %d before, %d after every held connection was dropped", before, after)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		n := 0
		for _, r := range h.records(t) {
			if r.Rule == "header-timeout" && r.Decision == audit.Blocked && r.BytesOut > 60<<10 {
				n++
			}
		}
		if n == stalled {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d header-timeout records for %d stalled heads:\n%s", n, stalled, h.dump())
		}
		time.Sleep(50 * time.Millisecond)
	}
}
