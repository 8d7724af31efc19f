package egress

import (
	"bufio"
	"errors"
	"io"
	"net/http"
	"strings"
	"testing"
	"testing/iotest"
)

// parseHead runs readConnectHead on s, and reports how many bytes of s it
// consumed.
func parseHead(s string, max int) (connectHead, int, error) {
	r := strings.NewReader(s)
	br := bufio.NewReaderSize(r, 4096)
	h, err := readConnectHead(br, max)
	return h, len(s) - r.Len() - br.Buffered(), err
}

func TestReadConnectHead(t *testing.T) {
	for _, c := range []struct {
		name, in, authority string
		header              http.Header
	}{
		{"curl", "CONNECT plain.example.com:443 HTTP/1.1\r\nHost: plain.example.com:443\r\nUser-Agent: curl/7.88.1\r\nProxy-Connection: Keep-Alive\r\n\r\n", "plain.example.com:443", nil},
		{"go client", "CONNECT api.example.com:443 HTTP/1.1\r\nHost: api.example.com:443\r\nUser-Agent: Go-http-client/1.1\r\n\r\n", "api.example.com:443", nil},
		{"HTTP/1.0, no Host", "CONNECT a.example:8443 HTTP/1.0\r\n\r\n", "a.example:8443", nil},
		{"bare LF", "CONNECT a.example:443 HTTP/1.1\nHost: a.example\n\n", "a.example:443", nil},
		{"kept headers", "CONNECT a.example:443 HTTP/1.1\r\naccept: application/json\r\nVIA: 1.1 p\r\nContent-Length: 0\r\n\r\n", "a.example:443",
			http.Header{"Accept": {"application/json"}, "Via": {"1.1 p"}}},
		{"IPv6 literal", "CONNECT [2001:db8::1]:443 HTTP/1.1\r\n\r\n", "[2001:db8::1]:443", nil},
		{"header longer than the buffer", "CONNECT a.example:443 HTTP/1.1\r\nX-Long: " + strings.Repeat("x", 9000) + "\r\n\r\n", "a.example:443", nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			h, used, err := parseHead(c.in+"\x16\x03\x01", 16<<10)
			if err != nil {
				t.Fatal(err)
			}
			if h.authority != c.authority {
				t.Fatalf("authority %q, want %q", h.authority, c.authority)
			}
			if len(h.header) != len(c.header) {
				t.Fatalf("header %v, want %v", h.header, c.header)
			}
			for k, v := range c.header {
				if strings.Join(h.header[k], ",") != strings.Join(v, ",") {
					t.Fatalf("header %s = %q, want %q", k, h.header[k], v)
				}
			}
			// What follows the head (a pipelined ClientHello) is left
			// unread for the tunnel.
			if used != len(c.in) {
				t.Fatalf("consumed %d bytes, the head is %d", used, len(c.in))
			}
		})
	}
}

// Every malformed head is refused with a status and says what is wrong.
func TestReadConnectHeadRefuses(t *testing.T) {
	big := "CONNECT a.example:443 HTTP/1.1\r\n" + strings.Repeat("X-Junk: "+strings.Repeat("j", 1000)+"\r\n", 20) + "\r\n"
	for _, c := range []struct {
		name, in string
		status   int
		says     string
	}{
		{"no version", "CONNECT a.example:443\r\n\r\n", 400, "malformed request line"},
		{"double space", "CONNECT  a.example:443 HTTP/1.1\r\n\r\n", 400, "malformed request line"},
		{"empty line", "\r\n\r\n", 400, "malformed request line"},
		{"other method", "CONNECTX a.example:443 HTTP/1.1\r\n\r\n", 400, "method"},
		{"bad version", "CONNECT a.example:443 HTTP/1.x\r\n\r\n", 400, "malformed HTTP version"},
		{"lower-case version", "CONNECT a.example:443 http/1.1\r\n\r\n", 400, "malformed HTTP version"},
		{"HTTP/2.0", "CONNECT a.example:443 HTTP/2.0\r\n\r\n", 505, "HTTP/1.x only"},
		{"trailing junk", "CONNECT a.example:443 HTTP/1.1 x\r\n\r\n", 400, "malformed HTTP version"},
		{"path form", "CONNECT /a HTTP/1.1\r\nHost: a.example:443\r\n\r\n", 400, "authority form"},
		{"asterisk", "CONNECT * HTTP/1.1\r\n\r\n", 400, "authority form"},
		{"absolute URL", "CONNECT http://a.example:443/ HTTP/1.1\r\n\r\n", 400, "authority form"},
		{"user info", "CONNECT user:pw@a.example:443 HTTP/1.1\r\n\r\n", 400, "authority form"},
		{"path after authority", "CONNECT a.example:443/x HTTP/1.1\r\n\r\n", 400, "authority form"},
		{"query", "CONNECT a.example:443?x HTTP/1.1\r\n\r\n", 400, "authority form"},
		{"fragment", "CONNECT a.example:443#x HTTP/1.1\r\n\r\n", 400, "authority form"},
		{"control character in target", "CONNECT a.exa\x01mple:443 HTTP/1.1\r\n\r\n", 400, "authority form"},
		{"no colon", "CONNECT a.example:443 HTTP/1.1\r\nHost a.example\r\n\r\n", 400, "no colon"},
		{"space in name", "CONNECT a.example:443 HTTP/1.1\r\nBad Header: x\r\n\r\n", 400, "malformed header name"},
		{"space before colon", "CONNECT a.example:443 HTTP/1.1\r\nHost : a.example\r\n\r\n", 400, "malformed header name"},
		{"empty name", "CONNECT a.example:443 HTTP/1.1\r\n: x\r\n\r\n", 400, "malformed header name"},
		{"NUL in value", "CONNECT a.example:443 HTTP/1.1\r\nX-A: a\x00b\r\n\r\n", 400, "control character"},
		{"CR in value", "CONNECT a.example:443 HTTP/1.1\r\nX-A: a\rb\r\n\r\n", 400, "control character"},
		{"folded line", "CONNECT a.example:443 HTTP/1.1\r\nX-A: a\r\n b\r\n\r\n", 400, "folded"},
		{"two Host headers", "CONNECT a.example:443 HTTP/1.1\r\nHost: a.example\r\nhost: b.example\r\n\r\n", 400, "too many Host"},
		{"a body", "CONNECT a.example:443 HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello", 400, "carries no body"},
		{"chunked", "CONNECT a.example:443 HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n", 400, "carries no body"},
		{"too large", big, 431, "over 16384 bytes"},
		{"one line too large", "CONNECT a.example:443 HTTP/1.1\r\nX: " + strings.Repeat("x", 17<<10), 431, "over 16384 bytes"},
		{"request line too large", "CONNECT " + strings.Repeat("a", 17<<10), 431, "over 16384 bytes"},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, used, err := parseHead(c.in, 16<<10)
			var he *headError
			if !errors.As(err, &he) {
				t.Fatalf("got %v, want a %d refusal", err, c.status)
			}
			if he.status != c.status || !strings.Contains(he.Error(), c.says) {
				t.Fatalf("got %q, want %d saying %q", he.Error(), c.status, c.says)
			}
			if used > 16<<10+4096 {
				t.Fatalf("read %d bytes past the limit before refusing", used)
			}
		})
	}
}

// A head that never completes is the reader's error, not a refusal: the
// front end closes the connection (audited as header-timeout).
func TestReadConnectHeadIncomplete(t *testing.T) {
	for _, in := range []string{"CONNECT a.example:443 HTTP/1.1\r\n", "CONNECT a.exa", "CONNECT a.example:443 HTTP/1.1\r\nHost: a"} {
		_, _, err := parseHead(in, 16<<10)
		if !errors.Is(err, io.EOF) {
			t.Fatalf("%q: got %v, want EOF", in, err)
		}
	}
	br := bufio.NewReader(iotest.TimeoutReader(strings.NewReader("CONNECT a.example:443 HTTP/1.1\r\n")))
	if _, err := readConnectHead(br, 16<<10); !errors.Is(err, iotest.ErrTimeout) {
		t.Fatalf("got %v, want the reader's timeout", err)
	}
}

// FuzzReadConnectHead: the parser never panics, never reads past its
// limit, and is never looser than net/http: whatever it accepts,
// http.ReadRequest parses as a CONNECT to the same Host, so the decision
// sees what it saw before the front end read CONNECT itself.
// checks/test.sh runs it briefly in the fuzz tier.
func FuzzReadConnectHead(f *testing.F) {
	for _, s := range []string{
		"CONNECT plain.example.com:443 HTTP/1.1\r\nHost: plain.example.com:443\r\n\r\n",
		"CONNECT [::1]:443 HTTP/1.0\r\nVia: x\r\n\r\n",
		"CONNECT a:1 HTTP/1.1\nAccept: application/json\n\n\x16\x03\x01",
		"CONNECT a%2eb:443 HTTP/1.1\r\n\r\n",
		"CONNECT a:443 HTTP/1.1\r\nHost: a\r\n b\r\n\r\n",
		"CONNECT /x HTTP/1.1\r\nHost: a:443\r\n\r\n",
	} {
		f.Add(s)
	}
	const max = 1024
	f.Fuzz(func(t *testing.T, in string) {
		h, used, err := parseHead(in, max)
		if used > max+4096 {
			t.Fatalf("read %d bytes, limit %d", used, max)
		}
		if err != nil {
			var he *headError
			if !errors.As(err, &he) && !errors.Is(err, io.EOF) {
				t.Fatalf("error %v is neither a refusal nor the reader's", err)
			}
			return
		}
		r, rerr := http.ReadRequest(bufio.NewReader(strings.NewReader(in)))
		if rerr != nil {
			t.Fatalf("accepted %q (authority %q), net/http refuses it: %v", in, h.authority, rerr)
		}
		if r.Method != http.MethodConnect || r.Host != h.authority {
			t.Fatalf("accepted %q as CONNECT %q, net/http reads %s %q", in, h.authority, r.Method, r.Host)
		}
	})
}
