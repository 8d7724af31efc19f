package bus

import (
	"context"
	"errors"
	"fmt"
	"os"

	"github.com/godbus/dbus/v5"
)

// Client is a typed connection to caged.
type Client struct {
	conn *dbus.Conn
	obj  dbus.BusObject
}

// Dial connects to caged on the bus at address; "" means the system bus.
// Failure to reach the bus is reported as ErrUnavailable.
func Dial(ctx context.Context, address string) (*Client, error) {
	var conn *dbus.Conn
	var err error
	if address == "" {
		conn, err = dbus.SystemBusPrivate(dbus.WithContext(ctx))
		address = "the system bus"
	} else {
		conn, err = dbus.Dial(address, dbus.WithContext(ctx))
	}
	if err != nil {
		return nil, fmt.Errorf("%w: cannot connect to %s: %v", ErrUnavailable, address, err)
	}
	// EXTERNAL with the numeric uid: no user name lookup needed.
	if err = conn.Auth([]dbus.Auth{dbus.AuthExternal(fmt.Sprint(os.Getuid()))}); err == nil {
		err = conn.Hello()
	}
	if err != nil {
		conn.Close()
		return nil, fmt.Errorf("%w: cannot authenticate to %s: %v", ErrUnavailable, address, err)
	}
	return &Client{conn: conn, obj: conn.Object(Name, Path)}, nil
}

// Close closes the connection.
func (c *Client) Close() error { return c.conn.Close() }

// Conn is the underlying connection (for benchmarks and tests).
func (c *Client) Conn() *dbus.Conn { return c.conn }

func (c *Client) call(ctx context.Context, method string, out []any, args ...any) error {
	call := c.obj.CallWithContext(ctx, ManagerIface+"."+method, 0, args...)
	if call.Err != nil {
		return remote(call.Err)
	}
	if len(out) == 0 {
		return nil
	}
	if err := call.Store(out...); err != nil {
		return fmt.Errorf("%s: unexpected reply: %w", method, err)
	}
	return nil
}

func remote(err error) error {
	var de dbus.Error
	if errors.As(err, &de) {
		return &RemoteError{Name: de.Name, Message: errMsg(de)}
	}
	var dp *dbus.Error
	if errors.As(err, &dp) {
		return &RemoteError{Name: dp.Name, Message: errMsg(*dp)}
	}
	return err
}

func errMsg(e dbus.Error) string {
	if e.Name == "org.freedesktop.DBus.Error.ServiceUnknown" || e.Name == "org.freedesktop.DBus.Error.NameHasNoOwner" {
		return "caged is not running (no owner of " + Name + " on the bus); start nixcage-caged.service"
	}
	if len(e.Body) > 0 {
		if s, ok := e.Body[0].(string); ok {
			return s
		}
	}
	return e.Name
}

// Status returns the appliance and every agent.
func (c *Client) Status(ctx context.Context) (*Status, error) {
	call := c.obj.CallWithContext(ctx, ManagerIface+".GetStatus", 0)
	if call.Err != nil {
		return nil, remote(call.Err)
	}
	if len(call.Body) == 1 {
		if st, ok := decodeStatus(call.Body[0]); ok {
			return st, nil
		}
	}
	var st Status
	if err := call.Store(&st); err != nil {
		return nil, fmt.Errorf("GetStatus: unexpected reply: %w", err)
	}
	return &st, nil
}

// decodeStatus converts godbus's generic decoding of a Status by type
// assertions: dbus.Store does the same by reflection, an order of magnitude
// slower for a thousand agents. Any mismatch falls back to dbus.Store.
func decodeStatus(v any) (*Status, bool) {
	f, ok := v.([]any)
	if !ok || len(f) != 14 {
		return nil, false
	}
	st := &Status{}
	var ok2 [11]bool
	st.Version, ok2[0] = f[0].(string)
	st.Mode, ok2[1] = f[1].(string)
	st.Config, ok2[2] = f[2].(string)
	st.Generation, ok2[3] = f[3].(uint64)
	st.Channel, ok2[4] = f[4].(string)
	st.GenerationExpiresUnix, ok2[5] = f[5].(int64)
	st.Freshness, ok2[6] = f[6].(string)
	st.FreshnessMessage, ok2[7] = f[7].(string)
	st.StartedUnix, ok2[8] = f[8].(int64)
	st.ReconciledUnix, ok2[9] = f[9].(int64)
	st.ReconcileError, ok2[10] = f[10].(string)
	for _, b := range ok2 {
		if !b {
			return nil, false
		}
	}
	agents, ok := f[11].([][]any)
	if !ok {
		generic, ok := f[11].([]any)
		if !ok {
			return nil, false
		}
		for _, g := range generic {
			a, ok := g.([]any)
			if !ok {
				return nil, false
			}
			agents = append(agents, a)
		}
	}
	cp, ok := f[12].([]any)
	if !ok || len(cp) != 8 {
		return nil, false
	}
	var okc [8]bool
	c := &st.ChannelPoll
	c.URL, okc[0] = cp[0].(string)
	c.LastPollUnix, okc[1] = cp[1].(int64)
	c.LastSuccessUnix, okc[2] = cp[2].(int64)
	c.NextPollUnix, okc[3] = cp[3].(int64)
	c.Published, okc[4] = cp[4].(uint64)
	c.Lag, okc[5] = cp[5].(int64)
	c.LastError, okc[6] = cp[6].(string)
	c.Failures, okc[7] = cp[7].(uint32)
	for _, b := range okc {
		if !b {
			return nil, false
		}
	}
	st.Agents = make([]AgentStatus, len(agents))
	for i, a := range agents {
		if len(a) != 16 {
			return nil, false
		}
		as := &st.Agents[i]
		var ok [16]bool
		as.Name, ok[0] = a[0].(string)
		as.Backend, ok[1] = a[1].(string)
		as.Unit, ok[2] = a[2].(string)
		as.LoadState, ok[3] = a[3].(string)
		as.ActiveState, ok[4] = a[4].(string)
		as.SubState, ok[5] = a[5].(string)
		as.EgressState, ok[6] = a[6].(string)
		as.Autostart, ok[7] = a[7].(bool)
		as.Quarantined, ok[8] = a[8].(bool)
		as.QuarantineReason, ok[9] = a[9].(string)
		as.Generation, ok[10] = a[10].(uint64)
		as.Allowed, ok[11] = a[11].(uint64)
		as.Flagged, ok[12] = a[12].(uint64)
		as.Blocked, ok[13] = a[13].(uint64)
		as.RunBy, ok[14] = a[14].(string)
		as.LearnUntilUnix, ok[15] = a[15].(int64)
		for _, b := range ok {
			if !b {
				return nil, false
			}
		}
	}
	// Bans are few: the generic path is fast enough for them.
	if err := dbus.Store([]any{f[13]}, &st.Bans); err != nil {
		return nil, false
	}
	return st, true
}

// Start starts an agent.
func (c *Client) Start(ctx context.Context, agent string) error {
	return c.call(ctx, "StartAgent", nil, agent)
}

// Stop stops an agent.
func (c *Client) Stop(ctx context.Context, agent string) error {
	return c.call(ctx, "StopAgent", nil, agent)
}

// Restart restarts an agent.
func (c *Client) Restart(ctx context.Context, agent string) error {
	return c.call(ctx, "RestartAgent", nil, agent)
}

// Kill sends SIGKILL to every process in the agent's cgroup.
func (c *Client) Kill(ctx context.Context, agent string) error {
	return c.call(ctx, "KillAgent", nil, agent)
}

// Quarantine quarantines an agent and returns its evidence directory.
func (c *Client) Quarantine(ctx context.Context, agent, reason string) (string, error) {
	var ev string
	err := c.call(ctx, "QuarantineAgent", []any{&ev}, agent, reason)
	return ev, err
}

// Release lifts an agent's quarantine (it does not start it).
func (c *Client) Release(ctx context.Context, agent string) error {
	return c.call(ctx, "ReleaseAgent", nil, agent)
}

// ReadAudit returns audit records from offset on and the next offset.
func (c *Client) ReadAudit(ctx context.Context, agent string, offset int64, max uint32) ([]string, int64, error) {
	var lines []string
	var next int64
	err := c.call(ctx, "ReadAudit", []any{&lines, &next}, agent, offset, max)
	return lines, next, err
}

// Apply applies the release at source (a directory or URL).
func (c *Client) Apply(ctx context.Context, source string) (*ApplyResult, error) {
	var r ApplyResult
	if err := c.call(ctx, "Apply", []any{&r}, source); err != nil {
		return nil, err
	}
	return &r, nil
}

// Rollback switches to generation to (0: the previous one); force allows a
// generation the current key set does not vouch for (audited).
func (c *Client) Rollback(ctx context.Context, to uint64, force bool) (from, now uint64, err error) {
	err = c.call(ctx, "Rollback", []any{&from, &now}, to, force)
	return from, now, err
}

// Generations lists the kept store generations.
func (c *Client) Generations(ctx context.Context) ([]Generation, error) {
	var gens []Generation
	err := c.call(ctx, "ListGenerations", []any{&gens})
	return gens, err
}

// Reload makes caged re-read its configuration and reconcile.
func (c *Client) Reload(ctx context.Context) error {
	return c.call(ctx, "Reload", nil)
}

// Ping is an empty round trip to caged (org.freedesktop.DBus.Peer.Ping).
func (c *Client) Ping(ctx context.Context) error {
	return remote(c.obj.CallWithContext(ctx, "org.freedesktop.DBus.Peer.Ping", 0).Err)
}

// Event is one signal from caged.
type Event struct {
	Kind  string            `json:"kind"` // the signal name
	Agent string            `json:"agent,omitempty"`
	Data  map[string]string `json:"data,omitempty"`
}

// Events delivers caged's signals until ctx ends. The channel is closed then.
// It subscribes: signals carrying audit data are addressed to subscribers
// allowed to read them, never broadcast. Addressed signals bypass match
// rules, so each one's sender is checked against the owner of caged's name;
// when caged restarts (a new owner), the stream follows it and subscribes
// again.
func (c *Client) Events(ctx context.Context) (<-chan Event, error) {
	if err := c.conn.AddMatchSignalContext(ctx, dbus.WithMatchSender(Name), dbus.WithMatchInterface(ManagerIface)); err != nil {
		return nil, remote(err)
	}
	if err := c.conn.AddMatchSignalContext(ctx, dbus.WithMatchSender("org.freedesktop.DBus"), dbus.WithMatchMember("NameOwnerChanged"), dbus.WithMatchArg(0, Name)); err != nil {
		return nil, remote(err)
	}
	in := make(chan *dbus.Signal, 64)
	c.conn.Signal(in)
	var owner string
	if err := c.conn.BusObject().CallWithContext(ctx, "org.freedesktop.DBus.GetNameOwner", 0, Name).Store(&owner); err != nil {
		c.conn.RemoveSignal(in)
		return nil, remote(err)
	}
	if err := c.call(ctx, "Subscribe", nil); err != nil {
		c.conn.RemoveSignal(in)
		return nil, err
	}
	out := make(chan Event, 64)
	go func() {
		defer close(out)
		defer c.conn.RemoveSignal(in)
		for {
			select {
			case <-ctx.Done():
				// Best effort: the subscription also ends with the connection.
				c.obj.Go(ManagerIface+".Unsubscribe", dbus.FlagNoReplyExpected, nil)
				return
			case sig, ok := <-in:
				if !ok {
					return
				}
				if sig.Name == "org.freedesktop.DBus.NameOwnerChanged" && sig.Sender == "org.freedesktop.DBus" && len(sig.Body) == 3 && sig.Body[0] == Name {
					owner, _ = sig.Body[2].(string)
					if owner != "" {
						c.obj.Go(ManagerIface+".Subscribe", dbus.FlagNoReplyExpected, nil)
					}
					continue
				}
				if sig.Path != Path || sig.Sender != owner {
					continue
				}
				ev, ok := decodeEvent(sig)
				if !ok {
					continue
				}
				select {
				case out <- ev:
				case <-ctx.Done():
					return
				}
			}
		}
	}()
	return out, nil
}

func decodeEvent(sig *dbus.Signal) (Event, bool) {
	iface := ManagerIface + "."
	if len(sig.Name) <= len(iface) || sig.Name[:len(iface)] != iface {
		return Event{}, false
	}
	kind := sig.Name[len(iface):]
	str := func(i int) string {
		if i < len(sig.Body) {
			return fmt.Sprint(sig.Body[i])
		}
		return ""
	}
	ev := Event{Kind: kind, Data: map[string]string{}}
	var keys []string
	switch kind {
	case SignalAgentStateChanged:
		keys = []string{"agent", "active_state", "sub_state"}
	case SignalEgressDecision:
		keys = []string{"agent", "decision", "host", "reason", "record"}
	case SignalReleaseApplied:
		keys = []string{"generation", "previous", "by"}
	case SignalAgentQuarantined:
		keys = []string{"agent", "reason", "evidence", "by"}
	case SignalAgentReleased, SignalAgentKilled:
		keys = []string{"agent", "by"}
	case SignalReconciled:
		keys = []string{"error"}
	case SignalEgressFailed:
		keys = []string{"agent", "reason", "recover"}
	case SignalRunStarted:
		keys = []string{"agent", "backend", "by"}
	case SignalRunFinished:
		keys = []string{"agent", "exit_status", "summary"}
	case SignalApprovalPending:
		keys = []string{"agent", "id", "host", "port", "method", "path", "since_unix", "expires_unix"}
	case SignalApprovalDecided:
		keys = []string{"agent", "id", "verdict", "by"}
	case SignalShellOpened:
		keys = []string{"agent", "by", "command", "unit"}
	case SignalShellClosed:
		keys = []string{"agent", "by", "exit_status", "unit"}
	case SignalRelayAction:
		keys = []string{"agent", "actor", "action", "outcome", "detail", "by"}
	case SignalTurnStarted:
		keys = []string{"agent", "by"}
	case SignalTurnFinished:
		keys = []string{"agent", "by", "status", "exit_status", "duration_ms"}
	case SignalFileTransferred:
		keys = []string{"agent", "op", "path", "bytes", "outcome", "by"}
	default:
		return Event{}, false
	}
	for i, k := range keys {
		if k == "agent" {
			ev.Agent = str(i)
			continue
		}
		ev.Data[k] = str(i)
	}
	return ev, true
}
