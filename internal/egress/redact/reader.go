package redact

import (
	"io"
	"sync"
)

// readSize is how much the Reader asks its source for at a time.
const readSize = 32 << 10

var bufs = sync.Pool{New: func() any { b := make([]byte, 0, 2*readSize); return &b }}

// Reader streams src with every form rewritten to its placeholder form.
//
// It always holds back exactly Hold() bytes (MaxLen-1) until the source ends,
// whether or not they could start a form: a hold-back that depended on the
// bytes (the previous redactor kept only a tail that was a prefix of a
// secret) lets an agent whose requests are reflected learn the secret one
// byte at a time from the size of what it receives. So the n-th Read's
// result length depends only on how many bytes the source has produced and
// on len(p), never on their content. The cost: a stream (server-sent events)
// reaches the agent Hold() bytes late, until the upstream sends more or ends.
type Reader struct {
	m     *Matcher
	src   io.Reader
	hold  int
	bp    *[]byte
	buf   []byte // pending bytes, not yet returned
	ready int    // buf[:ready] is rewritten and may be returned
	scan  int    // scanning resumes at buf[scan]
	done  bool   // src ended (err holds why, nil for EOF)
	err   error
	res   Result
}

// NewReader wraps src. Call Release when done reading.
func (m *Matcher) NewReader(src io.Reader) *Reader {
	hold := 0
	if m.maxLen > 0 {
		hold = m.maxLen - 1
	}
	bp := bufs.Get().(*[]byte)
	return &Reader{m: m, src: src, hold: hold, bp: bp, buf: (*bp)[:0]}
}

// Hold is the fixed number of bytes held back while the source is open.
func (r *Reader) Hold() int { return r.hold }

// Result says which secrets were redacted and which were near-matched so
// far.
func (r *Reader) Result() Result { return r.res }

// Release returns the buffer to the pool; r must not be used after.
func (r *Reader) Release() {
	if r.bp != nil {
		*r.bp = r.buf[:0]
		bufs.Put(r.bp)
		r.bp, r.buf = nil, nil
	}
}

func (r *Reader) Read(p []byte) (int, error) {
	for r.ready == 0 {
		if r.done {
			if len(r.buf) == 0 {
				if r.err != nil {
					return 0, r.err
				}
				return 0, io.EOF
			}
			r.rewrite(len(r.buf))
			r.ready = len(r.buf)
			break
		}
		r.fill()
		if !r.done {
			if limit := len(r.buf) - r.hold; limit > 0 {
				r.rewrite(limit)
				r.ready = limit
			}
		}
	}
	n := copy(p, r.buf[:r.ready])
	r.buf = r.buf[n:]
	r.ready -= n
	r.scan -= n
	return n, nil
}

// fill reads once from src, making room first.
func (r *Reader) fill() {
	if cap(r.buf)-len(r.buf) < readSize {
		need := len(r.buf) + readSize
		var nb []byte
		if bp := *r.bp; cap(bp) >= need {
			nb = bp[:len(r.buf)]
		} else {
			nb = make([]byte, len(r.buf), need+readSize)
			*r.bp = nb
		}
		copy(nb, r.buf) // overlapping move to the front is fine with copy
		r.buf = nb
	}
	n, err := r.src.Read(r.buf[len(r.buf) : len(r.buf)+readSize])
	r.buf = r.buf[:len(r.buf)+n]
	if err != nil {
		r.done = true
		if err != io.EOF {
			r.err = err
		}
	}
}

// rewrite scans and rewrites positions up to limit (a form starting before
// limit is whole in buf, because buf holds hold bytes past limit or the
// source has ended).
func (r *Reader) rewrite(limit int) {
	if limit <= r.scan {
		return
	}
	r.scan = r.m.Scan(r.buf, r.scan, limit, func(x Match) {
		copy(r.buf[x.Offset:], x.Form.Placeholder)
		r.res.add(x.Form.Secret, false)
	}, func(f *Form, _ int) { r.res.add(f.Secret, true) })
}

// Stream is the push form of Reader, for data that arrives in pieces the
// caller reads itself (WebSocket frames): Write returns what may go on,
// holding back the same fixed Hold() bytes, and Close returns the rest.
// What is returned is valid until the next call.
type Stream struct{ r Reader }

// NewStream starts a rewrite of one stream.
func (m *Matcher) NewStream() *Stream {
	s := &Stream{}
	s.r.m = m
	if m.maxLen > 0 {
		s.r.hold = m.maxLen - 1
	}
	return s
}

// Write adds p and returns the bytes now rewritten and released.
func (s *Stream) Write(p []byte) []byte {
	r := &s.r
	r.buf = append(r.buf[r.ready:], p...)
	r.scan -= r.ready
	r.ready = 0
	if limit := len(r.buf) - r.hold; limit > 0 {
		r.rewrite(limit)
		r.ready = limit
	}
	return r.buf[:r.ready]
}

// Close releases everything left, rewritten.
func (s *Stream) Close() []byte {
	r := &s.r
	r.buf = r.buf[r.ready:]
	r.scan -= r.ready
	r.rewrite(len(r.buf))
	r.ready = len(r.buf)
	return r.buf
}

// Result says which secrets were redacted and near-matched so far.
func (s *Stream) Result() Result { return s.r.res }
