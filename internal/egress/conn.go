package egress

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nixcage/nixcage/internal/egress/audit"
)

// ProxyListener wraps l for NewProxyServer: the front end (front.go)
// accepts every connection, serves CONNECT tunnels itself and hands the
// rest to the server through its Accept. Every connection takes a slot at
// accept (max_tunnels counts plain-HTTP connections, CONNECT tunnels and
// HTTP/2 streams alike, so no path holds gateway memory uncounted); one
// over the cap gets a 503 and is closed. Each is an auditConn, so that a
// connection refused before the policy code runs (a malformed or
// oversized head, a client too slow to send one), by the front end or by
// net/http, still produces an audit record: every decision is audited,
// not only the ones the policy code makes.
func (g *Gateway) ProxyListener(l net.Listener) net.Listener {
	return &frontListener{Listener: l, g: g, conns: make(chan net.Conn), done: make(chan struct{})}
}

// acquire takes one of the max_tunnels slots; release gives it back (once).
// n is how many were held when a slot was refused.
func (g *Gateway) acquire() (release func(), n int64, limit int, ok bool) {
	limit = g.st.Load().maxTun
	if n := g.held.Add(1); n > int64(limit) {
		g.held.Add(-1)
		return nil, n - 1, limit, false
	}
	var once sync.Once
	return func() { once.Do(func() { g.held.Add(-1) }) }, 0, limit, true
}

// maxRefusers bounds the goroutines answering connections over the cap; a
// flood beyond it is closed without an answer (still counted in the audit).
const maxRefusers = 32

var refuseBody = "nixcage egress: blocked: %d connections and streams open, limit %d (max_tunnels); close some or raise limits.max_tunnels\n"

// refuseConn answers a connection over the cap with a 503 and an audit
// record (budgeted: a connection flood is what the cap is for).
func (g *Gateway) refuseConn(c net.Conn, n int64, limit int) {
	reason := fmt.Sprintf("%d connections and streams open, limit %d", n, limit)
	_ = g.opts.Audit.LogBudgeted(audit.ClassCap, audit.Record{Decision: audit.Blocked, Rule: "max-tunnels", Reason: reason})
	if g.refusers.Add(1) > maxRefusers {
		g.refusers.Add(-1)
		c.Close()
		return
	}
	go func() {
		defer g.refusers.Add(-1)
		defer c.Close()
		body := fmt.Sprintf(refuseBody, n, limit)
		_ = c.SetDeadline(time.Now().Add(2 * time.Second))
		// Answer a request, not the connection: a 503 written before the
		// client has sent its request head is an "unsolicited response" to
		// an HTTP client (Go's transport drops it and fails the request;
		// seen as a flake in checks/fresh.sh). Wait for the head, bounded in
		// bytes and by the deadline above; a client that sends none gets
		// the 503 when the wait ends.
		readHead(c, 8<<10)
		fmt.Fprintf(c, "HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\nX-Nixcage-Egress: blocked\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
		// Read what the client sent before closing, so the kernel does not
		// answer it with a reset that discards the 503.
		closeWrite(c)
		_, _ = io.Copy(io.Discard, io.LimitReader(c, 64<<10))
	}()
}

// readHead reads from c until the end of an HTTP request head (a blank
// line) or max bytes, whichever comes first, or until c's deadline.
func readHead(c net.Conn, max int) {
	buf := make([]byte, 0, 1024)
	tmp := make([]byte, 1024)
	for len(buf) < max {
		n, err := c.Read(tmp)
		buf = append(buf, tmp[:n]...)
		if bytes.Contains(buf, []byte("\r\n\r\n")) || err != nil {
			return
		}
	}
}

// auditConn tracks whether a handler ever saw a request on the connection.
type auditConn struct {
	net.Conn
	g       *Gateway
	start   time.Time
	served  atomic.Bool // a handler ran: the policy code audits from here
	read    atomic.Int64
	logOnce sync.Once
	release func() // gives back the connection's slot; idempotent
	// pre is what the front end read before handing the connection to
	// net/http: replayed first, not counted again.
	pre []byte
}

type connKey struct{}

func (c *auditConn) Read(p []byte) (int, error) {
	if len(c.pre) > 0 {
		n := copy(p, c.pre)
		c.pre = c.pre[n:]
		return n, nil
	}
	n, err := c.Conn.Read(p)
	c.read.Add(int64(n))
	return n, err
}

func (c *auditConn) Write(p []byte) (int, error) {
	if !c.served.Load() {
		if line, ok := refusalLine(p); ok {
			c.audit("http-protocol", "refused by the HTTP server before the policy ran: "+line)
		}
	}
	return c.Conn.Write(p)
}

// refusalLine reports whether p, written to a connection while no handler
// runs, is net/http answering a request itself (an error status line),
// and returns that line. net/http writes such an answer in one Write.
func refusalLine(p []byte) (string, bool) {
	if !bytes.HasPrefix(p, []byte("HTTP/1.")) || len(p) <= 12 || (p[9] != '4' && p[9] != '5') {
		return "", false
	}
	line := p
	if i := bytes.IndexByte(p, '\r'); i > 0 {
		line = p[:i]
	}
	return string(line), true
}

func (c *auditConn) Close() error {
	if !c.served.Load() && c.read.Load() > 0 {
		c.audit("header-timeout", "connection closed after "+strconv.FormatInt(c.read.Load(), 10)+" bytes without a complete request header (slow client or header timeout)")
	}
	c.release()
	return c.Conn.Close()
}

func (c *auditConn) audit(rule, reason string) {
	c.logOnce.Do(func() {
		c.g.logAudit(audit.Record{Decision: audit.Blocked, Rule: rule, Reason: reason, BytesOut: c.read.Load(), DurationMS: time.Since(c.start).Milliseconds()})
	})
}

// markServed is called by the handler: from here on the policy code
// writes the records for this connection.
func markServed(ctx context.Context) {
	if c, ok := ctx.Value(connKey{}).(*auditConn); ok {
		c.served.Store(true)
	}
}

// rawConn unwraps an auditConn so tunnels splice between kernel sockets,
// and hands over its slot: release must be called when the tunnel ends.
func rawConn(c net.Conn) (raw net.Conn, release func()) {
	if ac, ok := c.(*auditConn); ok {
		return withPrefix(ac.Conn, ac.pre), ac.release
	}
	return c, func() {}
}

func connContext(ctx context.Context, c net.Conn) context.Context {
	return context.WithValue(ctx, connKey{}, c)
}
