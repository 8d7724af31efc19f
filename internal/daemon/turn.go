package daemon

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	sdbus "github.com/coreos/go-systemd/v22/dbus"
	"github.com/godbus/dbus/v5"
	sys "golang.org/x/sys/unix"

	"github.com/nixcage/nixcage/internal/bus"
	"github.com/nixcage/nixcage/internal/config"
	"github.com/nixcage/nixcage/internal/paths"
	"github.com/nixcage/nixcage/internal/reconcile"
	"github.com/nixcage/nixcage/internal/render"
)

// Turns (docs/relay.md): one run of an agent's turn command inside its
// cage, as a transient unit whose whole configuration is a drop-in
// rendered by the agent's own renderer (render.RenderTurn), so it has the
// agent's walls. The text reaches it as a sealed memfd on stdin: it is
// never part of a command line nor seen by a shell. Turns of one agent run
// one at a time, in call order (turnLane).

var _ bus.TurnBackend = (*Daemon)(nil)

// turnStderrTail is how much of a failed turn's stderr the reply carries.
const turnStderrTail = 4 << 10

// turnPoll is how often a running turn's unit state is read. The command's
// end is usually seen sooner: its stdout closes.
const turnPoll = 250 * time.Millisecond

// turnLane queues one agent's turns: one runs, at most bus.MaxQueuedTurns
// wait, first come first served.
type turnLane struct {
	mu      sync.Mutex
	busy    bool
	waiting []chan struct{}
	cancel  context.CancelFunc // of the running turn (quarantine, kill)
}

// acquire waits for the lane. A full queue is bus.ErrBusy; a caller whose
// ctx ends while waiting leaves the queue.
func (l *turnLane) acquire(ctx context.Context, agent string) error {
	l.mu.Lock()
	if !l.busy {
		l.busy = true
		l.mu.Unlock()
		return nil
	}
	if len(l.waiting) >= bus.MaxQueuedTurns {
		l.mu.Unlock()
		return fmt.Errorf("%w: agent %s has a turn running and %d waiting (the most); try again when one has finished", bus.ErrBusy, agent, bus.MaxQueuedTurns)
	}
	ch := make(chan struct{})
	l.waiting = append(l.waiting, ch)
	l.mu.Unlock()
	select {
	case <-ch:
		return nil
	case <-ctx.Done():
		l.mu.Lock()
		for i, w := range l.waiting {
			if w == ch {
				l.waiting = append(l.waiting[:i], l.waiting[i+1:]...)
				l.mu.Unlock()
				return ctx.Err()
			}
		}
		l.mu.Unlock()
		// Handed the lane just now: pass it on.
		l.release()
		return ctx.Err()
	}
}

// release hands the lane to the first waiting turn, or frees it.
func (l *turnLane) release() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.cancel = nil
	if len(l.waiting) > 0 {
		ch := l.waiting[0]
		l.waiting = l.waiting[1:]
		close(ch)
		return
	}
	l.busy = false
}

func (d *Daemon) lane(agent string) *turnLane {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.turns == nil {
		d.turns = map[string]*turnLane{}
	}
	l := d.turns[agent]
	if l == nil {
		l = &turnLane{}
		d.turns[agent] = l
	}
	return l
}

// cancelTurn ends agent's running turn, if any (quarantine, kill): its
// status is then canceled.
func (d *Daemon) cancelTurn(agent string) {
	d.mu.RLock()
	l := d.turns[agent]
	d.mu.RUnlock()
	if l == nil {
		return
	}
	l.mu.Lock()
	if l.cancel != nil {
		l.cancel()
	}
	l.mu.Unlock()
}

// Turn implements bus.TurnBackend.
func (d *Daemon) Turn(ctx context.Context, agent, text, by string) (bus.TurnResult, error) {
	a, argv, err := d.turnCommand(agent, text)
	if err == nil {
		err = d.refuseQuarantined(agent)
	}
	if err != nil {
		d.turnRefused(agent, by, err)
		return bus.TurnResult{}, err
	}
	l := d.lane(agent)
	if err := l.acquire(ctx, agent); err != nil {
		d.turnRefused(agent, by, err)
		return bus.TurnResult{}, err
	}
	defer l.release()
	// The wait may have been long: a quarantine since then wins.
	if err := d.refuseQuarantined(agent); err != nil {
		d.turnRefused(agent, by, err)
		return bus.TurnResult{}, err
	}
	tctx, cancel := context.WithCancel(ctx)
	defer cancel()
	l.mu.Lock()
	l.cancel = cancel
	l.mu.Unlock()

	d.emit(bus.SignalTurnStarted, agent, by)
	d.log.Info("turn started", "agent", agent, "by", by, "text_bytes", len(text))
	t0 := time.Now()
	res, err := d.runTurn(tctx, a, argv, text)
	ms := uint64(time.Since(t0).Milliseconds())
	if err != nil {
		d.log.Warn("turn could not run", "agent", agent, "by", by, "err", err)
		d.emit(bus.SignalTurnFinished, agent, by, bus.TurnRefused, int32(-1), ms)
		return bus.TurnResult{}, err
	}
	d.log.Info("turn finished", "agent", agent, "by", by, "status", res.Status, "exit", res.Exit, "reply_bytes", len(res.Reply), "duration_ms", ms)
	d.emit(bus.SignalTurnFinished, agent, by, res.Status, res.Exit, ms)
	return res, nil
}

// turnRefused audits a turn that did not run.
func (d *Daemon) turnRefused(agent, by string, err error) {
	d.log.Warn("turn refused", "agent", agent, "by", by, "err", err)
	d.emit(bus.SignalTurnFinished, agent, by, bus.TurnRefused, int32(-1), uint64(0))
}

// turnCommand checks that a turn can run: a declared agent with a turn
// command, and text within bounds.
func (d *Daemon) turnCommand(agent, text string) (*config.Agent, []string, error) {
	if err := d.refuseRun(agent, "given a turn"); err != nil {
		return nil, nil, err
	}
	a := d.config().Agent(agent)
	if a == nil {
		return nil, nil, fmt.Errorf("%w: %q", bus.ErrNoSuchAgent, agent)
	}
	if strings.TrimSpace(text) == "" {
		return nil, nil, fmt.Errorf("%w: the text of a turn is empty", bus.ErrInvalid)
	}
	if len(text) > bus.MaxTurnText {
		return nil, nil, fmt.Errorf("%w: the text is %d bytes; a turn takes at most %d", bus.ErrInvalid, len(text), bus.MaxTurnText)
	}
	argv := a.TurnArgv()
	if len(argv) == 0 {
		why := "it has no harness"
		if a.Harness != "" {
			why = "its harness " + a.Harness + " has no tested turn command"
		}
		return nil, nil, fmt.Errorf("%w: agent %s takes no turns: %s; declare turn_command = [...] (the text comes on its stdin; docs/relay.md)", bus.ErrInvalid, agent, why)
	}
	return a, argv, nil
}

// runTurn starts the turn's unit with the text on stdin, waits for it to
// end (or the timeout, or ctx), and collects its output. An error means the
// turn never ran.
func (d *Daemon) runTurn(ctx context.Context, a *config.Agent, argv []string, text string) (bus.TurnResult, error) {
	unit := paths.Instance(paths.TurnTemplate, a.Name)
	if err := d.installTurn(a, argv); err != nil {
		return bus.TurnResult{}, err
	}
	d.holdSlices(ctx)
	d.clearTurnUnit(ctx, unit)

	stdin, err := textFile(text)
	if err != nil {
		return bus.TurnResult{}, fmt.Errorf("turn of %s: %w", a.Name, err)
	}
	defer stdin.Close()
	outR, outW, err := os.Pipe()
	if err != nil {
		return bus.TurnResult{}, fmt.Errorf("turn of %s: %w", a.Name, err)
	}
	defer outR.Close()
	errR, errW, err := os.Pipe()
	if err != nil {
		outW.Close()
		return bus.TurnResult{}, fmt.Errorf("turn of %s: %w", a.Name, err)
	}
	defer errR.Close()
	props := []sdbus.Property{
		sdbus.PropDescription("nixcage turn of agent " + a.Name),
		{Name: "StandardInputFileDescriptor", Value: dbus.MakeVariant(dbus.UnixFD(stdin.Fd()))},
		{Name: "StandardOutputFileDescriptor", Value: dbus.MakeVariant(dbus.UnixFD(outW.Fd()))},
		{Name: "StandardErrorFileDescriptor", Value: dbus.MakeVariant(dbus.UnixFD(errW.Fd()))},
	}
	out := &replyBuffer{max: bus.MaxTurnReply}
	tail := &tailBuffer{max: turnStderrTail}
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); io.Copy(out, outR) }()
	go func() { defer wg.Done(); io.Copy(tail, errR) }()

	ch := make(chan string, 1)
	_, err = d.sd.StartTransientUnitContext(ctx, unit, "fail", props, ch)
	// systemd holds its own copies now; the turn's end closes the pipes.
	outW.Close()
	errW.Close()
	if err != nil && ctx.Err() != nil {
		// The caller left (or the agent was killed) while systemd was
		// starting the unit: the start may have gone through with only
		// its answer lost, so the unit is stopped, and the turn was
		// canceled, not refused (TestTurnCallerLeavesDuringTheStart).
		d.stopTurnUnit(unit)
		return bus.TurnResult{Status: bus.TurnCanceled, Exit: bus.ExitCanceled}, nil
	}
	if err != nil {
		return bus.TurnResult{}, fmt.Errorf("turn of %s: start %s: %w", a.Name, unit, err)
	}
	select {
	case res := <-ch:
		if res != "done" {
			d.stopTurnUnit(unit)
			return bus.TurnResult{}, fmt.Errorf("turn of %s: %s did not start (job %s); see journalctl -u %s", a.Name, unit, res, unit)
		}
	case <-ctx.Done():
		d.stopTurnUnit(unit)
		return bus.TurnResult{Status: bus.TurnCanceled, Exit: bus.ExitCanceled}, nil
	}

	status := d.waitTurn(ctx, unit, a.TurnTimeout)
	var res bus.TurnResult
	switch status {
	case bus.TurnTimeout:
		res = bus.TurnResult{Status: bus.TurnTimeout, Exit: bus.ExitTimeout}
	case bus.TurnCanceled:
		res = bus.TurnResult{Status: bus.TurnCanceled, Exit: bus.ExitCanceled}
	default:
		ectx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		code, result := d.exitStatus(ectx, unit)
		cancel()
		res = bus.TurnResult{Status: bus.TurnSuccess, Exit: code}
		switch {
		case result == "timeout":
			res = bus.TurnResult{Status: bus.TurnTimeout, Exit: bus.ExitTimeout}
		case code != 0 || (result != "" && result != "success"):
			res.Status = bus.TurnFailed
		}
	}
	// Stopping the unit kills whatever the command left behind, which also
	// closes the pipes' last writers.
	d.stopTurnUnit(unit)
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		// A writer outlived the unit (it cannot: its cgroup is gone); the
		// deferred closes end the copies.
		d.log.Warn("turn output still open after its unit stopped", "agent", a.Name)
	}
	res.Reply = out.String()
	if res.Status != bus.TurnSuccess && tail.Len() > 0 {
		if res.Reply != "" && !strings.HasSuffix(res.Reply, "\n") {
			res.Reply += "\n"
		}
		res.Reply += "--- stderr ---\n" + tail.String()
	}
	res.Reply = busString(res.Reply)
	return res, nil
}

// busString makes the harness's output a string D-Bus can carry: valid
// UTF-8 without NUL (the spec's rule, which godbus enforces by replacing
// the whole reply with an error). Invalid bytes (a binary dump, a cut at
// the reply limit or in the stderr tail inside a character) and NULs
// become U+FFFD; everything else is the reply as printed.
func busString(s string) string {
	if utf8.ValidString(s) && !strings.Contains(s, "\x00") {
		return s
	}
	return strings.ReplaceAll(strings.ToValidUTF8(s, "\uFFFD"), "\x00", "\uFFFD")
}

// installTurn writes the turn unit's drop-in (render.RenderTurn) for the
// agent as declared now.
func (d *Daemon) installTurn(a *config.Agent, argv []string) error {
	f, err := render.RenderTurn(d.config(), a.Name, d.renderedOptions(), argv)
	if err != nil {
		return err
	}
	root := d.o.Root
	if root == "" {
		root = "/"
	}
	if err := mkdirReadable(root + "/" + strings.TrimSuffix(f.Path, "/50-cage.conf")); err != nil {
		return fmt.Errorf("turn of %s: %w", a.Name, err)
	}
	if _, err := render.Write(root, []render.File{f}); err != nil {
		return fmt.Errorf("turn of %s: %w", a.Name, err)
	}
	return nil
}

// renderedOptions are the options the agents' units were rendered with:
// caged's own in render mode; under --units os those the installed tree
// records (render.OptionsFile under /etc: NixOS and cagectl render --out
// /etc), as the tool paths there (NixOS store paths) are not caged's.
func (d *Daemon) renderedOptions() render.Options {
	if d.o.Units != reconcile.ModeOS {
		return d.rec.Options
	}
	o := render.DefaultOptions()
	o.BinDir = d.o.BinDir
	b, err := os.ReadFile(d.qdirs.Host(filepath.Join(paths.DefaultPrefix, render.OptionsFile)))
	if err == nil {
		err = json.Unmarshal(b, &o)
	}
	if err != nil {
		d.log.Warn("no recorded render options; rendering turns with the defaults", "file", filepath.Join(paths.DefaultPrefix, render.OptionsFile), "err", err)
	}
	return o
}

// clearTurnUnit stops and forgets a turn unit a previous caged left (it
// died mid-turn): only one turn of an agent runs at a time, so any unit of
// that name now is stale.
func (d *Daemon) clearTurnUnit(ctx context.Context, unit string) {
	st, err := d.units.States(ctx, []string{unit})
	if err != nil {
		return
	}
	if s := st[unit]; s.Active != "" && s.Active != "inactive" {
		d.log.Warn("stopping a turn left running by a previous caged", "unit", unit, "state", s.Active)
		d.stopTurnUnit(unit)
	}
}

// stopTurnUnit stops the unit (a transient unit is then unloaded) and
// resets it if it failed, so the next turn can reuse the name.
func (d *Daemon) stopTurnUnit(unit string) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := d.units.Stop(ctx, unit); err != nil && !reconcile.IsNoSuchUnit(err) {
		d.log.Warn("stop turn", "unit", unit, "err", err)
	}
	_ = d.sd.ResetFailedUnitContext(ctx, unit)
}

// waitTurn waits until the unit's command ended ("" then), the timeout
// passed (bus.TurnTimeout) or ctx ended (bus.TurnCanceled).
func (d *Daemon) waitTurn(ctx context.Context, unit string, timeout time.Duration) string {
	if timeout <= 0 {
		timeout = config.DefaultTurnTimeout
	}
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	tk := time.NewTicker(turnPoll)
	defer tk.Stop()
	for {
		select {
		case <-ctx.Done():
			return bus.TurnCanceled
		case <-deadline.C:
			return bus.TurnTimeout
		case <-tk.C:
		}
		st, err := d.units.States(ctx, []string{unit})
		if err != nil {
			continue
		}
		// RemainAfterExit=yes: "active (exited)" once the command ended
		// well, "failed" otherwise; "inactive" if it is already gone.
		if s := st[unit]; s.Sub == "exited" || s.Active == "failed" || s.Active == "inactive" {
			return ""
		}
	}
}

// textFile is a sealed memfd holding text, at offset 0: the turn reads it
// as its stdin, and nothing (not even caged) can change it meanwhile.
func textFile(text string) (*os.File, error) {
	fd, err := sys.MemfdCreate("nixcage-turn-text", sys.MFD_CLOEXEC|sys.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, fmt.Errorf("memfd: %w", err)
	}
	f := os.NewFile(uintptr(fd), "turn text")
	if _, err := f.WriteString(text); err != nil {
		f.Close()
		return nil, fmt.Errorf("memfd: %w", err)
	}
	if err := seal(f); err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

// seal makes a memfd immutable and rewinds it.
func seal(f *os.File) error {
	if _, err := sys.FcntlInt(f.Fd(), sys.F_ADD_SEALS, sys.F_SEAL_SEAL|sys.F_SEAL_SHRINK|sys.F_SEAL_GROW|sys.F_SEAL_WRITE); err != nil {
		return fmt.Errorf("seal memfd: %w", err)
	}
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		return fmt.Errorf("memfd: %w", err)
	}
	return nil
}

// replyBuffer keeps the first max bytes written and counts the rest, which
// it drops: the writer (the turn) never blocks on a full pipe.
type replyBuffer struct {
	mu      sync.Mutex
	max     int
	buf     bytes.Buffer
	dropped int64
}

func (b *replyBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	keep := min(len(p), b.max-b.buf.Len())
	b.buf.Write(p[:keep])
	b.dropped += int64(len(p) - keep)
	return len(p), nil
}

func (b *replyBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	s := b.buf.String()
	if b.dropped > 0 {
		if !strings.HasSuffix(s, "\n") {
			s += "\n"
		}
		s += fmt.Sprintf("[nixcage: reply truncated, %d more bytes]\n", b.dropped)
	}
	return s
}

// tailBuffer keeps the last max bytes written.
type tailBuffer struct {
	mu  sync.Mutex
	max int
	buf []byte
}

func (b *tailBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.buf = append(b.buf, p...)
	if len(b.buf) > b.max {
		b.buf = append([]byte(nil), b.buf[len(b.buf)-b.max:]...)
	}
	return len(p), nil
}

func (b *tailBuffer) Len() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.buf)
}

func (b *tailBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return string(b.buf)
}
