package egress

import (
	"bufio"
	"crypto/tls"
	"encoding/json"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/miekg/dns"

	"github.com/nixcage/nixcage/internal/egress/audit"
	"github.com/nixcage/nixcage/internal/policy"
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

// TestBanLiveInGateway: the real gateway watching a real bans file. A ban
// written while it runs refuses the banned host at once (no restart),
// beats the policy's allow list and a grant, is refused in DNS, closes the
// open tunnel to the banned host and leaves an unrelated open tunnel
// alone; a ban for another agent does not apply; a broken bans file keeps
// the bans in force; removing the ban lifts it.
func TestBanLiveInGateway(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("bans files must be owned by root (uid 0); run as root")
	}
	var bfile, gfile string
	h := newHarness(t, func(rt *policy.Runtime) {
		rt.Policy.Allow = []string{"plain.example.com", "other.example.com"}
		rt.Policy.Inspect = nil
		rt.Secrets = nil
		dir := filepath.Join(filepath.Dir(rt.AuditFile), "control-run")
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		os.Chmod(dir, 0o755)
		bfile, gfile = filepath.Join(dir, "bans.json"), filepath.Join(dir, "grants.json")
		rt.BansFile, rt.GrantsFile = bfile, gfile
	})
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
	// A ban beats a grant.
	if _, st := h.connect(auth("api.example.com"), ""); st != http.StatusForbidden {
		t.Errorf("granted but banned host: %d", st)
	}
	h.want(t, func(r audit.Record) bool {
		return is("CONNECT", "api.example.com", port)(r) && r.Decision == audit.Blocked
	}, "blocked", "ban:b-aaaaaaaaaaaa")
	// DNS refuses the banned name.
	m := new(dns.Msg)
	m.SetQuestion("other.example.com.", dns.TypeA)
	if resp, _, err := (&dns.Client{Timeout: 10 * time.Second}).Exchange(m, h.dnsAddr); err != nil || resp.Rcode != dns.RcodeRefused {
		t.Errorf("DNS for a banned name: %v %v, want REFUSED", resp, err)
	}
	// The open tunnel to the banned host is closed, with the ban named.
	doomed.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := doomed.Write([]byte("GET / HTTP/1.1\r\nHost: other.example.com\r\n\r\n")); err == nil {
		if _, err := http.ReadResponse(bufio.NewReader(doomed), nil); err == nil {
			t.Errorf("the open tunnel to the banned host still answers")
		}
	}
	cr := h.want(t, closed("CONNECT", "other.example.com", port), "allowed", "")
	if !strings.Contains(cr.Reason, "banned by b-0123456789ab") {
		t.Errorf("close record reason %q does not name the ban", cr.Reason)
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
	if st := tlsGet(t, unrelated, ubr, "plain.example.com"); st != http.StatusOK {
		t.Fatalf("unrelated open tunnel after the unban: status %d", st)
	}
}
