package egress

import (
	"io"
	"slices"

	"golang.org/x/crypto/cryptobyte"
)

// The ClientHello gate's reader. It decides exactly what crypto/tls's
// server decides before it calls Config.GetConfigForClient: the record
// layer of conn.go (readRecordOrCCS, readHandshake) as it runs before a
// version is negotiated, clientHelloMsg.unmarshal of handshake_messages.go
// and the ECH extension check of ech.go (processECHClientHello with no
// keys). Each rule below names the crypto/tls check it mirrors; the
// differential fuzz target FuzzClientHelloPeek holds the two equal. It
// costs a fraction of a throwaway tls.Server handshake (docs/egress.md,
// docs/performance.md) because it keeps nothing but the server name.

// Limits and types as crypto/tls's common.go defines them.
const (
	recordHeaderLen = 5
	maxPlaintext    = 16384 // maxCiphertext (16384+2048) bounds the header; a record without cipher is its plaintext
	maxHandshake    = 65536
	// maxUselessRecords: crypto/tls drops at most this many warning
	// alerts in a row before it fails the handshake.
	maxUselessRecords = 16

	recordTypeCCS       = 20
	recordTypeAlert     = 21
	recordTypeHandshake = 22
	typeClientHello     = 1
	typeServerHello     = 2

	alertLevelWarning = 1
	alertCloseNotify  = 0

	// maxHelloBytes bounds what the gate takes for one hello, records,
	// alerts and all: a 64 KiB message in records of 16 KiB takes 65565
	// bytes. crypto/tls has no such bound (a message a byte a record, 16
	// warning alerts before each, is 7.7 MB it would take); the gate does
	// not follow it there, so an unfinished ClientHello costs the gateway
	// at most this much for the handshake timeout (TestThreatHelloFloodRSS).
	maxHelloBytes = 2 * maxHandshake

	// helloExts is room for a browser's extensions without allocating.
	helloExts = 32
)

// TLS extension numbers whose contents crypto/tls checks in a ClientHello.
const (
	extServerName              = 0
	extStatusRequest           = 5
	extSupportedCurves         = 10
	extSupportedPoints         = 11
	extSignatureAlgorithms     = 13
	extALPN                    = 16
	extSCT                     = 18
	extExtendedMasterSecret    = 23
	extSessionTicket           = 35
	extPreSharedKey            = 41
	extEarlyData               = 42
	extSupportedVersions       = 43
	extCookie                  = 44
	extPSKModes                = 45
	extSignatureAlgorithmsCert = 50
	extKeyShare                = 51
	extQUICTransportParameters = 57
	extRenegotiationInfo       = 0xff01
	extEncryptedClientHello    = 0xfe0d
)

// helloReader takes TLS records from pre, then from conn, keeping every
// byte it took in raw (they are replayed upstream verbatim). It reads from
// conn exactly the records it needs, never a byte past them.
type helloReader struct {
	conn io.Reader
	raw  []byte
	pos  int // parsed up to here
	// ccs: change_cipher_spec records (the one byte 1) are dropped as
	// useless records, as crypto/tls's TLS 1.3 server does once it has
	// sent a HelloRetryRequest (the client's middlebox-compatibility CCS
	// comes before its second ClientHello).
	ccs bool
}

// next returns the following n bytes, reading from conn what raw lacks;
// reserve (>= n) sizes a growth of raw so the next record header fits too.
func (r *helloReader) next(n, reserve int) ([]byte, bool) {
	if r.pos+n > maxHelloBytes {
		return nil, false
	}
	if lack := r.pos + n - len(r.raw); lack > 0 {
		if cap(r.raw)-len(r.raw) < lack {
			grown := make([]byte, len(r.raw), min(max(2*cap(r.raw), r.pos+reserve), maxHelloBytes))
			copy(grown, r.raw)
			r.raw = grown
		}
		got, err := io.ReadFull(r.conn, r.raw[len(r.raw):len(r.raw)+lack])
		r.raw = r.raw[:len(r.raw)+got]
		if err != nil {
			return nil, false
		}
	}
	b := r.raw[r.pos : r.pos+n : r.pos+n]
	r.pos += n
	return b, true
}

// peekedHello is what the gate keeps of a ClientHello.
type peekedHello struct {
	sni string // the first host_name, crypto/tls's ClientHelloInfo.ServerName
	// ech: the ClientHello carries an outer encrypted_client_hello. A
	// server holding the ECH key acts on the encrypted inner ClientHello
	// and its server name, which no reader without the key can see (a
	// greasing client's looks the same, by design).
	ech bool
	// records is how many bytes of raw are the ClientHello's records;
	// the rest is pre past them.
	records int
}

// readClientHello reads the ClientHello from pre and conn and returns what
// the gate keeps of it, everything taken (all of pre, then what was read
// from conn), and whether crypto/tls would have reached GetConfigForClient.
// The caller sets the read deadline.
func readClientHello(conn io.Reader, pre []byte) (hello peekedHello, raw []byte, ok bool) {
	return readHello(conn, pre, false)
}

// readRetryHello reads the second ClientHello, the one answering a
// HelloRetryRequest: as readClientHello, after any change_cipher_spec.
func readRetryHello(conn io.Reader, pre []byte) (hello peekedHello, raw []byte, ok bool) {
	return readHello(conn, pre, true)
}

func readHello(conn io.Reader, pre []byte, ccs bool) (hello peekedHello, raw []byte, ok bool) {
	// The first header sizes raw: a ClientHello in one record (every real
	// client's) then costs one allocation; bytes that are no handshake
	// record get no room they will not use.
	var first [recordHeaderLen]byte
	k := copy(first[:], pre)
	if k < recordHeaderLen {
		got, err := io.ReadFull(conn, first[k:])
		if err != nil {
			return hello, append(slices.Clip(pre), first[k:k+got]...), false
		}
	}
	n := int(first[3])<<8 | int(first[4])
	if first[0] != recordTypeHandshake || n > maxPlaintext {
		n = 0
	}
	r := &helloReader{conn: conn, raw: make([]byte, 0, max(len(pre), recordHeaderLen+n)), ccs: ccs}
	r.raw = append(r.raw, pre...)
	r.raw = append(r.raw, first[k:]...)

	msg, ok := r.handshakeMessage()
	if !ok {
		return hello, r.raw, false
	}
	hello, ok = parseClientHello(msg)
	if !ok {
		return peekedHello{}, r.raw, false
	}
	hello.records = r.pos
	return hello, r.raw, true
}

// helloRetryRandom is a HelloRetryRequest's random (RFC 8446, 4.1.3).
var helloRetryRandom = [32]byte{
	0xCF, 0x21, 0xAD, 0x74, 0xE5, 0x9A, 0x61, 0x11, 0xBE, 0x1D, 0x8C, 0x02, 0x1E, 0x65, 0xB8, 0x91,
	0xC2, 0xA2, 0x11, 0x16, 0x7A, 0xBB, 0x8C, 0x5E, 0x07, 0x9E, 0x09, 0xE2, 0xC8, 0xA8, 0x33, 0x9C,
}

// readServerHello reads the server's first handshake message from conn
// with the same record layer and reports whether it is a
// HelloRetryRequest; raw is every byte read, to be passed on to the
// client. Anything else (a ServerHello, an alert, bytes no TLS client
// would take) is not a retry: the client gets it as it is.
func readServerHello(conn io.Reader) (raw []byte, retry bool) {
	r := &helloReader{conn: conn}
	msg, ok := r.handshakeMessage()
	if !ok || msg[0] != typeServerHello {
		return r.raw, false
	}
	s := cryptobyte.String(msg[4:])
	var vers uint16
	var random []byte
	if !s.ReadUint16(&vers) || !s.ReadBytes(&random, 32) {
		return r.raw, false
	}
	return r.raw, [32]byte(random) == helloRetryRandom
}

// handshakeMessage reassembles the first handshake message from one or
// more records, as crypto/tls's readHandshake over readRecordOrCCS does
// while no version is negotiated (c.haveVers false, no cipher).
func (r *helloReader) handshakeMessage() ([]byte, bool) {
	var hand []byte
	useless := 0
	for {
		hdr, ok := r.next(recordHeaderLen, recordHeaderLen)
		if !ok {
			return nil, false
		}
		typ, vers, n := hdr[0], int(hdr[1])<<8|int(hdr[2]), int(hdr[3])<<8|int(hdr[4])
		// "first record does not look like a TLS handshake" (checked on
		// every record until a version is negotiated; it also covers the
		// SSLv2 0x80 check and application data without a cipher).
		if (typ != recordTypeAlert && typ != recordTypeHandshake && (typ != recordTypeCCS || !r.ccs)) || vers >= 0x1000 {
			return nil, false
		}
		// "oversized record": n > maxCiphertext fails at the header and
		// n > maxPlaintext once read; neither reaches the ClientHello.
		if n > maxPlaintext {
			return nil, false
		}
		data, ok := r.next(n, n+recordHeaderLen)
		if !ok {
			return nil, false
		}
		if typ == recordTypeCCS {
			if len(data) != 1 || data[0] != 1 {
				return nil, false
			}
			if useless++; useless > maxUselessRecords {
				return nil, false
			}
			continue
		}
		if typ == recordTypeAlert {
			// Only a warning alert other than close_notify is dropped,
			// at most maxUselessRecords in a row.
			if len(data) != 2 || data[1] == alertCloseNotify || data[0] != alertLevelWarning {
				return nil, false
			}
			if useless++; useless > maxUselessRecords {
				return nil, false
			}
			continue
		}
		// An empty handshake record is an unexpected message; a non-empty
		// one advances and resets the useless-record count.
		if len(data) == 0 {
			return nil, false
		}
		useless = 0
		if hand == nil {
			hand = data // capacity clipped by next: an append copies
		} else {
			hand = append(hand, data...)
		}
		if len(hand) < 4 {
			continue
		}
		// Bytes after the message stay buffered in crypto/tls, unchecked
		// before GetConfigForClient.
		m := int(hand[1])<<16 | int(hand[2])<<8 | int(hand[3])
		if m > maxHandshake {
			return nil, false
		}
		if len(hand) >= 4+m {
			return hand[:4+m], true
		}
	}
}

// parseClientHello mirrors clientHelloMsg.unmarshal (every check that can
// fail it, including those of extensions whose values the gate ignores),
// the message type check of readClientHello and the ECH extension parse
// of processECHClientHello. It returns the first host_name and whether an
// outer ECH extension is present.
func parseClientHello(msg []byte) (hello peekedHello, ok bool) {
	fail := peekedHello{}
	if msg[0] != typeClientHello {
		return fail, false
	}
	s := cryptobyte.String(msg[4:])
	var vers uint16
	var random, sessionID, suites, compression cryptobyte.String
	if !s.ReadUint16(&vers) || !s.ReadBytes((*[]byte)(&random), 32) ||
		!s.ReadUint8LengthPrefixed(&sessionID) ||
		!s.ReadUint16LengthPrefixed(&suites) || len(suites)%2 != 0 ||
		!s.ReadUint8LengthPrefixed(&compression) {
		return fail, false
	}
	if s.Empty() {
		return hello, true // no extensions
	}
	var exts cryptobyte.String
	if !s.ReadUint16LengthPrefixed(&exts) || !s.Empty() {
		return fail, false
	}
	var seenBuf [helloExts]uint16
	seen := seenBuf[:0]
	var name []byte
	for !exts.Empty() {
		var ext uint16
		var data cryptobyte.String
		if !exts.ReadUint16(&ext) || !exts.ReadUint16LengthPrefixed(&data) {
			return fail, false
		}
		seen = append(seen, ext)
		switch ext {
		case extServerName:
			var ok bool
			if name, ok = parseServerName(&data); !ok {
				return fail, false
			}
		case extPreSharedKey:
			// pre_shared_key must be the last extension.
			if !exts.Empty() || !checkPSK(&data) {
				return fail, false
			}
		case extEncryptedClientHello:
			var ok bool
			if hello.ech, ok = checkECH(data); !ok {
				return fail, false
			}
			data = nil
		case extSessionTicket, extQUICTransportParameters:
			data = nil // any contents
		default:
			known, ok := checkExtension(ext, &data)
			if !ok {
				return fail, false
			}
			if !known {
				continue // unknown extensions are ignored, contents and all
			}
		}
		if !data.Empty() {
			return fail, false
		}
	}
	// No extension twice (crypto/tls's seenExts).
	slices.Sort(seen)
	for i := 1; i < len(seen); i++ {
		if seen[i] == seen[i-1] {
			return fail, false
		}
	}
	hello.sni = string(name)
	return hello, true
}

// parseServerName reads server_name (RFC 6066, Section 3) as crypto/tls
// does: a non-empty list of non-empty names, at most one host_name (type
// 0), no trailing dot on it; names of other types are skipped.
func parseServerName(data *cryptobyte.String) (host []byte, ok bool) {
	var list cryptobyte.String
	if !data.ReadUint16LengthPrefixed(&list) || list.Empty() {
		return nil, false
	}
	for !list.Empty() {
		var typ uint8
		var name cryptobyte.String
		if !list.ReadUint8(&typ) || !list.ReadUint16LengthPrefixed(&name) || name.Empty() {
			return nil, false
		}
		if typ != 0 {
			continue
		}
		if len(host) != 0 || name[len(name)-1] == '.' {
			return nil, false
		}
		host = name
	}
	return host, true
}

// checkExtension checks the extensions crypto/tls parses whose contents
// the gate does not use. known is false for an extension crypto/tls
// ignores.
func checkExtension(ext uint16, data *cryptobyte.String) (known, ok bool) {
	var list cryptobyte.String
	switch ext {
	case extStatusRequest:
		var typ uint8
		var ignored cryptobyte.String
		ok = data.ReadUint8(&typ) && data.ReadUint16LengthPrefixed(&ignored) && data.ReadUint16LengthPrefixed(&ignored)
	case extSupportedCurves, extSignatureAlgorithms, extSignatureAlgorithmsCert:
		// Non-empty lists of uint16.
		ok = data.ReadUint16LengthPrefixed(&list) && !list.Empty() && len(list)%2 == 0
	case extSupportedPoints:
		ok = data.ReadUint8LengthPrefixed(&list) && !list.Empty()
	case extRenegotiationInfo, extPSKModes:
		ok = data.ReadUint8LengthPrefixed(&list)
	case extExtendedMasterSecret, extSCT, extEarlyData:
		ok = true // empty, checked by the caller
	case extALPN:
		ok = data.ReadUint16LengthPrefixed(&list) && !list.Empty()
		for ok && !list.Empty() {
			var proto cryptobyte.String
			ok = list.ReadUint8LengthPrefixed(&proto) && !proto.Empty()
		}
	case extSupportedVersions:
		ok = data.ReadUint8LengthPrefixed(&list) && !list.Empty() && len(list)%2 == 0
	case extCookie:
		ok = data.ReadUint16LengthPrefixed(&list) && !list.Empty()
	case extKeyShare:
		ok = data.ReadUint16LengthPrefixed(&list)
		for ok && !list.Empty() {
			var group uint16
			var share cryptobyte.String
			ok = list.ReadUint16(&group) && list.ReadUint16LengthPrefixed(&share) && !share.Empty()
		}
	default:
		return false, true
	}
	return true, ok
}

// checkPSK checks pre_shared_key (RFC 8446, Section 4.2.11): non-empty
// identities with non-empty labels, non-empty binders.
func checkPSK(data *cryptobyte.String) bool {
	var ids, binders cryptobyte.String
	if !data.ReadUint16LengthPrefixed(&ids) || ids.Empty() {
		return false
	}
	for !ids.Empty() {
		var label cryptobyte.String
		var age uint32
		if !ids.ReadUint16LengthPrefixed(&label) || !ids.ReadUint32(&age) || label.Empty() {
			return false
		}
	}
	if !data.ReadUint16LengthPrefixed(&binders) || binders.Empty() {
		return false
	}
	for !binders.Empty() {
		var binder cryptobyte.String
		if !binders.ReadUint8LengthPrefixed(&binder) || binder.Empty() {
			return false
		}
	}
	return true
}

// checkECH mirrors parseECHExt as processECHClientHello runs it on a
// non-empty extension: an inner one is the type byte alone; an outer one
// has cipher suite, config id, encapsulated key and payload (trailing
// bytes allowed); any other type fails. outer reports an outer one.
func checkECH(data cryptobyte.String) (outer, ok bool) {
	if data.Empty() {
		return false, true // crypto/tls skips an empty ECH extension
	}
	var typ, configID uint8
	var kdf, aead uint16
	var encap, payload cryptobyte.String
	if !data.ReadUint8(&typ) {
		return false, false
	}
	switch typ {
	case 1: // inner: this ClientHello's own name is the one served
		return false, data.Empty()
	case 0: // outer
		return true, data.ReadUint16(&kdf) && data.ReadUint16(&aead) && data.ReadUint8(&configID) &&
			data.ReadUint16LengthPrefixed(&encap) && data.ReadUint16LengthPrefixed(&payload)
	}
	return false, false
}
