package cli

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/nixcage/nixcage/internal/release/releasetest"
	"github.com/nixcage/nixcage/internal/store"
)

func cagectl(t *testing.T, args ...string) (string, string, int) {
	t.Helper()
	var out, errb bytes.Buffer
	code := Main(context.Background(), args, Stdio{In: strings.NewReader(""), Out: &out, Err: &errb})
	return out.String(), errb.String(), code
}

func mustRun(t *testing.T, args ...string) string {
	t.Helper()
	out, errOut, code := cagectl(t, args...)
	if code != 0 {
		t.Fatalf("cagectl %s: exit %d\n%s%s", strings.Join(args, " "), code, out, errOut)
	}
	return out
}

// The operator's path end to end, in-process: key, release from the local
// Nix store, offline verify, apply, generations, store verify, rollback, gc.
func TestStoreCommandsEndToEnd(t *testing.T) {
	releasetest.RequireNix(t)
	top1 := releasetest.Closure(t, "cli1", 64<<10)
	top2 := releasetest.Closure(t, "cli2", 64<<10)
	dir := t.TempDir()
	key := filepath.Join(dir, "ops")
	root := filepath.Join(dir, "root")
	t.Cleanup(func() { os.RemoveAll(root) })

	out := mustRun(t, "key", "generate", "--out", key)
	if !strings.Contains(out, "key id") {
		t.Fatalf("key generate: %q", out)
	}
	if _, _, code := cagectl(t, "key", "generate", "--out", key); code != ExitFailure {
		t.Fatalf("overwriting a key: exit %d, want %d", code, ExitFailure)
	}
	rel1, rel2 := filepath.Join(dir, "rel1"), filepath.Join(dir, "rel2")
	mustRun(t, "release", "create", top1, "--key", key+".key", "--channel", "stable", "--generation", "1", "--expires", "30d", "--out", rel1)
	mustRun(t, "release", "create", top2, "--key", key+".key", "--channel", "stable", "--generation", "2", "--expires", "720h", "--out", rel2, "--compression", "none")
	out = mustRun(t, "release", "verify", rel1, "--key", key+".pub")
	if !strings.Contains(out, "generation 1") || !strings.Contains(out, "2 paths") {
		t.Fatalf("release verify: %q", out)
	}

	// Without --offline the writer commands say what to do instead.
	_, errOut, code := cagectl(t, "apply", rel1)
	if code != ExitNoConn || !strings.Contains(errOut, "--offline --store ROOT") {
		t.Fatalf("apply without --offline: exit %d %q", code, errOut)
	}
	storeArgs := []string{"--offline", "--store", root, "--channel", "stable", "--key", key + ".pub"}
	out = mustRun(t, append([]string{"apply", rel1}, storeArgs...)...)
	if !strings.Contains(out, "generation 1 (channel stable) is current") {
		t.Fatalf("apply: %q", out)
	}
	mustRun(t, append([]string{"apply", rel2}, storeArgs...)...)
	out = mustRun(t, "generations", "--store", root)
	if !strings.Contains(out, "*    2") || !strings.Contains(out, "     1") {
		t.Fatalf("generations:\n%s", out)
	}
	out = mustRun(t, "store", "verify", "--store", root, "--all", "--key", key+".pub")
	if !strings.Contains(out, "signatures ok") || !strings.Contains(out, "4 paths") {
		t.Fatalf("store verify: %q", out)
	}
	out = mustRun(t, "rollback", "--offline", "--store", root)
	if !strings.Contains(out, "from generation 2 to 1") {
		t.Fatalf("rollback: %q", out)
	}
	_, errOut, code = cagectl(t, append([]string{"apply", rel2}, storeArgs...)...)
	if code != ExitFailure || !strings.Contains(errOut, "rollback protection") {
		t.Fatalf("re-apply after rollback: exit %d %q", code, errOut)
	}
	out = mustRun(t, "store", "gc", "--offline", "--store", root, "--keep", "1")
	if !strings.Contains(out, "removed 1 generation(s) [2] and 2 store path(s)") {
		t.Fatalf("gc: %q", out)
	}
	mustRun(t, "store", "verify", "--store", root, "--all")

	// A tampered release fails offline verification with exit 1.
	nars, _ := filepath.Glob(filepath.Join(rel2, "nar", "*.nar"))
	b, _ := os.ReadFile(nars[0])
	b[len(b)-20] ^= 1
	os.WriteFile(nars[0], b, 0o644)
	_, errOut, code = cagectl(t, "release", "verify", rel2, "--key", key+".pub")
	if code != ExitFailure || !strings.Contains(errOut, "release refused: nar of") {
		t.Fatalf("verify tampered: exit %d %q", code, errOut)
	}
}

func TestStoreCommandUsage(t *testing.T) {
	for _, args := range [][]string{
		{"release", "create"},
		{"release", "verify"},
		{"apply"},
		{"key", "generate"},
		{"apply", "x", "--offline", "--store", "/nonexistent"},
	} {
		_, _, code := cagectl(t, args...)
		if code != ExitUsage {
			t.Errorf("cagectl %v: exit %d, want %d", args, code, ExitUsage)
		}
	}
	_, errOut, code := cagectl(t, "generations", "--store", filepath.Join(t.TempDir(), "none"))
	if code != ExitFailure || !strings.Contains(errOut, "no store at") {
		t.Errorf("generations on a missing root: %d %q", code, errOut)
	}
	var ee *ExitError
	if err := Run(context.Background(), []string{"rollback"}, Stdio{Out: &bytes.Buffer{}, Err: &bytes.Buffer{}}); !errors.As(err, &ee) || ee.Code != ExitNoConn {
		t.Errorf("rollback without --offline: %v", err)
	}
}

func TestProgressPrinter(t *testing.T) {
	var b bytes.Buffer
	p := &progressPrinter{w: &b}
	p.update(store.Progress{Phase: "unpack", Done: 0, Total: 4, TotalBytes: 8 << 20})
	p.update(store.Progress{Phase: "unpack", Done: 1, Total: 4, Bytes: 1 << 20, TotalBytes: 8 << 20}) // throttled
	p.update(store.Progress{Phase: "unpack", Done: 4, Total: 4, Bytes: 8 << 20, TotalBytes: 8 << 20}) // final: always drawn
	p.done()
	out := b.String()
	if !strings.Contains(out, "unpack: 0/4 paths, 0.0 MiB/8.0 MiB") || !strings.Contains(out, "unpack: 4/4 paths, 8.0 MiB/8.0 MiB") {
		t.Fatalf("progress output %q", out)
	}
	if strings.Contains(out, "1/4") {
		t.Fatalf("progress not throttled: %q", out)
	}
	if isTerminal(&b) {
		t.Fatal("a buffer is not a terminal")
	}
}
