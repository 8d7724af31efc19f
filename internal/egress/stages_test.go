package egress

// Each pipeline stage alone, on a hand-built state (no listener, no
// upstream): decide, inspect (head and body), inject, outbound, respond
// (redact) and the refusal a program reads.

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"testing/iotest"

	"github.com/nixcage/nixcage/internal/egress/inspect"
	"github.com/nixcage/nixcage/internal/egress/redact"
	"github.com/nixcage/nixcage/internal/egress/secrets"
	"github.com/nixcage/nixcage/internal/policy"
)

func stageState(t *testing.T) (*state, string) {
	t.Helper()
	return stageStateWith(t, []policy.Inspector{
		{Name: policy.InspectSecretPatterns, Action: policy.ActionBlock},
		{Name: policy.InspectEntropy, Action: policy.ActionFlag},
	})
}

// stageStateWith is stageState with the inspectors list.
func stageStateWith(t testing.TB, list []policy.Inspector) (*state, string) {
	t.Helper()
	ph, err := secrets.NewPlaceholder(realAnthropic)
	if err != nil {
		t.Fatal(err)
	}
	secs := []*secrets.Secret{{Secret: policy.Secret{Name: "anthropic", Hosts: []string{"api.example.com"}, Header: "x-api-key"}, Real: realAnthropic, Placeholder: ph, PlaceholderBytes: []byte(ph)}}
	forms, err := redact.Forms("anthropic", realAnthropic, ph)
	if err != nil {
		t.Fatal(err)
	}
	m := redact.New(forms)
	insp, err := inspect.New(list, m, map[string]string{"anthropic": ph})
	if err != nil {
		t.Fatal(err)
	}
	return &state{pol: &policy.Policy{}, secrets: secs, insp: insp, redact: m, maxHeader: 8 << 10, maxBody: 1 << 20}, ph
}

func stageTarget(st *state, host string) *target {
	return &target{st: st, host: host, port: 443, tls: true, rule: "allow:*.example.com"}
}

func rule(b *blockedErr) string {
	if b == nil {
		return ""
	}
	return b.rule
}

func TestStageDecide(t *testing.T) {
	st, _ := stageState(t)
	cases := []struct {
		name string
		mod  func(*http.Request)
		want string
	}{
		{"ordinary GET", func(*http.Request) {}, ""},
		{"TRACE", func(r *http.Request) { r.Method = http.MethodTrace }, "trace"},
		{"Via", func(r *http.Request) { r.Header.Set("Via", "1.1 p") }, "proxy-chaining"},
		{"huge header", func(r *http.Request) { r.Header.Set("X-J", strings.Repeat("j", 9<<10)) }, "max-header-bytes"},
		{"declared body too big", func(r *http.Request) { r.ContentLength = 2 << 20 }, "max-body-bytes"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r := httptest.NewRequest("GET", "https://api.example.com/v1", nil)
			c.mod(r)
			if got := rule(decideRequest(st, stageTarget(st, "api.example.com"), r)); got != c.want {
				t.Fatalf("rule %q, want %q", got, c.want)
			}
		})
	}
}

func TestStageDecideRules(t *testing.T) {
	st, _ := stageState(t)
	st.pol = &policy.Policy{WebSocket: false, HTTPRules: []policy.HTTPRule{{Name: "no-batch", Hosts: []string{"api.example.com"}, Paths: []string{"/batch"}, Action: policy.ActionDeny}}}
	tg := stageTarget(st, "api.example.com")
	for _, c := range []struct {
		path string
		ws   bool
		want string
	}{{"/batch", false, "http_rule:no-batch"}, {"/v1", false, ""}, {"/v1", true, "websocket"}} {
		r := httptest.NewRequest("POST", "https://api.example.com"+c.path, nil)
		if _, b := decideRules(st, tg, r, c.ws); rule(b) != c.want {
			t.Errorf("%s ws=%v: rule %q, want %q", c.path, c.ws, rule(b), c.want)
		}
	}
	st.pol.WebSocket = true
	if _, b := decideRules(st, &target{st: st, host: "api.example.com", port: 80}, httptest.NewRequest("GET", "http://api.example.com/ws", nil), true); rule(b) != "websocket" {
		t.Errorf("plain-HTTP WebSocket: rule %q", rule(b))
	}
	r := httptest.NewRequest("GET", "https://api.example.com/ws", nil)
	r.Header.Set("Connection", "keep-alive, Upgrade")
	r.Header.Set("Upgrade", "websocket")
	if !isWebSocket(r) {
		t.Error("handshake not recognized")
	}
}

func TestStageInspectHead(t *testing.T) {
	st, ph := stageState(t)
	cases := []struct {
		name, host string
		hdr        http.Header
		url        string
		want       string
		flagged    bool
	}{
		{"placeholder to its host", "api.example.com", http.Header{"X-Api-Key": {ph}}, "/v1", "", false},
		{"placeholder elsewhere", "other.example.com", http.Header{"X-Api-Key": {ph}}, "/v1", "placeholder:anthropic", false},
		{"real value in a header", "api.example.com", http.Header{"X-Api-Key": {realAnthropic}}, "/v1", "inspector:real_values", false},
		{"hex of the real value in the URL", "other.example.com", nil, "/x?d=" + hex.EncodeToString([]byte(realAnthropic)), "inspector:real_values", false},
		{"near-match flags", "other.example.com", http.Header{"X-Guess": {realAnthropic[:24]}}, "/v1", "", true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r := httptest.NewRequest("GET", "https://"+c.host+c.url, nil)
			for k, v := range c.hdr {
				r.Header[k] = v
			}
			flags, b := inspectHead(st, stageTarget(st, c.host), r)
			if rule(b) != c.want || (len(flags) > 0) != c.flagged {
				t.Fatalf("rule %q flags %v, want %q flagged=%v", rule(b), flags, c.want, c.flagged)
			}
		})
	}
}

// A body blocked mid-stream never hands its offending bytes to the
// transport, and a small body is decided whole before anything is sent.
func TestStageInspectBody(t *testing.T) {
	st, ph := stageState(t)
	t.Run("real value after a megabyte", func(t *testing.T) {
		st.maxBody = 4 << 20
		clean := strings.Repeat("all good here\n", 80000)
		r := httptest.NewRequest("POST", "https://other.example.com/up", strings.NewReader(clean+"key="+realAnthropic+"\n"))
		b, blk := inspectBody(st, stageTarget(st, "other.example.com"), r, newDecodeBudget())
		if blk != nil || b.prime() != nil {
			t.Fatalf("blocked before the value: %v", blk)
		}
		sent, err := io.ReadAll(b)
		var be *blockedErr
		if !errors.As(err, &be) || be.rule != "inspector:real_values" {
			t.Fatalf("read ended with %v, want the real_values block", err)
		}
		if bytes.Contains(sent, []byte(realAnthropic[:20])) || int64(len(sent)) != b.sent() || len(sent) < len(clean)-8192 {
			t.Fatalf("sent %d bytes (of %d clean), offending bytes included: %v", len(sent), len(clean), bytes.Contains(sent, []byte(realAnthropic[:20])))
		}
	})
	// A source that hands its last bytes together with io.EOF (as a TLS
	// body can): what Write released must survive the Close after it.
	// Found by checks/system with Claude Code, whose 50 KB requests
	// arrived with a chunk replaced by later bytes.
	t.Run("last read with EOF keeps every byte", func(t *testing.T) {
		body := make([]byte, 0, 120<<10)
		for i := 0; len(body) < 120<<10; i++ {
			body = fmt.Appendf(body, "line %06d of a long clean request body\n", i)
		}
		r := httptest.NewRequest("POST", "https://other.example.com/up", iotest.DataErrReader(bytes.NewReader(body)))
		b, blk := inspectBody(st, stageTarget(st, "other.example.com"), r, newDecodeBudget())
		if blk != nil || b.prime() != nil {
			t.Fatalf("blocked: %v", blk)
		}
		sent, err := io.ReadAll(b)
		if err != nil || !bytes.Equal(sent, body) {
			t.Fatalf("sent %d bytes (err %v), want the %d bytes of the body unchanged", len(sent), err, len(body))
		}
	})
	t.Run("small body decided before sending", func(t *testing.T) {
		r := httptest.NewRequest("POST", "https://other.example.com/up", strings.NewReader(`{"k":"`+ph+`"}`))
		b, _ := inspectBody(st, stageTarget(st, "other.example.com"), r, newDecodeBudget())
		if got := rule(b.prime()); got != "placeholder:anthropic" || b.sent() != 0 {
			t.Fatalf("prime: %q, %d bytes sent", got, b.sent())
		}
	})
	t.Run("gzip request body is inspected and sent decoded", func(t *testing.T) {
		var z bytes.Buffer
		zw := gzip.NewWriter(&z)
		zw.Write([]byte("token=" + base64.StdEncoding.EncodeToString([]byte(realAnthropic))))
		zw.Close()
		r := httptest.NewRequest("POST", "https://other.example.com/up", &z)
		r.Header.Set("Content-Encoding", "gzip")
		b, _ := inspectBody(st, stageTarget(st, "other.example.com"), r, newDecodeBudget())
		if got := rule(b.prime()); got != "inspector:real_values" || r.Header.Get("Content-Encoding") != "" || b.length != -1 {
			t.Fatalf("prime %q, coding %q, length %d", got, r.Header.Get("Content-Encoding"), b.length)
		}
	})
	t.Run("unknown request coding", func(t *testing.T) {
		r := httptest.NewRequest("POST", "https://other.example.com/up", strings.NewReader("x"))
		r.Header.Set("Content-Encoding", "compress")
		if _, b := inspectBody(st, stageTarget(st, "other.example.com"), r, newDecodeBudget()); rule(b) != "content-encoding" {
			t.Fatalf("rule %q", rule(b))
		}
	})
}

func TestStageInjectAndOutbound(t *testing.T) {
	st, ph := stageState(t)
	r := httptest.NewRequest("GET", "https://api.example.com/v1?q=1", nil)
	r.Header.Set("X-Api-Key", ph)
	r.Header.Set("Accept-Encoding", "gzip, br")
	tg := stageTarget(st, "api.example.com")
	if got := inject(st.secrets, r.Header, tg); len(got) != 1 || r.Header.Get("X-Api-Key") != realAnthropic {
		t.Fatalf("inject: %v %q", got, r.Header.Get("X-Api-Key"))
	}
	out := outbound(r, tg, "https", &bodyStream{empty: true})
	if out.URL.String() != "https://api.example.com/v1?q=1" || out.Header.Get("Accept-Encoding") != "identity" || out.Body != nil {
		t.Fatalf("outbound %s %q", out.URL, out.Header.Get("Accept-Encoding"))
	}
	r2 := httptest.NewRequest("GET", "https://other.example.com/", nil)
	r2.Header.Set("Accept-Encoding", "gzip")
	if out := outbound(r2, stageTarget(st, "other.example.com"), "https", &bodyStream{empty: true}); out.Header.Get("Accept-Encoding") != "gzip" {
		t.Fatalf("unbound host: Accept-Encoding %q changed", out.Header.Get("Accept-Encoding"))
	}
	if plain := (&target{st: st, host: "api.example.com", port: 80}); inject(st.secrets, http.Header{"X-Api-Key": {ph}}, plain) != nil {
		t.Fatal("injected over plain HTTP")
	}
}

func TestStageRespond(t *testing.T) {
	st, ph := stageState(t)
	g := &Gateway{}
	tg := stageTarget(st, "api.example.com")
	var z bytes.Buffer
	zw := gzip.NewWriter(&z)
	zw.Write([]byte("echo " + realAnthropic))
	zw.Close()
	resp := &http.Response{StatusCode: 200, Proto: "HTTP/1.1",
		Header:  http.Header{"Content-Encoding": {"gzip"}, "Content-Length": {"99"}, "X-Echo": {"Basic " + base64.StdEncoding.EncodeToString([]byte("u:"+realAnthropic))}},
		Body:    io.NopCloser(&z),
		Trailer: http.Header{"X-T": {realAnthropic}},
	}
	rec := httptest.NewRecorder()
	_, res, err := g.respond(rec, resp, tg)
	if err != nil || !res.Redacted["anthropic"] {
		t.Fatalf("respond: %v %+v", err, res)
	}
	if rec.Body.String() != "echo "+ph || rec.Header().Get("Content-Encoding") != "" || rec.Header().Get("Content-Length") != "" {
		t.Fatalf("body %q headers %v", rec.Body.String(), rec.Header())
	}
	if d, _ := base64.StdEncoding.DecodeString(strings.TrimPrefix(rec.Header().Get("X-Echo"), "Basic ")); strings.Contains(string(d), realAnthropic[14:70]) {
		t.Fatalf("header still decodes to the key: %q", d)
	}
	if rec.Result().Trailer.Get("X-T") != ph {
		t.Fatalf("trailer %q", rec.Result().Trailer.Get("X-T"))
	}
	rec = httptest.NewRecorder()
	resp = &http.Response{StatusCode: 200, Header: http.Header{"Content-Encoding": {"gzip"}, "Content-Length": {"40"}}, Body: http.NoBody, Request: httptest.NewRequest("HEAD", "https://api.example.com/", nil)}
	if _, _, err := g.respond(rec, resp, tg); err != nil || rec.Header().Get("Content-Encoding") != "" || rec.Header().Get("Content-Length") != "" {
		t.Fatalf("HEAD of a gzip body: %v %v", err, rec.Header())
	}
	rec = httptest.NewRecorder()
	resp = &http.Response{StatusCode: 200, Header: http.Header{"Content-Encoding": {"compress"}}, Body: io.NopCloser(strings.NewReader(realAnthropic))}
	if _, _, err := g.respond(rec, resp, tg); rule(asBlocked(err)) != "content-encoding" || rec.Body.Len() != 0 {
		t.Fatalf("undecodable coding: %v, wrote %q", err, rec.Body.String())
	}
}

func asBlocked(err error) *blockedErr {
	var b *blockedErr
	errors.As(err, &b)
	return b
}

func TestStageRefusal(t *testing.T) {
	b := block(http.StatusForbidden, "deny:evil.example.org", "host x.evil.example.org matches deny pattern evil.example.org")
	t.Run("API client gets JSON", func(t *testing.T) {
		r := httptest.NewRequest("POST", "https://api.example.com/v1/messages", nil)
		r.Header.Set("Content-Type", "application/json")
		rec := httptest.NewRecorder()
		writeDenial(rec, r, b)
		var d denial
		if err := json.Unmarshal(rec.Body.Bytes(), &d); err != nil || rec.Code != 403 {
			t.Fatalf("%d %q: %v", rec.Code, rec.Body.String(), err)
		}
		if d.Error.Rule != b.rule || !strings.Contains(d.Error.Fix, "deny list") || !strings.Contains(d.Error.Message, b.rule) || rec.Header().Get("X-Nixcage-Rule") != b.rule {
			t.Fatalf("denial %+v", d)
		}
	})
	t.Run("curl gets one line", func(t *testing.T) {
		r := httptest.NewRequest("GET", "http://x/", nil)
		r.Header.Set("Accept", "*/*")
		rec := httptest.NewRecorder()
		writeDenial(rec, r, b)
		body := rec.Body.String()
		if strings.Count(body, "\n") != 1 || !strings.Contains(body, "blocked by rule deny:evil.example.org") || !strings.Contains(body, "operator: remove evil.example.org") {
			t.Fatalf("body %q", body)
		}
	})
}

// The WebSocket relay alone: a real value split across two frames of one
// message is caught before any of it is sent, and one from the upstream
// split the same way reaches the agent as the placeholder.
func TestStageWebSocketRelay(t *testing.T) {
	st, ph := stageState(t)
	s := &wsSession{st: st, t: stageTarget(st, "other.example.com")}
	frames := func(mask bool, parts ...string) *bufio.Reader {
		var b bytes.Buffer
		for i, p := range parts {
			op := byte(wsContinuation)
			if i == 0 {
				op = wsText
			}
			writeFrame(&b, i == len(parts)-1, op, []byte(p), mask)
		}
		return bufio.NewReader(&b)
	}
	msg := "leak " + realAnthropic + " end"
	cut := 5 + 30
	var sent bytes.Buffer
	agent := &wsSide{name: "agent", src: frames(true, msg[:cut], msg[cut:]), dst: &sent, mask: true, wantMsk: true, max: 1 << 20, newMsg: s.inspectMessage, control: s.inspectControl}
	blk, _ := agent.run()
	if blk == nil || blk.b.rule != "inspector:real_values" || blk.code != wsPolicyViolation {
		t.Fatalf("agent side: %+v", blk)
	}
	if bytes.Contains(sent.Bytes(), []byte(realAnthropic[13:30])) {
		t.Fatal("part of the real value was sent upstream")
	}
	var got bytes.Buffer
	upSide := &wsSide{name: "upstream", src: frames(false, msg[:cut], msg[cut:]), dst: &got, max: 1 << 20, newMsg: s.redactMessage, control: s.redactControl}
	if blk, err := upSide.run(); blk != nil || err != io.EOF {
		t.Fatalf("upstream side: %+v %v", blk, err)
	}
	var msgOut []byte
	br := bufio.NewReader(&got)
	for {
		f, err := readFrameHeader(br)
		if err != nil {
			break
		}
		p := make([]byte, f.length)
		io.ReadFull(br, p)
		msgOut = append(msgOut, p...)
	}
	if string(msgOut) != "leak "+ph+" end" || !s.res.Redacted["anthropic"] {
		t.Fatalf("agent got %q", msgOut)
	}
}
