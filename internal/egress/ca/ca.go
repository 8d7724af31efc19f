// Package ca is the per-cage certificate authority used for TLS interception.
//
// Invariants: the CA key is ECDSA P-256 from crypto/rand, stored 0600 and
// only ever read by root (prepare) or handed to the gateway by
// LoadCredential=; the certificate is public (0644) and bound into the cage.
// Leaf keys come from crypto/rand per host and are never derived from the CA
// key. The CA certificate carries X.509 name constraints limited to the
// intercepted hosts, so even a stolen CA key cannot mint a certificate the
// cage would accept for any other name or for an IP address.
package ca

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/nixcage/nixcage/internal/paths"
)

// File names inside a CA directory.
const (
	KeyFile  = paths.CAKeyFile
	CertFile = paths.CACertFile
)

// Authority signs leaf certificates for intercepted hosts.
type Authority struct {
	Cert *x509.Certificate
	key  crypto.Signer

	mu     sync.Mutex
	leaves map[string]*tls.Certificate
	now    func() time.Time
}

// Constraints turns host patterns into X.509 permitted DNS domains: an exact
// name permits the name (and, per RFC 5280, its subdomains); "*.x" permits
// only subdomains of x. With no hosts the CA permits only ".invalid", so it
// cannot vouch for anything real.
func Constraints(patterns []string) []string {
	var out []string
	for _, p := range patterns {
		if s, ok := strings.CutPrefix(p, "*"); ok {
			out = append(out, s)
		} else {
			out = append(out, p)
		}
	}
	if len(out) == 0 {
		out = []string{".invalid"}
	}
	slices.Sort(out)
	return slices.Compact(out)
}

// Create makes a new CA whose certificate permits only the given domains.
func Create(commonName string, permitted []string) (*x509.Certificate, *ecdsa.PrivateKey, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, fmt.Errorf("generate ca key: %w", err)
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		return nil, nil, fmt.Errorf("ca serial: %w", err)
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:                serial,
		Subject:                     pkix.Name{CommonName: commonName, Organization: []string{"nixcage"}},
		NotBefore:                   now.Add(-time.Hour),
		NotAfter:                    now.AddDate(10, 0, 0),
		KeyUsage:                    x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
		BasicConstraintsValid:       true,
		IsCA:                        true,
		MaxPathLenZero:              true,
		PermittedDNSDomainsCritical: true,
		PermittedDNSDomains:         permitted,
		ExcludedIPRanges: []*net.IPNet{
			{IP: net.IPv4zero, Mask: net.CIDRMask(0, 32)},
			{IP: net.IPv6zero, Mask: net.CIDRMask(0, 128)},
		},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, nil, fmt.Errorf("create ca certificate: %w", err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, nil, fmt.Errorf("parse ca certificate: %w", err)
	}
	return cert, key, nil
}

// Ensure makes sure dir holds a CA whose constraints equal permitted,
// creating or replacing it otherwise. It reports whether it wrote a new CA.
// Writes are atomic (temp file + rename) so a crash leaves the old pair or the
// new key without a cert (which the next Ensure replaces), never a torn file.
func Ensure(dir, commonName string, permitted []string) (bool, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return false, fmt.Errorf("create ca dir: %w", err)
	}
	if a, err := Load(filepath.Join(dir, KeyFile), filepath.Join(dir, CertFile)); err == nil {
		if slices.Equal(a.Cert.PermittedDNSDomains, permitted) && time.Until(a.Cert.NotAfter) > 30*24*time.Hour {
			return false, nil
		}
	} else if !errors.Is(err, os.ErrNotExist) {
		return false, err
	}
	cert, key, err := Create(commonName, permitted)
	if err != nil {
		return false, err
	}
	kder, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return false, fmt.Errorf("marshal ca key: %w", err)
	}
	if err := WriteAtomic(filepath.Join(dir, KeyFile), pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: kder}), 0o600); err != nil {
		return false, err
	}
	if err := WriteAtomic(filepath.Join(dir, CertFile), pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: cert.Raw}), 0o644); err != nil {
		return false, err
	}
	return true, nil
}

// Load reads a CA key and certificate and checks they belong together.
func Load(keyPath, certPath string) (*Authority, error) {
	kpem, err := os.ReadFile(keyPath)
	if err != nil {
		return nil, fmt.Errorf("read ca key: %w", err)
	}
	cpem, err := os.ReadFile(certPath)
	if err != nil {
		return nil, fmt.Errorf("read ca certificate: %w", err)
	}
	pair, err := tls.X509KeyPair(cpem, kpem)
	if err != nil {
		return nil, fmt.Errorf("ca key %s and certificate %s: %w; delete both and re-run `cage-egress prepare`", keyPath, certPath, err)
	}
	signer, ok := pair.PrivateKey.(crypto.Signer)
	if !ok {
		return nil, fmt.Errorf("ca key %s cannot sign", keyPath)
	}
	cert, err := x509.ParseCertificate(pair.Certificate[0])
	if err != nil {
		return nil, fmt.Errorf("parse ca certificate: %w", err)
	}
	if !cert.IsCA {
		return nil, fmt.Errorf("ca certificate %s is not a CA", certPath)
	}
	return &Authority{Cert: cert, key: signer, leaves: map[string]*tls.Certificate{}, now: time.Now}, nil
}

// leafLifetime is short: leaves live only in memory and are re-minted.
const leafLifetime = 24 * time.Hour

// Leaf returns a certificate for host, minted on first use and cached until
// it nears expiry. One key per host from crypto/rand.
func (a *Authority) Leaf(host string) (*tls.Certificate, error) {
	now := a.now()
	a.mu.Lock()
	if c, ok := a.leaves[host]; ok && now.Add(time.Hour).Before(c.Leaf.NotAfter) {
		a.mu.Unlock()
		return c, nil
	}
	a.mu.Unlock()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("generate leaf key: %w", err)
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		return nil, fmt.Errorf("leaf serial: %w", err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: host},
		DNSNames:     []string{host},
		NotBefore:    now.Add(-time.Hour),
		NotAfter:     now.Add(leafLifetime),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, a.Cert, &key.PublicKey, a.key)
	if err != nil {
		return nil, fmt.Errorf("sign leaf for %s: %w", host, err)
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, fmt.Errorf("parse leaf: %w", err)
	}
	c := &tls.Certificate{Certificate: [][]byte{der, a.Cert.Raw}, PrivateKey: key, Leaf: leaf}
	a.mu.Lock()
	if len(a.leaves) > 4096 { // bound memory: hosts are policy-limited anyway
		clear(a.leaves)
	}
	a.leaves[host] = c
	a.mu.Unlock()
	return c, nil
}

// Permits reports whether the CA's name constraints allow leaves for every
// name host pattern p can match ("*.x" needs subdomains of x).
func (a *Authority) Permits(p string) bool {
	if len(a.Cert.PermittedDNSDomains) == 0 {
		return true
	}
	name := p
	if s, ok := strings.CutPrefix(p, "*."); ok {
		name = "x." + s // any strict subdomain
	}
	for _, c := range a.Cert.PermittedDNSDomains {
		if strings.HasPrefix(c, ".") {
			if strings.HasSuffix(name, c) {
				return true
			}
		} else if name == c || strings.HasSuffix(name, "."+c) {
			return true
		}
	}
	return false
}

// CertPEM is the CA certificate in PEM form.
func (a *Authority) CertPEM() []byte {
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: a.Cert.Raw})
}

// WriteAtomic writes data to path via a temp file in the same directory and
// a rename, fsyncing the file first.
func WriteAtomic(path string, data []byte, mode os.FileMode) error {
	dir := filepath.Dir(path)
	f, err := os.CreateTemp(dir, "."+filepath.Base(path)+".tmp*")
	if err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	tmp := f.Name()
	defer os.Remove(tmp)
	if err := f.Chmod(mode); err != nil {
		f.Close()
		return fmt.Errorf("write %s: %w", path, err)
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	return nil
}
