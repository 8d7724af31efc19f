package egress

import (
	"bufio"
	"bytes"
	"compress/flate"
	"compress/gzip"
	"compress/zlib"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"

	"github.com/andybalholm/brotli"
	"github.com/klauspost/compress/zstd"
)

// Content-coding: redaction and inspection work on the bytes an agent can
// read, so a body whose Content-Encoding the gateway cannot undo is refused
// rather than passed on (a gzip-echoed key would otherwise reach the cage).
// Toward secret-bound hosts the gateway asks for identity; whatever coding
// comes back anyway is decoded here and the agent gets identity.

// errCoding is a content-coding the gateway cannot decode.
type errCoding struct{ coding string }

func (e errCoding) Error() string {
	return fmt.Sprintf("content-coding %q cannot be decoded by the gateway (gzip, deflate, br, zstd are)", e.coding)
}

// codings lists a Content-Encoding header's codings in the order applied,
// without identity.
func codings(h http.Header) []string {
	var out []string
	for _, v := range h.Values("Content-Encoding") {
		for _, c := range strings.Split(v, ",") {
			c = strings.ToLower(strings.TrimSpace(c))
			if c != "" && c != "identity" {
				out = append(out, c)
			}
		}
	}
	return out
}

// Bounds on what decoding may cost. Every coding listed gets a decoder
// (a gzip or deflate one holds about 44 KiB, a brotli one 38 KiB before
// it reads a byte), and a brotli or zstd decoder keeps a window of what it
// decoded for as long as its body is open: up to 16 MiB and 8 MiB. An
// agent holds a body open for the body read timeouts on as many requests
// as max_tunnels allows, and a secret-bound upstream's answer as long as
// the agent reads it slowly, so both are bounded over the whole gateway
// (red team redh2: a 60 KB "br,br,…" header made one request cost 130
// MiB of RSS; 16 stalled brotli uploads of a few hundred bytes held 382
// MiB; the gateway's unit has MemoryMax=512M).
const (
	// maxCodings is the most codings one body may list (identity not
	// counted). Each of gzip, deflate, br and zstd once is plenty: a
	// body coded twice is rare, four times is not a client's doing.
	maxCodings = 4
	// zstdMaxWindow is RFC 9659's bound for the zstd content coding
	// (§3: encoders must not use more than 8 MB, decoders need not take
	// more); a frame declaring more is refused.
	zstdMaxWindow = 8 << 20
	// brMaxWindow is brotli's largest window (RFC 7932: WBITS 24; the
	// large-window extension is off).
	brMaxWindow = 16 << 20
	// zstdOverhead and brOverhead are what a decoder may hold besides its
	// window: zstd's ring keeps two blocks of space beside the window,
	// plus its block buffers; brotli's Huffman tables for 256 block types
	// of each kind and its context maps come to about 2.7 MB.
	zstdOverhead = 1 << 20
	brOverhead   = 3 << 20
	// decodeMemory bounds the windows (and overheads) of every brotli and
	// zstd decoder open at once, request and response bodies alike: three
	// brotli streams at the largest window, eight zstd ones at RFC 9659's.
	decodeMemory = 64 << 20
)

// errDecodeMemory: the gateway's decoders hold decodeMemory already.
type errDecodeMemory struct{ coding string }

func (e errDecodeMemory) Error() string {
	return fmt.Sprintf("the gateway's %s and other brotli and zstd decoders hold %d MiB, their bound; retry when other coded bodies have ended", e.coding, decodeMemory>>20)
}

// errWindow: a stream declares a window over the gateway's bound.
type errWindow struct {
	coding    string
	size, max uint64
}

func (e errWindow) Error() string {
	return fmt.Sprintf("%s window of %d bytes exceeds %d (RFC 9659 bounds zstd at 8 MB; brotli windows are at most 16 MiB)", e.coding, e.size, e.max)
}

// codingBlock turns a decoding error into a refusal: an undecodable or
// oversized coding is refused as the body's fault (415 for a request, 502
// for an upstream's answer), a spent budget as the gateway's (503). Other
// errors are not the coding's: nil.
func codingBlock(status int, where string, err error) *blockedErr {
	var em errDecodeMemory
	var ec errCoding
	var ew errWindow
	switch {
	case errors.As(err, &em):
		return block(http.StatusServiceUnavailable, "decoder-memory", "%s: %v", where, err)
	case errors.As(err, &ec), errors.As(err, &ew):
		return block(status, "content-encoding", "%s: %v", where, err)
	}
	return nil
}

// decodeBudget is what brotli and zstd decoders may hold at once, over the
// gateway. A decoder takes its coding's largest window when it is made (so
// a refusal comes before anything is written), and gives back what its
// stream's header says it does not need when it opens.
type decodeBudget struct {
	mu   sync.Mutex
	left int64
}

func newDecodeBudget() *decodeBudget { return &decodeBudget{left: decodeMemory} }

// hold is one decoder's share of a decodeBudget.
type hold struct {
	b *decodeBudget
	n int64
}

func (b *decodeBudget) take(n int64) (*hold, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.left < n {
		return nil, false
	}
	b.left -= n
	return &hold{b: b, n: n}, true
}

// shrink gives back all of h but n.
func (h *hold) shrink(n int64) {
	h.b.mu.Lock()
	defer h.b.mu.Unlock()
	if n < h.n {
		h.b.left += h.n - n
		h.n = n
	}
}

func (h *hold) release() { h.shrink(0) }

// decodeBody undoes codings (applied in order, so undone in reverse),
// with brotli and zstd windows under mem. The returned close releases
// decoder state and the budget; it does not close r. Every decoder opens
// on its first Read: a stalled sender stalls the copy, not here, and
// nothing is allocated for a body that never comes.
func decodeBody(r io.Reader, cs []string, mem *decodeBudget) (io.Reader, func(), error) {
	if len(cs) > maxCodings {
		return nil, nil, errCoding{fmt.Sprintf("%d codings (%s, ...)", len(cs), strings.Join(cs[:maxCodings], ", "))}
	}
	var closers []func()
	done := func() {
		for _, c := range closers {
			c()
		}
	}
	for i := len(cs) - 1; i >= 0; i-- {
		switch cs[i] {
		case "gzip", "x-gzip":
			// gzip.Reader reads its header at construction.
			r = &lazyReader{open: func(src io.Reader) (io.Reader, error) {
				zr, err := gzip.NewReader(src)
				if err != nil {
					return nil, fmt.Errorf("gzip: %w", err)
				}
				closers = append(closers, func() { zr.Close() })
				return zr, nil
			}, src: r}
		case "deflate":
			// RFC 9110 says zlib; some servers send raw deflate. Tell them
			// apart by the zlib header check.
			r = &lazyReader{open: func(src io.Reader) (io.Reader, error) {
				br := bufio.NewReader(src)
				h, err := br.Peek(2)
				if err != nil {
					return nil, fmt.Errorf("deflate: %w", err)
				}
				if h[0]&0x0f == 8 && (uint16(h[0])<<8|uint16(h[1]))%31 == 0 {
					zr, err := zlib.NewReader(br)
					if err != nil {
						return nil, fmt.Errorf("deflate: %w", err)
					}
					closers = append(closers, func() { zr.Close() })
					return zr, nil
				}
				fr := flate.NewReader(br)
				closers = append(closers, func() { fr.Close() })
				return fr, nil
			}, src: r}
		case "br", "zstd":
			c := cs[i]
			max := int64(brMaxWindow + brOverhead)
			if c == "zstd" {
				max = zstdMaxWindow + zstdOverhead
			}
			h, ok := mem.take(max)
			if !ok {
				done()
				return nil, nil, errDecodeMemory{c}
			}
			closers = append(closers, h.release)
			open := openBrotli
			if c == "zstd" {
				open = openZstd
			}
			r = &lazyReader{open: func(src io.Reader) (io.Reader, error) {
				dec, closer, err := open(src, h)
				if err != nil {
					return nil, err
				}
				if closer != nil {
					closers = append(closers, closer)
				}
				return dec, nil
			}, src: r}
		default:
			done()
			return nil, nil, errCoding{cs[i]}
		}
	}
	return r, done, nil
}

// readHeader reads from src until parse stops asking for more bytes
// (more), src ends, or it fails; it returns what it read.
func readHeader(src io.Reader, more func([]byte) bool) ([]byte, error) {
	var pre []byte
	buf := make([]byte, 32)
	for len(pre) == 0 || more(pre) {
		n, err := src.Read(buf)
		pre = append(pre, buf[:n]...)
		if err == io.EOF {
			return pre, nil
		}
		if err != nil {
			return pre, err
		}
	}
	return pre, nil
}

// zstdMinHold is the least a zstd decoder keeps of the budget: a stream
// may be a run of frames of different sizes (an encoder flushing a frame
// per message), and the first one's window is only a floor for the rest.
const zstdMinHold = 1 << 20

// openZstd reads the first frame's header, refusing a window over
// zstdMaxWindow, keeps the larger of that window and zstdMinHold, and
// makes a decoder that refuses any later frame with a larger one.
func openZstd(src io.Reader, h *hold) (io.Reader, func(), error) {
	var fh zstd.Header
	pre, err := readHeader(src, func(b []byte) bool { return errors.Is(fh.Decode(b), io.ErrUnexpectedEOF) })
	if err != nil {
		return nil, nil, fmt.Errorf("zstd: %w", err)
	}
	window := uint64(zstdMaxWindow)
	if fh.Decode(pre) == nil && !fh.Skippable {
		window = fh.WindowSize
		if fh.SingleSegment {
			window = fh.FrameContentSize
		}
		if window > zstdMaxWindow {
			return nil, nil, errWindow{"zstd", window, zstdMaxWindow}
		}
		window = max(window, zstdMinHold)
		h.shrink(int64(window) + zstdOverhead)
	}
	zr, err := zstd.NewReader(io.MultiReader(bytes.NewReader(pre), src), zstd.WithDecoderConcurrency(1), zstd.WithDecoderMaxWindow(window), zstd.WithDecoderLowmem(true))
	if err != nil {
		return nil, nil, fmt.Errorf("zstd: %w", err)
	}
	return zr, zr.Close, nil
}

// openBrotli reads the stream's window size (RFC 7932 §9.1, in its first
// byte) and keeps that much.
func openBrotli(src io.Reader, h *hold) (io.Reader, func(), error) {
	pre, err := readHeader(src, func([]byte) bool { return false })
	if err != nil {
		return nil, nil, fmt.Errorf("br: %w", err)
	}
	if len(pre) > 0 {
		if wbits := brotliWindowBits(pre[0]); wbits > 0 {
			h.shrink(1<<wbits + brOverhead)
		}
	}
	return brotli.NewReader(io.MultiReader(bytes.NewReader(pre), src)), nil, nil
}

// brotliWindowBits decodes WBITS from a brotli stream's first byte; 0 for
// the large-window marker, which the decoder refuses.
func brotliWindowBits(b byte) int {
	switch {
	case b&1 == 0:
		return 16
	case b>>1&7 != 0:
		return 17 + int(b>>1&7)
	case b>>4&7 == 1:
		return 0
	case b>>4&7 != 0:
		return 8 + int(b>>4&7)
	}
	return 17
}

// lazyReader opens its decoder on the first Read.
type lazyReader struct {
	open func(io.Reader) (io.Reader, error)
	src  io.Reader
	r    io.Reader
	err  error
}

func (l *lazyReader) Read(p []byte) (int, error) {
	if l.r == nil && l.err == nil {
		l.r, l.err = l.open(l.src)
	}
	if l.err != nil {
		return 0, l.err
	}
	return l.r.Read(p)
}
