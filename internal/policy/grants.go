package policy

import (
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"time"
)

// Grants are time-bound additions to an agent's allow list, made by an
// operator with `cagectl allow` without a config edit. caged writes them
// (atomically: a temporary file renamed over this one) into the agent's
// runtime directory, which only root can write; the gateway reads the file
// whenever it changes and enforces each grant's expiry itself, at every
// decision, so a grant ends on time even if caged is gone.
//
// A grant adds to allow; it never beats a deny entry (deny wins, as in the
// policy) nor the address rules (private, loopback, metadata), which the
// gateway applies after any host decision.

// GrantsSchema versions the grants file.
const GrantsSchema = 1

// DefaultGrantDuration is how long `cagectl allow` grants without --for;
// MaxGrantDuration is the longest grant caged accepts (longer needs a policy).
const (
	DefaultGrantDuration = time.Hour
	MaxGrantDuration     = 7 * 24 * time.Hour
)

// Grant is one time-bound allow entry.
type Grant struct {
	ID   string `json:"id"`
	Host string `json:"host"` // an exact name or a wildcard pattern
	// Port 0 means the default ports (80 for HTTP, 443 for CONNECT) and
	// the policy's ports; any other value is that port only.
	Port        int    `json:"port,omitempty"`
	CreatedUnix int64  `json:"created_unix"`
	ExpiresUnix int64  `json:"expires_unix"`
	By          string `json:"by"`
	Reason      string `json:"reason,omitempty"`
}

// Active reports whether g is in force at now.
func (g *Grant) Active(now time.Time) bool { return now.Unix() < g.ExpiresUnix }

// Check reports why g cannot be enforced.
func (g *Grant) Check() error {
	if g.ID == "" || strings.ContainsAny(g.ID, " \t\n/") {
		return fmt.Errorf("grant id %q", g.ID)
	}
	if err := CheckPattern(g.Host); err != nil {
		return fmt.Errorf("grant %s: %w", g.ID, err)
	}
	if g.Port < 0 || g.Port > 65535 {
		return fmt.Errorf("grant %s: port %d out of range", g.ID, g.Port)
	}
	return nil
}

// GrantsDoc is the grants file.
type GrantsDoc struct {
	Schema int     `json:"schema"`
	Agent  string  `json:"agent"`
	Grants []Grant `json:"grants"`
}

// ParseGrants decodes a grants file strictly.
func ParseGrants(data []byte, agent string) (*GrantsDoc, error) {
	var d GrantsDoc
	if err := decodeDoc(data, "grants", &d, GrantsSchema, agent); err != nil {
		return nil, err
	}
	for i := range d.Grants {
		if err := d.Grants[i].Check(); err != nil {
			return nil, fmt.Errorf("grants: %w", err)
		}
	}
	return &d, nil
}

// ErrUntrustedGrants: the grants file is not a regular file that only root
// can write. The gateway then enforces no grants at all (fail closed).
var ErrUntrustedGrants = errors.New("grants file is not a root-owned regular file writable only by root")

// LoadGrants reads the grants file at path. A missing file is no grants.
// The file must be a regular file (not a link) owned by root and not
// writable by group or others, in a directory with the same properties:
// nothing the cage or the gateway's own dynamic user can write is trusted.
func LoadGrants(path, agent string) (*GrantsDoc, error) {
	data, err := readTrusted(path)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return &GrantsDoc{Schema: GrantsSchema, Agent: agent}, nil
		}
		if errors.Is(err, ErrUntrusted) {
			return nil, fmt.Errorf("%w: %v", ErrUntrustedGrants, err)
		}
		return nil, fmt.Errorf("grants: %w", err)
	}
	return ParseGrants(data, agent)
}

func dirOf(p string) string {
	if i := strings.LastIndexByte(p, '/'); i > 0 {
		return p[:i]
	}
	return "/"
}

// grantFor returns the first grant in force at now that allows host:port
// for method, or nil.
func (p *Policy) grantFor(gs []Grant, now time.Time, host string, port int, method string) *Grant {
	def := DefaultHTTPPort
	if method == "CONNECT" {
		def = DefaultConnectPort
	}
	for i := range gs {
		g := &gs[i]
		if !g.Active(now) || !Match(g.Host, host) {
			continue
		}
		if g.Port == port || (g.Port == 0 && (port == def || slices.Contains(p.Ports, port))) {
			return g
		}
	}
	return nil
}

// DecideWithGrants is Decide, then the grants: a request the policy refused
// only for not being allowed (rule default-deny or port) is allowed by a
// grant in force that matches it, with rule "grant:ID". Deny entries and IP
// literals stay refused.
func (p *Policy) DecideWithGrants(gs []Grant, now time.Time, host string, port int, method string) Decision {
	d := p.Decide(host, port, method)
	if d.Result == Allow || (d.Rule != "default-deny" && d.Rule != "port") {
		return d
	}
	g := p.grantFor(gs, now, host, port, method)
	if g == nil {
		return d
	}
	return Decision{Result: Allow, Reason: fmt.Sprintf("host %s:%d allowed by grant %s (by %s, until %s)", host, port, g.ID, g.By, time.Unix(g.ExpiresUnix, 0).UTC().Format(time.RFC3339)),
		Rule: "grant:" + g.ID, Intercept: MatchAny(p.Inspect, host) != ""}
}

// AllowsNameWithGrants is AllowsName, then the grants in force.
func (p *Policy) AllowsNameWithGrants(gs []Grant, now time.Time, name string) (bool, string) {
	ok, rule := p.AllowsName(name)
	if ok || rule != "default-deny" {
		return ok, rule
	}
	for i := range gs {
		if gs[i].Active(now) && Match(gs[i].Host, name) {
			return true, "grant:" + gs[i].ID
		}
	}
	return ok, rule
}
