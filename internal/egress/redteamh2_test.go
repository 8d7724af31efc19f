package egress

// Red team of the intercepted HTTP/2 path (red team redh2), as the caged
// agent with a hostile upstream among its allowed hosts: the agent speaks
// HTTP/2 to the gateway, the gateway's HTTP/2 Transport speaks HTTP/2 to an
// upstream that writes raw frames (rawH2Upstream), so it can answer what no
// well-behaved server library would send.

import (
	"bufio"
	"encoding/binary"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/nixcage/nixcage/internal/egress/audit"
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
