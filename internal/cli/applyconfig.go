package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/nixcage/nixcage/internal/bus"
)

func init() {
	register(&command{
		name:  "apply-config",
		args:  "FILE... [--dry-run] [--json] [--bus ADDR]",
		short: "validate a new configuration, show the plan, install it through caged and restart exactly what changed (admin)",
		run:   runApplyConfig,
	})
}

// runApplyConfig is the one-step configuration change on a host without
// NixOS. The files are validated here (diagnostics with source lines) and
// sent to caged as bytes, so it does not matter which directories caged's
// sandbox can see.
func runApplyConfig(ctx context.Context, env *Env, args []string) error {
	fs := newFlags(env, "apply-config")
	addr := addBusFlag(fs, env)
	dry := fs.Bool("dry-run", false, "print the plan and change nothing")
	asJSON := fs.Bool("json", false, "print the plan as JSON")
	files, err := parseFlags(fs, args)
	if err != nil {
		return err
	}
	if len(files) == 0 {
		return usageError("usage: cagectl apply-config FILE... [--dry-run]")
	}
	if _, err := loadConfig(env, files); err != nil {
		return err
	}
	srcs := make([]bus.ConfigSource, len(files))
	for i, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			return failure(err)
		}
		abs, _ := filepath.Abs(f)
		srcs[i] = bus.ConfigSource{Name: abs, Data: b}
	}
	c, err := dialCaged(ctx, *addr)
	if err != nil {
		return err
	}
	defer c.Close()
	p, err := c.ApplyConfig(ctx, srcs, *dry)
	if p != nil && *asJSON {
		enc := json.NewEncoder(env.Out)
		enc.SetIndent("", "  ")
		enc.Encode(p)
	} else if p != nil {
		printPlan(env, p)
	}
	if err != nil {
		return busError(fmt.Errorf("apply-config: %w", err))
	}
	return nil
}

func printPlan(env *Env, p *bus.ConfigPlan) {
	verb := map[bool][2]string{
		false: {"to write", "to remove"}, true: {"written", "removed"},
	}[p.Applied]
	units := map[bool][3]string{
		false: {"to stop", "to restart", "to start"}, true: {"stopped", "restarted", "started"},
	}[p.Applied]
	row := func(label string, xs []string) {
		v := "-"
		if len(xs) > 0 {
			v = strings.Join(xs, " ")
		}
		fmt.Fprintf(env.Out, "  %-20s %s\n", label+":", v)
	}
	row("agents added", p.Added)
	row("agents changed", p.Changed)
	row("agents removed", p.Removed)
	row("files "+verb[0], p.Write)
	row("files "+verb[1], p.Remove)
	row("units "+units[0], p.Stop)
	row("units "+units[1], p.Restart)
	row("units "+units[2], p.Start)
	if !p.Applied {
		fmt.Fprintln(env.Out, "dry run: nothing was changed")
	} else {
		fmt.Fprintln(env.Out, "configuration applied")
	}
}
