package egress

import (
	"bufio"
	"bytes"
	"crypto/tls"
	"io"
	"net"
	"net/http"
	"net/url"
	"path/filepath"
	"testing"

	"github.com/nixcage/nixcage/internal/egress/audit"
	"github.com/nixcage/nixcage/internal/policy"
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

// BenchmarkPeekClientHello is the tunnel's ClientHello gate on a real
// ClientHello of Go's client (SNI, default config) through an in-memory
// connection: "gate" is peekClientHello, "crypto-tls" the throwaway
// tls.Server handshake it replaced (the differential tests' oracle), as
// the baseline of the same run.
func BenchmarkPeekClientHello(b *testing.B) {
	hello := clientHello(b, &tls.Config{ServerName: "example.com"})
	for _, bc := range []struct {
		name string
		peek func(net.Conn, []byte) (string, []byte, bool)
	}{{"gate", peekSNI}, {"crypto-tls", peekClientHelloTLS}} {
		b.Run(bc.name, func(b *testing.B) {
			var c memConn
			b.SetBytes(int64(len(hello)))
			b.ReportAllocs()
			for b.Loop() {
				if sni, raw, ok := bc.peek(c.reset(hello, 0), nil); !ok || sni != "example.com" || len(raw) != len(hello) {
					b.Fatal(sni, len(raw), ok)
				}
			}
		})
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

// benchStages is stageState with bench/egress/run.sh's five inspectors.
func benchStages(b *testing.B) (*state, string) {
	st, ph := stageStateWith(b, []policy.Inspector{
		{Name: policy.InspectRealValues, Action: policy.ActionBlock},
		{Name: policy.InspectSecretPatterns, Action: policy.ActionBlock},
		{Name: policy.InspectBodySize, Action: policy.ActionFlag, MaxBytes: 1 << 20},
		{Name: policy.InspectEntropy, Action: policy.ActionFlag},
		{Name: policy.InspectEncodedBlobs, Action: policy.ActionFlag, MinLength: 512},
	})
	st.maxHeader, st.maxBody = 64<<10, 32<<20
	return st, ph
}

// BenchmarkRequestStages runs the gateway's own per-request stages of an
// intercepted GET, without sockets, so -benchmem shows the allocations
// each stage makes per request (the end-to-end figure is
// bench/egress/run.sh's CPU per intercepted request):
//
//	go test ./internal/egress/ -run '^$' -bench RequestStages -benchmem
//
// head: decide, inspect the URL and headers (all five inspectors of the
// bench policy), inject the credential, build the upstream request.
// request-write: write the upstream request's head (writeHead).
// respond: redact a 64-byte response's headers and body to the agent.
// audit: encode and write the request's record to a file.
func BenchmarkRequestStages(b *testing.B) {
	st, ph := benchStages(b)
	tg := stageTarget(st, "api.example.com")
	hdr := http.Header{
		"User-Agent":      {"Go-http-client/1.1"},
		"Accept-Encoding": {"gzip"},
		"X-Api-Key":       {ph},
		"Accept":          {"application/json"},
	}
	b.Run("head", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			r := &http.Request{Method: "GET", URL: &url.URL{Path: "/small"}, RequestURI: "/small", Host: "api.example.com", Header: hdr.Clone(), Body: http.NoBody}
			if b := decideRequest(st, tg, r); b != nil {
				panic(b)
			}
			if _, b := decideRules(st, tg, r, false); b != nil {
				panic(b)
			}
			delHop(r.Header)
			if _, b := inspectHead(st, tg, r); b != nil {
				panic(b)
			}
			body, _ := inspectBody(st, tg, r, newDecodeBudget())
			if len(inject(st.secrets, r.Header, tg)) != 1 {
				panic("not injected")
			}
			_ = outbound(r, tg, "https", body)
		}
	})
	b.Run("request-write", func(b *testing.B) {
		r := &http.Request{Method: "GET", URL: &url.URL{Path: "/small"}, RequestURI: "/small", Host: "api.example.com", Header: hdr.Clone(), Body: http.NoBody}
		body, _ := inspectBody(st, tg, r, newDecodeBudget())
		out := outbound(r, tg, "https", body)
		bw := bufio.NewWriter(io.Discard)
		b.ReportAllocs()
		for b.Loop() {
			if !writeHead(bw, out) {
				panic("declined")
			}
			bw.Flush()
		}
	})
	b.Run("respond", func(b *testing.B) {
		g := &Gateway{}
		body := bytes.Repeat([]byte("x"), 64)
		w := discardWriter{h: http.Header{}}
		b.ReportAllocs()
		for b.Loop() {
			clear(w.h)
			resp := &http.Response{StatusCode: 200, Proto: "HTTP/1.1", ContentLength: 64,
				Header: http.Header{"Content-Length": {"64"}, "Content-Type": {"text/plain"}, "Date": {"Tue, 01 Dec 2026 17:00:00 GMT"}},
				Body:   io.NopCloser(bytes.NewReader(body)),
			}
			if _, _, err := g.respond(w, resp, tg); err != nil {
				panic(err)
			}
		}
	})
	b.Run("audit", func(b *testing.B) {
		l, err := audit.Open("bench", filepath.Join(b.TempDir(), "audit.jsonl"), false)
		if err != nil {
			b.Fatal(err)
		}
		defer l.Close()
		b.ReportAllocs()
		for b.Loop() {
			rec := audit.Record{Method: "GET", Host: "api.example.com", Port: 443, Path: "/small", Rule: "allow:*.example.com",
				Decision: audit.Allowed, Reason: "HTTP/1.1 200", Inspectors: st.insp.Names(), SecretsInjected: []string{"anthropic"}, BytesIn: 64}
			if err := l.Log(rec); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// discardWriter is a ResponseWriter that keeps nothing, so the respond
// benchmark counts the gateway's allocations and not a recorder's.
type discardWriter struct{ h http.Header }

func (w discardWriter) Header() http.Header         { return w.h }
func (w discardWriter) Write(p []byte) (int, error) { return len(p), nil }
func (w discardWriter) WriteHeader(int)             {}
func (w discardWriter) Flush()                      {}
