package egress

import (
	"net/http"
	"testing"
)

// BenchmarkIntercepted measures one keep-alive client through the full
// pipeline (inspectors, injection, redaction, audit). Ratios against peers
// come from bench/egress/run.sh; this one is for profiling.
func BenchmarkIntercepted(b *testing.B) {
	h := newHarness(b, nil)
	c := h.client(false)
	c.Transport.(*http.Transport).DisableKeepAlives = false
	hdr := http.Header{"X-Api-Key": {h.ph["anthropic"]}}
	u := h.tlsURL("api.example.com", "/bench")
	b.ResetTimer()
	for b.Loop() {
		if code, _, _, err := h.do(c, "GET", u, hdr, ""); err != nil || code != 200 {
			b.Fatal(code, err)
		}
	}
}

// BenchmarkInterceptedParallel is the same with concurrent clients, each on
// its own tunnel.
func BenchmarkInterceptedParallel(b *testing.B) {
	h := newHarness(b, nil)
	hdr := http.Header{"X-Api-Key": {h.ph["anthropic"]}}
	u := h.tlsURL("api.example.com", "/bench")
	b.RunParallel(func(pb *testing.PB) {
		c := h.client(false)
		c.Transport.(*http.Transport).DisableKeepAlives = false
		for pb.Next() {
			if code, _, _, err := h.do(c, "GET", u, hdr, ""); err != nil || code != 200 {
				b.Error(code, err)
				return
			}
		}
	})
}

// BenchmarkTunnelNew opens a new, non-intercepted tunnel per request (TCP,
// CONNECT, policy, resolve, SNI check, dial, TLS, GET): the path the
// new-tunnel figure of bench/egress/run.sh measures, here for pprof.
func BenchmarkTunnelNew(b *testing.B) {
	h := newHarness(b, nil)
	c := h.client(false)
	c.Transport.(*http.Transport).TLSClientConfig.RootCAs = h.up.roots
	u := h.tlsURL("plain.example.com", "/bench")
	for b.Loop() {
		if code, _, _, err := h.do(c, "GET", u, nil, ""); err != nil || code != 200 {
			b.Fatal(code, err)
		}
	}
}

// BenchmarkTunnelKeepAlive sends requests on one held tunnel: the
// gateway's share is the copy loop only.
func BenchmarkTunnelKeepAlive(b *testing.B) {
	h := newHarness(b, nil)
	c := h.client(false)
	tr := c.Transport.(*http.Transport)
	tr.TLSClientConfig.RootCAs = h.up.roots
	tr.DisableKeepAlives = false
	u := h.tlsURL("plain.example.com", "/bench")
	for b.Loop() {
		if code, _, _, err := h.do(c, "GET", u, nil, ""); err != nil || code != 200 {
			b.Fatal(code, err)
		}
	}
}
