package bus

import (
	"context"
	"encoding/xml"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sort"
	"strings"
	"sync"

	"github.com/godbus/dbus/v5"
	"github.com/godbus/dbus/v5/introspect"
	"github.com/godbus/dbus/v5/prop"

	"github.com/nixcage/nixcage/internal/config"
	"github.com/nixcage/nixcage/internal/paths"
)

// Backend is what the server exposes; caged's daemon implements it. Methods
// are called only after authorization. by names the caller for the logs.
type Backend interface {
	Status(ctx context.Context) (*Status, error)
	Agent(ctx context.Context, name string) (*AgentStatus, error)
	Start(ctx context.Context, agent, by string) error
	Stop(ctx context.Context, agent, by string) error
	Restart(ctx context.Context, agent, by string) error
	Kill(ctx context.Context, agent, by string) error
	Quarantine(ctx context.Context, agent, reason, by string) (evidence string, err error)
	Release(ctx context.Context, agent, by string) error
	Apply(ctx context.Context, source, by string) (*ApplyResult, error)
	// Rollback switches to an older kept generation; force switches even
	// to one the current key set does not vouch for (logged as forced).
	Rollback(ctx context.Context, to uint64, force bool, by string) (from, now uint64, err error)
	Generations(ctx context.Context) ([]Generation, error)
	Reload(ctx context.Context, by string) error
	// ReadAudit returns complete JSONL records from byte offset on (at
	// most max of them) and the offset to continue from.
	ReadAudit(ctx context.Context, agent string, offset int64, max uint32) ([]string, int64, error)
	// Accounts are the declared accounts, for authorization.
	Accounts() []*config.Account
	// HasAgent reports whether agent is declared.
	HasAgent(agent string) bool
	ConfigBackend
	LogsBackend
	GrantsBackend
	ApprovalsBackend
	ControlBackend
}

// Backend errors the server maps to D-Bus error names.
var (
	ErrInvalid       = errors.New("invalid argument")
	ErrIsQuarantined = errors.New("agent is quarantined")
)

// ServerOptions tune a Server.
type ServerOptions struct {
	Users UserDB // default SystemUsers
	Log   *slog.Logger
}

// Server serves org.nixcage.cage1 on a connection.
type Server struct {
	conn  *dbus.Conn
	be    Backend
	users UserDB
	log   *slog.Logger

	mu       sync.Mutex
	uids     map[string]uint32 // unique bus name -> uid; names are never reused
	agents   map[string]*agentObject
	mgrProps *prop.Properties
	subs     map[string]Identity // unique bus name -> who subscribed
	// calls end when their caller leaves the bus (long calls: turns).
	calls map[string]map[*callerCall]bool
}

type callerCall struct{ cancel context.CancelFunc }

// maxSubscribers bounds the subscriptions caged keeps; dbus-daemon bounds
// connections per user, this bounds the total.
const maxSubscribers = 4096

// NewServer prepares a server; Export publishes it.
func NewServer(conn *dbus.Conn, be Backend, o ServerOptions) *Server {
	if o.Users == nil {
		o.Users = SystemUsers{}
	}
	if o.Log == nil {
		o.Log = slog.Default()
	}
	return &Server{conn: conn, be: be, users: o.Users, log: o.Log, uids: map[string]uint32{}, agents: map[string]*agentObject{}, subs: map[string]Identity{}, calls: map[string]map[*callerCall]bool{}}
}

// ManagerProps are the Manager's initial property values.
type ManagerProps struct {
	Version, Mode, Config, Channel string
	Generation                     uint64
}

// Export publishes the Manager object, the intermediate nodes that make
// `busctl tree` work, and then requests the bus name. It fails if the name
// is owned already (another caged) or the bus policy forbids owning it.
func (s *Server) Export(mp ManagerProps) error {
	props, err := prop.Export(s.conn, Path, prop.Map{ManagerIface: {
		"Version":        {Value: mp.Version, Emit: prop.EmitConst},
		"Mode":           {Value: mp.Mode, Emit: prop.EmitConst},
		"ConfigPath":     {Value: mp.Config, Emit: prop.EmitConst},
		"Generation":     {Value: mp.Generation, Emit: prop.EmitTrue},
		"Channel":        {Value: mp.Channel, Emit: prop.EmitTrue},
		"Agents":         {Value: []dbus.ObjectPath{}, Emit: prop.EmitTrue},
		"ReconcileError": {Value: "", Emit: prop.EmitTrue},
		// The current generation's expiry and "none", "ok", "expiring" or
		// "expired": a monitor watches these for a frozen channel.
		"GenerationExpires": {Value: int64(0), Emit: prop.EmitTrue},
		"Freshness":         {Value: "none", Emit: prop.EmitTrue},
		// The pulled channel (docs/fleet.md "Status"): a monitor watches
		// ChannelError and ChannelLastSuccess for a host that stopped
		// following its channel.
		"ChannelURL":         {Value: "", Emit: prop.EmitTrue},
		"ChannelLastPoll":    {Value: int64(0), Emit: prop.EmitTrue},
		"ChannelLastSuccess": {Value: int64(0), Emit: prop.EmitTrue},
		"ChannelPublished":   {Value: uint64(0), Emit: prop.EmitTrue},
		"ChannelLag":         {Value: int64(0), Emit: prop.EmitTrue},
		"ChannelError":       {Value: "", Emit: prop.EmitTrue},
	}})
	if err != nil {
		return fmt.Errorf("export properties: %w", err)
	}
	s.mgrProps = props
	if err := s.conn.Export(&manager{s}, Path, ManagerIface); err != nil {
		return fmt.Errorf("export manager: %w", err)
	}
	for _, p := range []string{"/", "/org", "/org/nixcage", paths.BusPath, paths.AgentPath} {
		p := p
		if err := s.conn.Export(introspector(func() string { return s.introspect(p) }), dbus.ObjectPath(p), "org.freedesktop.DBus.Introspectable"); err != nil {
			return fmt.Errorf("export introspection: %w", err)
		}
	}
	if err := s.watchSubscribers(); err != nil {
		return err
	}
	reply, err := s.conn.RequestName(Name, dbus.NameFlagDoNotQueue)
	if err != nil {
		return fmt.Errorf("request bus name %s: %w (only root may own it; is the D-Bus policy installed?)", Name, err)
	}
	if reply != dbus.RequestNameReplyPrimaryOwner {
		return fmt.Errorf("bus name %s is owned by another process (is caged already running?)", Name)
	}
	return nil
}

// SetManager updates the Manager's changing properties, emitting
// PropertiesChanged for those that differ.
func (s *Server) SetManager(generation uint64, channel, reconcileErr string) {
	setIfChanged(s.mgrProps, ManagerIface, "Generation", generation)
	setIfChanged(s.mgrProps, ManagerIface, "Channel", channel)
	setIfChanged(s.mgrProps, ManagerIface, "ReconcileError", reconcileErr)
}

// SetFreshness updates the current generation's expiry properties.
func (s *Server) SetFreshness(expiresUnix int64, freshness string) {
	setIfChanged(s.mgrProps, ManagerIface, "GenerationExpires", expiresUnix)
	setIfChanged(s.mgrProps, ManagerIface, "Freshness", freshness)
}

// SetChannel updates the pulled channel's properties.
func (s *Server) SetChannel(c ChannelStatus) {
	setIfChanged(s.mgrProps, ManagerIface, "ChannelURL", c.URL)
	setIfChanged(s.mgrProps, ManagerIface, "ChannelLastPoll", c.LastPollUnix)
	setIfChanged(s.mgrProps, ManagerIface, "ChannelLastSuccess", c.LastSuccessUnix)
	setIfChanged(s.mgrProps, ManagerIface, "ChannelPublished", c.Published)
	setIfChanged(s.mgrProps, ManagerIface, "ChannelLag", c.Lag)
	setIfChanged(s.mgrProps, ManagerIface, "ChannelError", c.LastError)
}

func setIfChanged(p *prop.Properties, iface, name string, v any) {
	if p == nil {
		return
	}
	if cur, err := p.Get(iface, name); err == nil && fmt.Sprint(cur.Value()) == fmt.Sprint(v) {
		return
	}
	setProp(p, iface, name, v)
}

// setProp sets a read-only property. SetMust panics when emitting
// PropertiesChanged fails, which it does once the connection is closed
// (shutdown, a lost bus); a status update must never bring caged down
// (the watchdog handles a lost bus). Names are constants here, so that is
// the only failure left to swallow.
func setProp(p *prop.Properties, iface, name string, v any) {
	defer func() { _ = recover() }()
	p.SetMust(iface, name, v)
}

// SetAgents exports an object for every agent in sts and removes objects of
// agents no longer declared. Existing objects get their properties updated.
func (s *Server) SetAgents(sts []AgentStatus) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	keep := map[string]bool{}
	for i := range sts {
		st := sts[i]
		keep[st.Name] = true
		if o, ok := s.agents[st.Name]; ok {
			o.update(st)
			continue
		}
		o := &agentObject{s: s, name: st.Name}
		path := AgentPath(st.Name)
		props, err := prop.Export(s.conn, path, prop.Map{AgentIface: agentProps(st)})
		if err != nil {
			return fmt.Errorf("export agent %s: %w", st.Name, err)
		}
		o.props = props
		if err := s.conn.Export(o, path, AgentIface); err != nil {
			return fmt.Errorf("export agent %s: %w", st.Name, err)
		}
		if err := s.conn.Export(introspector(func() string { return s.introspect(string(path)) }), path, "org.freedesktop.DBus.Introspectable"); err != nil {
			return fmt.Errorf("export agent %s: %w", st.Name, err)
		}
		s.agents[st.Name] = o
	}
	for name := range s.agents {
		if keep[name] {
			continue
		}
		path := AgentPath(name)
		for _, iface := range []string{AgentIface, "org.freedesktop.DBus.Properties", "org.freedesktop.DBus.Introspectable"} {
			s.conn.Export(nil, path, iface)
		}
		delete(s.agents, name)
	}
	names := make([]string, 0, len(s.agents))
	for n := range s.agents {
		names = append(names, n)
	}
	sort.Strings(names)
	objs := make([]dbus.ObjectPath, len(names))
	for i, n := range names {
		objs[i] = AgentPath(n)
	}
	if s.mgrProps != nil {
		cur, _ := s.mgrProps.Get(ManagerIface, "Agents")
		if fmt.Sprint(cur.Value()) != fmt.Sprint(objs) {
			setProp(s.mgrProps, ManagerIface, "Agents", objs)
		}
	}
	return nil
}

// UpdateAgent refreshes one agent's properties.
func (s *Server) UpdateAgent(st AgentStatus) {
	s.mu.Lock()
	o := s.agents[st.Name]
	s.mu.Unlock()
	if o != nil {
		o.update(st)
	}
}

// scopedSignals are never broadcast (see Emit): an agent's audit signals,
// and a throw-away cage's start and summary (the hosts it was refused).
// The run signals are left out of the bus policy's receive rules: a run's
// owner must get its summary even if dbus-daemon loaded the policy before
// the owner's account existed.
var scopedSignals = append(slices.Clone(paths.BusAuditSignals), SignalRunStarted, SignalRunFinished,
	SignalTurnStarted, SignalTurnFinished, SignalFileTransferred, SignalShellOpened, SignalShellClosed)

// Emit sends a Manager signal. Signals carrying audit data (scopedSignals;
// args[0] is the agent or run) are never broadcast: each goes, addressed,
// to the subscribed callers allowed to view that agent's audit, as
// ReadAudit would decide now (a run is covered by accounts over every
// agent, which its owner, an operator, has). dbus-daemon does not let other
// connections eavesdrop on addressed messages, and the bus policy refuses
// the agent signals to anyone but root and the declared accounts.
func (s *Server) Emit(signal string, args ...any) {
	if !slices.Contains(scopedSignals, signal) {
		if err := s.conn.Emit(Path, ManagerIface+"."+signal, args...); err != nil {
			s.log.Warn("emit signal", "signal", signal, "err", err)
		}
		return
	}
	agent, _ := args[0].(string)
	accounts := s.be.Accounts()
	s.mu.Lock()
	var dests []string
	for name, id := range s.subs {
		if Authorize(accounts, id, ActView, agent) == nil {
			dests = append(dests, name)
		}
	}
	s.mu.Unlock()
	for _, dest := range dests {
		msg := &dbus.Message{Type: dbus.TypeSignal, Headers: map[dbus.HeaderField]dbus.Variant{
			dbus.FieldPath:        dbus.MakeVariant(Path),
			dbus.FieldInterface:   dbus.MakeVariant(ManagerIface),
			dbus.FieldMember:      dbus.MakeVariant(signal),
			dbus.FieldDestination: dbus.MakeVariant(dest),
			dbus.FieldSignature:   dbus.MakeVariant(dbus.SignatureOf(args...)),
		}, Body: args}
		if call := s.conn.Send(msg, nil); call.Err != nil {
			s.log.Warn("send signal", "signal", signal, "to", dest, "err", call.Err)
		}
	}
}

// watchSubscribers forgets a subscriber when its connection goes away.
func (s *Server) watchSubscribers() error {
	if err := s.conn.AddMatchSignal(dbus.WithMatchSender("org.freedesktop.DBus"), dbus.WithMatchInterface("org.freedesktop.DBus"),
		dbus.WithMatchMember("NameOwnerChanged")); err != nil {
		return fmt.Errorf("watch bus names: %w", err)
	}
	ch := make(chan *dbus.Signal, 256)
	s.conn.Signal(ch)
	go func() {
		for sig := range ch {
			if sig.Name != "org.freedesktop.DBus.NameOwnerChanged" || len(sig.Body) != 3 {
				continue
			}
			name, _ := sig.Body[0].(string)
			owner, _ := sig.Body[2].(string)
			if owner == "" {
				s.mu.Lock()
				delete(s.subs, name)
				delete(s.uids, name)
				for c := range s.calls[name] {
					c.cancel()
				}
				delete(s.calls, name)
				s.mu.Unlock()
			}
		}
	}()
	return nil
}

// callerContext is a context for a long call that ends when sender leaves
// the bus (its connection closed: cagectl interrupted, a relay restarted),
// so caged does not go on with work nobody waits for. cancel releases it.
func (s *Server) callerContext(sender dbus.Sender) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithCancel(context.Background())
	c := &callerCall{cancel: cancel}
	s.mu.Lock()
	if s.calls[string(sender)] == nil {
		s.calls[string(sender)] = map[*callerCall]bool{}
	}
	s.calls[string(sender)][c] = true
	s.mu.Unlock()
	// The caller may have left before the entry existed.
	var has bool
	if err := s.conn.BusObject().Call("org.freedesktop.DBus.NameHasOwner", 0, string(sender)).Store(&has); err == nil && !has {
		cancel()
	}
	return ctx, func() {
		cancel()
		s.mu.Lock()
		delete(s.calls[string(sender)], c)
		if len(s.calls[string(sender)]) == 0 {
			delete(s.calls, string(sender))
		}
		s.mu.Unlock()
	}
}

// subscribe records sender as a receiver of audit signals.
func (s *Server) subscribe(sender dbus.Sender) *dbus.Error {
	id, err := s.caller(sender)
	if err != nil {
		return newError(ErrorAccessDenied, "%v", err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.subs[string(sender)]; !ok && len(s.subs) >= maxSubscribers {
		return newError(ErrorFailed, "too many subscribers (%d); try again later", maxSubscribers)
	}
	s.subs[string(sender)] = id
	return nil
}

func agentProps(st AgentStatus) map[string]*prop.Prop {
	v := agentValues(st)
	m := make(map[string]*prop.Prop, len(v))
	for k, x := range v {
		emit := prop.EmitTrue
		if k == "Name" || k == "Backend" || k == "Unit" || k == "RunBy" {
			emit = prop.EmitConst
		}
		m[k] = &prop.Prop{Value: x, Emit: emit}
	}
	return m
}

func agentValues(st AgentStatus) map[string]any {
	return map[string]any{
		"Name": st.Name, "Backend": st.Backend, "Unit": st.Unit,
		"LoadState": st.LoadState, "ActiveState": st.ActiveState, "SubState": st.SubState,
		"EgressState": st.EgressState, "Autostart": st.Autostart,
		"Quarantined": st.Quarantined, "QuarantineReason": st.QuarantineReason, "Generation": st.Generation,
		"EgressAllowed": st.Allowed, "EgressFlagged": st.Flagged, "EgressBlocked": st.Blocked,
		"RunBy": st.RunBy,
	}
}

// caller resolves the identity behind a unique bus name.
func (s *Server) caller(sender dbus.Sender) (Identity, error) {
	s.mu.Lock()
	uid, ok := s.uids[string(sender)]
	s.mu.Unlock()
	if !ok {
		if err := s.conn.BusObject().Call("org.freedesktop.DBus.GetConnectionUnixUser", 0, string(sender)).Store(&uid); err != nil {
			return Identity{}, fmt.Errorf("cannot identify caller %s: %w", sender, err)
		}
		s.mu.Lock()
		if len(s.uids) > 4096 {
			s.uids = map[string]uint32{}
		}
		s.uids[string(sender)] = uid
		s.mu.Unlock()
	}
	return s.users.Lookup(uid), nil
}

// authorize checks an appliance-wide call and logs refusals.
func (s *Server) authorize(sender dbus.Sender, act Action, method string) (Identity, *dbus.Error) {
	return s.check(sender, act, "", method)
}

// authorizeAgent checks a call on one agent. The agent must be declared,
// whatever the caller: an empty or unknown name is refused here, before
// the role check (which would read "" as "every agent").
func (s *Server) authorizeAgent(sender dbus.Sender, act Action, agent, method string) (Identity, *dbus.Error) {
	if agent == "" {
		return Identity{}, newError(ErrorNoSuchAgent, "%s needs an agent name (cagectl status lists them)", method)
	}
	if !s.be.HasAgent(agent) {
		return Identity{}, newError(ErrorNoSuchAgent, "no agent named %q is declared (cagectl status lists them)", agent)
	}
	return s.check(sender, act, agent, method)
}

func (s *Server) check(sender dbus.Sender, act Action, agent, method string) (Identity, *dbus.Error) {
	id, err := s.caller(sender)
	if err != nil {
		s.log.Warn("refused call", "method", method, "sender", string(sender), "err", err)
		return id, newError(ErrorAccessDenied, "%v", err)
	}
	if err := Authorize(s.be.Accounts(), id, act, agent); err != nil {
		s.log.Warn("refused call", "method", method, "uid", id.UID, "user", id.User, "agent", agent, "err", err)
		return id, newError(ErrorAccessDenied, "%v", err)
	}
	return id, nil
}

// fail maps a backend error to a D-Bus error.
func fail(err error) *dbus.Error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, ErrNoSuchAgent):
		return newError(ErrorNoSuchAgent, "%v", err)
	case errors.Is(err, ErrInvalid):
		return newError(ErrorInvalid, "%v", err)
	case errors.Is(err, ErrIsQuarantined):
		return newError(ErrorQuarantined, "%v", err)
	case errors.Is(err, ErrIO):
		return newError(ErrorIO, "%v", err)
	case errors.Is(err, ErrBusy):
		return newError(ErrorBusy, "%v", err)
	}
	return newError(ErrorFailed, "%v", err)
}

// manager carries exactly the Manager's D-Bus methods.
type manager struct{ s *Server }

func (m *manager) GetStatus() (Status, *dbus.Error) {
	st, err := m.s.be.Status(context.Background())
	if err != nil {
		return Status{}, fail(err)
	}
	return *st, nil
}

func (m *manager) ListAgents() ([]AgentStatus, *dbus.Error) {
	st, err := m.s.be.Status(context.Background())
	if err != nil {
		return nil, fail(err)
	}
	return st.Agents, nil
}

func (m *manager) GetAgent(name string) (dbus.ObjectPath, *dbus.Error) {
	if !m.s.be.HasAgent(name) {
		return "", newError(ErrorNoSuchAgent, "no agent named %q is declared", name)
	}
	return AgentPath(name), nil
}

func (m *manager) control(sender dbus.Sender, method, agent string, f func(ctx context.Context, agent, by string) error) *dbus.Error {
	id, derr := m.s.authorizeAgent(sender, ActOperate, agent, method)
	if derr != nil {
		return derr
	}
	return fail(f(context.Background(), agent, id.String()))
}

func (m *manager) StartAgent(sender dbus.Sender, name string) *dbus.Error {
	return m.control(sender, "StartAgent", name, m.s.be.Start)
}

func (m *manager) StopAgent(sender dbus.Sender, name string) *dbus.Error {
	return m.control(sender, "StopAgent", name, m.s.be.Stop)
}

func (m *manager) RestartAgent(sender dbus.Sender, name string) *dbus.Error {
	return m.control(sender, "RestartAgent", name, m.s.be.Restart)
}

func (m *manager) KillAgent(sender dbus.Sender, name string) *dbus.Error {
	return m.control(sender, "KillAgent", name, m.s.be.Kill)
}

func (m *manager) QuarantineAgent(sender dbus.Sender, name, reason string) (string, *dbus.Error) {
	id, derr := m.s.authorizeAgent(sender, ActOperate, name, "QuarantineAgent")
	if derr != nil {
		return "", derr
	}
	if strings.TrimSpace(reason) == "" {
		return "", newError(ErrorInvalid, "quarantine needs a reason (it is recorded with the evidence)")
	}
	ev, err := m.s.be.Quarantine(context.Background(), name, reason, id.String())
	return ev, fail(err)
}

// Subscribe asks for caged's signals addressed to the caller: those that
// carry audit data arrive only this way, and only for agents whose audit
// the caller may read. Anyone may subscribe; the subscription ends with
// the caller's connection or Unsubscribe.
func (m *manager) Subscribe(sender dbus.Sender) *dbus.Error {
	return m.s.subscribe(sender)
}

// Unsubscribe ends the caller's subscription.
func (m *manager) Unsubscribe(sender dbus.Sender) *dbus.Error {
	m.s.mu.Lock()
	delete(m.s.subs, string(sender))
	m.s.mu.Unlock()
	return nil
}

func (m *manager) ReleaseAgent(sender dbus.Sender, name string) *dbus.Error {
	return m.control(sender, "ReleaseAgent", name, m.s.be.Release)
}

func (m *manager) ReadAudit(sender dbus.Sender, name string, offset int64, max uint32) ([]string, int64, *dbus.Error) {
	if _, derr := m.s.authorizeAgent(sender, ActView, name, "ReadAudit"); derr != nil {
		return nil, 0, derr
	}
	lines, next, err := m.s.be.ReadAudit(context.Background(), name, offset, max)
	if lines == nil {
		lines = []string{}
	}
	return lines, next, fail(err)
}

func (m *manager) Apply(sender dbus.Sender, source string) (ApplyResult, *dbus.Error) {
	id, derr := m.s.authorize(sender, ActAdmin, "Apply")
	if derr != nil {
		return ApplyResult{}, derr
	}
	res, err := m.s.be.Apply(m.s.progressTo(context.Background(), sender), source, id.String())
	if err != nil {
		return ApplyResult{}, fail(err)
	}
	return *res, nil
}

func (m *manager) Rollback(sender dbus.Sender, to uint64, force bool) (uint64, uint64, *dbus.Error) {
	id, derr := m.s.authorize(sender, ActAdmin, "Rollback")
	if derr != nil {
		return 0, 0, derr
	}
	from, now, err := m.s.be.Rollback(context.Background(), to, force, id.String())
	return from, now, fail(err)
}

func (m *manager) ListGenerations() ([]Generation, *dbus.Error) {
	gens, err := m.s.be.Generations(context.Background())
	if gens == nil {
		gens = []Generation{}
	}
	return gens, fail(err)
}

func (m *manager) Reload(sender dbus.Sender) *dbus.Error {
	id, derr := m.s.authorize(sender, ActAdmin, "Reload")
	if derr != nil {
		return derr
	}
	return fail(m.s.be.Reload(context.Background(), id.String()))
}

// agentObject carries exactly the Agent interface's D-Bus methods.
type agentObject struct {
	s     *Server
	name  string
	props *prop.Properties
	mu    sync.Mutex
}

func (o *agentObject) update(st AgentStatus) {
	o.mu.Lock()
	defer o.mu.Unlock()
	for k, v := range agentValues(st) {
		if k == "Name" || k == "Backend" || k == "Unit" || k == "RunBy" {
			continue
		}
		setIfChanged(o.props, AgentIface, k, v)
	}
}

func (o *agentObject) Start(sender dbus.Sender) *dbus.Error {
	return (&manager{o.s}).StartAgent(sender, o.name)
}

func (o *agentObject) Stop(sender dbus.Sender) *dbus.Error {
	return (&manager{o.s}).StopAgent(sender, o.name)
}

func (o *agentObject) Restart(sender dbus.Sender) *dbus.Error {
	return (&manager{o.s}).RestartAgent(sender, o.name)
}

func (o *agentObject) Kill(sender dbus.Sender) *dbus.Error {
	return (&manager{o.s}).KillAgent(sender, o.name)
}

func (o *agentObject) Quarantine(sender dbus.Sender, reason string) (string, *dbus.Error) {
	return (&manager{o.s}).QuarantineAgent(sender, o.name, reason)
}

func (o *agentObject) Release(sender dbus.Sender) *dbus.Error {
	return (&manager{o.s}).ReleaseAgent(sender, o.name)
}

func (o *agentObject) ReadAudit(sender dbus.Sender, offset int64, max uint32) ([]string, int64, *dbus.Error) {
	return (&manager{o.s}).ReadAudit(sender, o.name, offset, max)
}

// introspector serves org.freedesktop.DBus.Introspectable from a function,
// so child nodes follow the agents as they come and go.
type introspector func() string

func (f introspector) Introspect() (string, *dbus.Error) { return f(), nil }

// Argument names for introspection; signatures come from the Go methods
// themselves (introspect.Methods), so they cannot drift.
var argNames = map[string][]string{
	"GetStatus":       {"status"},
	"ListAgents":      {"agents"},
	"GetAgent":        {"name", "agent"},
	"StartAgent":      {"name"},
	"StopAgent":       {"name"},
	"RestartAgent":    {"name"},
	"KillAgent":       {"name"},
	"QuarantineAgent": {"name", "reason", "evidence"},
	"ReleaseAgent":    {"name"},
	"ReadAudit":       {"name", "offset", "max", "records", "next_offset"},
	"Apply":           {"source", "result"},
	"Rollback":        {"to", "force", "from", "now"},
	"ListGenerations": {"generations"},
	"Quarantine":      {"reason", "evidence"},
	"StartRun":        {"request", "stdin", "stdout", "stderr", "binds", "secrets", "name"},
	"AttachConsole":   {"name", "console"},
	"ResizeConsole":   {"name", "rows", "cols"},
	"SignalRun":       {"name", "signal"},
	"OpenShell":       {"request", "stdin", "stdout", "stderr", "unit"},
	"TurnAgent":       {"name", "text", "reply", "status", "exit_status"},
	"Turn":            {"text", "reply", "status", "exit_status"},
	"GetAgentFile":    {"name", "path", "max_bytes", "fd", "size"},
	"GetFile":         {"path", "max_bytes", "fd", "size"},
	"PutAgentFile":    {"agent", "name", "fd", "saved_path"},
	"PutFile":         {"name", "fd", "saved_path"},
}

func methods(v any, agentScoped bool) []introspect.Method {
	ms := introspect.Methods(v)
	for i := range ms {
		names := argNames[ms[i].Name]
		if agentScoped && ms[i].Name == "ReadAudit" {
			names = names[1:]
		}
		for j := range ms[i].Args {
			if j < len(names) {
				ms[i].Args[j].Name = names[j]
			}
		}
	}
	return ms
}

var managerSignals = []introspect.Signal{
	{Name: SignalAgentStateChanged, Args: []introspect.Arg{{Name: "agent", Type: "s"}, {Name: "active_state", Type: "s"}, {Name: "sub_state", Type: "s"}}},
	{Name: SignalEgressDecision, Args: []introspect.Arg{{Name: "agent", Type: "s"}, {Name: "decision", Type: "s"}, {Name: "host", Type: "s"}, {Name: "reason", Type: "s"}, {Name: "record", Type: "s"}}},
	{Name: SignalReleaseApplied, Args: []introspect.Arg{{Name: "generation", Type: "t"}, {Name: "previous", Type: "t"}, {Name: "by", Type: "s"}}},
	{Name: SignalAgentQuarantined, Args: []introspect.Arg{{Name: "agent", Type: "s"}, {Name: "reason", Type: "s"}, {Name: "evidence", Type: "s"}, {Name: "by", Type: "s"}}},
	{Name: SignalAgentReleased, Args: []introspect.Arg{{Name: "agent", Type: "s"}, {Name: "by", Type: "s"}}},
	{Name: SignalAgentKilled, Args: []introspect.Arg{{Name: "agent", Type: "s"}, {Name: "by", Type: "s"}}},
	{Name: SignalReconciled, Args: []introspect.Arg{{Name: "error", Type: "s"}}},
	{Name: SignalEgressFailed, Args: []introspect.Arg{{Name: "agent", Type: "s"}, {Name: "reason", Type: "s"}, {Name: "recover", Type: "s"}}},
	{Name: SignalRunStarted, Args: []introspect.Arg{{Name: "name", Type: "s"}, {Name: "backend", Type: "s"}, {Name: "by", Type: "s"}}},
	{Name: SignalRunFinished, Args: []introspect.Arg{{Name: "name", Type: "s"}, {Name: "exit_status", Type: "i"}, {Name: "summary", Type: "s"}}},
	{Name: SignalShellOpened, Args: []introspect.Arg{{Name: "agent", Type: "s"}, {Name: "by", Type: "s"}, {Name: "command", Type: "s"}, {Name: "unit", Type: "s"}}},
	{Name: SignalShellClosed, Args: []introspect.Arg{{Name: "agent", Type: "s"}, {Name: "by", Type: "s"}, {Name: "exit_status", Type: "i"}, {Name: "unit", Type: "s"}}},
	{Name: SignalTurnStarted, Args: []introspect.Arg{{Name: "agent", Type: "s"}, {Name: "by", Type: "s"}}},
	{Name: SignalTurnFinished, Args: []introspect.Arg{{Name: "agent", Type: "s"}, {Name: "by", Type: "s"}, {Name: "status", Type: "s"}, {Name: "exit_status", Type: "i"}, {Name: "duration_ms", Type: "t"}}},
	{Name: SignalFileTransferred, Args: []introspect.Arg{{Name: "agent", Type: "s"}, {Name: "op", Type: "s"}, {Name: "path", Type: "s"}, {Name: "bytes", Type: "t"}, {Name: "outcome", Type: "s"}, {Name: "by", Type: "s"}}},
}

// introspectSignal is a signal with "name:type" arguments.
func introspectSignal(name string, args ...string) introspect.Signal {
	sig := introspect.Signal{Name: name}
	for _, a := range args {
		n, t, _ := strings.Cut(a, ":")
		sig.Args = append(sig.Args, introspect.Arg{Name: n, Type: t})
	}
	return sig
}

func (s *Server) introspect(path string) string {
	n := &introspect.Node{}
	child := func(names ...string) {
		for _, c := range names {
			n.Children = append(n.Children, introspect.Node{Name: c})
		}
	}
	switch {
	case path == "/":
		child("org")
	case path == "/org":
		child("nixcage")
	case path == "/org/nixcage":
		child("cage1")
	case path == paths.BusPath:
		child("agent")
		n.Interfaces = append(n.Interfaces, introspect.Interface{
			Name: ManagerIface, Methods: methods(&manager{}, false), Signals: managerSignals,
			Properties: s.mgrProps.Introspection(ManagerIface),
		}, prop.IntrospectData)
	case path == paths.AgentPath:
		s.mu.Lock()
		names := make([]string, 0, len(s.agents))
		for name := range s.agents {
			names = append(names, strings.TrimPrefix(string(AgentPath(name)), paths.AgentPath+"/"))
		}
		s.mu.Unlock()
		sort.Strings(names)
		child(names...)
	default:
		s.mu.Lock()
		var o *agentObject
		for name, a := range s.agents {
			if string(AgentPath(name)) == path {
				o = a
			}
		}
		s.mu.Unlock()
		if o != nil {
			n.Interfaces = append(n.Interfaces, introspect.Interface{
				Name: AgentIface, Methods: methods(&agentObject{}, true),
				Properties: o.props.Introspection(AgentIface),
			}, prop.IntrospectData)
		}
	}
	n.Interfaces = append(n.Interfaces, introspect.IntrospectData, introspect.PeerData)
	for i := range n.Interfaces {
		sort.Slice(n.Interfaces[i].Properties, func(a, b int) bool {
			return n.Interfaces[i].Properties[a].Name < n.Interfaces[i].Properties[b].Name
		})
	}
	b, err := xml.MarshalIndent(n, "", "  ")
	if err != nil {
		return ""
	}
	return strings.TrimSpace(introspect.IntrospectDeclarationString) + "\n" + string(b) + "\n"
}
