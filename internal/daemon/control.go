package daemon

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/nixcage/nixcage/internal/bus"
	"github.com/nixcage/nixcage/internal/channel"
	"github.com/nixcage/nixcage/internal/config"
	"github.com/nixcage/nixcage/internal/control"
	"github.com/nixcage/nixcage/internal/events"
	"github.com/nixcage/nixcage/internal/paths"
	"github.com/nixcage/nixcage/internal/policy"
	"github.com/nixcage/nixcage/internal/release"
)

// Signed control commands (package control, docs/fleet.md): caged runs
// every stage of the check, claims the command in the replay cache (before
// executing: at most once, even across a crash), executes it and records
// the ack in the ack file, the journal and, if configured, the upload URL.

// Source names of a command, in its ack.
const (
	SourceFile    = "file"
	SourceChannel = "channel"
)

// controlState is opened on first use (tests and hosts without a control
// block never create the directory).
type controlState struct {
	once  sync.Once
	err   error
	cache *control.Cache
	acks  *control.AckLog
	// rejected remembers channel entries already refused, so a command
	// left on a channel is acked once per caged run, not on every poll.
	mu       sync.Mutex
	rejected map[string]bool
	uploads  sync.WaitGroup
}

var bansMu sync.Mutex

func (d *Daemon) ctlState() (*controlState, error) {
	s := &d.ctl
	s.once.Do(func() {
		dir := d.qdirs.Host(paths.ControlDir)
		if s.cache, s.err = control.OpenCache(filepath.Join(dir, "replay.json")); s.err != nil {
			return
		}
		s.acks, s.err = control.OpenAckLog(filepath.Join(dir, "acks.jsonl"))
		s.rejected = map[string]bool{}
	})
	return s, s.err
}

// hostID is what commands must name as their host: control.host_id, else
// the host name (lower-cased) at the time of the call.
func hostID(cfg *config.Config) string {
	if cfg.Control != nil && cfg.Control.HostID != "" {
		return cfg.Control.HostID
	}
	h, err := os.Hostname()
	if err != nil {
		return ""
	}
	return strings.ToLower(h)
}

// ApplyControl implements bus.ControlBackend: a command handed in by an
// admin (cagectl control apply FILE).
func (d *Daemon) ApplyControl(ctx context.Context, raw []byte, by string) (control.Ack, error) {
	return d.runControl(ctx, raw, SourceFile, by)
}

// ControlAcks implements bus.ControlBackend.
func (d *Daemon) ControlAcks(ctx context.Context, max uint32) ([]control.Ack, error) {
	s, err := d.ctlState()
	if err != nil {
		return nil, err
	}
	return s.acks.Read(int(max))
}

// applyChannelControls is the channel poller's control feed hook.
func (d *Daemon) applyChannelControls(ctx context.Context, cmds []channel.Control) {
	d.applyControlFeed(ctx, cmds)
}

// applyControlFeed runs the commands a channel carries (each file one
// signed command). A channel is shared by the fleet and read again on
// every poll, so entries for other hosts, entries already claimed here
// and entries already refused in this run are skipped without an ack;
// everything else is run and acked like a command from a file, with the
// entry's name as its "by". A host without a control block ignores the
// feed.
func (d *Daemon) applyControlFeed(ctx context.Context, cmds []channel.Control) []control.Ack {
	if d.config().Control == nil {
		if len(cmds) > 0 {
			d.log.Debug("channel control feed ignored: no control block", "commands", len(cmds))
		}
		return nil
	}
	s, err := d.ctlState()
	if err != nil {
		d.log.Error("control feed not read", "err", err)
		return nil
	}
	host := hostID(d.config())
	claimed := map[string]bool{}
	if es, err := s.cache.Entries(time.Now()); err == nil {
		for _, e := range es {
			claimed[e.SHA256] = true
		}
	}
	var out []control.Ack
	refusedAcks, unacked := 0, 0
	for _, cmd := range cmds {
		raw := cmd.Data
		key := control.HashBytes(raw)
		if p, err := control.Parse(raw); err == nil {
			if p.Command.Host != control.All && p.Command.Host != host {
				continue
			}
			if claimed[p.Hash] {
				continue
			}
			key = p.Hash
		}
		s.mu.Lock()
		seen := s.rejected[key]
		s.mu.Unlock()
		if seen {
			continue
		}
		// A channel server holding no key can list fresh junk on every
		// poll; acking all of it would rotate the controller's genuine
		// acks out of the ack log. Past maxRefusedFeedAcks refusals in one
		// poll, refused entries are remembered (never retried this run)
		// but not acked; the journal says how many.
		if refusedAcks >= maxRefusedFeedAcks {
			if _, err := d.checkControl(d.config(), raw, host, time.Now()); err != nil {
				s.mu.Lock()
				if len(s.rejected) > control.MaxCacheEntries {
					s.rejected = map[string]bool{}
				}
				s.rejected[key] = true
				s.mu.Unlock()
				unacked++
				continue
			}
		}
		ack, err := d.runControl(ctx, raw, SourceChannel, channel.ControlsDir+"/"+cmd.Name)
		if err != nil {
			d.log.Error("control command from the channel", "err", err)
			continue
		}
		if ack.Status != control.StatusExecuted && ack.Status != control.StatusFailed {
			s.mu.Lock()
			if len(s.rejected) > control.MaxCacheEntries {
				s.rejected = map[string]bool{}
			}
			s.rejected[key] = true
			s.mu.Unlock()
			refusedAcks++
		}
		out = append(out, ack)
	}
	if unacked > 0 {
		d.log.Warn("channel control feed: refused entries not acked (more than the per-poll ack limit; the channel may be flooding)",
			"refused_acked", refusedAcks, "refused_not_acked", unacked, "limit", maxRefusedFeedAcks)
	}
	return out
}

// maxRefusedFeedAcks bounds the refused-command acks one poll of the
// control feed writes (docs/fleet.md "Acknowledgements").
const maxRefusedFeedAcks = 8

// runControl is the pipeline: check (pure stages), target agents, claim,
// execute, acknowledge. Every outcome is an ack; an error means the ack
// could not be recorded.
func (d *Daemon) runControl(ctx context.Context, raw []byte, source, by string) (control.Ack, error) {
	s, err := d.ctlState()
	if err != nil {
		return control.Ack{}, err
	}
	now := time.Now()
	cfg := d.config()
	host := hostID(cfg)
	p, err := d.checkControl(cfg, raw, host, now)
	if err == nil {
		err = checkControlAgent(cfg, p.Command)
	}
	if err == nil {
		err = s.cache.Claim(p.Hash, p.Command.Nonce, p.Command.Expires, now)
	}
	status, reason := control.StatusExecuted, ""
	if err != nil {
		r := control.AsRefusal(err)
		status, reason = r.Status, r.Reason
	} else {
		var failed bool
		reason, failed = d.executeControl(ctx, p, source, by)
		if failed {
			status = control.StatusFailed
		}
	}
	ack := control.NewAck(host, raw, p, status, reason, source, by, now)
	return ack, d.recordAck(s, cfg, ack)
}

// checkControl runs the stages that need only the configuration.
func (d *Daemon) checkControl(cfg *config.Config, raw []byte, host string, now time.Time) (*control.Parsed, error) {
	if cfg.Control == nil {
		p, _ := control.Parse(raw)
		return p, control.AsRefusal(errors.New("this host has no control block in its configuration: it accepts no control commands (docs/fleet.md)"))
	}
	keys := make([]string, len(cfg.Control.Keys))
	for i, k := range cfg.Control.Keys {
		keys[i] = d.qdirs.Host(k)
	}
	trusted, err := release.LoadPublicKeys(keys)
	if err != nil {
		p, _ := control.Parse(raw)
		return p, control.AsRefusal(fmt.Errorf("control keys: %w", err))
	}
	return control.Check(raw, trusted, cfg.Control.Threshold, host, now)
}

// checkControlAgent refuses a command naming an agent this host does not
// declare (a throw-away cage is not a target: it has no declared name).
func checkControlAgent(cfg *config.Config, c *control.Command) error {
	if c.Agent != control.All && cfg.Agent(c.Agent) == nil {
		return control.AsRefusal(fmt.Errorf("unknown agent %q: this host declares %s", c.Agent, agentList(cfg)))
	}
	return nil
}

func agentList(cfg *config.Config) string {
	if len(cfg.Agents) == 0 {
		return "no agents"
	}
	var names []string
	for _, a := range cfg.Agents {
		names = append(names, a.Name)
	}
	return strings.Join(names, ", ")
}

// executeControl runs a claimed command on its agents and says what
// happened to each; failed is true if any part failed.
func (d *Daemon) executeControl(ctx context.Context, p *control.Parsed, source, by string) (string, bool) {
	c := p.Command
	who := "control command " + p.Hash[:16] + " (" + source
	if by != "" {
		who += " by " + by
	}
	who += ")"
	d.log.Warn("control command", "action", c.Action, "agent", c.Agent, "ban", c.Ban, "command", p.Hash, "source", source, "by", by, "reason", c.Reason)
	switch c.Action {
	case control.ActionBanHost:
		return d.banHost(p, who)
	case control.ActionUnbanHost:
		return d.unbanHost(p, who)
	}
	var agents []string
	if c.Agent == control.All {
		for _, a := range d.config().Agents {
			agents = append(agents, a.Name)
		}
	} else {
		agents = []string{c.Agent}
	}
	var done []string
	failed := false
	for _, a := range agents {
		msg, err := d.controlAgent(ctx, c, a, who)
		if err != nil {
			failed = true
			msg = "failed: " + err.Error()
		}
		done = append(done, a+": "+msg)
	}
	if len(done) == 0 {
		return c.Action + ": no agents declared", false
	}
	return strings.Join(done, "; "), failed
}

// controlAgent runs one action on one agent, through the same methods an
// operator's cagectl reaches (so signals, journal events and the audit of
// quarantine are the same).
func (d *Daemon) controlAgent(ctx context.Context, c *control.Command, agent, who string) (string, error) {
	unit := paths.Instance(paths.AgentTemplate, agent)
	switch c.Action {
	case control.ActionKill:
		return "killed (SIGKILL)", d.Kill(ctx, agent, who)
	case control.ActionQuarantine:
		reason := c.Reason
		if reason == "" {
			reason = "control command"
		}
		ev, err := d.Quarantine(ctx, agent, reason, who)
		if errors.Is(err, bus.ErrIsQuarantined) {
			return "already quarantined", nil
		}
		return "quarantined, evidence in " + ev, err
	case control.ActionRelease:
		if err := d.Release(ctx, agent, who); err != nil {
			return "", err
		}
		return "released", nil
	case control.ActionPause:
		// Freezing needs the cgroup v2 freezer; where it is missing the
		// command fails with systemd's reason rather than stopping the
		// agent: pause must be undoable by resume.
		if err := d.units.Freeze(ctx, unit); err != nil {
			return "", err
		}
		d.refresh(ctx, agent)
		return "paused (frozen)", nil
	case control.ActionResume:
		if err := d.units.Thaw(ctx, unit); err != nil {
			return "", err
		}
		d.refresh(ctx, agent)
		return "resumed (thawed)", nil
	}
	return "", fmt.Errorf("action %q has no executor", c.Action)
}

func (d *Daemon) bansFile() string { return d.qdirs.Host(paths.BansFile) }

// readBans reads caged's own bans file (a missing one is no bans).
func (d *Daemon) readBans() ([]policy.Ban, error) {
	b, err := os.ReadFile(d.bansFile())
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("bans: %w", err)
	}
	doc, err := policy.ParseBans(b)
	if err != nil {
		return nil, err
	}
	return doc.Bans, nil
}

// banHost adds the ban to the host-wide bans file every gateway watches:
// the running gateways apply it within their poll interval, no restart.
func (d *Daemon) banHost(p *control.Parsed, who string) (string, bool) {
	bansMu.Lock()
	defer bansMu.Unlock()
	bans, err := d.readBans()
	if err != nil {
		return "failed: " + err.Error(), true
	}
	bans, added := control.AddBan(bans, p.Command, p.Hash, time.Now())
	if !added {
		return fmt.Sprintf("%s was already banned for agent %s", p.Command.Ban, p.Command.Agent), false
	}
	if err := os.MkdirAll(filepath.Dir(d.bansFile()), 0o755); err != nil {
		return "failed: " + err.Error(), true
	}
	if err := control.WriteBans(d.bansFile(), bans); err != nil {
		return "failed: " + err.Error(), true
	}
	d.log.Warn("host banned", "host", p.Command.Ban, "agent", p.Command.Agent, "ban", control.BanID(p.Hash), "by", who)
	return fmt.Sprintf("banned %s for agent %s as %s", p.Command.Ban, p.Command.Agent, control.BanID(p.Hash)), false
}

func (d *Daemon) unbanHost(p *control.Parsed, who string) (string, bool) {
	bansMu.Lock()
	defer bansMu.Unlock()
	bans, err := d.readBans()
	if err != nil {
		return "failed: " + err.Error(), true
	}
	bans, n := control.RemoveBan(bans, p.Command)
	if n == 0 {
		return fmt.Sprintf("%s was not banned for agent %s", p.Command.Ban, p.Command.Agent), false
	}
	if err := control.WriteBans(d.bansFile(), bans); err != nil {
		return "failed: " + err.Error(), true
	}
	d.log.Warn("host unbanned", "host", p.Command.Ban, "agent", p.Command.Agent, "bans_removed", n, "by", who)
	return fmt.Sprintf("unbanned %s (%d ban(s) removed)", p.Command.Ban, n), false
}

// recordAck writes the ack to the ack file and the journal, and uploads
// it when control.ack_url is set (in the background, bounded: a slow
// controller must not hold the bus call or the channel poll).
func (d *Daemon) recordAck(s *controlState, cfg *config.Config, a control.Ack) error {
	d.journal(events.ControlCommand, map[string]string{
		"NIXCAGE_STATUS": a.Status, "NIXCAGE_ACTION": a.Action, "NIXCAGE_AGENT": a.Agent, "NIXCAGE_BAN": a.Ban,
		"NIXCAGE_COMMAND": a.SHA256, "NIXCAGE_NONCE": a.Nonce, "NIXCAGE_HOST_ID": a.Host, "NIXCAGE_SOURCE": a.Source,
		"NIXCAGE_BY": a.By, "NIXCAGE_REASON": a.Reason,
	})
	lv := d.log.Warn
	if a.Status == control.StatusExecuted {
		lv = d.log.Info
	}
	lv("control command acknowledged", "status", a.Status, "command", a.SHA256, "action", a.Action, "agent", a.Agent, "reason", a.Reason)
	if cfg.Control != nil && cfg.Control.AckURL != "" {
		s.uploads.Add(1)
		go func() {
			defer s.uploads.Done()
			ctx, cancel := context.WithTimeout(context.Background(), ackUploadTimeout)
			defer cancel()
			client, err := control.UploadClient(cfg.Control.AckURL)
			if err == nil {
				err = control.Upload(ctx, client, cfg.Control.AckURL, a)
				client.CloseIdleConnections() // a client per upload: leave no connection behind
			}
			if err != nil {
				d.log.Warn("ack not uploaded (it is in the ack file and the journal)", "command", a.SHA256, "err", err)
			}
		}()
	}
	if err := s.acks.Append(a); err != nil {
		return fmt.Errorf("record ack: %w", err)
	}
	return nil
}

// ackUploadTimeout bounds one ack upload.
const ackUploadTimeout = 15 * time.Second
