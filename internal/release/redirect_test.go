package release

import (
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
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
