package bus

import (
	"context"

	"github.com/godbus/dbus/v5"

	"github.com/nixcage/nixcage/internal/policy"
)

// Approval signals (docs/grants.md "Approvals"): a request outside an
// agent's policy waits for an operator. Both are audit signals
// (paths.BusAuditSignals: addressed to subscribers who may view the agent,
// never broadcast, and refused by the bus policy to undeclared users):
// they carry what the agent asked for.
const (
	SignalApprovalPending = "ApprovalPending" // (s agent, s id, s host, u port, s method, s path, x since_unix, x expires_unix)
	SignalApprovalDecided = "ApprovalDecided" // (s agent, s id, s verdict, s by)
)

// Approval is a request waiting for an operator. Wire order: (sssussxx).
// Host, method and path are the agent's words (bounded and checked by
// caged); show them escaped.
type Approval struct {
	ID          string `json:"id"`
	Agent       string `json:"agent"`
	Host        string `json:"host"`
	Port        uint32 `json:"port"`
	Method      string `json:"method"`
	Path        string `json:"path"`
	SinceUnix   int64  `json:"since_unix"`
	ExpiresUnix int64  `json:"expires_unix"`
}

// ApprovalsBackend lists pending approvals and records decisions.
type ApprovalsBackend interface {
	// ListApprovals returns agent's requests waiting now.
	ListApprovals(ctx context.Context, agent string) ([]Approval, error)
	// DecideApproval records verdict on approval id of agent; with
	// policy.VerdictHost it first makes a grant and returns its id.
	DecideApproval(ctx context.Context, agent, id, verdict, by string) (string, error)
	// ApprovalAgent finds which agent's request id is.
	ApprovalAgent(id string) (string, bool)
}

func init() {
	argNames["ListApprovals"] = []string{"name", "approvals"}
	argNames["Decide"] = []string{"id", "verdict", "grant"}
	managerSignals = append(managerSignals,
		introspectSignal(SignalApprovalPending, "agent:s", "id:s", "host:s", "port:u", "method:s", "path:s", "since_unix:x", "expires_unix:x"),
		introspectSignal(SignalApprovalDecided, "agent:s", "id:s", "verdict:s", "by:s"))
}

// ListApprovals lists the requests of agent waiting for an operator, or of
// every agent the caller may view when agent is "" (viewer role).
func (m *manager) ListApprovals(sender dbus.Sender, agent string) ([]Approval, *dbus.Error) {
	agents, derr := m.viewable(sender, agent, "ListApprovals")
	if derr != nil {
		return nil, derr
	}
	out := []Approval{}
	for _, a := range agents {
		as, err := m.s.be.ListApprovals(context.Background(), a)
		if err != nil {
			return nil, fail(err)
		}
		out = append(out, as...)
	}
	return out, nil
}

// Decide decides approval id: "once" lets that request through, "host"
// grants the host for policy.DefaultGrantDuration and lets it through,
// "deny" refuses it. Operator over the agent whose request it is.
func (m *manager) Decide(sender dbus.Sender, id, verdict string) (string, *dbus.Error) {
	if err := policy.CheckApprovalID(id); err != nil {
		return "", newError(ErrorInvalid, "%v", err)
	}
	switch verdict {
	case policy.VerdictOnce, policy.VerdictHost, policy.VerdictDeny:
	default:
		return "", newError(ErrorInvalid, "verdict %q: use once, host or deny", verdict)
	}
	agent, ok := m.s.be.ApprovalAgent(id)
	if !ok {
		if _, err := m.s.caller(sender); err != nil {
			return "", newError(ErrorAccessDenied, "%v", err)
		}
		return "", newError(ErrorInvalid, "no request %s is waiting (decided, timed out, or never asked; cagectl approvals lists them)", id)
	}
	who, derr := m.s.authorizeAgent(sender, ActOperate, agent, "Decide")
	if derr != nil {
		return "", derr
	}
	g, err := m.s.be.DecideApproval(context.Background(), agent, id, verdict, who.String())
	if err != nil {
		return "", fail(err)
	}
	return g, nil
}

// ListApprovals lists waiting requests of agent ("" for every agent the
// caller may view).
func (c *Client) ListApprovals(ctx context.Context, agent string) ([]Approval, error) {
	var as []Approval
	err := c.call(ctx, "ListApprovals", []any{&as}, agent)
	return as, err
}

// Decide decides approval id (once, host or deny); with host it returns
// the grant made.
func (c *Client) Decide(ctx context.Context, id, verdict string) (string, error) {
	var g string
	err := c.call(ctx, "Decide", []any{&g}, id, verdict)
	return g, err
}
