// Package render turns a validated config into the files a host needs:
// systemd units (per agent a network namespace, a prepare step, the egress
// gateway's sockets and service, and the agent under its backend), the
// gateway's runtime documents, the D-Bus policy and tmpfiles rules.
//
// Rendering is a pure function of (Config, Options): the same input gives
// byte-identical output, so NixOS builds are reproducible and caged can tell
// exactly which units changed by comparing bytes.
package render

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"

	"github.com/coreos/go-systemd/v22/unit"

	"github.com/nixcage/nixcage/internal/config"
	"github.com/nixcage/nixcage/internal/paths"
)

// Options say where things live on the target host.
type Options struct {
	// Prefix is where the rendered tree is installed ("/etc" or "/run");
	// units reference their configuration under it.
	Prefix string `json:"prefix"`
	// BinDir holds caged, cagectl and cage-egress.
	BinDir string `json:"bindir"`
	// Tools are absolute paths of the host programs units run.
	IP       string `json:"ip"`
	Nspawn   string `json:"nspawn"`
	Podman   string `json:"podman"`
	Tmpfiles string `json:"tmpfiles"`
	// CagedConfig is the configuration caged reads; empty means the
	// canonical JSON this render writes.
	CagedConfig string `json:"caged_config,omitempty"`
	// CagedUnits is caged's --units in its rendered unit: "os" (default;
	// the whole tree is installed with it) or "render" (only caged's unit,
	// the bus policy and the config are installed; caged renders the rest
	// into /run).
	CagedUnits string `json:"caged_units,omitempty"`
}

// DefaultOptions fit a Debian-like host where nixcage was installed to
// /usr/local/bin.
func DefaultOptions() Options {
	return Options{
		Prefix:   paths.DefaultPrefix,
		BinDir:   "/usr/local/bin",
		IP:       "/usr/bin/ip",
		Nspawn:   "/usr/bin/systemd-nspawn",
		Podman:   "/usr/bin/podman",
		Tmpfiles: "/usr/bin/systemd-tmpfiles",
	}
}

// File is one rendered file, relative to the prefix (e.g.
// "systemd/system/nixcage-caged.service").
type File struct {
	Path string
	Mode os.FileMode
	Data []byte
	// Link, when set, makes the file a symlink to Link instead.
	Link string
}

// Render returns every file for cfg, sorted by path.
func Render(cfg *config.Config, o Options) ([]File, error) {
	if !filepath.IsAbs(o.Prefix) || !filepath.IsAbs(o.BinDir) {
		return nil, fmt.Errorf("render: prefix %q and bindir %q must be absolute", o.Prefix, o.BinDir)
	}
	if o.CagedUnits != "" && o.CagedUnits != "os" && o.CagedUnits != "render" {
		return nil, fmt.Errorf("render: caged units %q: use \"os\" (the whole tree is installed) or \"render\" (caged renders agents into /run)", o.CagedUnits)
	}
	r := &renderer{cfg: cfg, o: o}
	if err := r.all(); err != nil {
		return nil, err
	}
	sort.Slice(r.files, func(i, j int) bool { return r.files[i].Path < r.files[j].Path })
	return r.files, nil
}

type renderer struct {
	cfg   *config.Config
	o     Options
	files []File
	run   *Throwaway // set when rendering a throw-away cage
	turn  *Turn      // set when rendering one turn of an agent
}

func (r *renderer) add(path string, mode os.FileMode, data []byte) {
	r.files = append(r.files, File{Path: path, Mode: mode, Data: data})
}

func (r *renderer) unit(name string, sections ...section) {
	r.add(filepath.Join("systemd/system", name), 0o644, serialize(sections))
}

// section is one [Section] of a unit, as ordered key/value pairs.
type section struct {
	name string
	opts [][2]string
}

func sec(name string, kv ...string) section {
	s := section{name: name}
	s.add(kv...)
	return s
}

// add appends options; one with an empty key is left out (an option a
// renderer decides against).
func (s *section) add(kv ...string) {
	for i := 0; i+1 < len(kv); i += 2 {
		if kv[i] == "" {
			continue
		}
		s.opts = append(s.opts, [2]string{kv[i], kv[i+1]})
	}
}

func serialize(sections []section) []byte {
	var opts []*unit.UnitOption
	for _, s := range sections {
		for _, kv := range s.opts {
			opts = append(opts, unit.NewUnitOption(s.name, kv[0], kv[1]))
		}
	}
	b, _ := io.ReadAll(unit.Serialize(opts))
	return b
}

// OptionsFile is where a render records its Options, relative to the
// prefix: caged renders each turn's unit (RenderTurn) with the options the
// agents' own units were rendered with, which under --units os (NixOS, or
// cagectl render --out /etc) only the rendered tree knows.
const OptionsFile = "nixcage/render-options.json"

func (r *renderer) all() error {
	opts, err := json.MarshalIndent(r.o, "", "  ")
	if err != nil {
		return err
	}
	r.add(OptionsFile, 0o644, append(opts, '\n'))
	r.caged()
	r.templates()
	r.target()
	r.dbusPolicy()
	r.tmpfiles()
	if err := r.relay(); err != nil {
		return err
	}
	if err := r.canonical(); err != nil {
		return err
	}
	for _, a := range r.cfg.Agents {
		if err := r.agent(a); err != nil {
			return fmt.Errorf("agent %s: %w", a.Name, err)
		}
	}
	return nil
}

// Write puts files under dir: written to a temporary name and renamed, so a
// reader (systemd, caged) sees either the old or the new content of each
// file, never a torn one. It reports whether anything changed.
func Write(dir string, files []File) (changed []string, err error) {
	for _, f := range files {
		dst := filepath.Join(dir, f.Path)
		if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
			return changed, fmt.Errorf("write %s: %w", f.Path, err)
		}
		if upToDate(dst, f) {
			continue
		}
		if f.Link != "" {
			tmp := dst + ".nixcage-tmp"
			os.Remove(tmp)
			if err := os.Symlink(f.Link, tmp); err != nil {
				return changed, fmt.Errorf("write %s: %w", f.Path, err)
			}
			if err := os.Rename(tmp, dst); err != nil {
				return changed, fmt.Errorf("write %s: %w", f.Path, err)
			}
			changed = append(changed, f.Path)
			continue
		}
		tmp, err := os.CreateTemp(filepath.Dir(dst), ".nixcage-*")
		if err != nil {
			return changed, fmt.Errorf("write %s: %w", f.Path, err)
		}
		_, werr := tmp.Write(f.Data)
		if werr == nil {
			werr = tmp.Chmod(f.Mode)
		}
		if werr == nil {
			werr = tmp.Sync()
		}
		if cerr := tmp.Close(); werr == nil {
			werr = cerr
		}
		if werr == nil {
			werr = os.Rename(tmp.Name(), dst)
		}
		if werr != nil {
			os.Remove(tmp.Name())
			return changed, fmt.Errorf("write %s: %w", f.Path, werr)
		}
		changed = append(changed, f.Path)
	}
	return changed, nil
}
