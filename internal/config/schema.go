package config

import "github.com/hashicorp/hcl/v2"

// The v1 schema as HCL (and HCL's JSON syntax) decodes it. Field tags are the
// user-facing names: renaming one is a breaking change. gohcl rejects unknown
// arguments and blocks, which is what makes the schema strict.

// fileV1 is one configuration file.
type fileV1 struct {
	Body     hcl.Body      `hcl:",body"`
	Version  *int          `hcl:"version,optional"`
	Agents   []agentV1     `hcl:"agent,block"`
	Policies []namedPolicy `hcl:"egress_policy,block"`
	Accounts []accountV1   `hcl:"account,block"`
	Store    []storeV1     `hcl:"store,block"`
	Evidence []evidenceV1  `hcl:"evidence,block"`
	Metrics  []metricsV1   `hcl:"metrics,block"`
	Control  []controlV1   `hcl:"control,block"`
	Relay    []relayV1     `hcl:"relay,block"`
	Channel  []channelV1   `hcl:"channel,block"`
}

// controlV1 configures signed control commands (docs/fleet.md).
type controlV1 struct {
	Body      hcl.Body `hcl:",body"`
	HostID    *string  `hcl:"host_id,optional"`
	Keys      []string `hcl:"keys"`
	Threshold *int     `hcl:"threshold,optional"`
	AckURL    *string  `hcl:"ack_url,optional"`
}

// relayV1 is the chat relay (cage-relay): where its token is, who may
// command it, which account it acts as, and the chat each agent answers in.
type relayV1 struct {
	Body         hcl.Body      `hcl:",body"`
	TokenFile    string        `hcl:"token_file"`
	Owners       []int64       `hcl:"owners"`
	Account      string        `hcl:"account"`
	APIURL       *string       `hcl:"api_url,optional"`
	MaxFileBytes *int64        `hcl:"max_file_bytes,optional"`
	Chats        []relayChatV1 `hcl:"chat,block"`
}

// relayChatV1 binds one agent to a chat (a group, or one topic of a forum
// group).
type relayChatV1 struct {
	Body   hcl.Body `hcl:",body"`
	Agent  string   `hcl:"agent,label"`
	ChatID int64    `hcl:"chat_id"`
	Topic  *int64   `hcl:"topic,optional"`
}

// channelV1 makes caged poll a release channel (docs/fleet.md).
type channelV1 struct {
	Body     hcl.Body `hcl:",body"`
	URL      string   `hcl:"url"`
	Interval *string  `hcl:"interval,optional"`
	CAFile   *string  `hcl:"ca_file,optional"`
}

// metricsV1 turns on caged's Prometheus endpoint.
type metricsV1 struct {
	Body   hcl.Body `hcl:",body"`
	Listen *string  `hcl:"listen,optional"`
}

// evidenceV1 bounds each quarantine's copy of an agent's workspace.
type evidenceV1 struct {
	Body        hcl.Body `hcl:",body"`
	MaxBytes    *int64   `hcl:"max_bytes,optional"`
	MaxEntries  *int     `hcl:"max_entries,optional"`
	MaxDuration *string  `hcl:"max_duration,optional"`
}

type agentV1 struct {
	Body        hcl.Body          `hcl:",body"`
	Name        string            `hcl:"name,label"`
	Backend     string            `hcl:"backend,optional"`
	Command     []string          `hcl:"command"`
	Environment map[string]string `hcl:"environment,optional"`
	Workspace   *string           `hcl:"workspace,optional"`
	Tools       *string           `hcl:"tools,optional"`
	Image       *string           `hcl:"image,optional"`
	Egress      *string           `hcl:"egress,optional"`
	Harness     *string           `hcl:"harness,optional"`
	Autostart   *bool             `hcl:"autostart,optional"`
	Interactive *bool             `hcl:"interactive,optional"`
	Learn       *bool             `hcl:"learn,optional"`
	LearnFor    *string           `hcl:"learn_for,optional"`
	TurnCommand *[]string         `hcl:"turn_command,optional"`
	TurnTimeout *string           `hcl:"turn_timeout,optional"`
	Approval    []approvalV1      `hcl:"approval,block"`
	Inline      []policyV1        `hcl:"egress_policy,block"`
	Resources   []resourcesV1     `hcl:"resources,block"`
	Secrets     []secretV1        `hcl:"secret,block"`
}

// approvalV1 makes requests outside the policy wait for an operator.
type approvalV1 struct {
	Body       hcl.Body `hcl:",body"`
	Wait       *string  `hcl:"wait,optional"`
	MaxPending *int     `hcl:"max_pending,optional"`
}

type resourcesV1 struct {
	Body   hcl.Body `hcl:",body"`
	Memory *string  `hcl:"memory,optional"`
	CPU    *string  `hcl:"cpu,optional"`
	Tasks  *int     `hcl:"tasks,optional"`
}

type secretV1 struct {
	Body   hcl.Body `hcl:",body"`
	Name   string   `hcl:"name,label"`
	Source string   `hcl:"source"`
	Env    *string  `hcl:"env,optional"` // optional where the agent's harness names it
	Hosts  []string `hcl:"hosts,optional"`
	Header *string  `hcl:"header,optional"`
}

// namedPolicy is decoded in two steps (label, then the rest as policyV1) so
// named and inline policies share one schema.
type namedPolicy struct {
	Name   string   `hcl:"name,label"`
	Remain hcl.Body `hcl:",remain"`
	policy policyV1 // decoded from Remain
}

type policyV1 struct {
	Body        hcl.Body       `hcl:",body"`
	Allow       []string       `hcl:"allow,optional"`
	Deny        []string       `hcl:"deny,optional"`
	Ports       []int          `hcl:"ports,optional"`
	Inspect     []string       `hcl:"inspect,optional"`
	RateLimit   []rateLimitV1  `hcl:"rate_limit,block"`
	Inspectors  []inspectorV1  `hcl:"inspector,block"`
	Limits      []limitsV1     `hcl:"limits,block"`
	DNS         []dnsV1        `hcl:"dns,block"`
	Credentials []credentialV1 `hcl:"credential,block"`
	WebSocket   *bool          `hcl:"websocket,optional"`
	HTTPRules   []httpRuleV1   `hcl:"http_rule,block"`

	UnsafeAllowLoopbackUpstreams *bool `hcl:"unsafe_allow_loopback_upstreams,optional"`
	UnsafeAllowPrivateUpstreams  *bool `hcl:"unsafe_allow_private_upstreams,optional"`
	// Decoded only to be refused with a message naming what it is: a
	// bench-only switch of cage-egress, never a policy setting.
	UnsafeBenchIPLiterals *bool `hcl:"unsafe_bench_ip_literals,optional"`
}

// httpRuleV1 allows or denies requests to intercepted hosts by method and
// path.
type httpRuleV1 struct {
	Body    hcl.Body `hcl:",body"`
	Name    string   `hcl:"name,label"`
	Hosts   []string `hcl:"hosts"`
	Methods []string `hcl:"methods,optional"`
	Paths   []string `hcl:"paths,optional"`
	Action  string   `hcl:"action"`
}

type rateLimitV1 struct {
	Body      hcl.Body `hcl:",body"`
	PerSecond float64  `hcl:"per_second"`
	Burst     *int     `hcl:"burst,optional"`
}

type inspectorV1 struct {
	Body      hcl.Body `hcl:",body"`
	Name      string   `hcl:"name,label"`
	Action    string   `hcl:"action"`
	Threshold *float64 `hcl:"threshold,optional"`
	MaxBytes  *int64   `hcl:"max_bytes,optional"`
	MinLength *int     `hcl:"min_length,optional"`
}

type limitsV1 struct {
	Body           hcl.Body `hcl:",body"`
	MaxTunnels     *int     `hcl:"max_tunnels,optional"`
	MaxHeaderBytes *int     `hcl:"max_header_bytes,optional"`
	MaxBodyBytes   *int64   `hcl:"max_body_bytes,optional"`
	IdleTimeout    *string  `hcl:"idle_timeout,optional"`
}

type dnsV1 struct {
	Body           hcl.Body `hcl:",body"`
	Enabled        *bool    `hcl:"enabled,optional"`
	AllowTypes     []string `hcl:"allow_types,optional"`
	DenyTypes      []string `hcl:"deny_types,optional"`
	MaxLabelLength *int     `hcl:"max_label_length,optional"`
}

// credentialV1 lets a shipped policy say where a named credential belongs, so
// an agent's `secret "anthropic"` needs only its source and variable.
type credentialV1 struct {
	Body   hcl.Body `hcl:",body"`
	Name   string   `hcl:"name,label"`
	Hosts  []string `hcl:"hosts"`
	Header *string  `hcl:"header,optional"`
}

type accountV1 struct {
	Body   hcl.Body `hcl:",body"`
	Name   string   `hcl:"name,label"`
	User   *string  `hcl:"user,optional"`
	Group  *string  `hcl:"group,optional"`
	Role   string   `hcl:"role"`
	Agents []string `hcl:"agents,optional"`
}

type storeV1 struct {
	Body        hcl.Body `hcl:",body"`
	Root        *string  `hcl:"root,optional"`
	Channel     string   `hcl:"channel"`
	Keys        []string `hcl:"keys"`
	NixKeys     []string `hcl:"nix_keys,optional"`
	Threshold   *int     `hcl:"threshold,optional"`
	Generations *int     `hcl:"generations,optional"`
	// ExpiryWarning is days ("7d") or a Go duration ("36h").
	ExpiryWarning *string  `hcl:"expiry_warning,optional"`
	RootKeys      []string `hcl:"root_keys,optional"`
	RootThreshold *int     `hcl:"root_threshold,optional"`
}
