package bus_test

import (
	"context"

	"github.com/nixcage/nixcage/internal/bus"
)

func (f *fakeBackend) RecordRelayAction(ctx context.Context, a bus.RelayAction, by string) error {
	f.rec("relay %s %s %s %s by %s", a.Agent, a.Action, a.Outcome, a.Detail, by)
	return nil
}

// relayHelper is the helper's side of the RecordRelayAction cases.
func relayHelper(ctx context.Context, c *bus.Client, what string) (bool, error) {
	rec := bus.RelayAction{Actor: "telegram:1 (@x)", Action: "stop", Outcome: bus.RelayOK, Detail: "stop done"}
	switch what {
	case "relay-alpha":
		rec.Agent = "alpha"
	case "relay-beta":
		rec.Agent = "beta-2"
	case "relay-none":
	case "relay-alpha-multiline":
		rec.Agent, rec.Detail = "alpha", "forged\nsecond line"
	case "relay-alpha-outcome":
		rec.Agent, rec.Outcome = "alpha", "fine"
	default:
		return false, nil
	}
	return true, c.RecordRelayAction(ctx, rec)
}
