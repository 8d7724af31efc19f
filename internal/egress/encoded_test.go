package egress

// Issue 11 hole 1 and issue 21 item 2, run as the caged agent would: an
// upstream bound to a secret echoes the injected key back in every encoding
// the agent could undo, and reflects the agent's guesses at it.

import (
	"bufio"
	"bytes"
	"compress/flate"
	"compress/gzip"
	"compress/zlib"
	"crypto/tls"
	"encoding/base64"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/andybalholm/brotli"
	"github.com/klauspost/compress/zstd"

	"github.com/nixcage/nixcage/internal/egress/audit"
)

// echo answers /echo/<form> with the X-Api-Key it received (the real key,
// injected by the gateway) encoded as form, ignoring Accept-Encoding as a
// hostile or careless server would.
func (u *upstream) echo(w http.ResponseWriter, r *http.Request) {
	u.mu.Lock()
	u.last = &seen{Proto: r.Proto, Host: r.Host, Header: r.Header.Clone(), Path: r.URL.Path}
	u.mu.Unlock()
	key := r.Header.Get("X-Api-Key")
	body := []byte("{\"error\":\"bad key " + key + "\"}\n")
	compress := func(coding string, wr func(io.Writer) io.WriteCloser) {
		var b bytes.Buffer
		zw := wr(&b)
		zw.Write(body)
		zw.Close()
		w.Header().Set("Content-Encoding", coding)
		w.Write(b.Bytes())
	}
	switch strings.TrimPrefix(r.URL.Path, "/echo/") {
	case "gzip":
		compress("gzip", func(w io.Writer) io.WriteCloser { return gzip.NewWriter(w) })
	case "gzip-gzip":
		var inner bytes.Buffer
		zw := gzip.NewWriter(&inner)
		zw.Write(body)
		zw.Close()
		body = inner.Bytes()
		compress("gzip, gzip", func(w io.Writer) io.WriteCloser { return gzip.NewWriter(w) })
	case "deflate":
		compress("deflate", func(w io.Writer) io.WriteCloser { return zlib.NewWriter(w) })
	case "rawdeflate":
		compress("deflate", func(w io.Writer) io.WriteCloser { zw, _ := flate.NewWriter(w, 5); return zw })
	case "br":
		compress("br", func(w io.Writer) io.WriteCloser { return brotli.NewWriter(w) })
	case "zstd":
		compress("zstd", func(w io.Writer) io.WriteCloser { zw, _ := zstd.NewWriter(w); return zw })
	case "compress":
		w.Header().Set("Content-Encoding", "compress")
		w.Write(body)
	case "basic":
		v := "Basic " + base64.StdEncoding.EncodeToString([]byte("user:"+key))
		w.Header().Set("X-Echo-Auth", v)
		fmt.Fprintf(w, "authorization was %s\n", v)
	case "base64url":
		fmt.Fprintf(w, "token=%s\n", base64.RawURLEncoding.EncodeToString([]byte(`{"k":"`+key+`"}`)))
	case "hex":
		fmt.Fprintf(w, "%x\n", key)
	case "percent":
		fmt.Fprintf(w, "next=%s\n", pctEvery(key))
	case "reversed":
		b := []byte(key)
		slices.Reverse(b)
		fmt.Fprintf(w, "%s\n", b)
	case "trailer":
		w.Header().Set("Trailer", "X-Echo-Trailer")
		fmt.Fprintln(w, "see trailer")
		w.Header().Set("X-Echo-Trailer", key)
	}
}

func pctEvery(s string) string {
	var sb strings.Builder
	for i := 0; i < len(s); i++ {
		fmt.Fprintf(&sb, "%%%02X", s[i])
	}
	return sb.String()
}

// agentDecode undoes whatever the agent received, as the agent would: the
// content-coding it was sent, then the form the upstream used.
func agentDecode(t *testing.T, form string, h http.Header, body []byte) string {
	t.Helper()
	for _, c := range strings.Split(h.Get("Content-Encoding"), ",") {
		c = strings.TrimSpace(c)
		var r io.Reader
		var err error
		switch c {
		case "gzip":
			r, err = gzip.NewReader(bytes.NewReader(body))
		case "deflate":
			r, err = zlib.NewReader(bytes.NewReader(body))
		case "br":
			r = brotli.NewReader(bytes.NewReader(body))
		case "zstd":
			r, err = zstd.NewReader(bytes.NewReader(body))
		}
		if err == nil && r != nil {
			body, _ = io.ReadAll(r)
		}
	}
	s := string(body)
	switch form {
	case "basic":
		v := strings.TrimSpace(strings.TrimPrefix(strings.SplitN(s, "\n", 2)[0], "authorization was Basic "))
		d, _ := base64.StdEncoding.DecodeString(v)
		return string(d) + " header:" + h.Get("X-Echo-Auth")
	case "base64url":
		d, _ := base64.RawURLEncoding.DecodeString(strings.TrimSpace(strings.TrimPrefix(s, "token=")))
		return string(d)
	case "hex":
		d, _ := hex.DecodeString(strings.TrimSpace(s))
		return string(d)
	case "percent":
		d, _ := url.QueryUnescape(strings.TrimSpace(strings.TrimPrefix(s, "next=")))
		return d
	case "reversed":
		b := []byte(strings.TrimSpace(s))
		slices.Reverse(b)
		return string(b)
	case "trailer":
		return s + " trailer:" + h.Get("X-Echo-Trailer")
	}
	return s
}

func TestThreatEncodedEcho(t *testing.T) {
	h := newHarness(t, nil)
	ph := h.ph["anthropic"]
	// The secret-specific middle of each: the provider prefix is public
	// and shared, and a base64 character at each end mixes in neighbours.
	realMid, phMid := realAnthropic[14:len(realAnthropic)-2], ph[14:len(ph)-2]
	tr := &http.Transport{
		Proxy:              http.ProxyURL(&url.URL{Scheme: "http", Host: h.proxyAddr}),
		TLSClientConfig:    &tls.Config{RootCAs: h.cagePool},
		DisableCompression: true, // the agent sees the bytes as sent
		TLSNextProto:       map[string]func(string, *tls.Conn) http.RoundTripper{},
	}
	t.Cleanup(tr.CloseIdleConnections)
	c := &http.Client{Transport: tr}
	for _, form := range []string{"gzip", "gzip-gzip", "deflate", "rawdeflate", "br", "zstd", "basic", "base64url", "hex", "percent", "reversed", "trailer"} {
		t.Run(form, func(t *testing.T) {
			req, _ := http.NewRequest("GET", h.tlsURL("api.example.com", "/echo/"+form), nil)
			req.Header.Set("X-Api-Key", ph)
			req.Header.Set("Accept-Encoding", "gzip, deflate, br, zstd")
			resp, err := c.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode != 200 {
				t.Fatalf("status %d: %s", resp.StatusCode, body)
			}
			if ae := h.up.lastSeen().Header.Get("Accept-Encoding"); ae != "identity" {
				t.Fatalf("upstream bound to a secret was offered Accept-Encoding %q, want identity", ae)
			}
			h2 := resp.Header.Clone()
			for k, v := range resp.Trailer {
				h2[k] = v
			}
			got := agentDecode(t, form, h2, body)
			if strings.Contains(got, realMid) || strings.Contains(string(body), realMid) {
				t.Fatalf("the agent decoded the real key from a %s echo: %q", form, got)
			}
			if !strings.Contains(got, phMid) {
				t.Fatalf("%s echo: the placeholder is not where the key was: %q", form, got)
			}
			r := h.want(t, func(r audit.Record) bool { return r.Path == "/echo/"+form }, audit.Allowed, "allow:*.example.com")
			if !slices.Contains(r.SecretsRedacted, "anthropic") {
				t.Fatalf("audit secrets_redacted %v, want anthropic", r.SecretsRedacted)
			}
		})
	}
	t.Run("undecodable coding is refused", func(t *testing.T) {
		req, _ := http.NewRequest("GET", h.tlsURL("api.example.com", "/echo/compress"), nil)
		req.Header.Set("X-Api-Key", ph)
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusBadGateway || strings.Contains(string(body), realMid) {
			t.Fatalf("status %d body %q", resp.StatusCode, body)
		}
		h.want(t, func(r audit.Record) bool { return r.Path == "/echo/compress" }, audit.Blocked, "content-encoding")
	})
}

// A key the agent transformed (it should never have one, but a leak
// elsewhere would give it one) is blocked on the way out, to any host.
func TestThreatTransformedKeyOutbound(t *testing.T) {
	h := newHarness(t, nil)
	c := h.client(false)
	rev := []byte(realAnthropic)
	slices.Reverse(rev)
	cases := []struct {
		name string
		hdr  http.Header
		path string
		body string
	}{
		{"base64 at an odd offset", nil, "/t-b64", base64.StdEncoding.EncodeToString([]byte(`{"note":"` + realAnthropic + `"}`))},
		{"base64url unpadded", nil, "/t-b64url", base64.RawURLEncoding.EncodeToString([]byte("xy" + realGitHub))},
		{"hex", nil, "/t-hex", hex.EncodeToString([]byte(realAnthropic))},
		{"HEX in a header", http.Header{"X-Data": {strings.ToUpper(hex.EncodeToString([]byte(realGitHub)))}}, "/t-hexhdr", ""},
		{"percent-encoded every byte", nil, "/t-pct", "k=" + pctEvery(realAnthropic)},
		{"percent-encoded in the query", nil, "/t-q?k=" + url.QueryEscape(base64.StdEncoding.EncodeToString([]byte("a"+realGitHub))), ""},
		{"Basic pair in another header", http.Header{"X-Creds": {"Basic " + base64.StdEncoding.EncodeToString([]byte("me:"+realAnthropic))}}, "/t-basic", ""},
		{"reversed", nil, "/t-rev", string(rev)},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			code, _, body, err := h.do(c, "POST", h.tlsURL("other.example.com", tc.path), tc.hdr, tc.body)
			if err != nil || code != http.StatusForbidden {
				t.Fatalf("got %d %v %q, want 403", code, err, body)
			}
			if s := h.up.lastSeen(); s != nil && s.Path == strings.Split(tc.path, "?")[0] {
				t.Fatal("request reached the upstream")
			}
			r := h.want(t, func(r audit.Record) bool { return r.Path == strings.Split(tc.path, "?")[0] }, audit.Blocked, "inspector:real_values")
			if !strings.Contains(r.Reason, "real value of secret") {
				t.Fatalf("reason %q", r.Reason)
			}
		})
	}
}

// rawChunks sends one HTTP/1.1 request through an intercepted tunnel and
// returns the chunk sizes of the chunked response, as `curl --http1.1 --raw`
// shows them.
func rawChunks(t *testing.T, h *harness, path string, hdr http.Header) []int {
	t.Helper()
	conn, code := h.connect("api.example.com:"+strconv.Itoa(h.up.tlsPort), "")
	if code != 200 {
		t.Fatalf("CONNECT: %d", code)
	}
	defer conn.Close()
	tc := tls.Client(conn, &tls.Config{RootCAs: h.cagePool, ServerName: "api.example.com", NextProtos: []string{"http/1.1"}})
	var req bytes.Buffer
	fmt.Fprintf(&req, "GET %s HTTP/1.1\r\nHost: api.example.com:%d\r\nConnection: close\r\n", path, h.up.tlsPort)
	hdr.Write(&req)
	req.WriteString("\r\n")
	if _, err := tc.Write(req.Bytes()); err != nil {
		t.Fatal(err)
	}
	br := bufio.NewReader(tc)
	for { // status line and headers
		line, err := br.ReadString('\n')
		if err != nil {
			t.Fatalf("response head: %v", err)
		}
		if line == "\r\n" {
			break
		}
	}
	return chunkSizes(t, br)
}

// chunkSizes reads a chunked body and returns its chunks' sizes.
func chunkSizes(t *testing.T, br *bufio.Reader) []int {
	t.Helper()
	var sizes []int
	for {
		line, err := br.ReadString('\n')
		if err != nil {
			t.Fatalf("chunk size: %v (sizes so far %v)", err, sizes)
		}
		n, err := strconv.ParseInt(strings.TrimSpace(line), 16, 64)
		if err != nil {
			t.Fatalf("chunk size line %q", line)
		}
		if n == 0 {
			return sizes
		}
		sizes = append(sizes, int(n))
		if _, err := io.CopyN(io.Discard, br, n+2); err != nil {
			t.Fatal(err)
		}
	}
}

// Issue 21 item 2: the agent pads a reflected header so its guess at the
// key ends exactly where the upstream's first write ends, and watches the
// first chunk's length. A right guess and a wrong one of the same length
// must give the same chunks; and guessing is flagged.
func TestThreatRedactorOracle(t *testing.T) {
	h := newHarness(t, nil)
	ph := h.ph["anthropic"]
	k := 24 // 13 public prefix bytes + 11 guessed ones
	right := realAnthropic[:k]
	wrong := realAnthropic[:k-1] + string(rune(realAnthropic[k-1]^1))
	run := func(path, guess string) []int {
		return rawChunks(t, h, path, http.Header{"X-Api-Key": {ph}, "X-Pad": {strings.Repeat("p", 700)}, "X-Reflect": {guess}})
	}
	t.Run("raw HTTP/1.1 client", func(t *testing.T) {
		a := run("/reflect?right", right)
		b := run("/reflect?wrong", wrong)
		if !slices.Equal(a, b) {
			t.Fatalf("chunk lengths depend on the guess: right %v, wrong %v", a, b)
		}
	})
	t.Run("curl --http1.1 --raw", func(t *testing.T) {
		curl := lookCurl(t)
		chunks := func(guess string) []int {
			out, err := exec.Command(curl, "-sS", "--max-time", "20", "--http1.1", "--raw", "--proxy", "http://"+h.proxyAddr,
				"--cacert", h.rt.CADir+"/ca.crt", "-H", "X-Api-Key: "+ph, "-H", "X-Pad: "+strings.Repeat("p", 700), "-H", "X-Reflect: "+guess,
				h.tlsURL("api.example.com", "/reflect")).Output()
			if err != nil {
				t.Fatalf("curl: %v", err)
			}
			return chunkSizes(t, bufio.NewReader(bytes.NewReader(out)))
		}
		if a, b := chunks(right), chunks(wrong); !slices.Equal(a, b) {
			t.Fatalf("curl sees chunk lengths that depend on the guess: right %v, wrong %v", a, b)
		}
	})
	r := h.want(t, func(r audit.Record) bool { return r.Path == "/reflect" && r.Decision != audit.Blocked }, audit.Flagged, "")
	if !strings.Contains(r.Reason, "near-match of secret anthropic") {
		t.Fatalf("guessing not flagged: reason %q", r.Reason)
	}
}
