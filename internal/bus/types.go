// Package bus is caged's D-Bus API, org.nixcage.cage1, in the style of
// systemd's org.freedesktop.machine1: a Manager object at /org/nixcage/cage1
// and one object per agent under /org/nixcage/cage1/agent, full
// introspection, read-only properties that emit PropertiesChanged, and
// signals for agent state, egress decisions and applied releases.
//
// The server authorizes every call itself from the caller's uid (asked of the
// bus, never taken from the message) and groups against the declared
// accounts; the bus policy decides who may own the name (root) and who may
// receive audit signals at all. Signals carrying audit data are never
// broadcast: they are addressed to subscribers (Subscribe) allowed to view
// the agent. The typed Client is what cagectl and any other tool use; the
// wire types below are shared by both sides.
package bus

import (
	"errors"
	"fmt"

	sdbus "github.com/coreos/go-systemd/v22/dbus"
	"github.com/godbus/dbus/v5"

	"github.com/nixcage/nixcage/internal/paths"
	"github.com/nixcage/nixcage/internal/policy"
)

// Names on the bus.
const (
	Name         = paths.BusName
	Path         = dbus.ObjectPath(paths.BusPath)
	ManagerIface = paths.BusIface
	AgentIface   = "org.nixcage.cage1.Agent"

	// Errors the server returns.
	ErrorAccessDenied = "org.nixcage.cage1.Error.AccessDenied"
	ErrorNoSuchAgent  = "org.nixcage.cage1.Error.NoSuchAgent"
	ErrorQuarantined  = "org.nixcage.cage1.Error.Quarantined"
	ErrorInvalid      = "org.nixcage.cage1.Error.InvalidArgument"
	ErrorFailed       = "org.nixcage.cage1.Error.Failed"
	// ErrorIO: the store's own disk failed; nothing was switched.
	ErrorIO = "org.nixcage.cage1.Error.IO"
)

// Signals on the Manager interface.
const (
	SignalAgentStateChanged = "AgentStateChanged" // (s agent, s active_state, s sub_state)
	SignalEgressDecision    = "EgressDecision"    // (s agent, s decision, s host, s reason, s record)
	SignalReleaseApplied    = "ReleaseApplied"    // (t generation, t previous, s by)
	SignalAgentQuarantined  = "AgentQuarantined"  // (s agent, s reason, s evidence, s by)
	SignalAgentReleased     = "AgentReleased"     // (s agent, s by)
	SignalAgentKilled       = "AgentKilled"       // (s agent, s by)
	SignalReconciled        = "Reconciled"        // (s error) "" on success
	SignalEgressFailed      = "EgressFailed"      // (s agent, s reason, s recover) the gateway is down for good (start limit hit, ...)
)

// AgentPath is the object path of an agent. Names are escaped as systemd
// escapes unit names in object paths ('-' becomes "_2d").
func AgentPath(agent string) dbus.ObjectPath {
	return dbus.ObjectPath(paths.AgentPath + "/" + sdbus.PathBusEscape(agent))
}

// AgentStatus is one agent as the Manager reports it. Field order is the
// wire order: (sssssssbbsttttsx).
type AgentStatus struct {
	Name             string `json:"name"`
	Backend          string `json:"backend"`
	Unit             string `json:"unit"`
	LoadState        string `json:"load_state"`
	ActiveState      string `json:"active_state"`
	SubState         string `json:"sub_state"`
	EgressState      string `json:"egress_state"`
	Autostart        bool   `json:"autostart"`
	Quarantined      bool   `json:"quarantined"`
	QuarantineReason string `json:"quarantine_reason,omitempty"`
	// Generation is the store generation the agent started with (0: not
	// running, or no store). A running agent keeps its generation until
	// restarted, even after a newer release is applied.
	Generation uint64 `json:"generation"`
	// Egress decisions since caged started (from the gateway's audit log).
	Allowed uint64 `json:"egress_allowed"`
	Flagged uint64 `json:"egress_flagged"`
	Blocked uint64 `json:"egress_blocked"`
	// RunBy is who started a throw-away cage (cagectl run); "" for a
	// declared agent.
	RunBy string `json:"run_by,omitempty"`
	// LearnUntilUnix is the end of the cage's learn window (0: learn mode
	// off or no window stamped); past it the policy applies again.
	LearnUntilUnix int64 `json:"learn_until_unix,omitempty"`
}

// Status is the appliance and every agent.
type Status struct {
	Version    string `json:"version"`
	Mode       string `json:"units"` // "render" or "os"
	Config     string `json:"config"`
	Generation uint64 `json:"generation"` // store generation in use, 0 if none
	Channel    string `json:"channel"`
	// GenerationExpiresUnix is when the current generation's release
	// expires (0 if none); Freshness is "none", "ok", "expiring" (within
	// store.expiry_warning) or "expired" (a frozen channel).
	GenerationExpiresUnix int64  `json:"generation_expires_unix"`
	Freshness             string `json:"freshness"`
	// FreshnessMessage says what an operator does about it ("" when ok).
	FreshnessMessage string        `json:"freshness_message,omitempty"`
	StartedUnix      int64         `json:"started_unix"`
	ReconciledUnix   int64         `json:"reconciled_unix"`
	ReconcileError   string        `json:"reconcile_error,omitempty"`
	Agents           []AgentStatus `json:"agents"`
	// ChannelPoll is the release channel poller's state (URL "" when
	// caged polls no channel).
	ChannelPoll ChannelStatus `json:"channel_poll"`
	// Bans are the host names signed control commands banned on this host
	// (docs/fleet.md), in force in every affected gateway.
	Bans []policy.Ban `json:"bans"`
}

// ChannelStatus is the pulled channel's state (docs/fleet.md "Status").
type ChannelStatus struct {
	URL             string `json:"url"`
	LastPollUnix    int64  `json:"last_poll_unix"`    // 0: no poll finished yet
	LastSuccessUnix int64  `json:"last_success_unix"` // 0: none succeeded
	NextPollUnix    int64  `json:"next_poll_unix"`
	// Published is the generation the channel's index named at the last
	// poll that read it; Lag is Published minus the store's current
	// generation (> 0: behind; < 0: the channel serves an older one).
	Published uint64 `json:"published_generation"`
	Lag       int64  `json:"lag"`
	LastError string `json:"last_error,omitempty"`
	Failures  uint32 `json:"failures"` // consecutive failed polls
}

// Generation is one kept store generation.
type Generation struct {
	Number      uint64 `json:"generation"`
	Channel     string `json:"channel"`
	CreatedUnix int64  `json:"created_unix"`
	ExpiresUnix int64  `json:"expires_unix"`
	Top         string `json:"top"`
	Paths       uint32 `json:"paths"`
	Current     bool   `json:"current"`
}

// ApplyResult summarises an applied release.
type ApplyResult struct {
	Generation uint64 `json:"generation"`
	Previous   uint64 `json:"previous"`
	Channel    string `json:"channel"`
	Top        string `json:"top"`
	Added      uint32 `json:"added"`
	Reused     uint32 `json:"reused"`
	Bytes      int64  `json:"bytes"`
	// Warnings are failures after the switch: the generation is current.
	Warnings []string `json:"warnings"`
}

// Sentinel errors a Client returns (wrapped in *RemoteError or a dial error).
var (
	ErrDenied      = errors.New("access denied")
	ErrNoSuchAgent = errors.New("no such agent")
	ErrUnavailable = errors.New("caged is not available")
	// ErrIO marks a store I/O failure (out of space or inodes, read-only,
	// I/O error): a backend wraps it, the server sends ErrorIO, a client's
	// RemoteError matches it again.
	ErrIO = errors.New("store I/O failure")
)

// RemoteError is an error caged returned.
type RemoteError struct {
	Name    string
	Message string
}

func (e *RemoteError) Error() string { return e.Message }

// Is maps D-Bus error names to the sentinels.
func (e *RemoteError) Is(target error) bool {
	switch target {
	case ErrDenied:
		return e.Name == ErrorAccessDenied || e.Name == "org.freedesktop.DBus.Error.AccessDenied"
	case ErrNoSuchAgent:
		return e.Name == ErrorNoSuchAgent
	case ErrIO:
		return e.Name == ErrorIO
	case ErrBusy:
		return e.Name == ErrorBusy
	case ErrUnavailable:
		return e.Name == "org.freedesktop.DBus.Error.ServiceUnknown" ||
			e.Name == "org.freedesktop.DBus.Error.NameHasNoOwner" ||
			e.Name == "org.freedesktop.DBus.Error.NoReply"
	}
	return false
}

func newError(name, format string, args ...any) *dbus.Error {
	return &dbus.Error{Name: name, Body: []any{fmt.Sprintf(format, args...)}}
}
