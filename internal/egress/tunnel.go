package egress

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync/atomic"
	"time"

	"github.com/nixcage/nixcage/internal/egress/audit"
	"github.com/nixcage/nixcage/internal/policy"
)

// peekClientHello reads the client's TLS ClientHello and returns its SNI and
// every byte taken from the agent (all of pre, then the ClientHello's
// records, never a byte past them), to be replayed upstream. ok is false
// if the bytes are not a TLS ClientHello crypto/tls would accept as far as
// its server name. The parse is cryptobyte's primitives (the parser
// crypto/tls is built on) under rules mirrored one by one from crypto/tls
// (clienthello.go); FuzzClientHelloPeek holds its verdict and name equal
// to those of the throwaway tls.Server handshake it replaced, which cost
// 6.5x its time on every new tunnel (docs/egress.md, "The ClientHello
// gate").
func peekClientHello(conn net.Conn, pre []byte) (hello peekedHello, raw []byte, ok bool) {
	_ = conn.SetReadDeadline(time.Now().Add(handshakeTimeout))
	defer conn.SetReadDeadline(time.Time{})
	return readClientHello(conn, pre)
}

// openTunnel is the first stage of an allowed, non-intercepted CONNECT,
// run once the agent has its 200: it dials the vetted address (while the
// agent builds its ClientHello), checks that the client's TLS SNI names the
// CONNECT host (a tunnel carries TLS to the host the policy allowed,
// nothing else: no plain bytes, no fronting), replays the ClientHello and
// writes the open record. No byte goes upstream before the SNI check
// passes; a refused tunnel closes the upstream connection unused. Then it
// passes the server's first handshake message to the agent, and if that
// is a HelloRetryRequest, judges the second ClientHello as the first
// before it goes up. sent and got are the bytes moved each way; when ok
// is false the refusal has been audited and nothing is left open but conn.
func (g *Gateway) openTunnel(conn net.Conn, pre []byte, t *target, rec audit.Record, start time.Time) (up net.Conn, sent, got int64, ok bool) {
	refuse := func(rule, reason string, out int64) {
		if up != nil {
			up.Close()
		}
		rec.Decision, rec.Rule, rec.Reason = audit.Blocked, rule, reason
		rec.BytesOut = out
		rec.DurationMS = time.Since(start).Milliseconds()
		g.logAudit(rec)
	}
	up, err := g.dial(context.Background(), t.st, t.dst)
	if err != nil {
		refuse("dial", "dial upstream: "+err.Error(), 0)
		return nil, 0, 0, false
	}
	peeked, hello, isTLS := peekClientHello(conn, pre)
	sni := peeked.sni
	if rule, reason := helloRefusal(peeked, isTLS, t.host); rule != "" {
		refuse(rule, reason, int64(len(hello)))
		return nil, 0, 0, false
	}
	switch {
	case t.literal:
		rule, reason, ok := g.decideBenchSNI(t, policy.Normalize(sni))
		if !ok {
			refuse(rule, reason, int64(len(hello)))
			return nil, 0, 0, false
		}
		t.rule, rec.Rule = rule, rule
	case policy.Normalize(sni) != t.host:
		refuse("sni-mismatch", fmt.Sprintf("TLS SNI %q does not match CONNECT host %q (domain fronting)", sni, t.host), int64(len(hello)))
		return nil, 0, 0, false
	}
	// Only the ClientHello's records go up now; what the agent sent past
	// them waits for the server's answer.
	rest := hello[peeked.records:]
	if _, err := up.Write(hello[:peeked.records]); err != nil {
		refuse("dial", "write upstream: "+err.Error(), 0)
		return nil, 0, 0, false
	}
	sent = int64(peeked.records)
	// A HelloRetryRequest makes the client send a second ClientHello in
	// the clear, and OpenSSL (so nginx, HAProxy, ...) acts on its server
	// name even when it differs from the first one's (crypto/tls refuses
	// the change): it is judged as the first was, and must name the same
	// host.
	back, retry := peekServerHello(up)
	if _, err := conn.Write(back); err != nil {
		refuse("dial", "write to agent: "+err.Error(), sent)
		return nil, 0, 0, false
	}
	got = int64(len(back))
	if retry {
		peeked2, hello2, isTLS2 := peekRetryHello(conn, rest)
		rule, reason := helloRefusal(peeked2, isTLS2, t.host)
		if rule == "" && policy.Normalize(peeked2.sni) != policy.Normalize(sni) {
			rule, reason = "sni-mismatch", fmt.Sprintf("second TLS ClientHello (after the server's HelloRetryRequest) names %q, the first %q: the server name must not change (domain fronting)", peeked2.sni, sni)
		}
		if rule != "" {
			refuse(rule, "after HelloRetryRequest: "+reason, sent)
			return nil, 0, 0, false
		}
		rest = hello2
	}
	if _, err := up.Write(rest); err != nil {
		refuse("dial", "write upstream: "+err.Error(), sent)
		return nil, 0, 0, false
	}
	sent += int64(len(rest))
	// From here the tunnel carries bytes: the open record is written
	// first, so a gateway killed mid-tunnel still leaves it.
	g.logOpen(rec, t, "tunnel to "+t.host+" opened", start)
	return up, sent, got, true
}

// helloRefusal is the rule and reason refusing a ClientHello whatever
// the CONNECT host (host names it in the reason), or "".
func helloRefusal(p peekedHello, isTLS bool, host string) (rule, reason string) {
	switch {
	case !isTLS:
		return "not-tls", "tunnel payload is not a TLS ClientHello; tunnels carry TLS only"
	case p.sni == "":
		return "sni-missing", "TLS ClientHello without SNI; the server name must match the CONNECT host"
	case p.ech:
		// The SNI seen is the outer one; a server with the ECH key serves
		// the inner name instead, whatever the outer says (fronting by
		// design). Stripping ech from DNS answers (docs/egress.md) does
		// not stop an agent that brings its own ECHConfigList.
		return "ech", fmt.Sprintf("TLS ClientHello offers Encrypted ClientHello (outer SNI %q): the server may act on an encrypted inner server name the gateway cannot check against the CONNECT host; turn ECH off in the client (curl --ech false, Chrome --disable-features=EncryptedClientHello)", p.sni)
	case !asciiHostName(p.sni):
		// Normalize lowercases Unicode: U+212A KELVIN SIGN becomes "k",
		// so "\u212aiosk.example.com" would pass for kiosk.example.com
		// while the server, matching names bytewise or by ASCII case,
		// serves another (its default) name.
		return "sni-mismatch", fmt.Sprintf("TLS SNI %q is not an ASCII host name (RFC 6066: internationalized names are sent as xn-- A-labels), so it cannot name CONNECT host %q", p.sni, host)
	}
	return "", ""
}

// peekRetryHello is peekClientHello for the second ClientHello.
func peekRetryHello(conn net.Conn, pre []byte) (hello peekedHello, raw []byte, ok bool) {
	_ = conn.SetReadDeadline(time.Now().Add(handshakeTimeout))
	defer conn.SetReadDeadline(time.Time{})
	return readRetryHello(conn, pre)
}

// peekServerHello reads the upstream's first handshake message (within
// the handshake timeout) and reports whether it is a HelloRetryRequest.
func peekServerHello(up net.Conn) (raw []byte, retry bool) {
	_ = up.SetReadDeadline(time.Now().Add(handshakeTimeout))
	defer up.SetReadDeadline(time.Time{})
	return readServerHello(up)
}

// relay is the second stage: it copies both ways until the tunnel ends and
// writes the close record with bytes and duration. It keeps no buffer of
// its own (the ClientHello is not referenced past openTunnel).
func (g *Gateway) relay(conn, up net.Conn, t *target, rec audit.Record, start time.Time, sent, got int64, lt *liveTunnel) {
	lt.relaying(up)
	out, in, err := splice(conn, up, t.st.idle)
	reason := "tunnel to " + t.host + " closed"
	if errors.Is(err, errIdle) {
		reason = "tunnel to " + t.host + " closed after idle timeout"
	}
	if why := lt.banReason(); why != "" {
		reason = "tunnel to " + t.host + " closed: " + why
	}
	rec.Event, rec.Decision, rec.Rule, rec.Reason = audit.EventClose, audit.Allowed, t.rule, withNote(rec.Reason, reason)
	rec.BytesOut, rec.BytesIn = out+sent, in+got
	rec.DurationMS = time.Since(start).Milliseconds()
	g.logAudit(rec)
}

var errIdle = errors.New("idle timeout")

// asciiHostName reports whether name is printable ASCII without spaces,
// the only bytes a host name in SNI has (RFC 6066, Section 3), so that
// policy.Normalize on it is ASCII case folding, as servers match names.
func asciiHostName(name string) bool {
	for i := 0; i < len(name); i++ {
		if name[i] <= ' ' || name[i] >= 0x7f {
			return false
		}
	}
	return true
}

// logOpen writes the open record of an allowed tunnel (intercepted or
// not); its close record follows with bytes and duration.
func (g *Gateway) logOpen(rec audit.Record, t *target, reason string, start time.Time) {
	rec.Event, rec.Decision, rec.Rule, rec.Reason = audit.EventOpen, audit.Allowed, t.rule, withNote(rec.Reason, reason)
	rec.DurationMS = time.Since(start).Milliseconds()
	g.logAudit(rec)
}

// splice copies both ways until both sides are done or the tunnel has been
// idle (no byte in either direction) for idle.
func splice(client, up net.Conn, idle time.Duration) (out, in int64, err error) {
	var last atomic.Int64
	last.Store(time.Now().UnixNano())
	// One direction runs on the caller's goroutine: a held tunnel costs
	// one extra goroutine, not two.
	var errOut, errIn error
	done := make(chan struct{})
	go func() {
		defer close(done)
		out, errOut = pipe(up, client, idle, &last)
		closeWrite(up)
		if errOut != nil {
			client.Close()
			up.Close()
		}
	}()
	in, errIn = pipe(client, up, idle, &last)
	closeWrite(client)
	if errIn != nil {
		client.Close()
		up.Close()
	}
	<-done
	if errors.Is(errOut, errIdle) || errors.Is(errIn, errIdle) {
		return out, in, errIdle
	}
	return out, in, errors.Join(notClosed(errOut), notClosed(errIn))
}

// notClosed drops net.ErrClosed: a connection closed on this side (the
// other direction's end, or a ban cutting the tunnel) ends a direction
// without an error.
func notClosed(err error) error {
	if errors.Is(err, net.ErrClosed) {
		return nil
	}
	return err
}

// pipe copies src to dst until src's EOF, an error, or idle without a
// byte either way (last is the latest byte in either direction). Waiting
// counts against idle whether it waits for src to send or for dst to
// read: src's read deadline and dst's write deadline are armed together,
// once, and when one fires both are re-armed from last. (A deadline costs a
// timer update, so they are not refreshed per read; the loop before
// refreshed the read deadline per 1 MiB chunk and had no write deadline,
// so a tunnel whose receiver stopped reading never went idle.)
func pipe(dst, src net.Conn, idle time.Duration, last *atomic.Int64) (int64, error) {
	arm := func(at time.Time) {
		_ = src.SetReadDeadline(at)
		_ = dst.SetWriteDeadline(at)
	}
	arm(time.Now().Add(idle))
	step, release := copier(dst, src, last)
	defer func() { release() }()
	var total int64
	for {
		n, err := step()
		total += n
		if n > 0 {
			last.Store(time.Now().UnixNano())
		}
		switch {
		case err == nil:
			continue
		case errors.Is(err, errNoPipe):
			// At the descriptor limit with no free pipe: nothing was
			// read, so this direction goes on with read/write.
			release()
			step, release = bufCopier(dst, src)
			continue
		case errors.Is(err, io.EOF):
			return total, nil
		case errors.Is(err, os.ErrDeadlineExceeded):
			at := time.Unix(0, last.Load())
			if time.Since(at) < idle {
				arm(at.Add(idle))
				continue
			}
			return total, errIdle
		default:
			// net.ErrClosed too: a ban closed one of the connections
			// (bans.go: cut), and splice closes the other, so the
			// direction still waiting ends now, not when the peer
			// next sends.
			return total, err
		}
	}
}

// copier returns the step pipe repeats, and what to call when pipe ends:
// a step waits until src has bytes and moves what it has to dst, returning
// how many reached dst; one cut short by a deadline keeps the bytes it has
// not written for the next step. Between two sockets that is splice(2)
// through a pipe from a small shared pool (splicer); otherwise (a
// connection that is not a socket, as tests' net.Pipe) read/write through
// a buffer of respond.go's pool, held while it waits: sockets hold nothing
// while they wait.
func copier(dst, src net.Conn, last *atomic.Int64) (step func() (int64, error), release func()) {
	if s, ok := newSplicer(dst, src, last); ok {
		return s.step, s.release
	}
	return bufCopier(dst, src)
}

// bufCopier is copier's read/write step.
func bufCopier(dst, src net.Conn) (step func() (int64, error), release func()) {
	var bp *[]byte
	var pending []byte
	release = func() {
		if bp != nil {
			copyBufs.Put(bp)
			bp, pending = nil, nil
		}
	}
	return func() (int64, error) {
		var rerr error
		if len(pending) == 0 {
			bp = copyBufs.Get().(*[]byte)
			var n int
			n, rerr = src.Read(*bp)
			if n == 0 {
				release()
				if rerr == nil {
					rerr = io.ErrNoProgress
				}
				return 0, rerr
			}
			pending = (*bp)[:n]
		}
		w, werr := dst.Write(pending)
		pending = pending[w:]
		if len(pending) == 0 {
			release()
		}
		if werr != nil {
			return int64(w), werr
		}
		return int64(w), rerr
	}, release
}

func closeWrite(c net.Conn) {
	if cw, ok := c.(interface{ CloseWrite() error }); ok {
		_ = cw.CloseWrite()
	}
}
