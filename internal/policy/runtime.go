// Package policy holds the egress policy as the gateway consumes it: the
// per-agent runtime document that `cagectl render` writes and `cage-egress`
// reads, and the host-matching rules both sides must agree on.
//
// The document is the only contract between the config model and the gateway:
// the gateway never parses HCL, and the renderer never decides traffic.
package policy

import (
	"encoding/json"
	"fmt"
	"os"
	"strings"
)

// Schema is the version of the runtime document. Bump it on any change a
// gateway of the previous version would misread.
const Schema = 1

// Runtime is everything cage-egress needs for one agent.
type Runtime struct {
	Schema  int      `json:"schema"`
	Agent   string   `json:"agent"`
	Policy  Policy   `json:"policy"`
	Secrets []Secret `json:"secrets"`
	// AuditFile is the JSONL audit log; empty disables the file sink.
	AuditFile string `json:"audit_file"`
	// PlaceholderFile is written by `cage-egress prepare` and read by the gateway.
	PlaceholderFile string `json:"placeholder_file"`
	// AgentEnvFile is written by prepare: KEY=placeholder lines for the agent unit.
	AgentEnvFile string `json:"agent_env_file"`
	// ResolvConf is written by prepare and bound at /etc/resolv.conf in the cage.
	ResolvConf string `json:"resolv_conf"`
	// GrantsFile holds the time-bound grants caged writes (grants.go); the
	// gateway watches it. Empty: no grants.
	GrantsFile string `json:"grants_file,omitempty"`
	// BansFile holds the host-wide bans of signed control commands
	// (bans.go); the gateway watches it. Empty: no bans.
	BansFile string `json:"bans_file,omitempty"`
	// Learn turns on learn mode (learn.go); nil: off.
	Learn *Learn `json:"learn,omitempty"`
	// Approval turns on the approval queue (approval.go); nil: off.
	Approval *Approval `json:"approval,omitempty"`
	// CADir holds ca.crt (0644) and ca.key (0600) for TLS interception.
	CADir string `json:"ca_dir"`
}

// Policy is one egress policy, fully resolved (defaults applied).
type Policy struct {
	Name    string   `json:"name"`
	Allow   []string `json:"allow"`
	Deny    []string `json:"deny"`
	Ports   []int    `json:"ports"`
	Inspect []string `json:"inspect"`

	// WebSocket allows WebSocket handshakes on intercepted hosts (every
	// message is then inspected and redacted). The config model sets it.
	WebSocket bool       `json:"websocket"`
	HTTPRules []HTTPRule `json:"http_rules,omitempty"`

	RateLimit  RateLimit   `json:"rate_limit"`
	Inspectors []Inspector `json:"inspectors"`
	Limits     Limits      `json:"limits"`
	DNS        DNS         `json:"dns"`

	// Settings that weaken the gateway's address classification. Named unsafe_
	// so that they stand out in review; tests use them, production should not.
	UnsafeAllowLoopbackUpstreams bool `json:"unsafe_allow_loopback_upstreams"`
	UnsafeAllowPrivateUpstreams  bool `json:"unsafe_allow_private_upstreams"`
}

// RateLimit is a token bucket per destination host.
type RateLimit struct {
	PerSecond float64 `json:"per_second"`
	Burst     int     `json:"burst"`
}

// Inspector actions.
const (
	ActionFlag  = "flag"
	ActionBlock = "block"
)

// Inspector names the gateway knows.
const (
	InspectSecretPatterns = "secret_patterns"
	InspectRealValues     = "real_values"
	InspectBodySize       = "body_size"
	InspectEntropy        = "entropy"
	InspectEncodedBlobs   = "encoded_blobs"
)

// InspectorNames lists every inspector, in the order the gateway runs them.
var InspectorNames = []string{InspectRealValues, InspectSecretPatterns, InspectBodySize, InspectEntropy, InspectEncodedBlobs}

// Inspector is one content check with its action.
type Inspector struct {
	Name   string `json:"name"`
	Action string `json:"action"`
	// Threshold: bits per byte for entropy.
	Threshold float64 `json:"threshold,omitempty"`
	// MaxBytes: body_size limit.
	MaxBytes int64 `json:"max_bytes,omitempty"`
	// MinLength: shortest base64/hex run encoded_blobs reports.
	MinLength int `json:"min_length,omitempty"`
}

// Limits bound what one cage can make the gateway hold.
type Limits struct {
	MaxTunnels         int   `json:"max_tunnels"`
	MaxHeaderBytes     int   `json:"max_header_bytes"`
	MaxBodyBytes       int64 `json:"max_body_bytes"`
	IdleTimeoutSeconds int   `json:"idle_timeout_seconds"`
}

// DNS configures the cage's resolver.
type DNS struct {
	Enabled bool `json:"enabled"`
	// AllowTypes are the record types answered for allowed names; empty
	// means DefaultDNSAllowTypes. Every type is a few more bits per query
	// an agent can choose, so the set is what programs behind an HTTP
	// proxy actually ask for.
	AllowTypes []string `json:"allow_types"`
	// DenyTypes are refused even if listed in AllowTypes (e.g. ANY, AXFR).
	DenyTypes []string `json:"deny_types"`
	// MaxLabelLength caps labels to make tunnelling data through names costly.
	MaxLabelLength int `json:"max_label_length"`
}

// Secret is one credential the gateway injects.
type Secret struct {
	// Name is the LoadCredential= id; the value is read from
	// $CREDENTIALS_DIRECTORY/Name.
	Name string `json:"name"`
	// Env is the variable the agent sees, holding the placeholder.
	Env string `json:"env"`
	// Hosts the real value may be sent to (always over TLS, after inspection).
	Hosts []string `json:"hosts"`
	// Header the real value may appear in.
	Header string `json:"header"`
}

// BenchOnlyIPLiterals is the name a document might give the bench-only
// IP-literal switch; Parse refuses it by name (it is a cage-egress flag
// that refuses to run under systemd, never part of a policy).
const BenchOnlyIPLiterals = "unsafe_bench_ip_literals"

// Load reads and checks a runtime document. A gateway refuses to start on a
// document it cannot fully trust: fail closed.
func Load(path string) (*Runtime, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read egress config: %w", err)
	}
	return Parse(data)
}

// Parse decodes a runtime document strictly (unknown fields are errors).
func Parse(data []byte) (*Runtime, error) {
	dec := json.NewDecoder(strings.NewReader(string(data)))
	dec.DisallowUnknownFields()
	var r Runtime
	if err := dec.Decode(&r); err != nil {
		if strings.Contains(err.Error(), `unknown field "`+BenchOnlyIPLiterals+`"`) {
			return nil, fmt.Errorf("parse egress config: %s is no setting of a runtime document: IP-literal destinations exist only as cage-egress --unsafe-bench-ip-literals, for bench/egress/run.sh (%w)", BenchOnlyIPLiterals, err)
		}
		return nil, fmt.Errorf("parse egress config: %w", err)
	}
	if r.Schema != Schema {
		return nil, fmt.Errorf("egress config schema %d, this gateway reads %d: re-render with a matching cagectl", r.Schema, Schema)
	}
	if r.Agent == "" {
		return nil, fmt.Errorf("egress config names no agent")
	}
	for _, h := range append(append(append([]string{}, r.Policy.Allow...), r.Policy.Deny...), r.Policy.Inspect...) {
		if err := CheckPattern(h); err != nil {
			return nil, fmt.Errorf("egress config: %w", err)
		}
	}
	if r.Learn != nil {
		if err := r.Learn.Check(); err != nil {
			return nil, fmt.Errorf("egress config: %w", err)
		}
	}
	if r.Approval != nil {
		if err := r.Approval.Check(); err != nil {
			return nil, fmt.Errorf("egress config: %w", err)
		}
	}
	for _, hr := range r.Policy.HTTPRules {
		if err := hr.Check(); err != nil {
			return nil, fmt.Errorf("egress config: %w", err)
		}
	}
	return &r, nil
}

// Marshal renders the document deterministically (indented, trailing newline).
func (r *Runtime) Marshal() ([]byte, error) {
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return nil, err
	}
	return append(b, '\n'), nil
}
