package policy

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"syscall"
	"time"
)

// Learn mode: for a bounded window after a cage starts, a request the policy
// refuses only for not being allowed (rule default-deny or port) is let
// through and flagged (audit rule RuleLearn), so a first run shows what a
// harness needs and `cagectl policy suggest` turns it into a policy. It is
// an allow list that grows, never a switch that turns the gateway off:
//
//   - deny entries (the policy's) and the shipped policies' deny lists
//     (Learn.Deny) still refuse, with their own rules;
//   - IP literals still refuse (rule ip-literal): policies name hosts;
//   - special-use and cloud metadata names (SpecialUse) refuse;
//   - the address rules (private, loopback, link-local, metadata, CGNAT,
//     the gateway's own addresses) run after any host decision, learned or
//     not, so a learned name resolving to 10.0.0.1 or 169.254.169.254 is
//     refused with rule address.
//
// The window is stamped once per cage start by the root prepare step into
// a file the gateway and the cage cannot write (LearnWindow), so neither a
// gateway restart nor anything the agent does extends it; the gateway
// checks the end at every decision.

// RuleLearn is the audit rule of every decision learn mode allowed.
const RuleLearn = "learn"

// RuleSpecialUse refuses, in learn mode, a name no policy should allow.
const RuleSpecialUse = "special-use"

// DefaultLearnDuration is the window without learn_for; MaxLearnDuration
// the longest one the config accepts (longer is a policy, not a lesson).
const (
	DefaultLearnDuration = 30 * time.Minute
	MaxLearnDuration     = 24 * time.Hour
)

// Learn is the learn-mode part of the runtime document.
type Learn struct {
	// ForSeconds is the window's length, from the cage's prepare step.
	ForSeconds int64 `json:"for_seconds"`
	// File is where prepare stamps the window (root's runtime directory).
	File string `json:"file"`
	// Deny are the shipped policies' deny lists (telemetry, error
	// reporting): learning never lets them through, whatever the agent's
	// own policy says.
	Deny []string `json:"deny"`
}

// Check reports a learn block the gateway cannot enforce.
func (l *Learn) Check() error {
	if l.ForSeconds <= 0 || time.Duration(l.ForSeconds)*time.Second > MaxLearnDuration {
		return fmt.Errorf("learn.for_seconds %d: want 1 to %d", l.ForSeconds, int64(MaxLearnDuration/time.Second))
	}
	if l.File == "" || !strings.HasPrefix(l.File, "/") {
		return fmt.Errorf("learn.file %q: want an absolute path", l.File)
	}
	for _, d := range l.Deny {
		if err := CheckPattern(d); err != nil {
			return fmt.Errorf("learn.deny: %w", err)
		}
	}
	return nil
}

// LearnSchema versions the window file.
const LearnSchema = 1

// LearnWindow is the stamp prepare writes when the cage starts.
type LearnWindow struct {
	Schema      int    `json:"schema"`
	Agent       string `json:"agent"`
	StartedUnix int64  `json:"started_unix"`
	UntilUnix   int64  `json:"until_unix"`
}

// Until is the window's end.
func (w *LearnWindow) Until() time.Time { return time.Unix(w.UntilUnix, 0) }

// Active reports whether the window is open at now.
func (w *LearnWindow) Active(now time.Time) bool { return w != nil && now.Before(w.Until()) }

// ParseLearnWindow decodes a window file strictly.
func ParseLearnWindow(data []byte, agent string) (*LearnWindow, error) {
	var w LearnWindow
	if err := decodeDoc(data, "learn window", &w, LearnSchema, agent); err != nil {
		return nil, err
	}
	if w.UntilUnix <= w.StartedUnix || time.Duration(w.UntilUnix-w.StartedUnix)*time.Second > MaxLearnDuration {
		return nil, fmt.Errorf("learn window %d..%d: want a start before its end, at most %s apart", w.StartedUnix, w.UntilUnix, MaxLearnDuration)
	}
	return &w, nil
}

// ErrNoLearnWindow: learn mode is configured but no window was stamped.
var ErrNoLearnWindow = errors.New("no learn window stamped (the prepare step writes it)")

// LoadLearnWindow reads the window file with the grants file's trust rules
// (root-owned regular file in a root-owned directory, writable by nobody
// else). Unlike grants, a missing file is an error: the caller then runs
// without learning (fail closed).
func LoadLearnWindow(path, agent string) (*LearnWindow, error) {
	data, err := readTrusted(path)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil, fmt.Errorf("%s: %w", path, ErrNoLearnWindow)
		}
		return nil, err
	}
	return ParseLearnWindow(data, agent)
}

// ErrUntrusted: a file caged or prepare writes for the gateway is not a
// root-owned regular file writable only by root.
var ErrUntrusted = errors.New("not a root-owned regular file writable only by root")

// readTrusted reads path if it and its directory are owned by root and
// writable by nobody else, the file a regular file (not a link): nothing
// the cage or the gateway's own dynamic user can write is trusted.
func readTrusted(path string) ([]byte, error) {
	for _, p := range []string{dirOf(path), path} {
		st, err := os.Lstat(p)
		if err != nil {
			return nil, err
		}
		sys, ok := st.Sys().(*syscall.Stat_t)
		if !ok || sys.Uid != 0 || st.Mode().Perm()&0o022 != 0 || (p == path && !st.Mode().IsRegular()) || (p != path && !st.IsDir()) {
			return nil, fmt.Errorf("%s: %w", p, ErrUntrusted)
		}
	}
	return os.ReadFile(path)
}

// specialSuffixes are special-use names (RFC 6761, 6762, 7686, 8375 and
// common private zones): never public hosts a policy should name.
var specialSuffixes = []string{"localhost", "local", "internal", "arpa", "invalid", "onion", "home.arpa", "lan", "intranet", "corp"}

// metadataNames resolve to cloud instance metadata services.
var metadataNames = []string{"metadata.google.internal", "metadata.goog", "metadata.azure.com", "instance-data.ec2.internal"}

// SpecialUse says why host is not a public host a policy should allow (a
// special-use or cloud metadata name), or "".
func SpecialUse(host string) string {
	if slices.Contains(metadataNames, host) {
		return "a cloud metadata name"
	}
	for _, s := range specialSuffixes {
		if host == s || strings.HasSuffix(host, "."+s) {
			return "a special-use name (." + s + "), not a public host"
		}
	}
	return ""
}

// Learning is the learn mode a gateway enforces: the window and the shipped
// deny lists. A nil *Learning is learn mode off.
type Learning struct {
	Window LearnWindow
	Deny   []string
}

// Active reports whether l lets requests through at now.
func (l *Learning) Active(now time.Time) bool { return l != nil && l.Window.Active(now) }

// DecideLearning is DecideWithGrants, then learn mode: a request refused
// only for not being allowed (default-deny or port) while the window is
// open is allowed with rule RuleLearn, unless a shipped deny list covers
// the host (rule deny:PATTERN) or it is a special-use name (rule
// special-use). Deny entries and IP literals stay refused as they were.
func (p *Policy) DecideLearning(l *Learning, gs []Grant, now time.Time, host string, port int, method string) Decision {
	d := p.DecideWithGrants(gs, now, host, port, method)
	if d.Result == Allow || (d.Rule != "default-deny" && d.Rule != "port") || !l.Active(now) {
		return d
	}
	if rule, why := neverLearned(l, host); rule != "" {
		return Decision{Result: Deny, Reason: fmt.Sprintf("host %s %s; learn mode never passes it", host, why), Rule: rule}
	}
	return Decision{Result: Allow, Rule: RuleLearn, Intercept: MatchAny(p.Inspect, host) != "",
		Reason: fmt.Sprintf("learn mode until %s: %s; allowed and flagged", l.Window.Until().UTC().Format(time.RFC3339), d.Reason)}
}

// AllowsNameLearning is AllowsNameWithGrants, then learn mode, with
// DecideLearning's exceptions.
func (p *Policy) AllowsNameLearning(l *Learning, gs []Grant, now time.Time, name string) (bool, string) {
	ok, rule := p.AllowsNameWithGrants(gs, now, name)
	if ok || rule != "default-deny" || !l.Active(now) {
		return ok, rule
	}
	if rule, _ := neverLearned(l, name); rule != "" {
		return false, rule
	}
	return true, RuleLearn
}

// neverLearned is the rule and reason learn mode refuses host by, or "":
// a shipped deny list covering it, a name no policy could list (numeric
// forms of addresses such as "2130706433" included), a special-use name.
func neverLearned(l *Learning, host string) (string, string) {
	if dn := MatchDeny(l.Deny, host); dn != "" {
		return "deny:" + dn, "matches shipped deny pattern " + dn
	}
	if err := CheckPattern(host); err != nil {
		if strings.Contains(err.Error(), "IP address") {
			return "ip-literal", "is an address, not a host name"
		}
		return RuleSpecialUse, "is not a host name a policy could list"
	}
	if why := SpecialUse(host); why != "" {
		return RuleSpecialUse, "is " + why
	}
	return "", ""
}

// doc is one of the small files caged, prepare and the gateway hand each
// other: versioned and naming the agent it is for.
type doc interface {
	header() (schema int, agent string)
}

func (w *LearnWindow) header() (int, string) { return w.Schema, w.Agent }
func (d *GrantsDoc) header() (int, string)   { return d.Schema, d.Agent }

// decodeDoc decodes such a file strictly (unknown fields are errors) and
// checks its schema and agent.
func decodeDoc(data []byte, what string, v doc, want int, agent string) error {
	dec := json.NewDecoder(strings.NewReader(string(data)))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return fmt.Errorf("parse %s: %w", what, err)
	}
	schema, a := v.header()
	if schema != want {
		return fmt.Errorf("%s schema %d, want %d", what, schema, want)
	}
	if a != agent {
		return fmt.Errorf("%s is for agent %q, not %q", what, a, agent)
	}
	return nil
}
