package daemon

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"os"
	"path/filepath"
	"time"

	"github.com/nixcage/nixcage/internal/paths"
	"github.com/nixcage/nixcage/internal/reconcile"
	"github.com/nixcage/nixcage/internal/render"
)

// A spare namespace: after each run caged starts the next run's network
// namespace unit, under the name that run will get, so that a run without
// --name finds its namespace up (loopback up, nothing else in it) instead
// of waiting for `ip netns add` (docs/run.md, "A spare namespace"). Only the
// namespace: it holds nothing of any run, and nothing has run in it. The
// sockets cannot be made ahead, since loading them loads the gateway unit,
// whose credentials depend on the run's secrets.
type spare struct {
	name  string
	ready bool // its start job is done
}

// spareMark, in the spare's run directory, tells a spare from a run (the
// directory also holds the manifest, so a caged that crashed tears the
// spare down on its next start like any run it left).
const spareMark = "spare"

func newRunName() string {
	b := make([]byte, 4)
	rand.Read(b)
	return "run-" + hex.EncodeToString(b)
}

// makeSpare starts a spare namespace unless there is one already or caged
// is stopping. It runs after a run's teardown, off every caller's path.
func (d *Daemon) makeSpare() {
	d.spareMu.Lock()
	if d.spare != nil || d.noSpare {
		d.spareMu.Unlock()
		return
	}
	name := newRunName()
	if d.config().Agent(name) != nil || d.runByName(name) != nil {
		d.spareMu.Unlock()
		return
	}
	sp := &spare{name: name}
	d.spare = sp
	d.spareMu.Unlock()

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	err := d.startSpare(ctx, name)
	d.spareMu.Lock()
	mine := d.spare == sp
	if err == nil && mine {
		sp.ready = true
	} else if mine {
		d.spare = nil
	}
	d.spareMu.Unlock()
	if err != nil {
		d.log.Warn("spare namespace for the next run", "name", name, "err", err)
	}
	if err != nil || !mine {
		d.teardownRun(ctx, d.units, &run{name: name, dir: d.qdirs.Host(paths.RunDir(name))})
	}
}

// startSpare writes the spare's manifest and namespace unit (the run's
// own, render.ThrowawayNetns), starts it and marks it a spare.
func (d *Daemon) startSpare(ctx context.Context, name string) error {
	f, err := render.ThrowawayNetns(d.rec.Options, name)
	if err != nil {
		return err
	}
	root := d.o.Root
	if root == "" {
		root = "/"
	}
	dir := d.qdirs.Host(paths.RunDir(name))
	if err := mkdirReadable(dir); err != nil {
		return err
	}
	if err := writeRunManifest(filepath.Join(dir, runManifest), []string{"/" + f.Path}); err != nil {
		return err
	}
	if err := mkdirReadable(filepath.Join(root, filepath.Dir(f.Path))); err != nil {
		return err
	}
	if _, err := render.Write(root, []render.File{f}); err != nil {
		return err
	}
	d.holdSlices(ctx)
	if err := d.units.Start(ctx, paths.Instance(paths.NetnsTemplate, name)); err != nil {
		return err
	}
	// The mark once the namespace is up: until then it is a start
	// under way, to wait for (the teardown checks do).
	return os.WriteFile(filepath.Join(dir, spareMark), nil, 0o600)
}

// claimSpare hands the spare's name to a run without --name ("" when no
// spare is up); the run's own rendering has the same namespace unit, and
// its manifest replaces the spare's.
func (d *Daemon) claimSpare() string {
	d.spareMu.Lock()
	defer d.spareMu.Unlock()
	if d.spare == nil || !d.spare.ready {
		return ""
	}
	name := d.spare.name
	d.spare = nil
	return name
}

// unclaimSpare gives back a spare whose run was refused before anything of
// it was written (a bad policy, ...), or tears it down if another spare has
// been made meanwhile.
func (d *Daemon) unclaimSpare(name string) {
	d.spareMu.Lock()
	if d.spare == nil && !d.noSpare {
		d.spare = &spare{name: name, ready: true}
		d.spareMu.Unlock()
		return
	}
	d.spareMu.Unlock()
	d.teardownRun(context.Background(), d.units, &run{name: name, dir: d.qdirs.Host(paths.RunDir(name))})
}

// dropSpare tears the spare down when caged stops, and makes no more.
func (d *Daemon) dropSpare(ctx context.Context, units reconcile.Units) {
	d.spareMu.Lock()
	sp := d.spare
	d.spare, d.noSpare = nil, true
	d.spareMu.Unlock()
	if sp != nil {
		d.teardownRun(ctx, units, &run{name: sp.name, dir: d.qdirs.Host(paths.RunDir(sp.name))})
	}
}
