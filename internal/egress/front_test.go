package egress

import (
	"bufio"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nixcage/nixcage/internal/egress/audit"
	"github.com/nixcage/nixcage/internal/policy"
)

// rawRequest sends req on a fresh connection to the gateway and reads the
// response to a CONNECT.
func (h *harness) rawRequest(t *testing.T, req string) (*http.Response, string) {
	t.Helper()
	c, err := net.Dial("tcp", h.proxyAddr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(15 * time.Second))
	if _, err := io.WriteString(c, req); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(c), &http.Request{Method: http.MethodConnect})
	if err != nil {
		t.Fatalf("%q: %v", req, err)
	}
	b, _ := io.ReadAll(resp.Body)
	return resp, string(b)
}

// The front end reads a connection's first CONNECT itself: a malformed
// head is refused with its status, says what is wrong, and leaves an audit
// record (rule http-protocol), as net/http's refusals did; none of them
// opens a tunnel. Run against the real gateway as the agent would send it.
func TestFrontEndRefusesMalformedConnect(t *testing.T) {
	h := newHarness(t, nil)
	port := strconv.Itoa(h.up.tlsPort)
	for i, c := range []struct {
		name, req string
		status    int
		says      string
	}{
		{"no version", "CONNECT plain.example.com:" + port + "\r\n\r\n", 400, "malformed request line"},
		{"HTTP/2.0", "CONNECT plain.example.com:" + port + " HTTP/2.0\r\n\r\n", 505, "HTTP/1.x only"},
		{"path form", "CONNECT /x HTTP/1.1\r\nHost: plain.example.com:" + port + "\r\n\r\n", 400, "authority form"},
		{"user info", "CONNECT u@plain.example.com:" + port + " HTTP/1.1\r\n\r\n", 400, "authority form"},
		{"bad header name", "CONNECT plain.example.com:" + port + " HTTP/1.1\r\nBad Header: x\r\n\r\n", 400, "malformed header name"},
		{"NUL in value", "CONNECT plain.example.com:" + port + " HTTP/1.1\r\nX-A: \x00\r\n\r\n", 400, "control character"},
		{"two Host headers", "CONNECT plain.example.com:" + port + " HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400, "too many Host"},
		{"a body", "CONNECT plain.example.com:" + port + " HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc", 400, "carries no body"},
		// The limit is the policy's max_header_bytes (16 KiB here) plus
		// net/http's 4 KiB of slack, as before.
		{"huge head", "CONNECT plain.example.com:" + port + " HTTP/1.1\r\nX-Junk: " + strings.Repeat("j", 24<<10) + "\r\n\r\n", 431, "over 20480 bytes"},
	} {
		t.Run(c.name, func(t *testing.T) {
			resp, body := h.rawRequest(t, c.req+fmt.Sprintf("\x16\x03\x01 %d", i))
			if resp.StatusCode != c.status || !strings.Contains(body, c.says) || resp.Header.Get("X-Nixcage-Rule") != "http-protocol" {
				t.Fatalf("got %d %q (rule %q), want %d saying %q", resp.StatusCode, body, resp.Header.Get("X-Nixcage-Rule"), c.status, c.says)
			}
			r := h.want(t, func(r audit.Record) bool {
				return r.Rule == "http-protocol" && strings.Contains(r.Reason, c.says)
			}, audit.Blocked, "http-protocol")
			if !strings.Contains(r.Reason, strconv.Itoa(c.status)) || r.BytesOut == 0 {
				t.Fatalf("record %+v: want the status and the bytes read", r)
			}
		})
	}
	n := 0
	for _, r := range h.records(t) {
		if r.Event == audit.EventOpen {
			t.Fatalf("a malformed CONNECT opened a tunnel: %+v", r)
		}
		if r.Rule == "http-protocol" {
			n++
		}
	}
	if n != 9 {
		t.Fatalf("%d http-protocol records for 9 malformed heads:\n%s", n, h.dump())
	}
}

// A client trickling its request line is dropped when the header timeout
// (min(30 s, idle timeout), from the first byte's connection on) runs out,
// however steadily it sends: the deadline is not refreshed per byte.
func TestFrontEndSlowlorisRequestLine(t *testing.T) {
	h := newHarness(t, func(rt *policy.Runtime) { rt.Policy.Limits.IdleTimeoutSeconds = 1 })
	c, err := net.Dial("tcp", h.proxyAddr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	line := "CONNECT plain.example.com:" + strconv.Itoa(h.up.tlsPort) + " HTTP/1.1\r\n\r\n"
	dropped := false
	// 100 ms per byte: the line takes ~4 s, ten times the timeout plus
	// slack for a loaded machine; the gateway must close long before.
	for i := 0; i < len(line)-2; i++ {
		if _, err := c.Write([]byte{line[i]}); err != nil {
			dropped = true
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	b, err := io.ReadAll(c)
	if err != nil && !dropped {
		t.Fatalf("slow client not dropped: %v", err)
	}
	if strings.Contains(string(b), " 200 ") {
		t.Fatalf("slow client got a tunnel: %q", b)
	}
	h.want(t, func(r audit.Record) bool { return r.Rule == "header-timeout" }, audit.Blocked, "header-timeout")
}

// A refusal the front end writes reads like one from net/http's path: the
// rule header, JSON for an API client, the audit record.
func TestFrontEndRefusalShape(t *testing.T) {
	h := newHarness(t, nil)
	auth := "denied.example.com:" + strconv.Itoa(h.up.tlsPort)
	resp, body := h.rawRequest(t, "CONNECT "+auth+" HTTP/1.1\r\nHost: "+auth+"\r\nAccept: application/json\r\n\r\n")
	if resp.StatusCode != http.StatusForbidden || resp.Header.Get("X-Nixcage-Rule") != "deny:denied.example.com" {
		t.Fatalf("got %d rule %q: %s", resp.StatusCode, resp.Header.Get("X-Nixcage-Rule"), body)
	}
	var d denial
	if err := json.Unmarshal([]byte(body), &d); err != nil || d.Error.Rule != "deny:denied.example.com" || d.Error.Fix == "" {
		t.Fatalf("JSON denial %q: %v", body, err)
	}
	h.want(t, is("CONNECT", "denied.example.com", h.up.tlsPort), audit.Blocked, "deny:denied.example.com")
	resp, body = h.rawRequest(t, "CONNECT plain.example.com:"+strconv.Itoa(h.up.tlsPort)+" HTTP/1.1\r\nVia: 1.1 other-proxy\r\n\r\n")
	if resp.StatusCode != http.StatusForbidden || resp.Header.Get("X-Nixcage-Rule") != "proxy-chaining" || !strings.HasPrefix(body, "nixcage egress: blocked by rule proxy-chaining") {
		t.Fatalf("Via: got %d %q", resp.StatusCode, body)
	}
	h.want(t, func(r audit.Record) bool { return r.Rule == "proxy-chaining" }, audit.Blocked, "proxy-chaining")
}

// A CONNECT after a plain request on the same connection reaches
// net/http's server (the front end reads only a connection's first
// request): it is decided and tunnelled exactly the same.
func TestConnectAfterPlainRequest(t *testing.T) {
	h := newHarness(t, nil)
	c, err := net.Dial("tcp", h.proxyAddr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(15 * time.Second))
	br := bufio.NewReader(c)
	fmt.Fprintf(c, "GET %s HTTP/1.1\r\nHost: plain.example.com\r\n\r\n", h.httpURL("plain.example.com", "/first"))
	resp, err := http.ReadResponse(br, nil)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("plain request: %v %v", resp, err)
	}
	io.Copy(io.Discard, resp.Body)
	auth := "plain.example.com:" + strconv.Itoa(h.up.tlsPort)
	fmt.Fprintf(c, "CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n", auth, auth)
	resp, err = http.ReadResponse(br, &http.Request{Method: http.MethodConnect})
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("CONNECT after a plain request: %v %v", resp, err)
	}
	tc := tls.Client(c, &tls.Config{RootCAs: h.up.roots, ServerName: "plain.example.com"})
	fmt.Fprintf(tc, "GET /second HTTP/1.1\r\nHost: plain.example.com\r\nConnection: close\r\n\r\n")
	resp, err = http.ReadResponse(bufio.NewReader(tc), nil)
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("GET through the tunnel: %v %v", resp, err)
	}
	io.Copy(io.Discard, resp.Body)
	tc.Close()
	h.want(t, closed("CONNECT", "plain.example.com", h.up.tlsPort), audit.Allowed, "")
	h.want(t, func(r audit.Record) bool { return r.Path == "/first" }, audit.Allowed, "")
}

// An agent that hangs up while its CONNECT waits for an operator ends the
// wait (net/http's request context did this before the front end read
// CONNECT itself): the refusal is audited at once, not after the wait.
func TestFrontEndApprovalWaitEndsOnHangup(t *testing.T) {
	h := newHarness(t, approvalRuntime(60))
	c, err := net.Dial("tcp", h.proxyAddr)
	if err != nil {
		t.Fatal(err)
	}
	auth := "plain.example.com:" + strconv.Itoa(h.up.tlsPort)
	fmt.Fprintf(c, "CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n", auth, auth)
	waitPending(t, h.rt.Approval, "plain.example.com")
	c.Close()
	r := h.want(t, is("CONNECT", "plain.example.com", h.up.tlsPort), audit.Blocked, policy.RuleApprovalTimeout)
	if !strings.Contains(r.Reason, "went away") {
		t.Fatalf("reason %q, want the hang-up", r.Reason)
	}
}
