package store

import (
	"context"
	"net/http"
	"net/http/httptest"
	"net/url"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/nixcage/nixcage/internal/release"
)

// A release served over HTTP (loopback) goes through the same checks, and
// a connection dropped mid-NAR is resumed with a Range request.
func TestApplyOverHTTP(t *testing.T) {
	f := getFixture(t)
	var ranges, drops atomic.Int32
	files := http.FileServer(http.Dir(f.relA))
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Range") != "" {
			ranges.Add(1)
		}
		// Drop the first response for each NAR after 64 KiB.
		if strings.HasSuffix(r.URL.Path, ".nar.xz") && r.Header.Get("Range") == "" && drops.Add(1) <= 2 {
			hj := w.(http.Hijacker)
			rec := httptest.NewRecorder()
			files.ServeHTTP(rec, r)
			conn, buf, _ := hj.Hijack()
			body := rec.Body.Bytes()
			buf.WriteString("HTTP/1.1 200 OK\r\nContent-Length: " + itoa(len(body)) + "\r\n\r\n")
			buf.Write(body[:min(len(body), 64<<10)])
			buf.Flush()
			conn.Close()
			return
		}
		files.ServeHTTP(w, r)
	}))
	defer srv.Close()
	u, _ := url.Parse(srv.URL + "/")
	s := f.open(t, filepath.Join(t.TempDir(), "root"), nil)
	res, err := s.Apply(context.Background(), &release.HTTPSource{Base: u, Client: srv.Client()})
	if err != nil {
		t.Fatal(err)
	}
	if res.Added != 2 {
		t.Fatalf("added %d paths", res.Added)
	}
	if _, err := s.Verify(context.Background(), false); err != nil {
		t.Fatal(err)
	}
	if ranges.Load() == 0 {
		t.Fatal("no Range request: the dropped NAR was not resumed")
	}
}

func itoa(n int) string { return strconv.Itoa(n) }
