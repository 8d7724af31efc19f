package egress

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// splicer moves a tunnel's bytes from one socket to the other with
// splice(2) through a kernel pipe, so they never enter user space: per GiB
// of bulk that is about half the gateway's CPU of read/write through a
// buffer (docs/performance.md, "The tunnel copy loop"). io.Copy between
// two *net.TCPConn splices too, but it takes its pipe before it waits for
// the first byte and keeps it until its byte limit or EOF, so every open
// tunnel held two pipes (four descriptors and their kernel buffers) while
// idle. step waits for src's bytes without a pipe, takes one from a
// shared pool only for the bytes at hand, and gives it back once the pipe
// is empty again.
//
// The state of a step lives in the struct and the two callbacks are bound
// once, so a step allocates nothing (a keep-alive tunnel runs two steps
// per request).
type splicer struct {
	src, dst        syscall.RawConn
	drainFn, pumpFn func(fd uintptr) bool
	p               *kpipe
	n, left, moved  int
	err             error
	// last is the tunnel's latest byte either way (pipe's idle clock):
	// a pump that dst holds back stores it as it goes, so a slow but
	// steady reader is not idle while one pipe-full trickles out.
	last *atomic.Int64
}

func newSplicer(dst, src net.Conn, last *atomic.Int64) (*splicer, bool) {
	sc, ok1 := src.(syscall.Conn)
	dc, ok2 := dst.(syscall.Conn)
	if !ok1 || !ok2 {
		return nil, false
	}
	rs, err1 := sc.SyscallConn()
	rd, err2 := dc.SyscallConn()
	if err1 != nil || err2 != nil {
		return nil, false
	}
	s := &splicer{src: rs, dst: rd, last: last}
	s.drainFn, s.pumpFn = s.drain, s.pump
	return s, true
}

// step waits until src is readable (the netpoller, no pipe held), drains
// what src has into a pipe (up to the pipe's size) and pumps it all to dst.
// A pump cut short by dst's write deadline (pipe's idle clock) keeps the
// pipe and its bytes: the next step resumes it, or release drops it.
func (s *splicer) step() (int64, error) {
	if s.p == nil {
		n, err := s.fill()
		if n <= 0 {
			return 0, err
		}
		s.left = n
	}
	s.moved, s.err = 0, nil
	var err error
	for s.left > 0 {
		m := s.moved
		werr := s.dst.Write(s.pumpFn)
		if werr == nil {
			werr = s.err
		}
		if werr == nil && s.moved == m {
			werr = io.ErrShortWrite
		}
		if werr != nil {
			err = werr
			break
		}
		if s.left > 0 {
			// dst took part: the rest waits for it to read.
			s.last.Store(time.Now().UnixNano())
		}
	}
	switch {
	case s.left == 0:
		pipes.put(s.p)
		s.p = nil
	case !errors.Is(err, os.ErrDeadlineExceeded):
		// Bytes left in the pipe belong to this tunnel: the pipe cannot
		// serve another.
		s.release()
	}
	return int64(s.moved), err
}

// fill waits for src and drains it into a pipe, held (s.p) when n > 0;
// src's EOF is n == 0 with io.EOF.
func (s *splicer) fill() (n int, err error) {
	s.n, s.err = 0, nil
	err = s.src.Read(s.drainFn)
	if err == nil {
		err = s.err
	}
	if s.p == nil {
		return 0, err
	}
	if s.n <= 0 {
		pipes.put(s.p)
		s.p = nil
		if err == nil {
			err = io.EOF
		}
		return 0, err
	}
	return s.n, err
}

// release drops the pipe of a pump left unfinished (the tunnel ended).
func (s *splicer) release() {
	if s.p != nil {
		s.p.close()
		s.p = nil
	}
}

// drain is the src.Read callback: false asks the netpoller to wait.
func (s *splicer) drain(fd uintptr) bool {
	if s.p == nil {
		if s.p, s.err = pipes.get(); s.err != nil {
			return true
		}
	}
	s.n, s.err = spliceOnce(int(fd), s.p.w, s.p.size, true)
	if s.err == unix.EAGAIN {
		// Nothing to read: wait for the socket without the pipe (it
		// is empty, so it can serve another tunnel meanwhile).
		pipes.put(s.p)
		s.p = nil
		return false
	}
	return true
}

// pump is the dst.Write callback: it moves what it can of the pipe's bytes.
func (s *splicer) pump(fd uintptr) bool {
	m, err := spliceOnce(s.p.r, int(fd), s.left, s.left <= rawPumpMax)
	if err == unix.EAGAIN {
		return false
	}
	if m > 0 {
		s.moved += m
		s.left -= m
	}
	s.err = err
	return true
}

const spliceFlags = unix.SPLICE_F_MOVE | unix.SPLICE_F_NONBLOCK

// rawPumpMax is the largest pump done as a raw system call.
//
// Every splice here is non-blocking (the sockets are O_NONBLOCK, as all of
// Go's are, the pipes too, and SPLICE_F_NONBLOCK): it returns EAGAIN rather
// than wait. So it can skip the runtime's entersyscall/exitsyscall, and
// with them the wake-up of the runtime's sysmon thread that entering a
// system call costs in a process whose Ps were all idle, which is what a
// relay between short messages is: a fifth of a Go splice relay's CPU
// under keep-alive on this machine (docs/performance.md, "The tunnel copy
// loop"). A drain only moves page references into the pipe; a pump of a
// few dozen KiB is a few µs of loopback delivery. A larger pump (bulk, up
// to pipeSize: a few hundred µs) is an ordinary system call, so the
// runtime can hand the P to another goroutine while it lasts.
const rawPumpMax = 64 << 10

// spliceOnce is one non-blocking splice(2), retried on EINTR (waiting for
// readiness then would wait for bytes already there).
func spliceOnce(from, to, n int, raw bool) (int, error) {
	for {
		var r uintptr
		var e syscall.Errno
		if raw {
			r, _, e = unix.RawSyscall6(unix.SYS_SPLICE, uintptr(from), 0, uintptr(to), 0, uintptr(n), spliceFlags)
		} else {
			r, _, e = unix.Syscall6(unix.SYS_SPLICE, uintptr(from), 0, uintptr(to), 0, uintptr(n), spliceFlags)
		}
		switch e {
		case 0:
			return int(r), nil
		case unix.EINTR:
			continue
		}
		return 0, e
	}
}

// kpipe is a kernel pipe used by splicer; size is its capacity.
type kpipe struct{ r, w, size int }

func (p *kpipe) close() {
	unix.Close(p.r)
	unix.Close(p.w)
}

// pipeSize is the capacity asked for each pipe: one splice pair then moves
// up to this much of a bulk transfer (the default 64 KiB took 16 times the
// syscalls). It is also /proc/sys/fs/pipe-max-size's default, what an
// unprivileged process may ask for; a smaller grant is used as given.
const pipeSize = 1 << 20

// maxFreePipes bounds the pool: pipes are held only while bytes move, so
// the pool needs about as many as copies run at once, not one per tunnel.
const maxFreePipes = 16

type pipePool struct {
	mu   sync.Mutex
	free []*kpipe
}

var pipes pipePool

// errNoPipe is a pipe the kernel would not make (out of descriptors): the
// tunnel goes on with read/write (pipe), as io.Copy's splice did, rather
// than end.
var errNoPipe = errors.New("splice pipe")

func (pp *pipePool) get() (*kpipe, error) {
	pp.mu.Lock()
	if n := len(pp.free); n > 0 {
		p := pp.free[n-1]
		pp.free = pp.free[:n-1]
		pp.mu.Unlock()
		return p, nil
	}
	pp.mu.Unlock()
	var fds [2]int
	if err := unix.Pipe2(fds[:], unix.O_CLOEXEC|unix.O_NONBLOCK); err != nil {
		return nil, fmt.Errorf("%w: %w", errNoPipe, err)
	}
	p := &kpipe{r: fds[0], w: fds[1], size: 64 << 10}
	if got, err := unix.FcntlInt(uintptr(fds[1]), unix.F_SETPIPE_SZ, pipeSize); err == nil {
		p.size = got
	}
	return p, nil
}

func (pp *pipePool) put(p *kpipe) {
	pp.mu.Lock()
	if len(pp.free) < maxFreePipes {
		pp.free = append(pp.free, p)
		pp.mu.Unlock()
		return
	}
	pp.mu.Unlock()
	p.close()
}
