// Package doctor checks a host for what nixcage needs, and a config against
// the host: systemd's version, the cgroup layout, network namespaces, the
// bus policy, the store's permissions, secret sources, backend tools, and
// whether the installed units are the ones the config renders. Every
// finding names its fix. `cagectl doctor` prints them all; `cagectl
// validate --host-checks` runs the ones about the config.
package doctor

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/nixcage/nixcage/internal/config"
	"github.com/nixcage/nixcage/internal/paths"
	"github.com/nixcage/nixcage/internal/render"
)

// Levels of a finding. Only Fail makes a check run fail.
const (
	OK   = "ok"
	Warn = "warn"
	Fail = "FAIL"
	Skip = "skip"
)

// Finding is one checked fact.
type Finding struct {
	Check  string `json:"check"`
	Level  string `json:"level"`
	Detail string `json:"detail"`
	Fix    string `json:"fix,omitempty"`
}

// Host is where the checks look: a prefix for every path (tests) and the
// programs they run.
type Host struct {
	Root string // "" = "/"
	// Run runs a program and returns its combined output.
	Run func(ctx context.Context, name string, args ...string) ([]byte, error)
}

func (h Host) path(p string) string {
	if h.Root == "" {
		return p
	}
	return filepath.Join(h.Root, p)
}

func (h Host) run(ctx context.Context, name string, args ...string) ([]byte, error) {
	if h.Run != nil {
		return h.Run(ctx, name, args...)
	}
	return exec.CommandContext(ctx, name, args...).CombinedOutput()
}

// Failed reports whether any finding failed.
func Failed(fs []Finding) bool {
	for _, f := range fs {
		if f.Level == Fail {
			return true
		}
	}
	return false
}

// MinSystemd is the oldest systemd with everything the units use
// (LoadCredential= 247, socket NetworkNamespacePath= 242); TestedSystemd is
// the one the system tests boot.
const (
	MinSystemd    = 247
	TestedSystemd = 252
)

// Systemd checks systemd's version (from systemctl --version).
func (h Host) Systemd(ctx context.Context) Finding {
	f := Finding{Check: "systemd version"}
	out, err := h.run(ctx, "systemctl", "--version")
	if err != nil {
		f.Level, f.Detail, f.Fix = Fail, fmt.Sprintf("systemctl --version: %v", err), "nixcage needs systemd as PID 1 (a booted systemd host)"
		return f
	}
	first, _, _ := strings.Cut(string(out), "\n")
	fields := strings.Fields(first) // "systemd 252 (252.30-1~deb12u2)"
	v := 0
	if len(fields) >= 2 {
		v, _ = strconv.Atoi(fields[1])
	}
	switch {
	case v == 0:
		f.Level, f.Detail = Warn, fmt.Sprintf("cannot read a version from %q", first)
	case v < MinSystemd:
		f.Level, f.Detail, f.Fix = Fail, fmt.Sprintf("systemd %d", v), fmt.Sprintf("upgrade to systemd %d or later (LoadCredential= is %d)", TestedSystemd, MinSystemd)
	case v < TestedSystemd:
		f.Level, f.Detail = Warn, fmt.Sprintf("systemd %d: older than %d, the version nixcage is tested on", v, TestedSystemd)
	default:
		f.Level, f.Detail = OK, fmt.Sprintf("systemd %d", v)
	}
	if f.Level == OK {
		if out, err := h.run(ctx, "systemctl", "is-system-running"); err != nil && strings.TrimSpace(string(out)) == "offline" {
			f.Level, f.Detail, f.Fix = Fail, "systemd is not running as PID 1", "run nixcage on a host booted with systemd"
		}
	}
	return f
}

// Cgroups checks for the unified hierarchy and the controllers resource
// limits and freezing need.
func (h Host) Cgroups() []Finding {
	var st unix.Statfs_t
	if err := unix.Statfs(h.path("/sys/fs/cgroup"), &st); err != nil {
		return []Finding{{Check: "cgroup layout", Level: Fail, Detail: fmt.Sprintf("/sys/fs/cgroup: %v", err), Fix: "mount cgroup2 at /sys/fs/cgroup (boot with systemd.unified_cgroup_hierarchy=1)"}}
	}
	if st.Type != unix.CGROUP2_SUPER_MAGIC {
		return []Finding{{Check: "cgroup layout", Level: Warn, Detail: "hybrid or legacy cgroups: freezing (quarantine) falls back to stopping, podman needs --runtime runc",
			Fix: "boot with systemd.unified_cgroup_hierarchy=1 for the unified hierarchy"}}
	}
	out := []Finding{{Check: "cgroup layout", Level: OK, Detail: "unified (cgroup2)"}}
	b, _ := os.ReadFile(h.path("/sys/fs/cgroup/cgroup.controllers"))
	have := strings.Fields(string(b))
	var missing []string
	for _, c := range []string{"memory", "pids", "cpu"} {
		if !contains(have, c) {
			missing = append(missing, c)
		}
	}
	if len(missing) > 0 {
		out = append(out, Finding{Check: "cgroup controllers", Level: Warn,
			Detail: fmt.Sprintf("%s not available: MemoryMax=, TasksMax=, CPUQuota= are set on the units but not enforced", strings.Join(missing, ", ")),
			Fix:    "give the host these controllers (a container host must delegate them)"})
	} else {
		out = append(out, Finding{Check: "cgroup controllers", Level: OK, Detail: "memory, pids, cpu"})
	}
	return out
}

// Netns creates and deletes a network namespace with ip(8), as the
// namespace unit does.
func (h Host) Netns(ctx context.Context, ip string) Finding {
	f := Finding{Check: "network namespaces"}
	if os.Geteuid() != 0 {
		f.Level, f.Detail = Skip, "needs root (run cagectl doctor as root)"
		return f
	}
	name := fmt.Sprintf("nixcage-doctor-%d", os.Getpid())
	if out, err := h.run(ctx, ip, "netns", "add", name); err != nil {
		f.Level, f.Detail, f.Fix = Fail, fmt.Sprintf("%s netns add: %v: %s", ip, err, bytes.TrimSpace(out)), "nixcage needs CONFIG_NET_NS and ip(8) (iproute2); in a container, CAP_SYS_ADMIN and CAP_NET_ADMIN"
		return f
	}
	h.run(ctx, ip, "netns", "delete", name)
	f.Level, f.Detail = OK, "ip netns add/delete works"
	return f
}

// BusPolicy checks that the D-Bus policy for org.nixcage.cage1 is
// installed where the system bus reads it.
func (h Host) BusPolicy() Finding {
	f := Finding{Check: "bus policy"}
	dirs := []string{"/etc/dbus-1/system.d", "/usr/share/dbus-1/system.d"}
	// NixOS (and any distribution) may add directories in system.conf.
	if b, err := os.ReadFile(h.path("/etc/dbus-1/system.conf")); err == nil {
		for _, m := range includeDir.FindAllSubmatch(b, -1) {
			dirs = append(dirs, strings.TrimSpace(string(m[1])))
		}
	}
	for _, d := range dirs {
		p := filepath.Join(d, paths.BusName+".conf")
		if _, err := os.Stat(h.path(p)); err == nil {
			f.Level, f.Detail = OK, p
			return f
		}
	}
	f.Level, f.Detail = Fail, "no "+paths.BusName+".conf in /etc/dbus-1/system.d or /usr/share/dbus-1/system.d: caged cannot own its name"
	f.Fix = "install dbus-1/system.d/" + paths.BusName + ".conf from `cagectl render` into /etc/dbus-1/system.d/ and run `systemctl reload dbus`"
	return f
}

var includeDir = regexp.MustCompile(`<includedir>([^<]+)</includedir>`)

// Store checks the shared store's root: owned by root, writable by root
// only (a cage binds it read-only; anyone else writing it could change
// what every cage runs).
func (h Host) Store(cfg *config.Config) Finding {
	f := Finding{Check: "store permissions"}
	if cfg.Store == nil {
		f.Level, f.Detail = Skip, "no store block declared"
		return f
	}
	root := cfg.Store.Root
	for p := root; p != "/" && p != "."; p = filepath.Dir(p) {
		st, err := os.Lstat(h.path(p))
		if os.IsNotExist(err) {
			continue // made by caged's first apply
		}
		if err != nil {
			f.Level, f.Detail = Fail, fmt.Sprintf("%s: %v", p, err)
			return f
		}
		sys, _ := st.Sys().(*unix.Stat_t)
		if sys != nil && sys.Uid != 0 {
			f.Level, f.Detail, f.Fix = Fail, fmt.Sprintf("%s is owned by uid %d", p, sys.Uid), "chown root:root "+p
			return f
		}
		if st.Mode().Perm()&0o022 != 0 {
			f.Level, f.Detail, f.Fix = Fail, fmt.Sprintf("%s is writable by group or others (%v)", p, st.Mode().Perm()), "chmod go-w "+p
			return f
		}
	}
	f.Level, f.Detail = OK, root+" and its parents are root's alone"
	return f
}

// Config checks what the config needs of the host: secret sources, store
// keys, backend programs.
func (h Host) Config(cfg *config.Config, o render.Options) []Finding {
	var out []Finding
	for _, a := range cfg.Agents {
		for _, s := range a.Secrets {
			out = append(out, h.secret(a, s))
		}
		switch a.Backend {
		case config.BackendNspawn:
			out = append(out, h.program("agent "+a.Name+": backend nspawn", o.Nspawn, "apt-get install systemd-container (or render with --nspawn PATH)"))
		case config.BackendPodman:
			out = append(out, h.program("agent "+a.Name+": backend podman", o.Podman, "apt-get install podman runc uidmap (or render with --podman PATH)"))
		}
	}
	if cfg.Store != nil {
		for _, k := range append(append([]string(nil), cfg.Store.Keys...), cfg.Store.RootKeys...) {
			f := Finding{Check: "store key " + k, Level: OK, Detail: "present"}
			if _, err := os.Stat(h.path(k)); err != nil {
				f.Level, f.Detail, f.Fix = Fail, err.Error(), "put the release public key (cagectl key generate) at "+k+" or fix store.keys"
			}
			out = append(out, f)
		}
	}
	return out
}

func (h Host) secret(a *config.Agent, s config.Secret) Finding {
	f := Finding{Check: fmt.Sprintf("agent %s: secret %s", a.Name, s.Name)}
	fix := fmt.Sprintf("create %s (one line, mode 0600, owned by root) or fix agent %q's secret %q source", s.Source, a.Name, s.Name)
	st, err := os.Stat(h.path(s.Source))
	switch {
	case os.IsPermission(err):
		f.Level, f.Detail = Skip, fmt.Sprintf("%s: permission denied (run as root to check it)", s.Source)
	case err != nil:
		f.Level, f.Detail, f.Fix = Fail, fmt.Sprintf("source %s does not exist (systemd says \"Failed to set up credentials: Protocol error\" and the start fails)", s.Source), fix
	case !st.Mode().IsRegular():
		f.Level, f.Detail, f.Fix = Fail, fmt.Sprintf("source %s is not a regular file", s.Source), fix
	case st.Size() == 0:
		f.Level, f.Detail, f.Fix = Fail, fmt.Sprintf("source %s is empty", s.Source), fix
	case st.Mode().Perm()&0o077 != 0:
		f.Level, f.Detail, f.Fix = Warn, fmt.Sprintf("source %s is readable by others (%v)", s.Source, st.Mode().Perm()), "chmod 0600 "+s.Source
	default:
		f.Level, f.Detail = OK, s.Source
	}
	return f
}

func (h Host) program(check, p, fix string) Finding {
	if st, err := os.Stat(h.path(p)); err != nil || st.Mode()&0o111 == 0 {
		return Finding{Check: check, Level: Fail, Detail: p + " is not an executable", Fix: fix}
	}
	return Finding{Check: check, Level: OK, Detail: p}
}

// Units compares the installed tree under dir (the prefix units were
// installed with) with what cfg renders: missing or different files, and
// files of agents cfg does not declare.
func (h Host) Units(cfg *config.Config, o render.Options) Finding {
	f := Finding{Check: "units installed vs declared"}
	if _, err := os.Stat(h.path("/etc/NIXOS")); err == nil {
		f.Level, f.Detail = Skip, "NixOS: the units are part of the system generation (nixos-rebuild switch installs them)"
		return f
	}
	files, err := render.Render(cfg, o)
	if err != nil {
		f.Level, f.Detail = Fail, err.Error()
		return f
	}
	dir := h.path(o.Prefix)
	var want []render.File
	names := map[string]bool{}
	for _, x := range files {
		// caged's own unit and the bus policy are install-time files.
		if x.Path == "systemd/system/"+paths.CagedUnit || strings.HasPrefix(x.Path, "dbus-1/") {
			continue
		}
		want = append(want, x)
		names[x.Path] = true
	}
	differ := render.Diff(dir, want)
	var stale []string
	for _, p := range render.AgentFiles(dir) {
		if !names[p] {
			stale = append(stale, p)
		}
	}
	if len(differ)+len(stale) == 0 {
		f.Level, f.Detail = OK, fmt.Sprintf("%d files under %s match the config", len(want), o.Prefix)
		return f
	}
	var parts []string
	if len(differ) > 0 {
		parts = append(parts, fmt.Sprintf("%d missing or different (%s)", len(differ), short(differ)))
	}
	if len(stale) > 0 {
		parts = append(parts, fmt.Sprintf("%d of undeclared agents (%s)", len(stale), short(stale)))
	}
	f.Level, f.Detail = Fail, strings.Join(parts, "; ")+" under "+o.Prefix
	f.Fix = "cagectl apply-config FILE... (or cagectl render FILE... --out " + o.Prefix + " and systemctl daemon-reload)"
	return f
}

func short(xs []string) string {
	if len(xs) > 3 {
		return strings.Join(xs[:3], ", ") + ", ..."
	}
	return strings.Join(xs, ", ")
}

func contains(xs []string, x string) bool {
	for _, y := range xs {
		if y == x {
			return true
		}
	}
	return false
}

// CagedUnits reads the --units mode of the installed caged unit ("os" when
// it cannot tell), so doctor compares the tree caged actually uses.
func (h Host) CagedUnits() string {
	f, err := os.Open(h.path(filepath.Join("/etc/systemd/system", paths.CagedUnit)))
	if err != nil {
		return "os"
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if l := sc.Text(); strings.HasPrefix(l, "ExecStart=") && strings.Contains(l, "--units render") {
			return "render"
		}
	}
	return "os"
}
