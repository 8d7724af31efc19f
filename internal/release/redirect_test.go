package release

import (
	"context"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"net/url"
	"os"
	"strings"
	"sync/atomic"
	"testing"
)

// TestHTTPSourceRefusesRedirectToAnotherOrigin is a malicious publisher that
// also runs the mirror (red team, issue 12): its server answers every fetch
// with a redirect to an address only the host can reach (loopback here;
// 169.254.169.254 or an admin API in the field). caged follows it as root
// in the host's network namespace: a blind request forgery on the host's
// behalf. Refusing redirects that leave the mirror's origin (or at least
// those to loopback, link-local and private addresses, and https to http)
// is the fix; it fails before one.
func TestHTTPSourceRefusesRedirectToAnotherOrigin(t *testing.T) {
	var hit atomic.Int32
	inside := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hit.Add(1)
		io.WriteString(w, "internal admin API answered "+r.URL.Path)
	}))
	defer inside.Close()
	mirror := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, inside.URL+"/admin/delete-everything", http.StatusFound)
	}))
	defer mirror.Close()
	u, _ := url.Parse(mirror.URL)
	src := &HTTPSource{Base: u}
	rc, err := src.Open(context.Background(), ManifestFile, MaxManifestSize)
	if err == nil {
		b, _ := io.ReadAll(rc)
		rc.Close()
		t.Logf("body: %q", b)
	}
	if n := hit.Load(); n != 0 {
		t.Fatalf("the mirror's redirect made the host fetch %s/admin/delete-everything (%d request(s)); err=%v", inside.URL, n, err)
	}
}

// TestHTTPSourceFollowsRedirectWithinOrigin: the configured mirror may
// redirect within itself (a loopback mirror here, trusted because the
// operator configured it), so the guard does not break ordinary mirrors.
func TestHTTPSourceFollowsRedirectWithinOrigin(t *testing.T) {
	mirror := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/"+ManifestFile {
			http.Redirect(w, r, "/v2/"+ManifestFile, http.StatusFound)
			return
		}
		io.WriteString(w, "manifest at "+r.URL.Path)
	}))
	defer mirror.Close()
	u, _ := url.Parse(mirror.URL)
	src := &HTTPSource{Base: u}
	b, err := ReadFile(context.Background(), src, ManifestFile, MaxManifestSize)
	if err != nil || string(b) != "manifest at /v2/"+ManifestFile {
		t.Fatalf("got %q, %v", b, err)
	}
}

// TestFetchRedirectPolicy checks the redirect and dial decisions one by
// one, without sending traffic anywhere but loopback.
func TestFetchRedirectPolicy(t *testing.T) {
	origin := "mirror.example.org:443"
	req := func(raw string) *http.Request {
		r, err := http.NewRequest(http.MethodGet, raw, nil)
		if err != nil {
			t.Fatal(err)
		}
		return r
	}
	from := []*http.Request{req("https://mirror.example.org/release.json")}
	for _, tc := range []struct {
		to, want string // want "" = allowed
	}{
		{"https://cdn.example.net/x", ""},
		{"https://mirror.example.org/y", ""},
		{"https://203.0.113.9/x", ""},
		{"http://cdn.example.net/x", "downgrade"},
		{"https://169.254.169.254/latest/meta-data/", "metadata"},
		{"https://127.0.0.1:8080/admin", "loopback"},
		{"https://[::1]/admin", "loopback"},
		{"https://10.1.2.3/", "private"},
		{"https://[fe80::1%25eth0]/", "link-local"},
		{"https://[::ffff:127.0.0.1]/", "loopback"},
		{"https://localhost:9/", "loopback"},
		{"https://Admin.LOCALHOST./", "loopback"},
	} {
		err := checkRedirect(origin, req(tc.to), from)
		if tc.want == "" && err != nil || tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)) {
			t.Errorf("redirect to %s: err=%v, want %q", tc.to, err, tc.want)
		}
	}
	many := make([]*http.Request, MaxRedirects)
	for i := range many {
		many[i] = from[0]
	}
	if err := checkRedirect(origin, req("https://mirror.example.org/z"), many); err == nil || !strings.Contains(err.Error(), "redirects") {
		t.Errorf("redirect %d: err=%v", MaxRedirects+1, err)
	}
	// The dial hook: what a name resolved (or rebound) to.
	for addr, ok := range map[string]bool{"127.0.0.1:80": false, "169.254.169.254:80": false, "[fd00::1]:443": false,
		"192.168.1.1:443": false, "[::ffff:10.0.0.1]:443": false, "203.0.113.9:443": true} {
		if err := checkDial("tcp", addr, nil); (err == nil) != ok {
			t.Errorf("dial %s: err=%v, want allowed=%v", addr, err, ok)
		}
	}
}

// TestHTTPSourceRefusesRedirectByNameToLoopback: a redirect to another
// port of this host by a name resolving to loopback is refused at the
// dial, not only by its spelling (the DNS rebinding form of the attack).
func TestHTTPSourceRefusesRedirectByNameToLoopback(t *testing.T) {
	var hit atomic.Int32
	inside := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { hit.Add(1) }))
	defer inside.Close()
	iu, _ := url.Parse(inside.URL)
	// "localhost" is caught by name; a name with no such tell must be
	// caught by the dialer. /etc/hosts maps this machine's name to a
	// loopback address on Debian; skip where it does not.
	host, err := os.Hostname()
	if err != nil {
		t.Skipf("no host name: %v", err)
	}
	addrs, err := net.LookupHost(host)
	if err != nil || len(addrs) == 0 || !netip.MustParseAddr(addrs[0]).IsLoopback() {
		t.Skipf("host name %q does not resolve to loopback here (%v %v): the dial check cannot be exercised by name", host, addrs, err)
	}
	mirror := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, "http://"+net.JoinHostPort(host, iu.Port())+"/admin", http.StatusFound)
	}))
	defer mirror.Close()
	u, _ := url.Parse(mirror.URL)
	_, err = ReadFile(context.Background(), &HTTPSource{Base: u}, ManifestFile, MaxManifestSize)
	if err == nil || !strings.Contains(err.Error(), "not a public address") || hit.Load() != 0 {
		t.Fatalf("redirect to %s: err=%v, hits=%d", host, err, hit.Load())
	}
}
