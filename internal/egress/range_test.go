package egress

import (
	"fmt"
	"net/http"
	"slices"
	"strings"
	"testing"

	"github.com/nixcage/nixcage/internal/egress/audit"
)

// Red team, issue 11 item 1: an upstream that echoes the key in a body it
// serves with Range support gave it back 20 bytes at a time; no piece held a
// whole form, so nothing was redacted (audit: allowed), and the agent put
// the pieces together. Toward a secret-bound host the gateway drops Range
// and If-Range: the upstream sends the whole body, which is redacted.
// Another intercepted host keeps its ranges.
func TestThreatRangeReassembly(t *testing.T) {
	h := newHarness(t, nil)
	c := h.client(false)
	var got strings.Builder
	for off := 0; off < 10+len(realAnthropic); off += 20 {
		path := fmt.Sprintf("/ranged?off=%d", off)
		code, _, body, err := h.do(c, "GET", h.tlsURL("api.example.com", path), http.Header{"X-Api-Key": {h.ph["anthropic"]}, "Range": {fmt.Sprintf("bytes=%d-%d", off, off+19)}, "If-Range": {`"x"`}}, "")
		if err != nil || code != http.StatusOK {
			t.Fatalf("range at %d: %d %v %q, want the whole body (200)", off, code, err, body)
		}
		got.WriteString(body)
		if s := h.up.lastSeen(); s == nil || s.Header.Get("Range") != "" || s.Header.Get("If-Range") != "" {
			t.Fatalf("the upstream got a range request: %+v", s)
		}
		r := h.want(t, func(r audit.Record) bool {
			return r.Method == "GET" && r.Host == "api.example.com" && r.Event == audit.EventRequest && r.BytesIn > 0 && len(r.SecretsRedacted) > 0
		}, audit.Allowed, "")
		if !slices.Contains(r.SecretsInjected, "anthropic") || !slices.Contains(r.SecretsRedacted, "anthropic") {
			t.Fatalf("audit record %+v: want anthropic injected and redacted", r)
		}
	}
	if strings.Contains(got.String(), realAnthropic) || !strings.Contains(got.String(), h.ph["anthropic"]) {
		t.Fatalf("what the agent got: %q", got.String())
	}
	code, _, body, err := h.do(c, "GET", h.tlsURL("other.example.com", "/ranged"), http.Header{"Range": {"bytes=0-3"}}, "")
	if err != nil || code != http.StatusPartialContent || body != "your" {
		t.Fatalf("range on a host without secrets: %d %v %q, want 206 \"your\"", code, err, body)
	}
}
