package egress

import (
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/nixcage/nixcage/internal/egress/audit"
	"github.com/nixcage/nixcage/internal/testenv"
)

// setRRs registers one answer set of whole records (owner names of their
// own: CNAME chains, strays) for a question.
func (f *fakeDNS) setRRs(name, typ string, rrs ...string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.records[dns.Fqdn(name)+" "+typ] = [][]string{rrs}
}

// cageDNS asks the gateway's DNS filter from inside the cage's network
// namespace, as the agent's stub resolver does, over UDP with EDNS (HTTPS
// answers are larger than 512 bytes).
func cageDNS(t *testing.T, h *harness, name string, qtype uint16) *dns.Msg {
	t.Helper()
	m := new(dns.Msg)
	m.SetQuestion(dns.Fqdn(name), qtype)
	m.SetEdns0(1232, false)
	var resp *dns.Msg
	if err := inNetns(h.cageNetns, func() (err error) {
		resp, _, err = (&dns.Client{Timeout: 10 * time.Second, UDPSize: 1232}).Exchange(m, "127.0.0.1:53")
		return err
	}); err != nil {
		t.Fatalf("DNS %s %s from the cage: %v", name, dns.TypeToString[qtype], err)
	}
	return resp
}

// TestThreatDNSAnswersFromTheCage: an allowed name's answer carries more
// than the name's addresses, and the agent (its queries sent to the
// gateway's DNS filter from the cage's own network namespace) must get
// only what the policy lets it have:
//   - HTTPS records keep alpn (and mandatory, no-default-alpn, port) only:
//     ipv4hint/ipv6hint (here at the metadata service and private
//     addresses), ech (which would hide the real SNI from the gateway) and
//     opaque keys are stripped; a record making a stripped key mandatory is
//     dropped; the hints' refused classes flag the answer;
//   - a CNAME (or DNAME) chain through a denied name refuses the allowed
//     name, in DNS and on CONNECT, under the deny rule;
//   - records for names outside the question's chain are dropped;
//   - a chain through a name the policy merely does not list (a CDN) is
//     answered and the tunnel opens.
//
// Each failed on the code before the fix: the hints, ech and key65000
// reached the agent, the denied name's address was answered and the
// CONNECT to its alias opened, the stray record reached the agent.
func TestThreatDNSAnswersFromTheCage(t *testing.T) {
	testenv.RequirePrivileged(t)
	curl := testenv.LookPath(t, "curl")
	h := setupHarness(t, nil)
	const ech = "AEX+DQBBpQAgACB/RMfs1ubtZaK2fjWm0m6YvGHJUnqjgTfIDQbLuIjCQAAEAAEAAQASY2xvdWRmbGFyZS1lY2guY29tAAA="
	h.dns.setRRs("svc.example.com", "HTTPS",
		"svc.example.com. 60 IN HTTPS 1 . alpn=h2,http/1.1 ipv4hint=169.254.169.254,10.1.2.3 ipv6hint=fd12:3456::1 ech="+ech+" key65000=c2VjcmV0LWRhdGE",
		"svc.example.com. 60 IN HTTPS 2 . mandatory=ech alpn=h2 ech="+ech)
	h.dns.setRRs("alias.example.com", "A",
		"alias.example.com. 60 IN CNAME denied.example.com.",
		"denied.example.com. 60 IN A 127.0.0.1")
	h.dns.setRRs("x.dn.example.com", "A",
		"dn.example.com. 60 IN DNAME denied.example.com.",
		"x.dn.example.com. 60 IN CNAME x.denied.example.com.",
		"x.denied.example.com. 60 IN A 127.0.0.1")
	h.dns.setRRs("stray.example.com", "A",
		"stray.example.com. 60 IN A 127.0.0.1",
		"exfil.attacker.test. 60 IN A 192.0.2.66")
	h.dns.setRRs("cdn.example.com", "A",
		"cdn.example.com. 60 IN CNAME edge.cdn-provider.test.",
		"edge.cdn-provider.test. 60 IN A 127.0.0.1")
	agent, _ := startCage(t, h)
	// connect is the agent's curl through the gateway: "200 200" through
	// an open tunnel, "403 000" when the CONNECT is refused.
	connect := func(host string) string {
		out, _ := agent(curl, "-sS", "--max-time", "20", "--proxy", "http://127.0.0.1:3128", "--cacert", h.up.rootsFile,
			"-o", "/dev/null", "-w", "\n%{http_connect} %{http_code}", "https://"+host+":"+strconv.Itoa(h.up.tlsPort)+"/")
		lines := strings.Split(strings.TrimSpace(out), "\n")
		return lines[len(lines)-1]
	}
	dnsRecord := func(name, typ string) func(audit.Record) bool {
		return func(r audit.Record) bool { return r.Method == "DNS" && r.Host == name && r.Path == typ }
	}

	t.Run("HTTPS parameters", func(t *testing.T) {
		resp := cageDNS(t, h, "svc.example.com", dns.TypeHTTPS)
		if resp.Rcode != dns.RcodeSuccess || len(resp.Answer) != 1 {
			t.Fatalf("HTTPS svc.example.com: %v", resp)
		}
		https, ok := resp.Answer[0].(*dns.HTTPS)
		if !ok || https.Priority != 1 || len(https.Value) != 1 || https.Value[0].Key() != dns.SVCB_ALPN || https.Value[0].String() != "h2,http/1.1" {
			t.Fatalf("the agent got %v; want priority 1 with alpn=h2,http/1.1 only", resp.Answer)
		}
		r := h.want(t, dnsRecord("svc.example.com", "HTTPS"), audit.Flagged, "allow:*.example.com")
		for _, w := range []string{"stripped ech,ipv4hint,ipv6hint,key65000", "metadata", "private"} {
			if !strings.Contains(r.Reason, w) {
				t.Errorf("audit reason %q does not say %q", r.Reason, w)
			}
		}
	})
	t.Run("CNAME to a denied name", func(t *testing.T) {
		if resp := cageDNS(t, h, "alias.example.com", dns.TypeA); resp.Rcode != dns.RcodeRefused || len(resp.Answer) != 0 {
			t.Fatalf("alias of a denied name: the agent got %v", resp)
		}
		r := h.want(t, dnsRecord("alias.example.com", "A"), audit.Blocked, "deny:denied.example.com")
		if !strings.Contains(r.Reason, "alias of denied.example.com") {
			t.Errorf("reason %q does not name the denied alias", r.Reason)
		}
		if got := connect("alias.example.com"); !strings.HasPrefix(got, "403") {
			t.Fatalf("CONNECT to an alias of a denied name: curl says %q", got)
		}
		h.want(t, is("CONNECT", "alias.example.com", h.up.tlsPort), audit.Blocked, "deny:denied.example.com")
	})
	t.Run("DNAME to a denied name", func(t *testing.T) {
		if resp := cageDNS(t, h, "x.dn.example.com", dns.TypeA); resp.Rcode != dns.RcodeRefused || len(resp.Answer) != 0 {
			t.Fatalf("DNAME into a denied zone: the agent got %v", resp)
		}
		h.want(t, dnsRecord("x.dn.example.com", "A"), audit.Blocked, "deny:denied.example.com")
	})
	t.Run("records outside the chain", func(t *testing.T) {
		resp := cageDNS(t, h, "stray.example.com", dns.TypeA)
		if resp.Rcode != dns.RcodeSuccess || len(resp.Answer) != 1 || resp.Answer[0].Header().Name != "stray.example.com." {
			t.Fatalf("the agent got %v; want stray.example.com's own A record only", resp.Answer)
		}
		r := h.want(t, dnsRecord("stray.example.com", "A"), audit.Flagged, "allow:*.example.com")
		if !strings.Contains(r.Reason, "outside the question's chain") {
			t.Errorf("reason %q", r.Reason)
		}
	})
	t.Run("CNAME to an unlisted CDN name", func(t *testing.T) {
		resp := cageDNS(t, h, "cdn.example.com", dns.TypeA)
		if resp.Rcode != dns.RcodeSuccess || len(resp.Answer) != 2 {
			t.Fatalf("CDN chain: %v", resp)
		}
		r := h.want(t, dnsRecord("cdn.example.com", "A"), audit.Allowed, "allow:*.example.com")
		if !strings.Contains(r.Reason, "via edge.cdn-provider.test") {
			t.Errorf("reason %q does not name the chain", r.Reason)
		}
		if got := connect("cdn.example.com"); got != "200 200" {
			t.Fatalf("a tunnel to an allowed name served by a CDN: curl says %q", got)
		}
	})
}
