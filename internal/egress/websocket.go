package egress

import (
	"bufio"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"sync"
	"time"

	"github.com/nixcage/nixcage/internal/egress/audit"
	"github.com/nixcage/nixcage/internal/egress/inspect"
	"github.com/nixcage/nixcage/internal/egress/redact"
)

// WebSocket on intercepted hosts (RFC 6455 over HTTP/1.1). The handshake is
// a request like any other: decided, inspected, injected. After 101 the
// gateway relays frames itself, both ways:
//   - agent to upstream: every message streams through the same inspectors
//     as a request body (inspect.Stream): a placeholder where its secret is
//     not bound, a real value in any form, or a blocking finding closes the
//     connection with 1008 before the offending bytes are sent;
//   - upstream to agent: every message streams through the redactor
//     (redact.Stream, the fixed hold-back that is no oracle).
// Frames are streamed, never buffered whole; a frame or message longer than
// max_body_bytes closes with 1009. Because both directions hold bytes back,
// messages are re-fragmented (RFC 6455 §5.4 lets intermediaries do so).
// Extensions are not negotiated (Sec-WebSocket-Extensions is removed from
// the handshake): a compressed message could not be inspected, and an
// upstream that answers with one is refused.

const (
	wsContinuation = 0x0
	wsText         = 0x1
	wsBinary       = 0x2
	wsClose        = 0x8
	wsPing         = 0x9
	wsPong         = 0xA
)

// Close codes the gateway sends.
const (
	wsPolicyViolation = 1008
	wsTooBig          = 1009
	wsProtocolError   = 1002
)

// wsFrame is a frame header; the payload follows on the wire.
type wsFrame struct {
	fin    bool
	rsv    byte
	opcode byte
	masked bool
	mask   [4]byte
	length int64
}

func readFrameHeader(r io.Reader) (wsFrame, error) {
	var f wsFrame
	var h [2]byte
	if _, err := io.ReadFull(r, h[:]); err != nil {
		return f, err
	}
	f.fin, f.rsv, f.opcode = h[0]&0x80 != 0, h[0]&0x70, h[0]&0x0f
	f.masked = h[1]&0x80 != 0
	switch n := h[1] & 0x7f; n {
	case 126:
		var b [2]byte
		if _, err := io.ReadFull(r, b[:]); err != nil {
			return f, err
		}
		f.length = int64(binary.BigEndian.Uint16(b[:]))
	case 127:
		var b [8]byte
		if _, err := io.ReadFull(r, b[:]); err != nil {
			return f, err
		}
		f.length = int64(binary.BigEndian.Uint64(b[:]) & (1<<63 - 1))
	default:
		f.length = int64(n)
	}
	if f.masked {
		if _, err := io.ReadFull(r, f.mask[:]); err != nil {
			return f, err
		}
	}
	return f, nil
}

// writeFrame writes one frame, masking it with a fresh key when mask is set
// (client to server frames must be masked).
func writeFrame(w io.Writer, fin bool, opcode byte, payload []byte, mask bool) error {
	hdr := make([]byte, 0, 14)
	b0 := opcode
	if fin {
		b0 |= 0x80
	}
	hdr = append(hdr, b0)
	var mbit byte
	if mask {
		mbit = 0x80
	}
	switch n := len(payload); {
	case n < 126:
		hdr = append(hdr, mbit|byte(n))
	case n <= 0xffff:
		hdr = append(hdr, mbit|126, byte(n>>8), byte(n))
	default:
		hdr = append(hdr, mbit|127)
		hdr = binary.BigEndian.AppendUint64(hdr, uint64(n))
	}
	out := payload
	if mask {
		var key [4]byte
		if _, err := rand.Read(key[:]); err != nil {
			return err
		}
		hdr = append(hdr, key[:]...)
		out = make([]byte, len(payload))
		for i := range payload {
			out[i] = payload[i] ^ key[i%4]
		}
	}
	if _, err := w.Write(append(hdr, out...)); err != nil {
		return err
	}
	return nil
}

func closePayload(code int, reason string) []byte {
	if len(reason) > 123 {
		reason = reason[:123]
	}
	return append([]byte{byte(code >> 8), byte(code)}, reason...)
}

// wsBlocked is why a relay direction stopped the connection.
type wsBlocked struct {
	b    *blockedErr
	code int
}

// wsSide is one direction of the relay.
type wsSide struct {
	name    string // "agent" or "upstream", where frames come from
	src     *bufio.Reader
	dst     io.Writer
	mask    bool // frames written to dst must be masked
	wantMsk bool // frames read from src must be masked
	max     int64
	// newMsg starts a message's filter; it returns a function taking a
	// piece of payload (end=true for the last) and returning what may go
	// on, or a refusal.
	newMsg func() func(p []byte, end bool) ([]byte, *blockedErr)
	// control filters a control frame's whole payload.
	control func(op byte, p []byte) ([]byte, *blockedErr)
	msgs    int
	bytes   int64 // payload bytes read from src
}

// run relays frames from src to dst until either side ends or a message is
// refused.
func (s *wsSide) run() (*wsBlocked, error) {
	var m *wsMessage // the message in progress, nil between messages
	buf := make([]byte, 32<<10)
	for {
		f, err := readFrameHeader(s.src)
		if err != nil {
			return nil, err
		}
		if blk := s.check(f); blk != nil {
			return blk, nil
		}
		if f.opcode >= wsClose {
			if blk, err := s.controlFrame(f); blk != nil || err != nil {
				return blk, err
			}
			continue
		}
		switch {
		case f.opcode == wsText || f.opcode == wsBinary:
			if m != nil {
				return s.protocol("started a message inside another"), nil
			}
			m = &wsMessage{filter: s.newMsg(), op: f.opcode}
			s.msgs++
		case f.opcode == wsContinuation && m != nil:
		default:
			return s.protocol(fmt.Sprintf("sent opcode %d out of place", f.opcode)), nil
		}
		if m.length += f.length; m.length > s.max {
			return &wsBlocked{block(http.StatusRequestEntityTooLarge, "max-body-bytes", "%s sent a WebSocket message over %d bytes", s.name, s.max), wsTooBig}, nil
		}
		if blk, err := s.payload(f, m, buf); blk != nil || err != nil {
			return blk, err
		}
		if f.fin {
			m = nil
		}
	}
}

// wsMessage is a data message being relayed.
type wsMessage struct {
	filter  func([]byte, bool) ([]byte, *blockedErr)
	op      byte
	length  int64
	started bool // a frame of it has been written
}

func (s *wsSide) protocol(what string) *wsBlocked {
	return &wsBlocked{block(http.StatusBadGateway, "websocket-protocol", "%s %s", s.name, what), wsProtocolError}
}

// check refuses frames the relay cannot pass on as they are.
func (s *wsSide) check(f wsFrame) *wsBlocked {
	switch {
	case f.rsv != 0:
		return s.protocol("sent a frame with RSV bits (no extension was negotiated)")
	case f.masked != s.wantMsk:
		return s.protocol("sent a frame with the wrong masking")
	case f.length > s.max:
		return &wsBlocked{block(http.StatusRequestEntityTooLarge, "max-body-bytes", "%s sent a WebSocket frame of %d bytes, over %d", s.name, f.length, s.max), wsTooBig}
	case f.opcode >= wsClose && (f.length > 125 || !f.fin):
		return s.protocol("sent an invalid control frame")
	}
	return nil
}

// controlFrame relays a control frame (at most 125 bytes), filtered whole.
func (s *wsSide) controlFrame(f wsFrame) (*wsBlocked, error) {
	p := make([]byte, f.length)
	if _, err := io.ReadFull(s.src, p); err != nil {
		return nil, err
	}
	unmask(p, f.mask, 0, f.masked)
	out, b := s.control(f.opcode, p)
	if b != nil {
		return &wsBlocked{b, wsPolicyViolation}, nil
	}
	return nil, writeFrame(s.dst, true, f.opcode, out, s.mask)
}

// payload streams a data frame's payload through the message's filter in
// pieces; each piece's released bytes go on as a frame of their own.
func (s *wsSide) payload(f wsFrame, m *wsMessage, buf []byte) (*wsBlocked, error) {
	var off int64
	for first := true; first || off < f.length; first = false {
		n := int(min(f.length-off, int64(len(buf))))
		if _, err := io.ReadFull(s.src, buf[:n]); err != nil {
			return nil, err
		}
		unmask(buf[:n], f.mask, off, f.masked)
		s.bytes += int64(n)
		off += int64(n)
		last := f.fin && off == f.length
		out, b := m.filter(buf[:n], last)
		if b != nil {
			return &wsBlocked{b, wsPolicyViolation}, nil
		}
		if len(out) > 0 || last {
			op := byte(wsContinuation)
			if !m.started {
				op = m.op
			}
			if err := writeFrame(s.dst, last, op, out, s.mask); err != nil {
				return nil, err
			}
			m.started = true
		}
	}
	return nil, nil
}

func unmask(p []byte, key [4]byte, off int64, masked bool) {
	if !masked {
		return
	}
	for i := range p {
		p[i] ^= key[(off+int64(i))%4]
	}
}

// websocket relays one WebSocket session whose handshake passed decide and
// inspect: forward the handshake (wsHandshake), take over the agent's
// connection, relay both directions (wsSession), audit the session.
func (g *Gateway) websocket(w http.ResponseWriter, r *http.Request, t *target, rec audit.Record, start time.Time, flags []string, scheme string) {
	up, hdr, ok := g.wsHandshake(w, r, t, &rec, start, flags, scheme)
	if !ok {
		return
	}
	defer up.Close()
	conn, brw, err := http.NewResponseController(w).Hijack()
	if err != nil {
		g.refuse(w, r, rec, block(http.StatusInternalServerError, "hijack", "cannot take over connection: %v", err), start)
		return
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Time{})
	brw.WriteString("HTTP/1.1 101 Switching Protocols\r\n")
	hdr.Write(brw)
	brw.WriteString("\r\n")
	if err := brw.Flush(); err != nil {
		return
	}
	s := &wsSession{st: t.st, t: t}
	fromAgent, fromUp, blk := s.relay(conn, brw.Reader, up)
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, name := range sortedKeys(s.res.Near) {
		s.flags = append(s.flags, "real_values: near-match of secret "+name+" in a websocket message")
	}
	rec.SecretsRedacted = sortedKeys(s.res.Redacted)
	rec.BytesOut, rec.BytesIn = fromAgent.bytes, fromUp.bytes
	rec.DurationMS = time.Since(start).Milliseconds()
	summary := fmt.Sprintf("websocket: %d messages from the agent, %d from the upstream", fromAgent.msgs, fromUp.msgs)
	if blk != nil {
		rec.Decision, rec.Rule, rec.Reason = audit.Blocked, blk.b.rule, blk.b.reason+"; "+summary
		g.logAudit(rec)
		return
	}
	g.auditDone(rec, start, summary, append(flags, s.flags...), nil)
}

// wsHandshake forwards the handshake with credentials injected and no
// extension offered. On a 101 it returns the upstream connection and the
// redacted response headers; otherwise it has answered and audited.
func (g *Gateway) wsHandshake(w http.ResponseWriter, r *http.Request, t *target, rec *audit.Record, start time.Time, flags []string, scheme string) (io.ReadWriteCloser, http.Header, bool) {
	st := t.st
	if r.ProtoMajor != 1 {
		g.refuse(w, r, *rec, block(http.StatusBadRequest, "websocket", "WebSocket is supported over HTTP/1.1 only"), start)
		return nil, nil, false
	}
	// The hop-by-hop headers were removed; the handshake needs these two,
	// and no extension (a compressed message cannot be inspected).
	r.Header.Set("Connection", "Upgrade")
	r.Header.Set("Upgrade", "websocket")
	r.Header.Del("Sec-WebSocket-Extensions")
	rec.SecretsInjected = inject(st.secrets, r.Header, t)
	out := outbound(r, t, scheme, &bodyStream{empty: true})
	out.Header.Del("Accept-Encoding")
	resp, err := g.h1.RoundTrip(out)
	if err != nil {
		g.upstreamError(w, r, *rec, err, start)
		return nil, nil, false
	}
	if resp.StatusCode != http.StatusSwitchingProtocols {
		// A refusal by the upstream: an ordinary response, redacted.
		defer resp.Body.Close()
		n, res, err := g.respond(w, resp, t)
		if b, ok := err.(*blockedErr); ok {
			// Refused before anything was written (a status or coding
			// the gateway does not pass), as exchange does: not a copy
			// error after an answer the agent never got.
			g.refuse(w, r, *rec, b, start)
			return nil, nil, false
		}
		rec.SecretsRedacted, rec.BytesIn = sortedKeys(res.Redacted), n
		g.auditDone(*rec, start, fmt.Sprintf("websocket handshake answered %d", resp.StatusCode), flags, err)
		return nil, nil, false
	}
	up, ok := resp.Body.(io.ReadWriteCloser)
	if !ok {
		resp.Body.Close()
		g.upstreamError(w, r, *rec, errors.New("101 without a connection"), start)
		return nil, nil, false
	}
	if ext := resp.Header.Get("Sec-WebSocket-Extensions"); ext != "" {
		up.Close()
		g.refuse(w, r, *rec, block(http.StatusBadGateway, "websocket-extension", "upstream negotiated WebSocket extension %q that was not offered; messages could not be inspected", ext), start)
		return nil, nil, false
	}
	var res redact.Result
	hdr := http.Header{}
	redactHeader(st.redact, resp.Header, hdr, "", &res)
	return up, hdr, true
}

// wsSession is what both relay directions share: redactions and flags.
type wsSession struct {
	st    *state
	t     *target
	mu    sync.Mutex
	res   redact.Result
	flags []string
}

// inspectMessage starts the inspection of one message from the agent.
func (s *wsSession) inspectMessage() func([]byte, bool) ([]byte, *blockedErr) {
	ins := s.st.insp.NewStream("websocket message")
	return func(p []byte, end bool) ([]byte, *blockedErr) {
		out := ins.Write(p)
		if end {
			out = append(append([]byte(nil), out...), ins.Close()...)
		}
		if b := checkPlaceholders(s.st.secrets, ins.Placeholders(), "a websocket message", s.t); b != nil {
			return nil, b
		}
		fl, b := verdict(ins.Findings())
		if b != nil {
			return nil, b
		}
		if end && len(fl) > 0 {
			s.mu.Lock()
			s.flags = append(s.flags, fl...)
			s.mu.Unlock()
		}
		return out, nil
	}
}

// inspectControl inspects a control frame from the agent, whole.
func (s *wsSession) inspectControl(_ byte, p []byte) ([]byte, *blockedErr) {
	fs, phs := s.st.insp.Inspect([]inspect.Part{{Where: "websocket control frame", Data: p}})
	if b := checkPlaceholders(s.st.secrets, phs, "a websocket control frame", s.t); b != nil {
		return nil, b
	}
	_, b := verdict(fs)
	return p, b
}

// redactMessage starts the redaction of one message from the upstream.
func (s *wsSession) redactMessage() func([]byte, bool) ([]byte, *blockedErr) {
	rs := s.st.redact.NewStream()
	return func(p []byte, end bool) ([]byte, *blockedErr) {
		out := rs.Write(p)
		if end {
			out = append(append([]byte(nil), out...), rs.Close()...)
			s.mu.Lock()
			s.res.Merge(rs.Result())
			s.mu.Unlock()
		}
		return out, nil
	}
}

// redactControl redacts a control frame from the upstream, whole.
func (s *wsSession) redactControl(_ byte, p []byte) ([]byte, *blockedErr) {
	var r redact.Result
	out := []byte(s.st.redact.String(string(p), &r))
	s.mu.Lock()
	s.res.Merge(r)
	s.mu.Unlock()
	return out, nil
}

// relay runs both directions until one ends. When one refuses a message,
// both peers get a close frame (the agent's names the rule) and the
// agent's remaining bytes are read (bounded) so the close is not lost to a
// connection reset.
func (s *wsSession) relay(conn net.Conn, agent *bufio.Reader, up io.ReadWriteCloser) (*wsSide, *wsSide, *wsBlocked) {
	// Both directions and the closing code write frames: one writer each.
	connW, upW := &lockedWriter{w: conn}, &lockedWriter{w: up}
	fromAgent := &wsSide{name: "agent", src: agent, dst: upW, mask: true, wantMsk: true, max: s.st.maxBody, newMsg: s.inspectMessage, control: s.inspectControl}
	fromUp := &wsSide{name: "upstream", src: bufio.NewReader(up), dst: connW, max: s.st.maxBody, newMsg: s.redactMessage, control: s.redactControl}
	type outcome struct {
		side *wsSide
		blk  *wsBlocked
	}
	done := make(chan outcome, 2)
	for _, side := range []*wsSide{fromAgent, fromUp} {
		go func() {
			blk, _ := side.run()
			done <- outcome{side, blk}
		}()
	}
	first := <-done
	if first.blk != nil {
		_ = writeFrame(connW, true, wsClose, closePayload(first.blk.code, "nixcage egress: blocked by rule "+first.blk.b.rule), false)
		_ = writeFrame(upW, true, wsClose, closePayload(first.blk.code, "policy"), true)
		up.Close()
		if first.side == fromAgent {
			_ = conn.SetReadDeadline(time.Now().Add(2 * time.Second))
			_, _ = io.CopyN(io.Discard, agent, s.st.maxBody+(1<<20))
		}
	}
	conn.Close()
	up.Close()
	<-done
	return fromAgent, fromUp, first.blk
}

// lockedWriter serializes whole frames from several goroutines.
type lockedWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}
