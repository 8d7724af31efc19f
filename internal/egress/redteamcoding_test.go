package egress

// Red team of the content-coding decoders (red team redh2), as the caged
// agent through the real gateway binary: what a Content-Encoding header
// and a few bytes of body make the gateway hold.

import (
	"bufio"
	"bytes"
	"crypto/tls"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/andybalholm/brotli"

	"github.com/nixcage/nixcage/internal/egress/audit"
	"github.com/nixcage/nixcage/internal/policy"
)

// serveUpstream serves handler over TLS (HTTP/1.1, a leaf of the harness's
// upstream CA) on a port it adds to the harness's policy; the gateway is
// not started yet.
func serveUpstream(t *testing.T, h *harness, handler http.HandlerFunc) int {
	t.Helper()
	l := upstreamListener(t, filepath.Join(h.dir, "upstream-ca"))
	srv := &http.Server{ErrorLog: log.New(io.Discard, "", 0), Handler: handler}
	go srv.Serve(l)
	t.Cleanup(func() { srv.Close() })
	port := l.Addr().(*net.TCPAddr).Port
	h.rt.Policy.Ports = append(h.rt.Policy.Ports, port)
	h.writeConfig(h.rt)
	return port
}

// A Content-Encoding header may list any number of codings, and the
// gateway built a decoder for each before reading a byte of the body (a
// brotli reader is 38 KiB): "br,br,br,…" in one request header of 60 KB
// (max_header_bytes is 64 KiB) made the gateway allocate 750 MiB (its
// peak RSS grew by 130 MiB; 32 such streams on one HTTP/2 connection, 4 GiB), and a secret-bound upstream's response
// header, which could be 10 MiB then, 170 times that: one
// request, or one answer, and the gateway is past its unit's MemoryMax
// (512M) and killed, the cage's egress and audit with it. Either way the
// gateway must refuse the stack before building it, audited, and its
// peak memory must not move.
func TestRedTeamCodingStack(t *testing.T) {
	const layers = 20000 // 60 KB of header, under the default max_header_bytes
	stack := strings.TrimSuffix(strings.Repeat("br,", layers), ",")
	grew := func(t *testing.T, cmd *exec.Cmd, before int64) {
		t.Helper()
		if d := procStatus(t, cmd.Process.Pid, "VmHWM") - before; d > 32<<10 {
			t.Errorf("the gateway's peak memory grew by %d MiB for one request", d>>10)
		}
	}
	t.Run("request", func(t *testing.T) {
		h := setupHarness(t, func(rt *policy.Runtime) { rt.Policy.Limits.MaxHeaderBytes = 64 << 10 })
		cmd := h.startBinary(t)
		before := procStatus(t, cmd.Process.Pid, "VmHWM")
		code, _, body, err := h.do(h.client(false), "POST", h.httpURL("plain.example.com", "/upload"), http.Header{"Content-Encoding": {stack}}, "not much of a body")
		if err != nil {
			t.Fatal(err)
		}
		grew(t, cmd, before)
		if code != http.StatusUnsupportedMediaType || !strings.Contains(body, "codings") {
			t.Fatalf("agent got %d %q, want 415 naming the number of codings", code, body)
		}
		h.want(t, is("POST", "plain.example.com", h.up.httpPort), audit.Blocked, "content-encoding")
	})
	t.Run("response", func(t *testing.T) {
		h := setupHarness(t, nil)
		port := serveUpstream(t, h, func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Encoding", stack)
			io.WriteString(w, "not much of a body")
		})
		cmd := h.startBinary(t)
		before := procStatus(t, cmd.Process.Pid, "VmHWM")
		code, _, body, err := h.do(h.client(false), "GET", "https://api.example.com:"+strconv.Itoa(port)+"/v1/models", http.Header{"X-Api-Key": {h.ph["anthropic"]}}, "")
		if err != nil {
			t.Fatal(err)
		}
		grew(t, cmd, before)
		if code != http.StatusBadGateway || !strings.Contains(body, "codings") {
			t.Fatalf("agent got %d %q, want 502 naming the number of codings", code, body)
		}
		h.want(t, is("GET", "api.example.com", port), audit.Blocked, "content-encoding")
	})
}

// zstdFrame is one zstd frame (RFC 8878) whose header declares the window
// descriptor wd, holding data in one raw block.
func zstdFrame(wd byte, data string) []byte {
	b := []byte{0x28, 0xb5, 0x2f, 0xfd, 0x00, wd}
	n := len(data)<<3 | 1 // last block, raw
	b = append(b, byte(n), byte(n>>8), byte(n>>16))
	return append(b, data...)
}

// The zstd decoder took any window up to 32 MiB, and keeps a window of
// what it decoded: RFC 9659 bounds the zstd content coding's window at
// 8 MB (encoders must not use more, decoders need not take more). A frame
// declaring 32 MiB is refused before anything goes upstream; 8 MiB passes.
func TestRedTeamZstdWindowOverRFC9659(t *testing.T) {
	h := setupHarness(t, nil)
	h.startBinary(t)
	c := h.client(false)
	for _, tc := range []struct {
		wd   byte
		want int
	}{
		{0x78, http.StatusUnsupportedMediaType}, // 2^25: 32 MiB
		{0x69, http.StatusUnsupportedMediaType}, // 2^23 + 2^20: 9 MiB
		{0x68, http.StatusOK},                   // 2^23: 8 MiB
	} {
		path := fmt.Sprintf("/echo-zstd-%x", tc.wd)
		code, _, body, err := h.do(c, "POST", h.httpURL("plain.example.com", path), http.Header{"Content-Encoding": {"zstd"}}, string(zstdFrame(tc.wd, "hello, upstream")))
		if err != nil {
			t.Fatal(err)
		}
		if code != tc.want {
			t.Fatalf("window descriptor %#x: agent got %d %q, want %d", tc.wd, code, body, tc.want)
		}
		if code == http.StatusOK {
			if s := h.up.lastSeen(); s == nil || s.Body != "hello, upstream" {
				t.Fatalf("upstream saw %+v, want the decoded body", s)
			}
			continue
		}
		if !strings.Contains(body, "window") {
			t.Fatalf("window descriptor %#x: refusal %q does not name the window", tc.wd, body)
		}
		r := h.want(t, is("POST", "plain.example.com", h.up.httpPort), audit.Blocked, "content-encoding")
		if r.Path != path {
			t.Fatalf("audit record %+v, want path %s", r, path)
		}
	}
}

// brotliZeros is a brotli stream with a 16 MiB window (WBITS 24) that
// decodes to 16 MiB of zeros from a few hundred bytes: a decoder that read
// most of it holds a 16 MiB ring buffer, filled.
func brotliZeros(t *testing.T) []byte {
	t.Helper()
	var buf bytes.Buffer
	bw := brotli.NewWriterOptions(&buf, brotli.WriterOptions{Quality: 5, LGWin: 24})
	zeros := make([]byte, 1<<20)
	for range 16 {
		bw.Write(zeros)
		if err := bw.Flush(); err != nil {
			t.Fatal(err)
		}
	}
	if err := bw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// Each decoder keeps its window (a brotli ring buffer of up to 16 MiB, a
// zstd history of up to the frame's window) for as long as its body is
// open, and a body stays open as long as the agent trickles it in (the
// body read timeouts) or the upstream reads it slowly, on as many
// requests as max_tunnels allows: 16 uploads of a few hundred bytes of
// brotli each, to an upstream that stops reading after 12 MiB, held 355
// to 382 MiB of the gateway (its unit's MemoryMax is 512M; max_tunnels 256
// would have held 4 GiB). The decoders' windows held at once are bounded
// over the whole gateway: the uploads past the bound are refused (503,
// decoder-memory, audited), the gateway's memory stays far below what the
// uploads ask for, and the bound is given back when the bodies end.
func TestRedTeamDecoderWindowsHeldAtOnce(t *testing.T) {
	const uploads = 16
	const stallAt = 12 << 20
	var mu sync.Mutex
	got := map[string]int64{} // bytes the sink received, by path
	stall := make(chan struct{})
	sink := &http.Server{ErrorLog: log.New(io.Discard, "", 0), Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		buf := make([]byte, 64<<10)
		for {
			n, err := r.Body.Read(buf)
			mu.Lock()
			got[r.URL.Path] += int64(n)
			full := got[r.URL.Path] >= stallAt
			mu.Unlock()
			if full && strings.HasPrefix(r.URL.Path, "/u/") {
				<-stall
			}
			if err != nil {
				break
			}
		}
		io.WriteString(w, "stored\n")
	})}
	sl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go sink.Serve(sl)
	t.Cleanup(func() { sink.Close() })
	var once sync.Once
	unstall := func() { once.Do(func() { close(stall) }) }
	t.Cleanup(unstall)
	port := sl.Addr().(*net.TCPAddr).Port
	h := setupHarness(t, func(rt *policy.Runtime) {
		rt.Policy.Ports = append(rt.Policy.Ports, port)
		rt.Policy.Limits.MaxBodyBytes = 1 << 30 // the body is never refused for its size
	})
	h.dns.set("sink.example.com", "A", "127.0.0.1")
	cmd := h.startBinary(t)
	body := string(brotliZeros(t))
	base := procStatus(t, cmd.Process.Pid, "VmRSS")

	type result struct {
		path string
		code int
		err  error
	}
	results := make(chan result, uploads)
	c := h.client(false)
	for i := range uploads {
		path := "/u/" + strconv.Itoa(i)
		go func() {
			code, _, _, err := h.do(c, "POST", "http://sink.example.com:"+strconv.Itoa(port)+path, http.Header{"Content-Encoding": {"br"}}, body)
			results <- result{path, code, err}
		}()
	}
	// Every upload is either refused or has had 12 MiB decoded and sent
	// on, and waits for the upstream to read the rest.
	refused := 0
	// Not waitFor's 10 s: 64 MiB decoded, inspected and sent on by a
	// gateway sharing two cores with other tests.
	deadline := time.Now().Add(2 * time.Minute)
	for !func() bool {
		for {
			select {
			case r := <-results:
				if r.err != nil || r.code != http.StatusServiceUnavailable {
					t.Fatalf("upload %s: %d %v before the upstream read it, want 503 or no answer yet", r.path, r.code, r.err)
				}
				refused++
				continue
			default:
			}
			break
		}
		mu.Lock()
		defer mu.Unlock()
		stalled := 0
		for _, n := range got {
			if n >= stallAt {
				stalled++
			}
		}
		return refused+stalled == uploads
	}() {
		if time.Now().After(deadline) {
			mu.Lock()
			defer mu.Unlock()
			t.Fatalf("uploads neither refused nor stalled upstream after 2 minutes: %d refused, upstream got %v", refused, got)
		}
		time.Sleep(20 * time.Millisecond)
	}
	rss := procStatus(t, cmd.Process.Pid, "VmRSS")
	t.Logf("%d uploads, %d refused; gateway RSS %d MiB, %d MiB at start", uploads, refused, rss>>10, base>>10)
	if d := rss - base; d > 160<<10 {
		t.Errorf("%d brotli uploads of %d bytes each hold %d MiB of the gateway (%d refused)", uploads, len(body), d>>10, refused)
	}
	if refused == 0 {
		t.Errorf("no upload refused")
	} else {
		h.want(t, is("POST", "sink.example.com", port), audit.Blocked, "decoder-memory")
	}
	// The held ones finish once the upstream reads on, and the windows are
	// given back: another upload goes through.
	unstall()
	for range uploads - refused {
		if r := <-results; r.err != nil || r.code != http.StatusOK {
			t.Fatalf("upload %s: %d %v, want the sink's 200", r.path, r.code, r.err)
		}
	}
	code, _, out, err := h.do(c, "POST", "http://sink.example.com:"+strconv.Itoa(port)+"/after", http.Header{"Content-Encoding": {"br"}}, body)
	if err != nil || code != http.StatusOK || out != "stored\n" {
		t.Fatalf("upload after the others ended: %d %q %v", code, out, err)
	}
}

// An upstream's response head could be up to 10 MiB (net/http's
// Transport's default, which the intercepted path copied), and the gateway
// holds it parsed while it writes it to an agent that does not read:
// 16 tunnels whose upstream answered with a 9 MiB header held over 200 MiB
// of the gateway (its unit's MemoryMax is 512M; max_tunnels 256 allows 28
// times that). The agent, through the real binary: HTTP/1.1 and HTTP/2
// requests on intercepted tunnels to an upstream answering with a head
// over the gateway's bound are refused (502, rule upstream, audited) and
// the gateway's memory does not grow with them.
func TestRedTeamUpstreamHugeResponseHead(t *testing.T) {
	h := setupHarness(t, nil)
	big := strings.Repeat("h", 9<<20)
	l := upstreamListener(t, filepath.Join(h.dir, "upstream-ca"))
	serveEach(l, func(c net.Conn) {
		br := bufio.NewReader(c)
		for {
			if _, err := http.ReadRequest(br); err != nil {
				return
			}
			if _, err := io.WriteString(c, "HTTP/1.1 200 OK\r\nX-Big: "+big+"\r\nContent-Length: 2\r\n\r\nok"); err != nil {
				return
			}
		}
	})
	port := l.Addr().(*net.TCPAddr).Port
	h.rt.Policy.Ports = append(h.rt.Policy.Ports, port)
	h.writeConfig(h.rt)
	cmd := h.startBinary(t)
	base := procStatus(t, cmd.Process.Pid, "VmRSS")
	authority := "api.example.com:" + strconv.Itoa(port)
	const tunnels = 16
	for i := range tunnels {
		c, code := h.connect(authority, "")
		if code != http.StatusOK {
			t.Fatalf("CONNECT: %d", code)
		}
		defer c.Close()
		tc := tls.Client(c, &tls.Config{RootCAs: h.cagePool, ServerName: "api.example.com", NextProtos: []string{"http/1.1"}})
		// The agent asks, and does not read the answer.
		fmt.Fprintf(tc, "GET /big/%d HTTP/1.1\r\nHost: %s\r\n\r\n", i, authority)
	}
	// Every request has reached the upstream and had its answer (or
	// refusal) begun: one record each, or the gateway blocked writing.
	deadline := time.Now().Add(2 * time.Minute)
	var rss int64
	for {
		rss = procStatus(t, cmd.Process.Pid, "VmRSS")
		n := 0
		for _, r := range h.records(t) {
			if r.Method == "GET" && r.Port == port {
				n++
			}
		}
		if n == tunnels || rss-base > 160<<10 || time.Now().After(deadline) {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Logf("gateway RSS %d MiB, %d MiB at start", rss>>10, base>>10)
	if d := rss - base; d > 64<<10 {
		t.Fatalf("%d tunnels whose upstream sent a 9 MiB head hold %d MiB of the gateway", tunnels, d>>10)
	}
	r := h.want(t, is("GET", "api.example.com", port), audit.Blocked, "upstream")
	if !strings.Contains(r.Reason, "head exceeds") {
		t.Fatalf("audit record %+v, want the head's size named", r)
	}
	// HTTP/2 from the agent goes through net/http's Transport: the same
	// bound.
	code, _, body, err := h.do(h.client(true), "GET", "https://"+authority+"/big/h2", nil, "")
	if err != nil || code != http.StatusBadGateway {
		t.Fatalf("HTTP/2: %d %q %v, want 502", code, body, err)
	}
	h.want(t, is("GET", "api.example.com", port), audit.Blocked, "upstream")
}

// A WebSocket handshake the upstream answers with an ordinary response
// goes through the redact stage as any answer does, but a refusal that
// stage made (here a coding stack past the bound, before anything was
// written) was taken for a copy error: the agent got an empty 200 that the
// upstream never sent, and the record said "allowed". As the agent
// through the real binary: the refusal reaches the agent and the record.
func TestRedTeamWebSocketHandshakeAnswerRefused(t *testing.T) {
	h := setupHarness(t, nil)
	port := serveUpstream(t, h, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Encoding", "gzip, gzip, gzip, gzip, gzip")
		w.WriteHeader(http.StatusUnauthorized)
		io.WriteString(w, "no")
	})
	h.startBinary(t)
	hdr := http.Header{"Connection": {"Upgrade"}, "Upgrade": {"websocket"}, "Sec-Websocket-Version": {"13"}, "Sec-Websocket-Key": {"dGhlIHNhbXBsZSBub25jZQ=="}}
	code, _, body, err := h.do(h.client(false), "GET", "https://api.example.com:"+strconv.Itoa(port)+"/ws", hdr, "")
	if err != nil {
		t.Fatal(err)
	}
	if code != http.StatusBadGateway || !strings.Contains(body, "codings") {
		t.Fatalf("agent got %d %q, want the gateway's 502 naming the codings", code, body)
	}
	h.want(t, is("GET", "api.example.com", port), audit.Blocked, "content-encoding")
}
