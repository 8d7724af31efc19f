package daemon

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	sdbus "github.com/coreos/go-systemd/v22/dbus"
	"github.com/godbus/dbus/v5"

	"github.com/nixcage/nixcage/internal/auditlog"
	"github.com/nixcage/nixcage/internal/bus"
	"github.com/nixcage/nixcage/internal/config"
	"github.com/nixcage/nixcage/internal/paths"
	"github.com/nixcage/nixcage/internal/reconcile"
	"github.com/nixcage/nixcage/internal/render"
	"github.com/nixcage/nixcage/internal/tmpfiles"
)

// Throw-away cages (cagectl run). A run is a declared agent made at run
// time: the same config validation, the same renderer, the same units under
// a generated name. Only the agent unit differs in how it is started: as a
// transient unit (StartTransientUnit), because that is the one way systemd
// 252 takes file descriptors — the caller's terminal — for a unit's stdio;
// everything else about it comes from a drop-in rendered for it, so its
// sandbox is byte for byte what a declared agent gets. See docs/run.md.

var _ bus.RunBackend = (*Daemon)(nil)

// run is one throw-away cage.
type run struct {
	name, backend, by string
	uid               uint32
	sender            string    // the caller's unique bus name: the run ends when it leaves
	dir               string    // paths.RunDir, on the host
	started           time.Time // StartRun was called
	up                time.Time // the start job finished
	binds             []verifiedBind
	secretValues      map[string][]byte // until written to dir/secrets
	// auditFrom is where the audit log of the name ended before the run's
	// gateway could write: the log outlives runs, and what an earlier run
	// of the name (or a former declared agent) did is not this run's.
	auditFrom int64
	spared    bool // the name is a spare namespace's (spare.go): its directory is there

	mu     sync.Mutex
	state  reconcile.State
	active bool // the start job finished
	seenUp bool // systemd reported the unit activating or active
	ended  bool // the summary went out; the teardown is under way

	once sync.Once
	done chan struct{}
}

type verifiedBind struct {
	render.Bind
	dev, ino uint64
}

// manifest is the list of files installed for a run, in its directory.
const runManifest = "files.json"

// Limits on what a caller may hand in.
const (
	maxRunSecretBytes = 64 << 10
	maxRunBinds       = 8
	maxRunSecrets     = 4
)

func (d *Daemon) runByName(name string) *run {
	d.mu.RLock()
	defer d.mu.RUnlock()
	return d.runs[name]
}

// StartRun implements bus.RunBackend. It owns the descriptors it is given.
func (d *Daemon) StartRun(ctx context.Context, req bus.RunRequest, stdio [3]dbus.UnixFD, binds []bus.RunBind, secrets []bus.RunSecret, caller bus.Identity, sender string) (string, error) {
	files := make([]*os.File, 0, 3+len(binds)+len(secrets))
	own := func(fd dbus.UnixFD, what string) *os.File {
		f := os.NewFile(uintptr(fd), what)
		files = append(files, f)
		return f
	}
	var stdioF [3]*os.File
	for i, fd := range stdio {
		stdioF[i] = own(fd, "stdio")
	}
	bindF := make([]*os.File, len(binds))
	for i, b := range binds {
		bindF[i] = own(b.FD, b.Dest)
	}
	secretF := make([]*os.File, len(secrets))
	for i, s := range secrets {
		secretF[i] = own(s.FD, s.Name)
	}
	defer func() {
		for _, f := range files {
			f.Close()
		}
	}()

	t0 := time.Now()
	spared := ""
	if req.Name == "" {
		spared = d.claimSpare()
		req.Name = spared
	}
	r, agent, store, err := d.prepareRun(req, spared != "", bindF, binds, secrets, secretF, caller, sender)
	if err != nil {
		if spared != "" {
			d.unclaimSpare(spared)
		}
		return "", err
	}
	r.started = t0
	if err := d.launchRun(ctx, r, agent, store, req, stdioF); err != nil {
		return "", err
	}
	return r.name, nil
}

// prepareRun checks the request, reads secrets, verifies binds and builds
// the run's validated agent. Nothing is written yet.
func (d *Daemon) prepareRun(req bus.RunRequest, spared bool, bindF []*os.File, binds []bus.RunBind, secrets []bus.RunSecret, secretF []*os.File, caller bus.Identity, sender string) (*run, *config.Agent, *config.Store, error) {
	if len(binds) > maxRunBinds || len(secrets) > maxRunSecrets {
		return nil, nil, nil, fmt.Errorf("%w: at most %d binds and %d secrets per run", bus.ErrInvalid, maxRunBinds, maxRunSecrets)
	}
	if req.Backend == "" {
		req.Backend = config.BackendNspawn
	}
	if req.Backend != config.BackendService && req.Backend != config.BackendNspawn {
		return nil, nil, nil, fmt.Errorf("%w: backend %q: throw-away cages run under \"service\" or \"nspawn\"", bus.ErrInvalid, req.Backend)
	}
	if len(req.Command) == 0 || req.Command[0] == "" {
		return nil, nil, nil, fmt.Errorf("%w: no command given (cagectl run -- COMMAND [ARGS...])", bus.ErrInvalid)
	}
	if req.Policy != "" && len(req.Allow) > 0 {
		return nil, nil, nil, fmt.Errorf("%w: give either a policy or hosts to allow, not both", bus.ErrInvalid)
	}
	name := req.Name
	if name == "" {
		name = newRunName()
	}
	if old := d.runByName(name); old != nil && old.isEnded() {
		// Reported but still being torn down (finishRun): wait for it
		// rather than refuse a name its caller is done with.
		select {
		case <-old.done:
		case <-time.After(30 * time.Second):
		}
	}
	if d.config().Agent(name) != nil || d.runByName(name) != nil {
		return nil, nil, nil, fmt.Errorf("%w: %q is already a declared agent or a running cage; choose another --name", bus.ErrInvalid, name)
	}
	// Whether the run's directory is still there (an unfinished
	// teardown) is asked in launchRun, once the name has been validated
	// (runAgent): looked up here, a name with ".." would have caged, as
	// root, tell the caller whether any path exists (red team).
	r := &run{name: name, backend: req.Backend, by: caller.String(), uid: caller.UID, sender: sender,
		dir: d.qdirs.Host(paths.RunDir(name)), done: make(chan struct{}), spared: spared}

	seenDest := map[string]bool{}
	for i, b := range binds {
		vb, err := verifyBind(bindF[i], b)
		if err != nil {
			return nil, nil, nil, fmt.Errorf("%w: %v", bus.ErrInvalid, err)
		}
		if seenDest[vb.Dest] {
			return nil, nil, nil, fmt.Errorf("%w: two binds at %s", bus.ErrInvalid, vb.Dest)
		}
		seenDest[vb.Dest] = true
		r.binds = append(r.binds, vb)
	}

	secretValues := map[string][]byte{}
	doc := runAgentDoc(req, r.name)
	for i, s := range secrets {
		v, err := io.ReadAll(io.LimitReader(secretF[i], maxRunSecretBytes+1))
		if err != nil {
			return nil, nil, nil, fmt.Errorf("%w: secret %s: %v", bus.ErrInvalid, s.Name, err)
		}
		if len(v) > maxRunSecretBytes {
			return nil, nil, nil, fmt.Errorf("%w: secret %s is larger than %d bytes", bus.ErrInvalid, s.Name, maxRunSecretBytes)
		}
		secretValues[s.Name] = v
		entry := map[string]any{"source": filepath.Join(paths.RunDir(r.name), "secrets", s.Name), "env": s.Env}
		if len(req.Allow) > 0 {
			entry["hosts"] = exactHosts(req.Allow)
		}
		doc.secrets[s.Name] = entry
	}
	agent, store, err := d.runAgent(doc)
	if err != nil {
		return nil, nil, nil, err
	}
	r.secretValues = secretValues
	return r, agent, store, nil
}

// verifyBind resolves a directory the caller opened to the host path
// systemd will bind. caged never looks the path up itself (its own
// namespace hides /home and /tmp): the caller's descriptor says what it may
// bind. What the started cage got is checked against the descriptor's
// device and inode (checkBinds).
func verifyBind(f *os.File, b bus.RunBind) (verifiedBind, error) {
	var st syscall.Stat_t
	if err := syscall.Fstat(int(f.Fd()), &st); err != nil {
		return verifiedBind{}, fmt.Errorf("bind %s: %v", b.Dest, err)
	}
	if st.Mode&syscall.S_IFMT != syscall.S_IFDIR {
		return verifiedBind{}, fmt.Errorf("bind %s: not a directory", b.Dest)
	}
	src, err := os.Readlink(fmt.Sprintf("/proc/self/fd/%d", f.Fd()))
	if err != nil {
		return verifiedBind{}, fmt.Errorf("bind %s: resolve the directory: %v", b.Dest, err)
	}
	if err := render.CheckBindPath(src); err != nil {
		return verifiedBind{}, fmt.Errorf("bind %s: %v", b.Dest, err)
	}
	if err := render.CheckBindPath(b.Dest); err != nil {
		return verifiedBind{}, fmt.Errorf("bind destination: %v", err)
	}
	if b.Dest != paths.CageWorkspace && filepath.Dir(b.Dest) != render.ThrowawayMounts {
		return verifiedBind{}, fmt.Errorf("bind destination %s: binds go to %s or %s/NAME", b.Dest, paths.CageWorkspace, render.ThrowawayMounts)
	}
	return verifiedBind{Bind: render.Bind{Source: src, Dest: b.Dest, ReadOnly: b.ReadOnly}, dev: uint64(st.Dev), ino: st.Ino}, nil
}

// runDoc is the synthetic configuration of one run's agent.
type runDoc struct {
	name    string
	req     bus.RunRequest
	secrets map[string]any
}

func runAgentDoc(req bus.RunRequest, name string) *runDoc {
	return &runDoc{name: name, req: req, secrets: map[string]any{}}
}

func exactHosts(hosts []string) []string {
	var out []string
	for _, h := range hosts {
		if !strings.HasPrefix(h, "*") {
			out = append(out, h)
		}
	}
	return out
}

// runAgent validates the run's agent together with caged's own
// configuration (so declared policies resolve and every rule a declared
// agent obeys applies), in HCL's JSON syntax.
func (d *Daemon) runAgent(doc *runDoc) (*config.Agent, *config.Store, error) {
	req := doc.req
	cmd := req.Command
	if !filepath.IsAbs(cmd[0]) {
		// No PATH lookup in a unit: the cage's own shell finds it on the
		// cage's PATH.
		cmd = append([]string{"/bin/sh", "-c", `exec "$0" "$@"`}, cmd...)
	}
	agent := map[string]any{
		"backend":   req.Backend,
		"command":   cmd,
		"autostart": false,
	}
	if req.TTY && req.Term != "" {
		agent["environment"] = map[string]string{"TERM": req.Term}
	}
	if req.Learn {
		// Validated as a declared agent's learn_for would be.
		agent["learn"] = true
		if req.LearnSeconds != 0 {
			agent["learn_for"] = (time.Duration(req.LearnSeconds) * time.Second).String()
		}
	}
	switch {
	case len(req.Allow) > 0:
		pol := map[string]any{"allow": req.Allow}
		if len(doc.secrets) > 0 {
			// A secret is injected only into requests the gateway has
			// inspected.
			pol["inspect"] = exactHosts(req.Allow)
		}
		agent["egress_policy"] = pol
	case req.Policy != "":
		agent["egress"] = req.Policy
	default:
		agent["egress"] = config.DefaultPolicy
	}
	if len(doc.secrets) > 0 {
		agent["secret"] = doc.secrets
	}
	data, err := json.Marshal(map[string]any{"agent": map[string]any{doc.name: agent}})
	if err != nil {
		return nil, nil, err
	}
	own, err := os.ReadFile(d.o.Config)
	if err != nil {
		return nil, nil, fmt.Errorf("read caged's configuration: %w", err)
	}
	l := config.NewLoader()
	cfg, diags := l.Load(config.Source{Name: d.o.Config, Data: own}, config.Source{Name: "cagectl-run.json", Data: data})
	if diags.HasErrors() {
		var msgs []string
		for _, dg := range diags {
			if dg.Detail != "" {
				msgs = append(msgs, dg.Detail)
			} else {
				msgs = append(msgs, dg.Summary)
			}
		}
		return nil, nil, fmt.Errorf("%w: %s", bus.ErrInvalid, strings.Join(msgs, "; "))
	}
	a := cfg.Agent(doc.name)
	if a == nil {
		return nil, nil, fmt.Errorf("%w: the run's agent did not validate", bus.ErrInvalid)
	}
	return a, cfg.Store, nil
}

func lookupGID(uid uint32) uint32 {
	u, err := user.LookupId(strconv.FormatUint(uint64(uid), 10))
	if err != nil {
		return uid
	}
	g, err := strconv.ParseUint(u.Gid, 10, 32)
	if err != nil {
		return uid
	}
	return uint32(g)
}

// launchRun writes the run's files, starts its agent unit attached to the
// caller's descriptors and registers it.
// maxRunsPerCaller bounds the throw-away cages one uid runs at once: each
// is a namespace, a gateway and a cage on the host, and an operator's
// loop of `cagectl run` would otherwise grow them without end (red team).
const maxRunsPerCaller = 8

// registerRun takes the run's name and counts it against its caller's
// bound, both under d.mu, so two requests can never both pass.
func (d *Daemon) registerRun(r *run) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.runs == nil {
		d.runs = map[string]*run{}
	}
	if d.runs[r.name] != nil {
		return fmt.Errorf("%w: %q is already a running cage; choose another --name", bus.ErrInvalid, r.name)
	}
	n := 0
	for _, o := range d.runs {
		if o.uid == r.uid {
			n++
		}
	}
	if n >= maxRunsPerCaller {
		return fmt.Errorf("%w: uid %d already runs %d throw-away cages, the most one caller may run at once; end one first (cagectl status lists them)", bus.ErrBusy, r.uid, n)
	}
	d.runs[r.name] = r
	return nil
}

func (d *Daemon) launchRun(ctx context.Context, r *run, agent *config.Agent, store *config.Store, req bus.RunRequest, stdio [3]*os.File) error {
	userName := "user"
	if id := d.o.Users.Lookup(r.uid); id.User != "" {
		userName = id.User
	}
	t := render.Throwaway{
		Prefix: paths.RunDir(r.name), User: userName, UID: r.uid, GID: lookupGID(r.uid),
		TTY: req.TTY, Transient: true,
	}
	for _, b := range r.binds {
		t.Binds = append(t.Binds, b.Bind)
	}
	files, err := render.RenderThrowaway(agent, store, d.rec.Options, t)
	if err != nil {
		return err
	}
	root := d.o.Root
	if root == "" {
		root = "/"
	}
	// The name is taken here, checked and registered at once, before
	// anything is written: prepareRun's check is only the early answer.
	// Two requests of one name can both pass it (they are served
	// concurrently, and every waiter for a run's teardown is released at
	// the same moment); the second would overwrite the first's manifest,
	// and its failure's teardown would stop the first's cage (red team).
	if err := d.registerRun(r); err != nil {
		return err
	}
	unregister := func() {
		d.mu.Lock()
		if d.runs[r.name] == r {
			delete(d.runs, r.name)
		}
		d.mu.Unlock()
	}
	if _, err := os.Lstat(r.dir); err == nil && !r.spared {
		unregister()
		return fmt.Errorf("%w: a cage named %q is still being torn down; choose another --name", bus.ErrInvalid, r.name)
	}
	d.markAuditStart(r)
	if d.audit != nil {
		d.audit.startAt(r.name, r.auditFrom) // status counts this run's decisions only
	}
	fail := func(err error) error {
		d.teardownRun(context.Background(), d.units, r)
		unregister()
		return err
	}
	// The manifest first, so that whatever is written can be removed.
	var installed []string
	for _, f := range files {
		installed = append(installed, "/"+f.Path)
	}
	for name := range r.secretValues {
		installed = append(installed, filepath.Join(paths.RunDir(r.name), "secrets", name))
	}
	if err := mkdirReadable(r.dir); err != nil {
		unregister()
		return fmt.Errorf("run %s: %w", r.name, err)
	}
	if err := writeRunManifest(filepath.Join(r.dir, runManifest), installed); err != nil {
		return fail(fmt.Errorf("run %s: %w", r.name, err))
	}
	os.Remove(filepath.Join(r.dir, spareMark)) // a spare's namespace is this run's now
	if err := writeRunSecrets(r.dir, r.secretValues); err != nil {
		return fail(fmt.Errorf("run %s: %w", r.name, err))
	}
	r.secretValues = nil
	for _, f := range files {
		if err := mkdirReadable(filepath.Join(root, filepath.Dir(f.Path))); err != nil {
			return fail(fmt.Errorf("run %s: %w", r.name, err))
		}
	}
	if _, err := render.Write(root, files); err != nil {
		return fail(fmt.Errorf("run %s: %w", r.name, err))
	}
	if err := d.prepareRunCage(r, files); err != nil {
		return fail(fmt.Errorf("run %s: %w", r.name, err))
	}
	// No daemon-reload: every unit of the run has a name systemd has never
	// loaded, and systemd 252 rescans its unit directories when it looks
	// up such a name after they changed (checked in checks/system: the
	// /run instance file wins over the /etc template, and the transient
	// unit gets its drop-in). A reload would cost ~half a second and stall
	// every other job on the host.
	d.holdSlices(ctx)
	unit := paths.Instance(paths.AgentTemplate, r.name)
	props := []sdbus.Property{
		sdbus.PropDescription(fmt.Sprintf("nixcage throw-away cage %s (%s backend) for %s", r.name, r.backend, r.by)),
		{Name: "StandardInputFileDescriptor", Value: dbus.MakeVariant(dbus.UnixFD(stdio[0].Fd()))},
		{Name: "StandardOutputFileDescriptor", Value: dbus.MakeVariant(dbus.UnixFD(stdio[1].Fd()))},
		{Name: "StandardErrorFileDescriptor", Value: dbus.MakeVariant(dbus.UnixFD(stdio[2].Fd()))},
	}
	d.log.Info("start throw-away cage", "name", r.name, "backend", r.backend, "by", r.by, "command", req.Command, "binds", len(r.binds),
		"prepared_in", time.Since(r.started).Round(time.Microsecond))
	tStart := time.Now()
	ch := make(chan string, 1)
	if _, err := d.sd.StartTransientUnitContext(ctx, unit, "fail", props, ch); err != nil {
		return fail(fmt.Errorf("run %s: start: %w", r.name, err))
	}
	// systemd has loaded the run's units and queued their jobs.
	queued := time.Since(tStart)
	var job string
	select {
	case job = <-ch:
		if job != "done" && !d.commandRan(ctx, unit) {
			return fail(fmt.Errorf("run %s: the cage did not start (job %s); see journalctl -u %s -u %s", r.name, job, unit, paths.Instance(paths.NetnsTemplate, r.name)))
		}
	case <-ctx.Done():
		return fail(fmt.Errorf("run %s: waiting for the start: %w", r.name, ctx.Err()))
	}
	// A quick command may have ended before the job's result arrived,
	// and its state change been seen already.
	r.mu.Lock()
	r.active = true
	r.up = time.Now()
	d.log.Info("throw-away cage up", "name", r.name, "start_job", r.up.Sub(tStart).Round(time.Microsecond), "queued", queued.Round(time.Microsecond))
	if job != "done" {
		// The command ran and ended before systemd saw its exec complete
		// (a quick non-zero exit under Type=exec fails the start job):
		// it is a run that ended early, with the command's own status.
		r.seenUp = true
		if !isEnded(r.state) {
			r.state = reconcile.State{Load: "loaded", Active: "failed", Sub: "failed"}
		}
	}
	endedEarly := r.seenUp && isEnded(r.state)
	if !r.seenUp {
		r.state = reconcile.State{Load: "loaded", Active: "active", Sub: "running"}
	}
	r.mu.Unlock()
	if err := d.checkBinds(ctx, r, unit); err != nil {
		d.log.Error("throw-away cage got a different directory than the caller opened; killed", "name", r.name, "by", r.by, "err", err)
		d.units.Kill(ctx, unit, int32(syscall.SIGKILL))
		go d.finishRun(r, err.Error())
		return fmt.Errorf("run %s: %w", r.name, err)
	}
	d.emit(bus.SignalRunStarted, r.name, r.backend, r.by)
	if endedEarly {
		go d.finishRun(r, "")
		return nil
	}
	d.publishAgents(ctx)
	go d.superviseRun(r)
	return nil
}

// holdSlices starts the slices systemd puts template instances in
// (system-nixcage\x2dprep.slice, ...) once, so that they stay: otherwise
// a run's teardown empties them, systemd 252 removes them, and a unit of
// the same template starting at that moment (another run, or a declared
// agent) fails with "Failed to attach to cgroup ...: No such file or
// directory" (found by checks/system).
func (d *Daemon) holdSlices(ctx context.Context) {
	d.slicesOnce.Do(func() {
		for _, tpl := range append(reconcile.AgentUnits("x"), paths.Instance(paths.TurnTemplate, "x")) {
			prefix, _, _ := strings.Cut(tpl, "@")
			slice := "system-" + strings.ReplaceAll(prefix, "-", `\x2d`) + ".slice"
			if err := d.units.Start(ctx, slice); err != nil {
				d.log.Warn("hold slice", "slice", slice, "err", err)
			}
		}
	})
}

// checkBinds verifies what the started cage's main process sees: for the
// service backend its root is the cage's, for nspawn the unit's namespace
// in which nspawn makes its binds (bindcheck.go).
func (d *Daemon) checkBinds(ctx context.Context, r *run, unit string) error {
	if len(r.binds) == 0 {
		return nil
	}
	p, err := d.sd.GetServicePropertyContext(ctx, unit, "MainPID")
	if err != nil {
		return fmt.Errorf("read the cage's main process: %w", err)
	}
	pid, _ := p.Value.Value().(uint32)
	if pid == 0 {
		return nil // already gone (systemd reaped it)
	}
	proc, err := pinProcess(int(pid))
	if errors.Is(err, syscall.ESRCH) {
		return nil // already gone
	}
	if err != nil {
		return fmt.Errorf("watch the cage's main process %d: %w", pid, err)
	}
	defer proc.Close()
	return checkBindsOf(proc, r.binds, r.backend, func(b verifiedBind, err error) {
		d.log.Debug("cannot verify a throw-away cage's bind", "name", r.name, "bind", b.Source, "err", err)
	})
}

func writeRunSecrets(dir string, values map[string][]byte) error {
	if len(values) == 0 {
		return nil
	}
	sd := filepath.Join(dir, "secrets")
	if err := os.Mkdir(sd, 0o700); err != nil {
		return fmt.Errorf("secrets: %w", err)
	}
	for name, v := range values {
		if err := os.WriteFile(filepath.Join(sd, name), v, 0o600); err != nil {
			return fmt.Errorf("secret %s: %w", name, err)
		}
	}
	return nil
}

// superviseRun waits for the cage to end: systemd's signals (watchUnits)
// report it at once, the bus reports the caller leaving at once
// (NameOwnerChanged), and a slow poll covers a lost signal.
func (d *Daemon) superviseRun(r *run) {
	unit := paths.Instance(paths.AgentTemplate, r.name)
	left, unwatch := d.watchCaller(r.sender)
	defer unwatch()
	tk := time.NewTicker(5 * time.Second)
	defer tk.Stop()
	check := true // the caller may have left before the match was added
	for {
		if check && r.isEnded() {
			return // cagectl exits on the summary; the teardown is finishRun's
		}
		if check && !d.callerPresent(r.sender) {
			d.log.Info("caller of a throw-away cage left the bus; stopping it", "name", r.name, "by", r.by)
			d.stopRun(r, "the caller left")
			return
		}
		check = false
		select {
		case <-r.done:
			return
		case sig, ok := <-left:
			switch {
			case !ok:
				left = nil // the connection is closing; the poll goes on
			case sig != nil && sig.Name == "org.freedesktop.DBus.NameOwnerChanged" && len(sig.Body) == 3 && sig.Body[0] == r.sender:
				check = true
			}
			continue
		case <-tk.C:
			check = true
		}
		states, err := d.units.States(context.Background(), []string{unit})
		if err != nil {
			continue
		}
		if s := states[unit]; !s.Running() {
			d.finishRun(r, "")
			return
		}
	}
}

// watchCaller delivers the bus's NameOwnerChanged signals about sender (a
// caller's unique name: it changes owner only when the caller leaves), until
// unwatch is called.
func (d *Daemon) watchCaller(sender string) (left chan *dbus.Signal, unwatch func()) {
	left = make(chan *dbus.Signal, 8)
	match := []dbus.MatchOption{dbus.WithMatchSender("org.freedesktop.DBus"), dbus.WithMatchInterface("org.freedesktop.DBus"),
		dbus.WithMatchMember("NameOwnerChanged"), dbus.WithMatchArg(0, sender)}
	if sender == "" || d.conn.AddMatchSignal(match...) != nil {
		return left, func() {}
	}
	d.conn.Signal(left)
	return left, func() {
		d.conn.RemoveSignal(left)
		d.conn.RemoveMatchSignal(match...)
	}
}

func (d *Daemon) callerPresent(sender string) bool {
	if sender == "" {
		return true
	}
	var has bool
	if err := d.conn.BusObject().Call("org.freedesktop.DBus.NameHasOwner", 0, sender).Store(&has); err != nil {
		return true
	}
	return has
}

// runUnitChanged is watchUnits' hook: it reports whether unit belongs to a
// run, and ends the run when its agent unit stops.
func (d *Daemon) runUnitChanged(unit string, s reconcile.State) bool {
	name, ok := agentOfUnit(unit)
	if !ok {
		return false
	}
	r := d.runByName(name)
	if r == nil {
		return false
	}
	if unit != paths.Instance(paths.AgentTemplate, name) {
		return true
	}
	r.mu.Lock()
	if s.Active != "" {
		r.state.Active = s.Active
	}
	if s.Sub != "" {
		r.state.Sub = s.Sub
	}
	if s.Active == "activating" || s.Active == "active" {
		r.seenUp = true
	}
	ended := r.active && r.seenUp && isEnded(s)
	r.mu.Unlock()
	d.emit(bus.SignalAgentStateChanged, name, r.state.Active, r.state.Sub)
	if ended {
		go d.finishRun(r, "")
	}
	return true
}

func (r *run) isEnded() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.ended
}

func isEnded(s reconcile.State) bool { return s.Active == "inactive" || s.Active == "failed" }

// stopRun stops a run's command (the run then finishes as usual).
func (d *Daemon) stopRun(r *run, why string) {
	unit := paths.Instance(paths.AgentTemplate, r.name)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := d.units.Stop(ctx, unit); err != nil && !reconcile.IsNoSuchUnit(err) {
		d.log.Warn("stop throw-away cage", "name", r.name, "why", why, "err", err)
	}
	d.finishRun(r, why)
}

// stopRuns tears every run down when caged stops. caged's own bus
// connections end with its context, so this takes a connection of its
// own; the callers, who can no longer be told, notice caged going away and
// say so.
func (d *Daemon) stopRuns() {
	d.mu.RLock()
	runs := make([]*run, 0, len(d.runs))
	for _, r := range d.runs {
		runs = append(runs, r)
	}
	d.mu.RUnlock()
	d.spareMu.Lock()
	hasSpare := d.spare != nil
	d.noSpare = true
	d.spareMu.Unlock()
	if len(runs) == 0 && !hasSpare {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	sd, err := dialSystemd(ctx, d.o.Systemd)
	if err != nil {
		d.log.Error("stopping: cannot reach systemd; throw-away cages are left for the next caged", "err", err)
		return
	}
	defer sd.Close()
	d.dropSpare(ctx, reconcile.Units{SD: sd})
	for _, r := range runs {
		d.log.Info("caged is stopping: tearing down a throw-away cage", "name", r.name, "by", r.by)
		d.teardownRun(ctx, reconcile.Units{SD: sd}, r)
	}
}

// SignalRun implements bus.RunBackend.
func (d *Daemon) SignalRun(ctx context.Context, name string, signal int32, caller bus.Identity) error {
	r := d.runByName(name)
	if r == nil {
		return fmt.Errorf("%w: no throw-away cage %q is running", bus.ErrNoSuchAgent, name)
	}
	if caller.UID != 0 && caller.UID != r.uid {
		if err := bus.Authorize(d.config().Accounts, caller, bus.ActRun, ""); err != nil {
			return fmt.Errorf("%w: %s may not signal %s's cage", bus.ErrDenied, caller, r.by)
		}
	}
	switch syscall.Signal(signal) {
	case syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP, syscall.SIGQUIT, syscall.SIGKILL:
	default:
		return fmt.Errorf("%w: signal %d: only INT, TERM, HUP, QUIT and KILL are forwarded", bus.ErrInvalid, signal)
	}
	unit := paths.Instance(paths.AgentTemplate, name)
	if err := d.sd.KillUnitWithTarget(ctx, unit, sdbus.Main, signal); err != nil {
		return fmt.Errorf("signal %s: %w", name, err)
	}
	return nil
}

// finishRun reads the command's exit status, reports the summary once the
// gateway's audit is complete, and then tears the cage down. It runs once
// per run.
//
// The summary goes out before the teardown: the caller (cagectl run) exits
// on it, and what the teardown does after — stopping the namespace and the
// sockets, removing files — changes nothing the summary says. The run
// stays registered (not listed by status) until its teardown is done, so
// a run of the same name waits for it instead of colliding with it
// (prepareRun); the run's directory, with the manifest, goes last.
func (d *Daemon) finishRun(r *run, why string) {
	r.once.Do(func() {
		defer close(r.done)
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		unit := paths.Instance(paths.AgentTemplate, r.name)
		sum := bus.RunSummary{Name: r.name, Error: why, Audit: filepath.Join(paths.AuditDir(r.name), "audit.jsonl")}
		sum.Exit, sum.Result = d.exitStatus(ctx, unit)
		tEnd := time.Now()
		d.settleGateway(ctx, r)
		d.auditSummary(r, &sum)
		r.mu.Lock()
		r.ended = true
		r.mu.Unlock()
		js, _ := json.Marshal(sum)
		d.emit(bus.SignalRunFinished, r.name, sum.Exit, string(js))
		tReported := time.Now()
		d.teardownRun(ctx, d.units, r)
		d.mu.Lock()
		if d.runs[r.name] == r {
			delete(d.runs, r.name)
		}
		d.mu.Unlock()
		d.log.Info("throw-away cage ended", "name", r.name, "by", r.by, "exit", sum.Exit, "result", sum.Result,
			"allowed", sum.Allowed, "flagged", sum.Flagged, "blocked", sum.Blocked, "duration", tReported.Sub(r.started).Round(time.Millisecond),
			"ran", tEnd.Sub(r.up).Round(time.Microsecond), "reported", tReported.Sub(tEnd).Round(time.Microsecond),
			"teardown", time.Since(tReported).Round(time.Microsecond))
		d.publishAgents(ctx)
		go d.makeSpare()
	})
}

// settleGateway stops the run's gateway, if a request started it: it writes
// each request's audit record as it decides and a tunnel's when the tunnel
// closes, so once it has stopped, its audit log is complete. (A gateway
// that never started stops at once.)
func (d *Daemon) settleGateway(ctx context.Context, r *run) {
	gw := paths.Instance(paths.EgressTemplate, r.name)
	if err := d.units.Stop(ctx, gw); err != nil && !reconcile.IsNoSuchUnit(err) {
		d.log.Warn("stop the throw-away cage's gateway before its summary", "name", r.name, "err", err)
	}
}

// commandRan reports whether the unit's command itself ran and exited: a
// start job fails too when a command exits non-zero at once, before systemd
// has seen its exec complete. Exit statuses from 200 are systemd's own for a
// command it could not set up (203/EXEC, 219/CGROUP, ...): those did not run.
func (d *Daemon) commandRan(ctx context.Context, unit string) bool {
	props, err := d.sd.GetUnitTypePropertiesContext(ctx, unit, "Service")
	if err != nil {
		return false
	}
	ts, _ := props["ExecMainStartTimestampMonotonic"].(uint64)
	code, _ := props["ExecMainCode"].(int32)
	status, _ := props["ExecMainStatus"].(int32)
	return ts > 0 && code == 1 && status < 200 // CLD_EXITED
}

// exitStatus is the command's exit status as a shell reports it.
func (d *Daemon) exitStatus(ctx context.Context, unit string) (int32, string) {
	props, err := d.sd.GetUnitTypePropertiesContext(ctx, unit, "Service")
	if err != nil {
		return 1, "unknown"
	}
	code, _ := props["ExecMainCode"].(int32)
	status, _ := props["ExecMainStatus"].(int32)
	result, _ := props["Result"].(string)
	switch code {
	case 1: // CLD_EXITED
		return status, result
	case 2, 3: // CLD_KILLED, CLD_DUMPED
		return 128 + status, result
	}
	if result != "" && result != "success" {
		return 1, result
	}
	return 0, result
}

// teardownRun stops every unit of the run and removes every file it
// installed (from its manifest) and its state, except the audit log. If
// the units could not be stopped, the files stay: the manifest is how the
// next caged finds the run to tear down.
func (d *Daemon) teardownRun(ctx context.Context, units reconcile.Units, r *run) {
	// One job: stopping the namespace stops everything bound to it
	// (sockets and agent: BindsTo=, gateway: Requires= on the sockets), and
	// the prepare step then stops as unneeded. A failed unit is then reset
	// so that systemd forgets it.
	netns := paths.Instance(paths.NetnsTemplate, r.name)
	if err := units.Stop(ctx, netns); err != nil && !reconcile.IsNoSuchUnit(err) {
		d.log.Error("teardown: stop; left for the next caged", "unit", netns, "err", err)
		return
	}
	us := reconcile.AgentUnits(r.name)
	// Only units systemd still has loaded: asking for one by name would
	// load it again (the transient agent systemd already forgot, from its
	// drop-in and the template, logging that its transient file is gone).
	loaded, _ := units.SD.ListUnitsByPatternsContext(ctx, nil, us)
	states := map[string]reconcile.State{}
	for _, s := range loaded {
		states[s.Name] = reconcile.State{Load: s.LoadState, Active: s.ActiveState, Sub: s.SubState}
	}
	for _, u := range us {
		s := states[u]
		if s.Running() {
			// Not bound to the namespace after all (a unit changed): stop it.
			if err := units.Stop(ctx, u); err != nil && !reconcile.IsNoSuchUnit(err) {
				d.log.Warn("teardown: stop", "unit", u, "err", err)
			}
		}
		if s.Active == "failed" {
			_ = units.SD.ResetFailedUnitContext(ctx, u)
		}
	}
	root := d.o.Root
	for _, p := range readRunManifest(filepath.Join(r.dir, runManifest)) {
		hp := filepath.Join(root, p)
		if err := os.Remove(hp); err != nil && !errors.Is(err, os.ErrNotExist) {
			d.log.Warn("teardown: remove", "path", hp, "err", err)
		}
		if strings.HasSuffix(filepath.Dir(p), ".service.d") {
			os.Remove(filepath.Dir(hp))
		}
	}
	// The run's directory last: its manifest is how a later caged finds
	// an unfinished teardown, and its absence says this one is done.
	for _, p := range []string{paths.EgressState(r.name), paths.Runtime(r.name), paths.RunDir(r.name)} {
		if err := os.RemoveAll(d.qdirs.Host(p)); err != nil {
			d.log.Warn("teardown: remove", "path", p, "err", err)
		}
	}
}

// markAuditStart notes where the audit log of the run's name ends now,
// before any unit of the run starts: the run's records come after it.
func (d *Daemon) markAuditStart(r *run) {
	if fi, err := os.Lstat(d.qdirs.AuditFile(r.name)); err == nil && fi.Mode().IsRegular() {
		r.auditFrom = fi.Size()
	}
}

// auditSummary counts the run's egress decisions from its audit log: every
// record from the run's start on. The whole of it, one bounded read after
// the other: a cage that fills its log with allowed requests (which have
// no budget) before a refusal must not push that refusal out of the
// summary. The gateway has stopped (settleGateway), so the log no longer
// grows.
func (d *Daemon) auditSummary(r *run, sum *bus.RunSummary) {
	hosts := map[string]bool{}
	for offset := r.auditFrom; ; {
		lines, next, err := auditlog.Read(d.qdirs.AuditFile(r.name), offset, 100000)
		if err != nil || next <= offset {
			break // the end, or a log rotated under it (Read starts again at 0)
		}
		offset = next
		for _, l := range lines {
			var rec auditlog.Record
			if json.Unmarshal([]byte(l), &rec) != nil {
				continue
			}
			n := rec.Decisions() // 0 for a tunnel's close record
			switch rec.Decision {
			case auditlog.Allowed:
				sum.Allowed += n
			case auditlog.Flagged:
				sum.Flagged += n
			case auditlog.Blocked:
				sum.Blocked += n
				if rec.Host != "" {
					hosts[rec.Host] = true
				}
			}
		}
	}
	sum.BlockedHosts = []string{}
	for h := range hosts {
		sum.BlockedHosts = append(sum.BlockedHosts, h)
	}
	sort.Strings(sum.BlockedHosts)
}

// runStatuses are the running throw-away cages as status lists them.
func (d *Daemon) runStatuses() []bus.AgentStatus {
	d.mu.RLock()
	runs := make([]*run, 0, len(d.runs))
	for _, r := range d.runs {
		runs = append(runs, r)
	}
	d.mu.RUnlock()
	sort.Slice(runs, func(i, j int) bool { return runs[i].name < runs[j].name })
	out := make([]bus.AgentStatus, 0, len(runs))
	for _, r := range runs {
		r.mu.Lock()
		st, ended := r.state, r.ended
		r.mu.Unlock()
		if ended {
			continue // reported; only its teardown is left
		}
		as := bus.AgentStatus{Name: r.name, Backend: r.backend, Unit: paths.Instance(paths.AgentTemplate, r.name),
			LoadState: st.Load, ActiveState: st.Active, SubState: st.Sub, RunBy: r.by}
		if d.audit != nil {
			as.Allowed, as.Flagged, as.Blocked = d.audit.counts(r.name)
		}
		as.LearnUntilUnix = d.learnUntil(r.name)
		out = append(out, as)
	}
	return out
}

// cleanupOrphanRuns tears down runs a previous caged left behind (it
// crashed or was restarted while they ran): their callers' sessions are
// gone with it.
func (d *Daemon) cleanupOrphanRuns(ctx context.Context) {
	ents, err := os.ReadDir(d.qdirs.Host(paths.RunsRoot))
	if err != nil {
		return
	}
	for _, e := range ents {
		r := &run{name: e.Name(), dir: d.qdirs.Host(paths.RunDir(e.Name()))}
		d.log.Warn("tearing down a throw-away cage left by a previous caged", "name", r.name)
		d.teardownRun(ctx, d.units, r)
	}
}

// The manifest is written before anything else, so even a caged killed
// mid-start leaves a list of what to remove.
func writeRunManifest(p string, files []string) error {
	b, err := json.Marshal(files)
	if err != nil {
		return err
	}
	return os.WriteFile(p, b, 0o600)
}

func readRunManifest(p string) []string {
	var files []string
	if b, err := os.ReadFile(p); err == nil {
		json.Unmarshal(b, &files)
	}
	return files
}

// mkdirReadable makes dir and its missing parents 0755 whatever caged's
// umask (its unit's UMask=0077): the gateway and the prepare step read the
// run's configuration as other users.
func mkdirReadable(dir string) error { return tmpfiles.MkdirAll(dir) }
