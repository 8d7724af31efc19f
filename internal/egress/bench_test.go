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
