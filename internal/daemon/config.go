package daemon

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"github.com/nixcage/nixcage/internal/bus"
	"github.com/nixcage/nixcage/internal/config"
	"github.com/nixcage/nixcage/internal/paths"
	"github.com/nixcage/nixcage/internal/reconcile"
	"github.com/nixcage/nixcage/internal/render"
)

// ApplyConfig implements bus.ConfigBackend: the one-step configuration
// change. The new config is validated here again (the caller's cagectl did
// too, but caged trusts no client), planned against what is installed, and
// installed by the same reconciler that runs at start: stop removed agents,
// write, prune, daemon-reload, restart exactly the running units that read
// a changed file, start autostart agents. caged's own view (status, bus
// objects) switches to the new config in the same step, so no `cagectl
// reload` is needed.
func (d *Daemon) ApplyConfig(ctx context.Context, srcs []bus.ConfigSource, dryRun bool, by string) (*bus.ConfigPlan, error) {
	cs := make([]config.Source, len(srcs))
	for i, s := range srcs {
		cs[i] = config.Source{Name: s.Name, Data: s.Data}
	}
	cfg, diags := config.NewLoader().Load(cs...)
	if diags.HasErrors() {
		return nil, fmt.Errorf("%w: %v (nothing was changed; `cagectl validate FILE...` shows every error with its source)", bus.ErrInvalid, diags)
	}
	if !strings.HasSuffix(d.o.Config, ".json") {
		return nil, fmt.Errorf("%w: caged reads %s, and apply-config installs the canonical JSON: run caged with --config /etc/nixcage/nixcage.json (the file `cagectl render` writes)", bus.ErrInvalid, d.o.Config)
	}
	rec, err := d.installer()
	if err != nil {
		return nil, fmt.Errorf("%w: %v", bus.ErrInvalid, err)
	}
	d.lockOp()
	defer d.op.Unlock()
	plan, err := rec.Plan(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("plan: %w", err)
	}
	out := &bus.ConfigPlan{Added: plan.Added, Changed: plan.Changed, Removed: plan.Removed, Write: plan.Write,
		Remove: plan.Remove, Stop: plan.Stop, Restart: plan.Restart, Start: plan.Start}
	if dryRun {
		d.log.Info("apply-config dry run", "by", by, "added", plan.Added, "changed", plan.Changed, "removed", plan.Removed)
		return out, nil
	}
	// The config caged reads goes first: a caged restarted half-way reads
	// the new one and converges (render mode re-renders everything).
	canon, err := config.Canonical(cfg)
	if err != nil {
		return nil, err
	}
	if err := writeAtomic(d.qdirs.Host(d.o.Config), canon); err != nil {
		if errors.Is(err, syscall.EROFS) {
			return nil, fmt.Errorf("install config: %w: caged's unit does not let it write /etc (an install from before apply-config); reinstall systemd/system/%s from `cagectl render` into /etc/systemd/system, then systemctl daemon-reload && systemctl restart %s", err, paths.CagedUnit, paths.CagedUnit)
		}
		return nil, fmt.Errorf("install config: %w", err)
	}
	d.mu.Lock()
	d.cfg = cfg
	d.mu.Unlock()
	res, err := rec.Apply(ctx, cfg)
	if err != nil {
		// A start that failed for a missing secret source says which.
		var hints string
		for _, a := range cfg.Agents {
			hints += d.secretHint(ctx, a)
		}
		err = fmt.Errorf("%w%s", err, hints)
	}
	d.recordReconcile(ctx, res, err)
	d.publishAgents(ctx)
	gen, channel := d.storeCurrent()
	d.srv.SetManager(gen, channel, d.reconcileErrString())
	d.log.Warn("configuration applied", "by", by, "added", plan.Added, "changed", plan.Changed, "removed", plan.Removed, "err", err)
	out.Applied = true
	if res != nil { // what was done, which may be less than planned on error
		out.Write, out.Remove, out.Stop, out.Restart, out.Start = res.Written, res.Removed, res.Stopped, res.Restarted, res.Started
	}
	return out, err
}

// installer is the reconciler that installs a new config. With --units
// render it is caged's own (into /run). With --units os it installs into
// /etc, with the options of the install recorded there (so unchanged agents
// render byte for byte as before), unless NixOS owns /etc.
func (d *Daemon) installer() (*reconcile.Reconciler, error) {
	if d.o.Units == reconcile.ModeRender {
		return d.rec, nil
	}
	if _, err := os.Stat(d.qdirs.Host("/etc/NIXOS")); err == nil {
		return nil, errors.New("on NixOS the units come from the system configuration: change services.nixcage and run `nixos-rebuild switch`")
	}
	o := render.DefaultOptions()
	o.BinDir = d.o.BinDir
	if m := render.ReadManifest(d.qdirs.Host(paths.DefaultPrefix)); m.Options != nil {
		o = *m.Options
	}
	o.Prefix = paths.DefaultPrefix
	return &reconcile.Reconciler{Units: d.units, Mode: reconcile.ModeRender, Root: d.o.Root, Options: o, Log: d.log,
		Quarantined: d.rec.Quarantined}, nil
}

// writeAtomic replaces p (mode 0644) through render.Write: temp file,
// fsync, rename.
func writeAtomic(p string, data []byte) error {
	_, err := render.Write(filepath.Dir(p), []render.File{{Path: filepath.Base(p), Mode: 0o644, Data: data}})
	return err
}

// RotateSecret implements bus.ConfigBackend. systemd copies a credential
// into the gateway when the gateway starts, and the prepare step sizes the
// cage's placeholder from it; so rotating is a gateway restart when the new
// value fits the placeholder the agent holds, and a re-run of the prepare
// step (new placeholder, the cage restarted with it) when it does not or
// when a new placeholder is asked for. The gateway is Type=notify and says
// READY only once it loaded every credential, so a value that does not fit
// shows up as a failed restart job, not as a silent failure later.
func (d *Daemon) RotateSecret(ctx context.Context, agent, name string, newPlaceholder bool, by string) (string, error) {
	a := d.config().Agent(agent)
	if a == nil {
		return "", fmt.Errorf("%w: %q", bus.ErrNoSuchAgent, agent)
	}
	var names []string
	for _, s := range a.Secrets {
		if name == "" || s.Name == name {
			names = append(names, s.Name)
		}
	}
	if len(names) == 0 {
		var have []string
		for _, s := range a.Secrets {
			have = append(have, s.Name)
		}
		if len(have) == 0 {
			return "", fmt.Errorf("%w: agent %s declares no secrets", bus.ErrInvalid, agent)
		}
		return "", fmt.Errorf("%w: agent %s has no secret %q (it has: %s)", bus.ErrInvalid, agent, name, strings.Join(have, ", "))
	}
	d.op.Lock()
	defer d.op.Unlock()
	agentUnit := paths.Instance(paths.AgentTemplate, agent)
	egress := paths.Instance(paths.EgressTemplate, agent)
	states, err := d.units.States(ctx, []string{agentUnit, egress})
	if err != nil {
		return "", err
	}
	running := states[agentUnit].Running()
	d.log.Warn("rotate secret", "agent", agent, "secrets", names, "new_placeholder", newPlaceholder, "by", by)
	defer d.refresh(ctx, agent)
	what := strings.Join(names, ", ")
	if !newPlaceholder && states[egress].Running() {
		err := d.units.Restart(ctx, egress)
		if err == nil {
			return fmt.Sprintf("%s: gateway restarted with the new value of %s; the agent keeps its placeholder", agent, what), nil
		}
		var je *reconcile.JobError
		if !errors.As(err, &je) {
			return "", err
		}
		d.log.Info("rotated value does not fit the placeholder; re-running the prepare step", "agent", agent, "err", err)
		newPlaceholder = true
		_ = d.sd.ResetFailedUnitContext(ctx, egress)
	}
	if newPlaceholder {
		if err := dropPlaceholders(d.qdirs.Host(filepath.Join(paths.Runtime(agent), "placeholders.json")), names); err != nil {
			return "", err
		}
	}
	// Restarting the prepare step restarts what Requires= it (sockets,
	// gateway, agent) if it is running; the agent comes back with the env
	// file the step rewrote.
	if err := d.restartCage(ctx, agent, running); err != nil {
		return "", fmt.Errorf("rotate %s: %w%s", agent, err, d.secretHint(ctx, a))
	}
	if !running {
		return fmt.Sprintf("%s: prepare step re-ran with the new value of %s; the agent is not running and gets it when started", agent, what), nil
	}
	return fmt.Sprintf("%s: new placeholder for %s; the cage was restarted with it", agent, what), nil
}

// restartCage re-runs the agent's prepare step, which restarts its sockets,
// gateway and (if it runs) the agent through Requires=, and then starts the
// agent if it was running. Quarantined agents are never started.
func (d *Daemon) restartCage(ctx context.Context, agent string, startAgent bool) error {
	prep := paths.Instance(paths.PrepTemplate, agent)
	// The sockets too: after a gateway crash loop (start limit hit) they
	// are failed, and this restart is the documented way back.
	for _, u := range []string{prep, paths.Instance(paths.ProxySocketTpl, agent), paths.Instance(paths.DNSSocketTpl, agent), paths.Instance(paths.EgressTemplate, agent), paths.Instance(paths.AgentTemplate, agent)} {
		_ = d.sd.ResetFailedUnitContext(ctx, u)
	}
	if err := d.units.Restart(ctx, prep); err != nil {
		return err
	}
	if !startAgent {
		return nil
	}
	if err := d.refuseQuarantined(agent); err != nil {
		return nil
	}
	return d.units.Start(ctx, paths.Instance(paths.AgentTemplate, agent))
}

// dropPlaceholders removes names from the placeholder file, so the prepare
// step makes new ones for them (it keeps every placeholder that still fits).
func dropPlaceholders(file string, names []string) error {
	b, err := os.ReadFile(file)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("placeholders: %w", err)
	}
	var f map[string]json.RawMessage
	if err := json.Unmarshal(b, &f); err != nil {
		return os.Remove(file) // unreadable: the prepare step makes all anew
	}
	var secrets map[string]json.RawMessage
	if err := json.Unmarshal(f["secrets"], &secrets); err != nil {
		return os.Remove(file)
	}
	for _, n := range names {
		delete(secrets, n)
	}
	if f["secrets"], err = json.Marshal(secrets); err != nil {
		return err
	}
	out, err := json.MarshalIndent(f, "", "  ")
	if err != nil {
		return err
	}
	return writeAtomic(file, append(out, '\n'))
}

// secretHint names secret sources that do not exist, after a start failed:
// systemd's own words for it are "Failed to set up credentials: Protocol
// error" in the journal and a "dependency" job result. Only existence is
// checked (never the value); a source under /root or /home is invisible to
// caged (ProtectHome=) and reported as such.
func (d *Daemon) secretHint(ctx context.Context, a *config.Agent) string {
	var hints []string
	for _, s := range a.Secrets {
		if strings.HasPrefix(s.Source, "/root/") || strings.HasPrefix(s.Source, "/home/") {
			continue
		}
		if _, err := os.Stat(d.qdirs.Host(s.Source)); errors.Is(err, os.ErrNotExist) {
			hints = append(hints, fmt.Sprintf("secret %q: source %s does not exist; create it (one line, mode 0600) or fix agent %q's secret %q source", s.Name, s.Source, a.Name, s.Name))
		}
	}
	if len(hints) == 0 {
		return ""
	}
	return "; " + strings.Join(hints, "; ")
}

// ReadLogs implements bus.LogsBackend with journalctl, as `cagectl logs`
// runs it for root: the agent, its gateway, its prepare step and its
// namespace unit, interleaved.
func (d *Daemon) ReadLogs(ctx context.Context, agent string, lines uint32, cursor string) ([]string, string, error) {
	journalctl, err := exec.LookPath("journalctl")
	if err != nil {
		return nil, "", fmt.Errorf("journalctl not found on caged's PATH: %w", err)
	}
	argv := []string{"--no-pager", "-o", "short-iso", "--show-cursor"}
	if cursor != "" {
		argv = append(argv, "--after-cursor", cursor)
	} else {
		argv = append(argv, "-n", strconv.FormatUint(uint64(lines), 10))
	}
	for _, tpl := range []string{paths.AgentTemplate, paths.EgressTemplate, paths.PrepTemplate, paths.NetnsTemplate} {
		argv = append(argv, "-u", paths.Instance(tpl, agent))
	}
	out, err := exec.CommandContext(ctx, journalctl, argv...).Output()
	if err != nil {
		return nil, "", fmt.Errorf("journalctl: %w", err)
	}
	var entries []string
	next := cursor
	for _, l := range strings.Split(strings.TrimRight(string(out), "\n"), "\n") {
		switch {
		case strings.HasPrefix(l, "-- cursor: "):
			next = strings.TrimPrefix(l, "-- cursor: ")
		case l == "" || l == "-- No entries --":
		default:
			entries = append(entries, l)
		}
	}
	if uint32(len(entries)) > lines {
		entries = entries[len(entries)-int(lines):]
	}
	return entries, next, nil
}
