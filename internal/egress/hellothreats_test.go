package egress

import (
	"bytes"
	"crypto/ecdh"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
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

// startBinaryOn runs the real binary with port allowed too.
func (h *harness) startBinaryOn(t *testing.T, port int) {
	h.rt.Policy.Ports = append(h.rt.Policy.Ports, port)
	h.writeConfig(h.rt)
	h.startBinary(t)
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
	h.startBinaryOn(t, router.port)
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
	h.startBinaryOn(t, router.port)
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

// sServer is Debian's `openssl s_server` on loopback serving two names the
// way a name-based virtual host does: certFor(defaultName) by default,
// certFor(name2) when the SNI is name2 (-servername, -cert2). It logs
// every server name its callback saw ("Hostname in TLS extension").
type sServer struct {
	port int
	mu   sync.Mutex
	out  strings.Builder
}

func (s *sServer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.out.Write(p)
}

func (s *sServer) log() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.out.String()
}

func startSServer(t *testing.T, h *harness, defaultName, name2 string, args ...string) *sServer {
	t.Helper()
	bin, err := exec.LookPath("openssl")
	if err != nil {
		t.Skip("openssl (Debian package openssl, checks/deps.sh) is missing: the test needs OpenSSL's s_server as the upstream")
	}
	a, err := ca.Load(filepath.Join(h.dir, "upstream-ca", ca.KeyFile), filepath.Join(h.dir, "upstream-ca", ca.CertFile))
	if err != nil {
		t.Fatal(err)
	}
	files := func(name string) (certFile, keyFile string) {
		leaf, err := a.Leaf(name)
		if err != nil {
			t.Fatal(err)
		}
		der, err := x509.MarshalPKCS8PrivateKey(leaf.PrivateKey)
		if err != nil {
			t.Fatal(err)
		}
		certFile, keyFile = filepath.Join(h.dir, name+".pem"), filepath.Join(h.dir, name+".key")
		os.WriteFile(certFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: leaf.Certificate[0]}), 0o600)
		os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}), 0o600)
		return certFile, keyFile
	}
	c1, k1 := files(defaultName)
	c2, k2 := files(name2)
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := &sServer{port: l.Addr().(*net.TCPAddr).Port}
	l.Close()
	cmd := exec.Command(bin, append([]string{"s_server", "-accept", "127.0.0.1:" + strconv.Itoa(s.port),
		"-cert", c1, "-key", k1, "-servername", name2, "-cert2", c2, "-key2", k2, "-msg"}, args...)...) // -msg: the name callback logs
	stdin, err := cmd.StdinPipe() // s_server ends at EOF on stdin
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stdout, cmd.Stderr = s, s
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait(); stdin.Close() })
	for deadline := time.Now().Add(10 * time.Second); !strings.Contains(s.log(), "ACCEPT"); {
		if time.Now().After(deadline) {
			t.Fatalf("openssl s_server did not start:\n%s", s.log())
		}
		time.Sleep(20 * time.Millisecond)
	}
	return s
}

// rawHello is a TLS 1.3 ClientHello record offering X25519 only, with a
// key share for it when share is set (none: the server must answer with a
// HelloRetryRequest). random and sid stay the same across the two
// ClientHellos of a retry, as RFC 8446 requires.
func rawHello(sni string, share, random, sid []byte) []byte {
	var b cryptobyte.Builder
	b.AddUint8(recordTypeHandshake)
	b.AddUint16(0x0301)
	b.AddUint16LengthPrefixed(func(b *cryptobyte.Builder) {
		b.AddUint8(typeClientHello)
		b.AddUint24LengthPrefixed(func(b *cryptobyte.Builder) {
			b.AddUint16(0x0303)
			b.AddBytes(random)
			b.AddUint8LengthPrefixed(func(b *cryptobyte.Builder) { b.AddBytes(sid) })
			b.AddUint16LengthPrefixed(func(b *cryptobyte.Builder) { b.AddUint16(0x1301) })
			b.AddUint8LengthPrefixed(func(b *cryptobyte.Builder) { b.AddUint8(0) })
			b.AddUint16LengthPrefixed(func(b *cryptobyte.Builder) {
				ext := func(typ uint16, f cryptobyte.BuilderContinuation) { b.AddUint16(typ); b.AddUint16LengthPrefixed(f) }
				ext(extServerName, func(b *cryptobyte.Builder) {
					b.AddUint16LengthPrefixed(func(b *cryptobyte.Builder) {
						b.AddUint8(0)
						b.AddUint16LengthPrefixed(func(b *cryptobyte.Builder) { b.AddBytes([]byte(sni)) })
					})
				})
				ext(extSupportedVersions, func(b *cryptobyte.Builder) {
					b.AddUint8LengthPrefixed(func(b *cryptobyte.Builder) { b.AddUint16(tls.VersionTLS13) })
				})
				ext(extSupportedCurves, func(b *cryptobyte.Builder) {
					b.AddUint16LengthPrefixed(func(b *cryptobyte.Builder) { b.AddUint16(uint16(tls.X25519)) })
				})
				ext(extSignatureAlgorithms, func(b *cryptobyte.Builder) {
					b.AddUint16LengthPrefixed(func(b *cryptobyte.Builder) {
						b.AddUint16(uint16(tls.ECDSAWithP256AndSHA256))
						b.AddUint16(uint16(tls.PSSWithSHA256))
					})
				})
				ext(extPSKModes, func(b *cryptobyte.Builder) { b.AddUint8LengthPrefixed(func(b *cryptobyte.Builder) { b.AddUint8(1) }) })
				ext(extKeyShare, func(b *cryptobyte.Builder) {
					b.AddUint16LengthPrefixed(func(b *cryptobyte.Builder) {
						if share != nil {
							b.AddUint16(uint16(tls.X25519))
							b.AddUint16LengthPrefixed(func(b *cryptobyte.Builder) { b.AddBytes(share) })
						}
					})
				})
			})
		})
	})
	return b.BytesOrPanic()
}

// The caged agent fronts through a HelloRetryRequest: its first
// ClientHello names the CONNECT host and offers no key share, so the
// server asks for a retry; the second ClientHello, sent in the clear once
// the tunnel relays, names denied.example.com. OpenSSL's server (Debian's
// s_server, as behind nginx or HAProxy) takes the second name (its
// servername callback runs again and the handshake goes on) where
// crypto/tls would refuse the change. The gateway must judge the second
// ClientHello as the first: refused as sni-mismatch, the second
// ClientHello never reaching the server. An honest retry (Go's client
// offering a P-256 share to a server that wants P-384) still works.
// Through the real binary.
func TestThreatTunnelHelloRetryFronting(t *testing.T) {
	h := setupHarness(t, nil)
	srv := startSServer(t, h, "denied.example.com", "plain.example.com", "-groups", "X25519:P-384")
	h.startBinaryOn(t, srv.port)
	auth := "plain.example.com:" + strconv.Itoa(srv.port)

	conn, code := h.connect(auth, "")
	if code != http.StatusOK {
		t.Fatalf("CONNECT %s: %d", auth, code)
	}
	conn.SetDeadline(time.Now().Add(15 * time.Second))
	random, sid := make([]byte, 32), make([]byte, 32)
	rand.Read(random)
	rand.Read(sid)
	conn.Write(rawHello("plain.example.com", nil, random, sid))
	hdr := make([]byte, recordHeaderLen+6+32)
	if _, err := io.ReadFull(conn, hdr); err != nil || hdr[0] != recordTypeHandshake || hdr[5] != 2 || [32]byte(hdr[11:]) != sha256.Sum256([]byte("HelloRetryRequest")) {
		t.Fatalf("no HelloRetryRequest from s_server (%x, %v):\n%s", hdr, err, srv.log())
	}
	key, _ := ecdh.X25519().GenerateKey(rand.Reader)
	conn.Write(append([]byte{20, 3, 3, 0, 1, 1}, // change_cipher_spec
		rawHello("denied.example.com", key.PublicKey().Bytes(), random, sid)...))
	io.Copy(io.Discard, conn) // what the server (or the gateway) answers
	conn.Close()
	if log := srv.log(); strings.Contains(log, `"denied.example.com"`) {
		t.Fatalf("the second ClientHello reached s_server, which took its name:\n%s", log)
	}
	r := h.want(t, is("CONNECT", "plain.example.com", srv.port), audit.Blocked, "sni-mismatch")
	if !strings.Contains(r.Reason, "HelloRetryRequest") {
		t.Errorf("reason %q does not name the retry", r.Reason)
	}

	// An honest retry: Go's client sends a P-256 key share, s_server
	// wants P-384 (or X25519), the client retries with the same name.
	conn2, code := h.connect(auth, "")
	if code != http.StatusOK {
		t.Fatalf("CONNECT %s: %d", auth, code)
	}
	defer conn2.Close()
	conn2.SetDeadline(time.Now().Add(15 * time.Second))
	tc := tls.Client(conn2, &tls.Config{ServerName: "plain.example.com", RootCAs: h.up.roots,
		CurvePreferences: []tls.CurveID{tls.CurveP256, tls.CurveP384}, MinVersion: tls.VersionTLS13})
	if err := tc.Handshake(); err != nil {
		t.Fatalf("honest HelloRetryRequest through the tunnel: %v\n%s\n%s", err, srv.log(), h.dump())
	}
	if n := strings.Count(srv.log(), `Hostname in TLS extension: "plain.example.com"`); n < 3 {
		t.Errorf("s_server saw plain.example.com %d times, want the refused tunnel's first ClientHello and both of the retry:\n%s", n, srv.log())
	}
}

// The caged agent makes the gateway hold its ClientHello bytes: crypto/tls
// takes a handshake message of up to 64 KiB in records of one byte each,
// and up to 16 warning alerts before each record, so a ClientHello never
// finished costs the gateway up to 7.7 MB per tunnel for the 15 s
// handshake timeout. Across tunnels at the default limits (256) that is
// gigabytes. The gate must stop taking bytes at a bound of its own, so
// the real binary's peak RSS stays under FloodRSSBoundMiB, the bound
// TestFloodRSS holds for its floods; each tunnel is refused as not-tls.
func TestThreatHelloFloodRSS(t *testing.T) {
	h := setupHarness(t, func(rt *policy.Runtime) { rt.Policy.Limits = policy.Limits{} })
	cmd := h.startBinary(t)
	pid := cmd.Process.Pid
	warn := []byte{recordTypeAlert, 3, 3, 0, 2, alertLevelWarning, 90}
	// The header of a ClientHello message of 64 KiB, then its body a byte
	// a record, each record after 16 warnings.
	unit := append(bytes.Repeat(warn, 16), recordTypeHandshake, 3, 1, 0, 1, 0)
	var flood []byte
	flood = append(flood, recordTypeHandshake, 3, 1, 0, 4, typeClientHello, 1, 0, 0)
	for len(flood) < 3<<20 {
		flood = append(flood, unit...)
	}
	const tunnels = 64
	var wg sync.WaitGroup
	var conns []net.Conn
	for range tunnels {
		conn, code := h.connect("plain.example.com:"+strconv.Itoa(h.up.tlsPort), "")
		if code != http.StatusOK {
			t.Fatalf("CONNECT: %d", code)
		}
		conns = append(conns, conn)
		wg.Add(1)
		go func() {
			defer wg.Done()
			conn.SetWriteDeadline(time.Now().Add(20 * time.Second))
			conn.Write(flood) // fails once the gateway refuses
		}()
	}
	wg.Wait()
	time.Sleep(500 * time.Millisecond)
	peak := procStatus(t, pid, "VmHWM")
	for _, c := range conns {
		c.Close()
	}
	if p := h.panicked(); p != "" {
		t.Fatalf("the gateway crashed:\n%s", p)
	}
	t.Logf("gateway peak RSS %d KiB after %d tunnels sent %d KiB of ClientHello records each", peak, tunnels, len(flood)>>10)
	if peak > FloodRSSBoundMiB<<10 {
		t.Fatalf("gateway peak RSS %d KiB exceeds %d MiB", peak, FloodRSSBoundMiB)
	}
	h.want(t, is("CONNECT", "plain.example.com", h.up.tlsPort), audit.Blocked, "not-tls")
}

// What the agent sends through an allowed tunnel reaches the upstream
// byte for byte and in order: the ClientHello, bytes sent in the same
// write after it (held by the gateway until the server has answered),
// and bytes sent later; with a HelloRetryRequest, a second ClientHello
// pipelined in that same write too. What the server answers reaches the
// agent whole, and the close record counts both ways. Each refused
// tunnel leaves exactly one record, with its rule. The upstream is a raw
// TCP server answering the first record with a ServerHello (or a
// HelloRetryRequest) and recording everything.
func TestTunnelReplayExact(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	port := l.Addr().(*net.TCPAddr).Port
	var retry atomic.Bool
	got := make(chan []byte, 4)
	serverHello := func(random []byte) []byte {
		var b cryptobyte.Builder
		b.AddUint8(recordTypeHandshake)
		b.AddUint16(0x0303)
		b.AddUint16LengthPrefixed(func(b *cryptobyte.Builder) {
			b.AddUint8(2)
			b.AddUint24LengthPrefixed(func(b *cryptobyte.Builder) {
				b.AddUint16(0x0303)
				b.AddBytes(random)
				b.AddUint8(0)
				b.AddUint16(0x1301)
				b.AddUint8(0)
				b.AddUint16(0)
			})
		})
		return b.BytesOrPanic()
	}
	hrr := sha256.Sum256([]byte("HelloRetryRequest"))
	answer := map[bool][]byte{false: serverHello(make([]byte, 32)), true: serverHello(hrr[:])}
	serveEach(l, func(c net.Conn) {
		c.SetDeadline(time.Now().Add(20 * time.Second))
		hdr := make([]byte, 5)
		if _, err := io.ReadFull(c, hdr); err != nil {
			return
		}
		first := make([]byte, 5+(int(hdr[3])<<8|int(hdr[4])))
		copy(first, hdr)
		if _, err := io.ReadFull(c, first[5:]); err != nil {
			return
		}
		c.Write(answer[retry.Load()])
		rest, _ := io.ReadAll(c)
		got <- append(first, rest...)
	})
	h := newHarness(t, func(rt *policy.Runtime) { rt.Policy.Ports = append(rt.Policy.Ports, port) })
	auth := "plain.example.com:" + strconv.Itoa(port)
	random, sid := make([]byte, 32), make([]byte, 32)
	rand.Read(random)
	rand.Read(sid)
	key, _ := ecdh.X25519().GenerateKey(rand.Reader)
	hello := rawHello("plain.example.com", key.PublicKey().Bytes(), random, sid)
	tail := []byte("\x17\x03\x03\x00\x05early")
	ccs := []byte{20, 3, 3, 0, 1, 1}
	for _, c := range []struct {
		name        string
		retry       bool
		first, last []byte
	}{
		{"ServerHello", false, cat(hello, tail), []byte("\x17\x03\x03\x00\x04late")},
		{"HelloRetryRequest", true, cat(rawHello("plain.example.com", nil, random, sid), ccs, hello, tail), []byte("\x17\x03\x03\x00\x04late")},
	} {
		t.Run(c.name, func(t *testing.T) {
			retry.Store(c.retry)
			// Both cases tunnel to the same host: this one's close record
			// is the one after those already written.
			closes := func() []audit.Record {
				var out []audit.Record
				for _, r := range h.records(t) {
					if closed("CONNECT", "plain.example.com", port)(r) {
						out = append(out, r)
					}
				}
				return out
			}
			before := len(closes())
			conn, code := h.connect(auth, "")
			if code != http.StatusOK {
				t.Fatalf("CONNECT: %d", code)
			}
			defer conn.Close()
			conn.SetDeadline(time.Now().Add(15 * time.Second))
			conn.Write(c.first)
			back := make([]byte, len(answer[c.retry]))
			if _, err := io.ReadFull(conn, back); err != nil || !bytes.Equal(back, answer[c.retry]) {
				t.Fatalf("the server's answer reached the agent as %x (%v)", back, err)
			}
			conn.Write(c.last)
			conn.(*net.TCPConn).CloseWrite()
			io.Copy(io.Discard, conn)
			want := cat(c.first, c.last)
			select {
			case up := <-got:
				if !bytes.Equal(up, want) {
					t.Fatalf("upstream got %d bytes %x, the agent sent %d: %x", len(up), up, len(want), want)
				}
			case <-time.After(15 * time.Second):
				t.Fatal("upstream got nothing")
			}
			deadline := time.Now().Add(15 * time.Second)
			all := closes()
			for len(all) <= before {
				if time.Now().After(deadline) {
					t.Fatalf("no close record for this tunnel:\n%s", h.dump())
				}
				time.Sleep(10 * time.Millisecond)
				all = closes()
			}
			r := all[before]
			if r.Decision != audit.Allowed {
				t.Fatalf("close record %+v, want allowed", r)
			}
			if r.BytesOut != int64(len(want)) || r.BytesIn != int64(len(back)) {
				t.Errorf("close record counts %d out, %d in; want %d, %d", r.BytesOut, r.BytesIn, len(want), len(back))
			}
		})
	}

	refusals := []struct {
		name, rule string
		in         []byte
	}{
		{"plain bytes", "not-tls", []byte("GET / HTTP/1.1\r\nHost: plain.example.com\r\n\r\n")},
		{"no SNI", "sni-missing", clientHello(t, &tls.Config{InsecureSkipVerify: true})},
		{"other SNI", "sni-mismatch", rawHello("other.example.com", key.PublicKey().Bytes(), random, sid)},
	}
	blocked := func() (n int) {
		for _, r := range h.records(t) {
			if is("CONNECT", "plain.example.com", port)(r) && r.Decision == audit.Blocked {
				n++
			}
		}
		return n
	}
	for _, c := range refusals {
		t.Run(c.name, func(t *testing.T) {
			before := blocked()
			conn, code := h.connect(auth, "")
			if code != http.StatusOK {
				t.Fatalf("CONNECT: %d", code)
			}
			conn.SetDeadline(time.Now().Add(15 * time.Second))
			conn.Write(c.in)
			io.Copy(io.Discard, conn) // the gateway closes a refused tunnel
			conn.Close()
			r := h.want(t, is("CONNECT", "plain.example.com", port), audit.Blocked, c.rule)
			time.Sleep(100 * time.Millisecond)
			if n := blocked() - before; n != 1 {
				t.Fatalf("%d records for one refused tunnel (last %+v)", n, r)
			}
		})
	}
}
