package ca

import (
	"crypto/x509"
	"os"
	"path/filepath"
	"slices"
	"testing"
)

func TestEnsureAndPermits(t *testing.T) {
	dir := t.TempDir()
	permitted := Constraints([]string{"api.example.com", "*.example.org"})
	if !slices.Equal(permitted, []string{".example.org", "api.example.com"}) {
		t.Fatalf("constraints %v", permitted)
	}
	created, err := Ensure(dir, "test CA", permitted)
	if err != nil || !created {
		t.Fatalf("Ensure: %v %v", created, err)
	}
	if st, _ := os.Stat(filepath.Join(dir, KeyFile)); st.Mode().Perm() != 0o600 {
		t.Fatalf("key mode %o", st.Mode().Perm())
	}
	if created, err := Ensure(dir, "test CA", permitted); err != nil || created {
		t.Fatalf("second Ensure replaced the CA: %v %v", created, err)
	}
	a, err := Load(filepath.Join(dir, KeyFile), filepath.Join(dir, CertFile))
	if err != nil {
		t.Fatal(err)
	}
	for p, want := range map[string]bool{
		"api.example.com": true, "v1.api.example.com": true, "*.example.org": true, "a.example.org": true,
		"example.org": false, "other.example.com": false, "*.example.com": false,
	} {
		if got := a.Permits(p); got != want {
			t.Errorf("Permits(%s) = %v, want %v", p, got, want)
		}
	}
	pool := x509.NewCertPool()
	pool.AddCert(a.Cert)
	for host, ok := range map[string]bool{"api.example.com": true, "a.example.org": true, "example.org": false, "evil.test": false} {
		leaf, err := a.Leaf(host)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := leaf.Leaf.Verify(x509.VerifyOptions{DNSName: host, Roots: pool}); (err == nil) != ok {
			t.Errorf("leaf for %s: verify %v, want ok=%v", host, err, ok)
		}
	}
	if l1, _ := a.Leaf("api.example.com"); l1 != mustLeaf(t, a, "api.example.com") {
		t.Error("leaf not cached")
	}
}

func mustLeaf(t *testing.T, a *Authority, h string) any {
	l, err := a.Leaf(h)
	if err != nil {
		t.Fatal(err)
	}
	return l
}
