package daemon

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	sdbus "github.com/coreos/go-systemd/v22/dbus"
	"github.com/coreos/go-systemd/v22/unit"
	"github.com/godbus/dbus/v5"

	"github.com/nixcage/nixcage/internal/bus"
	"github.com/nixcage/nixcage/internal/config"
	"github.com/nixcage/nixcage/internal/paths"
	"github.com/nixcage/nixcage/internal/reconcile"
	"github.com/nixcage/nixcage/internal/render"
)

// Shells in running cages (cagectl shell). caged starts each as a
// transient unit, with the caller's descriptors as its stdio, whose whole
// configuration is a drop-in rendered from the agent's unit as systemd
// loaded it (render.ShellDropIn): the shell has the agent's user, view and
// walls, no more. See docs/run.md, "A shell in a running cage".

var _ bus.ShellBackend = (*Daemon)(nil)

// shellUnitPrefix names every shell's transient unit:
// nixcage-shell-AGENT-XXXXXXXX.service.
const shellUnitPrefix = "nixcage-shell-"

// nsenterPaths are where caged looks for nsenter(1) (util-linux): Debian,
// then NixOS.
var nsenterPaths = []string{"/usr/bin/nsenter", "/run/current-system/sw/bin/nsenter"}

// shell is one open shell.
type shell struct {
	unit, agent, by, sender string
	command                 []string
	started                 time.Time

	// opened is closed once OpenShell is through (ok: it started), so
	// that a quick shell's end is never reported before its opening.
	opened chan struct{}
	ok     bool
	once   sync.Once
	done   chan struct{}
}

func (d *Daemon) shellByUnit(unit string) *shell {
	d.mu.RLock()
	defer d.mu.RUnlock()
	return d.shells[unit]
}

// OpenShell implements bus.ShellBackend. It owns the descriptors.
func (d *Daemon) OpenShell(ctx context.Context, req bus.ShellRequest, stdio [3]dbus.UnixFD, caller bus.Identity, sender string) (string, error) {
	var files [3]*os.File
	for i, fd := range stdio {
		files[i] = os.NewFile(uintptr(fd), "stdio")
	}
	defer func() {
		for _, f := range files {
			f.Close()
		}
	}()
	a := d.config().Agent(req.Agent)
	if a == nil {
		return "", fmt.Errorf("%w: %s is a throw-away cage (cagectl run); its owner holds its terminal, and it has no shell", bus.ErrInvalid, req.Agent)
	}
	if a.Backend == config.BackendPodman {
		return "", fmt.Errorf("%w: %s is a podman cage, which has no shell: it would need podman exec, a second container runtime call outside the agent's unit; use the service or nspawn backend to debug it", bus.ErrInvalid, a.Name)
	}
	agentUnit := paths.Instance(paths.AgentTemplate, a.Name)
	states, err := d.units.States(ctx, []string{agentUnit})
	if err != nil {
		return "", fmt.Errorf("shell %s: %w", a.Name, err)
	}
	if s := states[agentUnit]; s.Active != "active" {
		return "", fmt.Errorf("%w: agent %s is not running (%s); a shell joins a running cage: cagectl start %s first", bus.ErrInvalid, a.Name, s.Active, a.Name)
	}
	spec := render.Shell{AgentUnit: agentUnit, Command: req.Command, By: caller.String()}
	if req.TTY {
		spec.Term = req.Term
	}
	if spec.AgentService, err = d.loadedService(ctx, agentUnit); err != nil {
		return "", fmt.Errorf("shell %s: %w", a.Name, err)
	}
	if a.Backend == config.BackendNspawn {
		if spec.ContainerPID, err = d.containerInit(ctx, agentUnit); err != nil {
			return "", fmt.Errorf("shell %s: %w", a.Name, err)
		}
		for _, p := range nsenterPaths {
			if _, err := os.Stat(p); err == nil {
				spec.Nsenter = p
				break
			}
		}
		if spec.Nsenter == "" {
			return "", fmt.Errorf("shell %s: no nsenter on this host (looked in %s): install util-linux", a.Name, strings.Join(nsenterPaths, ", "))
		}
	}
	dropIn, err := render.ShellDropIn(a, spec)
	if err != nil {
		return "", err
	}
	b := make([]byte, 4)
	rand.Read(b)
	sh := &shell{unit: shellUnitPrefix + a.Name + "-" + hex.EncodeToString(b) + ".service", agent: a.Name, by: caller.String(),
		sender: sender, command: req.Command, started: time.Now(), opened: make(chan struct{}), done: make(chan struct{})}
	if len(sh.command) == 0 {
		sh.command = render.ShellDefault
	}
	dir := d.shellDropInDir(sh.unit)
	if err := mkdirReadable(dir); err != nil {
		return "", fmt.Errorf("shell %s: %w", a.Name, err)
	}
	conf := filepath.Join(dir, "50-shell.conf")
	if err := os.WriteFile(conf, dropIn, 0o644); err == nil {
		err = os.Chmod(conf, 0o644) // whatever caged's umask
	} else {
		os.RemoveAll(dir)
		return "", fmt.Errorf("shell %s: %w", a.Name, err)
	}
	d.mu.Lock()
	if d.shells == nil {
		d.shells = map[string]*shell{}
	}
	d.shells[sh.unit] = sh
	d.mu.Unlock()
	fail := func(err error) (string, error) {
		d.removeShell(context.Background(), d.units, sh.unit)
		d.mu.Lock()
		delete(d.shells, sh.unit)
		d.mu.Unlock()
		close(sh.opened)
		return "", err
	}
	// The command is in the drop-in only: a unit systemd started without
	// it would have no ExecStart= and be refused.
	props := []sdbus.Property{
		sdbus.PropDescription(fmt.Sprintf("nixcage shell in %s for %s", a.Name, sh.by)),
		{Name: "StandardInputFileDescriptor", Value: dbus.MakeVariant(dbus.UnixFD(files[0].Fd()))},
		{Name: "StandardOutputFileDescriptor", Value: dbus.MakeVariant(dbus.UnixFD(files[1].Fd()))},
		{Name: "StandardErrorFileDescriptor", Value: dbus.MakeVariant(dbus.UnixFD(files[2].Fd()))},
	}
	ch := make(chan string, 1)
	if _, err := d.sd.StartTransientUnitContext(ctx, sh.unit, "fail", props, ch); err != nil {
		return fail(fmt.Errorf("shell %s: start: %w", a.Name, err))
	}
	select {
	case res := <-ch:
		if res != "done" && !d.shellRan(ctx, sh.unit) {
			return fail(fmt.Errorf("shell %s: the shell did not start (job %s); see journalctl -u %s", a.Name, res, sh.unit))
		}
	case <-ctx.Done():
		return fail(fmt.Errorf("shell %s: waiting for the start: %w", a.Name, ctx.Err()))
	}
	cmd := bus.FormatCommand(sh.command)
	d.log.Info("shell opened", "agent", a.Name, "by", sh.by, "command", cmd, "unit", sh.unit, "tty", req.TTY)
	d.emit(bus.SignalShellOpened, a.Name, sh.by, cmd, sh.unit)
	sh.ok = true
	close(sh.opened)
	go d.superviseShell(sh)
	return sh.unit, nil
}

// shellRan tells a command that ran and ended before its start job was
// through (systemd then fails the job of a Type=exec unit) from a start
// that failed: systemd's own failures before the exec are exit statuses
// 200-243 (EXIT_CHDIR ... in systemd.exec(5)).
func (d *Daemon) shellRan(ctx context.Context, unit string) bool {
	props, err := d.sd.GetUnitTypePropertiesContext(ctx, unit, "Service")
	if err != nil {
		return false
	}
	code, _ := props["ExecMainCode"].(int32)
	status, _ := props["ExecMainStatus"].(int32)
	return code == 2 || code == 3 || code == 1 && (status < 200 || status > 243)
}

// loadedService is the [Service] section of unit as systemd loaded it: its
// fragment, then its drop-ins, in systemd's order.
func (d *Daemon) loadedService(ctx context.Context, name string) ([]*unit.UnitOption, error) {
	props, err := d.sd.GetUnitPropertiesContext(ctx, name)
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", name, err)
	}
	frag, _ := props["FragmentPath"].(string)
	if frag == "" {
		return nil, fmt.Errorf("%s has no unit file", name)
	}
	files := []string{frag}
	if ds, ok := props["DropInPaths"].([]string); ok {
		files = append(files, ds...)
	}
	var opts []*unit.UnitOption
	for _, f := range files {
		data, err := os.ReadFile(filepath.Join(d.root(), f))
		if err != nil {
			return nil, fmt.Errorf("read %s's unit: %w", name, err)
		}
		o, err := unit.DeserializeOptions(bytes.NewReader(data))
		if err != nil {
			return nil, fmt.Errorf("parse %s: %w", f, err)
		}
		opts = append(opts, o...)
	}
	return opts, nil
}

func (d *Daemon) root() string {
	if d.o.Root == "" {
		return "/"
	}
	return d.o.Root
}

func (d *Daemon) shellDropInDir(unit string) string {
	return filepath.Join(d.root(), "run/systemd/system", unit+".d")
}

// containerInit finds the host pid of an nspawn cage's PID 1 among the
// processes of its unit: the one that is pid 1 of a PID namespace one
// level below the host's (/proc/PID/status NSpid; the kernel writes it,
// the cage cannot fake it, and cage-seal keeps the cage from nesting).
func (d *Daemon) containerInit(ctx context.Context, agentUnit string) (int, error) {
	p, err := d.sd.GetServicePropertyContext(ctx, agentUnit, "ControlGroup")
	if err != nil {
		return 0, fmt.Errorf("read the cage's control group: %w", err)
	}
	cg, _ := p.Value.Value().(string)
	if cg == "" {
		return 0, errors.New("the cage has no control group")
	}
	var pids []int
	for _, mnt := range []string{"/sys/fs/cgroup", "/sys/fs/cgroup/unified", "/sys/fs/cgroup/systemd"} {
		if pids = cgroupPids(filepath.Join(mnt, cg)); len(pids) > 0 {
			break
		}
	}
	for _, pid := range pids {
		if ns := nsPids(pid); len(ns) == 2 && ns[1] == 1 {
			return pid, nil
		}
	}
	return 0, fmt.Errorf("no process of %s is the cage's PID 1 (is nspawn still setting it up?)", agentUnit)
}

// cgroupPids are the processes of a cgroup and of those below it.
func cgroupPids(dir string) []int {
	var pids []int
	filepath.WalkDir(dir, func(p string, e os.DirEntry, err error) error {
		if err != nil || e.IsDir() || e.Name() != "cgroup.procs" {
			return nil
		}
		data, _ := os.ReadFile(p)
		for _, f := range strings.Fields(string(data)) {
			if n, err := strconv.Atoi(f); err == nil {
				pids = append(pids, n)
			}
		}
		return nil
	})
	return pids
}

// nsPids is the NSpid line of a process: its pid in each PID namespace
// from the host's down.
func nsPids(pid int) []int {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return nil
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if rest, ok := strings.CutPrefix(sc.Text(), "NSpid:"); ok {
			var out []int
			for _, w := range strings.Fields(rest) {
				n, _ := strconv.Atoi(w)
				out = append(out, n)
			}
			return out
		}
	}
	return nil
}

// superviseShell ends the shell when its command exits (systemd's signals
// through shellUnitChanged, and a slow poll), when the caller leaves the
// bus, or when the agent stops (BindsTo=).
func (d *Daemon) superviseShell(sh *shell) {
	left, unwatch := d.watchCaller(sh.sender)
	defer unwatch()
	tk := time.NewTicker(2 * time.Second)
	defer tk.Stop()
	check := true // the caller may have left before the match was added
	for {
		if check && !d.callerPresent(sh.sender) {
			d.log.Info("caller of a shell left the bus; stopping it", "agent", sh.agent, "by", sh.by, "unit", sh.unit)
			d.finishShell(sh)
			return
		}
		check = false
		select {
		case <-sh.done:
			return
		case sig, ok := <-left:
			if !ok {
				left = nil
			} else if sig != nil && sig.Name == "org.freedesktop.DBus.NameOwnerChanged" {
				check = true
			}
			continue
		case <-tk.C:
			check = true
		}
		states, err := d.units.States(context.Background(), []string{sh.unit})
		if err != nil {
			continue
		}
		if shellEnded(states[sh.unit]) {
			d.finishShell(sh)
			return
		}
	}
}

// shellEnded: the command exited (RemainAfterExit= keeps the unit active
// as "exited" until caged reads the status) or the unit went down.
func shellEnded(s reconcile.State) bool {
	return s.Sub == "exited" || s.Active == "inactive" || s.Active == "failed"
}

// shellUnitChanged is watchUnits' hook for shell units.
func (d *Daemon) shellUnitChanged(unit string, s reconcile.State) bool {
	if !strings.HasPrefix(unit, shellUnitPrefix) {
		return false
	}
	if sh := d.shellByUnit(unit); sh != nil && shellEnded(s) {
		// A transient unit is reported inactive before it starts: look
		// again, once OpenShell is through, before ending anything.
		go func() {
			<-sh.opened
			if !sh.ok {
				return
			}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			if states, err := d.units.States(ctx, []string{unit}); err == nil && shellEnded(states[unit]) {
				d.finishShell(sh)
			}
		}()
	}
	return true
}

// finishShell reads the exit status, stops the unit (and whatever the shell
// left running), removes its drop-in and reports the end. Once per shell.
func (d *Daemon) finishShell(sh *shell) {
	sh.once.Do(func() {
		defer close(sh.done)
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		states, _ := d.units.States(ctx, []string{sh.unit})
		st := states[sh.unit]
		exit, result := d.exitStatus(ctx, sh.unit)
		if st.Sub != "exited" && st.Active != "failed" && (exit == 0 || result == "unknown") {
			// Stopped from outside (the agent stopped, BindsTo=): a command
			// that exits by itself leaves the unit "exited" (RemainAfterExit=)
			// or failed, while systemd forgets a unit that stopped cleanly at
			// once, and with it the status (a fresh lookup reads 0,
			// "success"); what ended the shell was its stop's SIGTERM.
			exit, result = 128+int32(syscall.SIGTERM), "stopped"
		}
		d.removeShell(ctx, d.units, sh.unit)
		d.mu.Lock()
		delete(d.shells, sh.unit)
		d.mu.Unlock()
		d.log.Info("shell closed", "agent", sh.agent, "by", sh.by, "unit", sh.unit, "exit", exit, "result", result,
			"duration", time.Since(sh.started).Round(time.Millisecond))
		d.emit(bus.SignalShellClosed, sh.agent, sh.by, exit, sh.unit)
	})
}

// removeShell stops a shell's unit, makes systemd forget it and removes
// its drop-in.
func (d *Daemon) removeShell(ctx context.Context, units reconcile.Units, unit string) {
	if err := units.Stop(ctx, unit); err != nil && !reconcile.IsNoSuchUnit(err) {
		d.log.Warn("stop shell", "unit", unit, "err", err)
	}
	_ = units.SD.ResetFailedUnitContext(ctx, unit)
	if err := os.RemoveAll(d.shellDropInDir(unit)); err != nil {
		d.log.Warn("remove shell drop-in", "unit", unit, "err", err)
	}
}

// stopShells ends every shell when caged stops (with a connection of its
// own, as stopRuns does); cleanupOrphanShells those a previous caged left.
func (d *Daemon) stopShells() {
	d.mu.RLock()
	n := len(d.shells)
	d.mu.RUnlock()
	if n == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	sd, err := dialSystemd(ctx, d.o.Systemd)
	if err != nil {
		d.log.Error("stopping: cannot reach systemd; shells are left for the next caged", "err", err)
		return
	}
	defer sd.Close()
	d.mu.RLock()
	units := make([]string, 0, len(d.shells))
	for u := range d.shells {
		units = append(units, u)
	}
	d.mu.RUnlock()
	for _, u := range units {
		d.log.Info("caged is stopping: closing a shell", "unit", u)
		d.removeShell(ctx, reconcile.Units{SD: sd}, u)
	}
}

func (d *Daemon) cleanupOrphanShells(ctx context.Context) {
	dirs, _ := filepath.Glob(filepath.Join(d.root(), "run/systemd/system", shellUnitPrefix+"*.service.d"))
	for _, dir := range dirs {
		u := strings.TrimSuffix(filepath.Base(dir), ".d")
		d.log.Warn("closing a shell left by a previous caged", "unit", u)
		d.removeShell(ctx, d.units, u)
	}
}
