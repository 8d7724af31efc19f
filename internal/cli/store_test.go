package cli

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/nixcage/nixcage/internal/bus"
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
	out = mustRun(t, "rollback", "--offline", "--store", root, "--key", key+".pub")
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

// Exit statuses a script relies on: a full store disk is 5 (not 1, a
// refusal) and leaves the old generation verifying; an expired current
// generation makes `store verify` exit 6; one close to expiry warns.
func TestStoreExitCodes(t *testing.T) {
	releasetest.RequireNix(t)
	top1 := releasetest.Closure(t, "cli-io1", 64<<10)
	top2 := releasetest.Closure(t, "cli-io2", 2<<20)
	dir := t.TempDir()
	key := filepath.Join(dir, "ops")
	mustRun(t, "key", "generate", "--out", key)
	rel1, rel2 := filepath.Join(dir, "rel1"), filepath.Join(dir, "rel2")
	mustRun(t, "release", "create", top1, "--key", key+".key", "--channel", "stable", "--generation", "1", "--expires", "3d", "--out", rel1, "--compression", "none")
	mustRun(t, "release", "create", top2, "--key", key+".key", "--channel", "stable", "--generation", "2", "--expires", "30d", "--out", rel2, "--compression", "none")

	t.Run("ExpiringAndExpired", func(t *testing.T) {
		root := filepath.Join(t.TempDir(), "root")
		mustRun(t, "apply", rel1, "--offline", "--store", root, "--channel", "stable", "--key", key+".pub")
		out := mustRun(t, "store", "verify", "--store", root)
		if !strings.Contains(out, "WARN generation 1's release expires at") {
			t.Fatalf("a generation expiring in 3 days with the 7-day default window: %q", out)
		}
		if out := mustRun(t, "store", "verify", "--store", root, "--expiry-warning", "24h"); strings.Contains(out, "WARN") {
			t.Fatalf("outside a 24h window: %q", out)
		}
		// Three days on, the mirror still serves nothing newer.
		s, err := store.Open(store.Options{Root: root, ReadOnly: true, Now: func() time.Time { return time.Now().Add(4 * 24 * time.Hour) }})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := s.Verify(context.Background(), false); !errors.Is(err, store.ErrExpired) {
			t.Fatalf("verify 4 days on: %v", err)
		}
		// The same through cagectl: rewrite the kept manifest's expiry as
		// it would read then (the file is root's; only the clock moved).
		gen := filepath.Join(root, "generations", "1", "release.json")
		b, err := os.ReadFile(gen)
		if err != nil {
			t.Fatal(err)
		}
		os.Chmod(gen, 0o644)
		past := time.Now().Add(-time.Hour).UTC().Format(time.RFC3339)
		b = regexp.MustCompile(`"expires": "[^"]*"`).ReplaceAll(b, []byte(`"expires": "`+past+`"`))
		b = regexp.MustCompile(`"created": "[^"]*"`).ReplaceAll(b, []byte(`"created": "2020-01-01T00:00:00Z"`))
		if err := os.WriteFile(gen, b, 0o444); err != nil {
			t.Fatal(err)
		}
		out, _, code := cagectl(t, "store", "verify", "--store", root)
		if code != ExitExpired || !strings.Contains(out, "EXPIRED generation 1's release expired at") {
			t.Fatalf("store verify of an expired generation: exit %d %q", code, out)
		}
	})

	t.Run("DiskFull", func(t *testing.T) {
		mnt := releasetest.SmallFS(t, 16<<20, 2048)
		root := filepath.Join(mnt, "root")
		args := []string{"--offline", "--store", root, "--channel", "stable", "--key", key + ".pub"}
		mustRun(t, append([]string{"apply", rel1}, args...)...)
		free := releasetest.Fill(t, mnt, 256<<10, 1000)
		_, errOut, code := cagectl(t, append([]string{"apply", rel2}, args...)...)
		if code != ExitIO || !strings.Contains(errOut, "store I/O failure") || strings.Contains(errOut, "release refused") {
			t.Fatalf("apply on a full disk: exit %d %q, want %d", code, errOut, ExitIO)
		}
		if out := mustRun(t, "generations", "--store", root); !strings.Contains(out, "*    1") {
			t.Fatalf("generations after a failed apply:\n%s", out)
		}
		mustRun(t, "store", "verify", "--store", root)
		free()
		if out := mustRun(t, append([]string{"apply", rel2}, args...)...); !strings.Contains(out, "generation 2 (channel stable) is current") {
			t.Fatalf("apply once space is back: %q", out)
		}
	})
}

// The operator's rotation, in-process: a root key signs key set 1 (release
// key 2 replaces key 1) into the next release; apply takes it; a rollback to
// the generation only key 1 signed is refused (exit 1) until --force, which
// is logged as forced.
func TestKeyRotateCommand(t *testing.T) {
	releasetest.RequireNix(t)
	top1 := releasetest.Closure(t, "cli-rot1", 64<<10)
	top2 := releasetest.Closure(t, "cli-rot2", 64<<10)
	dir := t.TempDir()
	k1, k2, rootKey := filepath.Join(dir, "k1"), filepath.Join(dir, "k2"), filepath.Join(dir, "root")
	for _, k := range []string{k1, k2, rootKey} {
		mustRun(t, "key", "generate", "--out", k)
	}
	root := filepath.Join(dir, "store")
	rel1, rel2 := filepath.Join(dir, "rel1"), filepath.Join(dir, "rel2")
	mustRun(t, "release", "create", top1, "--key", k1+".key", "--channel", "stable", "--generation", "1", "--expires", "30d", "--out", rel1)
	mustRun(t, "release", "create", top2, "--key", k2+".key", "--channel", "stable", "--generation", "2", "--expires", "30d", "--out", rel2)
	out := mustRun(t, "key", "rotate", "--root-key", rootKey+".key", "--version", "1", "--release-key", k2+".pub", "--expires", "365d", "--out", rel2)
	if !strings.Contains(out, "version 1, 1 release key(s) threshold 1, 1 root key(s) threshold 1") {
		t.Fatalf("key rotate: %q", out)
	}
	if _, errOut, code := cagectl(t, "key", "rotate", "--root-key", rootKey+".key", "--version", "1", "--release-key", k2+".pub", "--out", rel2); code != ExitFailure || !strings.Contains(errOut, "exists") {
		t.Fatalf("signing version 1 twice: exit %d %q", code, errOut)
	}
	args := []string{"--offline", "--store", root, "--channel", "stable", "--key", k1 + ".pub", "--root-key", rootKey + ".pub"}
	mustRun(t, append([]string{"apply", rel1}, args...)...)
	mustRun(t, append([]string{"apply", rel2}, args...)...)
	_, errOut, code := cagectl(t, append([]string{"rollback", "--to", "1"}, args...)...)
	if code != ExitFailure || !strings.Contains(errOut, "not vouched for by the current key set (version 1)") {
		t.Fatalf("rollback to a revoked key's generation: exit %d %q", code, errOut)
	}
	out, errOut, code = cagectl(t, append([]string{"rollback", "--to", "1", "--force"}, args...)...)
	if code != 0 || !strings.Contains(out, "from generation 2 to 1") || !strings.Contains(errOut, "FORCED rollback") {
		t.Fatalf("forced rollback: exit %d %q %q", code, out, errOut)
	}
}

// `cagectl status` says when the current generation is frozen or about to.
func TestStatusReportsFreshness(t *testing.T) {
	for state, want := range map[string]string{"expired": "store EXPIRED: m", "expiring": "store expiring: m", "ok": ""} {
		var out bytes.Buffer
		printStatus(&Env{Stdio: Stdio{Out: &out, Err: &out}}, &bus.Status{Generation: 3, Channel: "stable", Freshness: state, FreshnessMessage: "m"})
		if got := out.String(); (want == "" && strings.Contains(strings.ToLower(got), "store expir")) || !strings.Contains(got, want) {
			t.Errorf("freshness %s: %q", state, got)
		}
	}
}
