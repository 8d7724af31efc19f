// Package paths is the single source of truth for where nixcage keeps things
// on a host and how its systemd units are named. The renderer, the gateway's
// prepare step, caged and the tests all derive locations from here, so a path
// can never disagree between the unit that creates it and the one that reads it.
package paths

import (
	"path/filepath"
	"strconv"
)

// Default locations. Prefix is where rendered configuration lives ("/etc" for
// units installed by an operator or NixOS, "/run" for units caged renders).
const (
	DefaultPrefix    = "/etc"
	DefaultStoreRoot = "/var/lib/nixcage/store"
	WorkspaceRoot    = "/var/lib/nixcage/agents"
	EgressStateRoot  = "/var/lib/nixcage/egress"
	RuntimeRoot      = "/run/nixcage"
	EvidenceRoot     = "/var/lib/nixcage/evidence"
	QuarantineRoot   = "/var/lib/nixcage/quarantine"
	// CageRootfs is the skeleton root (mount points and the merged-/usr
	// symlinks, nothing else) that service cages start from. systemd adds
	// a mount point for each service cage's workspace to it.
	CageRootfs = "/var/lib/nixcage/rootfs"
	// PodmanRootfs is the same skeleton for podman cages, kept apart so
	// that the mount points systemd leaves in CageRootfs (named after the
	// service agents) are not visible in them.
	PodmanRootfs = "/var/lib/nixcage/rootfs-podman"
	// PodmanConf is relative to the prefix: containers.conf for podman cages.
	PodmanConf = "nixcage/containers.conf"
	// TmpfilesConf is relative to the prefix.
	TmpfilesConf = "tmpfiles.d/nixcage.conf"

	// Inside a cage.
	CageCACert     = "/etc/nixcage/ca.crt"
	CageProxyAddr  = "127.0.0.1:3128"
	CageDNSAddr    = "127.0.0.1:53"
	CageStoreMount = "/nix/store"
	CageTools      = "/nix/tools"
	// CageStoreRoot is where a service cage sees the whole store root
	// (read-only): its /nix/store and /nix/tools are symlinks into it in
	// the skeleton, so every link on the way resolves inside the cage
	// (docs/store.md, "Bind sources never leave the store").
	CageStoreRoot = "/nix/.nixcage"
	CageWorkspace = "/workspace"
	// CageSeal is where nspawn and podman cages see cage-seal, the program
	// that seals the cage from inside before it execs the agent.
	CageSeal = "/etc/nixcage/cage-seal"

	// Socket-activation names (FileDescriptorName=) of the gateway's
	// listeners: the HTTP proxy, and the DNS pair (UDP and TCP).
	FDProxy = "proxy"
	FDDNS   = "dns"

	// Bus.
	BusName   = "org.nixcage.cage1"
	BusPath   = "/org/nixcage/cage1"
	BusIface  = "org.nixcage.cage1.Manager"
	AgentPath = "/org/nixcage/cage1/agent"
)

// BusAuditSignals are the Manager signals that carry a declared agent's
// audit data (what it sent, who acted on it); the first argument names the
// agent. caged sends each only to subscribed callers allowed to view that
// agent, and the rendered bus policy lets only root and the declared
// accounts receive them at all.
var BusAuditSignals = []string{"EgressDecision", "AgentQuarantined", "AgentReleased", "AgentKilled", "RelayAction", "ApprovalPending", "ApprovalDecided"}

// Unit names. Templates are instantiated with the agent name.
const (
	CagedUnit      = "nixcage-caged.service"
	TargetUnit     = "nixcage.target"
	NetnsTemplate  = "nixcage-netns@.service"
	PrepTemplate   = "nixcage-prep@.service"
	ProxySocketTpl = "cage-egress@.socket"
	DNSSocketTpl   = "cage-egress-dns@.socket"
	EgressTemplate = "cage-egress@.service"
	AgentTemplate  = "nixcage-agent@.service"
	// TurnTemplate names the transient unit of one turn of an agent
	// (docs/relay.md); no unit file of that name is ever installed.
	TurnTemplate = "nixcage-turn@.service"
	RelayUnit    = "cage-relay.service"
)

// The chat relay (cage-relay, docs/relay.md). It runs as a fixed system
// user, not a name systemd makes up at start: caged identifies callers by
// uid and name through the passwd database, and a DynamicUser= name is
// visible only through nss-systemd, which a Go binary built without cgo
// (os/user reads /etc/passwd) does not consult. With the user declared
// (sysusers.d or NixOS users.users), DynamicUser=yes still applies its
// sandbox and uses that user.
const (
	RelayUser = "cage-relay"
	// RelayConfig is the relay's runtime document, under the prefix.
	RelayConfig = "nixcage/relay.json"
	// RelaySysusers declares RelayUser, under the prefix.
	RelaySysusers = "sysusers.d/cage-relay.conf"
	// RelayTokenCredential is the LoadCredential= name of the bot token.
	RelayTokenCredential = "telegram-token"
)

// Instance turns "name@.suffix" into "name@agent.suffix".
func Instance(template, agent string) string {
	for i := 0; i < len(template); i++ {
		if template[i] == '@' {
			return template[:i+1] + agent + template[i+1:]
		}
	}
	return template
}

// NetnsName is the name of the agent's network namespace under /run/netns.
func NetnsName(agent string) string { return "nixcage-" + agent }

// NetnsPath is the bind-mounted namespace file units join.
func NetnsPath(agent string) string { return "/run/netns/" + NetnsName(agent) }

// ConfigDir holds the rendered per-agent runtime configuration.
func ConfigDir(prefix, agent string) string {
	return filepath.Join(prefix, "nixcage", "agents", agent)
}

// EgressConfig is the document cage-egress reads for one agent.
func EgressConfig(prefix, agent string) string {
	return filepath.Join(ConfigDir(prefix, agent), "egress.json")
}

// Files in an agent's EgressState directory. The CA key reaches the gateway
// only as a credential (LoadCredential=ca.key:...), under the same name.
const (
	CAKeyFile    = "ca.key"
	CACertFile   = "ca.crt"
	CABundleFile = "bundle.crt" // host roots + the cage CA, for SSL_CERT_FILE
)

// HostCABundles are where hosts keep their root bundle, in order of preference.
var HostCABundles = []string{
	"/etc/ssl/certs/ca-certificates.crt", // Debian, Ubuntu, NixOS
	"/etc/pki/tls/certs/ca-bundle.crt",   // Fedora, RHEL
	"/etc/ssl/cert.pem",                  // Alpine, Arch
}

// EgressState holds the cage CA (key 0600 root, cert 0644), created by the
// prepare step so the agent can trust it from its first request.
func EgressState(agent string) string { return filepath.Join(EgressStateRoot, agent) }

// Runtime holds per-boot files for one agent: placeholders, env, resolv.conf.
// It sits one level down so that no agent name can collide with caged's own
// files in RuntimeRoot.
func Runtime(agent string) string { return filepath.Join(RuntimeRoot, "cage", agent) }

// GrantsFile holds an agent's time-bound grants: written by caged (root),
// read by its gateway, in the runtime directory only root can write.
func GrantsFile(agent string) string { return filepath.Join(Runtime(agent), "grants.json") }

// ApprovalPendingDir is where an agent's gateway writes the requests
// waiting for an operator: its own RuntimeDirectory (ApprovalRuntimeDirectory),
// writable by its dynamic user, read by caged.
func ApprovalPendingDir(agent string) string {
	return filepath.Join("/run", ApprovalRuntimeDirectory(agent))
}

// ApprovalRuntimeDirectory is the gateway's RuntimeDirectory= (relative to /run).
func ApprovalRuntimeDirectory(agent string) string { return "nixcage-egress/" + agent }

// ApprovalDecisionsDir is where caged writes operators' decisions, in the
// agent's root-owned runtime directory; the gateway reads them.
func ApprovalDecisionsDir(agent string) string { return filepath.Join(Runtime(agent), "approvals") }

// ControlDir holds caged's control-command state (docs/fleet.md): the
// replay cache and the acknowledgements (0700, root only).
const ControlDir = "/var/lib/nixcage/control"

// BansFile holds the host names banned by signed control commands: written
// by caged (root, 0644), read by every gateway. Host-wide and persistent,
// so a ban outlives reboots and reaches agents declared after it.
const BansFile = "/var/lib/nixcage/bans.json"

// LearnFile is an agent's learn window: stamped by its prepare step (root)
// at each start of the cage, read by its gateway and by caged (status).
func LearnFile(agent string) string { return filepath.Join(Runtime(agent), "learn.json") }

// ConsoleLink is where caged links the terminal it holds for an
// interactive agent (a /dev/pts/N it made); the agent unit's TTYPath=.
func ConsoleLink(agent string) string { return filepath.Join(RuntimeRoot, "console", agent) }

// RunsRoot holds one directory per throw-away cage (cagectl run): its
// rendered configuration, its secrets and the list of files installed for
// it, so teardown (or caged after a crash) removes exactly those.
const RunsRoot = "/run/nixcage/runs"

// RunDir is a throw-away cage's directory.
func RunDir(name string) string { return filepath.Join(RunsRoot, name) }

// RunBindStage is where an nspawn throw-away cage's unit sees its binds:
// systemd binds each one there, on a tmpfs private to the unit, before it
// execs nspawn, and nspawn binds it on from there. A path systemd made in
// the unit's own namespace names the directory caged checked however the
// host's filesystem changes later; the source path itself follows renames
// and symlinks on the host until nspawn resolves it (docs/run.md, "Binds
// are descriptors too").
const RunBindStage = "/run/nixcage/binds"

// RunBindStaged is where the i-th bind (from 0) of an nspawn throw-away
// cage is staged.
func RunBindStaged(i int) string { return filepath.Join(RunBindStage, strconv.Itoa(i)) }

// DefaultWorkspace is an agent's workspace when the config names none.
func DefaultWorkspace(agent string) string { return filepath.Join(WorkspaceRoot, agent) }

// QuarantineMark exists while an agent is quarantined; agent units carry
// ConditionPathExists=! on it, so systemd itself keeps the agent down across
// caged restarts and reboots until an operator releases it.
func QuarantineMark(agent string) string { return filepath.Join(QuarantineRoot, agent) }

// AuditDir is where the gateway writes its JSONL audit (LogsDirectory=).
func AuditDir(agent string) string { return filepath.Join("/var/log/nixcage-egress", agent) }

// AuditLogsDirectory is the LogsDirectory= value of cage-egress@agent.
func AuditLogsDirectory(agent string) string { return "nixcage-egress/" + agent }
