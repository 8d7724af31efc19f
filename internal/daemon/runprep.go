package daemon

import (
	"fmt"
	"path/filepath"
	"time"

	"github.com/nixcage/nixcage/internal/egress/prepare"
	"github.com/nixcage/nixcage/internal/paths"
	"github.com/nixcage/nixcage/internal/policy"
	"github.com/nixcage/nixcage/internal/render"
	"github.com/nixcage/nixcage/internal/tmpfiles"
)

// prepareRunCage does a throw-away cage's prepare step in caged, once its
// files are written and before any of its units starts: the skeleton and
// state directories (the rendered tmpfiles rules), then `cage-egress
// prepare`'s work with the same code — the cage CA with the run's name
// constraints, the placeholders and the agent's env file, resolv.conf, the
// learn window. A declared agent does this in its prepare step's sandboxed
// unit; for a run that unit was the longest stage before the cage could
// start (docs/performance.md, "cagectl run"), and every input of it is
// caged's own: the egress document caged rendered from the configuration it
// validated, and secrets caged itself read from the caller's descriptors
// and wrote. docs/threat-model.md, "Throw-away cages are prepared by
// caged", says what this changes.
func (d *Daemon) prepareRunCage(r *run, files []render.File) error {
	root := d.o.Root
	if root == "" {
		root = "/"
	}
	prefix := paths.RunDir(r.name)
	rules := ""
	for _, f := range files {
		if "/"+f.Path == filepath.Join(prefix, paths.TmpfilesConf) {
			rules = string(f.Data)
		}
	}
	if rules == "" {
		return fmt.Errorf("prepare: the rendered run has no %s", paths.TmpfilesConf)
	}
	if err := tmpfiles.Apply(root, []byte(rules)); err != nil {
		return fmt.Errorf("prepare: %w", err)
	}
	// The directories the prepare step's unit had systemd make
	// (RuntimeDirectory=, StateDirectory=, both 0755): the gateway and
	// the cage read what is in them as other users. Teardown removes them.
	for _, dir := range []string{paths.Runtime(r.name), paths.EgressState(r.name)} {
		if err := mkdirReadable(d.qdirs.Host(dir)); err != nil {
			return fmt.Errorf("prepare: %w", err)
		}
	}
	rt, err := policy.Load(filepath.Join(root, paths.EgressConfig(prefix, r.name)))
	if err != nil {
		return fmt.Errorf("prepare: %w", err)
	}
	res, err := prepare.Prepare(rt, filepath.Join(r.dir, "secrets"))
	if err != nil {
		return err
	}
	if !res.LearnUntil.IsZero() {
		d.log.Warn("LEARN MODE: requests outside the policy will be allowed and flagged", "name", r.name,
			"until", res.LearnUntil.UTC().Format(time.RFC3339))
	}
	return nil
}
