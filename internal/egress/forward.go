package egress

import (
	"bytes"
	"encoding/base64"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/nixcage/nixcage/internal/egress/audit"
	"github.com/nixcage/nixcage/internal/egress/inspect"
	"github.com/nixcage/nixcage/internal/egress/secrets"
	"github.com/nixcage/nixcage/internal/policy"
)

// forward handles an absolute-form plain-HTTP request. Per RFC 9112 §3.2.2
// the request-target's authority governs and any Host header the agent sent
// is replaced by it, so the upstream sees the host the policy decided on.
func (g *Gateway) forward(w http.ResponseWriter, r *http.Request, t *target, rec audit.Record, start time.Time) {
	if !t.st.limiter.allow(t.host) {
		g.refuse(w, rec, block(http.StatusTooManyRequests, "rate-limit", "rate limit for %s exceeded", t.host), start)
		return
	}
	g.forwardWith(w, r, t, rec, start, g.h1, "http")
}

// headerSize approximates the request header's wire size.
func headerSize(r *http.Request) int {
	n := len(r.Method) + len(r.RequestURI) + len(r.Host) + 16
	for k, vs := range r.Header {
		for _, v := range vs {
			n += len(k) + len(v) + 4
		}
	}
	return n
}

// forwardWith runs inspect -> inject -> forward -> redact -> audit.
func (g *Gateway) forwardWith(w http.ResponseWriter, r *http.Request, t *target, rec audit.Record, start time.Time, tr http.RoundTripper, scheme string) {
	st := t.st
	rec.Inspectors = st.insp.Names()
	if r.Method == http.MethodTrace {
		g.refuse(w, rec, block(http.StatusMethodNotAllowed, "trace", "TRACE is not allowed (it reflects headers, including credentials)"), start)
		return
	}
	for _, h := range chainingHeaders {
		if r.Header.Get(h) != "" {
			g.refuse(w, rec, block(http.StatusForbidden, "proxy-chaining", "header %s: proxy chaining is not allowed", h), start)
			return
		}
	}
	if n := headerSize(r); n > st.maxHeader {
		g.refuse(w, rec, block(http.StatusRequestHeaderFieldsTooLarge, "max-header-bytes", "request header of %d bytes exceeds %d", n, st.maxHeader), start)
		return
	}
	if r.ContentLength > st.maxBody {
		drain(r.Body)
		g.refuse(w, rec, block(http.StatusRequestEntityTooLarge, "max-body-bytes", "request body of %d bytes exceeds %d", r.ContentLength, st.maxBody), start)
		return
	}
	// Buffer the body (bounded) so inspectors see all of it before any byte
	// leaves.
	body, err := io.ReadAll(io.LimitReader(r.Body, st.maxBody+1))
	if err != nil {
		g.refuse(w, rec, block(http.StatusBadRequest, "body", "read request body: %v", err), start)
		return
	}
	if int64(len(body)) > st.maxBody {
		drain(r.Body)
		g.refuse(w, rec, block(http.StatusRequestEntityTooLarge, "max-body-bytes", "request body exceeds %d bytes", st.maxBody), start)
		return
	}
	for _, h := range hopHeaders {
		r.Header.Del(h)
	}
	parts := []inspect.Part{{Where: "url", Data: []byte(r.URL.RequestURI())}}
	names := make([]string, 0, len(r.Header))
	for k := range r.Header {
		names = append(names, k)
	}
	sort.Strings(names)
	for _, k := range names {
		for _, v := range r.Header[k] {
			// Basic credentials are inspected decoded: that is where a
			// placeholder or a real value sits, and the encoded form of a
			// placeholder would look like a high-entropy blob.
			if dec, ok := decodeBasic(v); ok {
				parts = append(parts, inspect.Part{Where: "header " + k + " (basic auth)", Data: []byte(dec)})
				continue
			}
			parts = append(parts, inspect.Part{Where: "header " + k, Data: []byte(v)})
		}
	}
	if len(body) > 0 {
		parts = append(parts, inspect.Part{Where: "body", Data: body})
	}
	// Placeholders going where their secret is not bound: blocked before
	// anything else, so the audit names the secret.
	if b := checkPlaceholders(st.secrets, parts, t); b != nil {
		g.refuse(w, rec, b, start)
		return
	}
	findings := st.insp.Inspect(parts)
	var flags []string
	for _, f := range findings {
		if f.Action == policy.ActionBlock {
			g.refuse(w, rec, block(http.StatusForbidden, "inspector:"+f.Inspector, "%s", f.Reason), start)
			return
		}
		flags = append(flags, f.Inspector+": "+f.Reason)
	}
	injected := inject(st.secrets, r.Header, t)
	rec.SecretsInjected = injected

	out := &http.Request{
		Method:        r.Method,
		URL:           new(url.URL),
		Header:        r.Header,
		Host:          hostPortOmitDefault(t.host, t.port, scheme),
		ContentLength: int64(len(body)),
		Proto:         "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1,
	}
	*out.URL = *r.URL
	out.URL.Scheme, out.URL.Host = scheme, out.Host
	if len(body) > 0 {
		out.Body = io.NopCloser(bytes.NewReader(body))
	}
	out = out.WithContext(ctxWithDst(r.Context(), t))
	resp, err := tr.RoundTrip(out)
	if err != nil {
		rec.Decision, rec.Reason, rec.Rule = audit.Blocked, "upstream: "+err.Error(), "upstream"
		rec.BytesOut = int64(len(body))
		rec.DurationMS = time.Since(start).Milliseconds()
		g.logAudit(rec)
		http.Error(w, "nixcage egress: upstream error", http.StatusBadGateway)
		return
	}
	defer resp.Body.Close()
	pairs := redactPairs(st.secrets)
	redacted := map[string]bool{}
	for _, h := range hopHeaders {
		resp.Header.Del(h)
	}
	for k, vs := range resp.Header {
		for i, v := range vs {
			for _, p := range pairs {
				if strings.Contains(v, string(p.from)) {
					v = strings.ReplaceAll(v, string(p.from), string(p.to))
					redacted[p.name] = true
				}
			}
			resp.Header[k][i] = v
		}
		w.Header()[k] = resp.Header[k]
	}
	w.WriteHeader(resp.StatusCode)
	var src io.Reader = resp.Body
	var red *redactor
	if len(pairs) > 0 {
		red = newRedactor(resp.Body, pairs)
		defer red.release()
		src = red
	}
	n, copyErr := copyFlush(w, src)
	if red != nil {
		for k := range red.hits {
			redacted[k] = true
		}
	}
	rec.SecretsRedacted = sortedKeys(redacted)
	rec.BytesOut, rec.BytesIn = int64(len(body)), n
	rec.DurationMS = time.Since(start).Milliseconds()
	rec.Decision, rec.Reason = audit.Allowed, fmt.Sprintf("%s %d", resp.Proto, resp.StatusCode)
	if len(flags) > 0 {
		rec.Decision, rec.Reason = audit.Flagged, strings.Join(flags, "; ")
	}
	if copyErr != nil {
		rec.Reason += "; response copy: " + copyErr.Error()
	}
	g.logAudit(rec)
}

func hostPortOmitDefault(host string, port int, scheme string) string {
	if (scheme == "https" && port == 443) || (scheme == "http" && port == 80) {
		return host
	}
	return hostPort(host, port)
}

func sortedKeys(m map[string]bool) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

// decodeBasic returns the decoded credentials of a Basic auth value.
func decodeBasic(v string) (string, bool) {
	scheme, cred, ok := strings.Cut(v, " ")
	if !ok || !strings.EqualFold(scheme, "basic") {
		return "", false
	}
	b, err := base64.StdEncoding.DecodeString(strings.TrimSpace(cred))
	if err != nil {
		return "", false
	}
	return string(b), true
}

// checkPlaceholders refuses a request carrying a placeholder that would not
// be injected: to a host the secret is not bound to, or over plain HTTP.
func checkPlaceholders(secs []*secrets.Secret, parts []inspect.Part, t *target) *blockedErr {
	for _, s := range secs {
		for _, p := range parts {
			if !bytes.Contains(p.Data, s.PlaceholderBytes) {
				continue
			}
			if policy.MatchAny(s.Hosts, t.host) == "" {
				return block(http.StatusForbidden, "placeholder:"+s.Name, "placeholder of secret %s in %s sent to %s, which it is not bound to", s.Name, p.Where, t.host)
			}
			if !t.tls {
				return block(http.StatusForbidden, "placeholder:"+s.Name, "placeholder of secret %s in %s over plain HTTP; credentials travel only over TLS", s.Name, p.Where)
			}
		}
	}
	return nil
}

// inject swaps placeholders for real values in headers (also inside Basic
// auth) for secrets bound to t.host. Called only after every inspector
// passed; checkPlaceholders has already refused unbound hosts and plain HTTP.
func inject(secs []*secrets.Secret, h http.Header, t *target) []string {
	var names []string
	if !t.tls {
		return nil
	}
	for _, s := range secs {
		if policy.MatchAny(s.Hosts, t.host) == "" {
			continue
		}
		done := false
		for k, vs := range h {
			if s.Header != "" && !strings.EqualFold(k, s.Header) {
				continue
			}
			for i, v := range vs {
				if strings.Contains(v, s.Placeholder) {
					vs[i] = strings.ReplaceAll(v, s.Placeholder, s.Real)
					done = true
				} else if dec, ok := decodeBasic(v); ok && strings.Contains(dec, s.Placeholder) {
					scheme, _, _ := strings.Cut(v, " ")
					vs[i] = scheme + " " + base64.StdEncoding.EncodeToString([]byte(strings.ReplaceAll(dec, s.Placeholder, s.Real)))
					done = true
				}
			}
		}
		if done {
			names = append(names, s.Name)
		}
	}
	slices.Sort(names)
	return names
}

func redactPairs(secs []*secrets.Secret) []pair {
	var ps []pair
	for _, s := range secs {
		ps = append(ps, pair{name: s.Name, from: []byte(s.Real), to: []byte(s.Placeholder)})
	}
	return ps
}

// drain reads and discards a bounded amount of a refused request body, so
// a client still sending it reads the refusal instead of a connection reset.
func drain(body io.Reader) {
	_, _ = io.CopyN(io.Discard, body, 4<<20)
}

var copyBufs = sync.Pool{New: func() any { b := make([]byte, 32<<10); return &b }}

// copyFlush copies a response body to the agent, flushing after every chunk
// so streamed responses (server-sent events from model APIs) arrive as the
// upstream sends them rather than when a buffer fills.
func copyFlush(w http.ResponseWriter, src io.Reader) (int64, error) {
	rc := http.NewResponseController(w)
	bp := copyBufs.Get().(*[]byte)
	defer copyBufs.Put(bp)
	buf := *bp
	var total int64
	for {
		n, err := src.Read(buf)
		if n > 0 {
			m, werr := w.Write(buf[:n])
			total += int64(m)
			if werr != nil {
				return total, werr
			}
			_ = rc.Flush()
		}
		if err == io.EOF {
			return total, nil
		}
		if err != nil {
			return total, err
		}
	}
}
