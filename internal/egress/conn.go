package egress

import (
	"bytes"
	"context"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nixcage/nixcage/internal/egress/audit"
)

// auditListener wraps the proxy listener so that connections refused by
// net/http itself, before any handler runs (headers over the hard cap,
// malformed requests, clients too slow to send a request header), still
// produce an audit record: every decision is audited, not only the ones the
// policy code makes.
type auditListener struct {
	net.Listener
	g *Gateway
}

// ProxyListener wraps l for NewProxyServer.
func (g *Gateway) ProxyListener(l net.Listener) net.Listener {
	return &auditListener{Listener: l, g: g}
}

func (l *auditListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err != nil {
		return nil, err
	}
	return &auditConn{Conn: c, g: l.g, start: time.Now()}, nil
}

// auditConn tracks whether a handler ever saw a request on the connection.
type auditConn struct {
	net.Conn
	g       *Gateway
	start   time.Time
	served  atomic.Bool // a handler ran: the policy code audits from here
	read    atomic.Int64
	logOnce sync.Once
}

type connKey struct{}

func (c *auditConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	c.read.Add(int64(n))
	return n, err
}

func (c *auditConn) Write(p []byte) (int, error) {
	if !c.served.Load() && bytes.HasPrefix(p, []byte("HTTP/1.")) && len(p) > 12 && (p[9] == '4' || p[9] == '5') {
		line := p
		if i := bytes.IndexByte(p, '\r'); i > 0 {
			line = p[:i]
		}
		c.audit("http-protocol", "refused by the HTTP server before the policy ran: "+string(line))
	}
	return c.Conn.Write(p)
}

func (c *auditConn) Close() error {
	if !c.served.Load() && c.read.Load() > 0 {
		c.audit("header-timeout", "connection closed after "+strconv.FormatInt(c.read.Load(), 10)+" bytes without a complete request header (slow client or header timeout)")
	}
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

// rawConn unwraps an auditConn so tunnels splice between kernel sockets.
func rawConn(c net.Conn) net.Conn {
	if ac, ok := c.(*auditConn); ok {
		return ac.Conn
	}
	return c
}

func connContext(ctx context.Context, c net.Conn) context.Context {
	return context.WithValue(ctx, connKey{}, c)
}
