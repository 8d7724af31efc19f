package cli

import (
	"context"
	"fmt"

	"github.com/hashicorp/hcl/v2"

	"github.com/nixcage/nixcage/internal/config"
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
