package egress

import (
	"bufio"
	"compress/flate"
	"compress/gzip"
	"compress/zlib"
	"fmt"
	"io"
	"net/http"
	"strings"

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

// decodeBody undoes codings (applied in order, so undone in reverse). The
// returned close releases decoder state; it does not close r.
func decodeBody(r io.Reader, cs []string) (io.Reader, func(), error) {
	var closers []func()
	done := func() {
		for _, c := range closers {
			c()
		}
	}
	for i := len(cs) - 1; i >= 0; i-- {
		switch cs[i] {
		case "gzip", "x-gzip":
			// gzip.Reader reads its header at construction: defer that to
			// the first Read so a stalled upstream stalls the copy, not here.
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
		case "br":
			r = brotli.NewReader(r)
		case "zstd":
			// Bounded window: a hostile stream cannot make the decoder
			// allocate more than this (the default allows 8 GiB).
			zr, err := zstd.NewReader(r, zstd.WithDecoderConcurrency(1), zstd.WithDecoderMaxWindow(32<<20), zstd.WithDecoderLowmem(true))
			if err != nil {
				done()
				return nil, nil, fmt.Errorf("zstd: %w", err)
			}
			closers = append(closers, zr.Close)
			r = zr
		default:
			done()
			return nil, nil, errCoding{cs[i]}
		}
	}
	return r, done, nil
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
