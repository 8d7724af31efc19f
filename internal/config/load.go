// Package config loads nixcage's declarative model from HCL or JSON files
// (JSON is what the NixOS module renders), validates it strictly and returns
// one normalized Config. Every problem is an hcl.Diagnostic with file:line:col
// and a detail that says how to fix it; nothing downstream runs on a config
// with errors.
package config

import (
	"fmt"
	"io/fs"
	"os"
	"path"
	"sort"
	"strings"

	"github.com/hashicorp/hcl/v2"
	"github.com/hashicorp/hcl/v2/gohcl"
	"github.com/hashicorp/hcl/v2/hclparse"

	"github.com/nixcage/nixcage/policies"
)

// Loader parses files and keeps their sources for diagnostics.
type Loader struct {
	parser *hclparse.Parser
	// Builtin is where named policies come from when the files do not define
	// them. Defaults to the policies shipped with nixcage.
	Builtin fs.FS
}

// NewLoader returns a Loader using the shipped policies.
func NewLoader() *Loader {
	return &Loader{parser: hclparse.NewParser(), Builtin: policies.FS}
}

// Files returns the parsed sources, for hcl.NewDiagnosticTextWriter.
func (l *Loader) Files() map[string]*hcl.File { return l.parser.Files() }

// LoadFiles reads and validates the named files as one configuration.
func (l *Loader) LoadFiles(names ...string) (*Config, hcl.Diagnostics) {
	srcs := make([]Source, 0, len(names))
	var diags hcl.Diagnostics
	for _, n := range names {
		b, err := os.ReadFile(n)
		if err != nil {
			diags = append(diags, &hcl.Diagnostic{
				Severity: hcl.DiagError,
				Summary:  "Cannot read configuration file",
				Detail:   fmt.Sprintf("%v. Check the path and its permissions.", err),
			})
			continue
		}
		srcs = append(srcs, Source{Name: n, Data: b})
	}
	if diags.HasErrors() {
		return nil, diags
	}
	return l.Load(srcs...)
}

// Source is one configuration file's name and bytes. A name ending in
// ".json" is read as HCL's JSON syntax, anything else as native HCL.
type Source struct {
	Name string
	Data []byte
}

// Load parses, merges and validates sources as one configuration.
func (l *Loader) Load(srcs ...Source) (*Config, hcl.Diagnostics) {
	var diags hcl.Diagnostics
	var files []*fileV1
	if len(srcs) == 0 {
		return nil, hcl.Diagnostics{{Severity: hcl.DiagError, Summary: "No configuration files", Detail: "Name at least one .hcl or .json file."}}
	}
	for _, s := range srcs {
		f, d := l.decode(s)
		diags = append(diags, d...)
		if f != nil {
			files = append(files, f)
		}
	}
	if diags.HasErrors() {
		return nil, diags
	}
	v := &validator{loader: l}
	cfg := v.build(files)
	diags = append(diags, v.diags...)
	if diags.HasErrors() {
		return nil, diags
	}
	return cfg, diags
}

func (l *Loader) parse(s Source) (*hcl.File, hcl.Diagnostics) {
	if strings.HasSuffix(s.Name, ".json") {
		return l.parser.ParseJSON(s.Data, s.Name)
	}
	return l.parser.ParseHCL(s.Data, s.Name)
}

func (l *Loader) decode(s Source) (*fileV1, hcl.Diagnostics) {
	hf, diags := l.parse(s)
	if diags.HasErrors() {
		return nil, diags
	}
	var f fileV1
	diags = append(diags, gohcl.DecodeBody(hf.Body, nil, &f)...)
	if diags.HasErrors() {
		return nil, diags
	}
	for i := range f.Policies {
		d := gohcl.DecodeBody(f.Policies[i].Remain, nil, &f.Policies[i].policy)
		diags = append(diags, d...)
	}
	return &f, diags
}

// builtinPolicy loads a shipped policy by name, or returns nil.
func (l *Loader) builtinPolicy(name string) (*namedPolicy, hcl.Diagnostics) {
	if l.Builtin == nil {
		return nil, nil
	}
	file := name + ".hcl"
	data, err := fs.ReadFile(l.Builtin, file)
	if err != nil {
		return nil, nil
	}
	f, diags := l.decode(Source{Name: path.Join("<builtin>", file), Data: data})
	if diags.HasErrors() {
		return nil, diags
	}
	for i := range f.Policies {
		if f.Policies[i].Name == name {
			return &f.Policies[i], nil
		}
	}
	return nil, nil
}

// BuiltinPolicyNames lists the shipped policies, sorted.
func (l *Loader) BuiltinPolicyNames() []string {
	var names []string
	if l.Builtin == nil {
		return nil
	}
	entries, _ := fs.ReadDir(l.Builtin, ".")
	for _, e := range entries {
		if n, ok := strings.CutSuffix(e.Name(), ".hcl"); ok {
			names = append(names, n)
		}
	}
	sort.Strings(names)
	return names
}

// BuiltinDenies returns the deny patterns of every shipped policy: names
// nixcage itself says a cage should not reach (telemetry, error reporting),
// which `cagectl policy suggest` never proposes.
func (l *Loader) BuiltinDenies() []string {
	var out []string
	for _, n := range l.BuiltinPolicyNames() {
		p, diags := l.builtinPolicy(n)
		if p == nil || diags.HasErrors() {
			continue
		}
		out = append(out, p.policy.Deny...)
	}
	return out
}
