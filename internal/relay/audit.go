package relay

import (
	"context"
	"time"

	"github.com/nixcage/nixcage/internal/bus"
)

// audit records one relay action: in the relay's own journal always, and
// as a RelayAction event through caged (cagectl events, the journal's
// relay-action MESSAGE_ID). caged refuses records for agents outside the
// relay's account; the local line still stands then.
func (r *Relay) audit(ctx context.Context, q *request, action, outcome, detail string) {
	a := bus.RelayAction{Agent: q.agent, Actor: q.actor, Action: oneLine(action, 64), Outcome: outcome, Detail: oneLine(detail, 1000)}
	r.log.Info("relay action", "agent", a.Agent, "actor", a.Actor, "action", a.Action, "outcome", a.Outcome, "detail", a.Detail,
		"chat", q.to.ChatID, "topic", q.to.Topic)
	// Recorded even when the request's own context ended (shutdown): the
	// action happened. Bounded, so a stuck bus cannot hold a handler.
	actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	if err := r.caged.RecordRelayAction(actx, a); err != nil {
		r.log.Warn("caged did not record the relay action", "action", a.Action, "err", err)
	}
}
