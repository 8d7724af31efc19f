package control

import (
	"encoding/json"
	"fmt"
	"slices"
	"time"

	"github.com/nixcage/nixcage/internal/policy"
	"github.com/nixcage/nixcage/internal/release"
)

// BanID is the id of the ban a ban-host command makes: "b-" and the first
// 12 hex digits of the command's hash, so an audit record's rule
// ("ban:b-…") leads back to the command and its ack.
func BanID(hash string) string { return "b-" + hash[:12] }

// AddBan returns bans with c's ban added (hash is c's). Banning a host
// already banned for the same agents keeps the first ban.
func AddBan(bans []policy.Ban, c *Command, hash string, now time.Time) ([]policy.Ban, bool) {
	for _, b := range bans {
		if b.Host == c.Ban && b.Agent == c.Agent {
			return bans, false
		}
	}
	return append(slices.Clone(bans), policy.Ban{ID: BanID(hash), Host: c.Ban, Agent: c.Agent, CreatedUnix: now.Unix(), Command: hash, Reason: c.Reason}), true
}

// RemoveBan returns bans without c's host: with agent "*" every ban of the
// host, else only the one for that agent.
func RemoveBan(bans []policy.Ban, c *Command) ([]policy.Ban, int) {
	out := slices.DeleteFunc(slices.Clone(bans), func(b policy.Ban) bool {
		return b.Host == c.Ban && (c.Agent == All || b.Agent == c.Agent)
	})
	return out, len(bans) - len(out)
}

// WriteBans replaces the bans file atomically (0644: every gateway's
// dynamic user reads it).
func WriteBans(path string, bans []policy.Ban) error {
	if bans == nil {
		bans = []policy.Ban{}
	}
	b, err := json.MarshalIndent(policy.BansDoc{Schema: policy.BansSchema, Bans: bans}, "", "  ")
	if err != nil {
		return err
	}
	if err := release.WriteFileAtomic(path, append(b, '\n'), 0o644); err != nil {
		return fmt.Errorf("bans: %w", err)
	}
	return nil
}
