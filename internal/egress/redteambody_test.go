package egress

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/klauspost/compress/zstd"

	"github.com/nixcage/nixcage/internal/egress/audit"
	"github.com/nixcage/nixcage/internal/policy"
)

// tinyBlocksZstd is one zstd frame of n blocks of about 64 decoded bytes
// each (one per Flush): a decoder reading it spends its time in its own
// code between short reads, not waiting on the reader under it.
func tinyBlocksZstd(t *testing.T, n int) []byte {
	t.Helper()
	var buf bytes.Buffer
	zw, err := zstd.NewWriter(&buf, zstd.WithEncoderConcurrency(1))
	if err != nil {
		t.Fatal(err)
	}
	for i := range n {
		fmt.Fprintf(zw, "line %08d of an upload the upstream did not wait for..........\n", i)
		if err := zw.Flush(); err != nil {
			t.Fatal(err)
		}
	}
	if err := zw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// An upstream that answers a POST at once and reads its body on (the
// gateway's HTTP/1.1 Transport goes on writing the body on its own
// goroutine after the handler has returned), while the agent streams a
// zstd-coded body fast. The handler's end closed the body's zstd decoder
// under the Transport's read of it: a nil dereference in the decoder (or a
// send on its closed channel), and the gateway died, taking every cage
// connection with it. The real binary, as the agent: a plain-proxy POST
// with Content-Encoding: zstd, again and again; the gateway must still be
// there, without a panic in its log, with each request audited.
func TestBodyDecoderClosedUnderTransportRead(t *testing.T) {
	sink, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer sink.Close()
	port := sink.Addr().(*net.TCPAddr).Port
	serveEach(sink, func(c net.Conn) {
		br := bufio.NewReader(c)
		for {
			if _, err := http.ReadRequest(br); err != nil {
				return
			}
			// Answered before any of the body is read; the body is then
			// read on and thrown away.
			if _, err := io.WriteString(c, "HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"); err != nil {
				return
			}
			if _, err := io.Copy(io.Discard, br); err != nil {
				return
			}
		}
	})
	h := setupHarness(t, func(rt *policy.Runtime) {
		rt.Policy.Ports = append(rt.Policy.Ports, port)
		rt.Policy.Limits.MaxBodyBytes = 1 << 40 // the body is never refused for its size
	})
	h.dns.set("sink.example.com", "A", "127.0.0.1")
	cmd := h.startBinary(t)
	frame := tinyBlocksZstd(t, 4000)

	const attempts = 100
	target := "http://sink.example.com:" + strconv.Itoa(port) + "/upload"
	for i := range attempts {
		c, err := net.Dial("tcp", h.proxyAddr)
		if err != nil {
			if p := h.panicked(); p != "" {
				t.Fatalf("the gateway crashed after %d uploads:\n%s", i, p)
			}
			t.Fatalf("dial the gateway: %v", err)
		}
		fmt.Fprintf(c, "POST %s HTTP/1.1\r\nHost: sink.example.com:%d\r\nContent-Encoding: zstd\r\nTransfer-Encoding: chunked\r\n\r\n", target, port)
		var wg sync.WaitGroup
		stop := make(chan struct{})
		wg.Add(1)
		go func() {
			defer wg.Done()
			bw := bufio.NewWriterSize(c, 64<<10)
			for {
				// Concatenated frames, one chunk each: a body as long as
				// the agent likes.
				fmt.Fprintf(bw, "%x\r\n", len(frame))
				bw.Write(frame)
				bw.WriteString("\r\n")
				if bw.Flush() != nil {
					return
				}
				select {
				case <-stop:
					return
				default:
				}
			}
		}()
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err == nil {
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		}
		// The agent goes on uploading a little after its answer.
		time.Sleep(5 * time.Millisecond)
		close(stop)
		c.Close()
		wg.Wait()
		if p := h.panicked(); p != "" {
			t.Fatalf("the gateway crashed after %d uploads:\n%s", i+1, p)
		}
		if err != nil {
			t.Fatalf("upload %d: no answer from the gateway: %v", i, err)
		}
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("upload %d: status %d, want the upstream's 200", i, resp.StatusCode)
		}
	}
	code, _, _, err := h.do(h.client(false), "GET", h.httpURL("plain.example.com", "/after"), nil, "")
	if p := h.panicked(); p != "" {
		t.Fatalf("the gateway crashed:\n%s", p)
	}
	if err != nil || code != http.StatusOK {
		t.Fatalf("the gateway does not serve after the uploads: %d, %v", code, err)
	}
	if cmd.ProcessState != nil {
		t.Fatalf("the gateway exited: %v", cmd.ProcessState)
	}
	// Every upload is on record, answered by the upstream.
	count := func() (n int) {
		for _, r := range h.records(t) {
			if r.Method == "POST" && r.Host == "sink.example.com" && r.Decision != audit.Blocked {
				n++
			}
		}
		return n
	}
	waitFor(t, "an audit record per upload", func() bool { return count() == attempts })
}
