package render

import (
	"fmt"
	"github.com/nixcage/nixcage/internal/harness"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/coreos/go-systemd/v22/unit"

	"github.com/nixcage/nixcage/internal/config"
	"github.com/nixcage/nixcage/internal/paths"
	"github.com/nixcage/nixcage/internal/policy"
)

// cageBundle is where the cage sees paths.CABundleFile: host roots (for
// tunnelled hosts) plus the cage CA (for inspected ones).
const cageBundle = "/etc/nixcage/ca-bundle.crt"

// Runtime returns the gateway's document for agent a.
func Runtime(a *config.Agent) *policy.Runtime {
	secrets := make([]policy.Secret, 0, len(a.Secrets))
	for _, s := range a.Secrets {
		secrets = append(secrets, policy.Secret{Name: s.Name, Env: s.Env, Hosts: s.Hosts, Header: s.Header})
	}
	rt := paths.Runtime(a.Name)
	var learn *policy.Learn
	if a.Learn != nil {
		learn = &policy.Learn{ForSeconds: int64(a.Learn.For / time.Second), File: paths.LearnFile(a.Name), Deny: a.Learn.Deny}
	}
	var approval *policy.Approval
	if a.Approval != nil {
		approval = &policy.Approval{WaitSeconds: int64(a.Approval.Wait / time.Second), MaxPending: a.Approval.MaxPending,
			PendingDir: paths.ApprovalPendingDir(a.Name), DecisionsDir: paths.ApprovalDecisionsDir(a.Name)}
	}
	return &policy.Runtime{
		Learn:           learn,
		Approval:        approval,
		Schema:          policy.Schema,
		Agent:           a.Name,
		Policy:          a.Policy,
		Secrets:         secrets,
		AuditFile:       filepath.Join(paths.AuditDir(a.Name), "audit.jsonl"),
		PlaceholderFile: filepath.Join(rt, "placeholders.json"),
		AgentEnvFile:    filepath.Join(rt, "agent.env"),
		ResolvConf:      filepath.Join(rt, "resolv.conf"),
		GrantsFile:      paths.GrantsFile(a.Name),
		BansFile:        paths.BansFile,
		CADir:           paths.EgressState(a.Name),
	}
}

func (r *renderer) storeRoot() string {
	if r.cfg.Store != nil {
		return r.cfg.Store.Root
	}
	return paths.DefaultStoreRoot
}

func (r *renderer) agent(a *config.Agent) error {
	doc, err := Runtime(a).Marshal()
	if err != nil {
		return err
	}
	r.add(filepath.Join(strings.TrimPrefix(paths.ConfigDir("/", a.Name), "/"), "egress.json"), 0o644, doc)
	for _, f := range harnessFiles(a) {
		r.add(filepath.Join(strings.TrimPrefix(paths.ConfigDir("/", a.Name), "/"), f.rel), 0o644, []byte(f.text))
	}

	if len(a.Secrets) > 0 {
		// The same credentials reach the prepare step (to size the
		// placeholders) and the gateway (to inject them); never the agent.
		var creds []string
		for _, s := range a.Secrets {
			creds = append(creds, "LoadCredential", s.Name+":"+s.Source)
		}
		body := serialize([]section{sec("Service", creds...)})
		tpls := []string{paths.EgressTemplate}
		if r.run == nil {
			tpls = append(tpls, paths.PrepTemplate)
		}
		for _, tpl := range tpls {
			r.add(filepath.Join("systemd/system", paths.Instance(tpl, a.Name)+".d", "50-credentials.conf"), 0o644, body)
		}
	}

	var svc section
	switch a.Backend {
	case config.BackendService:
		svc = r.serviceBackend(a)
	case config.BackendNspawn:
		svc = r.nspawnBackend(a)
	case config.BackendPodman:
		svc = r.podmanBackend(a)
	default:
		return fmt.Errorf("unknown backend %q", a.Backend)
	}
	svc.add(
		"MemoryMax", a.Resources.Memory,
		"TasksMax", strconv.Itoa(a.Resources.Tasks),
	)
	switch {
	case r.turn != nil:
		svc.add(r.turn.service()...)
	case r.run == nil:
		svc.add("Restart", "on-failure", "RestartSec", "5")
	default:
		// A throw-away cage runs its command once: restarting it would run
		// the user's command again behind their back.
		svc.add("Restart", "no")
	}
	svc.add("LimitCORE", "0")
	if a.Interactive {
		// caged holds the pty's master (cagectl attach); systemd opens the
		// slave through the link caged made and makes it the agent's
		// controlling terminal.
		svc.add(
			"StandardInput", "tty",
			"StandardOutput", "tty",
			"StandardError", "tty",
			"TTYPath", paths.ConsoleLink(a.Name),
			"TTYReset", "yes",
			"TTYVHangup", "no",
		)
	}
	if a.Resources.CPU != "" {
		svc.add("CPUQuota", a.Resources.CPU)
	}
	depUnits := append(append([]string{paths.Instance(paths.NetnsTemplate, a.Name)}, r.prepUnit(a.Name)...),
		paths.Instance(paths.ProxySocketTpl, a.Name),
		paths.Instance(paths.DNSSocketTpl, a.Name),
	)
	deps := strings.Join(depUnits, " ")
	desc := fmt.Sprintf("nixcage agent %s (%s backend)", a.Name, a.Backend)
	if r.run != nil {
		desc = fmt.Sprintf("nixcage throw-away cage %s (%s backend)", a.Name, a.Backend)
	}
	if r.turn != nil {
		desc = fmt.Sprintf("nixcage turn of agent %s (%s backend)", a.Name, a.Backend)
	}
	unitSec := sec("Unit",
		"Description", desc,
		"Requires", deps,
		"After", deps,
		// No namespace, no agent: if it goes away the cage must stop
		// rather than end up somewhere with a route.
		"BindsTo", paths.Instance(paths.NetnsTemplate, a.Name),
	)
	if r.run == nil && r.turn == nil {
		unitSec.add("PartOf", paths.TargetUnit)
	}
	if a.Backend != config.BackendService && r.run == nil {
		m := r.workspaceMount(a)
		unitSec.add("Requires", m, "After", m)
	}
	if a.Interactive {
		// Without caged's terminal there is nothing to attach to: systemd
		// skips the start (caged makes the terminal, then starts it).
		unitSec.add("ConditionPathExists", paths.ConsoleLink(a.Name))
	}
	unitSec.add(
		"ConditionPathExists", "!"+paths.QuarantineMark(a.Name),
		"StartLimitIntervalSec", "60",
		"StartLimitBurst", "5",
	)
	r.unit(paths.Instance(paths.AgentTemplate, a.Name), unitSec, svc)
	return nil
}

// workspaceMount renders a mount unit that binds an nspawn or podman cage's
// workspace onto itself nosuid,nodev, and returns its name. nspawn's --bind
// takes no mount options, and the host side of a workspace is what the
// host's users would run a setuid file from: with the bind, neither the host
// nor the cage (a bind of it inherits the flags, which a user namespace
// cannot clear) honours a setuid bit or a device node there, whatever made
// it (issue 21). Service workspaces belong to a dynamic user under the
// root-only /var/lib/private and are left to systemd.
func (r *renderer) workspaceMount(a *config.Agent) string {
	name := unit.UnitNamePathEscape(a.Workspace) + ".mount"
	r.unit(name,
		sec("Unit",
			"Description", fmt.Sprintf("nixcage workspace of %s (nosuid, nodev)", a.Name),
		),
		sec("Mount",
			"What", a.Workspace,
			"Where", a.Workspace,
			"Type", "none",
			"Options", "bind,nosuid,nodev",
		),
	)
	return name
}

// cageEnv is the environment every cage gets, whatever the backend.
func cageEnv(a *config.Agent) [][2]string {
	proxy := "http://" + paths.CageProxyAddr
	env := [][2]string{
		{"HTTP_PROXY", proxy}, {"HTTPS_PROXY", proxy},
		{"http_proxy", proxy}, {"https_proxy", proxy},
		{"SSL_CERT_FILE", cageBundle}, {"CURL_CA_BUNDLE", cageBundle},
		{"REQUESTS_CA_BUNDLE", cageBundle}, {"GIT_SSL_CAINFO", cageBundle},
		{"NODE_EXTRA_CA_CERTS", paths.CageCACert},
		{"HOME", paths.CageWorkspace},
		{"PATH", paths.CageTools + "/bin:/usr/local/bin:/usr/bin:/bin"},
		{"NIXCAGE_AGENT", a.Name},
	}
	if _, set := a.Environment["TERM"]; a.Interactive && !set {
		env = append(env, [2]string{"TERM", "xterm-256color"})
	}
	keys := make([]string, 0, len(a.Environment))
	for k := range a.Environment {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		env = append(env, [2]string{k, a.Environment[k]})
	}
	return env
}

// harnessFile is one file of an agent's harness scaffold: rendered under
// the agent's config directory (rel), bound read-only at cage in the cage.
type harnessFile struct{ rel, cage, text string }

// harnessFiles are the scaffold's files (package harness), sorted by path.
// They are bound outside the workspace, read-only: the agent reads them and
// cannot change what its CLI is told at the next start.
func harnessFiles(a *config.Agent) []harnessFile {
	h, ok := harness.Lookup(a.Harness)
	if !ok {
		return nil
	}
	var out []harnessFile
	for p, text := range h.RenderedFiles() {
		rel := "harness/" + strings.ReplaceAll(strings.TrimPrefix(p, "/"), "/", "_")
		out = append(out, harnessFile{rel: rel, cage: p, text: text})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].cage < out[j].cage })
	return out
}

// cageBinds are (source, destination) read-only mounts every backend makes;
// the store's are each backend's own (serviceStoreLinks, withStoreBinds).
func (r *renderer) cageBinds(a *config.Agent) [][2]string {
	state := paths.EgressState(a.Name)
	var files [][2]string
	for _, f := range harnessFiles(a) {
		files = append(files, [2]string{filepath.Join(r.o.Prefix, paths.ConfigDir("/", a.Name), f.rel), f.cage})
	}
	return append(files, [][2]string{
		{filepath.Join(paths.Runtime(a.Name), "resolv.conf"), "/etc/resolv.conf"},
		{filepath.Join(state, paths.CACertFile), paths.CageCACert},
		{filepath.Join(state, paths.CABundleFile), cageBundle},
	}...)
}

// serviceStoreLinks are the service skeleton's /nix/store and /nix/tools:
// relative symlinks into the store root, which the service cage gets as
// one read-only bind at paths.CageStoreRoot (serviceBackend). Every link
// on the way (current, top, the store path itself, nix/store) is then
// resolved by the kernel inside the cage's own root, at each lookup: a
// store changed behind apply's back can point them only at what the cage
// already sees, never at a host path, so no check has to run before a
// start (docs/store.md, "Bind sources never leave the store"). nspawn and
// podman bind the resolved paths instead (withStoreBinds).
var serviceStoreLinks = func() [][2]string {
	rel, _ := filepath.Rel(filepath.Dir(paths.CageStoreRoot), paths.CageStoreRoot)
	return [][2]string{
		{paths.CageStoreMount, filepath.Join(rel, "nix/store")},
		{paths.CageTools, filepath.Join(rel, "current/top")},
	}
}()

func stateDir(ws string) string { return strings.TrimPrefix(ws, "/var/lib/") }

// withStoreBinds wraps a container manager's command line so that the store
// binds are decided when the cage starts, by `cagectl store binds`: it
// resolves ROOT/nix/store and current/top without following any link out
// of the store (a store with such a link makes the start fail) and prints
// the binds whose sources exist (nspawn and podman refuse a missing source,
// and the store has no current generation until the first release). The
// resolved paths hold no symlink, so the bind cannot be redirected either.
// prefix are the words before which the binds go (the program and, for
// podman, its subcommand); rest are the others. Evaluated at each start, so
// a restart after an apply picks up the tools.
func (r *renderer) withStoreBinds(a *config.Agent, backend string, prefix, rest []string) string {
	return quoteCmd(r.storeBindsArgv(a, backend, prefix, rest))
}

// storeBindsArgv is withStoreBinds' command before quoting for systemd.
func (r *renderer) storeBindsArgv(a *config.Agent, backend string, prefix, rest []string) []string {
	var script strings.Builder
	fmt.Fprintf(&script, "b=$('%s' store binds --store '%s' --for %s) || exit 1; exec", r.bin("cagectl"), r.storeRoot(), backend)
	for _, w := range prefix {
		script.WriteString(" '" + w + "'")
	}
	script.WriteString(` $b "$@"`)
	return append([]string{"/bin/sh", "-c", script.String(), "nixcage-" + a.Name}, rest...)
}

// serviceBackend runs the agent as the unit itself: a dynamic user whose
// root is the empty skeleton with only /usr, the cage's own files and its
// workspace mounted in.
func (r *renderer) serviceBackend(a *config.Agent) section {
	s := sec("Service",
		"Type", "exec",
		"ExecStart", quoteCmd(a.Command),
		"DynamicUser", "yes",
		"User", "nixcage-"+a.Name,
		"NetworkNamespacePath", paths.NetnsPath(a.Name),
		// Ignored while NetworkNamespacePath= is set (systemd.exec(5)), but
		// if a drop-in ever removed that line the agent would get a fresh
		// empty namespace, never the host's network.
		"PrivateNetwork", "yes",
		"EnvironmentFile", filepath.Join(paths.Runtime(a.Name), "agent.env"),
	)
	for _, kv := range cageEnv(a) {
		s.add("Environment", quoteArg(kv[0]+"="+kv[1]))
	}
	if r.run == nil {
		s.add("StateDirectory", stateDir(a.Workspace), "StateDirectoryMode", "0700")
	}
	s.add(
		"WorkingDirectory", paths.CageWorkspace,
		// systemd 252 does not replace / with TemporaryFileSystem=/ unless
		// RootDirectory= is set (found by checks/system): the skeleton is
		// the root, /usr the only host directory in it.
		"RootDirectory", paths.CageRootfs,
		"BindReadOnlyPaths", "/usr",
	)
	for _, b := range r.cageBinds(a) {
		s.add("BindReadOnlyPaths", b[0]+":"+b[1])
	}
	// The store root, the only host path of the store systemd resolves:
	// it is the configuration's, not the store's (serviceStoreLinks). "-":
	// absent until caged or the first apply makes it; the cage then has
	// no tools.
	s.add("BindReadOnlyPaths", "-"+r.storeRoot()+":"+paths.CageStoreRoot)
	if r.run == nil {
		s.add("BindPaths", a.Workspace+":"+paths.CageWorkspace)
	} else {
		s.add(r.run.serviceBinds()...)
	}
	s.add(serviceView(r.agentUnit(a))...)
	// PrivateDevices= binds the host's devpts into the private /dev
	// (systemd 252 has no devpts of the unit's own): the cage saw every
	// terminal of the host, could open one whose mode let it, and could
	// take the host's ptys. Every service cage gets an empty, read-only
	// /dev/pts instead; /dev/ptmx then finds no devpts next to it and
	// fails. A cage with a terminal keeps it: systemd opens it (TTYPath=)
	// or gets it (the run's stdio) before the namespace is made, so it is
	// an fd, not a path; only ttyname() fails (docs/threat-model.md).
	s.add("TemporaryFileSystem", "/dev/pts:ro")
	s.add(serviceCageHardening()...)
	s.add(
		"PrivateUsers", "yes",
		"PrivateIPC", "yes",
		"PrivateMounts", "yes",
		"CapabilityBoundingSet", "",
		"AmbientCapabilities", "",
		// The cage reaches only its loopback (the gateway's listeners);
		// the namespace has no route anyway, this is the second wall.
		"IPAddressAllow", "localhost",
		"IPAddressDeny", "any",
		"RestrictAddressFamilies", "AF_UNIX AF_INET AF_INET6",
		"SystemCallFilter", "@system-service",
		"SystemCallFilter", denySyscalls,
		"SystemCallErrorNumber", "EPERM",
		"DevicePolicy", "closed",
		// MemoryDenyWriteExecute is left off: Node-based harnesses (Claude
		// Code, Codex) JIT-compile and need writable+executable memory.
		"MemoryDenyWriteExecute", "no",
	)
	return s
}

// serviceCageHardening is baseHardening for the service cage, with the two
// options whose every mount is moot in the cage's skeleton root replaced by
// what holds the same walls at a fraction of the cost. systemd 252 re-reads
// the whole mount table for each mount entry it sets up, and again in its
// read-only and no-exec passes, and these two added 14 of the 62 mount()
// calls and 47 of the 112 mount-table parses of a cage start (strace of
// PID 1; docs/performance.md, "Cage start latency"):
//   - ProtectKernelTunables=: read-only binds of ~15 /proc paths
//     (/proc/sys, /proc/sysrq-trigger, /proc/kcore, ...) which ProcSubset=pid
//     already leaves out of the cage's /proc (it shows process directories
//     only), and of /sys, which one ReadOnlyPaths=/sys holds instead
//     (recursively: /sys/kernel/debug, /sys/fs/bpf with it);
//   - ProtectHome=: /home, /root and /run/user made inaccessible, none of
//     which the root-owned skeleton has (and DynamicUser= still implies
//     ProtectHome=read-only).
//
// checks/system TestCageWalls asserts both walls as the caged agent; the
// exposure score stays within its target (render.TestSecurityScores).
func serviceCageHardening() []string {
	var kv []string
	h := baseHardening()
	for i := 0; i+1 < len(h); i += 2 {
		if h[i] != "ProtectKernelTunables" && h[i] != "ProtectHome" {
			kv = append(kv, h[i], h[i+1])
		}
	}
	return append(kv, "ReadOnlyPaths", "/sys")
}

// nspawnBackend runs the agent in systemd-nspawn with a private user range,
// a volatile tmpfs root holding only the host's /usr, and its own PID, IPC,
// UTS, cgroup and mount namespaces. nspawn itself needs root to set that up.
func (r *renderer) nspawnBackend(a *config.Agent) section {
	users := "--private-users=" + strconv.Itoa(r.userNSBase(a.Name)) + ":65536"
	if r.run != nil {
		// A throw-away cage has no workspace of its own to own, and its
		// name is not in the config the ranges are allocated from: nspawn
		// picks a free range (below the fixed ones) and locks it.
		users = "--private-users=pick"
	}
	argv := []string{
		"--quiet", "--register=no", "--keep-unit",
		"--directory=/", "--volatile=yes",
		// A fixed range, the same at every start, so the workspace can be
		// owned by the cage's root on the host. No idmap on the
		// workspace bind: with it, nspawn 252 maps the cage's root to the
		// host's root, and a setuid file the cage made there was the host's
		// root for any local user (issue 21). ownership=off: the volatile
		// root is a fresh tmpfs and /usr is read-only.
		users, "--private-users-ownership=off",
		"--resolv-conf=off", "--timezone=off", "--link-journal=no",
		"--drop-capability=all", "--no-new-privileges=yes",
		// cage-seal is the cage's PID 1 (no --as-pid2): it installs its
		// seccomp filter, nspawn 252's allow list plus the cage's walls,
		// before anything else runs in the cage, and every process of
		// the cage descends from it (seal/init.go). nspawn's own filter is
		// off (SYSTEMD_SECCOMP=0 below): libseccomp building it for three
		// ABIs at every start was 60-75 ms of the cage's start, and a
		// unit-level SystemCallFilter= makes nspawn itself fail (exit 255).
		// A stop reaches the agent as SIGTERM through cage-seal, which
		// ends the cage StopGrace later if the agent does not.
		"--kill-signal=SIGTERM", "--console=" + r.console(a),
		"--machine=" + r.cageName(a),
		"--chdir=" + paths.CageWorkspace,
		"--bind-ro=" + r.bin("cage-seal") + ":" + paths.CageSeal,
	}
	if r.run == nil {
		argv = append(argv, "--bind="+a.Workspace+":"+paths.CageWorkspace)
	} else {
		argv = append(argv, r.run.nspawnArgs()...)
	}
	for _, b := range r.cageBinds(a) {
		argv = append(argv, "--bind-ro="+b[0]+":"+b[1])
	}
	for _, kv := range cageEnv(a) {
		argv = append(argv, "--setenv="+kv[0]+"="+kv[1])
	}
	argv = append(append(argv, "--", paths.CageSeal, "--init", "--"), a.Command...)
	cmd := r.withStoreBinds(a, config.BackendNspawn, []string{r.o.Nspawn}, argv)
	// Placeholders come from the EnvironmentFile; ${VAR} is expanded by
	// systemd, so they reach the container without being rendered here.
	// They go first: everything after "--" is the agent's command.
	var setenv string
	for _, sc := range a.Secrets {
		setenv += " " + quoteArg("--setenv="+sc.Env+"=") + "${" + sc.Env + "}"
	}
	if setenv != "" {
		marker := " " + quoteArg("nixcage-"+a.Name) + " "
		i := strings.Index(cmd, marker) + len(marker)
		cmd = cmd[:i] + strings.TrimPrefix(setenv, " ") + " " + cmd[i:]
	}
	s := sec("Service",
		"Type", "exec",
		"ExecStart", cmd,
		// nspawn inherits the namespace from its unit: asked to join it
		// itself (--network-namespace-path=) after creating the user
		// namespace, it lacks the privilege to (found by checks/system).
		"NetworkNamespacePath", paths.NetnsPath(a.Name),
		"EnvironmentFile", filepath.Join(paths.Runtime(a.Name), "agent.env"),
		// systemd's switch for its seccomp use, read by nspawn only (PID
		// 1 applies the unit's own filters below whatever the unit's
		// environment says, and nspawn does not pass its environment
		// into the cage): cage-seal's filter replaces nspawn's (above).
		"Environment", "SYSTEMD_SECCOMP=0",
	)
	s.add(
		"Delegate", "yes",
		"KillMode", "mixed",
		"DevicePolicy", "closed",
		"KeyringMode", "private",
	)
	if r.run == nil {
		s.add(
			"ProtectHome", "yes",
			// nspawn's own /tmp and /var/tmp (its volatile root's mount
			// point): empty tmpfs instead of PrivateTmp=, whose
			// directories on the host's /tmp, made at every start and
			// removed after, were ~35 ms of the start (docs/performance.md).
			// PrivateMounts=, the other half of the same exposure score,
			// costs nothing here: the unit has a mount namespace anyway;
			// what nspawn mounts in it stays there.
			"TemporaryFileSystem", "/tmp /var/tmp",
			"PrivateMounts", "yes",
		)
	} else {
		// /home stays hidden from nspawn itself except for exactly the
		// directories bound into the cage (which may be under /tmp).
		s.add("ProtectHome", "tmpfs")
		s.add(r.run.hostBinds()...)
		s.add("PrivateTmp", "yes")
	}
	s.add(
		"ProtectKernelModules", "yes",
		"ProtectClock", "yes",
		"ProtectKernelLogs", "yes",
		"IPAddressAllow", "localhost",
		"IPAddressDeny", "any",
	)
	s.add(containerWalls()...)
	return s
}

// containerWalls are the unit-level filters of the nspawn and podman units.
// They are seccomp filters on the container manager, inherited by
// everything it starts, the cage included; both managers were checked to
// work under them (checks/system TestCageWalls).
func containerWalls() []string {
	return []string{
		// The cage can never make a setuid or setgid file, whatever the
		// workspace's owner or mount options (issue 21).
		"RestrictSUIDSGID", "yes",
		// No AF_VSOCK (not network-namespaced: the hypervisor of a VM
		// host), AF_PACKET, AF_BLUETOOTH...; netlink is what nspawn and
		// podman need to set the cage up.
		"RestrictAddressFamilies", strings.Join(sealFamilies, " "),
	}
}

// userNSBase gives each nspawn and podman cage its own 65536-id range above
// the ranges nspawn --private-users=pick picks from (which end below
// 0x70000000): derived from the name so it is stable (the workspace stays
// owned by the cage's root across restarts), bumped past collisions in name
// order so it is unique within one config.
func (r *renderer) userNSBase(agent string) int {
	const first, slots = 0x70000000, 4096
	used := map[int]string{}
	for _, a := range r.cfg.Agents { // sorted by name
		if a.Backend == config.BackendService {
			continue
		}
		slot := int(fnv32(a.Name) % slots)
		for used[slot] != "" {
			slot = (slot + 1) % slots
		}
		used[slot] = a.Name
		if a.Name == agent {
			return first + slot*65536
		}
	}
	return first
}

func fnv32(s string) uint32 {
	h := uint32(2166136261)
	for i := 0; i < len(s); i++ {
		h ^= uint32(s[i])
		h *= 16777619
	}
	return h
}

// podmanBackend runs the agent with podman (runc, as the host's hybrid
// cgroups require) in a user namespace of its own, inside the agent unit's
// cgroup.
func (r *renderer) podmanBackend(a *config.Agent) section {
	name := r.cageName(a)
	base := strconv.Itoa(r.userNSBase(a.Name))
	argv := []string{
		"--rm", "--replace", "--name", name,
		"--network=ns:" + paths.NetnsPath(a.Name),
		"--dns=none", "--no-hosts",
		// An explicit range: podman 4.3's --userns=auto finds no mapping
		// for a --rootfs container (no layers to size it).
		"--uidmap=0:" + base + ":65536", "--gidmap=0:" + base + ":65536",
		"--cap-drop=all", "--security-opt=no-new-privileges",
		// No seccomp profile of podman's: runc built its ~1150
		// instructions with libseccomp at every start. cage-seal, the
		// container's first process, installs its filter (nspawn 252's
		// allow list plus what podman's default profile refuses besides,
		// TestAllowListCoversPodman) before it execs the agent, so every
		// process of the cage runs under it (docs/threat-model.md).
		"--security-opt=seccomp=unconfined",
		// runc cannot mount a sysfs or cgroupfs of the cage's own here (the
		// network namespace is not the user namespace's): it binds the
		// host's, with every cgroup and the host's network devices. Hide
		// them (read-only empty directories).
		"--security-opt=mask=" + strings.Join(podmanMasked, ":"),
		"--read-only",
		// The container stays in the unit's cgroup, so the unit's
		// MemoryMax=, TasksMax=, IP filters, kill and freeze reach it;
		// limits are the unit's, not podman's (which would write pids.max
		// and memory.max the unit may not delegate). Rlimits likewise.
		"--cgroups=split", "--pids-limit=0", "--ulimit=host",
		"--env-file=" + filepath.Join(paths.Runtime(a.Name), "agent.env"),
		"--workdir=" + paths.CageWorkspace,
		// No ":U": the workspace is made owned by the cage's root by
		// tmpfiles; podman's chown would also chown what the cage put there.
		"--volume=" + a.Workspace + ":" + paths.CageWorkspace + ":rw",
		"--volume=" + r.bin("cage-seal") + ":" + paths.CageSeal + ":ro",
		"--tmpfs=/tmp:rw,nosuid,nodev",
	}
	if r.turn != nil {
		// podman passes its stdin (the turn's text) only when asked.
		argv = append([]string{"--interactive"}, argv...)
	}
	for _, b := range r.cageBinds(a) {
		argv = append(argv, "--volume="+b[0]+":"+b[1]+":ro")
	}
	for _, kv := range cageEnv(a) {
		argv = append(argv, "--env="+kv[0]+"="+kv[1])
	}
	if a.Image != "" {
		argv = append(argv, a.Image)
	} else {
		argv = append(argv, "--volume=/usr:/usr:ro", "--rootfs", paths.PodmanRootfs)
	}
	argv = append(append(argv, paths.CageSeal, "--"), a.Command...)
	s := sec("Service",
		"Type", "exec",
		"ExecStart", r.withStoreBinds(a, config.BackendPodman, []string{r.o.Podman, "--runtime", "runc", "run"}, argv),
		// --rm removes the container when podman ends by itself (the
		// container's own status, below podman's 125-127); only a podman
		// that was killed or failed leaves one behind, so only then pay
		// for another podman (~200 ms under load; docs/performance.md).
		// --replace at the next start is the second net.
		"ExecStopPost", "-"+quoteCmd([]string{"/bin/sh", "-c",
			`[ "$EXIT_CODE" = exited ] && [ "$EXIT_STATUS" -lt 125 ] || exec '` + r.o.Podman + `' rm --force --ignore "$0"`, name}),
		"Environment", "CONTAINERS_CONF="+filepath.Join(r.o.Prefix, paths.PodmanConf),
		"Delegate", "yes",
		"KillMode", "mixed",
		"KeyringMode", "private",
		"ProtectHome", "yes",
		"IPAddressAllow", "localhost",
		"IPAddressDeny", "any",
		// What --ulimit did before --ulimit=host: the cage inherits these.
		"LimitNOFILE", "65536",
		"LimitNPROC", strconv.Itoa(a.Resources.Tasks),
	)
	s.add(containerWalls()...)
	return s
}

// podmanMasked are the host views podman cages must not see.
var podmanMasked = []string{"/sys/fs/cgroup", "/sys/class/net", "/sys/devices"}

// serviceView hides from a service cage what the skeleton root shows of the
// host and of other cages (issues 16 and 21):
//   - /var/lib: systemd makes each service cage's StateDirectory= mount
//     point inside the shared skeleton, so every cage saw the others'
//     names; on a tmpfs the cage's own is made there instead;
//   - /sys/class/net and /sys/devices: systemd 252 binds the host's /sys,
//     with the host's network devices (names, MACs, counters of every
//     cage's traffic); CPU topology stays, for tools that count CPUs;
//   - /sys/fs/cgroup: services get no cgroup namespace in systemd 252, so
//     the cage's own cgroup is bound to /sys/fs/cgroup itself, the layout
//     of a container without a cgroup namespace (runtimes that size
//     themselves from memory.max find it through /proc/self/mountinfo).
//     No "-": if the cgroup is not where the unit's name says, the cage
//     does not start rather than see the whole tree;
//   - /dev/shm: PrivateDevices= binds the host's into the private /dev, so
//     every service cage and every local user shared one sticky directory,
//     a channel around every gateway (red team): a tmpfs of the cage's own
//     (its pages are charged to the cage's memory limit).
func serviceView(unit string) []string {
	tpl := unit[:strings.IndexByte(unit, '@')+1] + unit[strings.LastIndexByte(unit, '.'):]
	own := "/sys/fs/cgroup/system.slice/" + sliceOf(tpl) + "/" + unit
	return []string{
		"TemporaryFileSystem", "/var/lib:ro /sys/class/net:ro /sys/devices:ro",
		"TemporaryFileSystem", "/dev/shm:mode=1777,nosuid,nodev",
		"BindReadOnlyPaths", "/sys/devices/system/cpu",
		"BindReadOnlyPaths", unitPathEscape(own) + ":/sys/fs/cgroup",
	}
}

// sliceOf is the slice systemd puts instances of a template in:
// system-<prefix, "-" escaped>.slice.
func sliceOf(template string) string {
	prefix := template[:strings.IndexByte(template, '@')]
	return "system-" + strings.ReplaceAll(prefix, "-", `\x2d`) + ".slice"
}

// unitPathEscape protects backslashes in a path from the unit file parser,
// which unescapes them in BindPaths= and friends.
func unitPathEscape(p string) string { return strings.ReplaceAll(p, `\`, `\\`) }
