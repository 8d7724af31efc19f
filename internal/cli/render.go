package cli

import (
	"context"
	"fmt"

	"github.com/nixcage/nixcage/internal/render"
)

func init() {
	register(&command{
		name:  "render",
		args:  "FILE... --out DIR",
		short: "write the systemd units and runtime files for a config (DIR is an /etc-like root)",
		run:   runRender,
	})
}

func runRender(ctx context.Context, env *Env, args []string) error {
	o := render.DefaultOptions()
	fs := newFlags(env, "render")
	out := fs.String("out", "", "directory to write into, laid out like /etc (required)")
	fs.StringVar(&o.Prefix, "prefix", o.Prefix, "where DIR will be installed on the target host (/etc, or /run for runtime units)")
	fs.StringVar(&o.BinDir, "bindir", o.BinDir, "directory holding caged and cage-egress on the target host")
	fs.StringVar(&o.IP, "ip", o.IP, "path of ip(8) on the target host")
	fs.StringVar(&o.Nspawn, "nspawn", o.Nspawn, "path of systemd-nspawn on the target host")
	fs.StringVar(&o.Podman, "podman", o.Podman, "path of podman on the target host")
	fs.StringVar(&o.Tmpfiles, "tmpfiles", o.Tmpfiles, "path of systemd-tmpfiles on the target host")
	fs.StringVar(&o.CagedConfig, "caged-config", "", "configuration caged reads (default: the canonical JSON written with the units)")
	fs.StringVar(&o.CagedUnits, "caged-units", "os", "caged's --units in its unit: os (install the whole tree) or render (install only caged's unit, the bus policy and the config; caged renders agents into /run)")
	files, err := parseFlags(fs, args)
	if err != nil {
		return err
	}
	if len(files) == 0 || *out == "" {
		return usageError("render needs FILE... and --out DIR")
	}
	cfg, err := loadConfig(env, files)
	if err != nil {
		return err
	}
	rendered, err := render.Render(cfg, o)
	if err != nil {
		return err
	}
	changed, err := render.Write(*out, rendered)
	if err != nil {
		return err
	}
	// The manifest lets caged (`cagectl apply-config`) prune what a later
	// config no longer declares and render unchanged agents identically.
	if err := render.WriteManifest(*out, render.Manifest{Files: render.Paths(rendered), Options: &o}); err != nil {
		return err
	}
	fmt.Fprintf(env.Out, "rendered %d file(s) into %s, %d changed\n", len(rendered), *out, len(changed))
	return nil
}
