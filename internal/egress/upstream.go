package egress

import (
	"bufio"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The upstream leg of an intercepted HTTP/1.1 tunnel. net/http's Transport
// runs every request through two goroutines of its own (a write loop and a
// read loop per connection) and hands request and response between them
// and the caller: on a two-core machine those hand-offs were a fifth of the
// gateway's CPU per intercepted request (docs/performance.md, issue 20).
// Here the tunnel's own goroutine (net/http's server handler for the
// agent's connection, which serves one request at a time) writes the
// request and reads the response on one upstream TLS connection it owns:
// no goroutine, no channel, for a request without a body. A request with a
// body writes it on one goroutine while the handler reads the response, as
// the Transport does, so an upstream that answers before reading the whole
// body is not deadlocked.
//
// The wire format is net/http's own on both sides: http.Request.Write, the
// function the Transport writes with (for a GET or HEAD without a body,
// writeHead writes Request.Write's bytes without its fmt calls; a test
// compares the two), and http.ReadResponse, the parser it reads with. Nothing here parses HTTP; the framing decisions (chunked,
// Content-Length, a close-delimited body, 1xx) are net/http's, the same as
// before. What this file decides is only when a connection may carry the
// next request.
//
// HTTP/2 from the agent keeps the Transport (g.h2): its streams are
// concurrent, which is what a pool of multiplexed connections is for.

const (
	// maxUpstreamHeader bounds an upstream's response head, here and in
	// both Transports (MaxResponseHeaderBytes; on HTTP/2 the header list
	// size). The gateway holds a head parsed while it writes it to the
	// agent, which may not read: at net/http's default of 10 MiB, 16
	// tunnels held over 200 MiB (red team redh2,
	// TestRedTeamUpstreamHugeResponseHead), max_tunnels 256 could hold
	// 2.5 GiB. 128 KiB is twice Envoy's default (60 KiB); nginx proxies
	// refuse heads over 4 or 8 KiB.
	maxUpstreamHeader = 128 << 10
	// upstreamHeaderTimeout is the Transport's ResponseHeaderTimeout: a
	// model API may think for minutes before its first byte.
	upstreamHeaderTimeout = 5 * time.Minute
	// upstreamIdle is how long a connection waits in the gateway's idle
	// list for the next tunnel to the same host (the Transport's
	// IdleConnTimeout), at most maxIdlePerHost of them per host.
	upstreamIdle   = 90 * time.Second
	maxIdlePerHost = 64
	// maxIdleTotal bounds the idle list over all hosts (the Transport's
	// MaxIdleConns): without it an agent allowed a wildcard could park
	// an idle upstream connection for every name it can resolve, each
	// holding a descriptor and TLS buffers for upstreamIdle.
	maxIdleTotal = 128
	// max1xx bounds informational responses before the final one.
	max1xx = 5
	// writeWait is how long a finished response waits for its request
	// body's write to end before the connection is given up (the
	// Transport waits as long before reusing one).
	writeWait = 50 * time.Millisecond
)

// upKey names what an idle connection may be reused for: the TLS server
// name it verified and the vetted address it is connected to.
type upKey struct {
	host string
	dst  netip.AddrPort
}

// upConn is one upstream TLS connection.
type upConn struct {
	key upKey
	tc  net.Conn // the TLS connection
	raw syscall.Conn
	lim headLimit
	// rc and peekFn are alive's, made once per connection rather than
	// per request; peekOK is peekFn's result.
	rc      syscall.RawConn
	peekFn  func(fd uintptr) bool
	peekOK  bool
	peekBuf [1]byte
	br      *bufio.Reader
	bw      *bufio.Writer
	timer   *time.Timer // idle expiry while in the pool
}

// headLimit caps the bytes read from the connection while a response
// head is read, and counts them (nothing read: a request may be retried).
type headLimit struct {
	c    net.Conn
	left int64
	read int64
}

func (l *headLimit) Read(p []byte) (int, error) {
	if l.left <= 0 {
		return 0, fmt.Errorf("upstream response head exceeds %d bytes", maxUpstreamHeader)
	}
	if int64(len(p)) > l.left {
		p = p[:l.left]
	}
	n, err := l.c.Read(p)
	l.left -= int64(n)
	l.read += int64(n)
	return n, err
}

// alive reports whether an idle connection can carry a request: the peer
// has not closed it and has sent nothing unasked (an HTTP/1.1 server says
// nothing between responses but a close: a TLS alert, a 408). One
// non-blocking peek at the socket, no goroutine watching it.
func (c *upConn) alive() bool {
	if c.br.Buffered() > 0 {
		return false
	}
	if c.rc == nil {
		rc, err := c.raw.SyscallConn()
		if err != nil {
			return false
		}
		c.rc, c.peekFn = rc, c.peek
	}
	c.peekOK = false
	_ = c.rc.Read(c.peekFn)
	return c.peekOK
}

// peek is alive's look at the socket: nothing to read (EAGAIN) is alive.
func (c *upConn) peek(fd uintptr) bool {
	// recvfrom(2) with no address buffer: unix.Recvfrom would allocate
	// one per call to return a peer address TCP does not give.
	_, _, errno := unix.Syscall6(unix.SYS_RECVFROM, fd, uintptr(unsafe.Pointer(&c.peekBuf[0])), 1, unix.MSG_PEEK|unix.MSG_DONTWAIT, 0, 0)
	c.peekOK = errno == unix.EAGAIN
	return true
}

func (c *upConn) close() { _ = c.tc.Close() }

// upPool holds upstream connections between tunnels, so a new intercepted
// tunnel to a host does not pay a TLS handshake upstream.
type upPool struct {
	mu   sync.Mutex
	idle map[upKey][]*upConn
	n    int // connections in idle, over all keys
}

func (p *upPool) get(k upKey) *upConn {
	p.mu.Lock()
	defer p.mu.Unlock()
	cs := p.idle[k]
	if len(cs) == 0 {
		return nil
	}
	c := cs[len(cs)-1]
	cs[len(cs)-1] = nil
	p.n--
	if len(cs) == 1 {
		delete(p.idle, k)
	} else {
		p.idle[k] = cs[:len(cs)-1]
	}
	c.timer.Stop()
	return c
}

func (p *upPool) put(c *upConn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.idle == nil {
		p.idle = map[upKey][]*upConn{}
	}
	if len(p.idle[c.key]) >= maxIdlePerHost || p.n >= maxIdleTotal {
		c.close()
		return
	}
	p.idle[c.key] = append(p.idle[c.key], c)
	p.n++
	c.timer = time.AfterFunc(upstreamIdle, func() { p.expire(c) })
}

// expire closes c if it is still idle (get may have taken it meanwhile).
func (p *upPool) expire(c *upConn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	cs := p.idle[c.key]
	for i, x := range cs {
		if x == c {
			cs = append(cs[:i], cs[i+1:]...)
			p.n--
			if len(cs) == 0 {
				delete(p.idle, c.key)
			} else {
				p.idle[c.key] = cs
			}
			c.close()
			return
		}
	}
}

// tunnelClient is the upstream client of one intercepted HTTP/1.1 tunnel
// (an http.RoundTripper for exchange). Its requests come one at a time,
// from the tunnel's handler; the connection between them is c.
type tunnelClient struct {
	g *Gateway
	c *upConn
	// headTimeout, when set, replaces upstreamHeaderTimeout (the fuzz
	// test's upstream never finishes a truncated head).
	headTimeout time.Duration

	// A failed read of the agent's connection (its tunnel closed, a ban,
	// a stalled body) aborts the exchange in flight: agentGone, called by
	// the tunnel's agentConn, aborts cur and, unless the read timed out,
	// every later exchange (goneErr). Once per tunnel rather than a
	// context.AfterFunc per request (whose registration on net/http's
	// request context was a thirtieth of the gateway's CPU per request).
	mu      sync.Mutex
	cur     *upExchange
	goneErr error
}

func (g *Gateway) newTunnelClient() *tunnelClient { return &tunnelClient{g: g} }

// agentGone aborts the exchange in flight because a read of the agent's
// connection failed with err; unless it timed out, the agent is gone and
// every later exchange is aborted too.
//
// This is what net/http did to the request's context, which an
// AfterFunc per request watched before: its server cancels it on every
// failed read of the connection but the timeout of its own background
// read, which it causes when a handler has returned (no exchange is in
// flight then, and a timeout is not sticky here). A timeout with an
// exchange in flight is a stalled request body (deadlineBody).
func (tc *tunnelClient) agentGone(err error, timeout bool) {
	tc.mu.Lock()
	defer tc.mu.Unlock()
	if !timeout && tc.goneErr == nil {
		tc.goneErr = err
	}
	if tc.cur != nil {
		tc.cur.abort(err)
	}
}

// begin makes e the exchange agentGone aborts; it is aborted at once if
// the agent has already gone.
func (tc *tunnelClient) begin(e *upExchange) {
	tc.mu.Lock()
	defer tc.mu.Unlock()
	tc.cur = e
	if tc.goneErr != nil {
		e.abort(tc.goneErr)
	}
}

// agentConn is the agent's side of an intercepted HTTP/1.1 tunnel as
// net/http's server reads it (the TLS connection; net/http takes its TLS
// state from ConnectionState). Every failed read goes to gone, with
// whether it timed out as net/http tells it (a net.Error, not unwrapped):
// net/http's background read sees the agent leave while a handler waits
// on the upstream.
type agentConn struct {
	*tls.Conn
	gone func(err error, timeout bool)
}

func (c *agentConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if err != nil {
		ne, ok := err.(net.Error)
		c.gone(err, ok && ne.Timeout())
	}
	return n, err
}

// close ends the tunnel's use of its connection: an idle one goes to the
// gateway's pool for the next tunnel to the same host.
func (tc *tunnelClient) close() {
	if tc.c != nil {
		tc.g.upIdle.put(tc.c)
		tc.c = nil
	}
}

// errNothingRead marks a failure on a reused connection before any byte of
// a response arrived: the upstream closed it as the request went out.
type errNothingRead struct{ err error }

func (e errNothingRead) Error() string { return e.err.Error() }
func (e errNothingRead) Unwrap() error { return e.err }

func (tc *tunnelClient) RoundTrip(req *http.Request) (*http.Response, error) {
	di, ok := req.Context().Value(dstKey{}).(dstInfo)
	if !ok {
		return nil, errors.New("egress: request without a vetted destination")
	}
	if err := validHeader(req.Header); err != nil {
		return nil, err
	}
	key := upKey{host: req.URL.Hostname(), dst: di.dst}
	// Only a request without a body, whose method is safe to repeat, is
	// sent again on a fresh connection (what the Transport retries too).
	replay := req.Body == nil && (req.Method == http.MethodGet || req.Method == http.MethodHead || req.Method == http.MethodOptions)
	for attempt := 0; ; attempt++ {
		c, reused, err := tc.conn(req.Context(), di, key)
		if err != nil {
			return nil, err
		}
		resp, err := tc.send(c, req)
		if err == nil {
			return resp, nil
		}
		var nr errNothingRead
		if reused && replay && attempt == 0 && errors.As(err, &nr) {
			continue
		}
		return nil, err
	}
}

// conn returns a connection for key: the tunnel's own, one from the pool,
// or a new one. reused is false for a new one.
func (tc *tunnelClient) conn(ctx context.Context, di dstInfo, key upKey) (*upConn, bool, error) {
	if c := tc.c; c != nil {
		tc.c = nil
		if c.key == key && c.alive() {
			return c, true, nil
		}
		c.close()
	}
	for {
		c := tc.g.upIdle.get(key)
		if c == nil {
			break
		}
		if c.alive() {
			return c, true, nil
		}
		c.close()
	}
	c, err := tc.g.dialUpstream(ctx, di, key)
	return c, false, err
}

// dialUpstream connects to the vetted address (the guard checks it again
// at connect) and verifies the upstream's certificate for the host.
func (g *Gateway) dialUpstream(ctx context.Context, di dstInfo, key upKey) (*upConn, error) {
	raw, err := g.dial(ctx, di.st, di.dst)
	if err != nil {
		return nil, err
	}
	conf := g.upTLS.Clone()
	// No ALPN, as net/http's HTTP/1.1 Transport offers none: the
	// upstream speaks HTTP/1.1 (a cached session does not change that).
	conf.ServerName, conf.NextProtos = key.host, nil
	tc := tls.Client(raw, conf)
	hctx, cancel := context.WithTimeout(ctx, handshakeTimeout)
	err = tc.HandshakeContext(hctx)
	cancel()
	if err != nil {
		raw.Close()
		return nil, err
	}
	sc, ok := raw.(syscall.Conn)
	if !ok {
		tc.Close()
		return nil, errors.New("egress: upstream connection has no socket")
	}
	return newUpConn(key, tc, sc), nil
}

// newUpConn wraps conn (TLS over the socket raw) for requests.
func newUpConn(key upKey, conn net.Conn, raw syscall.Conn) *upConn {
	c := &upConn{key: key, tc: conn, raw: raw, lim: headLimit{c: conn}}
	c.br = bufio.NewReader(&c.lim)
	c.bw = bufio.NewWriter(conn)
	return c
}

// send writes req on c and reads the response head. On error c is closed.
func (tc *tunnelClient) send(c *upConn, req *http.Request) (*http.Response, error) {
	c.lim.left, c.lim.read = maxUpstreamHeader, 0
	headTimeout := upstreamHeaderTimeout
	if tc.headTimeout > 0 {
		headTimeout = tc.headTimeout
	}
	if req.Body == nil {
		_ = c.tc.SetReadDeadline(time.Now().Add(headTimeout))
	}
	ex := &upExchange{tc: tc, c: c}
	// The agent going away (its tunnel closed, a ban) aborts the exchange:
	// whatever waits on the upstream returns. The connection stays whole
	// (a deadline, not a close), so an exchange that had read its answer
	// to the end when the agent left still hands it on.
	tc.begin(ex)
	if req.Body == nil {
		if err := writeRequest(c, req); err != nil {
			ex.fail()
			return nil, err
		}
	} else {
		// The head timeout starts when the body is written (the
		// Transport's ResponseHeaderTimeout), unless the head came first.
		ex.wrote = make(chan error, 1)
		go func() {
			err := writeRequest(c, req)
			if err != nil {
				c.close() // the upstream sees a cut request, never a short one
			} else {
				ex.mu.Lock()
				if !ex.gotHead && !ex.aborted {
					_ = c.tc.SetReadDeadline(time.Now().Add(headTimeout))
				}
				ex.mu.Unlock()
			}
			ex.wrote <- err
		}()
	}
	resp, err := readResponse(c, req)
	ex.mu.Lock()
	ex.gotHead = true
	ex.mu.Unlock()
	if err != nil {
		werr := ex.fail()
		switch {
		case ex.aborted:
			err = fmt.Errorf("request abandoned by the agent: %w", ex.abortErr)
		case werr != nil:
			err = werr
		case c.lim.read == 0:
			err = errNothingRead{err}
		}
		return nil, err
	}
	// The body has no deadline of its own (a stream may last), unless the
	// agent has already gone.
	ex.mu.Lock()
	if !ex.aborted {
		_ = c.tc.SetReadDeadline(time.Time{})
	}
	ex.mu.Unlock()
	c.lim.left = 1<<63 - 1
	ex.body = resp.Body
	ex.keep = !resp.Close && !req.Close
	resp.Body = ex
	return resp, nil
}

func writeRequest(c *upConn, req *http.Request) error {
	if !writeHead(c.bw, req) {
		if err := req.Write(c.bw); err != nil {
			return err
		}
	}
	return c.bw.Flush()
}

// readResponse reads the final response head, skipping informational ones.
// A 101 is refused: this path never asks for an upgrade (hop headers are
// removed; WebSocket has its own), so a switch is an upstream out of step.
func readResponse(c *upConn, req *http.Request) (*http.Response, error) {
	for n := 0; ; n++ {
		resp, err := http.ReadResponse(c.br, req)
		if err != nil {
			return nil, err
		}
		switch {
		case resp.StatusCode < 100:
			// net/http's parser takes any three digits; no such status
			// exists, and the agent's server would panic writing it.
			return nil, fmt.Errorf("upstream sent status %03d", resp.StatusCode)
		case resp.StatusCode == http.StatusSwitchingProtocols:
			return nil, errors.New("upstream switched protocols unasked (101)")
		case resp.StatusCode >= 100 && resp.StatusCode < 200:
			if n >= max1xx {
				return nil, errors.New("upstream sent too many 1xx informational responses")
			}
			c.lim.left = maxUpstreamHeader
			continue
		}
		return resp, nil
	}
}

// upExchange is one request in flight on a connection; as the response's
// body it decides, at Close, whether the connection carries the next one.
type upExchange struct {
	tc     *tunnelClient
	c      *upConn
	body   io.ReadCloser
	eof    bool
	keep   bool
	closed bool

	wrote    chan error // the body writer's result; nil without a body
	mu       sync.Mutex
	gotHead  bool
	aborted  bool
	abortErr error // the agent's read error that aborted the exchange
}

// abort runs, under tc.mu, when a read of the agent's connection failed
// with err before the exchange ended.
func (e *upExchange) abort(err error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.aborted, e.abortErr = true, err
	_ = e.c.tc.SetDeadline(aLongTimeAgo)
}

// settle ends e's registration with the tunnel (an abort under way has
// finished when it returns: both hold tc.mu); it reports whether abort
// ran.
func (e *upExchange) settle() bool {
	e.tc.mu.Lock()
	if e.tc.cur == e {
		e.tc.cur = nil
	}
	e.tc.mu.Unlock()
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.aborted
}

func (e *upExchange) Read(p []byte) (int, error) {
	n, err := e.body.Read(p)
	if err == io.EOF {
		e.eof = true
	}
	return n, err
}

// fail closes the connection and waits for the body writer; it returns
// the writer's error, if it had one.
func (e *upExchange) fail() error {
	e.c.close()
	e.settle()
	if e.wrote == nil {
		return nil
	}
	return <-e.wrote
}

// Close keeps the connection for the tunnel's next request only when the
// response was read to its end, neither side asked to close, the request
// was written whole and the agent is still there; otherwise it is closed
// (a half-read body is never drained: a stream may not end).
func (e *upExchange) Close() error {
	if e.closed {
		return nil
	}
	e.closed = true
	reuse := e.eof && e.keep
	if !reuse {
		e.c.close()
	}
	if e.settle() && reuse {
		// The agent left after the answer was read whole: nothing was
		// cut, the deadline abort set goes.
		_ = e.c.tc.SetDeadline(time.Time{})
	}
	if e.wrote != nil {
		t := time.NewTimer(writeWait)
		select {
		case err := <-e.wrote:
			reuse = reuse && err == nil
		case <-t.C:
			reuse = false
			e.c.close()
			<-e.wrote
		}
		t.Stop()
	}
	if !reuse {
		e.c.close()
		return nil
	}
	_ = e.body.Close()
	e.tc.c = e.c
	return nil
}

// validHeader refuses a header field net/http's Transport would refuse to
// send (an injected value with a line break would split the request).
func validHeader(h http.Header) error {
	for k, vs := range h {
		if !validFieldName(k) {
			return fmt.Errorf("invalid header field name %q", k)
		}
		for _, v := range vs {
			if !validFieldValue(v) {
				return fmt.Errorf("invalid header field value for %q", k)
			}
		}
	}
	return nil
}

// validFieldName: a token (RFC 9110 §5.1).
func validFieldName(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c >= 0x80 || !tokenChar[c] {
			return false
		}
	}
	return true
}

// validFieldValue: no control byte but HTAB (RFC 9110 §5.5, as
// httpguts.ValidHeaderFieldValue).
func validFieldValue(s string) bool {
	for i := 0; i < len(s); i++ {
		if c := s[i]; (c < 0x20 && c != '\t') || c == 0x7f {
			return false
		}
	}
	return true
}

var tokenChar = func() (t [128]bool) {
	for c := '0'; c <= '9'; c++ {
		t[c] = true
	}
	for c := 'a'; c <= 'z'; c++ {
		t[c] = true
		t[c-'a'+'A'] = true
	}
	for _, c := range "!#$%&'*+-.^_`|~" {
		t[c] = true
	}
	return t
}()
