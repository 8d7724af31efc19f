package egress

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nixcage/nixcage/internal/egress/audit"
	"github.com/nixcage/nixcage/internal/policy"
)

// countConn counts bytes through a connection.
type countConn struct {
	net.Conn
	in, out atomic.Int64
}

func (c *countConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	c.out.Add(int64(n)) // bytes the agent sent
	return n, err
}

func (c *countConn) Write(p []byte) (int, error) {
	n, err := c.Conn.Write(p)
	c.in.Add(int64(n))
	return n, err
}

// oneConnListener hands out one connection, then blocks until it is done.
type oneConnListener struct {
	conn net.Conn
	once sync.Once
	done chan struct{}
}

func (l *oneConnListener) Accept() (net.Conn, error) {
	var c net.Conn
	l.once.Do(func() { c = l.conn })
	if c != nil {
		return c, nil
	}
	<-l.done
	return nil, net.ErrClosed
}
func (l *oneConnListener) Close() error   { return nil }
func (l *oneConnListener) Addr() net.Addr { return l.conn.LocalAddr() }

// intercept terminates the agent's TLS with a leaf from the cage CA and
// serves the requests inside through the inspection pipeline.
func (g *Gateway) intercept(raw net.Conn, pre []byte, t *target, rec audit.Record, start time.Time) {
	cc := &countConn{Conn: withPrefix(raw, pre)}
	var sniErr error
	conf := &tls.Config{
		MinVersion: tls.VersionTLS12,
		NextProtos: []string{"h2", "http/1.1"},
		GetCertificate: func(h *tls.ClientHelloInfo) (*tls.Certificate, error) {
			if h.ServerName != "" && policy.Normalize(h.ServerName) != t.host {
				sniErr = fmt.Errorf("TLS SNI %q does not match CONNECT host %q (domain fronting)", h.ServerName, t.host)
				return nil, sniErr
			}
			return g.opts.CA.Leaf(t.host)
		},
	}
	tc := tls.Server(cc, conf)
	ctx, cancel := context.WithTimeout(context.Background(), handshakeTimeout)
	// The handshake is CPU work (the leaf's signature, the key exchange):
	// several at once get every P.
	g.opts.Procs.Begin()
	err := tc.HandshakeContext(ctx)
	g.opts.Procs.End()
	cancel()
	finish := func(decision, rule, reason string) {
		rec.Decision, rec.Rule, rec.Reason = decision, rule, withNote(rec.Reason, reason)
		rec.BytesOut, rec.BytesIn = cc.out.Load(), cc.in.Load()
		rec.DurationMS = time.Since(start).Milliseconds()
		g.logAudit(rec)
	}
	if err != nil {
		if sniErr != nil {
			finish(audit.Blocked, "sni-mismatch", sniErr.Error())
		} else {
			finish(audit.Blocked, "tls-handshake", "TLS handshake with the agent failed (does it trust the cage CA?): "+err.Error())
		}
		return
	}
	g.logOpen(rec, t, "intercepted tunnel to "+t.host+" opened", start)
	rec.Event = audit.EventClose
	h2 := tc.ConnectionState().NegotiatedProtocol == "h2"
	// HTTP/1.1 requests go upstream on the tunnel's own connection
	// (upstream.go), which learns from agentConn that the agent left;
	// HTTP/2 streams through the multiplexing Transport (net/http serves
	// HTTP/2 only on a *tls.Conn, and cancels each stream's context).
	var served net.Conn = tc
	var up http.RoundTripper = g.h2
	var ucl *tunnelClient
	var rc *tunnelRefusals
	if !h2 {
		ucl = g.newTunnelClient()
		defer ucl.close()
		up = ucl
		rc = &tunnelRefusals{agentConn: &agentConn{Conn: tc, gone: ucl.agentGone}, g: g, t: t, start: time.Now()}
		served = rc
	}
	l := &oneConnListener{conn: served, done: make(chan struct{})}
	var closeOnce sync.Once
	// A hijacked connection (a WebSocket relay) is done when its handler
	// returns, not when net/http lets go of it.
	var hijacked atomic.Bool
	srv := &http.Server{
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			rc.handling()
			g.serveInner(w, r, t, h2, up)
			if hijacked.Load() {
				closeOnce.Do(func() { close(l.done) })
			}
		}),
		ReadHeaderTimeout: headerTimeout,
		IdleTimeout:       t.st.idle,
		MaxHeaderBytes:    t.st.maxHeader + 4096,
		ConnState: func(_ net.Conn, s http.ConnState) {
			switch s {
			case http.StateIdle:
				rc.idle()
			case http.StateHijacked:
				hijacked.Store(true)
			case http.StateClosed:
				closeOnce.Do(func() { close(l.done) })
			}
		},
	}
	var p http.Protocols
	p.SetHTTP1(true)
	p.SetHTTP2(true)
	srv.Protocols = &p
	srv.HTTP2 = h2Limits
	if h2 {
		conf := *h2Limits
		conf.CountError = func(errType string) { g.auditH2Error(t, errType) }
		srv.HTTP2 = &conf
	}
	if err := srv.Serve(l); err != nil && !errors.Is(err, net.ErrClosed) {
		g.log.Debug("intercepted connection ended", "host", t.host, "err", err)
	}
	// The upstream connection is free for the next tunnel before the
	// close record says this one ended.
	if ucl != nil {
		ucl.close()
	}
	finish(audit.Allowed, t.rule, "intercepted tunnel to "+t.host+" closed")
}

// tunnelRefusals is the agent's side of an intercepted HTTP/1.1 tunnel as
// net/http's server sees it: it audits what net/http answers itself,
// before any handler runs (431 for a head over the limit, 400 for a
// malformed request line or header, 417, 501), as auditConn does on the
// proxy listener, but per request: a tunnel carries many, and a refusal
// may follow requests the policy code served. A nil *tunnelRefusals (an
// HTTP/2 tunnel, served on the *tls.Conn itself) does nothing.
type tunnelRefusals struct {
	*agentConn // keeps CloseWrite, which net/http's lingering close uses
	g          *Gateway
	t          *target
	start      time.Time   // of the current request's wait
	inRequest  atomic.Bool // a handler runs or its response is being flushed
	logged     atomic.Bool // the current request's refusal is audited
}

// handling is called as a handler starts: the policy code audits this
// request.
func (c *tunnelRefusals) handling() {
	if c != nil {
		c.inRequest.Store(true)
	}
}

// idle is called when net/http has finished a request (response flushed)
// and waits for the next one, which may be refused before a handler runs.
func (c *tunnelRefusals) idle() {
	if c != nil {
		c.start = time.Now()
		c.inRequest.Store(false)
		c.logged.Store(false)
	}
}

func (c *tunnelRefusals) Write(p []byte) (int, error) {
	if !c.inRequest.Load() {
		if line, ok := refusalLine(p); ok && !c.logged.Swap(true) {
			c.g.logAudit(audit.Record{Decision: audit.Blocked, Rule: "http-protocol", Host: c.t.host, Port: c.t.port,
				Reason:     "refused by the HTTP server inside the intercepted tunnel before the policy ran: " + line,
				DurationMS: time.Since(c.start).Milliseconds()})
		}
	}
	return c.agentConn.Write(p)
}

// auditH2Error audits what net/http's HTTP/2 server refuses itself inside
// an intercepted tunnel, as tunnelRefusals does for HTTP/1.1: it calls
// HTTP2Config.CountError once per error it answers. Audited: connection
// errors (a GOAWAY: "conn_*" and the framer's "frame_*") and streams reset
// with PROTOCOL_ERROR (a malformed request: no :path, a bad CONNECT, bogus
// trailers, over the stream limit). Not audited: STREAM_CLOSED, FLOW_CONTROL
// and REFUSED_STREAM resets, which an honest client meets in a race (DATA
// still in flight for a stream a refusal ended), and a lost ping (the agent
// is gone). The 431 for a header block over the limit and the GOAWAY for
// one far over it are not counted by net/http (no hook): not audited.
func (g *Gateway) auditH2Error(t *target, errType string) {
	if !strings.HasPrefix(errType, "conn_") && !strings.HasPrefix(errType, "frame_") && !strings.HasPrefix(errType, "stream_PROTOCOL_ERROR_") || errType == "conn_close_lost_ping" {
		return
	}
	g.logAudit(audit.Record{Decision: audit.Blocked, Rule: "http-protocol", Host: t.host, Port: t.port,
		Reason: "refused by the HTTP/2 server inside the intercepted tunnel before the policy ran: " + errType})
}

// serveInner handles one request inside an intercepted tunnel.
// up is the upstream client for the tunnel's requests.
func (g *Gateway) serveInner(w http.ResponseWriter, r *http.Request, t *target, h2 bool, up http.RoundTripper) {
	// An intercepted request is CPU work (TLS both ways, inspection):
	// two in flight get every P.
	g.opts.Procs.Begin()
	defer g.opts.Procs.End()
	start := time.Now()
	rec := audit.Record{Method: r.Method, Host: t.host, Port: t.port, Path: r.URL.Path, Rule: t.rule}
	if r.Method == http.MethodConnect {
		g.refuse(w, r, rec, block(http.StatusForbidden, "connect-in-connect", "CONNECT inside a tunnel is not allowed"), start)
		return
	}
	if r.RequestURI != "*" && len(r.RequestURI) > 0 && r.RequestURI[0] != '/' && !h2 {
		g.refuse(w, r, rec, block(http.StatusForbidden, "proxy-chaining", "absolute-form request inside a tunnel (proxy chaining) is not allowed"), start)
		return
	}
	host, port, err := splitAuthority(r.Host, t.port)
	if err != nil || host != t.host || port != t.port {
		g.refuse(w, r, rec, block(http.StatusMisdirectedRequest, "host-mismatch", "Host %q does not match CONNECT authority %s (domain fronting)", r.Host, hostPort(t.host, t.port)), start)
		return
	}
	// Re-read the state: a reload between requests in a long tunnel applies
	// to the next request (a newly denied host stops here).
	st := g.st.Load()
	// A learned tunnel is decided again per request, so the end of the
	// learn window refuses the next request inside it.
	if st != t.st || t.rule == policy.RuleLearn {
		dec := g.decide(st, t.host, t.port, http.MethodConnect)
		if dec.Result != policy.Allow {
			g.refuse(w, r, rec, block(http.StatusForbidden, dec.Rule, "%s", dec.Reason), start)
			return
		}
		nt := *t
		nt.st, nt.rule = st, dec.Rule
		t = &nt
		rec.Rule = t.rule
	}
	// A ban applies to the next request of an open intercepted tunnel.
	if dec, ok := g.bannedTarget(t); ok {
		g.refuse(w, r, rec, block(http.StatusForbidden, dec.Rule, "%s", dec.Reason), start)
		return
	}
	if !t.st.limiter.allow(t.host) {
		g.refuse(w, r, rec, block(http.StatusTooManyRequests, "rate-limit", "rate limit for %s exceeded", t.host), start)
		return
	}
	if h2 {
		// Each HTTP/2 stream holds gateway memory like a connection does,
		// so it takes a slot of its own (the tunnel holds one already).
		release, n, limit, ok := g.acquire()
		if !ok {
			g.refuse(w, r, rec, block(http.StatusServiceUnavailable, "max-tunnels", "%d connections and streams open, limit %d", n, limit), start)
			return
		}
		defer release()
	}
	defer g.limitBody(w, r, t.st)()
	g.forwardWith(w, r, t, rec, start, up, "https")
}
