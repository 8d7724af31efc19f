package egress

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"strings"
	"time"

	"github.com/nixcage/nixcage/internal/egress/audit"
	"github.com/nixcage/nixcage/internal/egress/dnsfilter"
	"github.com/nixcage/nixcage/internal/policy"
)

// Handler returns the HTTP handler of the proxy listener.
func (g *Gateway) Handler() http.Handler { return http.HandlerFunc(g.serveProxy) }

// NewProxyServer is the http.Server for a proxy listener. Header limits and
// timeouts come from the policy in force at start; a slow client that does not
// finish its request header in time is dropped.
func (g *Gateway) NewProxyServer() *http.Server {
	st := g.st.Load()
	return &http.Server{
		Handler:           g.Handler(),
		ReadHeaderTimeout: min(headerTimeout, st.idle),
		IdleTimeout:       st.idle,
		// The handler enforces the policy limit with an audit record; this
		// is the hard cap for headers too large to even parse.
		MaxHeaderBytes: st.maxHeader + 4096,
		ConnContext:    connContext,
	}
}

// chainingHeaders ask a proxy to forward to another proxy or carry a hop
// history: a cage has exactly one hop.
var chainingHeaders = []string{"Via", "Forwarded", "X-Forwarded-For", "X-Forwarded-Host", "X-Forwarded-Proto", "Max-Forwards"}

// chainingBlock refuses a request that carries a chaining header, with
// any value: Header.Get reads only the first line, and an empty first
// line must not hide a second one, which would be forwarded (the upstream
// reads "X-Forwarded-Host: ,evil.test").
func chainingBlock(hdr http.Header) *blockedErr {
	for _, h := range chainingHeaders {
		if len(hdr.Values(h)) > 0 {
			return block(http.StatusForbidden, "proxy-chaining", "header %s: proxy chaining is not allowed", h)
		}
	}
	return nil
}

// hopHeaders are removed before forwarding (RFC 9110 §7.6.1 plus proxy ones).
var hopHeaders = []string{"Connection", "Proxy-Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "Te", "Trailer", "Transfer-Encoding", "Upgrade"}

// delHop removes the hop-by-hop headers from h. Each name above is in
// canonical form, so this is h.Del(name) without canonicalizing it again
// on every request.
func delHop(h http.Header) {
	for _, k := range hopHeaders {
		delete(h, k)
	}
}

// blockedErr is a refusal with its HTTP status, reason and rule.
type blockedErr struct {
	status int
	reason string
	rule   string
}

func (b *blockedErr) Error() string { return b.reason }

func block(status int, rule, format string, args ...any) *blockedErr {
	return &blockedErr{status: status, reason: fmt.Sprintf(format, args...), rule: rule}
}

// logAudit writes rec. A refusal is made at once, on a new connection if
// the agent likes, so refusals are budgeted (audit.RefusalBudget): a flood
// of them cannot push the one that mattered out of the bounded views of
// the log. A tunnel's close record is never budgeted: its open record was
// written and an open without a close reads as a crashed gateway.
func (g *Gateway) logAudit(rec audit.Record) {
	learned(&rec)
	log := g.opts.Audit.Log
	if rec.Decision == audit.Blocked && rec.Event != audit.EventClose {
		log = func(r audit.Record) error { return g.opts.Audit.LogBudgeted(audit.ClassRefusal, r) }
	}
	if err := log(rec); err != nil {
		g.log.Error("audit write failed", "err", err)
	}
}

func (g *Gateway) serveProxy(w http.ResponseWriter, r *http.Request) {
	start := time.Now()
	markServed(r.Context())
	st := g.st.Load()
	if r.Method == http.MethodConnect {
		g.handleConnect(w, r, st, start)
		return
	}
	rec := audit.Record{Method: r.Method, Path: r.URL.Path}
	if !r.URL.IsAbs() {
		rec.Host = r.Host
		g.refuse(w, r, rec, block(http.StatusBadRequest, "not-a-proxy-request", "this is a forward proxy: send absolute-form requests (http://host/...) or CONNECT"), start)
		return
	}
	if r.URL.Scheme != "http" {
		rec.Host = r.URL.Hostname()
		g.refuse(w, r, rec, block(http.StatusBadRequest, "scheme", "scheme %q: use CONNECT for https", r.URL.Scheme), start)
		return
	}
	host, port, err := splitAuthority(r.URL.Host, policy.DefaultHTTPPort)
	rec.Host, rec.Port = host, port
	if err != nil {
		g.refuse(w, r, rec, block(http.StatusBadRequest, "authority", "%v", err), start)
		return
	}
	dec, b := g.admit(r.Context(), st, g.decide(st, host, port, r.Method), host, port, r.Method, r.URL.Path)
	if b != nil {
		g.refuse(w, r, rec, b, start)
		return
	}
	rec.Reason = approvedBy(dec)
	rec.Rule = dec.Rule
	dst, aliases, err := g.resolve(r.Context(), st, host, port, dec.Rule)
	if err != nil {
		g.refuse(w, r, rec, resolveBlock(err), start)
		return
	}
	t := &target{st: st, host: host, port: port, dst: dst, aliases: aliases, rule: dec.Rule}
	defer g.limitBody(w, r, t.st)()
	g.opts.Procs.Begin()
	defer g.opts.Procs.End()
	g.forward(w, r, t, rec, start)
}

func resolveBlock(err error) *blockedErr {
	var ref errRefused
	var dec errDecided
	if errors.As(err, &dec) {
		return block(http.StatusForbidden, dec.d.Rule, "%s", dec.d.Reason)
	}
	if errors.Is(err, dnsfilter.ErrLookupRate) {
		return block(http.StatusTooManyRequests, dnsfilter.RuleRateLimit, "%v", err)
	}
	if errors.As(err, &ref) {
		return block(http.StatusForbidden, "address", "%v", err)
	}
	return block(http.StatusBadGateway, "resolve", "%v", err)
}

// splitAuthority parses host[:port], normalizing the host.
func splitAuthority(auth string, defPort int) (string, int, error) {
	host, ps, err := net.SplitHostPort(auth)
	if err != nil {
		host, ps = auth, strconv.Itoa(defPort)
		if strings.Count(auth, ":") > 0 && !strings.HasPrefix(auth, "[") {
			return "", 0, fmt.Errorf("authority %q: want host:port", auth)
		}
		host = strings.TrimSuffix(strings.TrimPrefix(host, "["), "]")
	}
	port, err := strconv.Atoi(ps)
	if err != nil || port < 1 || port > 65535 {
		return "", 0, fmt.Errorf("authority %q: bad port", auth)
	}
	if host == "" {
		return "", 0, fmt.Errorf("authority %q: empty host", auth)
	}
	return policy.Normalize(host), port, nil
}

// handleConnect is a CONNECT that reached net/http's server: one sent on
// a connection that carried a plain request first (the front end reads
// only a connection's first request, front.go). Decided and run exactly
// like one from the front end.
func (g *Gateway) handleConnect(w http.ResponseWriter, r *http.Request, st *state, start time.Time) {
	t, rec, intercepted, b := g.decideConnect(r.Context(), st, r.Host, r.Header)
	if b != nil {
		g.refuse(w, r, rec, b, start)
		return
	}
	hc, brw, err := http.NewResponseController(w).Hijack()
	if err != nil {
		g.refuse(w, r, rec, block(http.StatusInternalServerError, "hijack", "cannot take over connection: %v", err), start)
		return
	}
	conn, release := rawConn(hc)
	_ = conn.SetDeadline(time.Time{})
	var pre []byte
	if n := brw.Reader.Buffered(); n > 0 {
		pre, _ = brw.Reader.Peek(n)
		pre = append([]byte(nil), pre...)
	}
	// Off the HTTP server's connection goroutine, which would otherwise
	// pin the request and its buffers for the tunnel's whole life.
	go g.tunnel(conn, release, pre, t, rec, start, intercepted)
}

// decideConnect is the decision stage of a CONNECT to authority, from
// either front end: the authority's form, proxy-chaining headers, the
// policy (and an operator's approval, waiting on ctx), the rate limit,
// and one resolution whose every address is classified. hdr holds at
// least the chaining headers the request carried. On refusal b is set and
// rec is the record to write with it.
func (g *Gateway) decideConnect(ctx context.Context, st *state, authority string, hdr http.Header) (t *target, rec audit.Record, intercepted bool, b *blockedErr) {
	rec = audit.Record{Method: http.MethodConnect}
	host, port, err := splitAuthority(authority, 0)
	rec.Host, rec.Port = host, port
	if err != nil {
		return nil, rec, false, block(http.StatusBadRequest, "authority", "CONNECT %v", err)
	}
	if b := chainingBlock(hdr); b != nil {
		return nil, rec, false, b
	}
	lit, isLit := benchLiteral(g.opts.UnsafeBenchIPLiterals, host)
	var dec policy.Decision
	if isLit {
		if dec = decideLiteralPort(st, port); dec.Result != policy.Allow {
			b = block(http.StatusForbidden, dec.Rule, "%s", dec.Reason)
		}
	} else {
		dec, b = g.admit(ctx, st, g.decide(st, host, port, http.MethodConnect), host, port, http.MethodConnect, "")
	}
	if b != nil {
		return nil, rec, false, b
	}
	rec.Reason = approvedBy(dec)
	rec.Rule = dec.Rule
	if !st.limiter.allow(host) {
		return nil, rec, false, block(http.StatusTooManyRequests, "rate-limit", "rate limit for %s exceeded", host)
	}
	var dst netip.AddrPort
	var aliases []string
	if isLit {
		dst, err = checkLiteral(st, lit, port)
	} else {
		dst, aliases, err = g.resolve(ctx, st, host, port, dec.Rule)
	}
	if err != nil {
		return nil, rec, false, resolveBlock(err)
	}
	t = &target{st: st, host: host, port: port, dst: dst, aliases: aliases, rule: dec.Rule, tls: true, literal: isLit}
	return t, rec, !isLit && st.intercepts(host), nil
}

const established = "HTTP/1.1 200 Connection established\r\n\r\n"

// tunnel runs an admitted CONNECT on the agent's raw connection (conn's
// slot is given back by release when the tunnel ends). It answers 200;
// an intercepted tunnel is then served on this goroutine until it ends. A
// plain tunnel's upstream is dialled right after the 200, while the agent
// reads it and builds its ClientHello, so the connect leaves the critical
// path without a goroutine of its own; then the SNI check (openTunnel),
// and the relay on fresh goroutines: this one has grown its stack parsing
// the ClientHello and ends, so an idle tunnel holds two small stacks.
func (g *Gateway) tunnel(conn net.Conn, release func(), pre []byte, t *target, rec audit.Record, start time.Time, intercepted bool) {
	if _, err := io.WriteString(conn, established); err != nil {
		conn.Close()
		release()
		return
	}
	if intercepted {
		defer release()
		defer conn.Close()
		_, untrack := g.track(t, conn)
		defer untrack()
		g.intercept(conn, pre, t, rec, start)
		return
	}
	up, sent, got, ok := g.openTunnel(conn, pre, t, rec, start)
	if !ok {
		conn.Close()
		release()
		return
	}
	go func() {
		defer release()
		defer conn.Close()
		defer up.Close()
		lt, untrack := g.track(t, conn)
		defer untrack()
		g.relay(conn, up, t, rec, start, sent, got, lt)
	}()
}

// target is a vetted destination.
type target struct {
	st   *state
	host string
	port int
	dst  netip.AddrPort
	// aliases are the names dst's answer went through (CNAME, DNAME),
	// judged by bans for as long as the tunnel is open (bans.go).
	aliases []string
	rule    string
	tls     bool // the agent's connection to the host is TLS end to end
	// literal: an IP-literal CONNECT admitted by UnsafeBenchIPLiterals; the
	// policy decides on the TLS SNI name (openTunnel).
	literal bool
}

// prefixConn replays bytes read ahead before reading from the connection.
type prefixConn struct {
	net.Conn
	r io.Reader
}

func (c *prefixConn) Read(p []byte) (int, error) { return c.r.Read(p) }

func withPrefix(c net.Conn, pre []byte) net.Conn {
	if len(pre) == 0 {
		return c
	}
	return &prefixConn{Conn: c, r: io.MultiReader(bufioFrom(pre), c)}
}

func bufioFrom(b []byte) io.Reader { return bufio.NewReader(strings.NewReader(string(b))) }

// ctxWithDst carries the vetted destination to the transports' dialer.
func ctxWithDst(ctx context.Context, t *target) context.Context {
	return context.WithValue(ctx, dstKey{}, dstInfo{st: t.st, dst: t.dst})
}
