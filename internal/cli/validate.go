package cli

import (
	"context"
	"fmt"

	"github.com/hashicorp/hcl/v2"

	"github.com/nixcage/nixcage/internal/config"
	"github.com/nixcage/nixcage/internal/doctor"
)

func init() {
	register(&command{
		name:  "validate",
		args:  "FILE...",
		short: "check configuration files; diagnostics on stderr, exit 1 if invalid",
		run:   runValidate,
	})
}

func runValidate(ctx context.Context, env *Env, args []string) error {
	fs := newFlags(env, "validate")
	hostChecks := fs.Bool("host-checks", false, "also check this host for what the config names: secret sources, store keys, backend programs")
	files, err := parseFlags(fs, args)
	if err != nil {
		return err
	}
	if len(files) == 0 {
		return usageError("validate needs at least one FILE (.hcl or .json)")
	}
	cfg, err := loadConfig(env, files)
	if err != nil {
		return err
	}
	if *hostChecks {
		h := doctor.Host{}
		fl := h.Config(cfg, installedOptions(h))
		var bad []doctor.Finding
		for _, f := range fl {
			if f.Level != doctor.OK {
				bad = append(bad, f)
			}
		}
		printFindings(&Env{Stdio: Stdio{In: env.In, Out: env.Err, Err: env.Err}}, bad, false)
		if doctor.Failed(fl) {
			return &ExitError{Code: ExitFailure, Err: fmt.Errorf("configuration valid, but this host lacks what it names (above)")}
		}
		fmt.Fprintf(env.Out, "%d file(s) valid: %d agent(s), %d account(s); %d host check(s) passed\n", len(files), len(cfg.Agents), len(cfg.Accounts), len(fl))
		return nil
	}
	fmt.Fprintf(env.Out, "%d file(s) valid: %d agent(s), %d account(s)\n", len(files), len(cfg.Agents), len(cfg.Accounts))
	return nil
}

// loadConfig loads files and prints diagnostics, with source snippets, to
// stderr. Invalid configs return an ExitError with code 1.
func loadConfig(env *Env, files []string) (*config.Config, error) {
	l := config.NewLoader()
	cfg, diags := l.LoadFiles(files...)
	if len(diags) > 0 {
		w := hcl.NewDiagnosticTextWriter(env.Err, l.Files(), 100, false)
		w.WriteDiagnostics(diags)
	}
	if diags.HasErrors() {
		n := 0
		for _, d := range diags {
			if d.Severity == hcl.DiagError {
				n++
			}
		}
		return nil, &ExitError{Code: ExitFailure, Err: fmt.Errorf("%d error(s) in configuration", n)}
	}
	return cfg, nil
}
