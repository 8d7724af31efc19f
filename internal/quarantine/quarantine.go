// Package quarantine takes a misbehaving agent out of service and preserves
// what it did: a mark file that systemd itself honours (agent units carry
// ConditionPathExists=! on it, so the agent stays down across caged restarts
// and reboots), its cgroup frozen or stopped, its egress cut, and an evidence
// directory with a copy of its workspace, its audit records and a status
// snapshot, all listed in a SHA-256 manifest that `sha256sum -c` verifies.
//
// Invariant: the mark is written first and removed only by Release. Any
// failure after it leaves the agent quarantined (down) and is reported; a
// quarantine never half-applies silently.
package quarantine

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/godbus/dbus/v5"

	"github.com/nixcage/nixcage/internal/paths"
	"github.com/nixcage/nixcage/internal/reconcile"
)

// Dirs locate quarantine state on the host. Root is prepended to every path
// ("" means "/"); tests use a temporary directory.
type Dirs struct {
	Root string
}

func (d Dirs) host(p string) string {
	if d.Root == "" {
		return p
	}
	return filepath.Join(d.Root, p)
}

// MarkPath is the host path of agent's mark.
func (d Dirs) MarkPath(agent string) string { return d.host(paths.QuarantineMark(agent)) }

// EvidenceRoot is where evidence directories are created.
func (d Dirs) EvidenceRoot() string { return d.host(paths.EvidenceRoot) }

// AuditFile is the gateway's JSONL audit log for agent.
func (d Dirs) AuditFile(agent string) string {
	return d.host(filepath.Join(paths.AuditDir(agent), "audit.jsonl"))
}

// Host maps an absolute host path (a workspace) under Root.
func (d Dirs) Host(p string) string { return d.host(p) }

// Mark is the content of a mark file.
type Mark struct {
	Agent    string    `json:"agent"`
	Reason   string    `json:"reason"`
	By       string    `json:"by"`
	At       time.Time `json:"at"`
	Evidence string    `json:"evidence,omitempty"`
}

// ErrAlreadyQuarantined is returned when quarantining a quarantined agent.
var ErrAlreadyQuarantined = errors.New("agent is already quarantined")

// Read returns agent's mark, or nil when it is not quarantined. A mark that
// exists but cannot be parsed still counts (systemd only checks existence).
func Read(d Dirs, agent string) (*Mark, error) {
	b, err := os.ReadFile(d.MarkPath(agent))
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("read quarantine mark: %w", err)
	}
	m := &Mark{Agent: agent}
	if err := json.Unmarshal(b, m); err != nil {
		m.Reason = "(unreadable mark: " + err.Error() + ")"
	}
	return m, nil
}

// List returns the marks of every quarantined agent, reading the mark
// directory once (status for a thousand agents must not open a thousand
// files).
func List(d Dirs) (map[string]*Mark, error) {
	dir := filepath.Dir(d.MarkPath("x"))
	ents, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return map[string]*Mark{}, nil
	}
	if err != nil {
		return nil, fmt.Errorf("quarantine marks: %w", err)
	}
	out := make(map[string]*Mark, len(ents))
	for _, e := range ents {
		name := e.Name()
		if strings.HasPrefix(name, ".") {
			continue // a mark being written
		}
		if m, err := Read(d, name); err == nil && m != nil {
			out[name] = m
		}
	}
	return out, nil
}

// Quarantined reports whether agent's mark exists.
func Quarantined(d Dirs, agent string) bool {
	_, err := os.Lstat(d.MarkPath(agent))
	return err == nil
}

// place writes the mark durably: the agent must stay down even if the host
// loses power right after. A first mark is linked into place, which fails
// if one exists: two quarantines of one agent cannot both proceed.
func place(d Dirs, m *Mark, first bool) error {
	p := d.MarkPath(m.Agent)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		return fmt.Errorf("quarantine mark: %w", err)
	}
	b, err := json.MarshalIndent(m, "", "  ")
	if err != nil {
		return err
	}
	tmp, err := os.CreateTemp(filepath.Dir(p), ".mark-*")
	if err != nil {
		return fmt.Errorf("quarantine mark: %w", err)
	}
	defer os.Remove(tmp.Name())
	_, werr := tmp.Write(append(b, '\n'))
	if werr == nil {
		werr = tmp.Chmod(0o644)
	}
	if werr == nil {
		werr = tmp.Sync()
	}
	if cerr := tmp.Close(); werr == nil {
		werr = cerr
	}
	if werr == nil && first {
		werr = os.Link(tmp.Name(), p)
		if errors.Is(werr, os.ErrExist) {
			return ErrAlreadyQuarantined
		}
	} else if werr == nil {
		werr = os.Rename(tmp.Name(), p)
	}
	if werr != nil {
		return fmt.Errorf("quarantine mark: %w", werr)
	}
	if dir, err := os.Open(filepath.Dir(p)); err == nil {
		dir.Sync()
		dir.Close()
	}
	return nil
}

// Request describes one quarantine.
type Request struct {
	Agent     string
	Reason    string
	By        string // who asked (user name and uid)
	Workspace string // host path, as declared in the config
	// Status is a snapshot of the agent's state, stored as status.json.
	Status any
	// Limits bound the evidence copy (zero fields: the defaults).
	Limits Limits
	// Contained, if set, is called once the agent is down and cut off,
	// before its evidence is copied (caged logs it; tests order on it).
	Contained func()
	Now       func() time.Time
	Log       *slog.Logger
}

func (r Request) clock() func() time.Time {
	if r.Now != nil {
		return r.Now
	}
	return time.Now
}

func (r Request) logger() *slog.Logger {
	if r.Log != nil {
		return r.Log
	}
	return slog.Default()
}

// Result says what a quarantine did.
type Result struct {
	Mark     *Mark
	Frozen   bool // the cgroup was frozen before anything else
	Evidence *Evidence
}

// Run quarantines an agent: Contain it (mark, halt, cut egress, stop), then
// collect its evidence, bounded by req.Limits. It holds no lock shared with
// other agents: quarantines of different agents run side by side, and a
// slow copy delays only its own reply.
func Run(ctx context.Context, u reconcile.Units, d Dirs, req Request) (*Result, error) {
	now, lg := req.clock(), req.logger()
	res, err := Contain(ctx, u, d, req)
	if res == nil {
		return nil, err
	}
	var errs []error
	if err != nil {
		errs = append(errs, err)
	}
	if req.Contained != nil {
		req.Contained()
	}
	ev, err := Collect(d, Collection{
		Agent: req.Agent, Workspace: req.Workspace, Mark: res.Mark, Status: req.Status, Now: now(), Limits: req.Limits,
	})
	if err != nil {
		errs = append(errs, err)
	} else {
		res.Evidence = ev
		res.Mark.Evidence = ev.Dir
		if err := place(d, res.Mark, false); err != nil {
			errs = append(errs, err)
		}
		lg.Info("evidence collected", "agent", req.Agent, "dir", ev.Dir, "files", ev.Files, "bytes", ev.Bytes, "omitted", ev.Omitted, "stopped", ev.Stopped)
	}
	// Cut once more: a reconcile that read unit states before the mark
	// existed may have restarted the gateway meanwhile. Stopping a stopped
	// unit is a no-op.
	errs = append(errs, cutEgress(ctx, u, req.Agent)...)
	if err := errors.Join(errs...); err != nil {
		return res, fmt.Errorf("quarantine %s (the agent stays marked and will not start): %w", req.Agent, err)
	}
	return res, nil
}

// Contain marks the agent and takes it down, in this order:
//
//  1. the mark (systemd refuses to start a marked agent from now on);
//  2. freeze its cgroup, so it cannot react to what follows;
//     where freezing is unavailable (cgroup v1), SIGKILL it instead;
//  3. cut its egress: the gateway and both listeners;
//  4. stop it: SIGKILL reaches a frozen cgroup, then the stop job cleans
//     up (a thaw first would let it run its SIGTERM handler on the
//     workspace before the copy);
//  5. thaw only if the unit is still loaded and active; an agent already
//     gone is done, not an error.
//
// Errors are real failures only; the result is nil only if no mark was
// placed.
func Contain(ctx context.Context, u reconcile.Units, d Dirs, req Request) (*Result, error) {
	now, lg := req.clock(), req.logger()
	m := &Mark{Agent: req.Agent, Reason: req.Reason, By: req.By, At: now().UTC()}
	if err := place(d, m, true); err != nil {
		if errors.Is(err, ErrAlreadyQuarantined) {
			if old, _ := Read(d, req.Agent); old != nil {
				return nil, fmt.Errorf("%w (since %s by %s: %s); release it first", ErrAlreadyQuarantined, old.At.Format(time.RFC3339), old.By, old.Reason)
			}
		}
		return nil, err
	}
	lg.Warn("agent quarantined", "agent", req.Agent, "reason", req.Reason, "by", req.By)
	res := &Result{Mark: m}
	agentUnit := paths.Instance(paths.AgentTemplate, req.Agent)

	var errs []error
	if err := u.Freeze(ctx, agentUnit); err == nil {
		res.Frozen = true
	} else if !isGone(err) {
		lg.Info("freeze unavailable, killing agent", "agent", req.Agent, "err", err)
		if err := kill(ctx, u, agentUnit); err != nil {
			errs = append(errs, err)
		}
	}
	errs = append(errs, cutEgress(ctx, u, req.Agent)...)
	if res.Frozen {
		if err := kill(ctx, u, agentUnit); err != nil {
			errs = append(errs, err)
		}
	}
	if err := u.Stop(ctx, agentUnit); err != nil && !reconcile.IsNoSuchUnit(err) {
		errs = append(errs, err)
	}
	if res.Frozen {
		st, err := u.States(ctx, []string{agentUnit})
		if err != nil {
			errs = append(errs, err)
		} else if s := st[agentUnit]; s.Load == "loaded" && s.Active != "inactive" && s.Active != "failed" {
			if err := u.Thaw(ctx, agentUnit); err != nil && !isGone(err) {
				errs = append(errs, err)
			}
		}
	}
	return res, errors.Join(errs...)
}

// cutEgress stops the agent's gateway and both listeners.
func cutEgress(ctx context.Context, u reconcile.Units, agent string) []error {
	var errs []error
	for _, unit := range []string{
		paths.Instance(paths.EgressTemplate, agent),
		paths.Instance(paths.ProxySocketTpl, agent),
		paths.Instance(paths.DNSSocketTpl, agent),
	} {
		if err := u.Stop(ctx, unit); err != nil && !reconcile.IsNoSuchUnit(err) {
			errs = append(errs, err)
		}
	}
	return errs
}

// kill sends SIGKILL to the agent's whole cgroup if it still runs (cutting
// the egress usually stopped it already: it Requires= the sockets). An
// agent with no process left is what was wanted.
func kill(ctx context.Context, u reconcile.Units, unit string) error {
	if st, err := u.States(ctx, []string{unit}); err == nil && !st[unit].Running() {
		return nil
	}
	err := u.Kill(ctx, unit, int32(syscall.SIGKILL))
	if err == nil || isGone(err) {
		return nil
	}
	if st, serr := u.States(ctx, []string{unit}); serr == nil && !st[unit].Running() {
		return nil // it died between our look and the signal
	}
	return err
}

// isGone reports whether systemd refused because the unit is not running
// (or not loaded): for taking an agent down, that is success.
func isGone(err error) bool {
	if reconcile.IsNoSuchUnit(err) {
		return true
	}
	var de dbus.Error
	if errors.As(err, &de) {
		return goneErrors[de.Name]
	}
	var dp *dbus.Error
	if errors.As(err, &dp) {
		return goneErrors[dp.Name]
	}
	return false
}

var goneErrors = map[string]bool{
	"org.freedesktop.systemd1.NoSuchUnit":             true,
	"org.freedesktop.systemd1.UnitInactive":           true,
	"org.freedesktop.systemd1.NoSuchProcess":          true,
	"org.freedesktop.DBus.Error.UnixProcessIdUnknown": true,
}

// Release removes agent's mark so it may start again. It does not start it.
func Release(d Dirs, agent string) (*Mark, error) {
	m, err := Read(d, agent)
	if err != nil {
		return nil, err
	}
	if m == nil {
		return nil, fmt.Errorf("agent %s is not quarantined", agent)
	}
	if err := os.Remove(d.MarkPath(agent)); err != nil {
		return nil, fmt.Errorf("release: %w", err)
	}
	return m, nil
}
