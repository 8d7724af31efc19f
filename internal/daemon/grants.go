package daemon

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"github.com/nixcage/nixcage/internal/bus"
	"github.com/nixcage/nixcage/internal/paths"
	"github.com/nixcage/nixcage/internal/policy"
)

// grantsMu serializes changes to grants files (one caged per host).
var grantsMu sync.Mutex

func (d *Daemon) grantsFile(agent string) string { return d.qdirs.Host(paths.GrantsFile(agent)) }

// readGrants returns the agent's grants file with expired grants dropped.
func (d *Daemon) readGrants(agent string, now time.Time) (*policy.GrantsDoc, error) {
	doc, err := policy.LoadGrants(d.grantsFile(agent), agent)
	if err != nil {
		return nil, err
	}
	doc.Grants = slices.DeleteFunc(doc.Grants, func(g policy.Grant) bool { return !g.Active(now) })
	return doc, nil
}

// writeGrants replaces the file atomically (temporary file, fsync, rename),
// so the gateway never reads half a file. The directory is the agent's
// runtime directory (root, 0755), created by its prepare step; caged makes
// it if the agent has not started yet.
func (d *Daemon) writeGrants(doc *policy.GrantsDoc) error {
	path := d.grantsFile(doc.Agent)
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return fmt.Errorf("grants: %w", err)
	}
	b, err := json.MarshalIndent(doc, "", "  ")
	if err != nil {
		return err
	}
	if err := policy.WriteFileAtomic(path, append(b, '\n')); err != nil {
		return fmt.Errorf("grants: %w", err)
	}
	return nil
}

func toBus(agent string, g policy.Grant) bus.Grant {
	return bus.Grant{ID: g.ID, Agent: agent, Host: g.Host, Port: int32(g.Port), CreatedUnix: g.CreatedUnix, ExpiresUnix: g.ExpiresUnix, By: g.By, Reason: g.Reason}
}

// AllowHost implements bus.GrantsBackend. The server has authorized the
// caller (wildcards: admin) and checked host, port, duration and reason.
func (d *Daemon) AllowHost(ctx context.Context, agent, host string, port int, dur time.Duration, reason, by string) (bus.Grant, error) {
	grantsMu.Lock()
	defer grantsMu.Unlock()
	now := time.Now()
	doc, err := d.readGrants(agent, now)
	if err != nil {
		return bus.Grant{}, err
	}
	var rnd [6]byte
	if _, err := rand.Read(rnd[:]); err != nil {
		return bus.Grant{}, err
	}
	g := policy.Grant{ID: "g-" + hex.EncodeToString(rnd[:]), Host: host, Port: port, CreatedUnix: now.Unix(), ExpiresUnix: now.Add(dur).Unix(), By: by, Reason: reason}
	if err := g.Check(); err != nil {
		return bus.Grant{}, fmt.Errorf("%w: %v", bus.ErrInvalid, err)
	}
	doc.Grants = append(doc.Grants, g)
	if err := d.writeGrants(doc); err != nil {
		return bus.Grant{}, err
	}
	d.log.Warn("egress grant", "agent", agent, "grant", g.ID, "host", host, "port", port, "until", time.Unix(g.ExpiresUnix, 0).UTC().Format(time.RFC3339), "reason", reason, "by", by)
	return toBus(agent, g), nil
}

// ListGrants implements bus.GrantsBackend.
func (d *Daemon) ListGrants(ctx context.Context, agent string) ([]bus.Grant, error) {
	doc, err := d.readGrants(agent, time.Now())
	if err != nil {
		return nil, err
	}
	out := []bus.Grant{}
	for _, g := range doc.Grants {
		out = append(out, toBus(agent, g))
	}
	return out, nil
}

// RevokeGrant implements bus.GrantsBackend.
func (d *Daemon) RevokeGrant(ctx context.Context, agent, id, by string) error {
	grantsMu.Lock()
	defer grantsMu.Unlock()
	doc, err := d.readGrants(agent, time.Now())
	if err != nil {
		return err
	}
	n := len(doc.Grants)
	doc.Grants = slices.DeleteFunc(doc.Grants, func(g policy.Grant) bool { return g.ID == id })
	if len(doc.Grants) == n {
		return fmt.Errorf("%w: grant %s is not in force for %s (expired or revoked)", bus.ErrInvalid, id, agent)
	}
	if err := d.writeGrants(doc); err != nil {
		return err
	}
	d.log.Warn("egress grant revoked", "agent", agent, "grant", id, "by", by)
	return nil
}

// GrantAgent implements bus.GrantsBackend.
func (d *Daemon) GrantAgent(id string) (string, bool) {
	st, err := d.Status(context.Background())
	if err != nil {
		return "", false
	}
	now := time.Now()
	for _, a := range st.Agents {
		doc, err := d.readGrants(a.Name, now)
		if err != nil {
			continue
		}
		for _, g := range doc.Grants {
			if g.ID == id {
				return a.Name, true
			}
		}
	}
	return "", false
}

// learnUntil is the end of agent's learn window, as its prepare step
// stamped it and its gateway enforces it (0: none stamped or untrusted).
func (d *Daemon) learnUntil(agent string) int64 {
	w, err := policy.LoadLearnWindow(d.qdirs.Host(paths.LearnFile(agent)), agent)
	if err != nil {
		return 0
	}
	return w.UntilUnix
}
