package egress

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nixcage/nixcage/internal/egress/audit"
	"github.com/nixcage/nixcage/internal/policy"
)

// stalledPost opens a plain-HTTP connection through the proxy and sends a
// POST whose body never comes: it holds whatever the gateway gives it.
func (h *harness) stalledPost(t *testing.T, path string) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", h.proxyAddr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	fmt.Fprintf(c, "POST %s HTTP/1.1\r\nHost: plain.example.com\r\nContent-Length: 1000\r\n\r\nx", h.httpURL("plain.example.com", path))
	return c
}

// One cap for every path: plain-HTTP connections, CONNECT tunnels and
// HTTP/2 streams inside an intercepted tunnel all take max_tunnels slots; a
// stalled body is cut off by the body read timeout and frees its slot.
func TestThreatOneCapForEveryPath(t *testing.T) {
	h := newHarness(t, func(rt *policy.Runtime) {
		rt.Policy.Limits = policy.Limits{MaxTunnels: 4, MaxHeaderBytes: 8 << 10, MaxBodyBytes: 256 << 10, IdleTimeoutSeconds: 2}
	})
	t.Run("plain HTTP connections", func(t *testing.T) {
		var held []net.Conn
		for i := range 4 {
			held = append(held, h.stalledPost(t, fmt.Sprintf("/stall%d", i)))
		}
		time.Sleep(200 * time.Millisecond) // the gateway has accepted them
		code, hdr, body, err := h.do(h.client(false), "GET", h.httpURL("plain.example.com", "/fifth"), nil, "")
		if err != nil || code != http.StatusServiceUnavailable || hdr.Get("X-Nixcage-Egress") != "blocked" || !strings.Contains(body, "max_tunnels") {
			t.Fatalf("fifth connection with four stalled: %d %q %v, want 503 naming max_tunnels", code, body, err)
		}
		h.want(t, func(r audit.Record) bool { return r.Rule == "max-tunnels" }, audit.Blocked, "max-tunnels")
		// The stalled bodies hit the body read timeout: refused, audited,
		// connections closed, slots free again.
		for _, c := range held {
			c.SetReadDeadline(time.Now().Add(20 * time.Second))
			resp, err := http.ReadResponse(bufio.NewReader(c), nil)
			if err != nil {
				t.Fatalf("stalled body: no answer: %v", err)
			}
			resp.Body.Close()
			if resp.StatusCode < 400 {
				t.Fatalf("stalled body answered %d", resp.StatusCode)
			}
		}
		r := h.want(t, func(r audit.Record) bool { return r.Path == "/stall0" }, audit.Blocked, "")
		if !strings.Contains(r.Reason, "body read timeout") {
			t.Fatalf("stalled body record %+v", r)
		}
		waitFor(t, "slots freed", func() bool {
			code, _, _, err := h.do(h.client(false), "GET", h.httpURL("plain.example.com", "/after"), nil, "")
			return err == nil && code == http.StatusOK
		})
	})
	t.Run("HTTP/2 streams", func(t *testing.T) {
		c := h.client(true)
		var wg sync.WaitGroup
		codes := make(chan int, 6)
		var writers []*io.PipeWriter
		for i := range 6 {
			pr, pw := io.Pipe()
			writers = append(writers, pw)
			wg.Add(1)
			go func() {
				defer wg.Done()
				req, _ := http.NewRequest("POST", h.tlsURL("api.example.com", fmt.Sprintf("/stream%d", i)), pr)
				req.ContentLength = 1000
				resp, err := c.Do(req)
				if err != nil {
					codes <- 0
					return
				}
				resp.Body.Close()
				if resp.ProtoMajor != 2 {
					t.Errorf("stream %d over %s", i, resp.Proto)
				}
				codes <- resp.StatusCode
			}()
			pw.Write([]byte("x"))
		}
		// One slot is the tunnel, three are streams; the other three
		// streams are refused while those stall.
		refused := 0
		for range 3 {
			select {
			case code := <-codes:
				if code != http.StatusServiceUnavailable {
					t.Fatalf("stream over the cap: %d, want 503", code)
				}
				refused++
			case <-time.After(15 * time.Second):
				t.Fatalf("only %d of 6 streams refused with 4 slots", refused)
			}
		}
		h.want(t, func(r audit.Record) bool { return r.Rule == "max-tunnels" && strings.HasPrefix(r.Path, "/stream") }, audit.Blocked, "max-tunnels")
		for _, w := range writers {
			w.CloseWithError(io.ErrUnexpectedEOF)
		}
		wg.Wait()
	})
}
