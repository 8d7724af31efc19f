package release

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

func httpSource(t *testing.T, h http.Handler) *HTTPSource {
	t.Helper()
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	u, _ := url.Parse(srv.URL + "/rel/")
	return &HTTPSource{Base: u, Client: srv.Client()}
}

// flaky serves content with Range support but cuts the first `cuts`
// responses short after chunk bytes, as a dropping network would.
func flaky(content []byte, cuts int32, chunk int) (http.Handler, *atomic.Int32) {
	var ranges atomic.Int32
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Range") != "" {
			ranges.Add(1)
		}
		if cuts > 0 {
			cuts--
			hj, _ := w.(http.Hijacker)
			conn, buf, _ := hj.Hijack()
			start := 0
			status := "200 OK"
			extra := ""
			if rg := r.Header.Get("Range"); rg != "" {
				start, _ = strconv.Atoi(strings.TrimSuffix(strings.TrimPrefix(rg, "bytes="), "-"))
				status = "206 Partial Content"
				extra = "Content-Range: bytes " + itoa(start) + "-" + itoa(len(content)-1) + "/" + itoa(len(content)) + "\r\n"
			}
			buf.WriteString("HTTP/1.1 " + status + "\r\nContent-Length: " + itoa(len(content)-start) + "\r\n" + extra + "\r\n")
			end := min(start+chunk, len(content))
			buf.Write(content[start:end])
			buf.Flush()
			conn.Close()
			return
		}
		http.ServeContent(w, r, "x", time.Time{}, bytes.NewReader(content))
	}), &ranges
}

func itoa(n int) string { return strconv.Itoa(n) }

func TestHTTPSourceResumes(t *testing.T) {
	content := bytes.Repeat([]byte("0123456789abcdef"), 64<<10) // 1 MiB
	h, ranges := flaky(content, 3, 100<<10)
	src := httpSource(t, h)
	rc, err := src.Open(context.Background(), "nar/x.nar", int64(len(content)))
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	got, err := io.ReadAll(rc)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, content) {
		t.Fatalf("resumed body differs: %d bytes, want %d", len(got), len(content))
	}
	if ranges.Load() < 2 {
		t.Fatalf("only %d Range requests: the reads were not resumed", ranges.Load())
	}
}

func TestHTTPSourceRefusesWrongResume(t *testing.T) {
	content := bytes.Repeat([]byte("x"), 1<<20)
	cut := true
	src := httpSource(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if cut {
			cut = false
			hj, _ := w.(http.Hijacker)
			conn, buf, _ := hj.Hijack()
			buf.WriteString("HTTP/1.1 200 OK\r\nContent-Length: 1048576\r\n\r\n")
			buf.Write(content[:1000])
			buf.Flush()
			conn.Close()
			return
		}
		w.Write(content) // ignores Range: would splice the start in again
	}))
	rc, err := src.Open(context.Background(), "nar/x.nar", int64(len(content)))
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	if _, err := io.ReadAll(rc); err == nil || !strings.Contains(err.Error(), "unexpected HTTP status 200") {
		t.Fatalf("resume answered with 200: %v", err)
	}
}

func TestHTTPSourceEndlessData(t *testing.T) {
	src := httpSource(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		chunk := make([]byte, 32<<10)
		for {
			if _, err := w.Write(chunk); err != nil {
				return
			}
		}
	}))
	rc, err := src.Open(context.Background(), "nar/x.nar", 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	n, err := io.Copy(io.Discard, rc)
	if !errors.Is(err, ErrTooLarge) || n > 1<<20+1 {
		t.Fatalf("endless body: read %d bytes, err %v; want ErrTooLarge after at most the limit", n, err)
	}
	// A server that announces too much is refused before any body is read.
	src = httpSource(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", "99999999")
		w.WriteHeader(200)
	}))
	if _, err := src.Open(context.Background(), "release.json", 1000); !errors.Is(err, ErrTooLarge) {
		t.Fatalf("announced oversize: %v", err)
	}
}

func TestSourceNames(t *testing.T) {
	dir := t.TempDir()
	src := DirSource(dir)
	for _, name := range []string{"../etc/passwd", "/etc/passwd", "a/../../b", ""} {
		if _, err := src.Open(context.Background(), name, 10); err == nil {
			t.Errorf("name %q accepted", name)
		}
	}
	if _, err := NewSource("ftp://example.org/x"); err == nil {
		t.Error("ftp source accepted")
	}
}

// A server that stops sending mid-body is abandoned after IdleTimeout and
// the read resumes from where it stopped.
func TestHTTPSourceStallResumed(t *testing.T) {
	content := bytes.Repeat([]byte("stall"), 100<<10)
	var first atomic.Bool
	first.Store(true)
	src := httpSource(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if first.Swap(false) {
			w.Header().Set("Content-Length", strconv.Itoa(len(content)))
			w.Write(content[:10000])
			w.(http.Flusher).Flush()
			<-r.Context().Done() // stall until the client gives up
			return
		}
		http.ServeContent(w, r, "x", time.Time{}, bytes.NewReader(content))
	}))
	src.IdleTimeout = 200 * time.Millisecond
	rc, err := src.Open(context.Background(), "nar/x.nar", int64(len(content)))
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	got, err := io.ReadAll(rc)
	if err != nil || !bytes.Equal(got, content) {
		t.Fatalf("stalled download: %d bytes, %v", len(got), err)
	}
}
