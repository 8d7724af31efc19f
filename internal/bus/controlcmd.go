package bus

import (
	"context"

	"github.com/godbus/dbus/v5"

	"github.com/nixcage/nixcage/internal/control"
)

// ControlBackend executes signed control commands handed in over the bus
// (cagectl control apply) and lists their acknowledgements.
type ControlBackend interface {
	// ApplyControl verifies raw as a signed control command and executes
	// it at most once. Every outcome (executed or refused) is an ack, not
	// an error; an error means no ack could be recorded.
	ApplyControl(ctx context.Context, raw []byte, by string) (control.Ack, error)
	// ControlAcks returns the newest max acks, oldest first.
	ControlAcks(ctx context.Context, max uint32) ([]control.Ack, error)
}

func init() {
	argNames["ApplyControl"] = []string{"command", "ack"}
	argNames["ListControlAcks"] = []string{"max", "acks"}
}

// ApplyControl needs the admin role, as apply does: the command's
// signatures are its authority, but handing one in is still a change to
// the whole host, and the caller is recorded in the ack.
func (m *manager) ApplyControl(sender dbus.Sender, raw []byte) (control.Ack, *dbus.Error) {
	id, derr := m.s.authorize(sender, ActAdmin, "ApplyControl")
	if derr != nil {
		return control.Ack{}, derr
	}
	if len(raw) > control.MaxSize {
		return control.Ack{}, newError(ErrorInvalid, "command document is %d bytes, more than the %d allowed", len(raw), control.MaxSize)
	}
	ack, err := m.s.be.ApplyControl(context.Background(), raw, id.String())
	if err != nil {
		return control.Ack{}, fail(err)
	}
	return ack, nil
}

// ListControlAcks needs viewer over every agent: acks name agents and
// banned hosts.
func (m *manager) ListControlAcks(sender dbus.Sender, max uint32) ([]control.Ack, *dbus.Error) {
	if _, derr := m.s.authorize(sender, ActView, "ListControlAcks"); derr != nil {
		return nil, derr
	}
	acks, err := m.s.be.ControlAcks(context.Background(), max)
	if acks == nil {
		acks = []control.Ack{}
	}
	return acks, fail(err)
}

// ApplyControl hands a signed command document to caged.
func (c *Client) ApplyControl(ctx context.Context, raw []byte) (*control.Ack, error) {
	var a control.Ack
	if err := c.call(ctx, "ApplyControl", []any{&a}, raw); err != nil {
		return nil, err
	}
	return &a, nil
}

// ControlAcks lists the newest max acks (0: all kept).
func (c *Client) ControlAcks(ctx context.Context, max uint32) ([]control.Ack, error) {
	var as []control.Ack
	err := c.call(ctx, "ListControlAcks", []any{&as}, max)
	return as, err
}
