package egress

import (
	"net/http"
	"strconv"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/nixcage/nixcage/internal/egress/audit"
)

// The agent reaches for a name below a denied one (allow "*.example.com",
// deny "denied.example.com"): CONNECT, plain HTTP and DNS are all refused
// with the deny rule, and the DNS query never reaches the upstream resolver
// (the denied party's name servers would see the data in its labels).
func TestThreatDenyCoversNamesBelow(t *testing.T) {
	h := newHarness(t, nil)
	for _, n := range []string{"x.denied.example.com", "c2vjcmv0.denied.example.com"} {
		h.dns.set(n, "A", "127.0.0.1")
		h.dns.set(n, "TXT", `"ok"`)
	}
	const rule = "deny:denied.example.com"

	if conn, code := h.connect("x.denied.example.com:"+strconv.Itoa(h.up.tlsPort), ""); code != http.StatusForbidden {
		if conn != nil {
			conn.Close()
		}
		t.Fatalf("CONNECT below a denied name: %d, want 403", code)
	}
	h.want(t, is("CONNECT", "x.denied.example.com", h.up.tlsPort), audit.Blocked, rule)

	code, _, _, err := h.do(h.client(false), "GET", h.httpURL("x.denied.example.com", "/below"), nil, "")
	if err != nil || code != http.StatusForbidden {
		t.Fatalf("plain HTTP below a denied name: %d %v, want 403", code, err)
	}
	h.want(t, func(r audit.Record) bool { return r.Path == "/below" }, audit.Blocked, rule)

	for _, netw := range []string{"udp", "tcp"} {
		m := new(dns.Msg)
		m.SetQuestion("c2vjcmv0.denied.example.com.", dns.TypeTXT)
		resp, _, err := (&dns.Client{Net: netw, Timeout: 10 * time.Second}).Exchange(m, h.dnsAddr)
		if err != nil {
			t.Fatal(err)
		}
		if resp.Rcode != dns.RcodeRefused || len(resp.Answer) != 0 {
			t.Fatalf("%s DNS below a denied name: %s %v, want REFUSED", netw, dns.RcodeToString[resp.Rcode], resp.Answer)
		}
	}
	h.want(t, is("DNS", "c2vjcmv0.denied.example.com", 53), audit.Blocked, rule)
	if n := h.dns.queries("c2vjcmv0.denied.example.com", "TXT"); n != 0 {
		t.Fatalf("upstream resolver received %d queries for a name below a denied one", n)
	}
}
