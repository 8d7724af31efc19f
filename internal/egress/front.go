package egress

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"sync"
	"time"
)

// The proxy listener's front end. A connection's first request is read
// here: a CONNECT (every tunnel, intercepted or not) is parsed by
// readConnectHead, decided, answered and run on the connection's one
// goroutine; anything else (plain-HTTP proxying, a malformed or HTTP/2
// preface) is handed, with the bytes read so far, to net/http's server
// unchanged. net/http's server costs a tunnel a connection goroutine, its
// background reader (whose hand-off on hijack is a wake-up of its own), a
// connection state machine, header maps and a response writer: the
// profile of a new tunnel showed the Go scheduler's wake-ups as its
// largest share of CPU (docs/performance.md, issue 20).

// frontReaders are the small buffers a request head is read with; a head
// longer than one buffer is assembled in readHeadLine's scratch slice.
var frontReaders = sync.Pool{New: func() any { return bufio.NewReaderSize(nil, 4096) }}

// frontListener is what ProxyListener returns: its Accept hands net/http
// the connections that are not CONNECT tunnels; the accept loop behind it
// takes every connection's slot and reads its first request.
type frontListener struct {
	net.Listener
	g       *Gateway
	once    sync.Once
	conns   chan net.Conn
	done    chan struct{}
	err     error // why the accept loop ended; read after done
	closing sync.Once
}

func (l *frontListener) Accept() (net.Conn, error) {
	l.once.Do(func() { go l.loop() })
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.done:
		return nil, l.err
	}
}

// Close stops the accept loop; connections already accepted go on.
func (l *frontListener) Close() error {
	var err error
	l.closing.Do(func() { err = l.Listener.Close() })
	return err
}

// loop accepts connections until the listener fails or is closed. A
// temporary error (out of file descriptors) is retried with a backoff, as
// net/http's server does.
func (l *frontListener) loop() {
	var backoff time.Duration
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			var te interface{ Temporary() bool }
			if errors.As(err, &te) && te.Temporary() && !errors.Is(err, net.ErrClosed) {
				backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
				l.g.log.Warn("accept failed; retrying", "err", err, "in", backoff)
				time.Sleep(backoff)
				continue
			}
			l.err = err
			close(l.done)
			return
		}
		backoff = 0
		release, n, limit, ok := l.g.acquire()
		if !ok {
			l.g.refuseConn(c, n, limit)
			continue
		}
		go l.serve(&auditConn{Conn: c, g: l.g, start: time.Now(), release: release})
	}
}

// serve reads the first bytes of c, bounded by the header timeout: a
// CONNECT is served here, anything else goes to net/http with what was
// read replayed. A client that sends nothing in time, or hangs up, is
// closed (audited by auditConn.Close if it sent anything).
func (l *frontListener) serve(c *auditConn) {
	st := l.g.st.Load()
	br := frontReaders.Get().(*bufio.Reader)
	br.Reset(c)
	_ = c.SetReadDeadline(time.Now().Add(min(headerTimeout, st.idle)))
	// One byte first: a request that cannot be a CONNECT goes to net/http
	// at once, so its own header timeout is not added to ours.
	b, err := br.Peek(1)
	if err == nil && b[0] == 'C' {
		b, err = br.Peek(len("CONNECT "))
	}
	if err != nil {
		putReader(br)
		c.Close()
		return
	}
	if string(b) == "CONNECT " {
		l.g.serveConnect(c, br, st)
		return
	}
	c.pre = buffered(br)
	putReader(br)
	_ = c.SetReadDeadline(time.Time{})
	select {
	case l.conns <- c:
	case <-l.done:
		c.Close()
	}
}

func putReader(br *bufio.Reader) {
	br.Reset(nil)
	frontReaders.Put(br)
}

// buffered copies what br holds beyond what was consumed.
func buffered(br *bufio.Reader) []byte {
	n := br.Buffered()
	if n == 0 {
		return nil
	}
	b, _ := br.Peek(n)
	return append([]byte(nil), b...)
}

// serveConnect reads, decides and runs a CONNECT that opened connection
// c. A malformed head is answered and audited here (rule http-protocol,
// as net/http's refusals are); from a well-formed head on, the policy code
// audits, as for a request net/http parsed.
func (g *Gateway) serveConnect(c *auditConn, br *bufio.Reader, st *state) {
	start := time.Now()
	head, err := readConnectHead(br, st.maxHeader+4096)
	if err != nil {
		putReader(br)
		var he *headError
		if errors.As(err, &he) {
			c.audit("http-protocol", "refused before the policy ran: "+he.Error())
			w := newDenialWriter()
			w.h.Set("Content-Type", "text/plain; charset=utf-8")
			w.h.Set("Connection", "close")
			w.h.Set("X-Nixcage-Egress", "blocked")
			w.h.Set("X-Nixcage-Rule", "http-protocol")
			w.WriteHeader(he.status)
			_, _ = io.WriteString(w, "nixcage egress: blocked: "+he.Error()+"\n")
			lingerClose(c, w.bytes())
			return
		}
		c.Close()
		return
	}
	c.served.Store(true)
	ctx, stop := context.Background(), func() {}
	if g.approvals != nil {
		// An operator's approval may be waited for: the wait ends if the
		// agent hangs up, as net/http's request context would.
		ctx, stop = watchHangup(c, br)
	}
	t, rec, intercepted, b := g.decideConnect(ctx, st, head.authority, head.header)
	stop()
	if b != nil {
		putReader(br)
		w := newDenialWriter()
		g.refuse(w, &http.Request{Method: http.MethodConnect, Host: head.authority, Header: head.header}, rec, b, start)
		lingerClose(c, w.bytes())
		return
	}
	pre := buffered(br)
	putReader(br)
	_ = c.SetReadDeadline(time.Time{})
	conn, release := rawConn(c)
	g.tunnel(conn, release, pre, t, rec, start, intercepted)
}

// lingerClose writes a final response, then closes c the way net/http
// does: its write side first, then, after the client's bytes (bounded in
// size and time) are read, the whole connection, so the kernel does not
// answer unread bytes with a reset that discards the response.
func lingerClose(c net.Conn, resp []byte) {
	_ = c.SetWriteDeadline(time.Now().Add(5 * time.Second))
	_, _ = c.Write(resp)
	closeWrite(c)
	_ = c.SetReadDeadline(time.Now().Add(500 * time.Millisecond))
	_, _ = io.Copy(io.Discard, io.LimitReader(c, 64<<10))
	c.Close()
}

// watchHangup returns a context cancelled when the agent closes c (or
// sends bytes) while a decision waits; stop ends the watch and leaves any
// byte read in br. Only for the approval wait: it costs a goroutine and a
// deadline hand-off, as net/http's background read does per request.
func watchHangup(c net.Conn, br *bufio.Reader) (context.Context, func()) {
	ctx, cancel := context.WithCancel(context.Background())
	_ = c.SetReadDeadline(time.Time{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		if _, err := br.Peek(1); err != nil {
			cancel() // a hang-up, or stop's deadline: nothing waits then
		}
	}()
	return ctx, func() {
		_ = c.SetReadDeadline(aLongTimeAgo)
		<-done
		_ = c.SetReadDeadline(time.Time{})
		cancel()
	}
}

// aLongTimeAgo is a deadline in the past: it wakes a blocked read at once.
var aLongTimeAgo = time.Unix(1, 0)
