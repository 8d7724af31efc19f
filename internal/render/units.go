package render

import (
	"encoding/json"
	"encoding/xml"
	"fmt"
	"path/filepath"
	"slices"
	"strings"

	"github.com/nixcage/nixcage/internal/config"
	"github.com/nixcage/nixcage/internal/paths"
)

// The gateway's resource ceiling (cage-egress@.service). Its own bounds keep
// it far below: TestFloodRSS measures the peak RSS under a flood of every
// kind at the default limits (docs/egress.md, "Limits").
const (
	gatewayMemoryMax  = "512M"
	gatewayGoMemLimit = "384MiB"
	gatewayTasksMax   = "128"
)

func (r *renderer) bin(name string) string { return filepath.Join(r.o.BinDir, name) }

func (r *renderer) cagedConfig() string {
	if r.o.CagedConfig != "" {
		return r.o.CagedConfig
	}
	return filepath.Join(r.o.Prefix, "nixcage", "nixcage.json")
}

func (r *renderer) cagedUnits() string {
	if r.o.CagedUnits != "" {
		return r.o.CagedUnits
	}
	return "os"
}

// caged runs as root because it writes the shared store and asks systemd to
// manage units; everything else is taken away.
func (r *renderer) caged() {
	storeRoot := paths.DefaultStoreRoot
	if r.cfg.Store != nil {
		storeRoot = r.cfg.Store.Root
	}
	svc := sec("Service",
		"Type", "dbus",
		"BusName", paths.BusName,
		// In --units render mode caged installs tmpfiles rules for podman
		// cages under /run/tmpfiles.d, which may not exist yet and is not
		// writable under ProtectSystem=strict; create it with full
		// privileges ("+") so ReadWritePaths= below can open it up.
		"ExecStartPre", "+/bin/mkdir -p /run/tmpfiles.d",
		// Likewise the parent of service agents' workspaces (systemd makes
		// it, 0700, when the first one starts, possibly after caged), so
		// that cagectl put can write there (docs/relay.md).
		"ExecStartPre", `+/bin/sh -c "umask 077 && mkdir -p /var/lib/private/nixcage"`,
		// By default the units were rendered together with this one, so
		// caged only manages their lifecycle ("os"); "render" is for a caged
		// installed alone that renders into /run itself.
		"ExecStart", quoteCmd([]string{r.bin("caged"), "--config", r.cagedConfig(), "--units", r.cagedUnits()}),
		// Re-read the config and reconcile, synchronously, over the bus
		// (minimal hosts have no kill(1); SIGHUP does the same).
		"ExecReload", quoteCmd([]string{r.bin("cagectl"), "reload"}),
		"Restart", "on-failure",
		"RestartSec", "2",
		"WatchdogSec", "30",
	)
	svc.add(baseHardening()...)
	svc.add(
		// Writes: the store, evidence and quarantine marks, and the
		// runtime unit directory it renders into.
		"StateDirectory", "nixcage",
		"RuntimeDirectory", "nixcage",
		"RuntimeDirectoryPreserve", "yes",
		// "-": a store root that does not exist yet must not keep caged
		// from starting (the default one lies inside StateDirectory=).
		// `cagectl apply-config` has caged install a new config: the
		// config itself and, with --units os, the tree rendered under /etc.
		// (caged can already write units systemd runs as root, under /run;
		// /etc adds no privilege, only persistence.)
		"ReadWritePaths", "-"+storeRoot+" -/run/systemd/system -/run/tmpfiles.d -/etc/nixcage -/etc/systemd/system -/etc/tmpfiles.d",
	)
	// cagectl put saves into agents' workspaces (docs/relay.md). The
	// default ones are under StateDirectory= or, for service agents,
	// systemd's /var/lib/private/nixcage; others are listed one by one (an
	// agent with its own workspace added later needs this unit
	// re-installed before files can be put there).
	rw := []string{"-/var/lib/private/nixcage"}
	for _, a := range r.cfg.Agents {
		if strings.HasPrefix(a.Workspace, "/var/lib/nixcage/") {
			continue
		}
		rw = append(rw, "-"+a.Workspace)
		if a.Backend == config.BackendService {
			rw = append(rw, "-/var/lib/private/"+stateDir(a.Workspace))
		}
	}
	svc.add("ReadWritePaths", strings.Join(rw, " "))
	svc.add(
		"PrivateNetwork", "no", // fetches releases by URL
		"RestrictAddressFamilies", "AF_UNIX AF_INET AF_INET6",
		"IPAddressDeny", "link-local multicast",
		// Evidence copies read workspaces owned by dynamic users; store
		// unpacking sets ownership and modes.
		"CapabilityBoundingSet", "CAP_DAC_READ_SEARCH CAP_DAC_OVERRIDE CAP_CHOWN CAP_FOWNER CAP_FSETID",
		"SystemCallFilter", "@system-service",
		"SystemCallFilter", denySyscalls,
		// Back from @privileged: files put into a workspace are handed to
		// the agent's user (docs/relay.md); CAP_CHOWN is granted above.
		"SystemCallFilter", "@chown",
		"SystemCallErrorNumber", "EPERM",
		"MemoryDenyWriteExecute", "yes",
		"DevicePolicy", "closed",
		// caged holds the terminals of interactive agents (cagectl attach).
		"DeviceAllow", "/dev/ptmx rw",
		"DeviceAllow", "char-pts rw",
	)
	r.unit(paths.CagedUnit,
		sec("Unit",
			"Description", "nixcage manager (caged)",
			"Documentation", "https://github.com/nixcage/nixcage/blob/main/docs/operations.md",
			"Requires", "dbus.socket",
			"After", "dbus.socket network-online.target",
		),
		svc,
		sec("Install", "WantedBy", "multi-user.target"),
	)
}

func (r *renderer) target() {
	r.unit(paths.TargetUnit,
		sec("Unit",
			"Description", "nixcage agents",
			"Wants", paths.CagedUnit,
			"After", paths.CagedUnit,
		),
		sec("Install", "WantedBy", "multi-user.target"),
	)
	for _, a := range r.cfg.Agents {
		if a.Autostart {
			name := paths.Instance(paths.AgentTemplate, a.Name)
			r.files = append(r.files, File{
				Path: filepath.Join("systemd/system", paths.TargetUnit+".wants", name),
				Link: "../" + name,
			})
		}
	}
}

// staleNetns removes a namespace a crash left under the agent's name. Not
// for a throw-away cage: its name is new (caged refuses one whose files are
// still there), and should a namespace of that name exist all the same,
// `ip netns add` fails the run rather than reuse it; one process fewer on
// every run's path.
func (r *renderer) staleNetns(netns string) [2]string {
	if r.run != nil {
		return [2]string{} // an empty key: sec skips it
	}
	return [2]string{"ExecStartPre", "-" + r.o.IP + " netns delete " + netns}
}

// prepUnit is the prepare step the gateway, its sockets and the agent
// require: none for a throw-away cage, which caged prepares itself before
// starting any of its units (docs/run.md, "Units").
func (r *renderer) prepUnit(name string) []string {
	if r.run != nil {
		return nil
	}
	return []string{paths.Instance(paths.PrepTemplate, name)}
}

// templates are the same for every agent: everything agent-specific is
// derived from the instance name %i through the paths package.
func (r *renderer) templates() {
	shutdown := []string{
		"DefaultDependencies", "no",
		"Conflicts", "shutdown.target",
		"Before", "shutdown.target",
		"After", "local-fs.target",
		"StopWhenUnneeded", "yes",
	}
	// The namespace must not wait for basic.target: its socket units are
	// ordered before sockets.target, which basic.target waits for.
	netns := paths.NetnsName("%i")
	stale := r.staleNetns(netns)
	netnsSec := sec("Unit", append([]string{"Description", "nixcage network namespace of %i (loopback only, no route)"}, shutdown...)...)
	if r.run != nil {
		// A throw-away cage's namespace is stopped by caged's teardown,
		// and caged starts the next run's before that run exists (a
		// spare, docs/run.md): nothing needs it yet, and it must not stop
		// for that.
		netnsSec = sec("Unit", append([]string{"Description", "nixcage network namespace of %i (loopback only, no route)"}, shutdown[:len(shutdown)-2]...)...)
	}
	r.unit(paths.NetnsTemplate,
		netnsSec,
		sec("Service",
			"Type", "oneshot",
			"RemainAfterExit", "yes",
			stale[0], stale[1],
			"ExecStart", r.o.IP+" netns add "+netns,
			"ExecStart", r.o.IP+" -n "+netns+" link set lo up",
			"ExecStop", r.o.IP+" netns delete "+netns,
			// No mount-namespacing options here (ProtectSystem=, PrivateTmp=,
			// ...): `ip netns add` bind-mounts the namespace under /run/netns,
			// which must be visible to the host, not to a private namespace.
			"NoNewPrivileges", "yes",
			"CapabilityBoundingSet", "CAP_SYS_ADMIN CAP_NET_ADMIN",
			"RestrictAddressFamilies", "AF_UNIX AF_NETLINK",
			"IPAddressDeny", "any",
			"SystemCallArchitectures", "native",
			"LockPersonality", "yes",
			"RestrictRealtime", "yes",
			"RestrictSUIDSGID", "yes",
			"MemoryDenyWriteExecute", "yes",
			"UMask", "0022",
		),
	)

	prep := sec("Service",
		"Type", "oneshot",
		"RemainAfterExit", "yes",
		// The skeleton root and state directories must exist before any
		// cage starts; "+" runs this one command outside the sandbox below.
		"ExecStartPre", "+"+join(r.o.Tmpfiles, "--create", filepath.Join(r.o.Prefix, paths.TmpfilesConf)),
		"ExecStart", join(r.bin("cage-egress"), "prepare", "--config", paths.EgressConfig(r.o.Prefix, "%i")),
		"RuntimeDirectory", strings.TrimPrefix(paths.Runtime("%i"), "/run/"),
		"RuntimeDirectoryMode", "0755",
		"StateDirectory", strings.TrimPrefix(paths.EgressState("%i"), "/var/lib/"),
		"StateDirectoryMode", "0755",
	)
	prep.add(baseHardening()...)
	prep.add(offlineHelper()...)
	prep.add(
		// The prepare step writes the CA key (0600) and placeholders; the
		// agent's workspace is created here so its owner can be fixed later.
		"UMask", "0022",
	)
	if r.run == nil {
		r.unit(paths.PrepTemplate,
			sec("Unit", append([]string{"Description", "nixcage prepare cage %i (CA, placeholders, resolv.conf)"}, shutdown...)...),
			prep,
		)
	}

	netnsUnit := paths.Instance(paths.NetnsTemplate, "%i")
	deps := strings.Join(append([]string{netnsUnit}, r.prepUnit("%i")...), " ")
	socketUnit := func(desc string) section {
		return sec("Unit",
			"Description", desc,
			"Requires", deps,
			// Ordered after the namespace only: a listener needs nothing
			// the prepare step makes, and the gateway it activates and the
			// agent are each ordered after the prepare step themselves. So
			// the sockets open while the prepare step runs instead of after
			// it (~20 ms off every cold start and run; docs/performance.md).
			"After", netnsUnit,
			"BindsTo", netnsUnit,
		)
	}
	// Listeners live inside the cage's namespace; the gateway itself stays in
	// the host namespace and receives them by socket activation.
	r.unit(paths.ProxySocketTpl,
		socketUnit("nixcage egress proxy of %i (127.0.0.1:3128 inside the cage)"),
		sec("Socket",
			"ListenStream", paths.CageProxyAddr,
			"FileDescriptorName", paths.FDProxy,
			"NetworkNamespacePath", paths.NetnsPath("%i"),
			"Service", paths.Instance(paths.EgressTemplate, "%i"),
			"NoDelay", "yes",
		),
	)
	r.unit(paths.DNSSocketTpl,
		socketUnit("nixcage egress DNS of %i (127.0.0.1:53 inside the cage)"),
		sec("Socket",
			"ListenStream", paths.CageDNSAddr,
			"ListenDatagram", paths.CageDNSAddr,
			"FileDescriptorName", paths.FDDNS,
			"NetworkNamespacePath", paths.NetnsPath("%i"),
			"Service", paths.Instance(paths.EgressTemplate, "%i"),
		),
	)

	sockets := paths.Instance(paths.ProxySocketTpl, "%i") + " " + paths.Instance(paths.DNSSocketTpl, "%i")
	svc := sec("Service",
		// The gateway says READY=1 only once it holds its credentials and
		// listeners: a start or restart job fails, instead of reporting
		// "done", when a (rotated) secret cannot be loaded.
		"Type", "notify",
		"ExecStart", join(r.bin("cage-egress"), "--config", paths.EgressConfig(r.o.Prefix, "%i")),
		"Sockets", sockets,
		"DynamicUser", "yes",
		"LoadCredential", paths.CAKeyFile+":"+filepath.Join(paths.EgressState("%i"), paths.CAKeyFile),
		"LogsDirectory", paths.AuditLogsDirectory("%i"),
		"LogsDirectoryMode", "0750",
		// Requests waiting for an operator (approval queue): the gateway's
		// own, read by caged (root), gone when the gateway stops.
		"RuntimeDirectory", paths.ApprovalRuntimeDirectory("%i"),
		"RuntimeDirectoryMode", "0700",
		"Restart", "on-failure",
		"RestartSec", "1",
	)
	svc.add(baseHardening()...)
	// The gateway is the one component that reaches the internet for a cage.
	svc.add(unprivilegedHardening()...)
	svc.add(
		"LimitNOFILE", "65536",
		// The cage must not be able to take the host's memory through its
		// gateway: the gateway bounds what it holds (max_tunnels slots,
		// read timeouts, HTTP/2 stream and window limits; docs/egress.md
		// states the measured bound), and the kernel enforces a ceiling
		// above that. GOMEMLIMIT makes the Go GC work harder well before it.
		// An OOM kill fails closed: the cage loses the network, the open
		// tunnels' audit records are already written.
		"MemoryMax", gatewayMemoryMax,
		"Environment", "GOMEMLIMIT="+gatewayGoMemLimit,
		"TasksMax", gatewayTasksMax,
	)
	r.unit(paths.EgressTemplate,
		sec("Unit",
			"Description", "nixcage egress gateway of %i",
			"Requires", strings.Join(append([]string{sockets}, r.prepUnit("%i")...), " "),
			"After", strings.Join(append([]string{sockets}, r.prepUnit("%i")...), " "),
		),
		svc,
	)
}

func (r *renderer) dbusPolicy() {
	// Everyone may call; caged authorizes each method from the caller's
	// uid and groups against the declared accounts. Only root may own the
	// name, so nobody can impersonate caged. Signals carrying audit data
	// may be received only by root and the declared accounts: caged
	// addresses each to subscribers allowed to view that agent, and this
	// refusal holds even if a signal were broadcast or a host allowed
	// eavesdropping. The accounts come from the config, so the file must
	// be re-installed when they change (dbus-daemon reloads it itself).
	var deny, allow strings.Builder
	for _, sig := range paths.BusAuditSignals {
		fmt.Fprintf(&deny, "    <deny receive_interface=%q receive_member=%q/>\n", paths.BusIface, sig)
		fmt.Fprintf(&allow, "    <allow receive_interface=%q receive_member=%q/>\n", paths.BusIface, sig)
	}
	var b strings.Builder
	b.WriteString(`<?xml version="1.0"?>
<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-BUS Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<!-- Rendered by cagectl render. caged checks every method against the
     declared accounts; this file decides who may own and reach the name,
     and who may receive signals carrying audit data (root and the
     declared accounts; caged narrows that to each account's agents). -->
<busconfig>
  <policy user="root">
    <allow own="org.nixcage.cage1"/>
    <allow send_destination="org.nixcage.cage1"/>
` + allow.String() + `  </policy>
  <policy context="default">
    <allow send_destination="org.nixcage.cage1" send_interface="org.freedesktop.DBus.Introspectable"/>
    <allow send_destination="org.nixcage.cage1" send_interface="org.freedesktop.DBus.Properties"/>
    <allow send_destination="org.nixcage.cage1" send_interface="org.freedesktop.DBus.Peer"/>
    <allow send_destination="org.nixcage.cage1" send_interface="org.nixcage.cage1.Manager"/>
    <allow send_destination="org.nixcage.cage1" send_interface="org.nixcage.cage1.Agent"/>
` + deny.String() + `  </policy>
`)
	// Every role may view audit records, so every account may receive.
	seen := map[string]bool{}
	for _, a := range r.cfg.Accounts {
		attr, who := "user", a.User
		if who == "" {
			attr, who = "group", a.Group
		}
		if who == "" || seen[attr+"="+who] {
			continue
		}
		seen[attr+"="+who] = true
		fmt.Fprintf(&b, "  <policy %s=\"%s\">\n%s  </policy>\n", attr, xmlText(who), allow.String())
	}
	b.WriteString("</busconfig>\n")
	r.add("dbus-1/system.d/"+paths.BusName+".conf", 0o644, []byte(b.String()))
}

func xmlText(s string) string {
	var b strings.Builder
	xml.EscapeText(&b, []byte(s))
	return b.String()
}

// tmpfiles creates the directories units expect before any of them runs,
// the nspawn and podman cages' workspaces, and the skeleton roots service and
// podman cages start from (empty but for mount points and the merged-/usr
// symlinks).
func (r *renderer) tmpfiles() {
	var b strings.Builder
	b.WriteString("# Rendered by cagectl render.\n")
	fmt.Fprintf(&b, "d %s 0755 root root -\n", "/var/lib/nixcage")
	// Only root traverses to the workspaces: a file a cage leaves there is
	// out of reach of the host's other users whatever its mode (issue 21).
	// tmpfiles applies the mode to an existing directory, at install and
	// before every cage start.
	fmt.Fprintf(&b, "d %s 0700 root root -\n", paths.WorkspaceRoot)
	fmt.Fprintf(&b, "d %s 0755 root root -\n", paths.EgressStateRoot)
	fmt.Fprintf(&b, "d %s 0700 root root -\n", paths.EvidenceRoot)
	fmt.Fprintf(&b, "d %s 0755 root root -\n", paths.QuarantineRoot)
	// nspawn and podman workspaces belong to the cage's root, an
	// unprivileged host uid of the cage's own range; service workspaces are
	// StateDirectory= of their dynamic user.
	for _, a := range r.cfg.Agents {
		if a.Backend != config.BackendService && r.run == nil {
			base := r.userNSBase(a.Name)
			fmt.Fprintf(&b, "d %s 0700 %d %d -\n", a.Workspace, base, base)
		}
	}
	// Every mount target a cage needs exists in the skeleton beforehand:
	// systemd could create them, but podman's container root (a mapped
	// uid) cannot write to a root-owned directory.
	skeleton(&b, paths.CageRootfs, serviceStoreLinks)
	if r.run == nil { // throw-away cages are never podman cages
		skeleton(&b, paths.PodmanRootfs, nil, paths.CageSeal)
	}
	r.add(paths.TmpfilesConf, 0o644, []byte(b.String()))
	// podman's default sysctls (net.ipv4.ping_group_range) cannot be set in
	// a namespace the container does not own. The container's output goes
	// straight to the unit's stdout (the journal, as for the other
	// backends) instead of through conmon into a log file, and podman logs
	// no lifecycle events of its own (the unit's journal has the start and
	// the end): both are per-start work (docs/performance.md).
	r.add(paths.PodmanConf, 0o644, []byte("# Rendered by cagectl render: containers.conf for nixcage's podman cages.\n"+
		"[containers]\ndefault_sysctls = []\nlog_driver = \"passthrough\"\n\n[engine]\nevents_logger = \"none\"\n"))
}

// skeleton writes the tmpfiles lines of a skeleton root. With storeLinks,
// /nix/store and /nix/tools are those symlinks and the store root's mount
// point is made instead (the service cages); without, they are mount
// points for binds the container manager resolves (podman).
func skeleton(b *strings.Builder, root string, storeLinks [][2]string, files ...string) {
	dirs := []string{"", "/usr", "/etc", "/etc/nixcage", "/nix", "/nix/store", "/nix/tools", "/workspace", "/mnt", "/tmp", "/proc", "/sys", "/dev", "/run", "/var", "/var/tmp"}
	if storeLinks != nil {
		dirs = slices.DeleteFunc(dirs, func(d string) bool { return d == paths.CageStoreMount || d == paths.CageTools })
		dirs = slices.Insert(dirs, slices.Index(dirs, "/nix")+1, paths.CageStoreRoot)
	}
	for _, d := range dirs {
		fmt.Fprintf(b, "d %s%s 0755 root root -\n", root, d)
	}
	for _, l := range []string{"bin", "sbin", "lib", "lib64"} {
		fmt.Fprintf(b, "L %s/%s - - - - usr/%s\n", root, l, l)
	}
	// "L+": an older skeleton has empty directories there (the mount
	// points of the binds these links replace); tmpfiles replaces them.
	for _, l := range storeLinks {
		fmt.Fprintf(b, "L+ %s%s - - - - %s\n", root, l[0], l[1])
	}
	for _, f := range append([]string{"/etc/resolv.conf", "/etc/hostname", "/etc/hosts", paths.CageCACert, cageBundle, "/run/.containerenv"}, files...) {
		fmt.Fprintf(b, "f %s%s 0644 root root -\n", root, f)
	}
}

// canonical writes the validated model back out as HCL-JSON: caged reads it,
// and `cagectl validate` accepts it, so what caged enforces is exactly what
// was rendered.
func (r *renderer) canonical() error {
	b, err := config.Canonical(r.cfg)
	if err != nil {
		return err
	}
	r.add("nixcage/nixcage.json", 0o644, b)
	return nil
}

func marshal(v any) ([]byte, error) {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return nil, err
	}
	return append(b, '\n'), nil
}

// join renders a command line of nixcage's own words, which may carry
// specifiers such as %i on purpose.
// offlineHelper confines a helper that needs no network, no capability and
// no device: the prepare step.
func offlineHelper() []string {
	return []string{
		"PrivateNetwork", "yes",
		"RestrictAddressFamilies", "AF_UNIX",
		"CapabilityBoundingSet", "",
		"SystemCallFilter", "@system-service",
		"SystemCallFilter", denySyscalls,
		"MemoryDenyWriteExecute", "yes",
		"DevicePolicy", "closed",
		"IPAddressDeny", "any",
	}
}

func join(argv ...string) string { return strings.Join(argv, " ") }

// quoteCmd renders argv for Exec*= lines: every word double-quoted, with
// specifiers (%) and variable references ($) escaped so that systemd passes
// them through verbatim.
func quoteCmd(argv []string) string {
	out := make([]string, len(argv))
	for i, a := range argv {
		out[i] = quoteArg(a)
	}
	return strings.Join(out, " ")
}

func quoteArg(a string) string {
	if a != "" && !strings.ContainsAny(a, " \t\n\"'\\$%;") {
		return a
	}
	// systemd unescapes C-style sequences inside quoted words, which is how
	// a multi-line script survives the one-line ExecStart=.
	r := strings.NewReplacer(`\`, `\\`, `"`, `\"`, `%`, `%%`, `$`, `$$`, "\n", `\n`, "\t", `\t`)
	return `"` + r.Replace(a) + `"`
}
