package reconcile

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"

	"github.com/nixcage/nixcage/internal/config"
	"github.com/nixcage/nixcage/internal/paths"
	"github.com/nixcage/nixcage/internal/render"
)

// Modes say who provides the unit files.
const (
	// ModeRender: caged renders the units into /run (non-NixOS hosts) and
	// owns them: it installs, reloads, and removes what disappears.
	ModeRender = "render"
	// ModeOS: the units come from NixOS or the operator under /etc; caged
	// only drives their lifecycle.
	ModeOS = "os"
)

// Reconciler applies a config to a host. It is safe for concurrent use;
// reconciles are serialized.
type Reconciler struct {
	Units Units
	Mode  string
	// Root is prepended to every host path (tests use a temporary
	// directory); "" means "/".
	Root string
	// Options are the render options; Prefix should be "/run" in render mode.
	Options render.Options
	// Quarantined reports whether an agent is quarantined; such agents are
	// never started by a reconcile.
	Quarantined func(agent string) bool
	Log         *slog.Logger

	mu sync.Mutex
}

// Result is what one reconcile did, in the order it did it.
type Result struct {
	Written   []string // files installed or changed (relative to the prefix)
	Removed   []string // files removed
	Reloaded  bool     // daemon-reload was issued
	Stopped   []string // units stopped (agents that disappeared)
	Restarted []string // units restarted because their bytes changed
	Started   []string // autostart agents started
	Skipped   []string // autostart agents left down because quarantined
	// Shadowed are rendered units that a file of the same name under
	// /etc/systemd/system overrides (systemd prefers /etc over /run), so
	// caged's version is ignored: the host mixes the two modes.
	Shadowed []string
}

// Changed reports whether the reconcile touched anything.
func (r *Result) Changed() bool {
	return len(r.Written)+len(r.Removed)+len(r.Stopped)+len(r.Restarted)+len(r.Started) > 0 || r.Reloaded
}

func (r *Reconciler) log() *slog.Logger {
	if r.Log != nil {
		return r.Log
	}
	return slog.Default()
}

func (r *Reconciler) host(p string) string {
	if r.Root == "" {
		return p
	}
	return filepath.Join(r.Root, p)
}

// AgentUnits are the instance units of one agent, in start order.
func AgentUnits(agent string) []string {
	return []string{
		paths.Instance(paths.NetnsTemplate, agent),
		paths.Instance(paths.PrepTemplate, agent),
		paths.Instance(paths.ProxySocketTpl, agent),
		paths.Instance(paths.DNSSocketTpl, agent),
		paths.Instance(paths.EgressTemplate, agent),
		paths.Instance(paths.AgentTemplate, agent),
	}
}

// Apply brings the host to cfg. It is idempotent: applying the same config
// twice does nothing the second time (beyond starting autostart agents that
// are down). Every step is attempted; failures are collected and returned
// together with what was done, never swallowed.
func (r *Reconciler) Apply(ctx context.Context, cfg *config.Config) (*Result, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.Units.SD == nil {
		return nil, errors.New("reconcile: no systemd connection")
	}
	res := &Result{}
	var errs []error
	switch r.Mode {
	case ModeRender:
		errs = r.applyRender(ctx, cfg, res)
	case ModeOS:
	default:
		return nil, fmt.Errorf("reconcile: unknown mode %q (use %q or %q)", r.Mode, ModeRender, ModeOS)
	}
	errs = append(errs, r.autostart(ctx, cfg, res)...)
	err := errors.Join(errs...)
	lg := r.log()
	if err != nil {
		lg.Error("reconcile failed", "written", len(res.Written), "removed", len(res.Removed),
			"restarted", res.Restarted, "started", res.Started, "stopped", res.Stopped, "err", err)
	} else if res.Changed() {
		lg.Info("reconciled", "written", len(res.Written), "removed", len(res.Removed),
			"reloaded", res.Reloaded, "restarted", res.Restarted, "started", res.Started, "stopped", res.Stopped)
	}
	return res, err
}

// Plan is what installing a config would do, computed without changing
// anything: `cagectl apply-config --dry-run` prints it, and Apply does
// exactly this.
type Plan struct {
	Added   []string // agents declared now and not installed before
	Changed []string // installed agents with a changed file or unit
	Removed []string // installed agents no longer declared
	Write   []string // files whose bytes change (relative to the prefix)
	Remove  []string // files of what is no longer declared
	Stop    []string // units of removed agents, stopped first
	Restart []string // running units that read a changed file
	Start   []string // autostart agents that are down and will be started
}

// renderPlan is a Plan with what executing it needs.
type renderPlan struct {
	Plan
	dir      string
	files    []render.File
	old      []string // previous manifest
	affected []string // units reading a changed file, running or not
}

// Plan computes what Apply would do for cfg, reading the installed tree and
// unit states but changing nothing.
func (r *Reconciler) Plan(ctx context.Context, cfg *config.Config) (*Plan, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.Mode != ModeRender {
		return nil, fmt.Errorf("reconcile: a plan needs the units to be installed by caged (mode %q)", ModeRender)
	}
	p, err := r.planRender(cfg)
	if err != nil {
		return nil, err
	}
	states, err := r.Units.States(ctx, p.affected)
	if err != nil {
		return nil, err
	}
	for _, u := range p.affected {
		if states[u].Running() {
			p.Restart = append(p.Restart, u)
		}
	}
	down, _, err := r.autostartCandidates(ctx, cfg)
	if err != nil {
		return nil, err
	}
	p.Start = down
	return &p.Plan, nil
}

// planRender renders cfg and compares it with what is installed.
func (r *Reconciler) planRender(cfg *config.Config) (*renderPlan, error) {
	files, err := render.Render(cfg, r.Options)
	if err != nil {
		return nil, fmt.Errorf("render: %w", err)
	}
	files = installable(files)
	dir := r.host(r.Options.Prefix)
	p := &renderPlan{dir: dir, files: files, old: render.ReadManifest(dir).Files}
	want := map[string]bool{}
	for _, f := range files {
		want[f.Path] = true
	}
	// Files of undeclared agents are found by name too, so a tree
	// installed without a manifest (or with a lost one) is still pruned.
	seen := map[string]bool{}
	for _, f := range append(append([]string(nil), p.old...), render.AgentFiles(dir)...) {
		if !want[f] && !seen[f] && installablePath(f) {
			seen[f] = true
			p.Remove = append(p.Remove, f)
		}
	}
	sort.Strings(p.Remove)
	current := map[string]bool{}
	for _, a := range cfg.Agents {
		current[a.Name] = true
	}
	installed := map[string]bool{}
	for _, f := range render.AgentFiles(dir) {
		if a, ok := agentOf(f); ok {
			installed[a] = true
		}
	}
	gone := map[string]bool{}
	for _, f := range p.Remove {
		if a, ok := agentOf(f); ok && !current[a] {
			gone[a] = true
		}
	}
	p.Removed = sortedKeys(gone)
	for _, a := range p.Removed {
		us := AgentUnits(a)
		for i := len(us) - 1; i >= 0; i-- {
			p.Stop = append(p.Stop, us[i])
		}
	}
	// Other units whose file goes (an agent's workspace mount, named after
	// its path) stop after the agents that needed them.
	for _, f := range p.Remove {
		if u, ok := strings.CutPrefix(f, "systemd/system/"); ok && !strings.Contains(u, "/") && !strings.Contains(u, "@.") && !slices.Contains(p.Stop, u) {
			p.Stop = append(p.Stop, u)
		}
	}
	p.Write = render.Diff(dir, files)
	p.affected = affectedUnits(p.Write, cfg)
	changed := map[string]bool{}
	for _, f := range p.Write {
		if a, ok := agentOf(f); ok {
			changed[a] = true
		}
	}
	for _, u := range p.affected {
		if a, ok := agentOf("systemd/system/" + u); ok {
			changed[a] = true
		}
	}
	for _, a := range cfg.Agents {
		switch {
		case !installed[a.Name]:
			p.Added = append(p.Added, a.Name)
		case changed[a.Name]:
			p.Changed = append(p.Changed, a.Name)
		}
	}
	return p, nil
}

// applyRender installs the rendered tree and restarts what changed.
// Order: stop vanished agents; write; remove stale files; reload; restart
// units whose bytes changed. A failed write aborts before reload, so systemd
// never loads a half-written set.
func (r *Reconciler) applyRender(ctx context.Context, cfg *config.Config, res *Result) []error {
	p, err := r.planRender(cfg)
	if err != nil {
		return []error{err}
	}
	dir := p.dir
	if r.Options.Prefix != paths.DefaultPrefix {
		for _, f := range p.files {
			if rest, ok := strings.CutPrefix(f.Path, "systemd/system/"); ok && !strings.Contains(rest, "/") {
				if _, err := os.Lstat(r.host(filepath.Join("/etc/systemd/system", rest))); err == nil {
					res.Shadowed = append(res.Shadowed, rest)
				}
			}
		}
	}
	if len(res.Shadowed) > 0 {
		r.log().Warn("units under /etc/systemd/system override the ones caged renders into /run; install only nixcage-caged.service there, or run caged with --units os",
			"units", res.Shadowed)
	}

	var errs []error
	// Agents whose unit disappears are stopped while systemd still knows
	// their units.
	for _, u := range p.Stop {
		if err := r.Units.Stop(ctx, u); err != nil && !IsNoSuchUnit(err) {
			errs = append(errs, err)
			continue
		}
		res.Stopped = append(res.Stopped, u)
	}

	// The manifest first lists old and new files, so that a crash after
	// writing still lets the next run find everything it may have to remove.
	want := render.Paths(p.files)
	union := append(append([]string(nil), p.old...), want...)
	if err := render.WriteManifest(dir, render.Manifest{Files: dedupe(union), Options: &r.Options}); err != nil {
		return append(errs, err)
	}
	changed, err := render.Write(dir, p.files)
	res.Written = changed
	if err != nil {
		return append(errs, fmt.Errorf("install units: %w", err))
	}
	for _, f := range p.Remove {
		if err := os.Remove(filepath.Join(dir, f)); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, fmt.Errorf("remove %s: %w", f, err))
			continue
		}
		removeEmptyParents(dir, filepath.Dir(f))
		res.Removed = append(res.Removed, f)
	}
	if err := render.WriteManifest(dir, render.Manifest{Files: want, Options: &r.Options}); err != nil {
		errs = append(errs, err)
	}

	if len(changed)+len(res.Removed) == 0 {
		return errs
	}
	// systemd reads only unit files; a changed runtime document (the
	// canonical config, egress.json) needs restarts, not a reload.
	if touchesUnits(changed) || touchesUnits(res.Removed) {
		if err := r.Units.SD.ReloadContext(ctx); err != nil {
			return append(errs, fmt.Errorf("daemon-reload: %w", err))
		}
		res.Reloaded = true
	}

	affected := affectedUnits(changed, cfg)
	if len(affected) == 0 {
		return errs
	}
	states, err := r.Units.States(ctx, affected)
	if err != nil {
		return append(errs, err)
	}
	for _, u := range affected {
		if !states[u].Running() {
			continue
		}
		if err := r.Units.Restart(ctx, u); err != nil {
			errs = append(errs, err)
			continue
		}
		res.Restarted = append(res.Restarted, u)
	}
	return errs
}

// autostartCandidates are the agent units declared with autostart that are
// down: to start, and (separately) those kept down by a quarantine.
func (r *Reconciler) autostartCandidates(ctx context.Context, cfg *config.Config) (start, skipped []string, err error) {
	var names []string
	for _, a := range cfg.Agents {
		if a.Autostart {
			names = append(names, paths.Instance(paths.AgentTemplate, a.Name))
		}
	}
	states, err := r.Units.States(ctx, names)
	if err != nil {
		return nil, nil, err
	}
	for _, a := range cfg.Agents {
		u := paths.Instance(paths.AgentTemplate, a.Name)
		if !a.Autostart || states[u].Running() {
			continue
		}
		if r.Quarantined != nil && r.Quarantined(a.Name) {
			skipped = append(skipped, u)
			continue
		}
		start = append(start, u)
	}
	return start, skipped, nil
}

func touchesUnits(files []string) bool {
	for _, p := range files {
		if strings.HasPrefix(p, "systemd/") {
			return true
		}
	}
	return false
}

// autostart starts agents declared with autostart that are down.
func (r *Reconciler) autostart(ctx context.Context, cfg *config.Config, res *Result) []error {
	start, skipped, err := r.autostartCandidates(ctx, cfg)
	if err != nil {
		return []error{err}
	}
	res.Skipped = append(res.Skipped, skipped...)
	var errs []error
	for _, u := range start {
		if err := r.Units.Start(ctx, u); err != nil {
			errs = append(errs, err)
			continue
		}
		res.Started = append(res.Started, u)
	}
	return errs
}

// installable drops what caged must not install at run time: its own unit
// and bus policy belong to the package (an /etc unit shadows /run anyway,
// and caged must never restart itself mid-reconcile).
func installable(files []render.File) []render.File {
	out := files[:0:0]
	for _, f := range files {
		if installablePath(f.Path) {
			out = append(out, f)
		}
	}
	return out
}

// installablePath is false for the install-time files: never written, and
// never pruned either (`cagectl render --out /etc` lists them in its
// manifest).
func installablePath(p string) bool {
	return p != "systemd/system/"+paths.CagedUnit && !strings.HasPrefix(p, "dbus-1/")
}

// agentOf names the agent a rendered file belongs to, if any.
func agentOf(p string) (string, bool) {
	if rest, ok := strings.CutPrefix(p, "nixcage/agents/"); ok {
		a, _, _ := strings.Cut(rest, "/")
		return a, a != ""
	}
	if rest, ok := strings.CutPrefix(p, "systemd/system/"); ok {
		unit, sub, _ := strings.Cut(rest, "/") // drop-in dirs: X@a.service.d/...
		if strings.HasSuffix(unit, ".wants") {
			unit = sub // autostart links: nixcage.target.wants/nixcage-agent@a.service
		}
		unit = strings.TrimSuffix(unit, ".d")
		if strings.Contains(unit, "/") || !strings.Contains(unit, "@") {
			return "", false
		}
		_, inst, _ := strings.Cut(unit, "@")
		a, _, _ := strings.Cut(inst, ".")
		return a, a != ""
	}
	return "", false
}

// affectedUnits maps changed files to the unit instances that read them, in
// a stable order (per agent, dependencies first).
func affectedUnits(changed []string, cfg *config.Config) []string {
	hit := map[string]bool{}
	for _, p := range changed {
		rest, ok := strings.CutPrefix(p, "systemd/system/")
		if !ok {
			if a, ok := agentOf(p); ok {
				// egress.json: the prepare step and the gateway read it.
				hit[paths.Instance(paths.PrepTemplate, a)] = true
				hit[paths.Instance(paths.EgressTemplate, a)] = true
			}
			continue
		}
		unit, _, _ := strings.Cut(rest, "/")
		unit = strings.TrimSuffix(unit, ".d")
		if strings.Contains(unit, "@.") {
			// A template: every agent's instance.
			for _, a := range cfg.Agents {
				hit[paths.Instance(unit, a.Name)] = true
			}
			continue
		}
		if strings.Contains(unit, "@") {
			hit[unit] = true
		}
	}
	var out []string
	for _, a := range cfg.Agents {
		for _, u := range AgentUnits(a.Name) {
			if hit[u] {
				out = append(out, u)
			}
		}
	}
	return out
}

// removeEmptyParents removes now-empty directories (drop-in dirs, an
// agent's config dir) up to, not including, the prefix.
func removeEmptyParents(prefix, rel string) {
	for rel != "." && rel != "/" && rel != "" {
		if os.Remove(filepath.Join(prefix, rel)) != nil {
			return
		}
		rel = filepath.Dir(rel)
	}
}

func sortedKeys(m map[string]bool) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

func dedupe(s []string) []string {
	seen := map[string]bool{}
	out := s[:0:0]
	for _, x := range s {
		if !seen[x] {
			seen[x] = true
			out = append(out, x)
		}
	}
	sort.Strings(out)
	return out
}
