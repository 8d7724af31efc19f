package egress

import (
	"fmt"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/nixcage/nixcage/internal/egress/audit"
)

func (f *fakeDNS) received() []*dns.Msg {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]*dns.Msg(nil), f.msgs...)
}

// The agent hides data in the parts of a DNS query the name check does not
// read: letter case, the ID, flags, EDNS options and additional records,
// and the record type. The upstream resolver (a real DNS server) must only
// ever see the gateway's own fixed-shape query: the lower-case name, an ID
// unrelated to the agent's, RD and nothing else, one question, and the
// gateway's own EDNS record with no options.
func TestThreatDNSQueryShape(t *testing.T) {
	h := newHarness(t, nil)
	h.dns.set("api.example.com", "AAAA", "2001:db8::1")
	secret := "c2stYW50LWFwaTAzLVJFQUxyZWFs" // what the agent smuggles
	var clientIDs []uint16
	for i, name := range []string{"aPi.ExAmPlE.cOm.", "API.EXAMPLE.COM.", "api.example.com.", "ApI.eXaMpLe.CoM."} {
		for _, qt := range []uint16{dns.TypeA, dns.TypeAAAA} {
			m := new(dns.Msg)
			m.SetQuestion(name, qt)
			m.Id = uint16(0xbe00 + i) // a chosen ID
			m.CheckingDisabled, m.AuthenticatedData, m.RecursionDesired = true, true, i%2 == 0
			m.Zero = true
			o := m.SetEdns0(4096, true).IsEdns0()
			o.Option = append(o.Option, &dns.EDNS0_LOCAL{Code: 65001, Data: []byte(secret)}, &dns.EDNS0_COOKIE{Code: dns.EDNS0COOKIE, Cookie: "0123456789abcdef"}, &dns.EDNS0_PADDING{Padding: []byte(secret)})
			txt, _ := dns.NewRR(`smuggle.example.com. 60 IN TXT "` + secret + `"`)
			m.Extra = append(m.Extra, txt)
			m.Ns = append(m.Ns, txt)
			clientIDs = append(clientIDs, m.Id)
			for _, netw := range []string{"udp", "tcp"} {
				resp, _, err := (&dns.Client{Net: netw, Timeout: 10 * time.Second, UDPSize: 4096}).Exchange(m, h.dnsAddr)
				if err != nil {
					t.Fatal(err)
				}
				if resp.Id != m.Id || resp.Rcode != dns.RcodeSuccess || len(resp.Answer) == 0 {
					t.Fatalf("%s %s over %s: %v", name, dns.TypeToString[qt], netw, resp)
				}
				for _, rr := range append(resp.Extra, resp.Ns...) {
					if strings.Contains(rr.String(), secret) {
						t.Fatalf("the agent's sections echoed back: %v", rr)
					}
				}
			}
		}
	}
	got := h.dns.received()
	if len(got) == 0 {
		t.Fatal("upstream received nothing")
	}
	for _, q := range got {
		shape := fmt.Sprintf("%v", q)
		if len(q.Question) != 1 || q.Question[0].Name != strings.ToLower(q.Question[0].Name) || q.Question[0].Qclass != dns.ClassINET {
			t.Fatalf("upstream query question not normalized:\n%s", shape)
		}
		if qt := q.Question[0].Qtype; qt != dns.TypeA && qt != dns.TypeAAAA {
			t.Fatalf("upstream query of type %s:\n%s", dns.TypeToString[qt], shape)
		}
		if !q.RecursionDesired || q.CheckingDisabled || q.AuthenticatedData || q.Zero || q.Opcode != dns.OpcodeQuery || q.Response || len(q.Answer) != 0 || len(q.Ns) != 0 {
			t.Fatalf("upstream query flags or sections not fixed:\n%s", shape)
		}
		o := q.IsEdns0()
		if len(q.Extra) != 1 || o == nil || len(o.Option) != 0 || o.UDPSize() != 1232 || o.Do() {
			t.Fatalf("upstream query carries more than the gateway's own EDNS record:\n%s", shape)
		}
		if strings.Contains(shape, secret) || strings.Contains(strings.ToLower(shape), "smuggle") {
			t.Fatalf("agent data reached the upstream resolver:\n%s", shape)
		}
		for _, id := range clientIDs {
			if q.Id == id {
				t.Fatalf("upstream query reuses the agent's ID %#x", id)
			}
		}
	}
	// A type outside the policy's allow_types is refused, never forwarded.
	m := new(dns.Msg)
	m.SetQuestion("api.example.com.", dns.TypeTXT)
	if resp, _, err := (&dns.Client{Timeout: 10 * time.Second}).Exchange(m, h.dnsAddr); err != nil || resp.Rcode != dns.RcodeRefused {
		t.Fatalf("TXT for an allowed name: %v %v, want REFUSED", resp, err)
	}
	h.want(t, func(r audit.Record) bool { return r.Method == "DNS" && r.Path == "TXT" }, audit.Blocked, "dns-type:TXT")
	if n := h.dns.queries("api.example.com", "TXT"); n != 0 {
		t.Fatalf("a refused type reached the upstream resolver %d times", n)
	}
}

// Within its TTL a repeated question is answered from the cache: the
// upstream resolver sees it once. Lookups that miss the cache are rate
// limited per cage, refused with REFUSED and the rule dns-rate-limit.
func TestDNSCacheAndRateLimit(t *testing.T) {
	h := newHarness(t, nil)
	h.dns.ttl = 300
	h.dns.set("cached.example.com", "A", "192.0.2.10")
	for range 20 {
		m := new(dns.Msg)
		m.SetQuestion("Cached.Example.Com.", dns.TypeA)
		resp, _, err := (&dns.Client{Timeout: 10 * time.Second}).Exchange(m, h.dnsAddr)
		if err != nil || resp.Rcode != dns.RcodeSuccess || len(resp.Answer) != 1 {
			t.Fatalf("cached lookup: %v %v", resp, err)
		}
		if ttl := resp.Answer[0].Header().Ttl; ttl > 300 || ttl < 290 {
			t.Fatalf("TTL %d from cache", ttl)
		}
	}
	if n := h.dns.queries("cached.example.com", "A"); n != 1 {
		t.Fatalf("upstream saw %d queries for one name within its TTL, want 1", n)
	}
	h.want(t, func(r audit.Record) bool {
		return r.Host == "cached.example.com" && strings.Contains(r.Reason, "from cache")
	}, audit.Allowed, "allow:*.example.com")

	refused := 0
	for i := range 400 {
		m := new(dns.Msg)
		m.SetQuestion(fmt.Sprintf("n%d.example.com.", i), dns.TypeA)
		resp, _, err := (&dns.Client{Timeout: 10 * time.Second}).Exchange(m, h.dnsAddr)
		if err != nil {
			t.Fatal(err)
		}
		if resp.Rcode == dns.RcodeRefused {
			refused++
		}
	}
	if refused == 0 {
		t.Fatal("400 distinct lookups at once: none refused by the lookup rate limit")
	}
	if up := len(h.dns.received()); up > 300 {
		t.Fatalf("upstream received %d queries; the rate limit allows a burst of 200 then 50/s", up)
	}
	// Many distinct names under one wildcard in a minute: an alert record,
	// outside the audit budget, at once.
	h.want(t, func(r audit.Record) bool { return r.Rule == "dns-pattern" }, audit.Flagged, "dns-pattern")
	// The refusals came after the audit budget's burst: they are counted in
	// the summary written when its window ends.
	waitFor(t, "a DNS summary counting the rate-limit refusals", func() bool {
		for _, r := range h.records(t) {
			if r.Event == audit.EventSummary && r.Rule == "audit-budget:dns" && r.Decision == audit.Blocked && strings.Contains(r.Reason, "dns-rate-limit") && r.Count > 0 {
				return true
			}
		}
		return false
	})
}

// A long random label under an allowed wildcard is answered and flagged.
func TestDNSHighEntropyLabelFlagged(t *testing.T) {
	h := newHarness(t, nil)
	m := new(dns.Msg)
	m.SetQuestion("k7qz2mx9vbt4wy8r.x.example.com.", dns.TypeA)
	if _, _, err := (&dns.Client{Timeout: 10 * time.Second}).Exchange(m, h.dnsAddr); err != nil {
		t.Fatal(err)
	}
	r := h.want(t, is("DNS", "k7qz2mx9vbt4wy8r.x.example.com", 53), audit.Flagged, "allow:*.example.com")
	if !strings.Contains(r.Reason, "bits/character") {
		t.Fatalf("reason %q", r.Reason)
	}
}

// An answer with a TTL is reused for the next tunnel (no DNS round trip per
// tunnel), and the reused addresses are still classified: once the policy
// stops allowing loopback, the cached 127.0.0.1 is refused with an address
// record like a fresh answer. TTL 0 answers are never reused
// (TestThreatDNSRebinding).
func TestResolveReusesAnswerWithinTTL(t *testing.T) {
	h := newHarness(t, nil)
	h.dns.ttl = 60
	h.dns.set("cached.example.com", "A", "127.0.0.1")
	h.dns.set("cached.example.com", "AAAA", "::1")
	auth := net.JoinHostPort("cached.example.com", strconv.Itoa(h.up.tlsPort))
	for i := range 3 {
		conn, code := h.connect(auth, "")
		if code != 200 {
			t.Fatalf("CONNECT %d: %d", i, code)
		}
		conn.Close()
	}
	if a, aaaa := h.dns.queries("cached.example.com", "A"), h.dns.queries("cached.example.com", "AAAA"); a != 1 || aaaa != 1 {
		t.Fatalf("3 tunnels within the TTL made %d A and %d AAAA queries, want 1 each", a, aaaa)
	}
	h.rt.Policy.UnsafeAllowLoopbackUpstreams = false
	h.writeConfig(h.rt)
	syscall.Kill(os.Getpid(), syscall.SIGHUP)
	waitFor(t, "reloaded", func() bool { return h.logged("configuration reloaded") })
	if _, code := h.connect(auth, ""); code != http.StatusForbidden {
		t.Fatalf("CONNECT to a cached loopback answer after loopback was disallowed: %d, want 403", code)
	}
	h.want(t, func(r audit.Record) bool { return r.Host == "cached.example.com" && r.Rule == "address" }, audit.Blocked, "address")
	if n := h.dns.queries("cached.example.com", "A"); n != 1 {
		t.Fatalf("A queries %d, want the cached answer reused (1)", n)
	}
}
