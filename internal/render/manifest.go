package render

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sort"

	"github.com/nixcage/nixcage/internal/paths"
)

// ManifestFile (relative to the prefix) lists every file the last install
// wrote and the options it was rendered with, so the next one (caged's
// reconcile, `cagectl apply-config`) knows what to remove when an agent goes
// away and renders the unchanged agents byte for byte as before.
const ManifestFile = "nixcage/rendered.json"

// Manifest is the content of ManifestFile.
type Manifest struct {
	Files []string `json:"files"`
	// Options are absent in manifests written before they were recorded.
	Options *Options `json:"options,omitempty"`
}

// ReadManifest reads dir's manifest; a missing or unreadable one is empty
// (the reconciler then also scans for files of undeclared agents).
func ReadManifest(dir string) Manifest {
	b, err := os.ReadFile(filepath.Join(dir, ManifestFile))
	if err != nil {
		return Manifest{}
	}
	var m Manifest
	if json.Unmarshal(b, &m) != nil {
		return Manifest{}
	}
	return m
}

// WriteManifest replaces dir's manifest atomically.
func WriteManifest(dir string, m Manifest) error {
	sort.Strings(m.Files)
	b, err := json.MarshalIndent(m, "", "  ")
	if err != nil {
		return err
	}
	p := filepath.Join(dir, ManifestFile)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		return fmt.Errorf("manifest: %w", err)
	}
	tmp := p + ".tmp"
	if err := os.WriteFile(tmp, append(b, '\n'), 0o644); err != nil {
		return fmt.Errorf("manifest: %w", err)
	}
	if err := os.Rename(tmp, p); err != nil {
		return fmt.Errorf("manifest: %w", err)
	}
	return nil
}

// Paths lists the files' paths.
func Paths(files []File) []string {
	out := make([]string, len(files))
	for i, f := range files {
		out[i] = f.Path
	}
	return out
}

// Diff returns the paths of files whose bytes, link target or mode differ
// from what is under dir: exactly what Write would change.
func Diff(dir string, files []File) []string {
	var out []string
	for _, f := range files {
		if !upToDate(filepath.Join(dir, f.Path), f) {
			out = append(out, f.Path)
		}
	}
	return out
}

func upToDate(dst string, f File) bool {
	if f.Link != "" {
		cur, err := os.Readlink(dst)
		return err == nil && cur == f.Link
	}
	cur, err := os.ReadFile(dst)
	if err != nil || !bytes.Equal(cur, f.Data) {
		return false
	}
	st, err := os.Lstat(dst)
	return err == nil && st.Mode().Perm() == f.Mode.Perm()
}

// AgentFiles lists the per-agent files the renderer writes that exist
// under dir (agent units, credential drop-ins, autostart links, gateway
// documents), whatever the manifest says.
func AgentFiles(dir string) []string {
	var out []string
	for _, pat := range []string{
		"systemd/system/" + paths.Instance(paths.AgentTemplate, "*"),
		"systemd/system/" + paths.Instance(paths.PrepTemplate, "*") + ".d/50-credentials.conf",
		"systemd/system/" + paths.Instance(paths.EgressTemplate, "*") + ".d/50-credentials.conf",
		"systemd/system/" + paths.TargetUnit + ".wants/" + paths.Instance(paths.AgentTemplate, "*"),
		"nixcage/agents/*/egress.json",
	} {
		m, _ := filepath.Glob(filepath.Join(dir, pat))
		for _, f := range m {
			rel, err := filepath.Rel(dir, f)
			if err == nil {
				out = append(out, rel)
			}
		}
	}
	sort.Strings(out)
	return out
}
