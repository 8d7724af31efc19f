package config

import (
	"time"

	"github.com/nixcage/nixcage/internal/harness"
	"github.com/nixcage/nixcage/internal/policy"
)

// Config is the validated, normalized model every other package consumes.
// Everything in it has been checked; defaults are filled in.
type Config struct {
	Agents   []*Agent   // sorted by name
	Accounts []*Account // in declaration order
	Store    *Store     // nil when no store block was declared
	Evidence Evidence   // zero fields: the quarantine package's defaults
	Metrics  *Metrics   // nil when no metrics block was declared (off)
	Control  *Control   // nil when no control block was declared (no commands accepted)
	Relay    *Relay     // nil when no relay block was declared (no chat relay)
	Channel  *Channel   // nil when no channel block was declared (no polling)
	// Policies are the declared named policies, used or not (cagectl run
	// names them too), sorted by name.
	Policies []policy.Policy
}

// Backends an agent can run under.
const (
	BackendService = "service"
	// DefaultBackend is what an agent without `backend` runs under: the
	// lightest cage, needing nothing beyond systemd.
	DefaultBackend = BackendService
	BackendNspawn  = "nspawn"
	BackendPodman  = "podman"
)

// Agent is one cage.
type Agent struct {
	Name        string
	Backend     string
	Command     []string
	Environment map[string]string
	Workspace   string
	Tools       string // tool profile; "" means the store's current generation
	Image       string // podman only; "" means a rootfs built from the host's /usr
	// Harness names the shipped scaffold (package harness) the agent runs
	// under, "" for none. Its policy, secret variable and environment are
	// already folded into the fields here; render adds its files.
	Harness   string
	Autostart bool
	// Interactive agents get a terminal that caged holds (cagectl attach).
	Interactive bool
	Resources   Resources
	Policy      policy.Policy // resolved; Policy.Name is the policy's name
	// InlinePolicy is set when the policy was declared inside the agent.
	InlinePolicy bool
	Secrets      []Secret
	// Learn is learn mode (docs/grants.md), nil when off.
	Learn *Learn
	// Approval is the approval queue, nil when off.
	Approval *Approval
	// TurnCommand is turn_command as declared (nil: the harness's; see
	// TurnArgv). TurnTimeout bounds one turn (docs/relay.md).
	TurnCommand []string
	TurnTimeout time.Duration
}

// TurnArgv is what one turn runs in the cage (the text comes on its stdin):
// turn_command, else the harness's turn command; nil if the agent has none.
func (a *Agent) TurnArgv() []string {
	if len(a.TurnCommand) > 0 {
		return a.TurnCommand
	}
	if h, ok := harness.Lookup(a.Harness); ok {
		return h.TurnCommand
	}
	return nil
}

// Learn: for For after each start of the cage, requests outside the policy
// are allowed and flagged, within the address rules and deny lists.
type Learn struct {
	For time.Duration
	// Deny are the shipped policies' deny lists, which learning never
	// passes whatever the agent's policy is.
	Deny []string
}

// Approval: a request outside the policy waits up to Wait for an
// operator's decision; at most MaxPending wait at once per agent.
type Approval struct {
	Wait       time.Duration
	MaxPending int
}

// Resources are the cgroup limits of the cage.
type Resources struct {
	Memory string // MemoryMax=
	CPU    string // CPUQuota= ("" = unlimited)
	Tasks  int    // TasksMax=
}

// Secret is a credential: its real value stays with the gateway.
type Secret struct {
	Name   string
	Source string // host path, loaded with LoadCredential=
	Env    string
	Hosts  []string
	Header string
}

// Roles, in increasing power. Each includes the ones before it.
const (
	RoleViewer   = "viewer"
	RoleOperator = "operator"
	RoleAdmin    = "admin"
)

// Account grants a Unix user or group a role over some agents.
type Account struct {
	Name   string
	User   string
	Group  string
	Role   string
	Agents []string // empty: every agent
}

// Covers reports whether the account's scope includes agent.
func (a *Account) Covers(agent string) bool {
	if len(a.Agents) == 0 {
		return true
	}
	for _, n := range a.Agents {
		if n == agent {
			return true
		}
	}
	return false
}

// Store configures the shared read-only tool store and release trust.
// Evidence bounds the workspace copy of each quarantine (per agent). A zero
// field means the default, which lives with the copy (package quarantine).
type Evidence struct {
	MaxBytes    int64
	MaxEntries  int
	MaxDuration time.Duration
}

type Store struct {
	Root        string
	Channel     string
	Keys        []string
	NixKeys     []string
	Threshold   int
	Generations int
	// ExpiryWarning: the current generation is reported as expiring this
	// long before its release expires (DefaultExpiryWarning).
	ExpiryWarning time.Duration
	// RootKeys sign key rotations (docs/store.md "Key rotation");
	// RootThreshold of them must (default 1). Empty: no rotation.
	RootKeys      []string
	RootThreshold int
}

// Metrics is caged's Prometheus endpoint.
type Metrics struct {
	// Listen is "HOST:PORT" with a loopback IP literal, or
	// "unix:/run/nixcage/NAME" (DefaultMetricsListen).
	Listen string
}

// Control is the trust and identity for signed control commands.
type Control struct {
	// HostID is what a command's "host" must name; "" means the host
	// name at caged's start.
	HostID    string
	Keys      []string // PEM public key files
	Threshold int
	// AckURL, if set, receives every ack by HTTP PUT (docs/fleet.md).
	AckURL string
}

// Channel is the release channel caged polls (docs/fleet.md "Channels").
type Channel struct {
	// URL is the channel's base: http://, https:// or an absolute
	// directory (a mounted channel).
	URL string
	// Interval between polls (DefaultChannelInterval); failures back off
	// from it.
	Interval time.Duration
	// CAFile replaces the system's CA pool for https ("" = system's).
	CAFile string
}

// Agent returns the agent called name, or nil.
func (c *Config) Agent(name string) *Agent {
	for _, a := range c.Agents {
		if a.Name == name {
			return a
		}
	}
	return nil
}
