package daemon

import (
	"context"

	"github.com/nixcage/nixcage/internal/bus"
)

// RecordRelayAction turns a chat relay's record into an event: a bus
// signal for subscribers allowed to view the agent (cagectl events) and a
// journal entry with the relay-action MESSAGE_ID. by is the caller caged
// identified, so a record says which account reported it.
func (d *Daemon) RecordRelayAction(ctx context.Context, a bus.RelayAction, by string) error {
	d.log.Info("relay action", "agent", a.Agent, "actor", a.Actor, "action", a.Action, "outcome", a.Outcome, "detail", a.Detail, "by", by)
	d.emit(bus.SignalRelayAction, a.Agent, a.Actor, a.Action, a.Outcome, a.Detail, by)
	return nil
}
