package egress

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"
)

// tcpPair is a connected pair of loopback TCP sockets: what the gateway
// relays between (the agent's connection and the upstream's).
func tcpPair(t *testing.T) (near, far net.Conn) {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	acc := make(chan net.Conn, 1)
	go func() {
		c, _ := l.Accept()
		acc <- c
	}()
	far, err = net.Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	near = <-acc
	if near == nil {
		t.Fatal("accept failed")
	}
	t.Cleanup(func() { near.Close(); far.Close() })
	return near, far
}

type spliceResult struct {
	out, in int64
	err     error
	took    time.Duration
}

// relayed starts splice between two fresh socket pairs and returns the
// agent's and the upstream's ends and the relay's result.
func relayed(t *testing.T, idle time.Duration) (agent, upstream net.Conn, res <-chan spliceResult) {
	gwAgent, agent := tcpPair(t)
	gwUp, upstream := tcpPair(t)
	ch := make(chan spliceResult, 1)
	go func() {
		start := time.Now()
		out, in, err := splice(gwAgent, gwUp, idle)
		ch <- spliceResult{out, in, err, time.Since(start)}
	}()
	return agent, upstream, ch
}

func pattern(n int, seed byte) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = seed + byte(i*7+i/4096)
	}
	return b
}

// The copy loop carries every byte both ways, counts them for the close
// record, and passes a half-close on: the agent's CloseWrite reaches the
// upstream as EOF while the upstream's answer still flows back.
func TestSpliceBytesAndHalfClose(t *testing.T) {
	agent, upstream, res := relayed(t, time.Minute)
	sendUp, sendDown := pattern(3<<20+17, 1), pattern(5<<20+3, 9)
	go func() {
		agent.Write(sendUp)
		agent.(*net.TCPConn).CloseWrite()
	}()
	gotUp, err := io.ReadAll(upstream) // ends at the relayed half-close
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(gotUp, sendUp) {
		t.Fatalf("upstream got %d bytes (sha %x), want %d", len(gotUp), sha256.Sum256(gotUp), len(sendUp))
	}
	go func() {
		upstream.Write(sendDown)
		upstream.Close()
	}()
	gotDown, err := io.ReadAll(agent)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(gotDown, sendDown) {
		t.Fatalf("agent got %d bytes, want %d", len(gotDown), len(sendDown))
	}
	r := <-res
	if r.err != nil || r.out != int64(len(sendUp)) || r.in != int64(len(sendDown)) {
		t.Fatalf("splice = out %d in %d err %v; want out %d in %d, no error", r.out, r.in, r.err, len(sendUp), len(sendDown))
	}
}

// Many small messages each way, as a keep-alive tunnel carries: each is
// relayed as it comes (nothing waits for a buffer to fill).
func TestSpliceSmallMessagesRoundTrip(t *testing.T) {
	agent, upstream, res := relayed(t, time.Minute)
	go func() {
		buf := make([]byte, 512)
		for {
			n, err := upstream.Read(buf)
			if err != nil {
				upstream.Close()
				return
			}
			upstream.Write(bytes.ToUpper(buf[:n]))
		}
	}()
	buf := make([]byte, 512)
	var sent int64
	for i := range 2000 {
		msg := []byte(strings.Repeat("ping", 1+i%50))
		agent.SetReadDeadline(time.Now().Add(10 * time.Second))
		agent.Write(msg)
		sent += int64(len(msg))
		n, err := io.ReadFull(agent, buf[:len(msg)])
		if err != nil || !bytes.Equal(buf[:n], bytes.ToUpper(msg)) {
			t.Fatalf("round trip %d: %q, %v", i, buf[:n], err)
		}
	}
	agent.(*net.TCPConn).CloseWrite()
	r := <-res
	if r.err != nil || r.out != sent || r.in != sent {
		t.Fatalf("splice = out %d in %d err %v; want %d each way", r.out, r.in, r.err, sent)
	}
}

// The idle timeout counts bytes in either direction: a download whose
// upload direction is quiet for longer than idle stays open, and the
// tunnel closes once neither direction has carried a byte for idle.
func TestSpliceIdleTimeoutEitherDirection(t *testing.T) {
	// Ticks every idle/6 leave the relay 5/6 of the idle time of scheduling
	// slack: with idle 300 ms a loaded CI machine (checks/fresh.sh beside
	// another suite) delayed the relay's reads past it.
	const idle = 1500 * time.Millisecond
	agent, upstream, res := relayed(t, idle)
	go io.Copy(io.Discard, agent)
	start := time.Now()
	for time.Since(start) < 3*idle {
		if _, err := upstream.Write([]byte("tick")); err != nil {
			t.Fatalf("write after %v: %v", time.Since(start), err)
		}
		select {
		case r := <-res:
			t.Fatalf("tunnel closed after %v while the upstream sent every %v: %+v", r.took, idle/6, r)
		case <-time.After(idle / 6):
		}
	}
	select {
	case r := <-res:
		if !errors.Is(r.err, errIdle) || r.in == 0 || r.in%4 != 0 || r.took < 3*idle {
			t.Fatalf("splice = %+v; want the idle timeout after the ticks (%v)", r, 3*idle)
		}
	case <-time.After(idle + 5*time.Second):
		t.Fatal("tunnel still open long after it went idle")
	}
}

// Closing the agent's connection while the tunnel waits, as a ban does
// (bans.go: cut), ends the relay at once without an error, the upstream
// side included: before, the direction reading the upstream waited until
// the upstream next sent or hung up.
func TestSpliceEndsWhenClosedFromOutside(t *testing.T) {
	gwAgent, agent := tcpPair(t)
	gwUp, upstream := tcpPair(t)
	res := make(chan error, 1)
	go func() {
		_, _, err := splice(gwAgent, gwUp, time.Minute)
		res <- err
	}()
	time.Sleep(100 * time.Millisecond)
	gwAgent.Close()
	select {
	case err := <-res:
		if err != nil {
			t.Fatalf("splice after close: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("relay still running 5 s after its connection was closed")
	}
	// The gateway's side of the upstream connection is closed too.
	upstream.SetReadDeadline(time.Now().Add(5 * time.Second))
	if n, err := upstream.Read(make([]byte, 1)); err != io.EOF {
		t.Fatalf("upstream read after the cut = %d, %v; want EOF", n, err)
	}
	agent.Close()
}

// pipeFDs counts this process's open pipe descriptors.
func pipeFDs(t *testing.T) int {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Skipf("no /proc/self/fd: %v", err)
	}
	n := 0
	for _, e := range ents {
		if l, err := os.Readlink("/proc/self/fd/" + e.Name()); err == nil && strings.HasPrefix(l, "pipe:") {
			n++
		}
	}
	return n
}

// An idle tunnel holds no kernel pipe (nor buffer): pipes come from a
// small pool only while bytes move. Before, io.CopyN between the two
// sockets held a splice pipe per direction for as long as the tunnel was
// open, two pipes (four descriptors) per idle tunnel.
func TestIdleTunnelsHoldNoPipes(t *testing.T) {
	const tunnels = 64
	before := pipeFDs(t)
	type ends struct{ agent, upstream net.Conn }
	var all []ends
	for range tunnels {
		a, u, _ := relayed(t, time.Minute)
		all = append(all, ends{a, u})
	}
	// One message each way first, so every direction has spliced.
	buf := make([]byte, 5)
	for _, e := range all {
		e.agent.Write([]byte("hello"))
		if _, err := io.ReadFull(e.upstream, buf); err != nil {
			t.Fatal(err)
		}
		e.upstream.Write([]byte("world"))
		if _, err := io.ReadFull(e.agent, buf); err != nil {
			t.Fatal(err)
		}
	}
	time.Sleep(100 * time.Millisecond)
	held := pipeFDs(t) - before
	t.Logf("%d idle tunnels hold %d pipe descriptors", tunnels, held)
	if held > 2*maxFreePipes {
		t.Fatalf("%d idle tunnels hold %d pipe descriptors; want at most the pool's %d", tunnels, held, 2*maxFreePipes)
	}
}

// A connection that is not a socket (net.Pipe) is copied with read/write:
// bytes and the idle timeout alike.
func TestSpliceNonSocketFallback(t *testing.T) {
	gwAgent, agent := net.Pipe()
	gwUp, upstream := net.Pipe()
	defer agent.Close()
	defer upstream.Close()
	res := make(chan spliceResult, 1)
	go func() {
		out, in, err := splice(gwAgent, gwUp, 200*time.Millisecond)
		res <- spliceResult{out: out, in: in, err: err}
	}()
	go agent.Write([]byte("over a pipe"))
	buf := make([]byte, 11)
	if _, err := io.ReadFull(upstream, buf); err != nil || string(buf) != "over a pipe" {
		t.Fatalf("upstream read %q, %v", buf, err)
	}
	select {
	case r := <-res:
		if !errors.Is(r.err, errIdle) || r.out != 11 {
			t.Fatalf("splice = %+v; want the idle timeout after 11 bytes out", r)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("no idle timeout over net.Pipe")
	}
}

// Waiting to write counts against idle as waiting to read does: a tunnel
// whose agent half-closed and stopped reading, under an upstream that
// keeps sending, goes idle (before, the write had no deadline and the
// relay never ended), and the bytes counted in are the ones the agent's
// socket got.
func TestSpliceIdleWhileWaitingToWrite(t *testing.T) {
	const idle = 300 * time.Millisecond
	agent, upstream, res := relayed(t, idle)
	go func() {
		buf := make([]byte, 64<<10)
		for {
			if _, err := upstream.Write(buf); err != nil {
				return
			}
		}
	}()
	agent.(*net.TCPConn).CloseWrite()
	select {
	case r := <-res:
		if !errors.Is(r.err, errIdle) || r.in == 0 {
			t.Fatalf("splice = %+v; want the idle timeout", r)
		}
		agent.SetReadDeadline(time.Now().Add(10 * time.Second))
		n, err := io.Copy(io.Discard, agent)
		if err != nil || n != r.in {
			t.Fatalf("agent read %d bytes (%v) after the cut; the relay counted %d in", n, err, r.in)
		}
	case <-time.After(idle + 5*time.Second):
		t.Fatal("relay still open long after nothing moved either way")
	}
}

// A slow but steady reader is not idle: the bytes a pump moves as the
// reader makes room count, not only a whole pipe-full once it is written
// (before, the relay cut such a tunnel at the idle timeout while bytes
// moved: a pipe-full of 1 MiB took this reader 5 s). The gateway's send
// buffer is kept small so the gateway sees the room the reader makes: it
// cannot see a reader draining that buffer itself, so a reader slower than
// half of it per idle timeout still looks idle (docs/egress.md). Nor what
// the kernel takes past the buffer in one send: a pump moved 64 KiB at
// once into the 4 KiB buffer, and the gateway sees room again only once
// the reader has drained them. At idle 1 s a loaded machine (three busy
// loops beside the test) stretched this reader's 10 ms per 2 KiB to 36 ms,
// and the relay went idle after those 64 KiB (5 of 20 runs). Idle is 3 s:
// the 64 KiB take this reader a third of a second unloaded, 1.2 s loaded,
// and the old pipe-full still 5 s.
func TestSpliceSlowReaderIsNotIdle(t *testing.T) {
	const idle = 3 * time.Second
	gwAgent, agent := tcpPair(t)
	gwUp, upstream := tcpPair(t)
	for c, opt := range map[net.Conn][2]int{gwAgent: {syscall.SO_SNDBUF, 4096}, agent: {syscall.SO_RCVBUF, 4096}, gwUp: {syscall.SO_RCVBUF, 4 << 20}} {
		rc, _ := c.(*net.TCPConn).SyscallConn()
		rc.Control(func(fd uintptr) { syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, opt[0], opt[1]) })
	}
	go upstream.Write(make([]byte, 4<<20))
	time.Sleep(200 * time.Millisecond) // so the first drain takes a pipe-full
	res := make(chan spliceResult, 1)
	go func() {
		out, in, err := splice(gwAgent, gwUp, idle)
		res <- spliceResult{out: out, in: in, err: err}
	}()
	buf := make([]byte, 2048)
	start := time.Now()
	// Twice idle: the relay's deadline fires and is re-armed from the
	// reader's progress at least once.
	for read := 0; time.Since(start) < 2*idle; time.Sleep(10 * time.Millisecond) {
		agent.SetReadDeadline(time.Now().Add(5 * time.Second))
		if _, err := io.ReadFull(agent, buf); err != nil {
			t.Fatalf("reader cut off after %d KiB in %v while reading 2 KiB every 10 ms: %v", read*2, time.Since(start), err)
		}
		read++
		select {
		case r := <-res:
			t.Fatalf("relay ended after %v while the reader read steadily (%d KiB): out %d in %d err %v", time.Since(start), read*2, r.out, r.in, r.err)
		default:
		}
	}
}

// Pipes from the pool carry one tunnel's bytes only: many relays at once
// (more than the pool holds), a third of them reset by the agent and a
// third by the upstream mid-transfer (their pipes may hold bytes then),
// and every end receives a prefix of exactly what its own peer sent, in
// both directions: never a byte of another tunnel.
func TestSplicePipesNeverMixTunnels(t *testing.T) {
	const tunnels, size = 3 * maxFreePipes, 1 << 20
	mine := func(id, dir int) []byte {
		b := make([]byte, size)
		for i := range b {
			b[i] = byte(id*2+dir) ^ byte(i*7+i>>12)
		}
		return b
	}
	reset := func(c net.Conn) {
		c.(*net.TCPConn).SetLinger(0)
		c.Close()
	}
	errs := make(chan error, 2*tunnels)
	for id := range tunnels {
		agent, upstream, res := relayed(t, 10*time.Second)
		up, down := mine(id, 0), mine(id, 1)
		// receive reads c until it ends, checking it got a prefix of
		// want; the id%3 == who end resets after half.
		receive := func(c net.Conn, want []byte, who int, name string) {
			c.SetReadDeadline(time.Now().Add(20 * time.Second))
			got := make([]byte, 0, size)
			buf := make([]byte, 32<<10)
			for {
				n, err := c.Read(buf)
				got = append(got, buf[:n]...)
				if id%3 == who && len(got) > size/2 {
					reset(c)
					break
				}
				if err != nil {
					break
				}
			}
			if !bytes.Equal(got, want[:len(got)]) {
				i := 0
				for i < len(got) && got[i] == want[i] {
					i++
				}
				errs <- fmt.Errorf("tunnel %d: %s got %d bytes, not what its peer sent from byte %d on", id, name, len(got), i)
				return
			}
			errs <- nil
		}
		go func() { agent.Write(up); agent.(*net.TCPConn).CloseWrite() }()
		go func() { upstream.Write(down); upstream.(*net.TCPConn).CloseWrite() }()
		go receive(upstream, up, 1, "upstream")
		go receive(agent, down, 2, "agent")
		go func() { <-res }()
	}
	for range 2 * tunnels {
		select {
		case err := <-errs:
			if err != nil {
				t.Error(err)
			}
		case <-time.After(30 * time.Second):
			t.Fatal("relays still running 30 s on")
		}
	}
}
