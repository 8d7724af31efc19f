// Package daemon is caged: the small privileged manager that turns the
// declared configuration into running cages (package reconcile), answers
// operators on the system bus (package bus), quarantines agents (package
// quarantine) and applies signed releases to the shared store (package
// store). It is the only package that wires all of them together.
package daemon

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	sddaemon "github.com/coreos/go-systemd/v22/daemon"
	sdbus "github.com/coreos/go-systemd/v22/dbus"
	"github.com/godbus/dbus/v5"

	"github.com/nixcage/nixcage/internal/bus"
	"github.com/nixcage/nixcage/internal/channel"
	"github.com/nixcage/nixcage/internal/config"
	"github.com/nixcage/nixcage/internal/paths"
	"github.com/nixcage/nixcage/internal/quarantine"
	"github.com/nixcage/nixcage/internal/reconcile"
	"github.com/nixcage/nixcage/internal/render"
	"github.com/nixcage/nixcage/internal/version"
)

// Stdio is the daemon's view of its standard streams; logs go to Err.
type Stdio struct {
	In       io.Reader
	Out, Err io.Writer
}

// Options configure a daemon; Run fills them from flags.
type Options struct {
	Config  string // canonical config JSON (or HCL)
	Units   string // reconcile.ModeRender or reconcile.ModeOS
	Bus     string // bus address to serve on; "" = system bus
	Systemd string // bus address where systemd is; "" = system bus
	Root    string // prefix for every host path (tests); "" = "/"
	BinDir  string // where cage-egress lives, for rendered units
	// Users resolves callers; default the host's user database.
	Users bus.UserDB
	// Ready is called once the name is owned and the first reconcile ran.
	Ready func()
	// PollInterval is how often audit logs are read (default 1s).
	PollInterval time.Duration
	// Contained, if set, is called when a quarantined agent is down and
	// cut off, before its evidence is copied (tests order on it).
	Contained func(agent string)
	Log       *slog.Logger
}

// Run is caged's main: it parses args, serves until ctx ends, and returns
// nil on a clean shutdown.
func Run(ctx context.Context, args []string, stdio Stdio) error {
	fs := flag.NewFlagSet("caged", flag.ContinueOnError)
	fs.SetOutput(stdio.Err)
	o := Options{}
	fs.StringVar(&o.Config, "config", filepath.Join(paths.DefaultPrefix, "nixcage", "nixcage.json"), "configuration `FILE` (the canonical JSON cagectl render writes, or HCL)")
	fs.StringVar(&o.Units, "units", reconcile.ModeRender, "who provides unit files: \"render\" (caged renders them into /run) or \"os\" (NixOS or the operator, under /etc)")
	fs.StringVar(&o.Bus, "bus", "", "bus `ADDRESS` to serve on (default: the system bus)")
	fs.StringVar(&o.Systemd, "systemd-bus", "", "bus `ADDRESS` where systemd is reached (default: the system bus)")
	fs.StringVar(&o.Root, "root", "", "prefix every host path with `DIR` (testing only)")
	fs.StringVar(&o.BinDir, "bindir", "", "`DIR` holding cage-egress for rendered units (default: caged's own directory)")
	level := fs.String("log-level", "info", "debug, info, warn or error")
	showVersion := fs.Bool("version", false, "print the version and exit")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *showVersion {
		fmt.Fprintln(stdio.Out, "caged", version.Version)
		return nil
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("caged takes no arguments (got %q); see caged -h", fs.Args())
	}
	var lv slog.Level
	if err := lv.UnmarshalText([]byte(*level)); err != nil {
		return fmt.Errorf("--log-level: %w", err)
	}
	o.Log = slog.New(slog.NewTextHandler(stdio.Err, &slog.HandlerOptions{Level: lv}))
	ctx, stop := signal.NotifyContext(ctx, syscall.SIGTERM, os.Interrupt)
	defer stop()
	return Serve(ctx, o)
}

// Daemon is a running caged.
type Daemon struct {
	o       Options
	log     *slog.Logger
	started time.Time

	sd    *sdbus.Conn
	units reconcile.Units
	rec   *reconcile.Reconciler
	qdirs quarantine.Dirs
	srv   *bus.Server
	conn  *dbus.Conn

	// op serializes operations that change the host: reconcile, quarantine,
	// apply, rollback. Reads never take it. Admin actions take it with
	// lockOp.
	op sync.Mutex
	// chApply cancels the channel apply holding op (nil when none);
	// opWaiting counts operators waiting in lockOp. Both under chMu.
	chMu      sync.Mutex
	chApply   context.CancelFunc
	opWaiting int

	mu             sync.RWMutex
	cfg            *config.Config
	reconciled     time.Time
	reconcileErr   string
	agentGen       map[string]uint64 // store generation an agent started with
	states         map[string]reconcile.State
	egressFail     map[string]string // agent -> why its gateway is down (egress.go)
	audit          *auditTail
	lastGeneration uint64
	lastApply      time.Time       // last apply or rollback by this caged
	runs           map[string]*run // throw-away cages by name
	channel        *channelState   // nil: no channel polled (channel.go)
	// controlFeed, when set, receives each poll's control commands as
	// fetched, unverified (the consumer verifies them; docs/fleet.md).
	controlFeed func(ctx context.Context, cmds []channel.Control)
	consoles    map[string]*console
	shells      map[string]*shell    // open shells by unit (cagectl shell)
	turns       map[string]*turnLane // one queue of turns per agent (turn.go)
	slicesOnce  sync.Once
	ctl         controlState // signed control commands (control.go)
	spareMu     sync.Mutex
	spare       *spare // the next run's namespace, started ahead (spare.go)
	noSpare     bool   // caged is stopping: no more spares
}

// Serve runs caged with o until ctx ends.
func Serve(ctx context.Context, o Options) error {
	if o.Log == nil {
		o.Log = slog.Default()
	}
	if o.Units != reconcile.ModeRender && o.Units != reconcile.ModeOS {
		return fmt.Errorf("--units %q: use %q (caged renders units into /run) or %q (units come from NixOS or /etc)", o.Units, reconcile.ModeRender, reconcile.ModeOS)
	}
	if o.Users == nil {
		o.Users = bus.SystemUsers{}
	}
	if o.PollInterval == 0 {
		o.PollInterval = time.Second
	}
	if o.BinDir == "" {
		if exe, err := os.Executable(); err == nil {
			o.BinDir = filepath.Dir(exe)
		} else {
			o.BinDir = render.DefaultOptions().BinDir
		}
	}
	if o.Units == reconcile.ModeRender {
		// Rendered units and runtime documents are read by dynamic users
		// (the gateway); the unit's UMask=0077 would make their directories
		// unreadable to them. Every file caged writes sets its mode.
		syscall.Umask(0o022)
	}
	d := &Daemon{o: o, log: o.Log, started: time.Now(), qdirs: quarantine.Dirs{Root: o.Root}, agentGen: map[string]uint64{}, states: map[string]reconcile.State{}, egressFail: map[string]string{}}
	cfg, err := d.loadConfig()
	if err != nil {
		return err
	}
	d.cfg = cfg

	if d.sd, err = dialSystemd(ctx, o.Systemd); err != nil {
		return fmt.Errorf("connect to systemd: %w", err)
	}
	defer d.sd.Close()
	d.units = reconcile.Units{SD: d.sd}
	ropts := render.DefaultOptions()
	ropts.Prefix = "/run"
	ropts.BinDir = o.BinDir
	ropts.CagedConfig = o.Config
	d.rec = &reconcile.Reconciler{
		Units: d.units, Mode: o.Units, Root: o.Root, Options: ropts, Log: o.Log,
		Quarantined: func(a string) bool { return quarantine.Quarantined(d.qdirs, a) },
	}

	if d.conn, err = dialBus(ctx, o.Bus); err != nil {
		return fmt.Errorf("connect to the bus: %w", err)
	}
	defer d.conn.Close()
	d.srv = bus.NewServer(d.conn, d, bus.ServerOptions{Users: o.Users, Log: o.Log})

	// Unit state changes become properties and signals. The watcher runs
	// from here on, so the first reconcile's changes are seen too.
	updates := make(chan *sdbus.PropertiesUpdate, 4096)
	subErrs := make(chan error, 16)
	d.sd.SetPropertiesSubscriber(updates, subErrs)
	if err := d.sd.Subscribe(); err != nil {
		d.log.Warn("subscribe to systemd", "err", err)
	}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); d.watchUnits(ctx, updates, subErrs) }()

	// First reconcile before taking the name: when systemd sees caged ready
	// (Type=dbus), the declared agents are installed.
	// Bounded: with Type=dbus systemd waits for the name, and a start job
	// that hangs must not keep caged from serving. Jobs left running go on
	// in systemd; the status reports the error.
	rctx, rcancel := context.WithTimeout(ctx, startupReconcileTimeout)
	d.cleanupOrphanRuns(rctx)
	d.cleanupOrphanShells(rctx)
	// Before the reconcile: interactive agents start only with a console.
	d.ensureConsoles()
	d.reconcile(rctx, "start")
	rcancel()
	gen, channel := d.storeCurrent()
	d.lastGeneration = gen
	// Set before the name is owned: calls may arrive from then on.
	d.audit = newAuditTail(d, o.PollInterval)
	if err := d.srv.Export(bus.ManagerProps{Version: version.Version, Mode: o.Units, Config: o.Config, Channel: channel, Generation: gen}); err != nil {
		return err
	}
	d.publishAgents(ctx)
	d.srv.SetManager(gen, channel, d.reconcileErrString())

	wg.Add(6)
	go func() { defer wg.Done(); d.watchCages(ctx) }()
	go func() { defer wg.Done(); d.serveMetrics(ctx) }()
	// The channel's control feed goes through the same pipeline as
	// `cagectl control apply` (control.go).
	d.controlFeed = d.applyChannelControls
	go func() { defer wg.Done(); d.runChannel(ctx) }()
	go func() { defer wg.Done(); d.audit.run(ctx) }()
	go func() { defer wg.Done(); d.watchdog(ctx) }()
	go func() { defer wg.Done(); d.refreshLoop(ctx) }()

	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)

	if ok, err := sddaemon.SdNotify(false, sddaemon.SdNotifyReady); err != nil {
		d.log.Warn("sd_notify", "err", err)
	} else if ok {
		d.log.Debug("notified systemd: ready")
	}
	if o.Ready != nil {
		o.Ready()
	}
	d.log.Info("caged ready", "version", version.Version, "units", o.Units, "config", o.Config, "agents", len(cfg.Agents), "bus", busName(o.Bus))

	for {
		select {
		case <-ctx.Done():
			sddaemon.SdNotify(false, sddaemon.SdNotifyStopping)
			// Nobody would tear a run down otherwise.
			d.stopRuns()
			d.stopShells()
			d.conn.ReleaseName(bus.Name)
			wg.Wait()
			d.log.Info("caged stopped")
			return nil
		case <-hup:
			if err := d.Reload(ctx, "SIGHUP"); err != nil {
				d.log.Error("reload on SIGHUP", "err", err)
			}
		}
	}
}

func busName(addr string) string {
	if addr == "" {
		return "system"
	}
	return addr
}

func dialBus(ctx context.Context, addr string) (*dbus.Conn, error) {
	var c *dbus.Conn
	var err error
	if addr == "" {
		c, err = dbus.SystemBusPrivate(dbus.WithContext(ctx))
	} else {
		c, err = dbus.Dial(addr, dbus.WithContext(ctx))
	}
	if err != nil {
		return nil, err
	}
	if err = c.Auth([]dbus.Auth{dbus.AuthExternal(fmt.Sprint(os.Getuid()))}); err == nil {
		err = c.Hello()
	}
	if err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

func dialSystemd(ctx context.Context, addr string) (*sdbus.Conn, error) {
	if addr == "" {
		return sdbus.NewWithContext(ctx)
	}
	return sdbus.NewConnection(func() (*dbus.Conn, error) { return dialBus(ctx, addr) })
}

func (d *Daemon) loadConfig() (*config.Config, error) {
	l := config.NewLoader()
	cfg, diags := l.LoadFiles(d.o.Config)
	if diags.HasErrors() {
		return nil, fmt.Errorf("config %s: %w (check it with: cagectl validate %s)", d.o.Config, diags, d.o.Config)
	}
	return cfg, nil
}

func (d *Daemon) config() *config.Config {
	d.mu.RLock()
	defer d.mu.RUnlock()
	return d.cfg
}

func (d *Daemon) reconcileErrString() string {
	d.mu.RLock()
	defer d.mu.RUnlock()
	return d.reconcileErr
}

// reconcile applies the current config and records the outcome.
func (d *Daemon) reconcile(ctx context.Context, why string) error {
	d.lockOp()
	defer d.op.Unlock()
	res, err := d.rec.Apply(ctx, d.config())
	d.recordReconcile(ctx, res, err)
	d.log.Debug("reconcile done", "why", why, "err", err)
	return err
}

// recordReconcile keeps a reconcile's outcome for status and signals it.
// The caller holds d.op.
func (d *Daemon) recordReconcile(ctx context.Context, res *reconcile.Result, err error) {
	gen, _ := d.storeCurrent()
	d.mu.Lock()
	d.reconciled = time.Now()
	d.reconcileErr = ""
	if err != nil {
		d.reconcileErr = err.Error()
	}
	if res != nil {
		for _, u := range append(append([]string(nil), res.Started...), res.Restarted...) {
			if a, ok := agentOfUnit(u); ok {
				d.agentGen[a] = gen
			}
		}
	}
	d.mu.Unlock()
	if d.srv != nil {
		msg := ""
		if err != nil {
			msg = err.Error()
		}
		d.emit(bus.SignalReconciled, msg)
	}
	if rerr := d.refreshStates(ctx); rerr != nil {
		d.log.Warn("read unit states", "err", rerr)
	}
}

// publishAgents exports (and prunes) the agent objects from a fresh status.
func (d *Daemon) publishAgents(ctx context.Context) {
	if err := d.refreshStates(ctx); err != nil {
		d.log.Warn("read unit states", "err", err)
	}
	st, err := d.Status(ctx)
	if err != nil {
		d.log.Warn("status for bus objects", "err", err)
		st = &bus.Status{}
		for _, a := range d.config().Agents {
			st.Agents = append(st.Agents, bus.AgentStatus{Name: a.Name, Backend: a.Backend, Unit: paths.Instance(paths.AgentTemplate, a.Name)})
		}
	}
	if err := d.srv.SetAgents(st.Agents); err != nil {
		d.log.Error("export agents", "err", err)
	}
}

// watchUnits applies systemd's PropertiesChanged to the state cache, the
// agents' bus properties and AgentStateChanged signals. It never calls
// systemd, so a burst of changes cannot back up the subscription.
func (d *Daemon) watchUnits(ctx context.Context, updates <-chan *sdbus.PropertiesUpdate, errs <-chan error) {
	for {
		select {
		case <-ctx.Done():
			return
		case err := <-errs:
			d.log.Warn("systemd subscription", "err", err)
		case u := <-updates:
			if d.shellUnitChanged(u.UnitName, changedState(u)) {
				continue
			}
			agent, ok := agentOfUnit(u.UnitName)
			if !ok {
				continue
			}
			if d.runUnitChanged(u.UnitName, changedState(u)) {
				continue
			}
			a := d.config().Agent(agent)
			if a == nil {
				continue
			}
			str := func(k string) (string, bool) {
				v, ok := u.Changed[k]
				if !ok {
					return "", false
				}
				s, ok := v.Value().(string)
				return s, ok
			}
			active, hasA := str("ActiveState")
			sub, hasS := str("SubState")
			load, hasL := str("LoadState")
			if !hasA && !hasS && !hasL {
				continue
			}
			d.mu.Lock()
			s := d.states[u.UnitName]
			prev := s
			if hasA {
				s.Active = active
			}
			if hasS {
				s.Sub = sub
			}
			if hasL {
				s.Load = load
			}
			d.states[u.UnitName] = s
			isAgent := u.UnitName == paths.Instance(paths.AgentTemplate, agent)
			if isAgent && s.Running() {
				if _, known := d.agentGen[agent]; !known {
					d.mu.Unlock()
					gen, _ := d.storeCurrent()
					d.mu.Lock()
					d.agentGen[agent] = gen
				}
			}
			d.mu.Unlock()
			if d.srv == nil {
				continue
			}
			if !isAgent && s.Active == "failed" && prev.Active != "failed" {
				// The gateway failed: find out why off this loop (it
				// must not call systemd), then publish.
				go d.refresh(ctx, agent)
			}
			d.srv.UpdateAgent(d.agentStatus(a))
			// systemd often repeats a state in a second PropertiesChanged;
			// signal transitions only.
			if isAgent && (s.Active != prev.Active || s.Sub != prev.Sub) {
				d.emit(bus.SignalAgentStateChanged, agent, s.Active, s.Sub)
			}
		}
	}
}

func changedState(u *sdbus.PropertiesUpdate) reconcile.State {
	str := func(k string) string {
		if v, ok := u.Changed[k]; ok {
			s, _ := v.Value().(string)
			return s
		}
		return ""
	}
	return reconcile.State{Load: str("LoadState"), Active: str("ActiveState"), Sub: str("SubState")}
}

// refreshLoop re-reads every unit state now and then, bounding how stale
// the cache can get if a signal was lost.
func (d *Daemon) refreshLoop(ctx context.Context) {
	t := time.NewTicker(stateRefresh)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			if err := d.refreshStates(ctx); err != nil && ctx.Err() == nil {
				d.log.Warn("refresh unit states", "err", err)
				continue
			}
			if st, err := d.Status(ctx); err == nil {
				for _, a := range st.Agents {
					d.srv.UpdateAgent(a)
				}
			}
		}
	}
}

// watchdog pings systemd while both connections are alive; a wedged caged
// stops pinging and systemd restarts it.
func (d *Daemon) watchdog(ctx context.Context) {
	interval, err := sddaemon.SdWatchdogEnabled(false)
	if err != nil || interval == 0 {
		return
	}
	t := time.NewTicker(interval / 2)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			if !d.conn.Connected() || !d.sd.Connected() {
				d.log.Error("lost a bus connection; withholding the watchdog ping")
				continue
			}
			sddaemon.SdNotify(false, sddaemon.SdNotifyWatchdog)
		}
	}
}

// agentOfUnit maps "nixcage-agent@a.service" and friends to "a".
func agentOfUnit(unit string) (string, bool) {
	for _, u := range []string{paths.AgentTemplate, paths.EgressTemplate} {
		pre := u[:len(u)-len(".service")]
		if len(unit) > len(pre) && unit[:len(pre)] == pre && filepath.Ext(unit) == ".service" {
			return unit[len(pre) : len(unit)-len(".service")], true
		}
	}
	return "", false
}

// startupReconcileTimeout stays well below systemd's default
// TimeoutStartSec= (90s).
const startupReconcileTimeout = 60 * time.Second

// stateRefresh is how often the unit state cache is re-read in full.
const stateRefresh = 30 * time.Second

var errNoStore = errors.New("no store block in the configuration: declare store { channel = ..., keys = [...] } to accept releases")

// lockOp takes op for an admin's action on the appliance (apply, rollback,
// apply-config, reload) and the start's reconcile. A channel apply holding
// it is canceled first and retried at the next poll: the channel server,
// not trusted, must not decide how long an admin waits (trickling a signed
// release's NARs would hold op for channelApplyTimeout). Operator actions
// (an agent restart, a secret rotation) still wait: an operator scoped to
// one agent, such as the chat relay, must not be able to starve the
// channel's updates by restarting its agent in a loop.
func (d *Daemon) lockOp() {
	d.chMu.Lock()
	d.opWaiting++
	if d.chApply != nil {
		d.chApply()
	}
	d.chMu.Unlock()
	d.op.Lock()
	d.chMu.Lock()
	d.opWaiting--
	d.chMu.Unlock()
}

// channelApplyContext is the context of a channel apply holding op: done
// at once if an operator is waiting, and when one starts to.
func (d *Daemon) channelApplyContext(ctx context.Context) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithTimeoutCause(ctx, channelApplyTimeout, errChannelApplyTimeout)
	ctx, yield := context.WithCancelCause(ctx)
	stop := func() { yield(errYieldToAdmin) }
	d.chMu.Lock()
	d.chApply = stop
	if d.opWaiting > 0 {
		stop()
	}
	d.chMu.Unlock()
	return ctx, func() {
		d.chMu.Lock()
		d.chApply = nil
		d.chMu.Unlock()
		yield(nil)
		cancel()
	}
}
