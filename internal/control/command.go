// Package control is the fleet's signed control commands (docs/fleet.md,
// "Control commands"): their format, how they are signed and verified,
// the replay cache that makes each execute at most once, and the
// acknowledgement record every attempt leaves.
//
// A command is signed over its canonical bytes with the store's signature
// machinery (package release: sigstore pkg/signature, KeyIDs, k-of-n), but
// against a key set of its own (config `control.keys`/`threshold`): a
// release key can issue commands only where an operator lists it there.
//
// Everything here is pure (no bus, no systemd): caged runs the stages in
// order (Parse, Verify, Validate, CheckTarget, CheckTime, the replay
// cache) and executes only what passed all of them.
package control

import (
	"bytes"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/nixcage/nixcage/internal/policy"
	"github.com/nixcage/nixcage/internal/release"
)

// Schema versions the command and its envelope.
const Schema = 1

// Actions a command may name.
const (
	ActionKill       = "kill"
	ActionQuarantine = "quarantine"
	ActionRelease    = "release"
	ActionPause      = "pause"
	ActionResume     = "resume"
	ActionBanHost    = "ban-host"
	ActionUnbanHost  = "unban-host"
)

// Actions is every action, in the order docs/fleet.md lists them.
var Actions = []string{ActionKill, ActionQuarantine, ActionRelease, ActionPause, ActionResume, ActionBanHost, ActionUnbanHost}

// All is the target meaning "every host" (Host) or "every agent" (Agent).
const All = "*"

// Bounds. A command is short-lived on purpose: the replay cache keeps an
// entry until the command expires (plus ClockSkew), so MaxLifetime bounds
// how long an entry lives and, with MaxCacheEntries, the cache's size.
const (
	// MaxSize bounds a signed command document as read from a file, the
	// bus or a channel.
	MaxSize = 64 << 10
	// MaxLifetime is the longest expires - issued accepted.
	MaxLifetime = 24 * time.Hour
	// ClockSkew is how far the host's clock may disagree with the
	// issuer's, either way: a command issued up to this far in the future
	// is valid, and one is still valid this long past its expires.
	ClockSkew = 5 * time.Minute
	// MaxReason bounds the reason (one line).
	MaxReason = 200
)

// Ack statuses (docs/fleet.md, "Acknowledgements").
const (
	StatusExecuted  = "executed"
	StatusFailed    = "failed" // verified and claimed, but the action itself failed
	StatusRejected  = "rejected"
	StatusDuplicate = "duplicate"
	StatusExpired   = "expired"
)

// Command is what an issuer signs. Field order is the canonical order.
type Command struct {
	Schema int    `json:"schema"`
	Action string `json:"action"`
	// Host is the target host's id (config control.host_id) or "*".
	Host string `json:"host"`
	// Agent is a declared agent's name or "*" (every agent of the host).
	Agent string `json:"agent"`
	// Ban is the host name (exact, covering its subdomains, or "*.suffix")
	// that ban-host and unban-host act on; empty for other actions.
	Ban     string    `json:"ban,omitempty"`
	Issued  time.Time `json:"issued"`
	Expires time.Time `json:"expires"`
	// Nonce is 128 random bits in hex: two commands alike in every other
	// field are still two commands, and the replay cache knows it.
	Nonce  string `json:"nonce"`
	Reason string `json:"reason"`
}

// Signed is the document that travels (file, bus, channel): the command
// and signatures over its canonical bytes.
type Signed struct {
	Schema     int                 `json:"schema"`
	Command    json.RawMessage     `json:"command"`
	Signatures []release.Signature `json:"signatures"`
}

// Refusal is why a command was not executed; Status is the ack status
// (rejected, duplicate, expired).
type Refusal struct {
	Status string
	Reason string
}

func (r *Refusal) Error() string { return r.Status + ": " + r.Reason }

func reject(format string, args ...any) *Refusal {
	return &Refusal{Status: StatusRejected, Reason: fmt.Sprintf(format, args...)}
}

// AsRefusal returns err's refusal, or a rejection carrying err's text.
func AsRefusal(err error) *Refusal {
	var r *Refusal
	if errors.As(err, &r) {
		return r
	}
	return reject("%v", err)
}

// Canonical is the command's canonical encoding, the bytes that are signed
// and hashed: compact JSON, fields in declaration order, times in UTC. It
// is re-derived from the parsed command on every side, so whitespace, key
// order, duplicate keys or time zones in a document cannot make the bytes
// verified differ from the command executed.
func (c *Command) Canonical() []byte {
	cp := *c
	cp.Issued, cp.Expires = c.Issued.UTC(), c.Expires.UTC()
	b, err := json.Marshal(&cp)
	if err != nil {
		panic(err) // strings and times only: cannot fail
	}
	return b
}

// Hash is the hex SHA-256 of the canonical bytes: the command's id in the
// replay cache and in every ack.
func (c *Command) Hash() string {
	sum := sha256.Sum256(c.Canonical())
	return hex.EncodeToString(sum[:])
}

// HashBytes is the hex SHA-256 of raw: the ack's hash of a document that
// did not parse as a command.
func HashBytes(raw []byte) string {
	sum := sha256.Sum256(raw)
	return hex.EncodeToString(sum[:])
}

// NewNonce returns 128 random bits in hex.
func NewNonce() (string, error) {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", err
	}
	return hex.EncodeToString(b[:]), nil
}

// Sign wraps c with signatures by every key (distinct keys only).
func Sign(c *Command, keys []*release.PrivateKey) (*Signed, error) {
	if len(keys) == 0 {
		return nil, errors.New("no signing key: pass --key (a key listed in the hosts' control.keys)")
	}
	canon := c.Canonical()
	sigs, err := release.Sign(canon, keys)
	if err != nil {
		return nil, err
	}
	return &Signed{Schema: Schema, Command: canon, Signatures: sigs.Signatures}, nil
}

// AddSignatures signs s's command with more keys (co-signing towards a
// threshold); a key that already signed is refused.
func (s *Signed) AddSignatures(keys []*release.PrivateKey) error {
	c, err := parseCommand(s.Command)
	if err != nil {
		return err
	}
	for _, k := range keys {
		if slices.ContainsFunc(s.Signatures, func(x release.Signature) bool { return x.KeyID == k.ID }) {
			return fmt.Errorf("key %s already signed this command", k.ID[:16])
		}
	}
	sigs, err := release.Sign(c.Canonical(), keys)
	if err != nil {
		return err
	}
	s.Signatures = append(s.Signatures, sigs.Signatures...)
	return nil
}

// Marshal renders the signed document.
func (s *Signed) Marshal() ([]byte, error) {
	b, err := json.MarshalIndent(s, "", "  ")
	if err != nil {
		return nil, err
	}
	return append(b, '\n'), nil
}

// Parsed is a signed document decoded: the command, its canonical hash
// and its signatures (not yet verified).
type Parsed struct {
	Command *Command
	Hash    string
	sigs    *release.Signatures
}

// Parse decodes a signed command strictly: unknown fields, trailing data,
// a wrong schema or an oversized document are rejected (malformed).
func Parse(raw []byte) (*Parsed, error) {
	if len(raw) > MaxSize {
		return nil, reject("malformed: command document is %d bytes, more than the %d allowed", len(raw), MaxSize)
	}
	var s Signed
	if err := release.DecodeStrict(raw, &s, "envelope"); err != nil {
		return nil, reject("malformed: %v", err)
	}
	if s.Schema != Schema {
		return nil, reject("malformed: envelope schema %d is not supported (want %d)", s.Schema, Schema)
	}
	if len(s.Signatures) > 32 {
		return nil, reject("malformed: %d signatures, more than the 32 allowed", len(s.Signatures))
	}
	c, err := parseCommand(s.Command)
	if err != nil {
		return nil, err
	}
	return &Parsed{Command: c, Hash: c.Hash(), sigs: &release.Signatures{Schema: release.Schema, Signatures: s.Signatures}}, nil
}

func parseCommand(raw []byte) (*Command, error) {
	if len(bytes.TrimSpace(raw)) == 0 {
		return nil, reject("malformed: the document has no command")
	}
	var c Command
	if err := release.DecodeStrict(raw, &c, "command"); err != nil {
		return nil, reject("malformed: %v", err)
	}
	if c.Schema != Schema {
		return nil, reject("malformed: command schema %d is not supported (want %d)", c.Schema, Schema)
	}
	// The canonical bytes hold the times in UTC, and JSON times exist only
	// for the years 0-9999: "9999-12-31T23:59:59-23:59" parses but is year
	// 10000 in UTC. Refused here, so every parsed command has canonical
	// bytes (Canonical cannot fail) before anything was verified.
	for _, tm := range []struct {
		name string
		t    time.Time
	}{{"issued", c.Issued}, {"expires", c.Expires}} {
		if y := tm.t.UTC().Year(); y < 0 || y > 9999 {
			return nil, reject("malformed: %s %s is outside the years 0-9999 in UTC", tm.name, tm.t.Format(time.RFC3339))
		}
	}
	return &c, nil
}

// Verify checks that at least threshold distinct keys of trusted signed
// the canonical bytes. Signatures by other keys count for nothing; the
// refusal names them, so an operator sees "signed by an untrusted key"
// rather than only a count.
func (p *Parsed) Verify(trusted []*release.PublicKey, threshold int) error {
	if len(trusted) == 0 {
		return reject("no control keys are configured (control.keys): this host accepts no commands")
	}
	if threshold < 1 || threshold > len(trusted) {
		return reject("control.threshold %d with %d key(s) can never be met", threshold, len(trusted))
	}
	if len(p.sigs.Signatures) == 0 {
		return reject("unsigned: the command carries no signature; sign it with `cagectl control sign --key`")
	}
	canon := p.Command.Canonical()
	valid := release.ValidSigners(canon, p.sigs, trusted)
	if len(valid) >= threshold {
		return nil
	}
	known := map[string]bool{}
	for _, k := range trusted {
		known[k.ID] = true
	}
	var unknown, bad []string
	for _, s := range p.sigs.Signatures {
		switch {
		case !known[s.KeyID]:
			unknown = append(unknown, short(s.KeyID))
		case !slices.Contains(valid, s.KeyID):
			bad = append(bad, short(s.KeyID))
		}
	}
	msg := fmt.Sprintf("signature: %d valid signature(s) from control keys, threshold is %d", len(valid), threshold)
	if len(bad) > 0 {
		msg += "; signature by control key(s) " + strings.Join(bad, ", ") + " does not match the command (signed over other bytes)"
	}
	if len(unknown) > 0 {
		msg += "; signed by key(s) not in control.keys: " + strings.Join(unknown, ", ")
	}
	return reject("%s", msg)
}

func short(id string) string {
	if len(id) > 16 {
		return id[:16]
	}
	return id
}

var (
	nonceRe = regexp.MustCompile(`^[0-9a-f]{32}$`)
	// HostIDPattern is what a host id (config control.host_id) may be.
	HostIDPattern = regexp.MustCompile(`^[a-z0-9]([a-z0-9.-]{0,62}[a-z0-9])?$`)
	agentRe       = regexp.MustCompile(`^[a-z][a-z0-9-]{0,30}$`)
)

// Validate checks the command's own fields: a known action, well-formed
// targets, a ban name where one is needed and only there, a nonce, a
// one-line reason, and a lifetime within MaxLifetime.
func (c *Command) Validate() error {
	if !slices.Contains(Actions, c.Action) {
		return reject("unknown action %q: one of %s", c.Action, strings.Join(Actions, ", "))
	}
	if c.Host != All && !HostIDPattern.MatchString(c.Host) {
		return reject("target host %q is not a host id (lower-case letters, digits, '.', '-') nor %q", c.Host, All)
	}
	if c.Agent != All && !agentRe.MatchString(c.Agent) {
		return reject("target agent %q is not an agent name nor %q", c.Agent, All)
	}
	isBan := c.Action == ActionBanHost || c.Action == ActionUnbanHost
	switch {
	case isBan && c.Ban == "":
		return reject("%s needs the host name to ban in \"ban\"", c.Action)
	case isBan:
		if err := policy.CheckPattern(c.Ban); err != nil || policy.Normalize(c.Ban) != c.Ban {
			return reject("ban %q is not a host name or *.suffix pattern in normal form", c.Ban)
		}
	case c.Ban != "":
		return reject("%s takes no \"ban\" (only ban-host and unban-host do)", c.Action)
	}
	if !nonceRe.MatchString(c.Nonce) {
		return reject("nonce %q is not 32 lower-case hex digits (128 random bits)", c.Nonce)
	}
	if len(c.Reason) > MaxReason || strings.ContainsAny(c.Reason, "\n\r\x00") {
		return reject("reason must be one line of at most %d bytes", MaxReason)
	}
	if c.Issued.IsZero() || c.Expires.IsZero() || !c.Expires.After(c.Issued) {
		return reject("issued and expires are required, expires after issued")
	}
	if life := c.Expires.Sub(c.Issued); life > MaxLifetime {
		return reject("lifetime %s (expires - issued) is more than the %s allowed: commands are short-lived so the replay cache stays bounded", life, MaxLifetime)
	}
	return nil
}

// CheckTarget refuses a command for another host.
func (c *Command) CheckTarget(hostID string) error {
	if c.Host != All && c.Host != hostID {
		return reject("wrong host: the command is for host %q, this host is %q (control.host_id)", c.Host, hostID)
	}
	return nil
}

// CheckTime refuses a command not valid at now, allowing ClockSkew either
// way.
func (c *Command) CheckTime(now time.Time) error {
	if c.Issued.After(now.Add(ClockSkew)) {
		return reject("not yet valid: issued %s, more than %s after this host's clock (%s)", c.Issued.UTC().Format(time.RFC3339), ClockSkew, now.UTC().Format(time.RFC3339))
	}
	if !now.Before(c.Expires.Add(ClockSkew)) {
		return &Refusal{Status: StatusExpired, Reason: fmt.Sprintf("expired at %s (this host's clock: %s, %s skew allowed)", c.Expires.UTC().Format(time.RFC3339), now.UTC().Format(time.RFC3339), ClockSkew)}
	}
	return nil
}

// Check runs the stages that need no host state, in order: parse, verify,
// validate, target, time. The command comes back when it parsed (also
// with a refusal), so the ack can name it.
func Check(raw []byte, trusted []*release.PublicKey, threshold int, hostID string, now time.Time) (*Parsed, error) {
	p, err := Parse(raw)
	if err != nil {
		return nil, err
	}
	for _, stage := range []func() error{
		func() error { return p.Verify(trusted, threshold) },
		p.Command.Validate,
		func() error { return p.Command.CheckTarget(hostID) },
		func() error { return p.Command.CheckTime(now) },
	} {
		if err := stage(); err != nil {
			return p, err
		}
	}
	return p, nil
}
