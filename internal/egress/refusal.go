package egress

import (
	"encoding/json"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/nixcage/nixcage/internal/egress/audit"
	"github.com/nixcage/nixcage/internal/egress/redact"
	"github.com/nixcage/nixcage/internal/policy"
)

// A refusal says which rule refused and what the operator can change, so an
// agent stops retrying into a wall and can tell its user why. API clients
// (they ask for JSON, or send it) get a JSON error in the shape the Anthropic
// and OpenAI SDKs both surface (error.message); everything else, curl
// included, gets one line. X-Nixcage-Rule carries the rule either way.

// denial is the JSON body of a refusal.
type denial struct {
	Type  string      `json:"type"` // "error", as Anthropic's API writes it
	Error denialError `json:"error"`
}

type denialError struct {
	Type    string `json:"type"`    // "permission_error" etc., by status
	Code    string `json:"code"`    // "nixcage_egress_blocked"
	Message string `json:"message"` // one line: rule, reason, fix
	Rule    string `json:"rule"`
	Reason  string `json:"reason"`
	Fix     string `json:"fix"`
}

// wantsJSON reports whether r is from an API client: it accepts JSON, or
// sends JSON.
func wantsJSON(r *http.Request) bool {
	if r == nil {
		return false
	}
	for _, h := range []string{"Accept", "Content-Type"} {
		if strings.Contains(strings.ToLower(r.Header.Get(h)), "json") {
			return true
		}
	}
	return false
}

// fixFor says what an operator can change for a refusal by rule.
func fixFor(rule string) string {
	name, arg, _ := strings.Cut(rule, ":")
	switch name {
	case "default-deny":
		return "add the host to the egress policy's allow list"
	case "deny":
		return "remove " + arg + " from the egress policy's deny list (it covers that name and every name below it)"
	case "port":
		return "add the port to the egress policy's ports"
	case "ip-literal":
		return "use a host name; policies allow names, never addresses"
	case "address":
		return "the name resolves to an address cages may not reach; fix its DNS (unsafe_allow_private_upstreams exists for tests only)"
	case "placeholder":
		return "send secret " + arg + "'s placeholder only to the hosts in its secret block, over https; or add the host there"
	case "inspector":
		return "the request carried what inspector " + arg + " blocks; remove it from the request, or set that inspector's action = \"flag\" (real_values always blocks)"
	case "http_rule":
		return "edit or remove http_rule \"" + arg + "\" in the egress policy (deny rules win over allow rules)"
	case "http-rule-default":
		return "add an http_rule with action = \"allow\" matching this method and path for the host, or remove the host's allow rules"
	case "http-rule-path":
		return "send the path in canonical form (no //, /./, /../, %2e, %5c, %25): http_rule blocks match clean paths only"
	case "websocket":
		return "set websocket = true in the egress policy to allow WebSocket on intercepted hosts"
	case "websocket-protocol", "websocket-extension":
		return "the WebSocket peer broke the protocol or negotiated an extension the gateway cannot inspect; no setting allows this"
	case policy.RuleApprovalDenied:
		return "an operator denied this request (cagectl approve ID deny); allow the host in the egress policy or with cagectl allow if it is needed"
	case policy.RuleApprovalTimeout:
		return "no operator decided in time: cagectl approvals lists waiting requests, cagectl approve ID once|host|deny decides; or allow the host in the egress policy"
	case policy.RuleApprovalQueueFull:
		return "too many requests wait for approval at once; decide them (cagectl approvals), or raise the agent's approval max_pending"
	case "rate-limit":
		return "wait, or raise the egress policy's rate_limit"
	case "max-tunnels", "max-conns":
		return "close connections, or raise the egress policy's limits.max_tunnels"
	case "max-body-bytes", "max-header-bytes":
		return "send less, or raise the egress policy's limits." + strings.ReplaceAll(name, "-", "_")
	case "content-encoding":
		return "the gateway decodes gzip, deflate, br and zstd only, at most 4 codings, zstd windows up to 8 MiB; send or request one of those (or identity)"
	case "decoder-memory":
		return "retry when other brotli or zstd bodies have ended, or send identity"
	case "trace", "proxy-chaining", "connect-in-connect", "host-mismatch", "sni-mismatch", "not-a-proxy-request", "scheme", "authority":
		return "no policy setting allows this; change the request"
	case "upstream", "resolve":
		return "the upstream could not be reached; check the name and the upstream"
	}
	return "see docs/egress.md for rule " + rule
}

// refuse writes a refusal the agent can read and audits it.
func (g *Gateway) refuse(w http.ResponseWriter, r *http.Request, rec audit.Record, b *blockedErr, start time.Time) {
	b = g.redactReason(b, &rec)
	rec.Decision, rec.Reason, rec.Rule = audit.Blocked, b.reason, b.rule
	rec.DurationMS = time.Since(start).Milliseconds()
	g.logAudit(rec)
	writeDenial(w, r, b)
}

// writeDenial writes b as the response.
func writeDenial(w http.ResponseWriter, r *http.Request, b *blockedErr) {
	fix := fixFor(b.rule)
	line := fmt.Sprintf("nixcage egress: blocked by rule %s: %s (operator: %s)", b.rule, b.reason, fix)
	h := w.Header()
	h.Set("X-Nixcage-Egress", "blocked")
	h.Set("X-Nixcage-Rule", b.rule)
	if r == nil || r.ProtoMajor != 2 {
		// HTTP/1.x: the refused request's body may be unread, so the
		// connection cannot carry another request. On HTTP/2 the refusal
		// ends its own stream (net/http resets it if the body is unread),
		// and Connection: close would make net/http send a graceful GOAWAY
		// for the agent's whole connection: the streams it opened after
		// this one would fail unserved (red team finding).
		h.Set("Connection", "close")
	}
	h.Set("Cache-Control", "no-store")
	if wantsJSON(r) {
		typ := "permission_error"
		switch {
		case b.status == http.StatusTooManyRequests:
			typ = "rate_limit_error"
		case b.status == http.StatusRequestEntityTooLarge:
			typ = "request_too_large"
		case b.status >= 500:
			typ = "api_error"
		case b.status == http.StatusBadRequest:
			typ = "invalid_request_error"
		}
		body, _ := json.Marshal(denial{Type: "error", Error: denialError{Type: typ, Code: "nixcage_egress_blocked", Message: line, Rule: b.rule, Reason: b.reason, Fix: fix}})
		h.Set("Content-Type", "application/json")
		w.WriteHeader(b.status)
		w.Write(append(body, '\n'))
		return
	}
	h.Set("Content-Type", "text/plain; charset=utf-8")
	w.WriteHeader(b.status)
	fmt.Fprintln(w, line)
}

// redactReason passes a refusal's reason through the redact stage's
// matcher: a reason can quote what a secret-bound upstream sent (Go's
// transport quotes a malformed header line, a bad Content-Length or
// Transfer-Encoding), and the refusal body goes to the agent, so without
// this a real value echoed into a malformed response reached the cage in
// clear (red team, issue 11 item 1). The audit gets the redacted text too.
func (g *Gateway) redactReason(b *blockedErr, rec *audit.Record) *blockedErr {
	st := g.st.Load()
	if st == nil || st.redact == nil {
		return b
	}
	var res redact.Result
	reason := st.redact.String(b.reason, &res)
	if len(res.Redacted) == 0 {
		return b
	}
	nb := *b
	nb.reason = reason
	for name := range res.Redacted {
		if !slices.Contains(rec.SecretsRedacted, name) {
			rec.SecretsRedacted = append(rec.SecretsRedacted, name)
		}
	}
	slices.Sort(rec.SecretsRedacted)
	return &nb
}
