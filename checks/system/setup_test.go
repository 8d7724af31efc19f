package system

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/nixcage/nixcage/internal/systest"
)

// nixcageMachine is the start most system tests share: a booted machine
// with the fake internet, before (if not nil) putting in place what the
// install must find (release keys, ...), then nixcage installed from
// config with bins and secrets (installConfig). The context bounds the
// test's work from the end of the boot by d (the boot has its own bounds)
// and ends with the test.
func nixcageMachine(t *testing.T, d time.Duration, bins systest.Binaries, config string, secrets map[string]string, before func(*systest.Machine)) (*systest.Machine, *systest.Internet, context.Context) {
	t.Helper()
	m := systest.BootT(t)
	in := systest.StartInternetT(t, m)
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	if before != nil {
		before(m)
	}
	installConfig(t, ctx, m, bins, config, secrets)
	return m, in, ctx
}

// installConfig installs nixcage in m from config (written to a file of
// the test's) with bins and secrets, failing the test on error.
func installConfig(t *testing.T, ctx context.Context, m *systest.Machine, bins systest.Binaries, config string, secrets map[string]string) {
	t.Helper()
	cfg := filepath.Join(t.TempDir(), "nixcage.hcl")
	if err := os.WriteFile(cfg, []byte(config), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := systest.InstallNixcage(ctx, m, bins, cfg, secrets); err != nil {
		t.Fatal(err)
	}
}
