package policy

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strings"
)

// Bans are host names a signed control command (ban-host, docs/fleet.md)
// took away from some or all agents of a host, fleet-wide. caged keeps
// them in one host-wide file under its state directory (so they survive
// reboots and reach agents declared later); every gateway watches that
// file as it watches its grants file and applies the bans for its agent
// live. A ban beats everything: the policy's allow list, a grant, an open
// intercepted tunnel's next request; the gateway also closes open tunnels
// to a banned host.

// BansSchema versions the bans file.
const BansSchema = 1

// Ban is one banned host name.
type Ban struct {
	ID string `json:"id"` // "b-" + 12 hex digits of the command's hash
	// Host is an exact name (covering its subdomains, as a deny entry
	// does) or "*.suffix".
	Host string `json:"host"`
	// Agent is the agent it applies to, or "*" for every agent.
	Agent       string `json:"agent"`
	CreatedUnix int64  `json:"created_unix"`
	Command     string `json:"command"` // sha256 of the ban-host command
	Reason      string `json:"reason,omitempty"`
}

// Check reports why b cannot be enforced.
func (b *Ban) Check() error {
	if b.ID == "" || strings.ContainsAny(b.ID, " \t\n/") {
		return fmt.Errorf("ban id %q", b.ID)
	}
	if err := CheckPattern(b.Host); err != nil {
		return fmt.Errorf("ban %s: %w", b.ID, err)
	}
	if b.Agent == "" {
		return fmt.Errorf("ban %s: no agent (a name or \"*\")", b.ID)
	}
	return nil
}

// Applies reports whether b applies to agent.
func (b *Ban) Applies(agent string) bool { return b.Agent == "*" || b.Agent == agent }

// BansDoc is the bans file.
type BansDoc struct {
	Schema int   `json:"schema"`
	Bans   []Ban `json:"bans"`
}

// ParseBans decodes a bans file strictly.
func ParseBans(data []byte) (*BansDoc, error) {
	dec := json.NewDecoder(strings.NewReader(string(data)))
	dec.DisallowUnknownFields()
	var d BansDoc
	if err := dec.Decode(&d); err != nil {
		return nil, fmt.Errorf("parse bans: %w", err)
	}
	if d.Schema != BansSchema {
		return nil, fmt.Errorf("bans schema %d, want %d", d.Schema, BansSchema)
	}
	for i := range d.Bans {
		if err := d.Bans[i].Check(); err != nil {
			return nil, fmt.Errorf("bans: %w", err)
		}
	}
	return &d, nil
}

// LoadBans reads the bans file at path with the grants file's trust rules
// (root-owned regular file, not group/other-writable, in such a
// directory). A missing file is no bans.
func LoadBans(path string) (*BansDoc, error) {
	data, err := readTrusted(path)
	if errors.Is(err, os.ErrNotExist) {
		return &BansDoc{Schema: BansSchema}, nil
	}
	if err != nil {
		return nil, fmt.Errorf("bans: %w", err)
	}
	return ParseBans(data)
}

// For returns the bans that apply to agent.
func (d *BansDoc) For(agent string) []Ban {
	var out []Ban
	for _, b := range d.Bans {
		if b.Applies(agent) {
			out = append(out, b)
		}
	}
	return out
}

// BanFor returns the first ban covering host, or nil.
func BanFor(bans []Ban, host string) *Ban {
	for i := range bans {
		if Covers(bans[i].Host, host) {
			return &bans[i]
		}
	}
	return nil
}

// Banned is the refusal of a banned host: rule "ban:ID", and a reason
// naming the ban, its command and why.
func Banned(b *Ban, host string) Decision {
	reason := fmt.Sprintf("host %s is banned by %s (control command %s)", host, b.ID, short12(b.Command))
	if b.Reason != "" {
		reason += ": " + b.Reason
	}
	return Decision{Result: Deny, Reason: reason, Rule: "ban:" + b.ID}
}

func short12(s string) string {
	if len(s) > 12 {
		return s[:12]
	}
	return s
}
