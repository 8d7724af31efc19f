package egress

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/nixcage/nixcage/internal/policy"
)

// The approval queue in the gateway (policy/approval.go has the protocol).
// A request the policy refuses only for not being listed, whose name
// passes the address rules, waits up to Approval.Wait while caged asks an
// operator. What a malicious agent can make the gateway hold is bounded:
//
//   - at most MaxPending distinct (host, port) wait at once; more are
//     refused at once (rule approval-queue-full);
//   - further requests for a host already waiting join that wait (one
//     pending file, one operator question) and hold only their connection,
//     whose slot max_tunnels already counts;
//   - a pending entry is a few bounded strings (the path cut to
//     MaxPendingPath) and one polling goroutine, for at most Wait;
//   - after a deny, the same host and port are refused at once for
//     DeniedCooldown, so a retrying agent does not page the operator.

// approvalPoll is how often a waiting request looks for its decision.
const approvalPoll = 200 * time.Millisecond

// maxCooldowns bounds the remembered denials (oldest dropped first).
const maxCooldowns = 256

type approvals struct {
	cfg   policy.Approval
	agent string

	mu       sync.Mutex
	waiting  map[string]*asking  // host:port -> the pending request
	cooldown map[string]cooldown // host:port -> a recent deny
	now      func() time.Time
}

type cooldown struct {
	until time.Time
	by    string
}

// asking is one pending request; done is closed once res is set.
type asking struct {
	id   string
	done chan struct{}
	res  approvalResult
}

type approvalResult struct {
	d        *policy.ApprovalDecision // nil on timeout or error
	err      error
	timedOut bool
}

func newApprovals(cfg *policy.Approval, agent string) *approvals {
	return &approvals{cfg: *cfg, agent: agent, waiting: map[string]*asking{}, cooldown: map[string]cooldown{}, now: time.Now}
}

// clearStale removes pending files a previous gateway left: nothing waits
// on them any more.
func (q *approvals) clearStale() {
	m, _ := filepath.Glob(filepath.Join(q.cfg.PendingDir, "a-*.json"))
	for _, f := range m {
		os.Remove(f)
	}
}

// approvable reports whether an operator may be asked about dec: only what
// a policy entry or a grant could allow (default-deny, port), never an IP
// literal, a deny entry or a name no policy could list.
func approvable(dec policy.Decision, host string) bool {
	if dec.Rule != "default-deny" && dec.Rule != "port" {
		return false
	}
	return policy.CheckPattern(host) == nil && policy.SpecialUse(host) == ""
}

// admit is decide's second chance: a refused decision an operator may
// overturn waits for one. It returns the decision to go on with, or the
// refusal to write.
func (g *Gateway) admit(ctx context.Context, st *state, dec policy.Decision, host string, port int, method, path string) (policy.Decision, *blockedErr) {
	if dec.Result == policy.Allow {
		return dec, nil
	}
	refused := block(http.StatusForbidden, dec.Rule, "%s", dec.Reason)
	q := g.approvals
	if q == nil || !approvable(dec, host) {
		return dec, refused
	}
	// The name is not resolved before an operator approves it: a lookup
	// is a DNS query leaving the host with labels the agent chose (data
	// smuggled in labels, which the cage's DNS filter refuses for an
	// unlisted name). The address rules run after the approval, at the
	// caller's resolve, so an approved name on a private, loopback or
	// metadata address is still refused (rule address).
	d, b := q.ask(ctx, host, port, method, path)
	if b != nil {
		return dec, b
	}
	how := "once"
	if d.Verdict == policy.VerdictHost {
		how = "for the host (grant " + d.Grant + ")"
	}
	return policy.Decision{Result: policy.Allow, Rule: policy.RuleApproval + ":" + d.ID, Intercept: policy.MatchAny(st.pol.Inspect, host) != "",
		Reason: fmt.Sprintf("%s; approved %s by %s (approval %s)", dec.Reason, how, d.By, d.ID)}, nil
}

// approvedBy is what the audit records of a request an operator approved
// start their reason with (who approved it, how), "" for any other.
func approvedBy(dec policy.Decision) string {
	if strings.HasPrefix(dec.Rule, policy.RuleApproval+":") {
		return dec.Reason
	}
	return ""
}

// withNote puts note (approvedBy) before a record's own reason.
func withNote(note, reason string) string {
	if note == "" {
		return reason
	}
	return note + "; " + reason
}

// ask waits for an operator's decision on host:port.
func (q *approvals) ask(ctx context.Context, host string, port int, method, path string) (*policy.ApprovalDecision, *blockedErr) {
	key := hostPort(host, port)
	q.mu.Lock()
	if c, ok := q.cooldown[key]; ok {
		if q.now().Before(c.until) {
			q.mu.Unlock()
			return nil, block(http.StatusForbidden, policy.RuleApprovalDenied, "%s was denied by %s less than %s ago; not asking again yet", key, c.by, policy.DeniedCooldown)
		}
		delete(q.cooldown, key)
	}
	a := q.waiting[key]
	if a == nil {
		if len(q.waiting) >= q.cfg.MaxPending {
			q.mu.Unlock()
			return nil, block(http.StatusForbidden, policy.RuleApprovalQueueFull, "%d requests already wait for an operator's approval (approval max_pending); refused without asking", q.cfg.MaxPending)
		}
		var err error
		if a, err = q.open(host, port, method, path); err != nil {
			q.mu.Unlock()
			return nil, block(http.StatusForbidden, policy.RuleApprovalTimeout, "cannot ask for approval: %v", err)
		}
		q.waiting[key] = a
		go q.await(key, a)
	}
	q.mu.Unlock()
	select {
	case <-a.done:
	case <-ctx.Done():
		return nil, block(http.StatusForbidden, policy.RuleApprovalTimeout, "the request went away while waiting for approval %s", a.id)
	}
	switch r := a.res; {
	case r.err != nil:
		return nil, block(http.StatusForbidden, policy.RuleApprovalTimeout, "approval %s: %v", a.id, r.err)
	case r.timedOut:
		return nil, block(http.StatusForbidden, policy.RuleApprovalTimeout, "timed out after %s waiting for an operator's approval (approval %s; an operator runs cagectl approvals and cagectl approve)", q.cfg.Wait(), a.id)
	case r.d.Verdict == policy.VerdictDeny:
		return nil, block(http.StatusForbidden, policy.RuleApprovalDenied, "denied by %s (approval %s)", r.d.By, a.id)
	}
	return a.res.d, nil
}

// open writes the pending file caged reads.
func (q *approvals) open(host string, port int, method, path string) (*asking, error) {
	id, err := policy.NewApprovalID()
	if err != nil {
		return nil, err
	}
	now := q.now()
	p := policy.Pending{Schema: policy.ApprovalSchema, ID: id, Agent: q.agent, Method: method, Host: host, Port: port,
		Path: policy.CutPath(strings.ToValidUTF8(path, "?")), SinceUnix: now.Unix(), ExpiresUnix: now.Add(q.cfg.Wait()).Unix()}
	b, err := policy.MarshalDoc(&p)
	if err != nil {
		return nil, err
	}
	if err := policy.WriteFileAtomic(q.cfg.PendingFile(id), b); err != nil {
		return nil, err
	}
	return &asking{id: id, done: make(chan struct{})}, nil
}

// await polls for the decision until it comes or the wait is over, then
// wakes every request waiting on a and removes its pending file.
func (q *approvals) await(key string, a *asking) {
	deadline := time.NewTimer(q.cfg.Wait())
	defer deadline.Stop()
	t := time.NewTicker(approvalPoll)
	defer t.Stop()
	for a.res.d == nil && a.res.err == nil && !a.res.timedOut {
		select {
		case <-deadline.C:
			a.res.timedOut = true
		case <-t.C:
			a.res.d, a.res.err = policy.LoadDecision(&q.cfg, q.agent, a.id)
		}
	}
	os.Remove(q.cfg.PendingFile(a.id))
	q.mu.Lock()
	delete(q.waiting, key)
	if a.res.d != nil && a.res.d.Verdict == policy.VerdictDeny {
		if len(q.cooldown) >= maxCooldowns {
			q.dropOldestCooldown()
		}
		q.cooldown[key] = cooldown{until: q.now().Add(policy.DeniedCooldown), by: a.res.d.By}
	}
	q.mu.Unlock()
	close(a.done)
}

func (q *approvals) dropOldestCooldown() {
	var oldest string
	var t time.Time
	for k, c := range q.cooldown {
		if oldest == "" || c.until.Before(t) {
			oldest, t = k, c.until
		}
	}
	delete(q.cooldown, oldest)
}
