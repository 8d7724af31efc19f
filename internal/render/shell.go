package render

import (
	"fmt"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/coreos/go-systemd/v22/unit"

	"github.com/nixcage/nixcage/internal/config"
	"github.com/nixcage/nixcage/internal/paths"
)

// Shell is a debugging shell in a running cage (cagectl shell). Its unit is
// a transient unit caged starts with the caller's terminal; its whole
// configuration, the command included, is the drop-in ShellDropIn renders.
// So if systemd did not apply the drop-in, the unit has no ExecStart= and
// does not start: the walls and the command come together or not at all.
type Shell struct {
	// AgentUnit is the agent's unit; AgentService its [Service] options as
	// systemd loaded them (fragment, then drop-ins, in order).
	AgentUnit    string
	AgentService []*unit.UnitOption
	Command      []string // default /bin/sh
	Term         string   // TERM for the shell, with a terminal
	By           string   // who opened it, for the description
	// ContainerPID is, for an nspawn cage, the host pid of the cage's own
	// PID 1 (cage-seal --init), whose namespaces the shell joins.
	ContainerPID int
	// Nsenter is the host's nsenter(1) (util-linux), for nspawn cages.
	Nsenter string
}

// ShellDefault is the command of a shell when none is given.
var ShellDefault = []string{"/bin/sh"}

// shellDropped are agent options a shell does not take over: how the agent
// is started, restarted and wired to its terminal. Everything else — user,
// namespaces, mounts, filters, limits — it takes as the agent has it.
var shellDropped = map[string]bool{
	"Type": true, "Restart": true, "RestartSec": true, "RemainAfterExit": true,
	"StandardInput": true, "StandardOutput": true, "StandardError": true,
	"TTYPath": true, "TTYReset": true, "TTYVHangup": true, "TTYVTDisallocate": true,
	"KillMode": true, "Delegate": true, "WatchdogSec": true, "NotifyAccess": true,
	"TimeoutStartSec": true, "TimeoutStopSec": true, "SuccessExitStatus": true,
}

// ShellDropIn renders the drop-in of a shell's transient unit for agent a.
//
// Service cages: the shell is the agent's own [Service] section with
// another ExecStart=, so it runs as the agent's dynamic user (the same uid:
// systemd allocates dynamic users by name) in the agent's network
// namespace, /tmp and IPC namespace (JoinsNamespaceOf=), with the same root,
// binds, capability bounding set, seccomp filters and limits.
//
// nspawn cages: systemd cannot join a container's user, mount and PID
// namespaces itself, so the unit runs nsenter(1) into the namespaces of the
// cage's PID 1 and cage-seal --no-caps, which empties every capability set
// (joining a user namespace grants all of them in it) and installs the
// agent's seccomp filter before it execs the command. The unit keeps the
// nspawn unit's own walls (address families, RestrictSUIDSGID=, IP filters,
// device policy, limits); nsenter runs as root only until cage-seal.
func ShellDropIn(a *config.Agent, s Shell) ([]byte, error) {
	cmd := s.Command
	if len(cmd) == 0 {
		cmd = ShellDefault
	}
	if !filepath.IsAbs(cmd[0]) {
		// No PATH lookup in a unit; and a first word that is absolute can
		// carry no "+", "!" or "-" prefix that would lift the sandbox.
		cmd = append([]string{"/bin/sh", "-c", `exec "$0" "$@"`}, cmd...)
	}
	desc := fmt.Sprintf("nixcage shell in %s for %s", a.Name, s.By)
	unitSec := sec("Unit",
		"Description", desc,
		// The shell is inside a running cage: it ends with the agent.
		"BindsTo", s.AgentUnit,
		"After", s.AgentUnit,
	)
	svc := section{name: "Service"}
	switch a.Backend {
	case config.BackendService:
		unitSec.add("JoinsNamespaceOf", s.AgentUnit)
		if err := copyAgentService(&svc, s.AgentService); err != nil {
			return nil, err
		}
	case config.BackendNspawn:
		if s.ContainerPID <= 1 || !filepath.IsAbs(s.Nsenter) {
			return nil, fmt.Errorf("render: shell in %s: no cage process to join or no nsenter", a.Name)
		}
		if err := copyAgentService(&svc, s.AgentService); err != nil {
			return nil, err
		}
		for _, kv := range cageEnv(a) {
			svc.add("Environment", quoteArg(kv[0]+"="+kv[1]))
		}
		svc.add(
			"NoNewPrivileges", "yes",
			// What nsenter needs to open another user's namespaces, root
			// and working directory and enter them; inside the cage's user
			// namespace it has every capability anyway, which cage-seal
			// --no-caps drops.
			"CapabilityBoundingSet", "CAP_SYS_ADMIN CAP_SYS_PTRACE CAP_SYS_CHROOT CAP_DAC_READ_SEARCH",
			// nsenter's own walls, until cage-seal puts the agent's filter
			// (nspawn 252's allow list and the cage's argument checks) on
			// the shell: what that list refuses and nsenter does not need.
			"SystemCallFilter", "~@clock @cpu-emulation @module @obsolete @raw-io @reboot @swap "+ioURing,
			"SystemCallErrorNumber", "EPERM",
		)
		argv := []string{s.Nsenter, "--target=" + strconv.Itoa(s.ContainerPID),
			"--user", "--mount", "--uts", "--ipc", "--net", "--pid", "--cgroup",
			// The cage's root and its working directory: without --wd,
			// nsenter would return to its own (host) directory after the
			// chroot, a way out of the cage's file system.
			"--root", "--wd",
			"--", paths.CageSeal, "--no-caps", "--chdir", paths.CageWorkspace, "--"}
		cmd = append(argv, cmd...)
	default:
		return nil, fmt.Errorf("render: shell in %s: the %s backend has no shell (podman cages would need podman exec, a second container runtime call outside the agent's unit)", a.Name, a.Backend)
	}
	if s.Term != "" {
		svc.add("Environment", quoteArg("TERM="+s.Term))
	}
	svc.add(
		"Type", "exec",
		"ExecStart", quoteCmd(cmd),
		// The unit stays until caged has read the exit status and stops it
		// (which also ends what the shell left running).
		"RemainAfterExit", "yes",
		"Restart", "no",
	)
	return serialize([]section{unitSec, svc}), nil
}

// copyAgentService appends the agent's [Service] options a shell keeps.
// A specifier (%i, %n, ...) would mean the shell's unit, not the agent's:
// refused rather than reinterpreted.
func copyAgentService(svc *section, opts []*unit.UnitOption) error {
	for _, o := range opts {
		if o.Section != "Service" || shellDropped[o.Name] || strings.HasPrefix(o.Name, "Exec") {
			continue
		}
		if v := strings.ReplaceAll(o.Value, "%%", ""); strings.Contains(v, "%") {
			return fmt.Errorf("render: the agent unit's %s=%s uses a specifier, which in a shell's unit would name the shell; remove it from the agent's unit", o.Name, o.Value)
		}
		svc.add(o.Name, o.Value)
	}
	if len(svc.opts) == 0 {
		return fmt.Errorf("render: the agent unit has no [Service] settings to give a shell")
	}
	return nil
}
