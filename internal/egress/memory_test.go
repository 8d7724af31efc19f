package egress

import (
	"io"
	"net/http"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nixcage/nixcage/internal/egress/audit"
	"github.com/nixcage/nixcage/internal/policy"
)

// heapPeak samples the in-process heap while f runs and returns the peak
// growth over the heap before it (gateway, upstream and client all live in
// this process, so this bounds what the gateway holds too).
func heapPeak(t *testing.T, f func()) uint64 {
	t.Helper()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	base := ms.HeapInuse
	var peak atomic.Uint64
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		var m runtime.MemStats
		for {
			select {
			case <-stop:
				return
			case <-time.After(2 * time.Millisecond):
			}
			runtime.ReadMemStats(&m)
			if m.HeapInuse > base && m.HeapInuse-base > peak.Load() {
				peak.Store(m.HeapInuse - base)
			}
		}
	}()
	f()
	close(stop)
	wg.Wait()
	return peak.Load()
}

// Issue 11 hole 3: a 50 MB body passes the inspectors and the redactor in
// both directions without being held whole. Before, a request body was
// buffered up to max_body.
func TestStreamingBodiesBoundedMemory(t *testing.T) {
	const size = 50 << 20
	const bound = 24 << 20 // well under one body; GC slack included
	h := newHarness(t, func(rt *policy.Runtime) {
		rt.Policy.Limits.MaxBodyBytes = 64 << 20
		// Inspected whole before, so a body_size limit above the body.
		for i := range rt.Policy.Inspectors {
			if rt.Policy.Inspectors[i].Name == policy.InspectBodySize {
				rt.Policy.Inspectors[i].MaxBytes = 64 << 20
			}
		}
	})
	c := h.client(false)
	ph := h.ph["anthropic"]
	t.Run("response", func(t *testing.T) {
		var n int64
		peak := heapPeak(t, func() {
			req, _ := http.NewRequest("GET", h.tlsURL("api.example.com", "/stream?n="+strconv.Itoa(size)), nil)
			req.Header.Set("X-Api-Key", ph)
			resp, err := c.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			n, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
		})
		if n != size {
			t.Fatalf("got %d bytes, want %d", n, size)
		}
		t.Logf("50 MB response: heap peak +%.1f MiB", float64(peak)/(1<<20))
		if peak > bound {
			t.Fatalf("heap grew by %d bytes for a %d-byte response, bound %d", peak, size, bound)
		}
		h.want(t, func(r audit.Record) bool { return r.Path == "/stream" }, audit.Allowed, "")
	})
	t.Run("request", func(t *testing.T) {
		var got string
		peak := heapPeak(t, func() {
			body := io.LimitReader(repeatReader("lorem ipsum dolor sit amet, consectetur adipiscing elit\n"), size)
			req, _ := http.NewRequest("POST", h.tlsURL("api.example.com", "/sink"), body)
			req.ContentLength = size
			req.Header.Set("X-Api-Key", ph)
			resp, err := c.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			got = strings.TrimSpace(string(b))
		})
		if got != strconv.Itoa(size) {
			t.Fatalf("upstream got %q bytes, want %d", got, size)
		}
		t.Logf("50 MB request body: heap peak +%.1f MiB", float64(peak)/(1<<20))
		if peak > bound {
			t.Fatalf("heap grew by %d bytes for a %d-byte request body, bound %d", peak, size, bound)
		}
		r := h.want(t, func(r audit.Record) bool { return r.Path == "/sink" }, audit.Allowed, "")
		if r.BytesOut != size {
			t.Fatalf("audit bytes_out %d, want %d", r.BytesOut, size)
		}
	})
}

type repeatReader string

func (s repeatReader) Read(p []byte) (int, error) {
	n := 0
	for n < len(p) {
		n += copy(p[n:], s)
	}
	return n, nil
}
