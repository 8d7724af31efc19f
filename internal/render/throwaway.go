package render

import (
	"fmt"
	"path/filepath"
	"strings"

	"github.com/nixcage/nixcage/internal/config"
	"github.com/nixcage/nixcage/internal/paths"
)

// Throwaway is how a throw-away cage (`cagectl run`) differs from a declared
// agent. Everything else — the namespace with no route, the gateway and its
// sockets, the prepare step, the backend's hardening — is rendered by the
// same code as for a declared agent, so a run has exactly an agent's walls.
type Throwaway struct {
	// Prefix is where the cage's own configuration is written (egress.json,
	// tmpfiles rules, passwd), e.g. /run/nixcage/runs/NAME. The units
	// reference it, so nothing is shared with declared agents.
	Prefix string
	// Binds are host directories mounted into the cage; the one whose
	// Dest is /workspace is the workspace. Without one the workspace is an
	// empty tmpfs that vanishes with the cage.
	Binds []Bind
	// User is who the command runs as inside an nspawn cage: the caller's
	// own ids, so that files it writes through the ID-mapped workspace
	// belong to the caller. (A service cage runs as its dynamic user, as a
	// declared agent does.)
	User      string
	UID, GID  uint32
	TTY       bool // stdin is a terminal: nspawn runs its own console pty
	Transient bool // the agent unit is a drop-in for a transient unit
}

// Bind is one host directory mounted into a throw-away cage.
type Bind struct {
	Source   string // absolute host path
	Dest     string // absolute path inside the cage
	ReadOnly bool
}

// ThrowawayMounts is where --bind directories appear in a cage (one
// level below, by name); the workspace is paths.CageWorkspace.
const ThrowawayMounts = "/mnt"

// CheckBindPath refuses a path that unit files and nspawn's command line
// cannot carry verbatim.
func CheckBindPath(p string) error {
	if !filepath.IsAbs(p) || filepath.Clean(p) != p {
		return fmt.Errorf("%q is not a clean absolute path", p)
	}
	if strings.ContainsAny(p, " \t\n:\"'\\%$;") {
		return fmt.Errorf("%q contains a space, ':', a quote, '\\', '%%', '$' or ';', which unit files cannot carry; rename it or bind a parent directory", p)
	}
	return nil
}

func (r *renderer) console(a *config.Agent) string {
	if a.Interactive || r.run != nil && r.run.TTY {
		// nspawn makes its own pty for the payload, its controlling
		// terminal, so Ctrl-C and window size reach the foreground process.
		return "interactive"
	}
	return "pipe"
}

func (t *Throwaway) hasWorkspace() bool {
	for _, b := range t.Binds {
		if b.Dest == paths.CageWorkspace {
			return true
		}
	}
	return false
}

// serviceBinds are the service backend's mounts (inside RootDirectory=).
func (t *Throwaway) serviceBinds() []string {
	var kv []string
	if !t.hasWorkspace() {
		kv = append(kv, "TemporaryFileSystem", paths.CageWorkspace+":mode=1777")
	}
	for _, b := range t.Binds {
		if b.Dest != paths.CageWorkspace {
			kv = append(kv, "TemporaryFileSystem", ThrowawayMounts+":mode=0755")
			break
		}
	}
	for _, b := range t.Binds {
		key := "BindPaths"
		if b.ReadOnly {
			key = "BindReadOnlyPaths"
		}
		kv = append(kv, key, b.Source+":"+b.Dest)
	}
	return kv
}

// nspawnArgs are nspawn's mounts and the user the payload runs as. nspawn
// binds each directory from where systemd staged it (hostBinds), never from
// its host path: that path follows renames and symlinks on the host until
// nspawn resolves it, after caged has checked what it named.
func (t *Throwaway) nspawnArgs() []string {
	var argv []string
	if !t.hasWorkspace() {
		argv = append(argv, "--tmpfs="+paths.CageWorkspace+":mode=1777")
	}
	for i, b := range t.Binds {
		opt := "--bind="
		if b.ReadOnly {
			opt = "--bind-ro="
		}
		// idmap: the caller's files appear with their own owners and the
		// payload, running as the caller's uid, writes them as the caller.
		argv = append(argv, opt+paths.RunBindStaged(i)+":"+b.Dest+":idmap")
	}
	argv = append(argv,
		"--bind-ro="+filepath.Join(t.Prefix, "passwd")+":/etc/passwd",
		"--bind-ro="+filepath.Join(t.Prefix, "group")+":/etc/group",
		"--user="+t.User,
	)
	return argv
}

// hostBinds stage the bound directories for nspawn itself, which otherwise
// sees an empty /home (ProtectHome=tmpfs) and a private /tmp: systemd binds
// each one, before it execs nspawn, to a numbered directory on a tmpfs of
// the unit's own (paths.RunBindStage, which no caller can reach), and that
// is what nspawn binds into the cage and caged checks. The stage names the
// directory systemd bound whatever happens on the host afterwards.
func (t *Throwaway) hostBinds() []string {
	if len(t.Binds) == 0 {
		return nil
	}
	kv := []string{"TemporaryFileSystem", paths.RunBindStage + ":mode=0700,nosuid,nodev"}
	for i, b := range t.Binds {
		key := "BindPaths"
		if b.ReadOnly {
			key = "BindReadOnlyPaths"
		}
		kv = append(kv, key, b.Source+":"+paths.RunBindStaged(i))
	}
	return kv
}

// RenderThrowaway returns the files of a throw-away cage for agent a (a
// validated agent with a generated name), with paths relative to "/":
// instance units under run/systemd/system (the templates' bytes under the
// instance's name, so no template is touched and nothing depends on where
// the declared units live), the agent unit as a drop-in for the transient
// unit caged starts with the caller's terminal, and the configuration under
// t.Prefix.
func RenderThrowaway(a *config.Agent, store *config.Store, o Options, t Throwaway) ([]File, error) {
	switch a.Backend {
	case config.BackendService, config.BackendNspawn:
	default:
		return nil, fmt.Errorf("render: throw-away cages run under the service or nspawn backend, not %q", a.Backend)
	}
	if !filepath.IsAbs(t.Prefix) || !filepath.IsAbs(o.BinDir) {
		return nil, fmt.Errorf("render: prefix %q and bindir %q must be absolute", t.Prefix, o.BinDir)
	}
	for _, b := range t.Binds {
		if err := CheckBindPath(b.Source); err != nil {
			return nil, fmt.Errorf("render: bind: %w", err)
		}
		if err := CheckBindPath(b.Dest); err != nil {
			return nil, fmt.Errorf("render: bind: %w", err)
		}
	}
	o.Prefix = t.Prefix
	r := &renderer{cfg: &config.Config{Agents: []*config.Agent{a}, Store: store}, o: o, run: &t}
	r.templates()
	r.tmpfiles()
	if err := r.agent(a); err != nil {
		return nil, fmt.Errorf("agent %s: %w", a.Name, err)
	}
	if a.Backend == config.BackendNspawn {
		r.add("passwd", 0o644, []byte(fmt.Sprintf("%s:x:%d:%d:nixcage throw-away cage:%s:/bin/sh\n", t.User, t.UID, t.GID, paths.CageWorkspace)))
		r.add("group", 0o644, []byte(fmt.Sprintf("%s:x:%d:\n", t.User, t.GID)))
	}
	agentUnit := filepath.Join("systemd/system", paths.Instance(paths.AgentTemplate, a.Name))
	prefix := strings.TrimPrefix(t.Prefix, "/")
	var out []File
	for _, f := range r.files {
		switch {
		case f.Path == paths.PodmanConf:
			continue
		case f.Path == agentUnit && t.Transient:
			f.Path = "run/" + agentUnit + ".d/50-cage.conf"
		case strings.HasPrefix(f.Path, "systemd/system/"):
			name := strings.TrimPrefix(f.Path, "systemd/system/")
			if strings.Contains(name, "@.") {
				name = paths.Instance(name, a.Name)
			}
			f.Path = "run/systemd/system/" + name
		default:
			f.Path = filepath.Join(prefix, f.Path)
		}
		out = append(out, f)
	}
	return out, nil
}

// ThrowawayNetns is the namespace unit of the throw-away cage name, as
// RenderThrowaway renders it (path relative to "/"): caged starts one for
// the next run ahead of it (docs/run.md, "A spare namespace").
func ThrowawayNetns(o Options, name string) (File, error) {
	r := &renderer{cfg: &config.Config{}, o: o, run: &Throwaway{}}
	r.templates()
	for _, f := range r.files {
		if f.Path == filepath.Join("systemd/system", paths.NetnsTemplate) {
			f.Path = filepath.Join("run/systemd/system", paths.Instance(paths.NetnsTemplate, name))
			return f, nil
		}
	}
	return File{}, fmt.Errorf("render: no namespace template")
}
