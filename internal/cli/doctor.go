package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"path/filepath"

	"github.com/nixcage/nixcage/internal/config"
	"github.com/nixcage/nixcage/internal/doctor"
	"github.com/nixcage/nixcage/internal/paths"
	"github.com/nixcage/nixcage/internal/render"
)

func init() {
	register(&command{
		name:  "doctor",
		args:  "[--config FILE] [--json] [--bus ADDR]",
		short: "check the host for nixcage: systemd, cgroups, namespaces, bus policy, caged, store, secrets, installed units; each problem with its fix",
		run:   runDoctor,
	})
	help["doctor"] = helpText{
		long:     "Checks, in order: systemd's version (247 needed, 252 tested) and that it is PID 1; the cgroup layout and controllers (limits are only enforced with memory, pids and cpu); that a network namespace can be made (as root); the D-Bus policy file; that caged answers on the bus; the store root's owner and modes; every secret source, store key and backend program the config names; and that the installed units are exactly what the config renders (nothing missing, nothing of undeclared agents). Each problem is printed with its fix. Exit status 1 if any check FAILed (warnings do not fail).",
		examples: []string{"cagectl doctor", "cagectl doctor --config /etc/nixcage/nixcage.json --json"},
	}
}

func runDoctor(ctx context.Context, env *Env, args []string) error {
	fs := newFlags(env, "doctor")
	addr := addBusFlag(fs, env)
	cfgFile := fs.String("config", filepath.Join(paths.DefaultPrefix, "nixcage", "nixcage.json"), "the configuration caged reads")
	asJSON := fs.Bool("json", false, "print the findings as JSON")
	pos, err := parseFlags(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 0 {
		return usageError("usage: cagectl doctor [--config FILE] [--json]")
	}
	h := doctor.Host{}
	opts := installedOptions(h)
	fl := []doctor.Finding{h.Systemd(ctx)}
	fl = append(fl, h.Cgroups()...)
	fl = append(fl, h.Netns(ctx, opts.IP), h.BusPolicy(), cagedFinding(ctx, *addr))
	cfg, diags := config.NewLoader().LoadFiles(*cfgFile)
	if diags.HasErrors() {
		fl = append(fl, doctor.Finding{Check: "config", Level: doctor.Fail, Detail: diags.Error(), Fix: "cagectl validate " + *cfgFile + " shows every error with its source"})
	} else {
		fl = append(fl, doctor.Finding{Check: "config", Level: doctor.OK, Detail: fmt.Sprintf("%s: %d agent(s)", *cfgFile, len(cfg.Agents))})
		fl = append(fl, h.Store(cfg))
		fl = append(fl, h.Config(cfg, opts)...)
		fl = append(fl, h.Units(cfg, opts))
	}
	printFindings(env, fl, *asJSON)
	if doctor.Failed(fl) {
		return &ExitError{Code: ExitFailure}
	}
	return nil
}

// installedOptions are the render options of the installed tree: from the
// manifest of the prefix caged's unit uses (/etc, or /run with --units
// render), else the defaults.
func installedOptions(h doctor.Host) render.Options {
	o := render.DefaultOptions()
	prefix := paths.DefaultPrefix
	if h.CagedUnits() == "render" {
		prefix = "/run"
	}
	if m := render.ReadManifest(prefix); m.Options != nil {
		o = *m.Options
	}
	o.Prefix = prefix
	return o
}

func cagedFinding(ctx context.Context, addr string) doctor.Finding {
	f := doctor.Finding{Check: "caged"}
	c, err := dialCaged(ctx, addr)
	if err == nil {
		defer c.Close()
		s, serr := c.Status(ctx)
		if serr == nil {
			f.Level, f.Detail = doctor.OK, fmt.Sprintf("caged %s answers (units %s)", s.Version, s.Mode)
			if s.ReconcileError != "" {
				f.Level, f.Detail, f.Fix = doctor.Fail, "last reconcile failed: "+s.ReconcileError, "fix what it names, then cagectl reload"
			}
			return f
		}
		err = serr
	}
	f.Level, f.Detail, f.Fix = doctor.Fail, err.Error(), "systemctl enable --now nixcage-caged.service; journalctl -u nixcage-caged says why it does not start"
	return f
}

func printFindings(env *Env, fl []doctor.Finding, asJSON bool) {
	if asJSON {
		enc := json.NewEncoder(env.Out)
		enc.SetIndent("", "  ")
		enc.Encode(fl)
		return
	}
	for _, f := range fl {
		fmt.Fprintf(env.Out, "%-4s  %-32s %s\n", f.Level, f.Check, f.Detail)
		if f.Fix != "" && f.Level != doctor.OK {
			fmt.Fprintf(env.Out, "      %-32s fix: %s\n", "", f.Fix)
		}
	}
}
