package egress

import (
	"bufio"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/nixcage/nixcage/internal/egress/audit"
	"github.com/nixcage/nixcage/internal/policy"
)

// scriptedUpstream is a TLS server (the harness's upstream CA) whose n-th
// connection (from 0) is served by serve, reading requests with net/http's
// parser and writing whatever bytes the test wants. It counts connections.
type scriptedUpstream struct {
	port  int
	conns atomic.Int64
}

func startScripted(t *testing.T, caDir string, serve func(n int, c net.Conn, br *bufio.Reader)) *scriptedUpstream {
	t.Helper()
	l := upstreamListener(t, caDir)
	s := &scriptedUpstream{port: l.Addr().(*net.TCPAddr).Port}
	serveEach(l, func(c net.Conn) {
		n := int(s.conns.Add(1)) - 1
		serve(n, c, bufio.NewReader(c))
	})
	return s
}

// scriptedHarness is a gateway whose policy allows the scripted upstream's
// port; api.example.com is intercepted and bound to the anthropic secret.
func scriptedHarness(t *testing.T, serve func(n int, c net.Conn, br *bufio.Reader)) (*harness, *scriptedUpstream) {
	var s *scriptedUpstream
	h := newHarness(t, func(rt *policy.Runtime) {
		s = startScripted(t, filepath.Join(filepath.Dir(rt.AuditFile), "upstream-ca"), serve)
		rt.Policy.Ports = append(rt.Policy.Ports, s.port)
	})
	return h, s
}

// keepAliveClient is an HTTP/1.1 client through the gateway that keeps its
// tunnel between requests.
func (h *harness) keepAliveClient() *http.Client {
	c := h.client(false)
	c.Transport.(*http.Transport).DisableKeepAlives = false
	return c
}

func (s *scriptedUpstream) url(path string) string {
	return "https://api.example.com:" + strconv.Itoa(s.port) + path
}

// answer writes a 200 with body and Content-Length.
func answer(c net.Conn, body string) {
	fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
}

// serveKeepAlive answers every request on the connection with the path it
// asked for (and the connection's number), reading bodies whole.
func serveKeepAlive(n int, c net.Conn, br *bufio.Reader) {
	for {
		req, err := http.ReadRequest(br)
		if err != nil {
			return
		}
		io.Copy(io.Discard, req.Body)
		answer(c, fmt.Sprintf("conn %d %s", n, req.URL.Path))
	}
}

// Requests on an intercepted tunnel share one upstream connection, and a
// later tunnel to the same host takes it over: the tunnel's client keeps
// what net/http's Transport pool gave before (no TLS handshake upstream
// per request or per tunnel).
func TestInterceptedUpstreamReuse(t *testing.T) {
	h, s := scriptedHarness(t, serveKeepAlive)
	for tunnel := range 2 {
		c := h.keepAliveClient()
		for i := range 4 {
			path := fmt.Sprintf("/t%d/r%d", tunnel, i)
			code, _, body, err := h.do(c, "GET", s.url(path), http.Header{"X-Api-Key": {h.ph["anthropic"]}}, "")
			if err != nil || code != 200 || body != "conn 0 "+path {
				t.Fatalf("%s: got %d %v %q", path, code, err, body)
			}
		}
		c.Transport.(*http.Transport).CloseIdleConnections()
		h.want(t, closed("CONNECT", "api.example.com", s.port), audit.Allowed, "")
	}
	if n := s.conns.Load(); n != 1 {
		t.Fatalf("upstream saw %d connections for 8 requests over 2 tunnels, want 1", n)
	}
}

// An upstream that closes its end after each response, without saying so
// (no Connection: close): the next request, with or without a body, goes
// out on a new connection instead of failing on the dead one.
func TestInterceptedUpstreamClosedBetweenRequests(t *testing.T) {
	h, s := scriptedHarness(t, func(n int, c net.Conn, br *bufio.Reader) {
		req, err := http.ReadRequest(br)
		if err != nil {
			return
		}
		b, _ := io.ReadAll(req.Body)
		answer(c, fmt.Sprintf("conn %d %s %s", n, req.URL.Path, b))
	})
	c := h.keepAliveClient()
	for i, m := range []string{"GET", "GET", "POST", "POST", "GET"} {
		body := ""
		if m == "POST" {
			body = "payload" + strconv.Itoa(i)
			// A request with a body cannot be sent twice (its stream is
			// read once, as with the Transport): it relies on the close
			// having arrived when the connection is picked, which takes
			// the upstream's goroutine a moment on a loaded machine. A GET
			// is sent again on a new connection if the close crosses it.
			time.Sleep(200 * time.Millisecond)
		}
		code, _, got, err := h.do(c, m, s.url("/r"+strconv.Itoa(i)), nil, body)
		if want := fmt.Sprintf("conn %d /r%d %s", i, i, body); err != nil || code != 200 || got != want {
			t.Fatalf("request %d (%s): got %d %v %q, want %q", i, m, code, err, got, want)
		}
	}
}

// A response followed by bytes no request asked for (a second response
// queued by a hostile or broken upstream, a body longer than its
// Content-Length, data after a chunked body) never answers the agent's
// next request: the connection is dropped, and the next request gets its
// own answer on a new one.
func TestInterceptedUpstreamNoDesync(t *testing.T) {
	for name, first := range map[string]string{
		"queued response": "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfirstHTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\nPOISONED",
		"long body":       "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nfirstPOISONED",
		"after chunked":   "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n0\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\nPOISONED",
		"CL and TE":       "HTTP/1.1 200 OK\r\nContent-Length: 40\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n0\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\nPOISONED",
	} {
		t.Run(name, func(t *testing.T) {
			h, s := scriptedHarness(t, func(n int, c net.Conn, br *bufio.Reader) {
				for i := 0; ; i++ {
					req, err := http.ReadRequest(br)
					if err != nil {
						return
					}
					if n == 0 && i == 0 {
						fmt.Fprint(c, first)
						continue
					}
					answer(c, fmt.Sprintf("conn %d %s", n, req.URL.Path))
				}
			})
			c := h.keepAliveClient()
			code, _, body, err := h.do(c, "GET", s.url("/one"), nil, "")
			if err != nil || code != 200 || body != "first" {
				t.Fatalf("first request: got %d %v %q", code, err, body)
			}
			code, _, body, err = h.do(c, "GET", s.url("/two"), nil, "")
			if err != nil || code != 200 || body != "conn 1 /two" {
				t.Fatalf("second request: got %d %v %q, want its own answer on a new connection", code, err, body)
			}
		})
	}
}

// An upstream that answers before it has read the request body (a 413 to
// an upload, with Connection: close) and then reads nothing more: the
// agent has the answer at once, the body's write is cut rather than
// waited for (the upstream's receive buffer is small, so the upload cannot
// sit in socket buffers: a gateway waiting on the write would hang until
// the client's timeout), and the next request goes on a new connection.
func TestInterceptedUpstreamEarlyAnswer(t *testing.T) {
	hold := make(chan struct{})
	t.Cleanup(func() { close(hold) })
	h, s := scriptedHarness(t, func(n int, c net.Conn, br *bufio.Reader) {
		if tc, ok := c.(*tls.Conn); ok {
			_ = tc.NetConn().(*net.TCPConn).SetReadBuffer(4096)
		}
		req, err := http.ReadRequest(br)
		if err != nil {
			return
		}
		if req.URL.Path == "/upload" {
			fmt.Fprint(c, "HTTP/1.1 413 Content Too Large\r\nConnection: close\r\nContent-Length: 8\r\n\r\ntoo big\n")
			<-hold
			return
		}
		answer(c, fmt.Sprintf("conn %d %s", n, req.URL.Path))
	})
	c := h.keepAliveClient()
	code, _, body, err := h.do(c, "POST", s.url("/upload"), nil, strings.Repeat("x", 1000<<10))
	if err != nil || code != http.StatusRequestEntityTooLarge || body != "too big\n" {
		t.Fatalf("upload: got %d %v %q, want the upstream's 413", code, err, body)
	}
	code, _, body, err = h.do(c, "GET", s.url("/next"), nil, "")
	if err != nil || code != 200 || body != "conn 1 /next" {
		t.Fatalf("next request: got %d %v %q", code, err, body)
	}
}

// Informational responses are skipped (the agent gets the final one); a
// 101 nobody asked for, an endless run of 1xx, a status below 100 (which
// net/http's parser accepts and its server panics on writing: the agent
// got no answer and the request no audit record) and a response head over
// the bound are upstream errors.
func TestInterceptedUpstreamInformational(t *testing.T) {
	h, s := scriptedHarness(t, func(n int, c net.Conn, br *bufio.Reader) {
		for {
			req, err := http.ReadRequest(br)
			if err != nil {
				return
			}
			switch req.URL.Path {
			case "/hints":
				fmt.Fprint(c, "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </s.css>\r\n\r\n")
				answer(c, "final")
			case "/switch":
				fmt.Fprint(c, "HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\nConnection: Upgrade\r\n\r\nraw bytes")
				return
			case "/endless":
				for range 10 {
					fmt.Fprint(c, "HTTP/1.1 102 Processing\r\n\r\n")
				}
				answer(c, "never")
			case "/status0":
				fmt.Fprint(c, "HTTP/1.1 000 Nothing\r\nContent-Length: 0\r\n\r\n")
			case "/hugehead":
				fmt.Fprintf(c, "HTTP/1.1 200 OK\r\nX-Big: %s\r\nContent-Length: 0\r\n\r\n", strings.Repeat("a", maxUpstreamHeader))
				return
			}
		}
	})
	code, _, body, err := h.do(h.keepAliveClient(), "GET", s.url("/hints"), nil, "")
	if err != nil || code != 200 || body != "final" {
		t.Fatalf("/hints: got %d %v %q", code, err, body)
	}
	for _, p := range []string{"/switch", "/endless", "/status0", "/hugehead"} {
		code, _, body, err := h.do(h.keepAliveClient(), "GET", s.url(p), nil, "")
		if err != nil || code != http.StatusBadGateway {
			t.Fatalf("%s: got %d %v %q, want 502", p, code, err, body)
		}
		h.want(t, func(r audit.Record) bool { return r.Path == p }, audit.Blocked, "upstream")
	}
}

// Request smuggling on the intercepted leg (the agent's own bytes inside
// its TLS tunnel): net/http's server parses the agent's request and the
// upstream client re-frames what passed (http.Request.Write), so every
// request the upstream sees is one the gateway decided, inspected and
// audited; no request hides in another's body. What net/http refuses (two
// different Content-Lengths) is answered 400 and nothing goes upstream;
// what it accepts it reads one way, and the upstream gets that reading:
// Content-Length with Transfer-Encoding is read as chunked and sent on
// without the Content-Length (RFC 9112 §6.3), an obs-fold is folded into
// the header before it, a bare LF ends a line. The test pins both: a
// change of the agent-side parser must keep the upstream's view the
// gateway's.
func TestInterceptedSmuggling(t *testing.T) {
	var mu sync.Mutex
	var seen []string
	h, s := scriptedHarness(t, func(n int, c net.Conn, br *bufio.Reader) {
		for {
			req, err := http.ReadRequest(br)
			if err != nil {
				return
			}
			b, _ := io.ReadAll(req.Body)
			mu.Lock()
			seen = append(seen, req.URL.Path)
			mu.Unlock()
			answer(c, fmt.Sprintf("%s %s body=%q", req.Method, req.URL.Path, b))
		}
	})
	host := "api.example.com:" + strconv.Itoa(s.port)
	for _, tc := range []struct {
		name, req string
		refused   bool // net/http answers 400 and nothing goes upstream
		// Otherwise the upstream may see only requests the gateway
		// audited, and no path with "smuggled" (bytes the gateway read
		// as a body).
	}{
		{"CL and TE", "POST /cl-te HTTP/1.1\r\nHost: " + host + "\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /after-cl-te HTTP/1.1\r\nHost: " + host + "\r\n\r\n", false},
		{"CL and TE, body as CL", "POST /cl-te2 HTTP/1.1\r\nHost: " + host + "\r\nContent-Length: 44\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /smuggled-cl-te HTTP/1.1\r\nHost: x\r\n\r\n", false},
		{"two Content-Lengths", "POST /two-cl HTTP/1.1\r\nHost: " + host + "\r\nContent-Length: 0\r\nContent-Length: 44\r\n\r\nGET /smuggled-two-cl HTTP/1.1\r\nHost: " + host + "\r\n\r\n", true},
		{"obs-fold", "GET /fold HTTP/1.1\r\nHost: " + host + "\r\nX-A: a\r\n Content-Length: 40\r\n\r\nGET /after-fold HTTP/1.1\r\nHost: " + host + "\r\n\r\n", false},
		{"bad chunk size", "POST /chunk HTTP/1.1\r\nHost: " + host + "\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffffff1\r\nx\r\n0\r\n\r\n", false},
		{"TE not chunked last", "POST /te HTTP/1.1\r\nHost: " + host + "\r\nTransfer-Encoding: chunked, identity\r\n\r\n0\r\n\r\nGET /smuggled-te HTTP/1.1\r\nHost: " + host + "\r\n\r\n", false},
		{"bare LF", "GET /lf HTTP/1.1\nHost: " + host + "\nContent-Length: 0\n\nGET /after-lf HTTP/1.1\r\nHost: " + host + "\r\n\r\n", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			mu.Lock()
			seen = nil
			mu.Unlock()
			raw, code := h.connect(host, "")
			if code != 200 {
				t.Fatalf("CONNECT: %d", code)
			}
			defer raw.Close()
			tc2 := tls.Client(raw, &tls.Config{ServerName: "api.example.com", RootCAs: h.cagePool, NextProtos: []string{"http/1.1"}})
			_ = tc2.SetDeadline(time.Now().Add(10 * time.Second))
			if _, err := io.WriteString(tc2, tc.req); err != nil {
				t.Fatal(err)
			}
			// Read every answer until the gateway closes or goes quiet.
			br := bufio.NewReader(tc2)
			var got []string
			for {
				_ = tc2.SetReadDeadline(time.Now().Add(time.Second))
				resp, err := http.ReadResponse(br, nil)
				if err != nil {
					break
				}
				b, _ := io.ReadAll(resp.Body)
				got = append(got, fmt.Sprintf("%d %s", resp.StatusCode, b))
			}
			if len(got) == 0 {
				t.Fatal("no answer")
			}
			mu.Lock()
			up := append([]string(nil), seen...)
			mu.Unlock()
			if tc.refused {
				if !strings.HasPrefix(got[0], "400 ") || len(up) > 0 {
					t.Fatalf("got %q, upstream saw %q: want a 400 and nothing upstream", got, up)
				}
				return
			}
			recs := h.records(t)
			for _, p := range up {
				if strings.Contains(p, "smuggled") {
					t.Fatalf("the upstream received a request hidden in another's body: %q (answers %q)", up, got)
				}
				found := false
				for _, r := range recs {
					found = found || (r.Path == p && r.Host == "api.example.com")
				}
				if !found {
					t.Fatalf("the upstream received %s, which the gateway never audited; audit:\n%s", p, h.dump())
				}
			}
		})
	}
}

// readCounter counts what is read from a connection.
type readCounter struct {
	net.Conn
	n int
}

func (c *readCounter) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	c.n += n
	return n, err
}

// FuzzUpstreamResponse feeds the intercepted tunnels' upstream client
// arbitrary bytes as an upstream's answer (over a socket pair: what the
// TLS layer would hand it). Whatever they are, it neither panics nor
// returns an informational response as the answer, and it never keeps a
// connection for the next request while a byte of this answer's stream is
// unread: what an upstream sends past its response (a queued second
// response, a body longer than its framing) is never taken as the answer
// to a later request. Run in checks/test.sh's fuzz tier; the seeds run in
// the unit tier.
func FuzzUpstreamResponse(f *testing.F) {
	for _, s := range []string{
		"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello",
		"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhelloHTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nbad",
		"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\nX-T: 1\r\n\r\n",
		"HTTP/1.1 200 OK\r\nContent-Length: 9\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nextra",
		"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
		"HTTP/1.1 200 OK\r\nX-A: a\r\n b\r\nContent-Length: 0\r\n\r\n",
		"HTTP/1.1 200 OK\nContent-Length: 2\n\nok",
		"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n",
		"HTTP/1.1 101 Switching Protocols\r\nUpgrade: x\r\n\r\n",
		"HTTP/1.1 304 Not Modified\r\nContent-Length: 10\r\n\r\n",
		"HTTP/1.0 200 OK\r\n\r\nuntil close",
		"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
		"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nfffffffffffffffff\r\n",
		"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 0\r\n\r\n",
	} {
		f.Add(false, []byte(s))
		f.Add(true, []byte(s))
	}
	f.Fuzz(func(t *testing.T, head bool, in []byte) {
		if len(in) > 32<<10 {
			return
		}
		fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			t.Fatal(err)
		}
		conns := make([]net.Conn, 2)
		for i, fd := range fds {
			fl := os.NewFile(uintptr(fd), "upstream")
			conns[i], err = net.FileConn(fl)
			fl.Close()
			if err != nil {
				t.Fatal(err)
			}
			defer conns[i].Close()
		}
		// The whole answer is in the client's socket before the request
		// goes out (a stream socket pair delivers on write).
		if _, err := conns[1].Write(in); err != nil {
			t.Fatal(err)
		}
		rc := &readCounter{Conn: conns[0]}
		c := newUpConn(upKey{}, rc, conns[0].(syscall.Conn))
		cl := &tunnelClient{headTimeout: 5 * time.Millisecond}
		method := http.MethodGet
		if head {
			method = http.MethodHead
		}
		req, _ := http.NewRequest(method, "https://api.example.com/", nil)
		resp, err := cl.send(c, req)
		if err == nil {
			if resp.StatusCode < 200 {
				t.Fatalf("informational %d returned as the answer", resp.StatusCode)
			}
			_ = conns[0].SetReadDeadline(time.Now().Add(5 * time.Millisecond))
			_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 1<<20))
			resp.Body.Close()
		}
		if cl.c != nil && cl.c.alive() && rc.n != len(in) {
			t.Fatalf("connection kept for the next request with %d of %d upstream bytes not part of this answer", len(in)-rc.n, len(in))
		}
	})
}

// A status below 100 from a plain-HTTP upstream (net/http's Transport
// takes any three digits): before, writing it panicked the handler, so the
// agent's connection was cut with no answer and the request had no audit
// record. Now it is a 502 with its record.
func TestUpstreamStatusBelow100(t *testing.T) {
	var port int
	h := newHarness(t, func(rt *policy.Runtime) {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { l.Close() })
		serveEach(l, func(c net.Conn) {
			if _, err := http.ReadRequest(bufio.NewReader(c)); err == nil {
				fmt.Fprint(c, "HTTP/1.1 000 Nothing\r\nContent-Length: 0\r\n\r\n")
			}
		})
		port = l.Addr().(*net.TCPAddr).Port
		rt.Policy.Ports = append(rt.Policy.Ports, port)
	})
	code, _, body, err := h.do(h.client(false), "GET", "http://plain.example.com:"+strconv.Itoa(port)+"/status0", nil, "")
	if err != nil || code != http.StatusBadGateway {
		t.Fatalf("got %d %v %q, want 502", code, err, body)
	}
	h.want(t, func(r audit.Record) bool { return r.Path == "/status0" }, audit.Blocked, "upstream")
}

// An agent that leaves while the upstream has not answered yet (a model
// thinking): the gateway gives up its upstream exchange at once (the
// upstream sees the connection end) instead of holding it until the
// upstream's answer or the 5-minute head timeout, and audits the request.
func TestInterceptedUpstreamAgentLeaves(t *testing.T) {
	gone := make(chan struct{})
	arrived := make(chan struct{}, 1)
	hold := make(chan struct{})
	t.Cleanup(func() { close(hold) })
	h, s := scriptedHarness(t, func(n int, c net.Conn, br *bufio.Reader) {
		if _, err := http.ReadRequest(br); err != nil {
			return
		}
		arrived <- struct{}{}
		go func() {
			_, _ = br.ReadByte() // returns when the gateway closes its end
			close(gone)
		}()
		<-hold
	})
	host := "api.example.com:" + strconv.Itoa(s.port)
	raw, code := h.connect(host, "")
	if code != 200 {
		t.Fatalf("CONNECT: %d", code)
	}
	tc := tls.Client(raw, &tls.Config{ServerName: "api.example.com", RootCAs: h.cagePool})
	fmt.Fprintf(tc, "GET /thinking HTTP/1.1\r\nHost: %s\r\n\r\n", host)
	h.want(t, func(r audit.Record) bool { return r.Event == audit.EventOpen && r.Host == "api.example.com" }, audit.Allowed, "")
	select { // the request reaches the upstream (a fixed 200 ms before)
	case <-arrived:
	case <-time.After(10 * time.Second):
		t.Fatal("the request never reached the upstream")
	}
	tc.Close()
	select {
	case <-gone:
	case <-time.After(10 * time.Second):
		t.Fatal("the gateway kept its upstream exchange after the agent left")
	}
	r := h.want(t, func(r audit.Record) bool { return r.Path == "/thinking" }, audit.Blocked, "upstream")
	if !strings.Contains(r.Reason, "abandoned by the agent") {
		t.Fatalf("record %+v: want the reason to say the agent left", r)
	}
}

// Two intercepted hosts on one upstream address: an upstream connection is
// reused only for the host whose certificate it verified, so a request
// (and the credential injected for its host) never travels on a TLS
// session made for another name, however the tunnels interleave.
func TestInterceptedUpstreamPerHost(t *testing.T) {
	var mu sync.Mutex
	var mismatch []string
	h, s := scriptedHarness(t, func(n int, c net.Conn, br *bufio.Reader) {
		for {
			req, err := http.ReadRequest(br)
			if err != nil {
				return
			}
			sni := c.(*tls.Conn).ConnectionState().ServerName
			if host, _, _ := net.SplitHostPort(req.Host); host != sni {
				mu.Lock()
				mismatch = append(mismatch, fmt.Sprintf("request for %s on a connection for %s", req.Host, sni))
				mu.Unlock()
			}
			answer(c, sni)
		}
	})
	for round := range 3 {
		for _, host := range []string{"api.example.com", "other.example.com"} {
			c := h.keepAliveClient()
			u := "https://" + host + ":" + strconv.Itoa(s.port) + "/r" + strconv.Itoa(round)
			code, _, body, err := h.do(c, "GET", u, http.Header{"X-Api-Key": {h.ph["anthropic"]}}, "")
			if host == "other.example.com" {
				// The placeholder is not bound there: refused before
				// anything goes upstream.
				if err != nil || code != http.StatusForbidden {
					t.Fatalf("%s with a placeholder: got %d %v %q, want 403", u, code, err, body)
				}
				code, _, body, err = h.do(c, "GET", u, nil, "")
			}
			if err != nil || code != 200 || body != host {
				t.Fatalf("%s: got %d %v %q", u, code, err, body)
			}
			c.Transport.(*http.Transport).CloseIdleConnections()
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if len(mismatch) > 0 {
		t.Fatalf("%q", mismatch)
	}
	if n := s.conns.Load(); n < 2 {
		t.Fatalf("upstream saw %d connection(s) for two hosts, want one per host at least", n)
	}
}
