package egress

import (
	"encoding/base64"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"slices"
	"sort"
	"strconv"
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
		g.refuse(w, r, rec, block(http.StatusTooManyRequests, "rate-limit", "rate limit for %s exceeded", t.host), start)
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

// forwardWith runs the pipeline for one request, one named stage each:
// decide (decideRequest, decideRules) -> inspect (inspectHead, then the
// body as it streams: inspectBody) -> inject -> forward (outbound) ->
// redact (respond) -> audit (auditDone, or refuse for every refusal).
func (g *Gateway) forwardWith(w http.ResponseWriter, r *http.Request, t *target, rec audit.Record, start time.Time, tr http.RoundTripper, scheme string) {
	st := t.st
	rec.Inspectors = st.insp.Names()
	fail := func(b *blockedErr) {
		drain(r.Body)
		g.refuse(w, r, rec, b, start)
	}
	if b := decideRequest(st, t, r); b != nil {
		fail(b)
		return
	}
	ws := isWebSocket(r)
	ruleName, b := decideRules(st, t, r, ws)
	if b != nil {
		fail(b)
		return
	}
	if ruleName != "" {
		rec.Rule = ruleName
	}
	delHop(r.Header)
	flags, b := inspectHead(st, t, r)
	if b != nil {
		fail(b)
		return
	}
	if ws {
		g.websocket(w, r, t, rec, start, flags, scheme)
		return
	}
	body, b := inspectBody(st, t, r, g.decodeMem)
	if b != nil {
		fail(b)
		return
	}
	defer body.close()
	// Nothing goes upstream (headers included, and no key is injected)
	// until the body has released its first inspected bytes or ended: a
	// body that fits in the stream's hold-back is decided whole first.
	if b := body.prime(); b != nil {
		fail(b)
		return
	}
	g.exchange(w, r, t, rec, start, tr, scheme, body, flags)
}

// exchange is the second half of the pipeline for a request that passed
// decide and the head's inspection and whose body is streaming: inject,
// forward, redact, audit.
func (g *Gateway) exchange(w http.ResponseWriter, r *http.Request, t *target, rec audit.Record, start time.Time, tr http.RoundTripper, scheme string, body *bodyStream, flags []string) {
	rec.SecretsInjected = inject(t.st.secrets, r.Header, t)
	resp, err := tr.RoundTrip(outbound(r, t, scheme, body))
	rec.BytesOut = body.sent()
	// The body's verdict wins over whatever the upstream said: a request
	// blocked mid-body never had its offending bytes sent, and the agent is
	// told why.
	if b := body.blocked(); b != nil {
		if err == nil {
			resp.Body.Close()
		}
		g.refuse(w, r, rec, b, start)
		return
	}
	if err != nil {
		g.upstreamError(w, r, rec, err, start)
		return
	}
	defer resp.Body.Close()
	flags = append(flags, body.flags()...)
	n, res, err := g.respond(w, resp, t)
	if b, ok := err.(*blockedErr); ok {
		g.refuse(w, r, rec, b, start)
		return
	}
	rec.BytesOut, rec.BytesIn = body.sent(), n
	// An upstream that answered before reading the whole body may have had
	// the rest of it stopped after the answer began: the body's verdict
	// still goes on record (its offending bytes were never sent).
	if b := body.blocked(); b != nil {
		rec.Decision, rec.Rule, rec.Reason = audit.Blocked, b.rule, b.reason+"; the upstream had begun its answer"
		rec.DurationMS = time.Since(start).Milliseconds()
		g.logAudit(rec)
		return
	}
	for _, name := range sortedKeys(res.Near) {
		flags = append(flags, fmt.Sprintf("%s: near-match of secret %s in the response (an agent guessing at a reflected value)", policy.InspectRealValues, name))
	}
	rec.SecretsRedacted = sortedKeys(res.Redacted)
	g.auditDone(rec, start, resp.Proto+" "+strconv.Itoa(resp.StatusCode), flags, err)
}

// auditDone writes the record of a request that was forwarded.
func (g *Gateway) auditDone(rec audit.Record, start time.Time, reason string, flags []string, copyErr error) {
	rec.DurationMS = time.Since(start).Milliseconds()
	note := rec.Reason // approvedBy, set at admission
	rec.Decision, rec.Reason = audit.Allowed, withNote(note, reason)
	if len(flags) > 0 {
		rec.Decision, rec.Reason = audit.Flagged, withNote(note, strings.Join(flags, "; "))
	}
	if copyErr != nil {
		rec.Reason += "; response copy: " + copyErr.Error()
	}
	g.logAudit(rec)
}

// upstreamError answers and audits a request the upstream did not answer.
func (g *Gateway) upstreamError(w http.ResponseWriter, r *http.Request, rec audit.Record, err error, start time.Time) {
	g.refuse(w, r, rec, block(http.StatusBadGateway, "upstream", "upstream: %v", err), start)
}

// decideRequest refuses what no policy may allow on any host: methods and
// headers that break the one-hop model, and sizes over the limits.
func decideRequest(st *state, t *target, r *http.Request) *blockedErr {
	if r.Method == http.MethodTrace {
		return block(http.StatusMethodNotAllowed, "trace", "TRACE is not allowed (it reflects headers, including credentials)")
	}
	if b := chainingBlock(r.Header); b != nil {
		return b
	}
	if n := headerSize(r); n > st.maxHeader {
		return block(http.StatusRequestHeaderFieldsTooLarge, "max-header-bytes", "request header of %d bytes exceeds %d", n, st.maxHeader)
	}
	if r.ContentLength > st.maxBody {
		return block(http.StatusRequestEntityTooLarge, "max-body-bytes", "request body of %d bytes exceeds %d", r.ContentLength, st.maxBody)
	}
	return nil
}

// decideRules applies the policy's http_rule blocks and websocket setting
// (policy.DecideHTTP: deny wins, a host with allow rules needs a match). It
// returns the rule that allowed the request, if one did.
func decideRules(st *state, t *target, r *http.Request, ws bool) (string, *blockedErr) {
	if ws && !t.tls {
		// Clients tunnel ws:// through CONNECT (refused: tunnels carry TLS
		// only); an absolute-form handshake is refused as clearly.
		return "", block(http.StatusForbidden, "websocket", "WebSocket over plain HTTP is not supported; use wss:// to an intercepted host")
	}
	d := st.pol.DecideHTTP(t.host, r.Method, r.URL.EscapedPath(), r.URL.Path, ws)
	if d.Result == policy.Deny {
		return "", block(http.StatusForbidden, d.Rule, "%s", d.Reason)
	}
	return d.Rule, nil
}

// isWebSocket reports whether r is a WebSocket handshake (RFC 6455 §4.1).
func isWebSocket(r *http.Request) bool {
	return r.Method == http.MethodGet && headerHasToken(r.Header, "Connection", "upgrade") && headerHasToken(r.Header, "Upgrade", "websocket")
}

func headerHasToken(h http.Header, name, token string) bool {
	for _, v := range h.Values(name) {
		for _, t := range strings.Split(v, ",") {
			if strings.EqualFold(strings.TrimSpace(t), token) {
				return true
			}
		}
	}
	return false
}

// headParts is the request line and headers as inspectors see them. The
// parts' bytes share one buffer (inspectors only read them).
func headParts(r *http.Request) []inspect.Part {
	uri := r.URL.RequestURI()
	n := len(uri)
	for k, vs := range r.Header {
		n += len(k)
		for _, v := range vs {
			n += len(v)
		}
	}
	buf := make([]byte, 0, n)
	take := func(s string) []byte {
		buf = append(buf, s...)
		return buf[len(buf)-len(s) : len(buf) : len(buf)]
	}
	parts := make([]inspect.Part, 0, 2+2*len(r.Header))
	parts = append(parts, inspect.Part{Where: "url", Data: take(uri)})
	// A value percent-encoded in the URL is inspected decoded too.
	if u, err := url.PathUnescape(uri); err == nil && u != uri {
		parts = append(parts, inspect.Part{Where: "url (decoded)", Data: []byte(u)})
	}
	names := make([]string, 0, len(r.Header))
	for k := range r.Header {
		names = append(names, k)
	}
	sort.Strings(names)
	for _, k := range names {
		// The name is a part too: an agent can write a key as a name as
		// well as a value. Its label does not repeat it (a finding would
		// quote the key), and it is matched without case (inspect.Part's
		// Fold: net/http has changed its letters' case already).
		parts = append(parts, inspect.Part{Where: "header name", Data: take(k), Fold: true})
		for _, v := range r.Header[k] {
			// Basic credentials are inspected decoded: that is where a
			// placeholder or a real value sits, and the encoded form of a
			// placeholder would look like a high-entropy blob.
			if dec, ok := decodeBasic(v); ok {
				parts = append(parts, inspect.Part{Where: "header", Name: k + " (basic auth)", Data: []byte(dec)})
				continue
			}
			parts = append(parts, inspect.Part{Where: "header", Name: k, Data: take(v)})
		}
	}
	return parts
}

// inspectHead runs the inspectors over the URL and headers. Placeholders
// going where their secret is not bound are refused first, so the audit
// names the secret.
func inspectHead(st *state, t *target, r *http.Request) ([]string, *blockedErr) {
	findings, phs := st.insp.Inspect(headParts(r))
	if b := checkPlaceholders(st.secrets, phs, "the request head", t); b != nil {
		return nil, b
	}
	return verdict(findings)
}

// verdict turns findings into flags, or the first block.
func verdict(findings []inspect.Finding) ([]string, *blockedErr) {
	var flags []string
	for _, f := range findings {
		if f.Action == policy.ActionBlock {
			return nil, block(http.StatusForbidden, "inspector:"+f.Inspector, "%s", f.Reason)
		}
		flags = append(flags, f.Inspector+": "+f.Reason)
	}
	return flags, nil
}

// outbound builds the upstream request. Toward a secret-bound host the
// gateway asks for identity encoding: what comes back must be redacted,
// and redaction works on bytes the agent can read (respond decodes
// anything else that comes back anyway).
func outbound(r *http.Request, t *target, scheme string, body *bodyStream) *http.Request {
	out := &http.Request{
		Method: r.Method,
		URL:    new(url.URL),
		Header: r.Header,
		Host:   hostPortOmitDefault(t.host, t.port, scheme),
		Proto:  "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1,
	}
	*out.URL = *r.URL
	out.URL.Scheme, out.URL.Host = scheme, out.Host
	if body != nil && !body.empty {
		out.Body, out.ContentLength = body, body.length
	}
	if t.st.bound(t.host) {
		out.Header.Set("Accept-Encoding", "identity")
		// A range is a piece of a body: a key echoed in a body served with
		// Range support would come back 20 bytes at a time, no piece a whole
		// form for the redactor to find, and the agent would put the pieces
		// together. The upstream sends the whole body (RFC 9110 lets a
		// server ignore Range; clients handle the 200).
		out.Header.Del("Range")
		out.Header.Del("If-Range")
	}
	return out.WithContext(ctxWithDst(r.Context(), t))
}

// bodyStream is the request body on its way upstream: inspected as it
// streams (inspect.Stream), in bounded memory, never buffered whole. A
// blocking finding stops it; the transport then aborts the request, so the
// upstream never receives the offending bytes.
//
// The upstream client may go on reading it after the handler has returned
// (net/http's Transport writes a body on a goroutine of its own), while the
// handler closes its decoders: a zstd decoder closed under a Read
// dereferences nil, which killed the gateway. close detaches the agent's
// body (waking a Read blocked on the agent), waits for the Read in flight
// (rd), and every later Read fails; the inspection state the handler reads
// while a Read may run (flags) is under mu.
type bodyStream struct {
	src    io.Reader
	closer func()
	st     *state
	t      *target
	ins    *inspect.Stream
	empty  bool
	length int64 // for the upstream request; -1 when decoded or unknown
	buf    []byte
	out    []byte
	detach func() // limitBody's, when the agent's body is under it

	rd     sync.Mutex // held by Read, and by close
	closed bool       // under rd

	mu    sync.Mutex
	block *blockedErr
	n     int64 // bytes handed to the transport
	eof   bool
}

// inspectBody sets up streaming inspection of the body; a request body
// with a content-coding is decoded (and sent on decoded), since a coding
// the gateway cannot read would hide what it carries.
func inspectBody(st *state, t *target, r *http.Request, mem *decodeBudget) (*bodyStream, *blockedErr) {
	b := &bodyStream{st: st, t: t, closer: func() {}, length: r.ContentLength}
	if r.Body == nil || r.Body == http.NoBody || r.ContentLength == 0 {
		b.empty = true
		return b, nil
	}
	b.src = r.Body
	if db, ok := r.Body.(*deadlineBody); ok {
		b.detach = db.detach
	}
	if cs := codings(r.Header); len(cs) > 0 {
		dec, closer, err := decodeBody(r.Body, cs, mem)
		if err != nil {
			return nil, codingBlock(http.StatusUnsupportedMediaType, "request body", err)
		}
		b.src, b.closer, b.length = dec, closer, -1
		r.Header.Del("Content-Encoding")
	}
	b.ins = st.insp.NewStream("body")
	b.buf = make([]byte, 32<<10)
	return b, nil
}

// prime reads until the stream releases bytes, ends or blocks.
func (b *bodyStream) prime() *blockedErr {
	if b.empty {
		return nil
	}
	if err := b.pull(); err != nil {
		if blk, ok := err.(*blockedErr); ok {
			return blk
		}
		// A decoder opens on its first read: a window over the bound
		// shows here.
		if blk := codingBlock(http.StatusUnsupportedMediaType, "request body", err); blk != nil {
			return blk
		}
		return block(http.StatusBadRequest, "body", "read request body: %v", err)
	}
	return nil
}

func (b *bodyStream) Read(p []byte) (int, error) {
	b.rd.Lock()
	defer b.rd.Unlock()
	if b.closed {
		return 0, errBodyDetached
	}
	if err := b.pull(); err != nil {
		return 0, err
	}
	if len(b.out) == 0 {
		return 0, io.EOF
	}
	n := copy(p, b.out)
	b.out = b.out[n:]
	b.mu.Lock()
	b.n += int64(n)
	b.mu.Unlock()
	return n, nil
}

// pull reads from the agent until bytes are released or the body ends.
func (b *bodyStream) pull() error {
	for len(b.out) == 0 {
		if blk := b.blocked(); blk != nil {
			return blk
		}
		if b.eof {
			return nil
		}
		n, err := b.src.Read(b.buf)
		b.mu.Lock()
		if n > 0 {
			b.out = b.ins.Write(b.buf[:n])
		}
		if err == io.EOF {
			// What Write released is valid only until the next call, and
			// Close compacts the same buffer: copy it first, or the last
			// read's bytes are overwritten by what Close moves down.
			b.out = append(append([]byte(nil), b.out...), b.ins.Close()...)
			b.eof = true
		}
		b.mu.Unlock()
		if err != nil && err != io.EOF {
			return err
		}
		if blk := b.check(); blk != nil {
			b.out = nil
			return blk
		}
	}
	return nil
}

// check turns the stream's state into a refusal: over max_body, a
// placeholder where its secret is not bound, or a blocking finding.
func (b *bodyStream) check() *blockedErr {
	b.mu.Lock()
	defer b.mu.Unlock()
	var blk *blockedErr
	if n := b.ins.Len(); n > b.st.maxBody {
		blk = block(http.StatusRequestEntityTooLarge, "max-body-bytes", "request body exceeds %d bytes", b.st.maxBody)
	} else if pb := checkPlaceholders(b.st.secrets, b.ins.Placeholders(), "the body", b.t); pb != nil {
		blk = pb
	} else if _, vb := verdict(b.ins.Findings()); vb != nil {
		blk = vb
	}
	if blk != nil && b.block == nil {
		b.block = blk
	}
	return blk
}

func (b *bodyStream) blocked() *blockedErr {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.block
}

func (b *bodyStream) sent() int64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.n
}

func (b *bodyStream) flags() []string {
	if b.ins == nil {
		return nil
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	f, _ := verdict(b.ins.Findings())
	return f
}

// close ends the body for the upstream client and closes its decoders;
// the handler calls it as it returns.
func (b *bodyStream) close() {
	if b.detach != nil {
		b.detach()
	}
	b.rd.Lock()
	b.closed = true
	b.rd.Unlock()
	b.closer()
}

// Close is for the transport; the agent's body is closed by net/http.
func (b *bodyStream) Close() error { return nil }

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

// checkPlaceholders refuses a request carrying a placeholder (of the
// secrets named in found) that would not be injected: to a host the secret
// is not bound to, or over plain HTTP.
func checkPlaceholders(secs []*secrets.Secret, found []string, where string, t *target) *blockedErr {
	for _, s := range secs {
		if !slices.Contains(found, s.Name) {
			continue
		}
		if policy.MatchAny(s.Hosts, t.host) == "" {
			return block(http.StatusForbidden, "placeholder:"+s.Name, "placeholder of secret %s in %s sent to %s, which it is not bound to", s.Name, where, t.host)
		}
		if !t.tls {
			return block(http.StatusForbidden, "placeholder:"+s.Name, "placeholder of secret %s in %s over plain HTTP; credentials travel only over TLS", s.Name, where)
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

// drain reads and discards a bounded amount of a refused request body, so
// a client still sending it reads the refusal instead of a connection reset.
func drain(body io.Reader) {
	if body != nil {
		_, _ = io.CopyN(io.Discard, body, 4<<20)
	}
}
