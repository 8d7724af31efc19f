package systest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"
)

// The real harness CLIs the system tests run, pinned. Each is the npm
// package of the platform's native binary (what the front package's
// optionalDependencies install); no Node.js is needed to run them.
var HarnessPackages = []HarnessPackage{
	{Spec: "@anthropic-ai/claude-code-linux-x64@2.1.332", Files: map[string]string{"package/claude": "claude"}},
	{Spec: "@openai/codex@0.171.0-linux-x64", Files: map[string]string{
		"package/vendor/x86_64-unknown-linux-musl/bin/codex":                "codex",
		"package/vendor/x86_64-unknown-linux-musl/bin/codex-code-mode-host": "codex-code-mode-host",
		"package/vendor/x86_64-unknown-linux-musl/codex-path/rg":            "rg",
	}},
}

// HarnessPackage is one npm tarball and the files taken from it (tarball
// path -> name in the tools directory's bin/).
type HarnessPackage struct {
	Spec  string
	Files map[string]string
}

// ErrNoHarnessCLIs says the CLIs could not be fetched (no npm, no
// registry); tests skip with it.
var ErrNoHarnessCLIs = errors.New("harness CLIs unavailable")

// HarnessTools returns a host directory with bin/ holding the pinned CLIs.
// The npm tarballs are fetched once (`npm pack`) into CacheDir()/npm and
// unpacked there; later runs use the cache and need no network.
func HarnessTools(ctx context.Context) (string, error) {
	cache := filepath.Join(CacheDir(), "npm")
	var key []string
	for _, p := range HarnessPackages {
		key = append(key, strings.NewReplacer("@", "", "/", "_").Replace(p.Spec))
	}
	tools := filepath.Join(cache, "tools-"+strings.Join(key, "+"))
	if _, err := os.Stat(filepath.Join(tools, ".complete")); err == nil {
		return tools, nil
	}
	if err := os.MkdirAll(cache, 0o755); err != nil {
		return "", err
	}
	tmp, err := os.MkdirTemp(cache, ".tools-")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(tmp)
	if err := os.Chmod(tmp, 0o755); err != nil {
		return "", err
	}
	if err := os.MkdirAll(filepath.Join(tmp, "bin"), 0o755); err != nil {
		return "", err
	}
	for i, p := range HarnessPackages {
		tgz := filepath.Join(cache, key[i]+".tgz")
		if _, err := os.Stat(tgz); err != nil {
			if err := npmPack(ctx, p.Spec, cache, tgz); err != nil {
				return "", err
			}
		}
		args := []string{"-xzf", tgz, "-C", tmp}
		for f := range p.Files {
			args = append(args, f)
		}
		if out, err := exec.CommandContext(ctx, "tar", args...).CombinedOutput(); err != nil {
			return "", fmt.Errorf("unpack %s: %w: %s", tgz, err, out)
		}
		for f, name := range p.Files {
			if err := os.Rename(filepath.Join(tmp, f), filepath.Join(tmp, "bin", name)); err != nil {
				return "", err
			}
			if err := os.Chmod(filepath.Join(tmp, "bin", name), 0o755); err != nil {
				return "", err
			}
		}
	}
	os.RemoveAll(filepath.Join(tmp, "package"))
	if err := os.WriteFile(filepath.Join(tmp, ".complete"), nil, 0o644); err != nil {
		return "", err
	}
	os.RemoveAll(tools)
	if err := os.Rename(tmp, tools); err != nil {
		// A concurrent test process may have finished first.
		if _, serr := os.Stat(filepath.Join(tools, ".complete")); serr == nil {
			return tools, nil
		}
		return "", err
	}
	return tools, nil
}

// npmPack downloads one package tarball with the ordinary npm client.
func npmPack(ctx context.Context, spec, dir, dest string) error {
	npm, err := exec.LookPath("npm")
	if err != nil {
		return fmt.Errorf("%w: npm is not installed (checks/deps.sh installs it)", ErrNoHarnessCLIs)
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, npm, "pack", spec, "--pack-destination", dir, "--silent")
	cmd.Dir = dir
	out, err := cmd.Output()
	if err != nil {
		return fmt.Errorf("%w: npm pack %s: %v", ErrNoHarnessCLIs, spec, err)
	}
	name := strings.TrimSpace(string(out))
	if i := strings.LastIndex(name, "\n"); i >= 0 {
		name = name[i+1:]
	}
	if err := os.Rename(filepath.Join(dir, name), dest); err != nil {
		return fmt.Errorf("npm pack %s wrote %q: %w", spec, name, err)
	}
	return nil
}
