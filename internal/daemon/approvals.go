package daemon

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"time"

	"github.com/nixcage/nixcage/internal/bus"
	"github.com/nixcage/nixcage/internal/paths"
	"github.com/nixcage/nixcage/internal/policy"
)

// The approval queue, caged's side (policy/approval.go has the protocol):
// caged reads the pending files a gateway writes into its own runtime
// directory, announces each once (ApprovalPending signal and journal
// event), lists them for `cagectl approvals`, and writes an operator's
// decision into the agent's root-owned runtime directory, where the
// gateway looks for it.

// maxPendingRead bounds the pending files caged reads per agent, whatever
// a gateway wrote (policy.MaxMaxPending is what a sound one writes).
const maxPendingRead = 2 * policy.MaxMaxPending

// approvalDirs are agent's approval directories on this host.
func (d *Daemon) approvalDirs(agent string) *policy.Approval {
	return &policy.Approval{PendingDir: d.qdirs.Host(paths.ApprovalPendingDir(agent)), DecisionsDir: d.qdirs.Host(paths.ApprovalDecisionsDir(agent))}
}

// pending reads agent's waiting requests, oldest first. A file that does
// not parse is skipped: it is the gateway's (and so, in its fields, the
// agent's) input.
func (d *Daemon) pending(agent string, now time.Time) []*policy.Pending {
	dirs := d.approvalDirs(agent)
	ents, err := os.ReadDir(dirs.PendingDir)
	if err != nil {
		return nil
	}
	var out []*policy.Pending
	for _, e := range ents {
		if len(out) >= maxPendingRead {
			break
		}
		id, ok := strings.CutSuffix(e.Name(), ".json")
		if !ok || policy.CheckApprovalID(id) != nil || !e.Type().IsRegular() {
			continue
		}
		p, err := readPending(filepath.Join(dirs.PendingDir, e.Name()), agent)
		if err != nil || p.ID != id || now.Unix() > p.ExpiresUnix {
			continue
		}
		out = append(out, p)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].SinceUnix < out[j].SinceUnix })
	return out
}

func readPending(path, agent string) (*policy.Pending, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, policy.MaxApprovalFile+1))
	if err != nil {
		return nil, err
	}
	return policy.ParsePending(b, agent)
}

func toBusApproval(p *policy.Pending) bus.Approval {
	return bus.Approval{ID: p.ID, Agent: p.Agent, Host: p.Host, Port: uint32(p.Port), Method: p.Method, Path: p.Path, SinceUnix: p.SinceUnix, ExpiresUnix: p.ExpiresUnix}
}

// ListApprovals implements bus.ApprovalsBackend.
func (d *Daemon) ListApprovals(ctx context.Context, agent string) ([]bus.Approval, error) {
	out := []bus.Approval{}
	for _, p := range d.pending(agent, time.Now()) {
		out = append(out, toBusApproval(p))
	}
	return out, nil
}

// ApprovalAgent implements bus.ApprovalsBackend.
func (d *Daemon) ApprovalAgent(id string) (string, bool) {
	now := time.Now()
	for _, name := range d.cageNames() {
		for _, p := range d.pending(name, now) {
			if p.ID == id {
				return name, true
			}
		}
	}
	return "", false
}

// DecideApproval implements bus.ApprovalsBackend. The server has checked
// the verdict and that by is an operator over agent.
func (d *Daemon) DecideApproval(ctx context.Context, agent, id, verdict, by string) (string, error) {
	var p *policy.Pending
	for _, q := range d.pending(agent, time.Now()) {
		if q.ID == id {
			p = q
		}
	}
	if p == nil {
		return "", fmt.Errorf("%w: no request %s of %s is waiting (decided or timed out)", bus.ErrInvalid, id, agent)
	}
	dirs := d.approvalDirs(agent)
	dec := policy.ApprovalDecision{Schema: policy.ApprovalSchema, ID: id, Agent: agent, Verdict: verdict, By: by, DecidedUnix: time.Now().Unix()}
	if verdict == policy.VerdictHost {
		// The default ports are the grant's default (port 0); any other
		// port is granted alone, as `cagectl allow HOST:PORT` would.
		port := p.Port
		if port == policy.DefaultConnectPort || port == policy.DefaultHTTPPort {
			port = 0
		}
		g, err := d.AllowHost(ctx, agent, p.Host, port, policy.DefaultGrantDuration, "approved request "+id, by)
		if err != nil {
			return "", err
		}
		dec.Grant = g.ID
	}
	b, err := policy.MarshalDoc(&dec)
	if err != nil {
		return "", err
	}
	// The gateway's dynamic user must traverse it: 0755 whatever caged's
	// umask (0077 under its unit) made of MkdirAll's mode.
	if err := os.MkdirAll(dirs.DecisionsDir, 0o755); err != nil {
		return "", fmt.Errorf("approval: %w", err)
	}
	if err := os.Chmod(dirs.DecisionsDir, 0o755); err != nil {
		return "", fmt.Errorf("approval: %w", err)
	}
	if err := policy.WriteFileAtomic(dirs.DecisionFile(id), b); err != nil {
		return "", fmt.Errorf("approval: %w", err)
	}
	d.log.Warn("egress approval", "agent", agent, "approval", id, "host", p.Host, "port", p.Port, "verdict", verdict, "grant", dec.Grant, "by", by)
	d.emit(bus.SignalApprovalDecided, agent, id, verdict, by)
	return dec.Grant, nil
}

// watchApprovals announces new pending requests once each (seen maps
// agent to the ids it last saw) and removes the decisions of requests no
// longer waiting: the gateway removes a pending file once it has read its
// decision, or when the wait is over.
func (d *Daemon) watchApprovals(seen map[string]map[string]bool, now time.Time) {
	for _, name := range d.cageNames() {
		ps := d.pending(name, now)
		cur := map[string]bool{}
		for _, p := range ps {
			cur[p.ID] = true
			if !seen[name][p.ID] {
				d.log.Warn("egress approval pending", "agent", name, "approval", p.ID, "host", p.Host, "port", p.Port, "method", p.Method)
				d.emit(bus.SignalApprovalPending, name, p.ID, p.Host, uint32(p.Port), p.Method, p.Path, p.SinceUnix, p.ExpiresUnix)
			}
		}
		if len(cur) == 0 {
			delete(seen, name)
		} else {
			seen[name] = cur
		}
		dirs := d.approvalDirs(name)
		ents, err := os.ReadDir(dirs.DecisionsDir)
		if err != nil {
			continue
		}
		for _, e := range ents {
			id, ok := strings.CutSuffix(e.Name(), ".json")
			if !ok || policy.CheckApprovalID(id) != nil || cur[id] {
				continue
			}
			if _, err := os.Lstat(dirs.PendingFile(id)); err == nil {
				continue // waiting, though past its time: the gateway will remove it
			}
			if err := os.Remove(dirs.DecisionFile(id)); err != nil && !errors.Is(err, os.ErrNotExist) {
				d.log.Warn("remove approval decision", "agent", name, "approval", id, "err", err)
			}
		}
	}
}
