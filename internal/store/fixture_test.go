package store

import (
	"context"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/nixcage/nixcage/internal/release"
	"github.com/nixcage/nixcage/internal/release/releasetest"
)

// fixture is built once per test binary: two real Nix closures, A and B,
// sharing nothing, each copied to a cache by `nix copy` and made into a
// signed release (A with xz, B uncompressed), plus the keys.
type fixture struct {
	topA, topB string
	relA, relB string // release directories, generation 1 and 2
	key        *release.PrivateKey
	pub        *release.PublicKey
	key2       *release.PrivateKey
	pub2       *release.PublicKey
	other      *release.PrivateKey // a key nobody trusts
}

var (
	fixOnce sync.Once
	fix     *fixture
	fixErr  string
	fixDir  string
)

func TestMain(m *testing.M) {
	code := m.Run()
	if fixDir != "" {
		removeAll(fixDir)
	}
	os.Exit(code)
}

func getFixture(t *testing.T) *fixture {
	t.Helper()
	releasetest.RequireNix(t)
	fixOnce.Do(func() {
		f := &fixture{}
		var err error
		fixDir, err = os.MkdirTemp("", "nixcage-store-fixture-")
		if err != nil {
			fixErr = err.Error()
			return
		}
		f.key, f.pub, _ = releasetest.Key(t, release.AlgEd25519)
		f.key2, f.pub2, _ = releasetest.Key(t, release.AlgECDSAP256)
		f.other, _, _ = releasetest.Key(t, release.AlgEd25519)
		f.topA = releasetest.Closure(t, "a", 4<<20)
		f.topB = releasetest.Closure(t, "b", 1<<20)
		f.relA = filepath.Join(fixDir, "relA")
		f.relB = filepath.Join(fixDir, "relB")
		for _, c := range []struct {
			top, out, comp string
			gen            uint64
		}{{f.topA, f.relA, "xz", 1}, {f.topB, f.relB, "none", 2}} {
			_, err := release.Create(context.Background(), release.CreateOptions{
				StorePath: c.top, Keys: []*release.PrivateKey{f.key}, Channel: "stable",
				Generation: c.gen, Expires: releasetest.Expires(), Out: c.out, Compression: c.comp,
			})
			if err != nil {
				fixErr = err.Error()
				return
			}
		}
		fix = f
	})
	if fix == nil {
		t.Fatalf("fixture could not be built (see the first test's failure): %s", fixErr)
	}
	return fix
}

// release copies a fixture release into a fresh directory and re-signs it
// with keys after applying edit.
func (f *fixture) release(t *testing.T, base string, keys []*release.PrivateKey, edit func(*release.Manifest)) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "rel")
	releasetest.CopyDir(t, base, dir)
	if keys != nil || edit != nil {
		if keys == nil {
			keys = []*release.PrivateKey{f.key}
		}
		releasetest.Resign(t, dir, keys, edit)
	}
	return dir
}

func (f *fixture) open(t *testing.T, root string, mod func(*Options)) *Store {
	t.Helper()
	o := Options{Root: root, Channel: "stable", Keys: []*release.PublicKey{f.pub}, Keep: 2}
	if mod != nil {
		mod(&o)
	}
	s, err := Open(o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { removeAll(root) })
	return s
}
