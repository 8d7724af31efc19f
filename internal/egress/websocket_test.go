package egress

// Issue 11 item 7: WebSocket on intercepted hosts, with a real client and a
// real server (gorilla/websocket) on either side of the real gateway.

import (
	"encoding/base64"
	"encoding/hex"
	"errors"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/gorilla/websocket"

	"github.com/nixcage/nixcage/internal/egress/audit"
	"github.com/nixcage/nixcage/internal/policy"
)

// websocket is the upstream's /ws: it echoes each message as "got: ..." and
// answers "key" with the key it was given at the handshake (the real one,
// injected), raw and base64, as a careless API would.
func (u *upstream) websocket(w http.ResponseWriter, r *http.Request) {
	key := r.Header.Get("X-Api-Key")
	u.mu.Lock()
	u.last = &seen{Proto: r.Proto, Host: r.Host, Header: r.Header.Clone(), Path: r.URL.Path}
	u.mu.Unlock()
	up := websocket.Upgrader{}
	c, err := up.Upgrade(w, r, nil)
	if err != nil {
		return
	}
	defer c.Close()
	for {
		typ, msg, err := c.ReadMessage()
		if err != nil {
			return
		}
		u.mu.Lock()
		u.last.Body += string(msg) + "\n"
		u.mu.Unlock()
		reply := "got: " + string(msg)
		if string(msg) == "key" {
			reply = "key=" + key + " b64=" + base64.StdEncoding.EncodeToString([]byte("u:"+key))
		}
		if err := c.WriteMessage(typ, []byte(reply)); err != nil {
			return
		}
	}
}

func (h *harness) wsDial(t *testing.T, host string, hdr http.Header) (*websocket.Conn, *http.Response, error) {
	t.Helper()
	d := websocket.Dialer{
		Proxy:            http.ProxyURL(&url.URL{Scheme: "http", Host: h.proxyAddr}),
		TLSClientConfig:  h.client(false).Transport.(*http.Transport).TLSClientConfig,
		HandshakeTimeout: 10 * time.Second,
		// Offered, and the gateway must strip it: a compressed message
		// could not be inspected.
		EnableCompression: true,
	}
	return d.Dial("wss://"+host+":"+strconv.Itoa(h.up.tlsPort)+"/ws", hdr)
}

func TestWebSocketIntercepted(t *testing.T) {
	h := newHarness(t, func(rt *policy.Runtime) { rt.Policy.Limits.MaxBodyBytes = 64 << 10 })
	ph := h.ph["anthropic"]
	t.Run("messages both ways, key injected and redacted", func(t *testing.T) {
		c, _, err := h.wsDial(t, "api.example.com", http.Header{"X-Api-Key": {ph}})
		if err != nil {
			t.Fatalf("handshake through the gateway: %v", err)
		}
		defer c.Close()
		if s := h.up.lastSeen(); s.Header.Get("X-Api-Key") != realAnthropic || s.Header.Get("Sec-Websocket-Extensions") != "" {
			t.Fatalf("upstream handshake: key injected %v, extensions %q", s.Header.Get("X-Api-Key") == realAnthropic, s.Header.Get("Sec-Websocket-Extensions"))
		}
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		big := strings.Repeat("words of a long message ", 2000) // several frames' worth, streamed
		for _, m := range []string{"hello", big} {
			if err := c.WriteMessage(websocket.TextMessage, []byte(m)); err != nil {
				t.Fatal(err)
			}
			_, got, err := c.ReadMessage()
			if err != nil || string(got) != "got: "+m {
				t.Fatalf("echo of %d bytes: %d bytes, %v", len(m), len(got), err)
			}
		}
		c.WriteMessage(websocket.TextMessage, []byte("key"))
		_, got, err := c.ReadMessage()
		if err != nil {
			t.Fatal(err)
		}
		d, _ := base64.StdEncoding.DecodeString(strings.SplitN(string(got), "b64=", 2)[1])
		if strings.Contains(string(got), realAnthropic[14:]) || strings.Contains(string(d), realAnthropic[14:70]) || !strings.Contains(string(got), ph) {
			t.Fatalf("the agent received the real key over WebSocket: %q", got)
		}
		c.WriteMessage(websocket.CloseMessage, websocket.FormatCloseMessage(websocket.CloseNormalClosure, ""))
		c.ReadMessage()
		r := h.want(t, func(r audit.Record) bool { return r.Path == "/ws" && r.Host == "api.example.com" }, audit.Allowed, "allow:*.example.com")
		if !hasAll(r.SecretsInjected, "anthropic") || !hasAll(r.SecretsRedacted, "anthropic") || !strings.Contains(r.Reason, "3 messages from the agent") || r.BytesOut < int64(len(big)) {
			t.Fatalf("record %+v", r)
		}
	})
	t.Run("real value in a message closes with 1008", func(t *testing.T) {
		c, _, err := h.wsDial(t, "other.example.com", nil)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		c.WriteMessage(websocket.TextMessage, []byte("leak "+hex.EncodeToString([]byte(realAnthropic))))
		_, _, err = c.ReadMessage()
		var ce *websocket.CloseError
		if !errors.As(err, &ce) || ce.Code != websocket.ClosePolicyViolation || !strings.Contains(ce.Text, "inspector:real_values") {
			t.Fatalf("want close 1008 naming the rule, got %v", err)
		}
		if s := h.up.lastSeen(); strings.Contains(s.Body, "leak") {
			t.Fatal("the message reached the upstream")
		}
		h.want(t, func(r audit.Record) bool { return r.Path == "/ws" && r.Host == "other.example.com" }, audit.Blocked, "inspector:real_values")
	})
	t.Run("placeholder in a message to an unbound host", func(t *testing.T) {
		c, _, err := h.wsDial(t, "other.example.com", nil)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		c.WriteMessage(websocket.TextMessage, []byte(`{"key":"`+ph+`"}`))
		if _, _, err := c.ReadMessage(); !websocket.IsCloseError(err, websocket.ClosePolicyViolation) {
			t.Fatalf("got %v", err)
		}
		h.want(t, func(r audit.Record) bool { return r.Path == "/ws" && r.Rule == "placeholder:anthropic" }, audit.Blocked, "placeholder:anthropic")
	})
	t.Run("message over the size cap closes with 1009", func(t *testing.T) {
		c, _, err := h.wsDial(t, "api.example.com", nil)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		c.WriteMessage(websocket.BinaryMessage, make([]byte, 65<<10))
		if _, _, err := c.ReadMessage(); !websocket.IsCloseError(err, websocket.CloseMessageTooBig) {
			t.Fatalf("got %v", err)
		}
		h.want(t, func(r audit.Record) bool { return r.Path == "/ws" && r.Rule == "max-body-bytes" }, audit.Blocked, "max-body-bytes")
	})
}

func TestWebSocketRefusedByPolicy(t *testing.T) {
	h := newHarness(t, func(rt *policy.Runtime) { rt.Policy.WebSocket = false })
	_, resp, err := h.wsDial(t, "api.example.com", http.Header{"Accept": {"application/json"}})
	if err == nil || resp == nil || resp.StatusCode != http.StatusForbidden || resp.Header.Get("X-Nixcage-Rule") != "websocket" {
		t.Fatalf("handshake: %v %+v", err, resp)
	}
	h.want(t, func(r audit.Record) bool { return r.Path == "/ws" }, audit.Blocked, "websocket")
}
