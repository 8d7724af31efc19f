package egress

import (
	"bufio"
	"crypto/tls"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nixcage/nixcage/internal/egress/audit"
)

// A request net/http's server refuses inside an intercepted HTTP/1.1
// tunnel, before any handler runs (a head over the limit: 431; a header
// line without a colon: 400; an unknown Expect: 417; an unknown transfer
// coding: 501), is a decision like any other: the agent gets
// the refusal, the audit gets one http-protocol record naming the tunnel's
// host, and nothing goes upstream. The refused request follows one the
// policy code served on the same tunnel, so a tunnel's earlier requests do
// not hide a later refusal (red team finding: only the tunnel's open and
// close records were written).
func TestTunnelRefusalAudited(t *testing.T) {
	h := newHarness(t, nil)
	host := "other.example.com"
	authority := host + ":" + strconv.Itoa(h.up.tlsPort)
	for _, tc := range []struct {
		name, head string
		status     int
	}{
		{"header-too-large", "X-Big: " + strings.Repeat("a", 40<<10) + "\r\n", http.StatusRequestHeaderFieldsTooLarge},
		{"malformed-header", "No colon in this line\r\n", http.StatusBadRequest},
		{"unknown-expect", "Expect: bogus\r\n", http.StatusExpectationFailed},
		{"unknown-coding", "Transfer-Encoding: bogus\r\n", http.StatusNotImplemented},
	} {
		t.Run(tc.name, func(t *testing.T) {
			path := "/tunnelaudit-" + tc.name
			raw, _ := h.connect(authority, "")
			if raw == nil {
				t.Fatalf("CONNECT %s refused", authority)
			}
			defer raw.Close()
			_ = raw.SetDeadline(time.Now().Add(20 * time.Second))
			c := tls.Client(raw, &tls.Config{RootCAs: h.cagePool, ServerName: host, NextProtos: []string{"http/1.1"}})
			br := bufio.NewReader(c)

			// A request the policy code serves first.
			fmt.Fprintf(c, "GET %s-ok HTTP/1.1\r\nHost: %s\r\n\r\n", path, authority)
			resp, err := http.ReadResponse(br, nil)
			if err != nil {
				t.Fatalf("served request: %v", err)
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				t.Fatalf("served request: %s, want 200", resp.Status)
			}

			// Then the one net/http refuses; written while the answer is
			// read, as the gateway answers before it has read it all.
			go fmt.Fprintf(c, "GET %s HTTP/1.1\r\nHost: %s\r\n%s\r\n", path, authority, tc.head)
			resp, err = http.ReadResponse(br, nil)
			if err != nil {
				t.Fatalf("refused request: no answer: %v", err)
			}
			resp.Body.Close()
			if resp.StatusCode != tc.status {
				t.Fatalf("refused request: %s, want %d", resp.Status, tc.status)
			}
			h.wantOneProtocolRefusal(t, host, "HTTP/1.1 "+strconv.Itoa(tc.status))
			if s := h.up.lastSeen(); s == nil || s.Path != path+"-ok" {
				t.Fatalf("upstream last saw %+v, want the served request %s-ok only", s, path)
			}
		})
	}
}

// wantOneProtocolRefusal checks that exactly one http-protocol record whose
// reason contains reason was written, blocked, with the tunnel's host and
// port.
func (h *harness) wantOneProtocolRefusal(t *testing.T, host, reason string) {
	t.Helper()
	refusal := func(r audit.Record) bool {
		return r.Rule == "http-protocol" && strings.Contains(r.Reason, reason)
	}
	if !h.recorded(t, refusal) {
		t.Fatalf("no http-protocol record for %q; audit:\n%s", reason, h.dump())
	}
	n := 0
	for _, r := range h.records(t) {
		if refusal(r) {
			n++
			if r.Decision != audit.Blocked || r.Host != host || r.Port != h.up.tlsPort || r.Schema != audit.Schema || r.Agent != "alice" {
				t.Fatalf("refusal record %+v: want blocked, host %s port %d", r, host, h.up.tlsPort)
			}
		}
	}
	if n != 1 {
		t.Fatalf("%d http-protocol records for %q, want 1; audit:\n%s", n, reason, h.dump())
	}
}
