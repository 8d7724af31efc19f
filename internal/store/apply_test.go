package store

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nixcage/nixcage/internal/release"
)

func applyDir(t *testing.T, s *Store, dir string) (*Result, error) {
	t.Helper()
	return s.Apply(context.Background(), release.DirSource(dir))
}

func nixDump(t *testing.T, p string) []byte {
	t.Helper()
	out, err := exec.Command("nix-store", "--dump", p).Output()
	if err != nil {
		t.Fatalf("nix-store --dump %s: %v", p, err)
	}
	return out
}

// The whole happy path against real Nix: create, apply, verify, and the
// unpacked tree is byte-identical to what Nix itself serialises.
func TestApplyRealNixCache(t *testing.T) {
	f := getFixture(t)
	s := f.open(t, filepath.Join(t.TempDir(), "root"), nil)
	ctx := context.Background()

	var phases []string
	s.opts.Progress = func(p Progress) { phases = append(phases, p.Phase) }
	res, err := applyDir(t, s, f.relA)
	if err != nil {
		t.Fatal(err)
	}
	if res.Generation != 1 || res.Added != 2 || res.Reused != 0 {
		t.Fatalf("result %+v, want generation 1 with 2 paths added", res)
	}
	if !strings.Contains(strings.Join(phases, ","), "unpack") {
		t.Fatalf("no unpack progress reported: %v", phases)
	}
	m, err := s.manifest(1)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range m.Paths {
		got := nixDump(t, filepath.Join(s.storeDir(), p.Name()))
		want := nixDump(t, p.Path)
		if !bytes.Equal(got, want) {
			t.Fatalf("%s: unpacked tree differs from nix-store --dump (%d vs %d bytes)", p.Path, len(got), len(want))
		}
	}
	// Executables, symlinks and read-only modes survived.
	dep := ""
	for _, p := range m.Paths {
		if strings.HasSuffix(p.Path, "-tool-a") {
			dep = filepath.Join(s.storeDir(), p.Name())
		}
	}
	if fi, err := os.Stat(filepath.Join(dep, "bin", "hello")); err != nil || fi.Mode().Perm() != 0o555 {
		t.Fatalf("bin/hello: %v %v, want mode 0555", fi.Mode(), err)
	}
	if tgt, err := os.Readlink(filepath.Join(dep, "bin", "readme")); err != nil || tgt != "../share/doc/README" {
		t.Fatalf("bin/readme link: %q %v", tgt, err)
	}
	if fi, err := os.Stat(filepath.Join(dep, "share")); err != nil || fi.Mode().Perm() != 0o555 {
		t.Fatalf("share dir: %v %v, want 0555", fi.Mode(), err)
	}
	if cur, _ := s.Current(); cur != 1 {
		t.Fatalf("current = %d, want 1", cur)
	}
	if top, err := os.Readlink(filepath.Join(s.Root(), "generations", "1", "top")); err != nil || filepath.Base(top) != filepath.Base(f.topA) {
		t.Fatalf("top link %q %v", top, err)
	}
	rep, err := s.Verify(ctx, true)
	if err != nil {
		t.Fatalf("verify: %v %v", err, rep.Problems)
	}
	if rep.Paths != 2 {
		t.Fatalf("verified %d paths, want 2", rep.Paths)
	}

	// Generation 2 (uncompressed cache, another closure) switches current;
	// with Keep=2 both generations stay and nothing is collected.
	res, err = applyDir(t, s, f.relB)
	if err != nil {
		t.Fatal(err)
	}
	if res.Generation != 2 || res.Previous != 1 || len(res.Collected) != 0 {
		t.Fatalf("second apply %+v", res)
	}
	if _, err := s.Verify(ctx, true); err != nil {
		t.Fatal(err)
	}

	// Rollback is explicit and does not lower the anti-rollback counter.
	from, to, err := s.Rollback(ctx, 0, false)
	if err != nil || from != 2 || to != 1 {
		t.Fatalf("rollback %d->%d: %v", from, to, err)
	}
	if h, _ := s.Highest(); h != 2 {
		t.Fatalf("highest after rollback = %d, want 2", h)
	}
	if _, err := applyDir(t, s, f.relB); err == nil || !strings.Contains(err.Error(), "not newer than the accepted generation 2") {
		t.Fatalf("re-applying generation 2 after rollback: %v", err)
	}
	gens, err := s.Generations()
	if err != nil || len(gens) != 2 || !gens[0].Current || gens[1].Current {
		t.Fatalf("generations %+v %v", gens, err)
	}

	// Generation 3 = closure A again, on a Keep=2 store: generation 1 is
	// pruned, B's paths stay (generation 2 kept), nothing re-unpacked.
	rel3 := f.release(t, f.relA, nil, func(m *release.Manifest) { m.Generation = 3 })
	res, err = applyDir(t, s, rel3)
	if err != nil {
		t.Fatal(err)
	}
	if res.Added != 0 || res.Reused != 2 || len(res.Pruned) != 1 || res.Pruned[0] != 1 {
		t.Fatalf("third apply %+v", res)
	}
	s.opts.Keep = 1
	gs, removed, err := s.GC(ctx)
	if err != nil || len(gs) != 1 || len(removed) != 2 {
		t.Fatalf("gc removed generations %v paths %v: %v", gs, removed, err)
	}
	if _, err := s.Verify(ctx, true); err != nil {
		t.Fatal(err)
	}
}

func TestVerifyDetectsTampering(t *testing.T) {
	f := getFixture(t)
	s := f.open(t, filepath.Join(t.TempDir(), "root"), nil)
	if _, err := applyDir(t, s, f.relB); err != nil {
		t.Fatal(err)
	}
	m, _ := s.manifest(2)
	var victim string
	for _, p := range m.Paths {
		if strings.HasSuffix(p.Path, "-tool-b") {
			victim = filepath.Join(s.storeDir(), p.Name(), "share", "doc", "README")
		}
	}
	if err := os.Chmod(victim, 0o644); err != nil {
		t.Fatal(err)
	}
	_, err := s.Verify(context.Background(), false)
	if err == nil {
		t.Fatal("verify passed on a writable file")
	}
	os.Remove(victim)
	if err := os.WriteFile(victim, []byte("tampered\n"), 0o444); err != nil {
		t.Fatal(err)
	}
	rep, err := s.Verify(context.Background(), false)
	if err == nil || len(rep.Problems) != 1 || !strings.Contains(rep.Problems[0].Reason, "content differs") {
		t.Fatalf("verify after tampering: %v %v", err, rep.Problems)
	}
}

// A mirror that keeps serving the last good release freezes the channel:
// the current generation ages past its expiry. Freshness and Verify say
// so: expiring within the window, then expired (Verify fails with
// ErrExpired while the content still verifies).
func TestFreshnessReportsFrozenChannel(t *testing.T) {
	f := getFixture(t)
	root := filepath.Join(t.TempDir(), "root")
	now := time.Now()
	clock := now
	s := f.open(t, root, func(o *Options) {
		o.ExpiryWarning = 7 * 24 * time.Hour
		o.Now = func() time.Time { return clock }
	})
	if fr, err := s.Freshness(); err != nil || fr.State != FreshNone {
		t.Fatalf("empty store: %+v %v", fr, err)
	}
	expires := now.Add(10 * 24 * time.Hour).UTC().Truncate(time.Second)
	rel := f.release(t, f.relB, nil, func(m *release.Manifest) { m.Generation = 1; m.Expires = expires })
	if _, err := applyDir(t, s, rel); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		at   time.Duration
		want string
	}{{0, FreshOK}, {4 * 24 * time.Hour, FreshExpiring}, {10 * 24 * time.Hour, FreshExpired}, {40 * 24 * time.Hour, FreshExpired}} {
		clock = now.Add(c.at)
		fr, err := s.Freshness()
		if err != nil || fr.State != c.want || !fr.Expires.Equal(expires) || fr.Generation != 1 {
			t.Fatalf("at +%v: %+v %v, want %s", c.at, fr, err, c.want)
		}
		rep, err := s.Verify(context.Background(), false)
		if c.want == FreshExpired {
			if !errors.Is(err, ErrExpired) || !strings.Contains(err.Error(), "frozen") {
				t.Fatalf("verify of an expired generation: %v", err)
			}
		} else if err != nil {
			t.Fatalf("verify at +%v: %v", c.at, err)
		}
		if rep.Freshness.State != c.want {
			t.Fatalf("verify report freshness %+v", rep.Freshness)
		}
	}
}
