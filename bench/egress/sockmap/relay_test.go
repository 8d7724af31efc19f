package main

import (
	"bytes"
	"crypto/sha256"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"strings"
	"sync"
	"testing"
	"time"
)

// needBPF skips unless this process can create the relay's BPF objects.
func needBPF(t *testing.T) *kernel {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: the relay creates sockmaps and loads an SK_SKB program (CAP_BPF, CAP_NET_ADMIN)")
	}
	k, err := newKernel()
	if err != nil {
		t.Skipf("bpf sockmap unavailable on this kernel: %v", err)
	}
	t.Cleanup(func() { k.Close() })
	return k
}

func newTestRelay(t *testing.T, k *kernel, pause bool) *relay {
	t.Helper()
	r, err := newRelay(k, pause)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(r.Close)
	return r
}

// conns is one relayed connection seen from its two far ends: client
// talks to the relay's accepted socket, server to its dialed one.
type conns struct{ client, server *net.TCPConn }

// pairUp makes two loopback connections, calls before with their far ends
// (to queue data before the relay joins them), then joins the near ends.
func pairUp(t *testing.T, r *relay, before func(conns)) conns {
	t.Helper()
	var c conns
	var near [2]*net.TCPConn
	for i := range 2 {
		l, err := net.ListenTCP("tcp", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
		if err != nil {
			t.Fatal(err)
		}
		far, err := net.DialTCP("tcp", nil, l.Addr().(*net.TCPAddr))
		if err != nil {
			t.Fatal(err)
		}
		n, err := l.AcceptTCP()
		l.Close()
		if err != nil {
			t.Fatal(err)
		}
		near[i] = n
		if i == 0 {
			c.client = far
		} else {
			c.server = far
		}
	}
	t.Cleanup(func() { c.client.Close(); c.server.Close() })
	if before != nil {
		before(c)
	}
	a, err := detach(near[0])
	if err != nil {
		t.Fatal(err)
	}
	b, err := detach(near[1])
	if err != nil {
		t.Fatal(err)
	}
	if err := r.join(a, b); err != nil {
		t.Fatal(err)
	}
	return c
}

func payload(seed uint64, n int) []byte {
	b := make([]byte, n)
	rng := rand.NewChaCha8([32]byte{byte(seed), byte(seed >> 8)})
	rng.Read(b)
	return b
}

// side sends data on c, then shuts its write side, while reading c to
// EOF; it returns what it read.
type side struct {
	got []byte
	err error
}

func exchange(c *net.TCPConn, data []byte, delay time.Duration, wg *sync.WaitGroup, out *side) {
	wg.Add(2)
	go func() {
		defer wg.Done()
		if _, err := c.Write(data); err != nil {
			out.err = err
		}
		c.CloseWrite()
	}()
	go func() {
		defer wg.Done()
		c.SetReadDeadline(time.Now().Add(60 * time.Second))
		var buf bytes.Buffer
		chunk := make([]byte, 64<<10)
		for {
			n, err := c.Read(chunk)
			buf.Write(chunk[:n])
			if err == io.EOF {
				break
			}
			if err != nil {
				out.err = err
				break
			}
			if delay > 0 {
				time.Sleep(delay)
			}
		}
		out.got = buf.Bytes()
	}()
}

func sameBytes(t *testing.T, what string, got, want []byte) {
	t.Helper()
	if len(got) != len(want) || sha256.Sum256(got) != sha256.Sum256(want) {
		t.Errorf("%s: got %d bytes (sha256 %x), want %d (%x)", what, len(got), sha256.Sum256(got), len(want), sha256.Sum256(want))
	}
}

// waitPairs waits until the relay has closed n pairs.
func waitPairs(t *testing.T, r *relay, n int) totals {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for r.stats().Pairs < n {
		if time.Now().After(deadline) {
			t.Fatalf("relay closed %d pairs, want %d", r.stats().Pairs, n)
		}
		time.Sleep(10 * time.Millisecond)
	}
	return r.stats()
}

// TestTransferHalfClose: both far ends write at once (some of it queued
// before the relay joins the sockets), shut their write side and read to
// EOF; each must get exactly the other's bytes, and each FIN only after
// them. The slow reader makes the redirected bytes wait in the relay's
// psock queue when the FIN comes, the case where a FIN passed on at once
// would overtake them.
func TestTransferHalfClose(t *testing.T) {
	k := needBPF(t)
	r := newTestRelay(t, k, false)
	cases := []struct {
		name       string
		up, down   int
		slowReader time.Duration
	}{
		{"empty", 0, 0, 0},
		{"one byte each way", 1, 1, 0},
		{"client only", 100_000, 0, 0},
		{"64 MiB down, 1 MiB up", 1 << 20, 64 << 20, 0},
		{"8 MiB both ways, slow readers", 8 << 20, 8 << 20, 2 * time.Millisecond},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			up, down := payload(uint64(2*i), tc.up), payload(uint64(2*i+1), tc.down)
			before := r.stats()
			var wg sync.WaitGroup
			var cs, ss side
			c := pairUp(t, r, func(c conns) {
				// Queued before the join: the first 4 KiB of each side.
				c.client.Write(up[:min(4096, len(up))])
				c.server.Write(down[:min(4096, len(down))])
				time.Sleep(20 * time.Millisecond)
			})
			exchange(c.client, up[min(4096, len(up)):], tc.slowReader, &wg, &cs)
			exchange(c.server, down[min(4096, len(down)):], tc.slowReader, &wg, &ss)
			wg.Wait()
			if cs.err != nil || ss.err != nil {
				t.Fatalf("client: %v; server: %v", cs.err, ss.err)
			}
			sameBytes(t, "server received", ss.got, up)
			sameBytes(t, "client received", cs.got, down)
			after := waitPairs(t, r, before.Pairs+1)
			if d := after.Up - before.Up; d != uint64(len(up)) {
				t.Errorf("tcp_info counted %d bytes up, want %d", d, len(up))
			}
			if d := after.Down - before.Down; d != uint64(len(down)) {
				t.Errorf("tcp_info counted %d bytes down, want %d", d, len(down))
			}
			if d := after.VerdictUp - before.VerdictUp; d != uint64(len(up)) {
				t.Errorf("verdict counted %d bytes up, want %d", d, len(up))
			}
			if d := after.Aborted - before.Aborted; d != 0 {
				t.Errorf("%d pairs aborted: %s", d, after.LastAbort)
			}
		})
	}
}

// TestForward: the relay as the clients meet it, through serve/forward.
func TestForward(t *testing.T) {
	k := needBPF(t)
	r := newTestRelay(t, k, false)
	up, err := net.ListenTCP("tcp", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	defer up.Close()
	l, err := net.ListenTCP("tcp", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go serve(r, l, up.Addr().String())
	// An upstream that speaks first (SMTP, SSH): its greeting is queued
	// before its socket joins the pair.
	go func() {
		s, err := up.AcceptTCP()
		if err != nil {
			return
		}
		defer s.Close()
		s.Write([]byte("220 hello\r\n"))
		b, _ := io.ReadAll(s)
		s.Write(append([]byte("got "), b...))
		s.CloseWrite()
	}()
	c, err := net.DialTCP("tcp", nil, l.Addr().(*net.TCPAddr))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	greet := make([]byte, 11)
	if _, err := io.ReadFull(c, greet); err != nil || string(greet) != "220 hello\r\n" {
		t.Fatalf("greeting %q: %v", greet, err)
	}
	c.Write([]byte("QUIT"))
	c.CloseWrite()
	rest, err := io.ReadAll(c)
	if err != nil || string(rest) != "got QUIT" {
		t.Fatalf("reply %q: %v", rest, err)
	}
}

// TestIdle: a pair with no byte either way for the timeout is closed.
func TestIdle(t *testing.T) {
	k := needBPF(t)
	r := newTestRelay(t, k, false)
	c := pairUp(t, r, nil)
	go r.idle(t.Context(), 300*time.Millisecond)
	c.client.SetReadDeadline(time.Now().Add(5 * time.Second))
	start := time.Now()
	if _, err := c.client.Read(make([]byte, 1)); err == nil {
		t.Fatal("read a byte from an idle pair")
	}
	if d := time.Since(start); d < 250*time.Millisecond || d > 4*time.Second {
		t.Errorf("idle pair closed after %v, want ~300ms", d)
	}
	if s := r.stats(); s.Aborted != 1 {
		t.Errorf("aborted %d pairs, want 1", s.Aborted)
	}
}

// TestPitfalls runs the relay without each of its two guards and logs what
// the kernel does then; it asserts only that the guarded relay is exact.
// `go test -run TestPitfalls -v` prints the facts docs/performance.md
// quotes.
func TestPitfalls(t *testing.T) {
	k := needBPF(t)
	t.Run("queued before the join, no kick", func(t *testing.T) {
		for _, kick := range []bool{false, true} {
			r := newTestRelay(t, k, false)
			r.kick = kick
			c := pairUp(t, r, func(c conns) {
				c.client.Write([]byte("hello"))
				time.Sleep(20 * time.Millisecond)
			})
			c.server.SetReadDeadline(time.Now().Add(time.Second))
			buf := make([]byte, 5)
			n, err := io.ReadFull(c.server, buf)
			t.Logf("kick=%v: %d of 5 queued bytes forwarded within 1s (%v)", kick, n, err)
			if kick && (n != 5 || string(buf) != "hello") {
				t.Errorf("with the kick: got %q, %v", buf[:n], err)
			}
		}
	})
	t.Run("a receiver that does not read", func(t *testing.T) {
		r := newTestRelay(t, k, false)
		c := pairUp(t, r, nil)
		const limit = 256 << 20
		chunk := make([]byte, 1<<20)
		before := tcpMem()
		sent := 0
		start := time.Now()
		c.server.SetWriteDeadline(time.Now().Add(2 * time.Second))
		for sent < limit {
			n, err := c.server.Write(chunk)
			sent += n
			if err != nil {
				break
			}
		}
		t.Logf("no flow control: the sender wrote %d MiB in %v (stopped at %d MiB or 2 s) though the receiver reads nothing; /proc/net/sockstat before: %s; after: %s", sent>>20, time.Since(start).Round(time.Millisecond), limit>>20, before, tcpMem())
	})
	t.Run("FIN passed on at once", func(t *testing.T) {
		for _, drain := range []bool{false, true} {
			r := newTestRelay(t, k, false)
			r.drain = drain
			down := payload(7, 16<<20)
			var wg sync.WaitGroup
			var cs, ss side
			c := pairUp(t, r, nil)
			exchange(c.client, nil, 2*time.Millisecond, &wg, &cs)
			exchange(c.server, down, 0, &wg, &ss)
			wg.Wait()
			t.Logf("drain=%v: client got %d of %d bytes before EOF (read error %v), match=%v", drain, len(cs.got), len(down), cs.err, bytes.Equal(cs.got, down))
			if drain && !bytes.Equal(cs.got, down) {
				t.Errorf("with the drain wait: got %d of %d bytes", len(cs.got), len(down))
			}
		}
	})
}

// TestPauseSenders: with flow control on, a receiver that stops reading
// stops the sender, as with a user-space relay (without it the kernel
// queues whatever the upstream sends: a memory exhaustion a caged agent
// could cause, see TestPitfalls); once it reads again it gets every byte,
// in order, across the pauses. (Under load the pauses lose bytes: see
// relay.go, flow.)
func TestPauseSenders(t *testing.T) {
	k := needBPF(t)
	r := newTestRelay(t, k, true)
	c := pairUp(t, r, nil)
	const limit = 256 << 20
	data := payload(9, limit)
	t.Logf("before: /proc/net/sockstat: %s", tcpMem())
	sent := 0
	c.server.SetWriteDeadline(time.Now().Add(2 * time.Second))
	for sent < limit {
		n, err := c.server.Write(data[sent:min(sent+1<<20, limit)])
		sent += n
		if err != nil {
			break
		}
	}
	t.Logf("sender wrote %d KiB into a relay whose receiver reads nothing, in 2 s (limit %d KiB); /proc/net/sockstat: %s; %d pauses", sent>>10, limit>>10, tcpMem(), r.stats().Pauses)
	if sent >= limit {
		t.Fatalf("no backpressure: %d MiB accepted", sent>>20)
	}
	c.server.CloseWrite()
	c.client.SetReadDeadline(time.Now().Add(30 * time.Second))
	got, err := io.ReadAll(c.client)
	if err != nil {
		t.Fatal(err)
	}
	sameBytes(t, "client received after the pauses", got, data[:sent])
}

func tcpMem() string {
	b, _ := os.ReadFile("/proc/net/sockstat")
	for _, l := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(l, "TCP:") {
			return l
		}
	}
	return ""
}
