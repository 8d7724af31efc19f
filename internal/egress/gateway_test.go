package egress

import (
	"bufio"
	"crypto/tls"
	"encoding/base64"
	"net/http"
	"strings"
	"testing"

	"github.com/nixcage/nixcage/internal/egress/audit"
)

// The happy paths every threat test is a deviation from.
func TestAllowedPaths(t *testing.T) {
	h := newHarness(t, nil)
	t.Run("intercepted HTTP/1.1", func(t *testing.T) {
		code, _, body, err := h.do(h.client(false), "GET", h.tlsURL("api.example.com", "/v1/models"), nil, "")
		if err != nil || code != 200 {
			t.Fatalf("got %d %v", code, err)
		}
		if !strings.Contains(body, "proto=HTTP/1.1 host=api.example.com:") {
			t.Fatalf("upstream saw %q", body)
		}
		r := h.want(t, is("GET", "api.example.com", h.up.tlsPort), audit.Allowed, "allow:*.example.com")
		if r.Path != "/v1/models" || r.BytesIn == 0 || !hasAll(r.Inspectors, "real_values", "secret_patterns") {
			t.Fatalf("record %+v", r)
		}
	})
	t.Run("intercepted HTTP/2 end to end", func(t *testing.T) {
		code, _, body, err := h.do(h.client(true), "POST", h.tlsURL("api.example.com", "/h2"), nil, `{"q":1}`)
		if err != nil || code != 200 {
			t.Fatalf("got %d %v", code, err)
		}
		if !strings.Contains(body, "proto=HTTP/2.0") {
			t.Fatalf("upstream did not speak HTTP/2: %q", body)
		}
		if s := h.up.lastSeen(); s.Body != `{"q":1}` {
			t.Fatalf("upstream body %q", s.Body)
		}
		h.want(t, func(r audit.Record) bool { return r.Method == "POST" && r.Path == "/h2" }, audit.Allowed, "")
	})
	t.Run("plain tunnel (not intercepted)", func(t *testing.T) {
		// The client must trust the upstream's own certificate: the gateway
		// does not touch a tunnelled TLS session.
		c := h.client(false)
		c.Transport.(*http.Transport).TLSClientConfig = &tls.Config{RootCAs: h.up.roots}
		code, _, body, err := h.do(c, "GET", h.tlsURL("plain.example.com", "/"), nil, "")
		if err != nil || code != 200 || !strings.Contains(body, "host=plain.example.com") {
			t.Fatalf("got %d %v %q", code, err, body)
		}
		r := h.want(t, closed("CONNECT", "plain.example.com", h.up.tlsPort), audit.Allowed, "allow:*.example.com")
		if r.BytesOut == 0 || r.BytesIn == 0 {
			t.Fatalf("tunnel bytes not counted: %+v", r)
		}
	})
	t.Run("plain HTTP forward", func(t *testing.T) {
		code, _, body, err := h.do(h.client(false), "GET", h.httpURL("plain.example.com", "/x"), nil, "")
		if err != nil || code != 200 || !strings.Contains(body, "host=plain.example.com") {
			t.Fatalf("got %d %v %q", code, err, body)
		}
		h.want(t, is("GET", "plain.example.com", h.up.httpPort), audit.Allowed, "allow:*.example.com")
	})
	t.Run("credential injected and redacted", func(t *testing.T) {
		ph := h.ph["anthropic"]
		hdr := http.Header{"X-Api-Key": {ph}, "Authorization": {"Basic " + base64.StdEncoding.EncodeToString([]byte("x-access-token:"+h.ph["github"]))}}
		code, rh, body, err := h.do(h.client(false), "GET", h.tlsURL("api.example.com", "/inject"), hdr, "")
		if err != nil || code != 200 {
			t.Fatalf("got %d %v", code, err)
		}
		s := h.up.lastSeen()
		if s.Header.Get("X-Api-Key") != realAnthropic {
			t.Fatalf("upstream did not get the real key")
		}
		if s.Header.Get("Authorization") != "Basic "+base64.StdEncoding.EncodeToString([]byte("x-access-token:"+realGitHub)) {
			t.Fatalf("upstream did not get the real Basic credentials: %q", s.Header.Get("Authorization"))
		}
		if strings.Contains(body, realAnthropic) || rh.Get("X-Echo-Key") != ph || !strings.Contains(body, ph) {
			t.Fatalf("response not redacted: header %q body %q", rh.Get("X-Echo-Key"), body)
		}
		r := h.want(t, func(r audit.Record) bool { return r.Path == "/inject" }, audit.Allowed, "")
		if !hasAll(r.SecretsInjected, "anthropic", "github") || !hasAll(r.SecretsRedacted, "anthropic") {
			t.Fatalf("record %+v", r)
		}
	})
	t.Run("streamed response is not buffered", func(t *testing.T) {
		req, _ := http.NewRequest("GET", h.tlsURL("api.example.com", "/sse"), nil)
		req.Header.Set("X-Api-Key", h.ph["anthropic"])
		resp, err := h.client(false).Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		// The upstream holds the stream open after the first event; it
		// must arrive now, redacted, not when the stream ends.
		line, err := bufio.NewReader(resp.Body).ReadString('\n')
		close(h.up.release)
		if err != nil || line != "data: one "+h.ph["anthropic"]+"\n" {
			t.Fatalf("first event: %q %v", line, err)
		}
	})
}
