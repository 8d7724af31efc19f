package bus

import (
	"context"
	"strings"
	"unicode/utf8"

	"github.com/godbus/dbus/v5"
	"github.com/godbus/dbus/v5/introspect"
)

// SignalRelayAction: the chat relay did (or refused) something. Wire
// (s agent, s actor, s action, s outcome, s detail, s by); by is the bus
// caller caged identified (the relay's account), actor the chat user the
// relay names.
const SignalRelayAction = "RelayAction"

// RelayAction is one chat relay action as the relay reports it to caged,
// which stamps it with the caller and makes it an event (`cagectl events`,
// the journal's relay-action MESSAGE_ID). Wire order (sssss).
type RelayAction struct {
	Agent   string `json:"agent"`   // "" when the chat is bound to no agent
	Actor   string `json:"actor"`   // chat user, e.g. "telegram:123456 (@name)"
	Action  string `json:"action"`  // command or kind: "status", "turn", "upload", ...
	Outcome string `json:"outcome"` // "ok", "refused", "failed"
	Detail  string `json:"detail"`  // one line: the reason or what was done
}

// Relay outcomes.
const (
	RelayOK      = "ok"
	RelayRefused = "refused"
	RelayFailed  = "failed"
)

// RelayBackend records relay actions; caged's daemon implements it.
type RelayBackend interface {
	RecordRelayAction(ctx context.Context, a RelayAction, by string) error
}

// Bounds of a record: caged writes each to the journal, so a relay (or
// anyone holding an account) cannot make an entry arbitrarily large.
const (
	relayFieldMax  = 128
	relayDetailMax = 1024
)

func init() {
	argNames["RecordRelayAction"] = []string{"action"}
	managerSignals = append(managerSignals, introspect.Signal{Name: SignalRelayAction, Args: []introspect.Arg{
		{Name: "agent", Type: "s"}, {Name: "actor", Type: "s"}, {Name: "action", Type: "s"},
		{Name: "outcome", Type: "s"}, {Name: "detail", Type: "s"}, {Name: "by", Type: "s"}}})
}

// RecordRelayAction makes a relay's record an event. The caller needs view
// rights over the agent (over every agent for a record naming none): what
// it may read it may also report on, and nothing it reports changes any
// state. caged adds who called, so a record is never anonymous.
func (m *manager) RecordRelayAction(sender dbus.Sender, a RelayAction) *dbus.Error {
	var id Identity
	var derr *dbus.Error
	if a.Agent != "" {
		id, derr = m.s.authorizeAgent(sender, ActView, a.Agent, "RecordRelayAction")
	} else {
		id, derr = m.s.authorize(sender, ActView, "RecordRelayAction")
	}
	if derr != nil {
		return derr
	}
	for _, f := range []struct {
		name, v string
		max     int
	}{{"actor", a.Actor, relayFieldMax}, {"action", a.Action, relayFieldMax}, {"outcome", a.Outcome, relayFieldMax}, {"detail", a.Detail, relayDetailMax}} {
		if len(f.v) > f.max || !utf8.ValidString(f.v) || strings.ContainsAny(f.v, "\n\r\x00") {
			return newError(ErrorInvalid, "relay action %s: one line of valid UTF-8, at most %d bytes", f.name, f.max)
		}
	}
	switch a.Outcome {
	case RelayOK, RelayRefused, RelayFailed:
	default:
		return newError(ErrorInvalid, "relay action outcome %q: use %q, %q or %q", a.Outcome, RelayOK, RelayRefused, RelayFailed)
	}
	rb, ok := m.s.be.(RelayBackend)
	if !ok {
		return newError(ErrorFailed, "this caged records no relay actions")
	}
	return fail(rb.RecordRelayAction(context.Background(), a, id.String()))
}

// RecordRelayAction reports a relay action to caged.
func (c *Client) RecordRelayAction(ctx context.Context, a RelayAction) error {
	return c.call(ctx, "RecordRelayAction", nil, a)
}
