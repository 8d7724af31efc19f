package bus

import (
	"context"
	"strings"
	"time"

	"github.com/godbus/dbus/v5"

	"github.com/nixcage/nixcage/internal/policy"
)

// Grant is a time-bound allow entry as caged reports it (policy.Grant plus
// its agent). Wire order: (sssixxss).
type Grant struct {
	ID          string `json:"id"`
	Agent       string `json:"agent"`
	Host        string `json:"host"`
	Port        int32  `json:"port"`
	CreatedUnix int64  `json:"created_unix"`
	ExpiresUnix int64  `json:"expires_unix"`
	By          string `json:"by"`
	Reason      string `json:"reason"`
}

// GrantsBackend makes, lists and revokes time-bound grants (docs/grants.md).
type GrantsBackend interface {
	AllowHost(ctx context.Context, agent, host string, port int, d time.Duration, reason, by string) (Grant, error)
	// ListGrants returns the agent's grants in force.
	ListGrants(ctx context.Context, agent string) ([]Grant, error)
	// RevokeGrant removes grant id; the agent is the one holding it.
	RevokeGrant(ctx context.Context, agent, id, by string) error
	// GrantAgent finds which agent holds grant id.
	GrantAgent(id string) (string, bool)
}

func init() {
	argNames["AllowHost"] = []string{"name", "host", "port", "seconds", "reason", "grant"}
	argNames["ListGrants"] = []string{"name", "grants"}
	argNames["RevokeGrant"] = []string{"id"}
}

// AllowHost grants agent host[:port] for seconds. An operator over the agent
// may grant exact names; a wildcard needs an admin over it: "*.example.com"
// opens far more than one request showed was needed.
func (m *manager) AllowHost(sender dbus.Sender, agent, host string, port int32, seconds int64, reason string) (Grant, *dbus.Error) {
	id, derr := m.s.authorizeAgent(sender, ActOperate, agent, "AllowHost")
	if derr != nil {
		return Grant{}, derr
	}
	host = policy.Normalize(host)
	if strings.HasPrefix(host, "*.") {
		if err := Authorize(m.s.be.Accounts(), id, ActAdmin, agent); err != nil {
			m.s.log.Warn("refused", "method", "AllowHost", "caller", id.String(), "agent", agent, "host", host, "err", err)
			return Grant{}, newError(ErrorAccessDenied, "access denied: %s may grant exact host names only; a wildcard (%s) needs role %q covering agent %s", id, host, "admin", agent)
		}
	}
	if err := policy.CheckPattern(host); err != nil {
		return Grant{}, newError(ErrorInvalid, "%v", err)
	}
	if port < 0 || port > 65535 {
		return Grant{}, newError(ErrorInvalid, "port %d out of range 1-65535", port)
	}
	d := time.Duration(seconds) * time.Second
	if seconds <= 0 || d > policy.MaxGrantDuration {
		return Grant{}, newError(ErrorInvalid, "a grant lasts 1s to %s; for longer, add the host to the agent's policy", policy.MaxGrantDuration)
	}
	if len(reason) > 200 || strings.ContainsAny(reason, "\n\r\x00") {
		return Grant{}, newError(ErrorInvalid, "reason: one line of at most 200 bytes")
	}
	g, err := m.s.be.AllowHost(context.Background(), agent, host, int(port), d, reason, id.String())
	if err != nil {
		return Grant{}, fail(err)
	}
	return g, nil
}

// ListGrants lists the grants of agent, or of every agent the caller may
// view when agent is "".
func (m *manager) ListGrants(sender dbus.Sender, agent string) ([]Grant, *dbus.Error) {
	agents, derr := m.viewable(sender, agent, "ListGrants")
	if derr != nil {
		return nil, derr
	}
	out := []Grant{}
	for _, a := range agents {
		gs, err := m.s.be.ListGrants(context.Background(), a)
		if err != nil {
			return nil, fail(err)
		}
		out = append(out, gs...)
	}
	return out, nil
}

// viewable is agent if the caller may view it, or with agent "" every
// agent (and throw-away cage) the caller may view.
func (m *manager) viewable(sender dbus.Sender, agent, method string) ([]string, *dbus.Error) {
	if agent != "" {
		if _, derr := m.s.authorizeAgent(sender, ActView, agent, method); derr != nil {
			return nil, derr
		}
		return []string{agent}, nil
	}
	id, err := m.s.caller(sender)
	if err != nil {
		return nil, newError(ErrorAccessDenied, "%v", err)
	}
	st, err := m.s.be.Status(context.Background())
	if err != nil {
		return nil, fail(err)
	}
	var agents []string
	for _, a := range st.Agents {
		if Authorize(m.s.be.Accounts(), id, ActView, a.Name) == nil {
			agents = append(agents, a.Name)
		}
	}
	return agents, nil
}

// RevokeGrant ends grant id now (operator over the agent holding it).
func (m *manager) RevokeGrant(sender dbus.Sender, grant string) *dbus.Error {
	agent, ok := m.s.be.GrantAgent(grant)
	if !ok {
		if _, err := m.s.caller(sender); err != nil {
			return newError(ErrorAccessDenied, "%v", err)
		}
		return newError(ErrorInvalid, "no grant %q (cagectl grants list shows them)", grant)
	}
	id, derr := m.s.authorizeAgent(sender, ActOperate, agent, "RevokeGrant")
	if derr != nil {
		return derr
	}
	return fail(m.s.be.RevokeGrant(context.Background(), agent, grant, id.String()))
}

// AllowHost grants agent host (port 0: the default ports) for d.
func (c *Client) AllowHost(ctx context.Context, agent, host string, port int, d time.Duration, reason string) (*Grant, error) {
	var g Grant
	if err := c.call(ctx, "AllowHost", []any{&g}, agent, host, int32(port), int64(d/time.Second), reason); err != nil {
		return nil, err
	}
	return &g, nil
}

// ListGrants lists grants of agent ("" for every agent the caller may view).
func (c *Client) ListGrants(ctx context.Context, agent string) ([]Grant, error) {
	var gs []Grant
	err := c.call(ctx, "ListGrants", []any{&gs}, agent)
	return gs, err
}

// RevokeGrant ends a grant now.
func (c *Client) RevokeGrant(ctx context.Context, id string) error {
	return c.call(ctx, "RevokeGrant", nil, id)
}
