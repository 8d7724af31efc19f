package channel

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/nixcage/nixcage/internal/release"
)

// Defaults of the fetcher's time limits (docs/fleet.md "Limits").
const (
	// DefaultFileTimeout bounds the whole fetch of one small file: the
	// index, a control command, and a release's manifest, signatures,
	// narinfos and key sets. A server trickling bytes (slowloris) is cut
	// off here even if each byte arrives before the idle timeout.
	DefaultFileTimeout = 30 * time.Second
	// DefaultIdleTimeout aborts a response that delivers no byte for this
	// long (NARs included; a NAR resumes with a Range request).
	DefaultIdleTimeout = 30 * time.Second
	// maxHeaderBytes bounds a response's headers.
	maxHeaderBytes = 64 << 10
)

// Options configure a Client.
type Options struct {
	// URL is the channel's base: http:// or https://, or an absolute
	// directory path (a mounted channel, tests).
	URL string
	// CAFile is a PEM bundle that replaces the system's CA pool for
	// https; "" uses the system's.
	CAFile string
	// FileTimeout and IdleTimeout: zero means the defaults above.
	FileTimeout time.Duration
	IdleTimeout time.Duration
	// HTTPClient, when set, is used as is (tests with their own TLS
	// roots); nil builds release.FetchClientWith's guarded client.
	HTTPClient *http.Client
}

// Client fetches from one channel. It is safe for concurrent use.
type Client struct {
	o   Options
	src release.Source
}

// New checks o and returns a client; it does not touch the network.
func New(o Options) (*Client, error) {
	if o.FileTimeout == 0 {
		o.FileTimeout = DefaultFileTimeout
	}
	if o.IdleTimeout == 0 {
		o.IdleTimeout = DefaultIdleTimeout
	}
	if filepath.IsAbs(o.URL) {
		if o.CAFile != "" {
			return nil, fmt.Errorf("channel %s is a directory: ca_file applies to https only", o.URL)
		}
		return &Client{o: o, src: release.DirSource(o.URL)}, nil
	}
	u, err := ParseURL(o.URL)
	if err != nil {
		return nil, err
	}
	hc := o.HTTPClient
	if hc == nil {
		fo := release.FetchOptions{ResponseHeaderTimeout: o.FileTimeout, MaxResponseHeaderBytes: maxHeaderBytes}
		if o.CAFile != "" {
			if u.Scheme != "https" {
				return nil, fmt.Errorf("channel %s: ca_file applies to https only; use an https:// URL", u.Redacted())
			}
			if fo.RootCAs, err = LoadCAFile(o.CAFile); err != nil {
				return nil, err
			}
		}
		hc = release.FetchClientWith(u, fo)
	}
	return &Client{o: o, src: &release.HTTPSource{Base: u, Client: hc, IdleTimeout: o.IdleTimeout}}, nil
}

// ParseURL checks a channel URL: http or https, a host, no fragment.
func ParseURL(s string) (*url.URL, error) {
	u, err := url.Parse(s)
	if err != nil {
		return nil, fmt.Errorf("channel url %q: %w", s, err)
	}
	if u.Scheme != "http" && u.Scheme != "https" {
		return nil, fmt.Errorf("channel url %q: use http:// or https:// (or an absolute directory)", s)
	}
	if u.Host == "" || u.Fragment != "" || u.Opaque != "" {
		return nil, fmt.Errorf("channel url %q: want scheme://host[:port]/path/ with no #fragment", s)
	}
	return u, nil
}

// LoadCAFile reads a PEM bundle of CA certificates.
func LoadCAFile(p string) (*x509.CertPool, error) {
	b, err := os.ReadFile(p)
	if err != nil {
		return nil, fmt.Errorf("channel ca_file: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(b) {
		return nil, fmt.Errorf("channel ca_file %s holds no PEM certificate", p)
	}
	return pool, nil
}

func (c *Client) String() string { return c.src.String() }

// read fetches one small file whole, within FileTimeout and max bytes.
func (c *Client) read(ctx context.Context, name string, max int64) ([]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, c.o.FileTimeout)
	defer cancel()
	b, err := release.ReadFile(ctx, c.src, name, max)
	if err != nil && errors.Is(ctx.Err(), context.DeadlineExceeded) {
		return nil, fmt.Errorf("fetch %s: not complete within %s (a stalling server): %w", name, c.o.FileTimeout, err)
	}
	return b, err
}

// Index fetches and parses channel.json.
func (c *Client) Index(ctx context.Context) (*Index, error) {
	b, err := c.read(ctx, IndexFile, MaxIndexSize)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("channel %s has no %s: publish a release to it (docs/fleet.md)", c, IndexFile)
	}
	if err != nil {
		return nil, fmt.Errorf("channel index: %w", err)
	}
	return ParseIndex(b)
}

// Controls fetches the control feed: every command controls/index.json
// lists, as unverified bytes. A channel without the feed has none (nil,
// nil). One unreadable command fails the whole fetch, so a consumer never
// acts on a feed it saw only part of.
func (c *Client) Controls(ctx context.Context) ([]Control, error) {
	b, err := c.read(ctx, ControlsDir+"/"+ControlIndexFile, MaxControlIndexSize)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("control feed: %w", err)
	}
	ci, err := ParseControlIndex(b)
	if err != nil {
		return nil, err
	}
	out := make([]Control, 0, len(ci.Commands))
	for _, n := range ci.Commands {
		data, err := c.read(ctx, ControlsDir+"/"+n, MaxControlSize)
		if err != nil {
			return nil, fmt.Errorf("control feed: %w", err)
		}
		out = append(out, Control{Name: n, Data: data})
	}
	return out, nil
}

// Release is the release ix names, as a release.Source for store.Apply:
// release.json and its signatures from ix.Release, the cache (narinfos,
// NARs, nix-cache-info, keys/) from the channel's top. Every file but a
// NAR is fetched within FileTimeout; a NAR has the idle timeout and the
// size the signed manifest gives it.
func (c *Client) Release(ix *Index) release.Source {
	return &releaseSource{c: c, dir: ix.Release}
}

type releaseSource struct {
	c   *Client
	dir string
}

func (s *releaseSource) String() string {
	return strings.TrimSuffix(s.c.String(), "/") + "/" + s.dir
}

func (s *releaseSource) Open(ctx context.Context, name string, max int64) (io.ReadCloser, error) {
	target := name
	if name == release.ManifestFile || name == release.SignaturesFile {
		target = s.dir + "/" + name
	}
	if strings.HasPrefix(name, "nar/") {
		return s.c.src.Open(ctx, target, max)
	}
	ctx, cancel := context.WithTimeout(ctx, s.c.o.FileTimeout)
	rc, err := s.c.src.Open(ctx, target, max)
	if err != nil {
		cancel()
		return nil, err
	}
	return &deadlineReader{rc: rc, ctx: ctx, cancel: cancel, name: target, d: s.c.o.FileTimeout}, nil
}

// deadlineReader names the deadline when it is what stopped a read.
type deadlineReader struct {
	rc     io.ReadCloser
	ctx    context.Context
	cancel context.CancelFunc
	name   string
	d      time.Duration
}

func (r *deadlineReader) Read(p []byte) (int, error) {
	n, err := r.rc.Read(p)
	if err != nil && !errors.Is(err, io.EOF) && errors.Is(r.ctx.Err(), context.DeadlineExceeded) {
		err = fmt.Errorf("fetch %s: not complete within %s (a stalling server): %w", r.name, r.d, err)
	}
	return n, err
}

func (r *deadlineReader) Close() error {
	defer r.cancel()
	return r.rc.Close()
}
