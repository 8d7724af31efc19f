package egress

import (
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"io"
	"net"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"golang.org/x/crypto/cryptobyte"

	"github.com/nixcage/nixcage/internal/egress/ca"
)

// The oracle: the gate as it was, a throwaway tls.Server handshake over a
// recording view of the connection, stopped at GetConfigForClient. The
// differential tests hold readClientHello equal to it.

var errSNICaptured = errors.New("sni captured")

// recordConn is a read-only view of a connection that keeps what it read;
// writes are dropped so the throwaway TLS server cannot answer the client.
type recordConn struct {
	net.Conn
	r   io.Reader
	buf bytes.Buffer
}

func (c *recordConn) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.buf.Write(p[:n])
	return n, err
}
func (c *recordConn) Write(p []byte) (int, error) { return len(p), nil }

func peekClientHelloTLS(conn net.Conn, pre []byte) (sni string, raw []byte, ok bool) {
	rc := &recordConn{Conn: conn, r: io.MultiReader(bytes.NewReader(pre), conn)}
	_ = conn.SetReadDeadline(time.Now().Add(handshakeTimeout))
	defer conn.SetReadDeadline(time.Time{})
	var got bool
	srv := tls.Server(rc, &tls.Config{GetConfigForClient: func(h *tls.ClientHelloInfo) (*tls.Config, error) {
		sni, got = h.ServerName, true
		return nil, errSNICaptured
	}})
	_ = srv.Handshake()
	return sni, rc.buf.Bytes(), got
}

// peekSNI is the gate's verdict as the oracle gives it: ok and the name.
func peekSNI(conn net.Conn, pre []byte) (sni string, raw []byte, ok bool) {
	hello, raw, ok := peekClientHello(conn, pre)
	return hello.sni, raw, ok
}

// memConn is an in-memory connection that serves b in reads of at most
// chunk bytes (0: as much as asked) and counts what was taken.
type memConn struct {
	net.Conn
	b     []byte
	chunk int
	taken int
}

func (c *memConn) Read(p []byte) (int, error) {
	if c.taken == len(c.b) {
		return 0, io.EOF
	}
	if c.chunk > 0 && len(p) > c.chunk {
		p = p[:c.chunk]
	}
	n := copy(p, c.b[c.taken:])
	c.taken += n
	return n, nil
}
func (c *memConn) Write(p []byte) (int, error)        { return len(p), nil }
func (c *memConn) SetReadDeadline(time.Time) error    { return nil }
func (c *memConn) SetDeadline(time.Time) error        { return nil }
func (c *memConn) SetWriteDeadline(time.Time) error   { return nil }
func (c *memConn) Close() error                       { return nil }
func (c *memConn) LocalAddr() net.Addr                { return &net.TCPAddr{} }
func (c *memConn) RemoteAddr() net.Addr               { return &net.TCPAddr{} }
func (c *memConn) reset(b []byte, chunk int) *memConn { *c = memConn{b: b, chunk: chunk}; return c }

// captureConn records what a TLS client writes and ends its handshake
// at the first read.
type captureConn struct {
	memConn
	out bytes.Buffer
}

func (c *captureConn) Write(p []byte) (int, error) { return c.out.Write(p) }
func (c *captureConn) Read([]byte) (int, error)    { return 0, io.EOF }

// clientHello is the first flight of a real crypto/tls client.
func clientHello(t testing.TB, cfg *tls.Config) []byte {
	t.Helper()
	c := &captureConn{}
	_ = tls.Client(c, cfg).Handshake()
	if c.out.Len() == 0 {
		t.Fatal("tls.Client wrote no ClientHello")
	}
	return c.out.Bytes()
}

// resumingHello is a real TLS 1.3 ClientHello with a pre_shared_key: a
// first handshake against a tls.Server leaves a ticket in the cache.
func resumingHello(t testing.TB) []byte {
	t.Helper()
	dir := t.TempDir()
	if _, err := ca.Ensure(dir, "test upstream CA", []string{"example.com"}); err != nil {
		t.Fatal(err)
	}
	a, err := ca.Load(filepath.Join(dir, ca.KeyFile), filepath.Join(dir, ca.CertFile))
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AddCert(a.Cert)
	cfg := &tls.Config{ServerName: "example.com", RootCAs: roots, ClientSessionCache: tls.NewLRUClientSessionCache(1)}
	// Loopback TCP, not net.Pipe: the server writes its ticket before it
	// reads the client's Finished, which a buffer-less pipe deadlocks.
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		b, err := l.Accept()
		if err != nil {
			return
		}
		s := tls.Server(b, &tls.Config{GetCertificate: func(h *tls.ClientHelloInfo) (*tls.Certificate, error) { return a.Leaf(h.ServerName) }})
		if s.Handshake() == nil {
			_, _ = s.Write([]byte("x"))
		}
		s.Close()
	}()
	conn, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
	c := tls.Client(conn, cfg)
	if err := c.Handshake(); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Read(make([]byte, 1)); err != nil { // takes the ticket
		t.Fatal(err)
	}
	c.Close()
	wg.Wait()
	hello := clientHello(t, cfg)
	if !bytes.Contains(hello, []byte{0, extPreSharedKey}) {
		t.Fatal("second ClientHello carries no pre_shared_key")
	}
	return hello
}

// realHellos are ClientHellos of Go's client in several configurations.
func realHellos(t testing.TB) map[string][]byte {
	return map[string][]byte{
		"sni":        clientHello(t, &tls.Config{ServerName: "example.com"}),
		"no-sni":     clientHello(t, &tls.Config{InsecureSkipVerify: true}),
		"tls12-only": clientHello(t, &tls.Config{ServerName: "api.example.com", MaxVersion: tls.VersionTLS12}),
		"big-share":  clientHello(t, &tls.Config{ServerName: "example.com", CurvePreferences: []tls.CurveID{tls.SecP384r1MLKEM1024, tls.X25519MLKEM768}}),
		"alpn":       clientHello(t, &tls.Config{ServerName: "example.com", NextProtos: []string{"h2", "http/1.1"}}),
		"resuming":   resumingHello(t),
	}
}

// Builders for hand-made ClientHellos.

type ext struct {
	typ  uint16
	data []byte
}

// u16 is a uint16-length-prefixed byte string; u8 a uint8-prefixed one.
func u16(parts ...[]byte) []byte {
	return prefixed((*cryptobyte.Builder).AddUint16LengthPrefixed, parts)
}
func u8(parts ...[]byte) []byte { return prefixed((*cryptobyte.Builder).AddUint8LengthPrefixed, parts) }

func prefixed(add func(*cryptobyte.Builder, cryptobyte.BuilderContinuation), parts [][]byte) []byte {
	b := cryptobyte.NewBuilder(nil)
	add(b, func(b *cryptobyte.Builder) {
		for _, p := range parts {
			b.AddBytes(p)
		}
	})
	return b.BytesOrPanic()
}

func cat(parts ...[]byte) []byte { return bytes.Join(parts, nil) }

// hostName is a server_name extension's contents with one entry per
// name (type 0 each unless given as typed pairs by sniEntry).
func sniEntry(typ byte, name string) []byte { return cat([]byte{typ}, u16([]byte(name))) }
func sniExt(entries ...[]byte) ext          { return ext{extServerName, u16(entries...)} }
func hostName(name string) ext              { return sniExt(sniEntry(0, name)) }

// helloBody is a ClientHello's body (after the 4-byte message header)
// with the given extensions; nil exts means no extensions block at all.
func helloBody(exts []ext) []byte {
	body := cat([]byte{3, 3}, make([]byte, 32), u8(make([]byte, 32)), u16([]byte{0x13, 0x01, 0x00, 0xff}), u8([]byte{0}))
	if exts == nil {
		return body
	}
	var block []byte
	for _, e := range exts {
		block = cat(block, []byte{byte(e.typ >> 8), byte(e.typ)}, u16(e.data))
	}
	return cat(body, u16(block))
}

// handshake wraps a body into a handshake message of type typ.
func handshake(typ byte, body []byte) []byte {
	n := len(body)
	return cat([]byte{typ, byte(n >> 16), byte(n >> 8), byte(n)}, body)
}

// record is one TLS record of type typ and record version 0x0301.
func record(typ byte, payload []byte) []byte {
	return recordV(typ, 0x0301, payload)
}

func recordV(typ byte, vers uint16, payload []byte) []byte {
	n := len(payload)
	return cat([]byte{typ, byte(vers >> 8), byte(vers), byte(n >> 8), byte(n)}, payload)
}

// fragment splits msg into handshake records of the given sizes (the
// rest in a last record).
func fragment(msg []byte, sizes ...int) []byte {
	var out []byte
	for _, n := range sizes {
		out = cat(out, record(recordTypeHandshake, msg[:n]))
		msg = msg[n:]
	}
	return cat(out, record(recordTypeHandshake, msg))
}

func helloRecord(exts ...ext) []byte {
	return record(recordTypeHandshake, handshake(typeClientHello, helloBody(exts)))
}

// sized is a valid ClientHello message whose body is n bytes, padded
// with an unknown extension.
func sized(n int) []byte {
	base := len(helloBody([]ext{hostName("example.com"), {0x1234, nil}}))
	return handshake(typeClientHello, helloBody([]ext{hostName("example.com"), {0x1234, make([]byte, n-base)}}))
}

var warning = record(recordTypeAlert, []byte{alertLevelWarning, 90}) // user_canceled

func repeat(b []byte, n int) []byte { return bytes.Repeat(b, n) }

// TestClientHelloRules gives every rule that decides the gate one row
// that the rule's removal would turn; each row's verdict and name are
// also checked against the crypto/tls oracle, so a row is a crypto/tls
// rule and not one of ours.
func TestClientHelloRules(t *testing.T) {
	sni := hostName("example.com")
	msg := handshake(typeClientHello, helloBody([]ext{sni}))
	exts := func(e ...ext) []byte { return helloRecord(append([]ext{sni}, e...)...) }
	psk := ext{extPreSharedKey, cat(u16(u16([]byte("id")), []byte{0, 0, 0, 1}), u16(u8([]byte("binder"))))}
	rows := []struct {
		name string
		in   []byte
		ok   bool
		sni  string
	}{
		{"valid", helloRecord(sni), true, "example.com"},
		{"no extensions block", helloRecord(), true, ""},
		{"no server_name", helloRecord(ext{extALPN, u16(u8([]byte("h2")))}), true, ""},
		{"host_name after a name of another type", helloRecord(sniExt(sniEntry(1, "x"), sniEntry(0, "a.example"))), true, "a.example"},
		{"unknown extension contents ignored", exts(ext{0x1234, []byte{1, 2, 3}}), true, "example.com"},
		{"session ticket contents ignored", exts(ext{extSessionTicket, []byte{9, 9, 9}}), true, "example.com"},
		{"QUIC parameters contents ignored", exts(ext{extQUICTransportParameters, []byte{9}}), true, "example.com"},
		{"empty key share list", exts(ext{extKeyShare, u16()}), true, "example.com"},
		{"pre_shared_key last", exts(psk), true, "example.com"},
		{"ECH outer", exts(ext{extEncryptedClientHello, cat([]byte{0, 0, 1, 0, 1, 7}, u16([]byte{1}), u16([]byte{2}), []byte{0xee})}), true, "example.com"},
		{"ECH inner", exts(ext{extEncryptedClientHello, []byte{1}}), true, "example.com"},
		{"ECH empty", exts(ext{extEncryptedClientHello, nil}), true, "example.com"},
		{"fragmented 1+2+rest", fragment(msg, 1, 2), true, "example.com"},
		{"fragmented with warnings between", cat(warning, record(recordTypeHandshake, msg[:3]), repeat(warning, 16), record(recordTypeHandshake, msg[3:])), true, "example.com"},
		{"bytes after the message in its record", record(recordTypeHandshake, cat(msg, []byte{0, 0})), true, "example.com"},
		{"record version 0x0fff", recordV(recordTypeHandshake, 0x0fff, msg), true, "example.com"},

		{"duplicate extension", exts(ext{extALPN, u16(u8([]byte("h2")))}, ext{extALPN, u16(u8([]byte("h2")))}), false, ""},
		{"duplicate unknown extension", exts(ext{0x1234, nil}, ext{0x1234, nil}), false, ""},
		{"duplicate server_name", helloRecord(sni, hostName("other.example")), false, ""},
		{"two host_names", helloRecord(sniExt(sniEntry(0, "a.example"), sniEntry(0, "b.example"))), false, ""},
		{"empty host_name", helloRecord(hostName("")), false, ""},
		{"empty name of another type", helloRecord(sniExt(sniEntry(1, ""), sniEntry(0, "a.example"))), false, ""},
		{"trailing dot", helloRecord(hostName("example.com.")), false, ""},
		{"empty server_name list", helloRecord(sniExt()), false, ""},
		{"server_name trailing bytes", helloRecord(ext{extServerName, cat(u16(sniEntry(0, "a.example")), []byte{0})}), false, ""},
		{"server_name entry overruns", helloRecord(ext{extServerName, u16([]byte{0, 0, 9, 'a'})}), false, ""},
		{"bytes after the extensions block", record(recordTypeHandshake, handshake(typeClientHello, cat(helloBody([]ext{sni}), []byte{0}))), false, ""},
		{"extension overruns its block", record(recordTypeHandshake, handshake(typeClientHello, cat(helloBody(nil), u16([]byte{0, 16, 0, 9, 1})))), false, ""},
		{"odd cipher suites", record(recordTypeHandshake, handshake(typeClientHello, cat([]byte{3, 3}, make([]byte, 32), u8(), u16([]byte{0x13}), u8([]byte{0})))), false, ""},
		{"short random", record(recordTypeHandshake, handshake(typeClientHello, cat([]byte{3, 3}, make([]byte, 20)))), false, ""},
		{"no compression methods", record(recordTypeHandshake, handshake(typeClientHello, cat([]byte{3, 3}, make([]byte, 32), u8(), u16([]byte{0x13, 0x01})))), false, ""},
		{"not a ClientHello (ServerHello)", record(recordTypeHandshake, handshake(2, helloBody([]ext{sni}))), false, ""},
		{"unknown handshake type", record(recordTypeHandshake, handshake(99, helloBody([]ext{sni}))), false, ""},
		{"handshake message of 65536", fragment(sized(65536), 16384, 16384, 16384, 16383), true, "example.com"},
		{"handshake message over 65536", fragment(sized(65537), 16384, 16384, 16384, 16384), false, ""},
		{"application data record", record(23, msg), false, ""},
		{"change_cipher_spec record", cat(record(20, []byte{1}), record(recordTypeHandshake, msg)), false, ""},
		{"SSLv2 hello", cat([]byte{0x80, 0x2e, 1, 3, 1}, make([]byte, 0x2e-3)), false, ""},
		{"record version 0x1000", recordV(recordTypeHandshake, 0x1000, msg), false, ""},
		{"later record version 0x1000", cat(record(recordTypeHandshake, msg[:3]), recordV(recordTypeHandshake, 0x1000, msg[3:])), false, ""},
		{"record over 16384", record(recordTypeHandshake, cat(msg, make([]byte, 16385-len(msg)))), false, ""},
		{"empty handshake record", cat(record(recordTypeHandshake, nil), record(recordTypeHandshake, msg)), false, ""},
		{"17 warnings in a row", cat(repeat(warning, 17), record(recordTypeHandshake, msg)), false, ""},
		{"fatal alert", cat(record(recordTypeAlert, []byte{2, 40}), record(recordTypeHandshake, msg)), false, ""},
		{"close_notify", cat(record(recordTypeAlert, []byte{alertLevelWarning, alertCloseNotify}), record(recordTypeHandshake, msg)), false, ""},
		{"alert of 3 bytes", cat(record(recordTypeAlert, []byte{1, 90, 0}), record(recordTypeHandshake, msg)), false, ""},
		{"alert of unknown level", cat(record(recordTypeAlert, []byte{3, 90}), record(recordTypeHandshake, msg)), false, ""},
		{"EOF inside the record", helloRecord(sni)[:20], false, ""},
		{"EOF between fragments", fragment(msg, 10)[:15], false, ""},
		{"EOF in the header", []byte{recordTypeHandshake, 3}, false, ""},
		{"plain HTTP", []byte("GET / HTTP/1.1\r\nHost: example.com\r\n\r\n"), false, ""},
		{"extended_master_secret with contents", exts(ext{extExtendedMasterSecret, []byte{0}}), false, ""},
		{"SCT with contents", exts(ext{extSCT, []byte{0}}), false, ""},
		{"early_data with contents", exts(ext{extEarlyData, []byte{0}}), false, ""},
		{"status_request truncated", exts(ext{extStatusRequest, cat([]byte{1}, u16())}), false, ""},
		{"status_request trailing", exts(ext{extStatusRequest, cat([]byte{1}, u16(), u16(), []byte{0})}), false, ""},
		{"supported_groups empty", exts(ext{extSupportedCurves, u16()}), false, ""},
		{"supported_groups odd", exts(ext{extSupportedCurves, u16([]byte{0, 29, 0})}), false, ""},
		{"ec_point_formats empty", exts(ext{extSupportedPoints, u8()}), false, ""},
		{"signature_algorithms empty", exts(ext{extSignatureAlgorithms, u16()}), false, ""},
		{"signature_algorithms_cert odd", exts(ext{extSignatureAlgorithmsCert, u16([]byte{4, 3, 8})}), false, ""},
		{"renegotiation_info overruns", exts(ext{extRenegotiationInfo, []byte{5, 0}}), false, ""},
		{"ALPN empty list", exts(ext{extALPN, u16()}), false, ""},
		{"ALPN empty protocol", exts(ext{extALPN, u16(u8([]byte("h2")), u8())}), false, ""},
		{"supported_versions empty", exts(ext{extSupportedVersions, u8()}), false, ""},
		{"supported_versions odd", exts(ext{extSupportedVersions, u8([]byte{3, 4, 3})}), false, ""},
		{"cookie empty", exts(ext{extCookie, u16()}), false, ""},
		{"key share empty", exts(ext{extKeyShare, u16([]byte{0, 29}, u16())}), false, ""},
		{"key share truncated", exts(ext{extKeyShare, u16([]byte{0, 29, 0})}), false, ""},
		{"psk_key_exchange_modes overruns", exts(ext{extPSKModes, []byte{2, 1}}), false, ""},
		{"pre_shared_key not last", helloRecord(psk, sni), false, ""},
		{"pre_shared_key empty label", exts(ext{extPreSharedKey, cat(u16(u16(), []byte{0, 0, 0, 1}), u16(u8([]byte("b"))))}), false, ""},
		{"pre_shared_key empty binder", exts(ext{extPreSharedKey, cat(u16(u16([]byte("id")), []byte{0, 0, 0, 1}), u16(u8()))}), false, ""},
		{"pre_shared_key no binders", exts(ext{extPreSharedKey, cat(u16(u16([]byte("id")), []byte{0, 0, 0, 1}), u16())}), false, ""},
		{"ECH unknown type", exts(ext{extEncryptedClientHello, []byte{2}}), false, ""},
		{"ECH inner with bytes", exts(ext{extEncryptedClientHello, []byte{1, 0}}), false, ""},
		{"ECH outer truncated", exts(ext{extEncryptedClientHello, cat([]byte{0, 0, 1, 0, 1, 7}, u16([]byte{1}))}), false, ""},
	}
	var c memConn
	for _, r := range rows {
		t.Run(r.name, func(t *testing.T) {
			sni, raw, ok := peekSNI(c.reset(r.in, 0), nil)
			if ok != r.ok || sni != r.sni {
				t.Errorf("peekClientHello = (%q, %v), want (%q, %v)", sni, ok, r.sni, r.ok)
			}
			if !bytes.Equal(raw, r.in[:c.taken]) {
				t.Errorf("raw is not the %d bytes taken", c.taken)
			}
			if osni, _, ook := peekClientHelloTLS(c.reset(r.in, 0), nil); ook != r.ok || osni != r.sni {
				t.Errorf("crypto/tls says (%q, %v): the row is not a crypto/tls rule", osni, ook)
			}
		})
	}
}

// TestClientHelloReadsNoFurther: the gate takes the ClientHello's records
// from the connection and not a byte of what follows, and keeps all of
// pre (bytes the front end read already) even past the ClientHello.
func TestClientHelloReadsNoFurther(t *testing.T) {
	for name, hello := range realHellos(t) {
		msg := hello[recordHeaderLen:]
		for _, in := range [][]byte{hello, fragment(msg, 7, 100)} {
			tail := []byte("\x17\x03\x03\x00\x05early")
			for _, chunk := range []int{0, 1, 300} {
				c := (&memConn{}).reset(cat(in, tail), chunk)
				_, raw, ok := peekSNI(c, nil)
				if !ok || !bytes.Equal(raw, in) || c.taken != len(in) {
					t.Errorf("%s, chunk %d: ok %v, took %d bytes, raw %d bytes, want the %d of the ClientHello", name, chunk, ok, c.taken, len(raw), len(in))
				}
			}
			for _, split := range []int{0, 3, 5, 6, len(in), len(in) + 3} {
				all := cat(in, tail)
				c := (&memConn{}).reset(all[split:], 0)
				_, raw, ok := peekSNI(c, all[:split])
				want := all[:max(split, len(in))]
				if !ok || !bytes.Equal(raw, want) {
					t.Errorf("%s, pre %d bytes: ok %v, raw %d bytes, want %d", name, split, ok, len(raw), len(want))
				}
			}
		}
	}
}

// FuzzClientHelloPeek holds the gate equal to crypto/tls: for any bytes,
// split anywhere into pre and the connection and read in any chunk size,
// readClientHello and the tls.Server oracle agree on ok and the server
// name; raw is pre and then exactly the bytes taken from the connection,
// and the gate needed every byte it took (one byte fewer fails it).
func FuzzClientHelloPeek(f *testing.F) {
	for _, h := range realHellos(f) {
		f.Add(h, uint16(0), uint8(0))
		f.Add(h, uint16(40), uint8(7))
		f.Add(fragment(h[recordHeaderLen:], 1, 2, 200), uint16(3), uint8(0))
		f.Add(cat(warning, fragment(h[recordHeaderLen:], 100), h), uint16(0), uint8(1))
	}
	psk := ext{extPreSharedKey, cat(u16(u16([]byte("id")), []byte{0, 0, 0, 1}), u16(u8([]byte("binder"))))}
	for _, h := range [][]byte{
		helloRecord(), helloRecord(hostName("a.example."), psk),
		helloRecord(sniExt(sniEntry(1, "x"), sniEntry(0, "a.example"))),
		helloRecord(hostName("x"), ext{extEncryptedClientHello, cat([]byte{0, 0, 1, 0, 1, 7}, u16([]byte{1}), u16([]byte{2}))}),
		[]byte("GET / HTTP/1.1\r\n\r\n"),
	} {
		f.Add(h, uint16(0), uint8(0))
	}
	var c, oc memConn
	f.Fuzz(func(t *testing.T, in []byte, split uint16, chunk uint8) {
		s := int(split) % (len(in) + 1)
		pre, rest := in[:s], in[s:]
		sni, raw, ok := peekSNI(c.reset(rest, int(chunk)), pre)
		taken := c.taken
		osni, oraw, ook := peekClientHelloTLS(oc.reset(rest, int(chunk)), pre)
		if !ok && ook && len(raw) > maxHelloBytes-maxPlaintext-recordHeaderLen {
			return // the gate's own bound, past crypto/tls's (TestClientHelloBound)
		}
		if ok != ook || sni != osni {
			t.Fatalf("gate (%q, %v), crypto/tls (%q, %v)", sni, ok, osni, ook)
		}
		if !bytes.Equal(raw, in[:s+taken]) {
			t.Fatalf("raw (%d bytes) is not pre and the %d bytes taken", len(raw), taken)
		}
		if !bytes.HasPrefix(in, oraw) {
			t.Fatal("oracle raw is not a prefix of the input")
		}
		if !ok {
			return
		}
		if taken > oc.taken {
			t.Fatalf("gate took %d bytes, crypto/tls only %d", taken, oc.taken)
		}
		if nsni, _, nok := peekSNI(c.reset(rest[:taken], 0), pre); !nok || nsni != sni {
			t.Fatal("the bytes taken alone are not the same ClientHello")
		}
		if taken > 0 {
			if _, _, nok := peekSNI(c.reset(rest[:taken-1], 0), pre); nok {
				t.Fatal("took a byte it did not need")
			}
		}
	})
}

// TestRetryHello: the second ClientHello of a HelloRetryRequest may come
// after change_cipher_spec records (the middlebox-compatibility CCS), the
// first may not (crypto/tls agrees); a HelloRetryRequest is told from a
// ServerHello by its random, and what readServerHello read is passed on
// whole, records and all.
func TestRetryHello(t *testing.T) {
	ccs := record(recordTypeCCS, []byte{1})
	hello := helloRecord(hostName("a.example"))
	var c memConn
	if _, _, ok := peekSNI(c.reset(cat(ccs, hello), 0), nil); ok {
		t.Error("a first ClientHello after change_cipher_spec passed")
	}
	if _, _, ok := peekClientHelloTLS(c.reset(cat(ccs, hello), 0), nil); ok {
		t.Error("crypto/tls takes change_cipher_spec before the first ClientHello: the row is not its rule")
	}
	for _, in := range [][]byte{hello, cat(ccs, hello), cat(ccs, warning, ccs, hello)} {
		p, raw, ok := readRetryHello(c.reset(in, 0), nil)
		if !ok || p.sni != "a.example" || !bytes.Equal(raw, in) || p.records != len(in) {
			t.Errorf("second ClientHello %x: (%+v, %d bytes, %v)", in, p, len(raw), ok)
		}
	}
	for _, in := range [][]byte{cat(record(recordTypeCCS, []byte{2}), hello), cat(repeat(ccs, maxUselessRecords+1), hello)} {
		if _, _, ok := readRetryHello(c.reset(in, 0), nil); ok {
			t.Errorf("second ClientHello after %x passed", in[:6])
		}
	}

	serverHello := func(random []byte) []byte {
		return record(recordTypeHandshake, handshake(typeServerHello, cat([]byte{3, 3}, random, u8(), []byte{0x13, 0x01, 0}, u16())))
	}
	hrr := serverHello(helloRetryRandom[:])
	tail := record(recordTypeCCS, []byte{1})
	for _, r := range []struct {
		name  string
		in    []byte
		retry bool
		took  int
	}{
		{"HelloRetryRequest", cat(hrr, tail), true, len(hrr)},
		{"ServerHello", cat(serverHello(make([]byte, 32)), tail), false, len(hrr)},
		{"fatal alert", record(recordTypeAlert, []byte{2, 40}), false, 7},
		{"not TLS", []byte("HTTP/1.1 400 Bad Request\r\n\r\n"), false, 5},
	} {
		raw, retry := readServerHello(c.reset(r.in, 0))
		if retry != r.retry || !bytes.Equal(raw, r.in[:r.took]) || c.taken != r.took {
			t.Errorf("%s: retry %v, raw %d bytes, took %d; want %v, %d", r.name, retry, len(raw), c.taken, r.retry, r.took)
		}
	}
}

// TestClientHelloBound: the gate takes at most maxHelloBytes for a
// ClientHello, where crypto/tls takes a 64 KiB message a byte a record: a
// ClientHello of the largest size in full records passes, the same
// message in records of a byte is refused once the bound is reached.
func TestClientHelloBound(t *testing.T) {
	msg := sized(maxHandshake)
	var c memConn
	full := fragment(msg, maxPlaintext, maxPlaintext, maxPlaintext, maxPlaintext)
	if sni, raw, ok := peekSNI(c.reset(full, 0), nil); !ok || sni != "example.com" || len(raw) != len(full) {
		t.Errorf("64 KiB ClientHello in 16 KiB records: (%q, %d bytes, %v)", sni, len(raw), ok)
	}
	var tiny []byte
	for _, b := range msg {
		tiny = append(tiny, record(recordTypeHandshake, []byte{b})...)
	}
	if _, _, ok := peekClientHelloTLS(c.reset(tiny, 0), nil); !ok {
		t.Fatal("crypto/tls refuses the ClientHello in records of a byte: the bound is not past its rules")
	}
	if _, raw, ok := peekSNI(c.reset(tiny, 0), nil); ok || len(raw) > maxHelloBytes || c.taken > maxHelloBytes {
		t.Errorf("ClientHello in records of a byte: ok %v, %d bytes kept, %d taken; want refused within %d", ok, len(raw), c.taken, maxHelloBytes)
	}
}
