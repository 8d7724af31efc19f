package egress

import (
	"crypto/ecdh"
	"crypto/rand"
	"crypto/tls"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/crypto/cryptobyte"

	"github.com/nixcage/nixcage/internal/egress/audit"
	"github.com/nixcage/nixcage/internal/egress/ca"
	"github.com/nixcage/nixcage/internal/policy"
)

// nameRouter is a TLS server on loopback that serves whichever name its
// crypto/tls handshake resolves, as an SNI-routing front (a CDN edge)
// does: it records every name it was asked for and counts the bytes it
// received. With ech set it holds an ECH key whose config names
// publicName, as an ECH-enabled CDN does.
type nameRouter struct {
	port     int
	echList  []byte // the ECHConfigList a client needs (ech only)
	received atomic.Int64
	mu       sync.Mutex
	names    []string
}

func (n *nameRouter) served() []string {
	n.mu.Lock()
	defer n.mu.Unlock()
	return slices.Clone(n.names)
}

// routerConn counts what the server reads.
type routerConn struct {
	net.Conn
	n *atomic.Int64
}

func (c routerConn) Read(p []byte) (int, error) {
	k, err := c.Conn.Read(p)
	c.n.Add(int64(k))
	return k, err
}

func startNameRouter(t *testing.T, h *harness, publicName string) *nameRouter {
	t.Helper()
	a, err := ca.Load(filepath.Join(h.dir, "upstream-ca", ca.KeyFile), filepath.Join(h.dir, "upstream-ca", ca.CertFile))
	if err != nil {
		t.Fatal(err)
	}
	r := &nameRouter{}
	cfg := &tls.Config{
		MinVersion: tls.VersionTLS13,
		GetConfigForClient: func(chi *tls.ClientHelloInfo) (*tls.Config, error) {
			r.mu.Lock()
			r.names = append(r.names, chi.ServerName)
			r.mu.Unlock()
			return nil, nil
		},
		GetCertificate: func(chi *tls.ClientHelloInfo) (*tls.Certificate, error) { return a.Leaf(chi.ServerName) },
	}
	if publicName != "" {
		key, err := ecdh.X25519().GenerateKey(rand.Reader)
		if err != nil {
			t.Fatal(err)
		}
		config := echConfig(7, key.PublicKey().Bytes(), publicName)
		cfg.EncryptedClientHelloKeys = []tls.EncryptedClientHelloKey{{Config: config, PrivateKey: key.Bytes(), SendAsRetry: true}}
		var b cryptobyte.Builder
		b.AddUint16LengthPrefixed(func(b *cryptobyte.Builder) { b.AddBytes(config) })
		r.echList = b.BytesOrPanic()
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	r.port = l.Addr().(*net.TCPAddr).Port
	serveEach(l, func(c net.Conn) {
		c.SetDeadline(time.Now().Add(20 * time.Second))
		s := tls.Server(routerConn{c, &r.received}, cfg)
		if s.Handshake() == nil {
			io.WriteString(s, "served "+s.ConnectionState().ServerName+"\n")
		}
	})
	return r
}

// echConfig is an ECHConfig (draft-ietf-tls-esni, Section 4) for
// DHKEM(X25519, HKDF-SHA256) with HKDF-SHA256 and AES-128-GCM.
func echConfig(id uint8, pub []byte, publicName string) []byte {
	var b cryptobyte.Builder
	b.AddUint16(0xfe0d)
	b.AddUint16LengthPrefixed(func(b *cryptobyte.Builder) {
		b.AddUint8(id)
		b.AddUint16(0x0020)
		b.AddUint16LengthPrefixed(func(b *cryptobyte.Builder) { b.AddBytes(pub) })
		b.AddUint16LengthPrefixed(func(b *cryptobyte.Builder) { b.AddUint16(0x0001); b.AddUint16(0x0001) })
		b.AddUint8(64)
		b.AddUint8LengthPrefixed(func(b *cryptobyte.Builder) { b.AddBytes([]byte(publicName)) })
		b.AddUint16(0)
	})
	return b.BytesOrPanic()
}

// The caged agent fronts a denied name behind an allowed one with
// Encrypted ClientHello: its ClientHello's outer SNI is the CONNECT host
// (the ECH config's public name), the encrypted inner one names
// denied.example.com, and a server holding the ECH key (here Go's
// crypto/tls, as an ECH-enabled CDN edge) serves the inner name. The
// agent brings its own ECHConfigList, so stripping ech from DNS answers
// does not help: the tunnel must be refused at the ClientHello, audited
// as rule "ech", with no byte upstream. Through the real binary.
func TestThreatTunnelECHFronting(t *testing.T) {
	h := setupHarness(t, nil)
	router := startNameRouter(t, h, "plain.example.com")
	h.rt.Policy.Ports = append(h.rt.Policy.Ports, router.port)
	h.writeConfig(h.rt)
	h.startBinary(t)
	auth := "plain.example.com:" + strconv.Itoa(router.port)

	conn, code := h.connect(auth, "")
	if code != http.StatusOK {
		t.Fatalf("CONNECT %s: %d", auth, code)
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(15 * time.Second))
	tc := tls.Client(conn, &tls.Config{
		ServerName:                     "denied.example.com",
		EncryptedClientHelloConfigList: router.echList,
		InsecureSkipVerify:             true, // the name served is what is checked
		MinVersion:                     tls.VersionTLS13,
	})
	err := tc.Handshake()
	if err == nil {
		line, _ := io.ReadAll(tc)
		t.Fatalf("ECH handshake through the tunnel to plain.example.com succeeded (ECH accepted %v), upstream said %q, served names %q",
			tc.ConnectionState().ECHAccepted, line, router.served())
	}
	r := h.want(t, is("CONNECT", "plain.example.com", router.port), audit.Blocked, "ech")
	if !strings.Contains(r.Reason, "Encrypted ClientHello") {
		t.Errorf("reason %q does not name Encrypted ClientHello", r.Reason)
	}
	time.Sleep(200 * time.Millisecond)
	if n, names := router.received.Load(), router.served(); n != 0 || len(names) != 0 {
		t.Fatalf("upstream received %d bytes of a refused tunnel, served %q", n, names)
	}

	// A plain ClientHello to the same host still passes (the refusal is
	// for ECH, not for the host): the upstream serves plain.example.com.
	conn2, code := h.connect(auth, "")
	if code != http.StatusOK {
		t.Fatalf("CONNECT %s: %d", auth, code)
	}
	defer conn2.Close()
	conn2.SetDeadline(time.Now().Add(15 * time.Second))
	tc2 := tls.Client(conn2, &tls.Config{ServerName: "plain.example.com", RootCAs: h.up.roots})
	line, err := io.ReadAll(tc2)
	if string(line) != "served plain.example.com\n" {
		t.Fatalf("plain ClientHello: got %q, %v", line, err)
	}
}

// The caged agent names the CONNECT host in SNI with a character that
// Unicode lowercases to ASCII: U+212A KELVIN SIGN lowercases to "k", so
// policy.Normalize turns "\u212aiosk.example.com" into the allowed
// kiosk.example.com, while a server matching names as bytes (or by ASCII
// case, as OpenSSL's and nginx's name lookups do) sees another name and
// serves another site (here the name router records what it was asked
// for). The gateway must refuse the tunnel as sni-mismatch before a byte
// goes upstream. Through the real binary.
func TestThreatTunnelSNIUnicodeFold(t *testing.T) {
	h := setupHarness(t, nil)
	router := startNameRouter(t, h, "")
	h.dns.set("kiosk.example.com", "A", "127.0.0.1")
	h.rt.Policy.Ports = append(h.rt.Policy.Ports, router.port)
	h.writeConfig(h.rt)
	h.startBinary(t)
	auth := "kiosk.example.com:" + strconv.Itoa(router.port)
	if policy.Normalize("\u212aiosk.example.com") != "kiosk.example.com" {
		t.Skip("strings.ToLower no longer folds U+212A to k; the attack needs another character")
	}
	for _, name := range []string{"\u212aiosk.example.com", "kiosk.example.com\x00.evil.example.net"} {
		conn, code := h.connect(auth, "")
		if code != http.StatusOK {
			t.Fatalf("CONNECT %s: %d", auth, code)
		}
		conn.SetDeadline(time.Now().Add(15 * time.Second))
		tc := tls.Client(conn, &tls.Config{ServerName: name, InsecureSkipVerify: true})
		if err := tc.Handshake(); err == nil {
			t.Errorf("SNI %q: handshake through the tunnel to kiosk.example.com succeeded; upstream served %q", name, router.served())
		}
		conn.Close()
		h.want(t, func(r audit.Record) bool {
			return is("CONNECT", "kiosk.example.com", router.port)(r) && strings.Contains(r.Reason, strconv.Quote(name))
		}, audit.Blocked, "sni-mismatch")
	}
	time.Sleep(200 * time.Millisecond)
	if n, names := router.received.Load(), router.served(); n != 0 || len(names) != 0 {
		t.Fatalf("upstream received %d bytes of refused tunnels, served %q", n, names)
	}
}
