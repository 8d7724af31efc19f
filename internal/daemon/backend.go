package daemon

import (
	"context"
	"errors"
	"fmt"
	"github.com/nixcage/nixcage/internal/events"
	"os"
	"path/filepath"
	"syscall"

	"github.com/nixcage/nixcage/internal/auditlog"
	"github.com/nixcage/nixcage/internal/bus"
	"github.com/nixcage/nixcage/internal/config"
	"github.com/nixcage/nixcage/internal/paths"
	"github.com/nixcage/nixcage/internal/quarantine"
	"github.com/nixcage/nixcage/internal/release"
	"github.com/nixcage/nixcage/internal/store"
	"github.com/nixcage/nixcage/internal/version"
)

var _ bus.Backend = (*Daemon)(nil)

// Accounts implements bus.Backend.
func (d *Daemon) Accounts() []*config.Account { return d.config().Accounts }

// HasAgent implements bus.Backend: declared agents and running throw-away
// cages (which may be stopped, killed and audited like agents).
func (d *Daemon) HasAgent(agent string) bool {
	return d.config().Agent(agent) != nil || d.runByName(agent) != nil
}

// refuseRun refuses what only makes sense for a declared agent.
func (d *Daemon) refuseRun(agent, what string) error {
	if d.runByName(agent) != nil {
		return fmt.Errorf("%w: %s is a throw-away cage (cagectl run); it cannot be %s, only stopped or killed", bus.ErrInvalid, agent, what)
	}
	return nil
}

// Status answers from caged's cache of unit states (kept current by
// systemd's PropertiesChanged signals and refreshed after every operation
// and every stateRefresh), so reading status costs no call to systemd.
func (d *Daemon) Status(ctx context.Context) (*bus.Status, error) {
	cfg := d.config()
	gen, channel := d.storeCurrent()
	d.mu.RLock()
	st := &bus.Status{
		Version: version.Version, Mode: d.o.Units, Config: d.o.Config, Generation: gen, Channel: channel,
		StartedUnix: d.started.Unix(), ReconciledUnix: unix(d.reconciled), ReconcileError: d.reconcileErr,
		Agents: make([]bus.AgentStatus, 0, len(cfg.Agents)),
	}
	d.mu.RUnlock()
	st.ChannelPoll = d.channelStatus(gen)
	fr := d.storeFreshness()
	st.Freshness, st.FreshnessMessage = fr.State, fr.Message()
	if !fr.Expires.IsZero() {
		st.GenerationExpiresUnix = fr.Expires.Unix()
	}
	if d.srv != nil {
		// Status runs every stateRefresh too, so the properties follow the
		// clock, not only applies.
		d.srv.SetFreshness(st.GenerationExpiresUnix, st.Freshness)
	}
	marks, err := quarantine.List(d.qdirs)
	if err != nil {
		return nil, err
	}
	for _, a := range cfg.Agents {
		st.Agents = append(st.Agents, d.agentStatusWith(a, marks[a.Name]))
	}
	st.Agents = append(st.Agents, d.runStatuses()...)
	// A bans file caged cannot read is logged, not a failed status: the
	// gateways keep the bans they last loaded (egress/bans.go).
	if st.Bans, err = d.readBans(); err != nil {
		d.log.Warn("status: bans file unreadable", "file", d.bansFile(), "err", err)
	}
	return st, nil
}

func (d *Daemon) agentStatus(a *config.Agent) bus.AgentStatus {
	m, _ := quarantine.Read(d.qdirs, a.Name)
	return d.agentStatusWith(a, m)
}

func (d *Daemon) agentStatusWith(a *config.Agent, m *quarantine.Mark) bus.AgentStatus {
	unit := paths.Instance(paths.AgentTemplate, a.Name)
	as := bus.AgentStatus{Name: a.Name, Backend: a.Backend, Unit: unit, Autostart: a.Autostart}
	if m != nil {
		as.Quarantined, as.QuarantineReason = true, m.Reason
	}
	if d.audit != nil {
		as.Allowed, as.Flagged, as.Blocked = d.audit.counts(a.Name)
	}
	if a.Learn != nil {
		as.LearnUntilUnix = d.learnUntil(a.Name)
	}
	d.mu.RLock()
	s := d.states[unit]
	as.LoadState, as.ActiveState, as.SubState = s.Load, s.Active, s.Sub
	as.EgressState = d.states[paths.Instance(paths.EgressTemplate, a.Name)].Active
	if f := d.egressFail[a.Name]; f != "" {
		as.EgressState = f
	}
	if s.Running() {
		as.Generation = d.agentGen[a.Name]
	}
	d.mu.RUnlock()
	return as
}

// refreshStates reads the units of agents (all when none given) from
// systemd into the cache.
func (d *Daemon) refreshStates(ctx context.Context, agents ...string) error {
	if len(agents) == 0 {
		for _, a := range d.config().Agents {
			agents = append(agents, a.Name)
		}
	}
	names := make([]string, 0, 3*len(agents))
	for _, a := range agents {
		svc, sock := egressUnits(a)
		names = append(names, paths.Instance(paths.AgentTemplate, a), svc, sock)
	}
	states, err := d.units.States(ctx, names)
	if err != nil {
		return err
	}
	for _, a := range agents {
		d.noteEgress(a, d.egressFailure(ctx, a, states))
	}
	type change struct{ agent, active, sub string }
	var changed []change
	d.mu.Lock()
	for n, s := range states {
		prev, known := d.states[n]
		d.states[n] = s
		if a, ok := agentOfUnit(n); ok && n == paths.Instance(paths.AgentTemplate, a) && known && (prev.Active != s.Active || prev.Sub != s.Sub) {
			changed = append(changed, change{a, s.Active, s.Sub})
		}
	}
	d.mu.Unlock()
	// Whichever learns of a transition first, this read or systemd's
	// signal, reports it; the cache makes the other one a no-op.
	if d.srv != nil {
		for _, c := range changed {
			d.emit(bus.SignalAgentStateChanged, c.agent, c.active, c.sub)
		}
	}
	return nil
}

// Agent is one agent's status, read fresh from systemd.
func (d *Daemon) Agent(ctx context.Context, name string) (*bus.AgentStatus, error) {
	a := d.config().Agent(name)
	if a == nil {
		return nil, fmt.Errorf("%w: %q", bus.ErrNoSuchAgent, name)
	}
	if err := d.refreshStates(ctx, name); err != nil {
		return nil, err
	}
	st := d.agentStatus(a)
	return &st, nil
}

func unix(t interface{ Unix() int64 }) int64 { return t.Unix() }

func (d *Daemon) refuseQuarantined(agent string) error {
	if m, _ := quarantine.Read(d.qdirs, agent); m != nil {
		return fmt.Errorf("%w: %s was quarantined at %s by %s (%s); inspect %s, then `cagectl release %s`",
			bus.ErrIsQuarantined, agent, m.At.Format("2006-01-02 15:04:05Z07:00"), m.By, m.Reason, m.Evidence, agent)
	}
	return nil
}

func (d *Daemon) refresh(ctx context.Context, agent string) {
	if st, err := d.Agent(ctx, agent); err == nil {
		d.srv.UpdateAgent(*st)
	}
}

// Start starts an agent (its namespace, gateway sockets and prepare step
// come with it through Requires=).
func (d *Daemon) Start(ctx context.Context, agent, by string) error {
	if err := d.refuseRun(agent, "started again"); err != nil {
		return err
	}
	if a := d.config().Agent(agent); a != nil && a.Interactive {
		if err := d.ensureConsole(agent); err != nil {
			return err
		}
	}
	if err := d.refuseQuarantined(agent); err != nil {
		return err
	}
	unit := paths.Instance(paths.AgentTemplate, agent)
	// A unit that hit its start limit stays failed until reset; an operator
	// asking for a start means it.
	_ = d.sd.ResetFailedUnitContext(ctx, unit)
	d.log.Info("start agent", "agent", agent, "by", by)
	err := d.units.Start(ctx, unit)
	if err != nil {
		if a := d.config().Agent(agent); a != nil {
			err = fmt.Errorf("%w%s", err, d.secretHint(ctx, a))
		}
	} else {
		gen, _ := d.storeCurrent()
		d.mu.Lock()
		d.agentGen[agent] = gen
		d.mu.Unlock()
	}
	d.refresh(ctx, agent)
	return err
}

// Stop stops an agent.
func (d *Daemon) Stop(ctx context.Context, agent, by string) error {
	d.log.Info("stop agent", "agent", agent, "by", by)
	err := d.units.Stop(ctx, paths.Instance(paths.AgentTemplate, agent))
	d.refresh(ctx, agent)
	return err
}

// Restart restarts an agent's whole cage: the prepare step re-runs (so a
// changed secret source or placeholder is picked up), the gateway re-reads
// its credentials, and the agent starts again (also if it was down).
func (d *Daemon) Restart(ctx context.Context, agent, by string) error {
	if err := d.refuseRun(agent, "restarted"); err != nil {
		return err
	}
	if err := d.refuseQuarantined(agent); err != nil {
		return err
	}
	d.log.Info("restart agent", "agent", agent, "by", by)
	d.op.Lock()
	err := d.restartCage(ctx, agent, true)
	d.op.Unlock()
	if err != nil {
		if a := d.config().Agent(agent); a != nil {
			err = fmt.Errorf("%w%s", err, d.secretHint(ctx, a))
		}
	} else {
		gen, _ := d.storeCurrent()
		d.mu.Lock()
		d.agentGen[agent] = gen
		d.mu.Unlock()
	}
	d.refresh(ctx, agent)
	return err
}

// Kill sends SIGKILL to every process in the agent's cgroup at once. It is
// audited: logged at warning level and signalled on the bus.
func (d *Daemon) Kill(ctx context.Context, agent, by string) error {
	unit := paths.Instance(paths.AgentTemplate, agent)
	d.log.Warn("kill agent", "agent", agent, "unit", unit, "signal", "SIGKILL", "by", by)
	d.cancelTurn(agent)
	if err := d.units.Kill(ctx, unit, int32(syscall.SIGKILL)); err != nil {
		return err
	}
	d.emit(bus.SignalAgentKilled, agent, by)
	d.refresh(ctx, agent)
	return nil
}

// Quarantine takes the agent out of service and preserves evidence. It
// takes no lock shared with other operations: the exclusive mark keeps two
// quarantines of one agent apart, and a quarantine of another agent (or a
// reconcile) never waits behind this one's evidence copy.
func (d *Daemon) Quarantine(ctx context.Context, agent, reason, by string) (string, error) {
	if err := d.refuseRun(agent, "quarantined (stop or kill it; its audit stays)"); err != nil {
		return "", err
	}
	a := d.config().Agent(agent)
	if a == nil { // removed by a reload since the call was authorized
		return "", fmt.Errorf("%w: %q", bus.ErrNoSuchAgent, agent)
	}
	// A running turn ends too (cutting the egress would stop it anyway:
	// it Requires= the gateway's sockets).
	d.cancelTurn(agent)
	snap, _ := d.Agent(ctx, agent)
	res, err := quarantine.Run(ctx, d.units, d.qdirs, quarantine.Request{
		Agent: agent, Reason: reason, By: by, Workspace: a.Workspace, Status: snap, Log: d.log,
		// The config's evidence block, as of this quarantine (a reload
		// applies to the next one).
		Limits: quarantine.Limits(d.config().Evidence),
		Contained: func() {
			d.log.Warn("agent contained: stopped, egress cut; copying evidence", "agent", agent)
			if d.o.Contained != nil {
				d.o.Contained(agent)
			}
		},
	})
	if errors.Is(err, quarantine.ErrAlreadyQuarantined) {
		return "", fmt.Errorf("%w: %v", bus.ErrIsQuarantined, err)
	}
	evidence := ""
	if res != nil && res.Evidence != nil {
		evidence = res.Evidence.Dir
	}
	if res != nil {
		d.emit(bus.SignalAgentQuarantined, agent, reason, evidence, by)
	}
	d.refresh(ctx, agent)
	return evidence, err
}

// Release lifts a quarantine. The agent stays down until started.
func (d *Daemon) Release(ctx context.Context, agent, by string) error {
	m, err := quarantine.Release(d.qdirs, agent)
	if err != nil {
		return fmt.Errorf("%w: %v", bus.ErrInvalid, err)
	}
	d.log.Warn("agent released from quarantine", "agent", agent, "by", by, "quarantined_by", m.By, "reason", m.Reason, "evidence", m.Evidence)
	d.emit(bus.SignalAgentReleased, agent, by)
	d.refresh(ctx, agent)
	return nil
}

// Reload re-reads the configuration and reconciles. An invalid config is
// refused and the running one kept.
func (d *Daemon) Reload(ctx context.Context, by string) error {
	cfg, err := d.loadConfig()
	if err != nil {
		d.log.Error("reload refused", "by", by, "err", err)
		return fmt.Errorf("%w: %v (the running configuration is unchanged)", bus.ErrInvalid, err)
	}
	d.mu.Lock()
	d.cfg = cfg
	d.mu.Unlock()
	d.log.Info("reload", "by", by, "agents", len(cfg.Agents))
	d.ensureConsoles()
	err = d.reconcile(ctx, "reload by "+by)
	d.publishAgents(ctx)
	gen, channel := d.storeCurrent()
	d.srv.SetManager(gen, channel, d.reconcileErrString())
	return err
}

// ReadAudit returns complete audit records of agent from offset on. A
// negative offset means "the newest max records".
func (d *Daemon) ReadAudit(ctx context.Context, agent string, offset int64, max uint32) ([]string, int64, error) {
	if max == 0 || max > 10000 {
		max = 10000
	}
	return auditlog.Read(d.qdirs.AuditFile(agent), offset, int(max))
}

// openStore opens the shared store as the config declares it.
func (d *Daemon) openStore(readOnly bool, progress ...func(store.Progress)) (*store.Store, error) {
	sc := d.config().Store
	if sc == nil {
		return nil, errNoStore
	}
	if !readOnly {
		// The store's parent is caged's StateDirectory on a real host; make
		// sure it exists wherever the store root was declared.
		if err := os.MkdirAll(filepath.Dir(d.qdirs.Host(sc.Root)), 0o755); err != nil {
			return nil, fmt.Errorf("store: %w", err)
		}
	}
	keys := make([]string, len(sc.Keys))
	for i, k := range sc.Keys {
		keys[i] = d.qdirs.Host(k)
	}
	rootKeys := make([]string, len(sc.RootKeys))
	for i, k := range sc.RootKeys {
		rootKeys[i] = d.qdirs.Host(k)
	}
	o := store.Options{
		Root: d.qdirs.Host(sc.Root), Channel: sc.Channel, TrustedKeys: keys, NixPublicKeys: sc.NixKeys,
		Threshold: sc.Threshold, Keep: sc.Generations, Logger: d.log, ReadOnly: readOnly,
		ExpiryWarning: sc.ExpiryWarning, RootKeyFiles: rootKeys, RootThreshold: sc.RootThreshold,
	}
	if len(progress) > 0 {
		o.Progress = progress[0]
	}
	return store.Open(o)
}

// storeCurrent is the generation in use and its channel (0, "" if none).
func (d *Daemon) storeCurrent() (uint64, string) {
	sc := d.config().Store
	if sc == nil {
		return 0, ""
	}
	s, err := d.openStore(true)
	if err != nil {
		return 0, sc.Channel
	}
	n, err := s.Current()
	if err != nil {
		return 0, sc.Channel
	}
	return n, sc.Channel
}

// storeFreshness is the current generation's expiry state.
func (d *Daemon) storeFreshness() store.Freshness {
	s, err := d.openStore(true)
	if err != nil {
		return store.Freshness{State: store.FreshNone}
	}
	f, err := s.Freshness()
	if err != nil {
		d.log.Warn("store freshness", "err", err)
	}
	return f
}

// Apply verifies a release and makes it current. Running agents keep the
// generation they started with until restarted; status shows which.
func (d *Daemon) Apply(ctx context.Context, source, by string) (*bus.ApplyResult, error) {
	d.lockOp()
	defer d.op.Unlock()
	var progress func(store.Progress)
	if f := bus.ProgressFrom(ctx); f != nil { // the caller sees how far it is
		progress = func(p store.Progress) {
			f(bus.ApplyProgress{Phase: p.Phase, Done: uint64(p.Done), Total: uint64(p.Total), Bytes: p.Bytes, TotalBytes: p.TotalBytes})
		}
	}
	if d.config().Store == nil {
		return nil, errNoStore
	}
	src, err := release.NewSource(source)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", bus.ErrInvalid, err)
	}
	res, err := d.applySource(ctx, src, by, progress)
	if err != nil {
		return nil, d.storeFailure("apply", source, by, err)
	}
	warnings := res.Warnings
	if warnings == nil {
		warnings = []string{}
	}
	return &bus.ApplyResult{Generation: res.Generation, Previous: res.Previous, Channel: res.Channel, Top: res.Top,
		Added: uint32(res.Added), Reused: uint32(res.Reused), Bytes: res.Bytes, Warnings: warnings}, nil
}

// applySource applies the release at src and announces it (log, signal,
// journal, properties); a failure is returned as the store reported it,
// for the caller to pass to storeFailure. The caller holds d.op.
func (d *Daemon) applySource(ctx context.Context, src release.Source, by string, progress ...func(store.Progress)) (*store.Result, error) {
	s, err := d.openStore(false, progress...)
	if err != nil {
		return nil, err
	}
	d.log.Info("apply release", "source", src.String(), "by", by)
	res, err := s.Apply(ctx, src)
	if err != nil {
		return nil, err
	}
	d.log.Warn("release applied", "generation", res.Generation, "previous", res.Previous, "top", res.Top, "by", by)
	for _, w := range res.Warnings {
		d.log.Warn("release applied with a problem after the switch", "generation", res.Generation, "by", by, "warning", w)
	}
	d.noteApplied()
	d.emit(bus.SignalReleaseApplied, res.Generation, res.Previous, by)
	d.srv.SetManager(res.Generation, res.Channel, d.reconcileErrString())
	return res, nil
}

// ioFailure is a store error that the bus reports as bus.ErrIO, with the
// store's own message.
type ioFailure struct{ error }

func (e ioFailure) Is(target error) bool { return target == bus.ErrIO }
func (e ioFailure) Unwrap() error        { return e.error }

// storeFailure logs a failed store operation for what it was (a release
// refused by policy, or this machine's disk failing) and marks I/O
// failures so the bus reports them as such.
func (d *Daemon) storeFailure(op, source, by string, err error) error {
	var ref *release.Refusal
	var se *store.StorageError
	switch {
	case errors.As(err, &ref):
		d.log.Error("release refused", "op", op, "source", source, "by", by, "err", err)
		d.journal(events.ReleaseRefused, map[string]string{"NIXCAGE_OP": op, "NIXCAGE_SOURCE": source, "NIXCAGE_BY": by, "NIXCAGE_REASON": err.Error()})
	case errors.As(err, &se):
		d.log.Error("store I/O failure; the previous generation is still current", "op", op, "source", source, "by", by, "err", err)
		return ioFailure{err}
	default:
		d.log.Error("store operation failed", "op", op, "source", source, "by", by, "err", err)
	}
	return err
}

// Rollback switches the store to an older kept generation.
func (d *Daemon) Rollback(ctx context.Context, to uint64, force bool, by string) (uint64, uint64, error) {
	d.lockOp()
	defer d.op.Unlock()
	s, err := d.openStore(false)
	if err != nil {
		return 0, 0, err
	}
	if force {
		d.log.Warn("rollback with --force requested", "to", to, "by", by)
	}
	from, now, err := s.Rollback(ctx, to, force)
	if err != nil {
		return 0, 0, d.storeFailure("rollback", "", by, err)
	}
	d.log.Warn("store rolled back", "from", from, "to", now, "forced", force, "by", by)
	d.noteApplied()
	d.emit(bus.SignalReleaseApplied, now, from, by)
	_, channel := d.storeCurrent()
	d.srv.SetManager(now, channel, d.reconcileErrString())
	return from, now, nil
}

// Generations lists the kept generations.
func (d *Daemon) Generations(ctx context.Context) ([]bus.Generation, error) {
	s, err := d.openStore(true)
	if err != nil {
		return nil, err
	}
	gens, err := s.Generations()
	if err != nil {
		return nil, err
	}
	out := make([]bus.Generation, len(gens))
	for i, g := range gens {
		out[i] = bus.Generation{Number: g.Number, Channel: g.Channel, CreatedUnix: g.Created.Unix(), ExpiresUnix: g.Expires.Unix(),
			Top: g.Top, Paths: uint32(g.Paths), Current: g.Current}
	}
	return out, nil
}
