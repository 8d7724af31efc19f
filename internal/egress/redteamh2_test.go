package egress

// Red team of the intercepted HTTP/2 path (red team redh2), as the caged
// agent with a hostile upstream among its allowed hosts: the agent speaks
// HTTP/2 to the gateway, the gateway's HTTP/2 Transport speaks HTTP/2 to an
// upstream that writes raw frames (rawH2Upstream), so it can answer what no
// well-behaved server library would send.

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nixcage/nixcage/internal/egress/audit"
	"github.com/nixcage/nixcage/internal/policy"
)

// HTTP/2 frame types and flags (RFC 9113 §6) the raw upstream uses.
const (
	h2Data         = 0x0
	h2Headers      = 0x1
	h2RSTStream    = 0x3
	h2Settings     = 0x4
	h2GoAway       = 0x7
	h2WindowUpdate = 0x8

	h2EndStream  = 0x1
	h2Ack        = 0x1
	h2EndHeaders = 0x4
)

type h2Frame struct {
	typ, flags byte
	stream     uint32
	payload    []byte
}

func readH2Frame(r io.Reader) (h2Frame, error) {
	var hd [9]byte
	if _, err := io.ReadFull(r, hd[:]); err != nil {
		return h2Frame{}, err
	}
	n := int(hd[0])<<16 | int(hd[1])<<8 | int(hd[2])
	f := h2Frame{typ: hd[3], flags: hd[4], stream: binary.BigEndian.Uint32(hd[5:]) & 0x7fffffff, payload: make([]byte, n)}
	_, err := io.ReadFull(r, f.payload)
	return f, err
}

// h2Conn is the raw upstream's side of one connection; writes are
// serialized (the test's own goroutines may write frames too).
type h2Conn struct {
	c  net.Conn
	br *bufio.Reader
	mu sync.Mutex
}

func (c *h2Conn) write(typ, flags byte, stream uint32, payload []byte) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	hd := []byte{byte(len(payload) >> 16), byte(len(payload) >> 8), byte(len(payload)), typ, flags, 0, 0, 0, 0}
	binary.BigEndian.PutUint32(hd[5:], stream)
	_, err := c.c.Write(append(hd, payload...))
	return err
}

// hpackLiterals encodes header fields as HPACK literals without indexing
// and without Huffman coding (RFC 7541 §6.2.2): what a decoder must take
// whatever the values say.
func hpackLiterals(kv ...string) []byte {
	var b []byte
	str := func(s string) {
		n := len(s)
		if n < 127 {
			b = append(b, byte(n))
		} else {
			b = append(b, 127)
			for n -= 127; n >= 128; n >>= 7 {
				b = append(b, byte(n%128+128))
			}
			b = append(b, byte(n))
		}
		b = append(b, s...)
	}
	for i := 0; i+1 < len(kv); i += 2 {
		b = append(b, 0)
		str(kv[i])
		str(kv[i+1])
	}
	return b
}

// rawH2Upstream serves HTTP/2 over TLS (ALPN h2) with leaves of the
// harness's upstream CA. After the preface and SETTINGS, onFrame sees
// every frame the gateway sends but SETTINGS (acknowledged here); what it
// writes back is the test's. It returns the listener's port.
func rawH2Upstream(t *testing.T, h *harness, onFrame func(c *h2Conn, f h2Frame) error) int {
	t.Helper()
	l := upstreamListener(t, filepath.Join(h.dir, "upstream-ca"), "h2")
	serveEach(l, func(nc net.Conn) {
		c := &h2Conn{c: nc, br: bufio.NewReader(nc)}
		preface := make([]byte, 24)
		if _, err := io.ReadFull(c.br, preface); err != nil || string(preface) != "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" {
			return
		}
		if c.write(h2Settings, 0, 0, nil) != nil {
			return
		}
		for {
			f, err := readH2Frame(c.br)
			if err != nil {
				return
			}
			if f.typ == h2Settings {
				if f.flags&h2Ack == 0 && c.write(h2Settings, h2Ack, 0, nil) != nil {
					return
				}
				continue
			}
			if onFrame(c, f) != nil {
				return
			}
		}
	})
	return l.Addr().(*net.TCPAddr).Port
}

// gatewayPanic returns the panic in the gateway's log, if there is one
// (a handler's panic that net/http recovered is logged "panic serving").
func (h *harness) gatewayPanic() string {
	h.logMu.Lock()
	defer h.logMu.Unlock()
	log := h.logBuf.String()
	if i := strings.Index(log, "panic"); i >= 0 {
		return log[max(0, i-200):min(len(log), i+3000)]
	}
	return ""
}

// An HTTP/2 upstream may put any digits in :status (net/http's HTTP/2
// Transport takes whatever strconv.Atoi does); the gateway wrote a status
// over 999 to the agent's stream, and net/http's server panics on that:
// the handler died after the request, its real key injected, had reached
// the upstream, and nothing was written to the audit (net/http recovers a
// handler's panic, so the gateway stayed up, and the agent got a reset
// stream). As the agent: HTTP/2 through the real gateway binary, with the
// placeholder; the request must be answered with a refusal naming the
// status and audited.
func TestRedTeamH2UpstreamStatusOutOfRange(t *testing.T) {
	h := setupHarness(t, nil)
	var mu sync.Mutex
	requests := 0
	status := ""
	port := rawH2Upstream(t, h, func(c *h2Conn, f h2Frame) error {
		if f.typ != h2Headers {
			return nil
		}
		mu.Lock()
		requests++
		st := status
		mu.Unlock()
		return c.write(h2Headers, h2EndHeaders|h2EndStream, f.stream, hpackLiterals(":status", st, "content-length", "0"))
	})
	h.rt.Policy.Ports = append(h.rt.Policy.Ports, port)
	h.writeConfig(h.rt)
	h.startBinary(t)
	c := h.client(true)
	u := "https://api.example.com:" + strconv.Itoa(port) + "/v1/messages"
	for i, st := range []string{"1000", "2147483647", "99999999999999999"} {
		mu.Lock()
		status = st
		mu.Unlock()
		path := "/v1/messages/" + strconv.Itoa(i)
		code, _, body, err := h.do(c, "GET", u+"/"+strconv.Itoa(i), http.Header{"X-Api-Key": {h.ph["anthropic"]}}, "")
		if p := h.gatewayPanic(); p != "" {
			t.Fatalf(":status %s: the gateway's handler panicked:\n%s", st, p)
		}
		if err != nil {
			t.Fatalf(":status %s: the agent got no answer: %v", st, err)
		}
		if code != http.StatusBadGateway || !strings.Contains(body, st) {
			t.Fatalf(":status %s: agent got %d %q, want a 502 naming the status", st, code, body)
		}
		r := h.want(t, is("GET", "api.example.com", port), audit.Blocked, "upstream")
		if r.Path != path || !strings.Contains(r.Reason, st) {
			t.Fatalf(":status %s: audit record %+v, want path %s and the status in the reason", st, r, path)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if requests != 3 {
		t.Fatalf("the upstream saw %d requests, want 3", requests)
	}
}

// windowUpdates gives back the flow-control credit of a DATA frame, for
// the connection and the stream, as a server reading the body would.
func (c *h2Conn) windowUpdates(f h2Frame) error {
	if f.typ != h2Data || len(f.payload) == 0 {
		return nil
	}
	inc := binary.BigEndian.AppendUint32(nil, uint32(len(f.payload)))
	if err := c.write(h2WindowUpdate, 0, 0, inc); err != nil {
		return err
	}
	return c.write(h2WindowUpdate, 0, f.stream, inc)
}

// The agent uploads over HTTP/2 while the upstream, also HTTP/2, ends the
// exchange under it: it answers the request's HEADERS at once with
// END_STREAM and no body, answers and then resets the stream, resets it
// without answering, or sends GOAWAY and closes the connection; and the
// agent, for its part, resets some streams mid-upload (RST_STREAM
// CANCEL). net/http's HTTP/2 Transport goes on reading the body after the
// handler's RoundTrip returned, which crashed the gateway twice before
// (deadlineBody's detach, bodyStream's close); this is the recipe that was
// left to run, with plain and zstd-coded bodies, through the real binary.
// The gateway must stay up without a panic, answer or drop each stream,
// and write one record per request.
func TestRedTeamH2UploadEndedUnderIt(t *testing.T) {
	h := setupHarness(t, func(rt *policy.Runtime) { rt.Policy.Limits.MaxBodyBytes = 1 << 40 })
	var mu sync.Mutex
	n := 0
	port := rawH2Upstream(t, h, func(c *h2Conn, f h2Frame) error {
		if err := c.windowUpdates(f); err != nil {
			return err
		}
		if f.typ != h2Headers {
			return nil
		}
		mu.Lock()
		mode := n % 4
		n++
		mu.Unlock()
		ok := hpackLiterals(":status", "200", "content-length", "0")
		switch mode {
		case 0: // answered at once, the upload not read
			return c.write(h2Headers, h2EndHeaders|h2EndStream, f.stream, ok)
		case 1: // answered, then the stream reset
			if err := c.write(h2Headers, h2EndHeaders|h2EndStream, f.stream, ok); err != nil {
				return err
			}
			return c.write(h2RSTStream, 0, f.stream, binary.BigEndian.AppendUint32(nil, 0x8)) // CANCEL
		case 2: // reset, unanswered
			return c.write(h2RSTStream, 0, f.stream, binary.BigEndian.AppendUint32(nil, 0x2)) // INTERNAL_ERROR
		default: // the connection goes away under every stream on it
			// Last stream: this one, so the gateway's Transport does not
			// send it again (the count of requests upstream stays one
			// per request); nothing after it is read.
			c.write(h2GoAway, 0, 0, binary.BigEndian.AppendUint32(binary.BigEndian.AppendUint32(nil, f.stream), 0x0))
			return errors.New("gone")
		}
	})
	h.rt.Policy.Ports = append(h.rt.Policy.Ports, port)
	h.writeConfig(h.rt)
	h.startBinary(t)
	c := h.client(true)
	frame := tinyBlocksZstd(t, 200)
	plain := bytes.Repeat([]byte("an upload the upstream will not wait for\n"), 400)
	const rounds = 48
	unserved := map[int]bool{}
	outcome := map[int]string{}
	var wg sync.WaitGroup
	sem := make(chan struct{}, 4)
	for i := range rounds {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			pr, pw := io.Pipe()
			req, _ := http.NewRequestWithContext(ctx, "POST", "https://api.example.com:"+strconv.Itoa(port)+"/upload/"+strconv.Itoa(i), pr)
			chunk := plain
			if i%2 == 1 {
				req.Header.Set("Content-Encoding", "zstd")
				chunk = frame
			}
			agentResets := i%3 == 2
			go func() {
				// As long as the agent likes: until the stream is gone.
				for k := 0; ; k++ {
					if _, err := pw.Write(chunk); err != nil {
						return
					}
					if agentResets && k == 8 {
						cancel()
					}
				}
			}()
			resp, err := c.Do(req)
			mu.Lock()
			outcome[i] = fmt.Sprint(err)
			if err == nil {
				outcome[i] = resp.Status
			}
			mu.Unlock()
			if err == nil {
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			} else {
				// A refusal closes the agent's connection (Connection:
				// close: a graceful GOAWAY on HTTP/2, then the close),
				// so a stream opened after it was never served, by the
				// gateway's word ("cannot retry ... GOAWAY", "cannot
				// rewind body after connection loss"); a stream the
				// agent reset may have been dropped before its handler
				// started. None may have reached the upstream
				// unrecorded (below).
				mu.Lock()
				unserved[i] = true
				mu.Unlock()
			}
			pr.CloseWithError(errors.New("the agent is done"))
		}()
	}
	wg.Wait()
	if p := h.gatewayPanic(); p != "" {
		t.Fatalf("the gateway panicked:\n%s", p)
	}
	code, _, _, err := h.do(c, "GET", h.tlsURL("api.example.com", "/after"), nil, "")
	if err != nil || code != http.StatusOK {
		t.Fatalf("the gateway does not serve after the uploads: %d, %v", code, err)
	}
	// Every upload the gateway served has its record, and every request
	// that reached the upstream does.
	missing := func() (miss []int) {
		seen := map[string]bool{}
		for _, r := range h.records(t) {
			if r.Method == "POST" && r.Host == "api.example.com" && r.Port == port {
				seen[r.Path] = true
			}
		}
		mu.Lock()
		defer mu.Unlock()
		if len(seen) < n {
			miss = append(miss, -1)
		}
		for i := range rounds {
			if !seen["/upload/"+strconv.Itoa(i)] && !unserved[i] {
				miss = append(miss, i)
			}
		}
		return miss
	}
	deadline := time.Now().Add(time.Minute)
	for len(missing()) > 0 {
		if time.Now().After(deadline) {
			miss := missing()
			mu.Lock()
			for _, i := range miss {
				t.Logf("upload %d: %s", i, outcome[i])
			}
			t.Logf("the upstream saw %d requests", n)
			mu.Unlock()
			t.Fatalf("no audit record for uploads %v (-1: fewer records than requests upstream):\n%s", miss, h.dump())
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Logf("%d uploads, %d reached the upstream, %d reset by the agent or lost with a connection a refusal closed", rounds, n, len(unserved))
}

// net/http's HTTP/2 Transport lets an upstream send 4 MiB per stream (and
// 1 GiB per connection) before the gateway reads any of it, and the
// gateway reads a response only as fast as the agent takes it: an agent
// that asks for big responses on many HTTP/2 streams and reads none made
// the gateway buffer 4 MiB of each (48 streams: 199 MiB; max_tunnels 256
// allows 1 GiB, and the unit's MemoryMax is 512M), from any allowed
// upstream serving big bodies over HTTP/2, no hostile one needed. As the
// agent through the real binary: 48 streams over two HTTP/2 connections
// whose client advertises a small window and reads nothing; the gateway's
// memory must not grow with what the upstream has to send.
func TestRedTeamH2UpstreamWindowHeldForAgentNotReading(t *testing.T) {
	h := setupHarness(t, func(rt *policy.Runtime) { rt.Policy.Limits.MaxTunnels = 256 })
	cmd := h.startBinary(t)
	base := procStatus(t, cmd.Process.Pid, "VmRSS")
	pu, _ := url.Parse("http://" + h.proxyAddr)
	const conns, streams = 2, 24
	var resps []*http.Response
	var mu sync.Mutex
	var wg sync.WaitGroup
	for range conns {
		// An agent that reads nothing: its own window is small.
		tr := &http.Transport{
			Proxy:             http.ProxyURL(pu),
			TLSClientConfig:   &tls.Config{RootCAs: h.cagePool},
			ForceAttemptHTTP2: true,
			HTTP2:             &http.HTTP2Config{MaxReceiveBufferPerConnection: 64 << 10, MaxReceiveBufferPerStream: 16 << 10},
		}
		t.Cleanup(tr.CloseIdleConnections)
		c := &http.Client{Transport: tr}
		for range streams {
			wg.Add(1)
			go func() {
				defer wg.Done()
				resp, err := c.Get(h.tlsURL("api.example.com", "/stream?n=67108864"))
				if err != nil {
					t.Errorf("GET: %v", err)
					return
				}
				mu.Lock()
				resps = append(resps, resp)
				mu.Unlock()
			}()
		}
	}
	wg.Wait()
	defer func() {
		for _, r := range resps {
			r.Body.Close()
		}
	}()
	for _, r := range resps {
		if r.ProtoMajor != 2 {
			t.Fatalf("agent got %s, want HTTP/2", r.Proto)
		}
	}
	// The upstream sends until the gateway's windows are full; the
	// gateway's memory settles.
	var rss int64
	for prev, stable := int64(0), 0; stable < 10; {
		time.Sleep(100 * time.Millisecond)
		rss = procStatus(t, cmd.Process.Pid, "VmRSS")
		if rss-prev < 1<<10 {
			stable++
		} else {
			stable = 0
		}
		prev = rss
	}
	t.Logf("%d streams not read: gateway RSS %d MiB, %d MiB at start", len(resps), rss>>10, base>>10)
	if d := rss - base; d > 64<<10 {
		t.Fatalf("%d HTTP/2 streams the agent does not read hold %d MiB of the gateway", len(resps), d>>10)
	}
}
