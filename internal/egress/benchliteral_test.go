package egress

import (
	"crypto/tls"
	"io"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nixcage/nixcage/internal/egress/audit"
	"github.com/nixcage/nixcage/internal/policy"
)

// literalClient CONNECTs to 127.0.0.1 (an IP literal, as bench/egress/run.sh's
// ip rows do) and speaks TLS with sni inside the tunnel.
func (h *harness) literalClient(sni string) *http.Client {
	pu, _ := url.Parse("http://" + h.proxyAddr)
	tr := &http.Transport{
		Proxy:             http.ProxyURL(pu),
		TLSClientConfig:   &tls.Config{RootCAs: h.up.roots, ServerName: sni},
		DisableKeepAlives: true,
		TLSNextProto:      map[string]func(string, *tls.Conn) http.RoundTripper{},
	}
	h.t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr, Timeout: 10 * time.Second}
}

// Without the switch an IP-literal CONNECT is refused (the production
// behaviour); with it, the tunnel is decided on its TLS SNI: a name the
// policy allows gets through with an open and a close record whose rule
// shows the switch, a name it does not allow, an intercepted name and a
// forbidden address class are refused and audited.
func TestBenchIPLiterals(t *testing.T) {
	t.Run("off", func(t *testing.T) {
		h := newHarness(t, nil)
		if _, err := h.literalClient("plain.example.com").Get("https://127.0.0.1:" + strconv.Itoa(h.up.tlsPort) + "/x"); err == nil {
			t.Fatal("IP-literal tunnel through a gateway without the bench switch")
		}
		h.want(t, is("CONNECT", "127.0.0.1", h.up.tlsPort), audit.Blocked, "ip-literal")
	})
	h := setupHarness(t, nil)
	h.args = []string{"--unsafe-bench-ip-literals"}
	h.start()
	if !h.logged("--unsafe-bench-ip-literals") {
		t.Error("gateway did not log that the bench switch is on")
	}
	lit := "https://127.0.0.1:" + strconv.Itoa(h.up.tlsPort)
	t.Run("allowed SNI", func(t *testing.T) {
		code, _, body, err := h.do(h.literalClient("plain.example.com"), "GET", lit+"/lit", nil, "")
		if err != nil || code != http.StatusOK {
			t.Fatalf("GET through a literal tunnel: %d %v", code, err)
		}
		if got := h.up.lastSeen(); got == nil || got.Path != "/lit" {
			t.Fatalf("upstream saw %+v, body %q", got, body)
		}
		rule := ruleBenchLiteral + ":allow:*.example.com"
		open := h.want(t, func(r audit.Record) bool {
			return is("CONNECT", "127.0.0.1", h.up.tlsPort)(r) && r.Event == audit.EventOpen
		}, audit.Allowed, rule)
		if open.BytesOut != 0 || open.BytesIn != 0 {
			t.Errorf("open record %+v carries bytes", open)
		}
		cl := h.want(t, closed("CONNECT", "127.0.0.1", h.up.tlsPort), audit.Allowed, rule)
		if cl.BytesOut == 0 || cl.BytesIn == 0 {
			t.Errorf("close record %+v has no bytes", cl)
		}
	})
	for _, c := range []struct{ sni, rule string }{
		{"evil.test", "default-deny"},
		{"denied.example.com", "deny:denied.example.com"},
		{"api.example.com", ruleBenchLiteral}, // intercepted: only by name
	} {
		t.Run("refused SNI "+c.sni, func(t *testing.T) {
			if _, err := h.literalClient(c.sni).Get(lit + "/x"); err == nil {
				t.Fatalf("SNI %s through a literal tunnel was not refused", c.sni)
			}
			r := h.want(t, func(r audit.Record) bool {
				return is("CONNECT", "127.0.0.1", h.up.tlsPort)(r) && r.Decision == audit.Blocked && strings.Contains(r.Reason, c.sni)
			}, audit.Blocked, c.rule)
			if r.Event == audit.EventOpen {
				t.Errorf("refusal recorded as an open: %+v", r)
			}
		})
	}
	t.Run("forbidden address", func(t *testing.T) {
		if _, code := h.connect("10.1.2.3:"+strconv.Itoa(h.up.tlsPort), ""); code != http.StatusForbidden {
			t.Fatalf("CONNECT to a private literal: %d, want 403", code)
		}
		h.want(t, is("CONNECT", "10.1.2.3", h.up.tlsPort), audit.Blocked, "address")
	})
	t.Run("policy ports", func(t *testing.T) {
		if _, code := h.connect("127.0.0.1:22", ""); code != http.StatusForbidden {
			t.Fatalf("CONNECT to a literal on a port outside the policy: %d, want 403", code)
		}
		h.want(t, is("CONNECT", "127.0.0.1", 22), audit.Blocked, "port")
	})
}

// The switch is refused where a cage's gateway runs (under systemd or
// socket activation), before any configuration is read.
func TestBenchIPLiteralsRefusedUnderSystemd(t *testing.T) {
	for _, env := range []string{"INVOCATION_ID", "JOURNAL_STREAM", "LISTEN_FDS"} {
		t.Run(env, func(t *testing.T) {
			for _, e := range []string{"INVOCATION_ID", "JOURNAL_STREAM", "LISTEN_FDS"} {
				t.Setenv(e, "")
				os.Unsetenv(e)
			}
			t.Setenv(env, "1")
			err := Run(t.Context(), []string{"--config", filepath.Join(t.TempDir(), "none.json"), "--unsafe-bench-ip-literals"}, Stdio{Out: io.Discard, Err: io.Discard})
			if err == nil || !strings.Contains(err.Error(), "refused under systemd") {
				t.Fatalf("with %s set: err %v, want the bench switch refused", env, err)
			}
		})
	}
}

// No runtime document can turn IP literals on: the name is refused with a
// message saying what it is, and the gateway does not start.
func TestBenchIPLiteralsNotAPolicySetting(t *testing.T) {
	h := setupHarness(t, nil)
	b, err := os.ReadFile(h.cfgPath)
	if err != nil {
		t.Fatal(err)
	}
	doc := strings.Replace(string(b), `"unsafe_allow_loopback_upstreams"`, `"`+policy.BenchOnlyIPLiterals+`": true, "unsafe_allow_loopback_upstreams"`, 1)
	if doc == string(b) {
		t.Fatal("test document has no unsafe_allow_loopback_upstreams to insert next to")
	}
	if err := os.WriteFile(h.cfgPath, []byte(doc), 0o644); err != nil {
		t.Fatal(err)
	}
	err = Run(t.Context(), []string{"--config", h.cfgPath, "--listen-proxy", "127.0.0.1:0"}, Stdio{Out: io.Discard, Err: io.Discard})
	if err == nil || !strings.Contains(err.Error(), "--unsafe-bench-ip-literals") {
		t.Fatalf("runtime document with %s: err %v", policy.BenchOnlyIPLiterals, err)
	}
}
