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
	"testing"
	"time"

	"github.com/nixcage/nixcage/internal/egress/audit"
	"github.com/nixcage/nixcage/internal/policy"
)

// writeGrants writes the grants file as caged does: a temporary file in the
// same directory renamed over the old one.
func writeGrants(t *testing.T, path string, gs ...policy.Grant) {
	t.Helper()
	doc := policy.GrantsDoc{Schema: policy.GrantsSchema, Agent: "alice", Grants: gs}
	b, err := json.Marshal(doc)
	if err != nil {
		t.Fatal(err)
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, b, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

// pollConnect CONNECTs to authority until it gets want (a generous deadline,
// no timing assertion) and returns the open tunnel for 200.
func (h *harness) pollConnect(t *testing.T, authority string, want int) net.Conn {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		c, st := h.connect(authority, "")
		if st == want {
			return c
		}
		if c != nil {
			c.Close()
		}
		if time.Now().After(deadline) {
			t.Fatalf("CONNECT %s: still %d, want %d; audit:\n%s", authority, st, want, h.dump())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// tlsGet sends one HTTP/1.1 request over an open TLS connection.
func tlsGet(t *testing.T, c *tls.Conn, br *bufio.Reader, host string) int {
	t.Helper()
	fmt.Fprintf(c, "GET /g HTTP/1.1\r\nHost: %s\r\n\r\n", host)
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		t.Fatalf("request in the open tunnel: %v", err)
	}
	resp.Body.Close()
	return resp.StatusCode
}

// TestGrantAllowsThenExpires: the real gateway watching a real grants file.
// A grant written while it runs allows the host (no restart), its expiry
// (enforced by the gateway, the file unchanged) refuses new tunnels while
// the tunnel opened under it keeps working; a grant never beats a deny
// entry nor the address rules; a file others may write is not trusted.
func TestGrantAllowsThenExpires(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("grants files must be owned by root (uid 0); run as root")
	}
	var gfile string
	h := newHarness(t, func(rt *policy.Runtime) {
		rt.Policy.Allow = []string{"example.net"}
		rt.Policy.Deny = []string{"denied.example.com"}
		rt.Policy.Inspect = nil
		rt.Secrets = nil
		gdir := filepath.Join(filepath.Dir(rt.AuditFile), "grants-run")
		if err := os.MkdirAll(gdir, 0o755); err != nil {
			t.Fatal(err)
		}
		os.Chmod(gdir, 0o755)
		gfile = filepath.Join(gdir, "grants.json")
		rt.GrantsFile = gfile
	})
	host := "other.example.com"
	auth := host + ":" + strconv.Itoa(h.up.tlsPort)
	h.pollConnect(t, auth, http.StatusForbidden)

	now := time.Now()
	expires := now.Add(4 * time.Second)
	writeGrants(t, gfile,
		policy.Grant{ID: "g-test1", Host: host, Port: h.up.tlsPort, CreatedUnix: now.Unix(), ExpiresUnix: expires.Unix(), By: "root", Reason: "test"},
		policy.Grant{ID: "g-deny", Host: "denied.example.com", CreatedUnix: now.Unix(), ExpiresUnix: now.Add(time.Hour).Unix(), By: "root"},
		policy.Grant{ID: "g-priv", Host: "private.example.com", CreatedUnix: now.Unix(), ExpiresUnix: now.Add(time.Hour).Unix(), By: "root"},
		policy.Grant{ID: "g-meta", Host: "metadata.example.com", CreatedUnix: now.Unix(), ExpiresUnix: now.Add(time.Hour).Unix(), By: "root"},
	)
	conn := h.pollConnect(t, auth, http.StatusOK)
	defer conn.Close()
	tc := tls.Client(conn, &tls.Config{ServerName: host, RootCAs: h.up.roots})
	br := bufio.NewReader(tc)
	if st := tlsGet(t, tc, br, host); st != http.StatusOK {
		t.Fatalf("granted tunnel: status %d", st)
	}
	h.want(t, is("CONNECT", host, h.up.tlsPort), "allowed", "grant:g-test1")

	// A grant never beats a deny entry or the address rules.
	if _, st := h.connect("denied.example.com:443", ""); st != http.StatusForbidden {
		t.Fatalf("granted but denied host: %d", st)
	}
	h.want(t, is("CONNECT", "denied.example.com", 443), "blocked", "deny:denied.example.com")
	for _, n := range []string{"private.example.com", "metadata.example.com"} {
		if _, st := h.connect(n+":443", ""); st != http.StatusForbidden {
			t.Fatalf("granted %s: %d", n, st)
		}
		h.want(t, is("CONNECT", n, 443), "blocked", "address")
	}

	// Expiry: the file still lists the grant; the gateway stops honouring it.
	time.Sleep(time.Until(expires))
	h.pollConnect(t, auth, http.StatusForbidden)
	h.want(t, func(r audit.Record) bool { return is("CONNECT", host, h.up.tlsPort)(r) && r.Event != "close" }, "blocked", "default-deny")
	if st := tlsGet(t, tc, br, host); st != http.StatusOK {
		t.Fatalf("tunnel opened under the grant, after expiry: status %d", st)
	}

	// A grants file others may write is not trusted: no grants at all.
	writeGrants(t, gfile, policy.Grant{ID: "g-test2", Host: host, Port: h.up.tlsPort, CreatedUnix: now.Unix(), ExpiresUnix: now.Add(time.Hour).Unix(), By: "root"})
	h.pollConnect(t, auth, http.StatusOK).Close()
	if err := os.Chmod(gfile, 0o666); err != nil {
		t.Fatal(err)
	}
	h.pollConnect(t, auth, http.StatusForbidden)
	if !h.logged("grants refused") {
		t.Errorf("untrusted grants file not logged")
	}
}
