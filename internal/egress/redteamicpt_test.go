package egress

// Red team of the intercepted path's fast paths (issue 20's fifth pass),
// run as the caged agent would, through the real gateway: the redactor's
// no-copy shortcut for header values (redact.Matcher.String's two-byte
// prefix check, redactHeader copying only changed values) and the
// hand-written audit encoder (auditlog.Record.AppendJSON) fed with the
// agent's own words.

import (
	"bufio"
	"bytes"
	"crypto/tls"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/nixcage/nixcage/internal/egress/audit"
	"github.com/nixcage/nixcage/internal/egress/redact"
	"github.com/nixcage/nixcage/internal/policy"
)

// headerEcho answers /hdrecho with the X-Api-Key it received (the real
// key, injected by the gateway) in response headers, in every form the
// redactor claims, at places the fast path must not skip: the second value
// of a header whose first is untouched, the middle of a longer value at
// each base64 alignment, a header name.
func (u *upstream) headerEcho(w http.ResponseWriter, r *http.Request) {
	key := r.Header.Get("X-Api-Key")
	h := w.Header()
	h["X-Raw"] = []string{"benign first value", "second " + key}
	for shift := range 3 {
		lead := strings.Repeat("u", shift)
		h[fmt.Sprintf("X-B64-%d", shift)] = []string{"Basic " + base64.StdEncoding.EncodeToString([]byte(lead+key+"}"))}
		h[fmt.Sprintf("X-B64url-%d", shift)] = []string{"t=" + base64.RawURLEncoding.EncodeToString([]byte(lead+key+"}"))}
	}
	h["X-Hex"] = []string{"ok", hex.EncodeToString([]byte(key))}
	h["X-Hex-Upper"] = []string{strings.ToUpper(hex.EncodeToString([]byte(key)))}
	h["X-Pct-Upper"] = []string{"next=" + pctEvery(key)}
	h["X-Pct-Lower"] = []string{"next=" + strings.ToLower(pctEvery(key))}
	rev := []byte(key)
	slices.Reverse(rev)
	h["X-Rev"] = []string{string(rev)}
	// A name net/http keeps as it is through canonicalization: lower
	// hex after a digit.
	h["X-"+hex.EncodeToString([]byte(key))] = []string{"name"}
	// The key itself as a name: net/http changes its letters' case
	// before the gateway sees it.
	h["X-"+key] = []string{"raw name"}
	h["X-Both"] = []string{key, key}
	fmt.Fprintln(w, "see headers")
}

func TestRedTeamKeyInResponseHeaderForms(t *testing.T) {
	h := newHarness(t, nil)
	ph := h.ph["anthropic"]
	forms, err := redact.Forms("anthropic", realAnthropic, ph)
	if err != nil {
		t.Fatal(err)
	}
	for _, h2 := range []bool{false, true} {
		t.Run(fmt.Sprintf("h2=%v", h2), func(t *testing.T) {
			path := fmt.Sprintf("/hdrecho/%v", h2)
			code, hdr, _, err := h.do(h.client(h2), "GET", h.tlsURL("api.example.com", path), http.Header{"X-Api-Key": {ph}}, "")
			if err != nil || code != 200 {
				t.Fatalf("status %d err %v", code, err)
			}
			var seen strings.Builder
			for k, vs := range hdr {
				seen.WriteString(k + "\n")
				for _, v := range vs {
					seen.WriteString(v + "\n")
				}
			}
			all := seen.String()
			for _, f := range forms {
				if strings.Contains(all, string(f.Real)) {
					t.Errorf("the agent received the real key's %s form %q in a response header:\n%s", f.Kind, f.Real, all)
				}
			}
			// A name reaches the agent canonicalized, so the agent reads
			// names without case: the key but for its letters' case is
			// the key to it (before the fix "X-Sk-Ant-Api03-Realreal…"
			// came through).
			rawName := false
			for k := range hdr {
				for _, f := range forms {
					if strings.Contains(strings.ToLower(k), strings.ToLower(string(f.Real))) {
						t.Errorf("the agent received the real key's %s form, case changed, in the response header name %q", f.Kind, k)
					}
				}
				rawName = rawName || strings.Contains(strings.ToLower(k), strings.ToLower(ph[14:]))
			}
			if !rawName {
				t.Errorf("no header name carries the placeholder where the upstream put the key:\n%s", all)
			}
			// The agent decodes what it got, as it would.
			realMid := realAnthropic[14 : len(realAnthropic)-2]
			var dec []string
			for shift := range 3 {
				b, _ := base64.StdEncoding.DecodeString(strings.TrimPrefix(hdr.Get(fmt.Sprintf("X-B64-%d", shift)), "Basic "))
				dec = append(dec, string(b))
				b, _ = base64.RawURLEncoding.DecodeString(strings.TrimPrefix(hdr.Get(fmt.Sprintf("X-B64url-%d", shift)), "t="))
				dec = append(dec, string(b))
			}
			for _, v := range append(hdr.Values("X-Hex"), hdr.Get("X-Hex-Upper")) {
				b, _ := hex.DecodeString(v)
				dec = append(dec, string(b))
			}
			for k := range hdr {
				b, _ := hex.DecodeString(strings.ToLower(strings.TrimPrefix(k, "X-")))
				dec = append(dec, string(b))
			}
			for _, d := range dec {
				if strings.Contains(d, realMid) {
					t.Errorf("the agent decoded the real key from a response header: %q", d)
				}
			}
			if got := hdr.Values("X-Raw"); len(got) != 2 || got[0] != "benign first value" || got[1] != "second "+ph {
				t.Errorf("X-Raw reached the agent as %q, want the first value as sent and the placeholder in the second", got)
			}
			if got := hdr.Values("X-Both"); len(got) != 2 || got[0] != ph || got[1] != ph {
				t.Errorf("X-Both reached the agent as %q, want the placeholder twice", got)
			}
			r := h.want(t, func(r audit.Record) bool { return r.Path == path }, audit.Allowed, "allow:*.example.com")
			if !slices.Contains(r.SecretsRedacted, "anthropic") || !slices.Contains(r.SecretsInjected, "anthropic") {
				t.Fatalf("audit injected %v redacted %v, want anthropic in both", r.SecretsInjected, r.SecretsRedacted)
			}
		})
	}
}

// The agent's path goes into its audit record byte for byte (decoded): the
// encoder must keep one record one line, escape what json.Marshal
// escapes, and give back the path the agent sent when read.
func TestRedTeamAuditRecordFromAgentPath(t *testing.T) {
	h := newHarness(t, nil)
	c := h.client(false)
	paths := []string{
		`/forge%0A%7B%22schema%22:1,%22decision%22:%22allowed%22%7D`,
		`/forge%0D%0A%7B%22x%22:1%7D`,
		`/quote%22back%5Cslash%5C`,
		`/ls%E2%80%A8ps%E2%80%A9end`,
		`/bad%FF%FEutf8%C3`,
		`/ctl%00%01%08%0C%09%1B%7F`,
		`/html%3Cscript%3E&amp%3B`,
		`/surrogate%ED%A0%80x`,
	}
	for _, p := range paths {
		req, err := http.NewRequest("GET", h.tlsURL("api.example.com", p), nil)
		if err != nil {
			t.Fatal(err)
		}
		resp, err := c.Do(req)
		if err != nil {
			t.Fatalf("%s: %v", p, err)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	for _, p := range paths {
		u, err := url.PathUnescape(p)
		if err != nil {
			t.Fatal(err)
		}
		// json.Marshal's reading of the path: each invalid UTF-8 byte
		// one U+FFFD.
		b, _ := json.Marshal(u)
		var want string
		json.Unmarshal(b, &want)
		if !h.recorded(t, func(r audit.Record) bool { return r.Path == want }) {
			t.Fatalf("no audit record with path %q; have:\n%s", want, h.dump())
		}
	}
	// The agent's method and Host header reach a refusal's record (the
	// reason quotes the Host): characters json.Marshal escapes in both.
	host := "api.example.com:" + strconv.Itoa(h.up.tlsPort)
	conn, code := h.connect(host, "")
	if code != 200 {
		t.Fatalf("CONNECT: %d", code)
	}
	defer conn.Close()
	tc := tls.Client(conn, &tls.Config{ServerName: "api.example.com", RootCAs: h.cagePool})
	fmt.Fprintf(tc, "G&T /fronted HTTP/1.1\r\nHost: evil.example.com&'x\r\n\r\n")
	if resp, err := http.ReadResponse(bufio.NewReader(tc), nil); err != nil || resp.StatusCode != http.StatusMisdirectedRequest {
		t.Fatalf("fronted request: %v %v", resp, err)
	}
	fr := h.want(t, func(r audit.Record) bool { return r.Path == "/fronted" }, audit.Blocked, "host-mismatch")
	if fr.Method != "G&T" || !strings.Contains(fr.Reason, `"evil.example.com&'x"`) {
		t.Fatalf("fronted record method %q reason %q, want the agent's method and Host as sent", fr.Method, fr.Reason)
	}
	raw, err := os.ReadFile(h.rt.AuditFile)
	if err != nil {
		t.Fatal(err)
	}
	lines := bytes.Split(bytes.TrimSuffix(raw, []byte("\n")), []byte("\n"))
	for _, line := range lines {
		var r audit.Record
		if err := json.Unmarshal(line, &r); err != nil {
			t.Fatalf("audit line %q is not one record: %v", line, err)
		}
		if r.Schema != audit.Schema || r.Agent != "alice" {
			t.Fatalf("audit line %q: schema %d agent %q (a forged record?)", line, r.Schema, r.Agent)
		}
		for i := 0; i < len(line); {
			c, n := utf8.DecodeRune(line[i:])
			switch {
			case c == utf8.RuneError && n == 1, c < 0x20, c == '\u2028', c == '\u2029', c == '<', c == '>', c == '&':
				t.Fatalf("audit line has %q unescaped at %d: %q", c, i, line)
			}
			i += n
		}
	}
	n := 0
	for _, r := range h.records(t) {
		if strings.HasPrefix(r.Path, "/forge") {
			n++
		}
	}
	if n != 2 {
		t.Fatalf("%d records with a /forge path, want 2 (one per request):\n%s", n, raw)
	}
}

// recorded polls the audit file for a record matching match.
func (h *harness) recorded(t testing.TB, match func(audit.Record) bool) bool {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if slices.ContainsFunc(h.records(t), match) {
			return true
		}
	}
	return false
}

// A ban of the host closes an intercepted HTTP/1.1 tunnel whose request
// is still waiting on the upstream: the exchange in flight is aborted
// (the upstream sees the gateway leave) and audited as abandoned, for a
// request without a body and one whose body was sent whole. The tunnel's
// agentConn learns it from the read the ban's close fails (rather than a
// context.AfterFunc per request, issue 20).
func TestRedTeamBanAbortsInterceptedExchange(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("bans files must be owned by root (uid 0); run as root")
	}
	gone := make(chan string, 4)
	arrived := make(chan string, 4)
	hold := make(chan struct{})
	t.Cleanup(func() { close(hold) })
	var s *scriptedUpstream
	var bfile string
	h := newHarness(t, func(rt *policy.Runtime) {
		s = startScripted(t, filepath.Join(filepath.Dir(rt.AuditFile), "upstream-ca"), func(n int, c net.Conn, br *bufio.Reader) {
			req, err := http.ReadRequest(br)
			if err != nil {
				return
			}
			io.Copy(io.Discard, req.Body)
			arrived <- req.URL.Path
			go func() {
				_, _ = br.ReadByte() // returns when the gateway closes its end
				gone <- req.URL.Path
			}()
			<-hold
		})
		rt.Policy.Ports = append(rt.Policy.Ports, s.port)
		dir := filepath.Join(filepath.Dir(rt.AuditFile), "control-run")
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		os.Chmod(dir, 0o755)
		bfile = filepath.Join(dir, "bans.json")
		rt.BansFile = bfile
	})
	writeBans(t, bfile)
	host := "api.example.com:" + strconv.Itoa(s.port)
	for _, req := range []string{
		"GET /thinking-get HTTP/1.1\r\nHost: " + host + "\r\n\r\n",
		"POST /thinking-post HTTP/1.1\r\nHost: " + host + "\r\nContent-Length: 5\r\n\r\nhello",
	} {
		path := strings.Fields(req)[1]
		t.Run(path, func(t *testing.T) {
			writeBans(t, bfile)
			raw := h.pollConnect(t, host, http.StatusOK)
			defer raw.Close()
			tc := tls.Client(raw, &tls.Config{ServerName: "api.example.com", RootCAs: h.cagePool})
			if _, err := io.WriteString(tc, req); err != nil {
				t.Fatal(err)
			}
			select { // the request reaches the upstream (a fixed 300 ms before)
			case p := <-arrived:
				if p != path {
					t.Fatalf("the upstream got %s, want %s", p, path)
				}
			case <-time.After(10 * time.Second):
				t.Fatal("the request never reached the upstream")
			}
			writeBans(t, bfile, policy.Ban{ID: "b-0123456789ab", Host: "api.example.com", Agent: "*", CreatedUnix: time.Now().Unix(), Command: strings.Repeat("ab", 32)})
			select {
			case p := <-gone:
				if p != path {
					t.Fatalf("the upstream saw %s end, want %s", p, path)
				}
			case <-time.After(10 * time.Second):
				t.Fatal("the gateway kept its upstream exchange after a ban closed the tunnel")
			}
			r := h.want(t, func(r audit.Record) bool { return r.Path == path }, audit.Blocked, "upstream")
			if !strings.Contains(r.Reason, "abandoned by the agent") {
				t.Fatalf("record %+v: want the reason to say the agent's tunnel went", r)
			}
		})
	}
}
