package systest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"
	"time"
)

// ModuleRoot finds the directory holding go.mod, starting from the working
// directory (a test runs in its package directory).
func ModuleRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("no go.mod above the working directory")
		}
		dir = parent
	}
}

// Version is stamped into every binary the system tests build, as a
// release build stamps its own (nix/package.nix, docs/install.md).
const Version = "0.0.0-systest"

// Build compiles a main package of this module as a static binary (no cgo:
// the machine has its own libc, and the binary must run in any cage) into
// outDir and returns its path.
func Build(ctx context.Context, pkg, outDir string) (string, error) {
	root, err := ModuleRoot()
	if err != nil {
		return "", fmt.Errorf("build %s: %w", pkg, err)
	}
	out := filepath.Join(outDir, filepath.Base(pkg))
	cmd := exec.CommandContext(ctx, "go", "build", "-trimpath", "-ldflags", "-X github.com/nixcage/nixcage/internal/version.Version="+Version, "-o", out, pkg)
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go build %s: %w\n%s", pkg, err, b)
	}
	return out, nil
}

var built struct {
	sync.Mutex
	dir  string
	bins map[string]string
}

// BuildT builds a package once per test process and returns the binary.
func BuildT(t testing.TB, pkg string) string {
	t.Helper()
	built.Lock()
	defer built.Unlock()
	if p, ok := built.bins[pkg]; ok {
		return p
	}
	if built.dir == "" {
		sweepStale()
		d, err := os.MkdirTemp("", "nixcage-systest-bin-")
		if err != nil {
			t.Fatal(err)
		}
		built.dir = d
		built.bins = map[string]string{}
	}
	ctx, cancel := testContext(t, 5*time.Minute)
	defer cancel()
	dir := filepath.Join(built.dir, fmt.Sprint(len(built.bins)))
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	p, err := Build(ctx, pkg, dir)
	if err != nil {
		t.Fatal(err)
	}
	built.bins[pkg] = p
	return p
}

// CleanupBuilds removes binaries built by BuildT; call it from TestMain.
func CleanupBuilds() {
	built.Lock()
	defer built.Unlock()
	if built.dir != "" {
		os.RemoveAll(built.dir)
	}
}

// sweepStale removes build directories of test processes that were killed
// before their cleanup ran (more than an hour old).
func sweepStale() {
	old, _ := filepath.Glob(filepath.Join(os.TempDir(), "nixcage-systest-bin-*"))
	for _, d := range old {
		if fi, err := os.Stat(d); err == nil && time.Since(fi.ModTime()) > time.Hour {
			os.RemoveAll(d)
		}
	}
}
