package systest

import (
	"bufio"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"sort"
	"strings"
	"time"

	"github.com/nixcage/nixcage/internal/systest/upstream"
)

// The fake internet's layout. The upstream servers live in their own network
// namespace behind a veth pair, not on the machine's own interfaces: a
// gateway refuses to dial its own addresses, and on a real host the internet
// is not local either.
const (
	InternetNetns = "systest-internet"
	// GatewaySideAddr is the machine's end of the veth (what upstreams see as
	// the client address).
	GatewaySideAddr = "198.51.100.1"
	internetSide    = "198.51.100.2"
	// NameserverAddr is the zone's DNS server, the machine's resolver.
	NameserverAddr = "203.0.113.53"

	upstreamBin   = "/usr/local/libexec/nixcage-systest/upstream"
	upstreamDir   = "/etc/nixcage-systest/upstream"
	UpstreamLog   = "/run/nixcage-systest/upstream/requests.jsonl"
	upstreamReady = "/run/nixcage-systest/upstream/ready"
	upstreamUnit  = "systest-upstream.service"
	caInstallPath = "/usr/local/share/ca-certificates/nixcage-systest.crt"
	CABundlePath  = "/etc/ssl/certs/ca-certificates.crt"
)

// Zone is the fake internet's DNS. Names a policy may allow or deny, plus
// names that resolve to places a gateway must never dial.
var Zone = map[string][]string{
	"api.example.com":      {"203.0.113.10"},
	"evil.example.org":     {"203.0.113.20"},
	"other.example.net":    {"203.0.113.30"},
	"loopback.example.com": {"127.0.0.1"},
	"private.example.com":  {"10.1.2.3"},
	"metadata.example.com": {"169.254.169.254"},
	// The model APIs the real harness CLIs call (upstream/model.go).
	upstream.AnthropicHost: {"203.0.113.40"},
	upstream.OpenAIHost:    {"203.0.113.41"},
}

// Internet is a running fake internet in a machine.
type Internet struct {
	m *Machine
	// CAPEM is the test CA that signed every upstream certificate; it is in
	// the machine's system bundle (update-ca-certificates).
	CAPEM []byte
}

// The TEST-NET addresses sit on the internet namespace's lo: this kernel has
// no dummy interfaces (CONFIG_DUMMY unset) and lo serves the same purpose.
//
// StartInternet sets up the fake internet in a machine: namespace, veth,
// addresses, routes, the upstream server as a unit, the test CA in the
// system trust store and /etc/resolv.conf pointing at the zone's server.
// upstreamPath is the host path of the built upstream binary.
func StartInternet(ctx context.Context, m *Machine, upstreamPath string) (*Internet, error) {
	caPEM, certPEM, keyPEM, err := testCertificates(zoneNames())
	if err != nil {
		return nil, err
	}
	if err := m.CopyIn(upstreamPath, upstreamBin, 0o755); err != nil {
		return nil, err
	}
	hostAddrs := map[string]bool{NameserverAddr: true}
	for _, ips := range Zone {
		for _, ip := range ips {
			if strings.HasPrefix(ip, "203.0.113.") {
				hostAddrs[ip] = true
			}
		}
	}
	cfg := upstream.Config{
		HTTPS: ":443", HTTP: ":80", DNS: NameserverAddr + ":53",
		Cert: upstreamDir + "/tls.crt", Key: upstreamDir + "/tls.key",
		Zone: Zone, Log: UpstreamLog, Ready: upstreamReady,
	}
	cfgJSON, _ := json.MarshalIndent(cfg, "", "  ")
	for _, f := range []struct {
		path string
		data []byte
		mode uint32
	}{
		{upstreamDir + "/tls.crt", certPEM, 0o644},
		{upstreamDir + "/tls.key", keyPEM, 0o600},
		{upstreamDir + "/config.json", cfgJSON, 0o644},
		{caInstallPath, caPEM, 0o644},
		{"/etc/resolv.conf", []byte("nameserver " + NameserverAddr + "\n"), 0o644},
	} {
		if err := m.WriteFile(f.path, f.data, 0o644); err != nil {
			return nil, err
		}
		if err := chmodIn(m, f.path, f.mode); err != nil {
			return nil, err
		}
	}
	var addrs []string
	for a := range hostAddrs {
		addrs = append(addrs, a)
	}
	sort.Strings(addrs)
	script := fmt.Sprintf(`
ip netns add %[1]s
ip -n %[1]s link set lo up
ip link add systest-inet0 type veth peer name inet0 netns %[1]s
ip addr add %[2]s/24 dev systest-inet0
ip link set systest-inet0 up
ip -n %[1]s addr add %[3]s/24 dev inet0
ip -n %[1]s link set inet0 up
for a in %[4]s; do ip -n %[1]s addr add $a/32 dev lo; done
ip route add 203.0.113.0/24 via %[3]s
update-ca-certificates >/dev/null 2>&1
rm -f %[5]s
systemd-run --quiet --unit=%[6]s -p NetworkNamespacePath=/run/netns/%[1]s %[7]s --config %[8]s/config.json
`, InternetNetns, GatewaySideAddr, internetSide, strings.Join(addrs, " "), upstreamReady, upstreamUnit, upstreamBin, upstreamDir)
	if _, err := m.Shell(ctx, script); err != nil {
		return nil, fmt.Errorf("start fake internet: %w", err)
	}
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for {
		if _, err := m.ReadFile(upstreamReady); err == nil {
			break
		}
		select {
		case <-ctx.Done():
			st, _ := m.Run(context.Background(), "systemctl", "status", "--no-pager", upstreamUnit)
			return nil, fmt.Errorf("fake internet did not become ready: %w\n%s", ctx.Err(), st)
		case <-tick.C:
		}
	}
	return &Internet{m: m, CAPEM: caPEM}, nil
}

func chmodIn(m *Machine, p string, mode uint32) error {
	_, err := m.Run(context.Background(), "chmod", fmt.Sprintf("%o", mode), p)
	return err
}

func zoneNames() []string {
	var names []string
	for n := range Zone {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// Requests returns everything the fake internet has received so far.
func (in *Internet) Requests() ([]upstream.Record, error) {
	data, err := in.m.ReadFile(UpstreamLog)
	if err != nil {
		return nil, err
	}
	var rs []upstream.Record
	sc := bufio.NewScanner(strings.NewReader(string(data)))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		var r upstream.Record
		if err := json.Unmarshal(sc.Bytes(), &r); err != nil {
			return nil, fmt.Errorf("parse upstream log: %w", err)
		}
		rs = append(rs, r)
	}
	return rs, sc.Err()
}

// Certificates makes a fresh test CA and a leaf for names and every
// address of the zone (127.0.0.1 among them: a server on the machine's
// loopback, such as the channel test's nginx, can use it), for servers
// other than the fake internet's; the CA is not installed anywhere.
func Certificates(names []string) (caPEM, certPEM, keyPEM []byte, err error) {
	return testCertificates(names)
}

// testCertificates makes a CA and one leaf for all names (and the zone's
// TEST-NET addresses), valid for a day.
func testCertificates(names []string) (caPEM, certPEM, keyPEM []byte, err error) {
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("generate test CA key: %w", err)
	}
	now := time.Now()
	caTmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "nixcage systest CA"},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(24 * time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("create test CA: %w", err)
	}
	caCert, _ := x509.ParseCertificate(caDER)
	leafKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("generate upstream key: %w", err)
	}
	leaf := &x509.Certificate{
		SerialNumber: big.NewInt(2),
		Subject:      pkix.Name{CommonName: names[0]},
		DNSNames:     names,
		NotBefore:    now.Add(-time.Hour),
		NotAfter:     now.Add(24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	for _, ips := range Zone {
		for _, ip := range ips {
			leaf.IPAddresses = append(leaf.IPAddresses, net.ParseIP(ip))
		}
	}
	leafDER, err := x509.CreateCertificate(rand.Reader, leaf, caCert, &leafKey.PublicKey, caKey)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("create upstream certificate: %w", err)
	}
	keyDER, err := x509.MarshalECPrivateKey(leafKey)
	if err != nil {
		return nil, nil, nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER}),
		pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: leafDER}),
		pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER}), nil
}
