package channel

import (
	"context"
	"encoding/pem"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nixcage/nixcage/internal/release"
)

const goodIndex = `{"schema":1,"channel":"stable","generation":7,"release":"releases/7"}`

// hostile serves handler and counts the body bytes it wrote, so a test
// can show the client stopped reading (memory stays bounded) rather than
// only that it returned an error.
type hostile struct {
	*httptest.Server
	sent atomic.Int64
}

func serve(t *testing.T, h func(w http.ResponseWriter, r *http.Request, sent *atomic.Int64)) *hostile {
	t.Helper()
	s := &hostile{}
	s.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { h(w, r, &s.sent) }))
	t.Cleanup(s.Close)
	return s
}

func client(t *testing.T, url string, o Options) *Client {
	t.Helper()
	o.URL = url + "/stable/"
	c, err := New(o)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// A malicious or broken channel server must not make caged use unbounded
// memory or hang: each hostile behaviour ends in an error naming it.
func TestFetchLimitsAgainstHostileServers(t *testing.T) {
	chunk := []byte(strings.Repeat("A", 32<<10))
	for _, tc := range []struct {
		name    string
		handler func(w http.ResponseWriter, r *http.Request, sent *atomic.Int64)
		want    string
		// maxSent bounds what the server got to write before the client
		// hung up: the limit plus the socket buffers.
		maxSent int64
	}{
		{
			name: "EndlessBody", want: "larger than allowed", maxSent: MaxIndexSize + 8<<20,
			handler: func(w http.ResponseWriter, r *http.Request, sent *atomic.Int64) {
				w.Header().Set("Content-Type", "application/json")
				for {
					n, err := w.Write(chunk)
					sent.Add(int64(n))
					if err != nil {
						return
					}
				}
			},
		},
		{
			name: "HugeIndexAnnounced", want: "server announces 1099511627776 bytes", maxSent: 1 << 20,
			handler: func(w http.ResponseWriter, r *http.Request, sent *atomic.Int64) {
				w.Header().Set("Content-Length", "1099511627776")
				w.WriteHeader(200)
				n, _ := w.Write(chunk)
				sent.Add(int64(n))
			},
		},
		{
			name: "HugeIndexChunked", want: "larger than allowed", maxSent: MaxIndexSize + 8<<20,
			handler: func(w http.ResponseWriter, r *http.Request, sent *atomic.Int64) {
				// A valid JSON prefix that never closes.
				n, _ := w.Write([]byte(`{"schema":1,"channel":"`))
				sent.Add(int64(n))
				for i := 0; i < 1000; i++ {
					n, err := w.Write(chunk)
					sent.Add(int64(n))
					if err != nil {
						return
					}
				}
			},
		},
		{
			name: "Slowloris", want: "not complete within 300ms (a stalling server)", maxSent: 1 << 20,
			handler: func(w http.ResponseWriter, r *http.Request, sent *atomic.Int64) {
				// One byte every 20ms: far inside the idle timeout, so only
				// the whole-file deadline ends it.
				w.WriteHeader(200)
				for {
					if _, err := w.Write([]byte(" ")); err != nil {
						return
					}
					sent.Add(1)
					w.(http.Flusher).Flush()
					select {
					case <-r.Context().Done():
						return
					case <-time.After(20 * time.Millisecond):
					}
				}
			},
		},
		{
			// The header timeout and the file deadline are the same 300ms:
			// either may fire first.
			name: "NoHeadersEver", want: "timeout awaiting response headers|a stalling server", maxSent: 0,
			handler: func(w http.ResponseWriter, r *http.Request, sent *atomic.Int64) {
				<-r.Context().Done()
			},
		},
		{
			name: "HugeHeaders", want: "header", maxSent: 1 << 20,
			handler: func(w http.ResponseWriter, r *http.Request, sent *atomic.Int64) {
				for i := 0; i < 64; i++ {
					w.Header().Add(fmt.Sprintf("X-Pad-%d", i), strings.Repeat("p", 4000))
				}
				w.WriteHeader(200)
			},
		},
		{
			name: "NotJSON", want: "channel.json: invalid character", maxSent: 1 << 20,
			handler: func(w http.ResponseWriter, r *http.Request, sent *atomic.Int64) {
				w.Write([]byte("<html>hello</html>"))
			},
		},
		{
			name: "UnknownField", want: `unknown field "extra"`, maxSent: 1 << 20,
			handler: func(w http.ResponseWriter, r *http.Request, sent *atomic.Int64) {
				w.Write([]byte(`{"schema":1,"channel":"stable","generation":7,"release":"releases/7","extra":1}`))
			},
		},
		{
			name: "ReleaseOutsideTheChannel", want: `release "../../etc": not a clean relative path`, maxSent: 1 << 20,
			handler: func(w http.ResponseWriter, r *http.Request, sent *atomic.Int64) {
				w.Write([]byte(`{"schema":1,"channel":"stable","generation":7,"release":"../../etc"}`))
			},
		},
		{
			name: "Missing", want: "has no channel.json: publish a release", maxSent: 1 << 20,
			handler: func(w http.ResponseWriter, r *http.Request, sent *atomic.Int64) {
				http.NotFound(w, r)
			},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := serve(t, tc.handler)
			c := client(t, s.URL, Options{FileTimeout: 300 * time.Millisecond})
			// The test's own bound: a client that ignores its limits fails
			// here instead of hanging the suite.
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			ix, err := c.Index(ctx)
			if err == nil {
				t.Fatalf("hostile index accepted: %+v", ix)
			}
			if ctx.Err() != nil {
				t.Fatalf("the client was stopped only by the test's own deadline: %v", err)
			}
			if !slices.ContainsFunc(strings.Split(tc.want, "|"), func(w string) bool { return strings.Contains(err.Error(), w) }) {
				t.Fatalf("error %q does not name %q", err, tc.want)
			}
			s.CloseClientConnections()
			if got := s.sent.Load(); got > tc.maxSent && tc.maxSent > 0 {
				t.Fatalf("the server wrote %d bytes before the client stopped, want at most %d", got, tc.maxSent)
			}
		})
	}
}

func TestIndexAndControlFeed(t *testing.T) {
	files := map[string]string{
		"/stable/channel.json":          goodIndex,
		"/stable/controls/index.json":   `{"schema":1,"commands":["a.json","b-2.json"]}`,
		"/stable/controls/a.json":       `{"command":"a"}`,
		"/stable/controls/b-2.json":     `{"command":"b"}`,
		"/empty/channel.json":           goodIndex,
		"/toomany/controls/index.json":  fmt.Sprintf(`{"schema":1,"commands":[%s]}`, strings.TrimSuffix(strings.Repeat(`"x",`, MaxControls+1), ",")),
		"/badname/controls/index.json":  `{"schema":1,"commands":["../../channel.json"]}`,
		"/missing/controls/index.json":  `{"schema":1,"commands":["gone.json"]}`,
		"/bigctl/controls/index.json":   `{"schema":1,"commands":["big.json"]}`,
		"/bigctl/controls/big.json":     strings.Repeat("x", MaxControlSize+1),
		"/dup/controls/index.json":      `{"schema":1,"commands":["a.json","a.json"]}`,
		"/dotname/controls/index.json":  `{"schema":1,"commands":[".hidden"]}`,
		"/schema2/controls/index.json":  `{"schema":2,"commands":[]}`,
		"/trailing/controls/index.json": `{"schema":1,"commands":[]} {}`,
	}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, ok := files[r.URL.Path]
		if !ok {
			http.NotFound(w, r)
			return
		}
		w.Write([]byte(b))
	}))
	defer srv.Close()
	ctx := context.Background()
	at := func(dir string) *Client {
		c, err := New(Options{URL: srv.URL + "/" + dir + "/"})
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	ix, err := at("stable").Index(ctx)
	if err != nil || *ix != (Index{Schema: 1, Channel: "stable", Generation: 7, Release: "releases/7"}) {
		t.Fatalf("index %+v, %v", ix, err)
	}
	cmds, err := at("stable").Controls(ctx)
	if err != nil || len(cmds) != 2 || cmds[0].Name != "a.json" || string(cmds[1].Data) != `{"command":"b"}` {
		t.Fatalf("controls %+v, %v", cmds, err)
	}
	if cmds, err := at("empty").Controls(ctx); err != nil || cmds != nil {
		t.Fatalf("a channel without a feed: %+v, %v; want none and no error", cmds, err)
	}
	for dir, want := range map[string]string{
		"toomany":  "more than the 256 allowed",
		"badname":  `command name "../../channel.json"`,
		"missing":  "gone.json",
		"bigctl":   "larger than allowed",
		"dup":      `lists "a.json" twice`,
		"dotname":  `command name ".hidden"`,
		"schema2":  "schema 2 is not supported",
		"trailing": "trailing data",
	} {
		cmds, err := at(dir).Controls(ctx)
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: controls %d, error %v; want one naming %q", dir, len(cmds), err, want)
		}
	}
}

// The release source reads the manifest from the index's directory and the
// cache from the channel's top, and a stalling server is cut off on the
// manifest too (not only on the index).
func TestReleaseSourceLayoutAndDeadline(t *testing.T) {
	var paths []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		paths = append(paths, r.URL.Path)
		switch r.URL.Path {
		case "/c/releases/7/release.json.sig":
			w.WriteHeader(200)
			for {
				if _, err := w.Write([]byte(" ")); err != nil {
					return
				}
				w.(http.Flusher).Flush()
				select {
				case <-r.Context().Done():
					return
				case <-time.After(20 * time.Millisecond):
				}
			}
		default:
			fmt.Fprintf(w, "%s", r.URL.Path)
		}
	}))
	defer srv.Close()
	c, err := New(Options{URL: srv.URL + "/c", FileTimeout: 300 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	src := c.Release(&Index{Schema: 1, Channel: "stable", Generation: 7, Release: "releases/7"})
	ctx := context.Background()
	for name, want := range map[string]string{
		release.ManifestFile:          "/c/releases/7/release.json",
		"abc.narinfo":                 "/c/abc.narinfo",
		"nar/abc.nar.xz":              "/c/nar/abc.nar.xz",
		"keys/2.json":                 "/c/keys/2.json",
		"nix-cache-info":              "/c/nix-cache-info",
		release.ManifestFile + ".bak": "/c/release.json.bak",
	} {
		b, err := release.ReadFile(ctx, src, name, 1<<20)
		if err != nil || string(b) != want {
			t.Errorf("%s: read %q, %v; want %q", name, b, err, want)
		}
	}
	_, err = release.ReadFile(ctx, src, release.SignaturesFile, 1<<20)
	if err == nil || !strings.Contains(err.Error(), "releases/7/release.json.sig: not complete within 300ms") {
		t.Fatalf("stalling signatures: %v", err)
	}
	if got := src.String(); got != srv.URL+"/c/releases/7" {
		t.Fatalf("source named %q", got)
	}
}

// https with a configured CA file works; the same server without it fails
// certificate verification (the system pool does not hold the test CA).
func TestCAFile(t *testing.T) {
	srv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Write([]byte(goodIndex))
	}))
	defer srv.Close()
	ca := filepath.Join(t.TempDir(), "ca.pem")
	if err := os.WriteFile(ca, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw}), 0o644); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	c, err := New(Options{URL: srv.URL + "/", CAFile: ca})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Index(ctx); err != nil {
		t.Fatalf("with the CA file: %v", err)
	}
	c, err = New(Options{URL: srv.URL + "/"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Index(ctx); err == nil || !strings.Contains(err.Error(), "certificate") {
		t.Fatalf("without the CA file: %v, want a certificate error", err)
	}
	for _, tc := range []struct {
		o    Options
		want string
	}{
		{Options{URL: "http://x/", CAFile: ca}, "ca_file applies to https only"},
		{Options{URL: srv.URL + "/", CAFile: "/nonexistent.pem"}, "no such file"},
		{Options{URL: srv.URL + "/", CAFile: "/etc/hostname"}, "holds no PEM certificate"},
		{Options{URL: "ftp://x/"}, "use http:// or https://"},
		{Options{URL: "https://x/#frag"}, "no #fragment"},
	} {
		if _, err := New(tc.o); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("New(%+v): %v, want %q", tc.o, err, tc.want)
		}
	}
}

// Errors from a closed port are plain fetch errors (the poller backs off).
func TestUnreachable(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	c, err := New(Options{URL: "http://" + addr + "/"})
	if err != nil {
		t.Fatal(err)
	}
	_, err = c.Index(context.Background())
	if err == nil || !strings.Contains(err.Error(), "connection refused") {
		t.Fatalf("closed port: %v", err)
	}
	var ne *net.OpError
	if !errors.As(err, &ne) {
		t.Fatalf("error %v does not wrap the network error", err)
	}
}
