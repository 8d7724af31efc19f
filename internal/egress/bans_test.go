package egress

import (
	"bufio"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/nixcage/nixcage/internal/egress/audit"
	"github.com/nixcage/nixcage/internal/policy"
	"github.com/nixcage/nixcage/internal/testenv"
)

// writeBans writes the bans file as caged does (temporary file renamed).
func writeBans(t *testing.T, path string, bans ...policy.Ban) {
	t.Helper()
	if bans == nil {
		bans = []policy.Ban{}
	}
	b, err := json.Marshal(policy.BansDoc{Schema: policy.BansSchema, Bans: bans})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path+".tmp", b, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(path+".tmp", path); err != nil {
		t.Fatal(err)
	}
}

// banPolicy allows plain., other. and alias.example.com (a CNAME of
// other.example.com), tunnelled (not intercepted), and names a bans file and a grants file in a root-owned
// 0755 directory, as caged's are.
func banPolicy(t *testing.T, bfile, gfile *string) func(*policy.Runtime) {
	return func(rt *policy.Runtime) {
		rt.Policy.Allow = []string{"plain.example.com", "other.example.com", "alias.example.com"}
		rt.Policy.Inspect = nil
		rt.Secrets = nil
		dir := filepath.Join(filepath.Dir(rt.AuditFile), "control-run")
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		os.Chmod(dir, 0o755)
		*bfile, *gfile = filepath.Join(dir, "bans.json"), filepath.Join(dir, "grants.json")
		rt.BansFile, rt.GrantsFile = *bfile, *gfile
	}
}

// aliasOfOther makes alias.example.com a CNAME of other.example.com at the
// fake resolver, as an allowed name an attacker points at a banned host.
func aliasOfOther(h *harness) {
	h.dns.setRRs("alias.example.com", "A",
		"alias.example.com. 60 IN CNAME other.example.com.",
		"other.example.com. 60 IN A 127.0.0.1")
}

// TestBanLiveInGateway: the real gateway watching a real bans file. A ban
// written while it runs refuses the banned host at once (no restart),
// beats the policy's allow list and a grant, is refused in DNS, closes the
// open tunnel to the banned host and leaves an unrelated open tunnel
// alone; a ban for another agent does not apply; a broken bans file keeps
// the bans in force; removing the ban lifts it. An allowed name that is a
// CNAME of the banned host is the banned host: refused on CONNECT and in
// DNS, its open tunnel closed (before the fix it stayed open and new
// tunnels to it opened).
func TestBanLiveInGateway(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("bans files must be owned by root (uid 0); run as root")
	}
	var bfile, gfile string
	h := newHarness(t, banPolicy(t, &bfile, &gfile))
	aliasOfOther(h)
	port := h.up.tlsPort
	auth := func(host string) string { return host + ":" + strconv.Itoa(port) }
	now := time.Now()
	writeGrants(t, gfile, policy.Grant{ID: "g-api", Host: "api.example.com", Port: port, CreatedUnix: now.Unix(), ExpiresUnix: now.Add(time.Hour).Unix(), By: "root"})

	open := func(host string) (*tls.Conn, *bufio.Reader) {
		c := h.pollConnect(t, auth(host), http.StatusOK)
		t.Cleanup(func() { c.Close() })
		tc := tls.Client(c, &tls.Config{ServerName: host, RootCAs: h.up.roots})
		br := bufio.NewReader(tc)
		if st := tlsGet(t, tc, br, host); st != http.StatusOK {
			t.Fatalf("tunnel to %s: status %d", host, st)
		}
		return tc, br
	}
	unrelated, ubr := open("plain.example.com")
	doomed, _ := open("other.example.com")
	doomedAlias, _ := open("alias.example.com")
	h.pollConnect(t, auth("api.example.com"), http.StatusOK).Close()

	bans := []policy.Ban{
		{ID: "b-0123456789ab", Host: "other.example.com", Agent: "alice", CreatedUnix: now.Unix(), Command: strings.Repeat("ab", 32), Reason: "exfiltration endpoint"},
		{ID: "b-aaaaaaaaaaaa", Host: "api.example.com", Agent: "*", CreatedUnix: now.Unix(), Command: strings.Repeat("cd", 32)},
		{ID: "b-bbbbbbbbbbbb", Host: "plain.example.com", Agent: "bob", CreatedUnix: now.Unix(), Command: strings.Repeat("ef", 32)},
	}
	writeBans(t, bfile, bans...)

	h.pollConnect(t, auth("other.example.com"), http.StatusForbidden)
	r := h.want(t, func(r audit.Record) bool {
		return is("CONNECT", "other.example.com", port)(r) && r.Decision == audit.Blocked
	}, "blocked", "ban:b-0123456789ab")
	if !strings.Contains(r.Reason, "banned by b-0123456789ab") || !strings.Contains(r.Reason, "exfiltration endpoint") {
		t.Errorf("refusal reason %q does not name the ban and its reason", r.Reason)
	}
	// The banned host under another name.
	if _, st := h.connect(auth("alias.example.com"), ""); st != http.StatusForbidden {
		t.Errorf("CONNECT to a CNAME of the banned host: %d, want 403", st)
	}
	ar := h.want(t, func(r audit.Record) bool {
		return is("CONNECT", "alias.example.com", port)(r) && r.Decision == audit.Blocked
	}, "blocked", "ban:b-0123456789ab")
	if !strings.Contains(ar.Reason, "alias.example.com is an alias of other.example.com") || !strings.Contains(ar.Reason, "banned by b-0123456789ab") {
		t.Errorf("refusal reason %q does not name the alias and the ban", ar.Reason)
	}
	// A ban beats a grant.
	if _, st := h.connect(auth("api.example.com"), ""); st != http.StatusForbidden {
		t.Errorf("granted but banned host: %d", st)
	}
	h.want(t, func(r audit.Record) bool {
		return is("CONNECT", "api.example.com", port)(r) && r.Decision == audit.Blocked
	}, "blocked", "ban:b-aaaaaaaaaaaa")
	// DNS refuses the banned name, and its alias.
	for _, name := range []string{"other.example.com.", "alias.example.com."} {
		m := new(dns.Msg)
		m.SetQuestion(name, dns.TypeA)
		if resp, _, err := (&dns.Client{Timeout: 10 * time.Second}).Exchange(m, h.dnsAddr); err != nil || resp.Rcode != dns.RcodeRefused {
			t.Errorf("DNS for %s (banned, or a CNAME of the banned name): %v %v, want REFUSED", name, resp, err)
		}
	}
	h.want(t, is("DNS", "alias.example.com", 53), audit.Blocked, "ban:b-0123456789ab")
	// The open tunnels to the banned host, by its name and its alias, are
	// closed, with the ban named.
	for host, c := range map[string]*tls.Conn{"other.example.com": doomed, "alias.example.com": doomedAlias} {
		c.SetDeadline(time.Now().Add(10 * time.Second))
		if _, err := c.Write([]byte("GET / HTTP/1.1\r\nHost: " + host + "\r\n\r\n")); err == nil {
			if _, err := http.ReadResponse(bufio.NewReader(c), nil); err == nil {
				t.Errorf("the open tunnel to %s still answers", host)
			}
		}
		cr := h.want(t, closed("CONNECT", host, port), "allowed", "")
		if !strings.Contains(cr.Reason, "banned by b-0123456789ab") {
			t.Errorf("close record reason %q does not name the ban", cr.Reason)
		}
	}
	// The unrelated tunnel (and bob's ban of its host) leave it alone.
	if st := tlsGet(t, unrelated, ubr, "plain.example.com"); st != http.StatusOK {
		t.Fatalf("unrelated open tunnel after the ban: status %d", st)
	}
	h.pollConnect(t, auth("plain.example.com"), http.StatusOK).Close()

	// A broken bans file does not lift the bans.
	if err := os.WriteFile(bfile, []byte("{not json"), 0o644); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for !h.logged("bans file refused") && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	if _, st := h.connect(auth("other.example.com"), ""); st != http.StatusForbidden {
		t.Errorf("after a broken bans file the ban was lifted: %d", st)
	}

	// Unban: the host is reachable again, without a restart.
	writeBans(t, bfile, bans[1:]...)
	h.pollConnect(t, auth("other.example.com"), http.StatusOK).Close()
	h.pollConnect(t, auth("alias.example.com"), http.StatusOK).Close()
	if st := tlsGet(t, unrelated, ubr, "plain.example.com"); st != http.StatusOK {
		t.Fatalf("unrelated open tunnel after the unban: status %d", st)
	}
}

// TestBanInCageNetns is the production shape: the gateway a separate
// process, socket-activated in a cage network namespace holding only lo,
// the agent's curl inside it. A ban written while the gateway runs refuses
// the banned host to the agent (403, audit rule ban:…) with no restart of
// the gateway (same process), and a tunnel the agent holds open to an
// unrelated host keeps working. An allowed name the agent finds CNAMEd to
// the banned host is refused too, on CONNECT and by the cage's DNS (before
// the fix both answered); a name that merely shares the banned host's
// address (plain.example.com, 127.0.0.1 like it) is not: bans name hosts,
// not addresses (docs/fleet.md).
func TestBanInCageNetns(t *testing.T) {
	testenv.RequirePrivileged(t)
	curl := testenv.LookPath(t, "curl")
	var bfile, gfile string
	h := setupHarness(t, banPolicy(t, &bfile, &gfile))
	aliasOfOther(h)
	agent, gw := startCage(t, h)
	port := strconv.Itoa(h.up.tlsPort)
	get := func(host string) string {
		out, _ := agent(curl, "-sS", "--max-time", "20", "--proxy", "http://127.0.0.1:3128", "--cacert", h.up.rootsFile,
			"-o", "/dev/null", "-w", "%{http_connect} %{http_code}", "https://"+host+":"+port+"/ns")
		// "200 200" through an open tunnel; "403 000" when the CONNECT
		// is refused (after curl's own message on stderr).
		lines := strings.Split(strings.TrimSpace(out), "\n")
		return lines[len(lines)-1]
	}

	// The agent's long-lived tunnel to an unrelated host, dialled from
	// inside the cage's namespace.
	var raw net.Conn
	if err := inNetns(h.cageNetns, func() (err error) {
		raw, err = net.Dial("tcp", "127.0.0.1:3128")
		return err
	}); err != nil {
		t.Fatal(err)
	}
	defer raw.Close()
	fmt.Fprintf(raw, "CONNECT plain.example.com:%s HTTP/1.1\r\nHost: plain.example.com:%s\r\n\r\n", port, port)
	br0 := bufio.NewReader(raw)
	resp, err := http.ReadResponse(br0, &http.Request{Method: http.MethodConnect})
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("CONNECT from the cage: %v %v", resp, err)
	}
	tc := tls.Client(raw, &tls.Config{ServerName: "plain.example.com", RootCAs: h.up.roots})
	br := bufio.NewReader(tc)
	if st := tlsGet(t, tc, br, "plain.example.com"); st != http.StatusOK {
		t.Fatalf("unrelated tunnel: %d", st)
	}
	for _, host := range []string{"other.example.com", "alias.example.com"} {
		if got := get(host); got != "200 200" {
			t.Fatalf("%s before the ban: %s", host, got)
		}
	}

	writeBans(t, bfile, policy.Ban{ID: "b-0123456789ab", Host: "other.example.com", Agent: "*", CreatedUnix: time.Now().Unix(), Command: strings.Repeat("ab", 32), Reason: "exfiltration endpoint"})
	deadline := time.Now().Add(10 * time.Second)
	for got := get("other.example.com"); !strings.HasPrefix(got, "403"); got = get("other.example.com") {
		if time.Now().After(deadline) {
			t.Fatalf("the ban never reached the running gateway: curl says %q", got)
		}
		time.Sleep(100 * time.Millisecond)
	}
	h.want(t, func(r audit.Record) bool {
		return is("CONNECT", "other.example.com", h.up.tlsPort)(r) && r.Decision == audit.Blocked
	}, audit.Blocked, "ban:b-0123456789ab")
	if got := get("alias.example.com"); !strings.HasPrefix(got, "403") {
		t.Errorf("a CNAME of the banned host from the cage: curl says %q, want 403", got)
	}
	ar := h.want(t, func(r audit.Record) bool {
		return is("CONNECT", "alias.example.com", h.up.tlsPort)(r) && r.Decision == audit.Blocked
	}, audit.Blocked, "ban:b-0123456789ab")
	if !strings.Contains(ar.Reason, "alias of other.example.com") {
		t.Errorf("refusal reason %q does not name the banned alias", ar.Reason)
	}
	if resp := cageDNS(t, h, "alias.example.com", dns.TypeA); resp.Rcode != dns.RcodeRefused || len(resp.Answer) != 0 {
		t.Errorf("the cage's DNS answered a CNAME of the banned host: %v", resp)
	}
	h.want(t, is("DNS", "alias.example.com", 53), audit.Blocked, "ban:b-0123456789ab")
	if got := get("plain.example.com"); got != "200 200" {
		t.Errorf("a name sharing the banned host's address: %s, want 200 200 (bans name hosts)", got)
	}
	if st := tlsGet(t, tc, br, "plain.example.com"); st != http.StatusOK {
		t.Fatalf("the unrelated open tunnel after the ban: %d", st)
	}
	if gw.ProcessState != nil {
		t.Fatalf("the gateway exited: %v", gw.ProcessState)
	}
	if err := gw.Process.Signal(syscall.Signal(0)); err != nil {
		t.Fatalf("the gateway process (pid %d) is gone: %v", gw.Process.Pid, err)
	}
}
