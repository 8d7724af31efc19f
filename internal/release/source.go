package release

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"os"
	"path"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/nixcage/nixcage/internal/netclass"
)

// Source yields the files of a release. Names are relative slash paths
// ("release.json", "nar/x.nar.xz"); every read is capped so a source cannot
// feed endless data.
type Source interface {
	// Open returns the named file; reading more than max bytes fails.
	Open(ctx context.Context, name string, max int64) (io.ReadCloser, error)
	String() string
}

// ErrTooLarge is returned by readers of a Source when a file exceeds its cap.
var ErrTooLarge = errors.New("file is larger than allowed")

// NewSource picks a source for a directory path or an http(s) URL.
func NewSource(loc string) (Source, error) {
	if strings.HasPrefix(loc, "http://") || strings.HasPrefix(loc, "https://") {
		u, err := url.Parse(loc)
		if err != nil {
			return nil, fmt.Errorf("release URL: %w", err)
		}
		return &HTTPSource{Base: u}, nil
	}
	if strings.Contains(loc, "://") {
		return nil, fmt.Errorf("release location %q: only a directory, http:// or https:// is supported", loc)
	}
	fi, err := os.Stat(loc)
	if err != nil {
		return nil, fmt.Errorf("release directory: %w", err)
	}
	if !fi.IsDir() {
		return nil, fmt.Errorf("release %s is not a directory", loc)
	}
	return DirSource(loc), nil
}

func checkName(name string) error {
	if name == "" || path.IsAbs(name) || path.Clean(name) != name || name == ".." || strings.HasPrefix(name, "../") {
		return fmt.Errorf("release file name %q is not a clean relative path", name)
	}
	return nil
}

// DirSource reads a release from a local directory. Files are opened through
// os.Root so a name can never escape the directory.
type DirSource string

func (d DirSource) String() string { return string(d) }

// Open implements Source.
func (d DirSource) Open(_ context.Context, name string, max int64) (io.ReadCloser, error) {
	if err := checkName(name); err != nil {
		return nil, err
	}
	root, err := os.OpenRoot(string(d))
	if err != nil {
		return nil, fmt.Errorf("open release directory: %w", err)
	}
	defer root.Close()
	f, err := root.Open(name)
	if err != nil {
		return nil, err
	}
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, err
	}
	if !fi.Mode().IsRegular() {
		f.Close()
		return nil, fmt.Errorf("%s is not a regular file", name)
	}
	if fi.Size() > max {
		f.Close()
		return nil, fmt.Errorf("%s: %w (%d bytes, limit %d)", name, ErrTooLarge, fi.Size(), max)
	}
	return &limitedReader{r: f, c: f, left: max, name: name}, nil
}

// limitedReader fails (rather than truncating) once more than left bytes
// arrive, so an oversized file is an error, never a silently short read.
type limitedReader struct {
	r    io.Reader
	c    io.Closer
	left int64
	name string
	max  int64
}

func (l *limitedReader) Read(p []byte) (int, error) {
	if l.left < 0 {
		return 0, fmt.Errorf("%s: %w", l.name, ErrTooLarge)
	}
	if int64(len(p)) > l.left+1 {
		p = p[:l.left+1]
	}
	n, err := l.r.Read(p)
	l.left -= int64(n)
	if l.left < 0 {
		return n, fmt.Errorf("%s: %w", l.name, ErrTooLarge)
	}
	return n, err
}

func (l *limitedReader) Close() error { return l.c.Close() }

// HTTPSource reads a release from an http(s) base URL. Interrupted bodies
// are resumed with Range requests from the last byte received.
type HTTPSource struct {
	Base *url.URL
	// Client, when set, is used as is (tests with their own TLS roots);
	// nil means the guarded client of FetchClient.
	Client  *http.Client
	Retries int // resume attempts per file; 0 means 5
	// IdleTimeout aborts (and then resumes) a response that delivers no
	// byte for this long, so a stalling server cannot hold an apply
	// forever; 0 means 60s.
	IdleTimeout time.Duration

	once    sync.Once
	guarded *http.Client
}

// MaxRedirects bounds the redirects one fetch follows.
const MaxRedirects = 5

// FetchClient is the HTTP client caged and cagectl fetch releases with.
// caged fetches as root in the host's network namespace, and a mirror is
// run by whoever publishes, so it must not be able to aim the host's
// requests anywhere (a blind request forgery against 127.0.0.1, the LAN or
// a cloud metadata service):
//
//   - the configured origin (base's scheme, host and port) is trusted as
//     the operator named it, whatever it resolves to: a mirror on loopback
//     or on a private address works when configured so;
//   - every other host, reached only by a redirect, must be a public
//     address (internal/netclass): checked on the redirect's URL when it
//     names an address, and again by the dialer's Control hook on the
//     address actually connected to, so a name that resolves (or rebinds)
//     to a non-public address is refused too; public hosts of any name are
//     allowed (mirrors redirect to CDNs);
//   - no redirect from https to http, and at most MaxRedirects.
func FetchClient(base *url.URL) *http.Client {
	return FetchClientWith(base, FetchOptions{})
}

// FetchOptions adjust FetchClient for a long-running poller (package
// channel); the zero value is cagectl's and apply's client.
type FetchOptions struct {
	// RootCAs verify https servers; nil means the system's CA pool.
	RootCAs *x509.CertPool
	// ResponseHeaderTimeout bounds the wait for a response's headers;
	// MaxResponseHeaderBytes bounds their size (0: net/http's defaults).
	ResponseHeaderTimeout  time.Duration
	MaxResponseHeaderBytes int64
}

// FetchClientWith is FetchClient with o applied; the redirect and dial
// guards are the same.
func FetchClientWith(base *url.URL, o FetchOptions) *http.Client {
	origin := hostPort(base)
	guard := &net.Dialer{Timeout: 30 * time.Second, KeepAlive: 30 * time.Second, Control: checkDial}
	plain := &net.Dialer{Timeout: 30 * time.Second, KeepAlive: 30 * time.Second}
	tr := http.DefaultTransport.(*http.Transport).Clone()
	if o.RootCAs != nil {
		tr.TLSClientConfig = &tls.Config{RootCAs: o.RootCAs, MinVersion: tls.VersionTLS12}
	}
	tr.ResponseHeaderTimeout = o.ResponseHeaderTimeout
	tr.MaxResponseHeaderBytes = o.MaxResponseHeaderBytes
	tr.DialContext = func(ctx context.Context, network, addr string) (net.Conn, error) {
		if addr == origin {
			return plain.DialContext(ctx, network, addr)
		}
		return guard.DialContext(ctx, network, addr)
	}
	return &http.Client{Transport: tr, CheckRedirect: func(req *http.Request, via []*http.Request) error {
		return checkRedirect(origin, req, via)
	}}
}

// hostPort is u's host with its scheme's default port made explicit, the
// form http.Transport dials.
func hostPort(u *url.URL) string {
	port := u.Port()
	if port == "" {
		port = "80"
		if u.Scheme == "https" {
			port = "443"
		}
	}
	return net.JoinHostPort(u.Hostname(), port)
}

// checkRedirect is FetchClient's redirect policy (see there).
func checkRedirect(origin string, req *http.Request, via []*http.Request) error {
	if len(via) >= MaxRedirects {
		return fmt.Errorf("release fetch: stopped after %d redirects", MaxRedirects)
	}
	for _, v := range via {
		if v.URL.Scheme == "https" && req.URL.Scheme != "https" {
			return fmt.Errorf("release fetch: redirect from https to %s refused (a downgrade): fix the mirror's redirect", req.URL.Redacted())
		}
	}
	if hostPort(req.URL) == origin {
		return nil
	}
	host := strings.TrimSuffix(strings.ToLower(req.URL.Hostname()), ".")
	if host == "localhost" || strings.HasSuffix(host, ".localhost") {
		return fmt.Errorf("release fetch: redirect to %s refused: it leaves the configured mirror for this host's loopback", req.URL.Redacted())
	}
	if ip, err := netip.ParseAddr(host); err == nil {
		if c := netclass.Classify(ip); c != netclass.Public {
			return fmt.Errorf("release fetch: redirect to %s refused: %s is %s, not a public address, and only the configured mirror may be non-public", req.URL.Redacted(), ip, c)
		}
	}
	return nil
}

// checkDial is the Control hook for every host but the configured origin:
// it sees the address the kernel is about to connect to, after DNS.
func checkDial(network, address string, _ syscall.RawConn) error {
	ap, err := netip.ParseAddrPort(address)
	if err != nil {
		return fmt.Errorf("release fetch: dial address %q: %w", address, err)
	}
	if c := netclass.Classify(ap.Addr()); c != netclass.Public {
		return fmt.Errorf("release fetch: refusing to connect to %s: it is %s, not a public address, and was reached by a redirect away from the configured mirror", ap, c)
	}
	return nil
}

func (h *HTTPSource) String() string { return h.Base.String() }

// Open implements Source.
func (h *HTTPSource) Open(ctx context.Context, name string, max int64) (io.ReadCloser, error) {
	if err := checkName(name); err != nil {
		return nil, err
	}
	u := *h.Base
	u.Path = strings.TrimSuffix(u.Path, "/") + "/" + name
	u.RawPath = ""
	r := &httpReader{ctx: ctx, h: h, url: u.String(), name: name, max: max}
	if err := r.request(); err != nil {
		return nil, err
	}
	return &limitedReader{r: r, c: r, left: max, name: name}, nil
}

type httpReader struct {
	ctx     context.Context
	cancel  context.CancelFunc // of the current request
	idle    *time.Timer
	h       *HTTPSource
	url     string
	name    string
	max     int64
	off     int64
	body    io.ReadCloser
	retries int
}

func (r *httpReader) client() *http.Client {
	if r.h.Client != nil {
		return r.h.Client
	}
	r.h.once.Do(func() { r.h.guarded = FetchClient(r.h.Base) })
	return r.h.guarded
}

// request (re)opens the body at r.off.
func (r *httpReader) request() error {
	timeout := r.h.IdleTimeout
	if timeout == 0 {
		timeout = 60 * time.Second
	}
	rctx, cancel := context.WithCancel(r.ctx)
	r.cancel = cancel
	r.idle = time.AfterFunc(timeout, cancel)
	req, err := http.NewRequestWithContext(rctx, http.MethodGet, r.url, nil)
	if err != nil {
		r.stop()
		return err
	}
	if r.off > 0 {
		req.Header.Set("Range", "bytes="+strconv.FormatInt(r.off, 10)+"-")
	}
	resp, err := r.client().Do(req)
	if err != nil {
		r.stop()
		return fmt.Errorf("fetch %s: %w", r.name, err)
	}
	ok := false
	defer func() {
		if !ok {
			r.stop()
		}
	}()
	switch {
	case r.off == 0 && resp.StatusCode == http.StatusOK:
	case r.off > 0 && resp.StatusCode == http.StatusPartialContent:
		// The server must resume exactly where we stopped; anything else
		// would splice unrelated bytes into the stream.
		cr := resp.Header.Get("Content-Range")
		if !strings.HasPrefix(cr, "bytes "+strconv.FormatInt(r.off, 10)+"-") {
			resp.Body.Close()
			return fmt.Errorf("fetch %s: server resumed at %q, wanted byte %d", r.name, cr, r.off)
		}
	case resp.StatusCode == http.StatusNotFound:
		resp.Body.Close()
		return fmt.Errorf("fetch %s: %w", r.name, fs.ErrNotExist)
	default:
		resp.Body.Close()
		return fmt.Errorf("fetch %s: unexpected HTTP status %s", r.name, resp.Status)
	}
	if resp.ContentLength > 0 && r.off+resp.ContentLength > r.max {
		resp.Body.Close()
		return fmt.Errorf("%s: %w (server announces %d bytes, limit %d)", r.name, ErrTooLarge, r.off+resp.ContentLength, r.max)
	}
	r.body = resp.Body
	ok = true
	return nil
}

// stop releases the current request's timer and context.
func (r *httpReader) stop() {
	if r.idle != nil {
		r.idle.Stop()
	}
	if r.cancel != nil {
		r.cancel()
	}
}

func (r *httpReader) Read(p []byte) (int, error) {
	for {
		if r.body == nil {
			if err := r.request(); err != nil {
				return 0, err
			}
		}
		n, err := r.body.Read(p)
		r.off += int64(n)
		if n > 0 {
			timeout := r.h.IdleTimeout
			if timeout == 0 {
				timeout = 60 * time.Second
			}
			r.idle.Reset(timeout)
		}
		if err == nil || errors.Is(err, io.EOF) || n > 0 {
			if errors.Is(err, io.EOF) || err == nil {
				return n, err
			}
			// Return the bytes now; the error recurs on the next Read.
			return n, nil
		}
		if r.ctx.Err() != nil {
			return 0, r.ctx.Err()
		}
		r.body.Close()
		r.stop()
		r.body = nil
		r.retries++
		max := r.h.Retries
		if max == 0 {
			max = 5
		}
		if r.retries > max {
			return 0, fmt.Errorf("fetch %s: giving up after %d resumes: %w", r.name, max, err)
		}
		select {
		case <-time.After(time.Duration(r.retries) * 100 * time.Millisecond):
		case <-r.ctx.Done():
			return 0, r.ctx.Err()
		}
	}
}

func (r *httpReader) Close() error {
	defer r.stop()
	if r.body != nil {
		return r.body.Close()
	}
	return nil
}
