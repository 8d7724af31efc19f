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
	"time"

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
// loses power right after.
func place(d Dirs, m *Mark) error {
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
	if werr == nil {
		werr = os.Rename(tmp.Name(), p)
	}
	if werr != nil {
		os.Remove(tmp.Name())
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
	Now    func() time.Time
	Log    *slog.Logger
}

// Result says what a quarantine did.
type Result struct {
	Mark     *Mark
	Frozen   bool // the cgroup was frozen (else stopped) before evidence was taken
	Evidence *Evidence
}

// Run quarantines an agent: mark, freeze (or stop) the agent, stop its
// gateway and listeners, collect evidence, then stop the agent.
func Run(ctx context.Context, u reconcile.Units, d Dirs, req Request) (*Result, error) {
	now := time.Now
	if req.Now != nil {
		now = req.Now
	}
	lg := req.Log
	if lg == nil {
		lg = slog.Default()
	}
	if m, _ := Read(d, req.Agent); m != nil {
		return nil, fmt.Errorf("%w (since %s by %s: %s); release it first", ErrAlreadyQuarantined, m.At.Format(time.RFC3339), m.By, m.Reason)
	}
	m := &Mark{Agent: req.Agent, Reason: req.Reason, By: req.By, At: now().UTC()}
	if err := place(d, m); err != nil {
		return nil, err
	}
	lg.Warn("agent quarantined", "agent", req.Agent, "reason", req.Reason, "by", req.By)
	res := &Result{Mark: m}
	agentUnit := paths.Instance(paths.AgentTemplate, req.Agent)

	var errs []error
	// Freeze keeps the workspace still while it is copied; where the
	// freezer is unavailable (cgroup v1) stop instead.
	if err := u.Freeze(ctx, agentUnit); err == nil {
		res.Frozen = true
	} else {
		lg.Info("freeze unavailable, stopping agent", "agent", req.Agent, "err", err)
		if err := u.Stop(ctx, agentUnit); err != nil && !reconcile.IsNoSuchUnit(err) {
			errs = append(errs, err)
		}
	}
	// Cut egress: the gateway and both listeners.
	for _, unit := range []string{
		paths.Instance(paths.EgressTemplate, req.Agent),
		paths.Instance(paths.ProxySocketTpl, req.Agent),
		paths.Instance(paths.DNSSocketTpl, req.Agent),
	} {
		if err := u.Stop(ctx, unit); err != nil && !reconcile.IsNoSuchUnit(err) {
			errs = append(errs, err)
		}
	}
	ev, err := Collect(d, Collection{
		Agent: req.Agent, Workspace: req.Workspace, Mark: m, Status: req.Status, Now: now(),
	})
	if err != nil {
		errs = append(errs, err)
	} else {
		res.Evidence = ev
		m.Evidence = ev.Dir
		if err := place(d, m); err != nil {
			errs = append(errs, err)
		}
		lg.Info("evidence collected", "agent", req.Agent, "dir", ev.Dir, "files", ev.Files, "bytes", ev.Bytes)
	}
	if res.Frozen {
		// A frozen cgroup cannot act on SIGTERM; thaw so the stop is
		// prompt. Its network is already gone. Cutting the egress may have
		// stopped (and unloaded) the agent already: it Requires= the sockets.
		if err := u.Thaw(ctx, agentUnit); err != nil && !reconcile.IsNoSuchUnit(err) {
			errs = append(errs, err)
		}
		if err := u.Stop(ctx, agentUnit); err != nil && !reconcile.IsNoSuchUnit(err) {
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return res, fmt.Errorf("quarantine %s (the agent stays marked and will not start): %w", req.Agent, err)
	}
	return res, nil
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
