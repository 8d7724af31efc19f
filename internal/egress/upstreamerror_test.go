package egress

import (
	"bufio"
	"crypto/tls"
	"fmt"
	"net"
	"net/http"
	"net/textproto"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/nixcage/nixcage/internal/egress/audit"
	"github.com/nixcage/nixcage/internal/egress/ca"
	"github.com/nixcage/nixcage/internal/policy"
)

// rawUpstream is a TLS server (the harness's upstream CA) that answers each
// request with answer(key), key being the X-Api-Key it received: a
// secret-bound upstream that echoes the injected key into a response Go's
// transport cannot parse.
func rawUpstream(t *testing.T, caDir string, answer func(key string) string) int {
	t.Helper()
	l := upstreamListener(t, caDir)
	serveEach(l, func(c net.Conn) {
		tp := textproto.NewReader(bufio.NewReader(c))
		if _, err := tp.ReadLine(); err != nil {
			return
		}
		h, _ := tp.ReadMIMEHeader()
		fmt.Fprint(c, answer(h.Get("X-Api-Key")))
	})
	return l.Addr().(*net.TCPAddr).Port
}

// upstreamListener is a TLS listener on loopback with leaves from the
// harness's upstream CA in caDir, offering the ALPN protos, closed at the
// end of the test.
func upstreamListener(t *testing.T, caDir string, protos ...string) net.Listener {
	t.Helper()
	a, err := ca.Load(filepath.Join(caDir, ca.KeyFile), filepath.Join(caDir, ca.CertFile))
	if err != nil {
		t.Fatal(err)
	}
	l, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{NextProtos: protos, GetCertificate: func(h *tls.ClientHelloInfo) (*tls.Certificate, error) { return a.Leaf(h.ServerName) }})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}

// Red team, issue 11 item 1: the gateway's own refusal quoted the
// upstream's malformed response (Go's transport errors quote a bad header
// line, Content-Length or Transfer-Encoding), so a key echoed into one
// reached the agent in clear in the 502 body. The agent sends its
// placeholder; neither the refusal nor the audit may hold the real value,
// and the audit says the secret was redacted.
func TestThreatUpstreamErrorEcho(t *testing.T) {
	for name, answer := range map[string]func(string) string{
		"header line": func(k string) string {
			return "HTTP/1.1 401 Unauthorized\r\nX-Bad key " + k + "\r\nContent-Length: 0\r\n\r\n"
		},
		"control byte": func(k string) string {
			return "HTTP/1.1 401 Unauthorized\r\nX-Key: " + k + "\x01\r\nContent-Length: 0\r\n\r\n"
		},
		"content-length":    func(k string) string { return "HTTP/1.1 200 OK\r\nContent-Length: " + k + "\r\n\r\n" },
		"transfer-encoding": func(k string) string { return "HTTP/1.1 200 OK\r\nTransfer-Encoding: " + k + "\r\n\r\n" },
	} {
		t.Run(name, func(t *testing.T) {
			var port int
			h := newHarness(t, func(rt *policy.Runtime) {
				port = rawUpstream(t, filepath.Join(filepath.Dir(rt.AuditFile), "upstream-ca"), answer)
				rt.Policy.Ports = append(rt.Policy.Ports, port)
			})
			code, hdr, body, err := h.do(h.client(false), "GET", "https://api.example.com:"+strconv.Itoa(port)+"/v1/"+strings.ReplaceAll(name, " ", "-"), http.Header{"X-Api-Key": {h.ph["anthropic"]}}, "")
			if err != nil || code != http.StatusBadGateway {
				t.Fatalf("got %d %v %q, want 502", code, err, body)
			}
			if strings.Contains(body, realAnthropic) || strings.Contains(fmt.Sprint(hdr), realAnthropic) {
				t.Fatalf("the real key reached the agent: %q", body)
			}
			r := h.want(t, func(r audit.Record) bool { return r.Path == "/v1/"+strings.ReplaceAll(name, " ", "-") }, audit.Blocked, "upstream")
			if strings.Contains(r.Reason, realAnthropic) || !slices.Contains(r.SecretsRedacted, "anthropic") || !slices.Contains(r.SecretsInjected, "anthropic") {
				t.Fatalf("audit record %+v: want the key injected, redacted from the reason", r)
			}
		})
	}
}
