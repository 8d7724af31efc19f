package store

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nixcage/nixcage/internal/release"
	"github.com/nixcage/nixcage/internal/release/releasetest"
)

// shipKeySet signs key set v (root role: roots at rootThr, release role:
// rel at 1) with signers and puts it into release dir's keys/.
func shipKeySet(t *testing.T, dir string, v uint64, signers []*release.PrivateKey, roots, rel []*release.PublicKey, rootThr int, expires time.Time) {
	t.Helper()
	created := time.Now().UTC().Truncate(time.Second)
	if !expires.After(created) {
		created = expires.Add(-24 * time.Hour)
	}
	ks := &release.KeySet{Schema: release.Schema, Version: v, Created: created, Expires: expires.UTC().Truncate(time.Second)}
	var err error
	ks.Root, err = release.NewRole(roots, rootThr)
	must(t, err)
	ks.Release, err = release.NewRole(rel, 1)
	must(t, err)
	raw, sig, err := release.SignKeySet(ks, signers)
	must(t, err)
	must(t, os.MkdirAll(filepath.Join(dir, release.KeySetDir), 0o755))
	name := filepath.Join(dir, release.KeySetDir, release.KeySetFile(v))
	must(t, os.WriteFile(name, raw, 0o644))
	must(t, os.WriteFile(name+".sig", sig, 0o644))
}

// Key rotation and revocation, against real Nix-built releases: the root
// key signs a key set that replaces release key 1 by key 2; from then on a
// publisher holding only key 1 (revoked) is refused, a rollback to a
// generation only key 1 signed is refused unless forced (and the forced one
// is logged as such), and a root rotation is accepted only as a chain.
func TestKeyRotationAndRevocation(t *testing.T) {
	f := getFixture(t)
	root1, root1Pub, _ := releasetest.Key(t, release.AlgEd25519)
	root2, root2Pub, _ := releasetest.Key(t, release.AlgECDSAP256)
	var logs bytes.Buffer
	dir := filepath.Join(t.TempDir(), "root")
	s := f.open(t, dir, func(o *Options) {
		o.Keep = 5
		o.RootKeys = []*release.PublicKey{root1Pub}
		o.Logger = slog.New(slog.NewTextHandler(&logs, nil))
	})
	rel := func(base string, gen uint64, signer *release.PrivateKey) string {
		d := filepath.Join(t.TempDir(), "rel")
		linkRelease(t, f, base, d, gen)
		releasetest.Resign(t, d, []*release.PrivateKey{signer}, nil)
		return d
	}
	year := time.Now().Add(365 * 24 * time.Hour)
	if _, err := applyDir(t, s, rel(f.relA, 1, f.key)); err != nil {
		t.Fatal(err)
	}

	// Version 1: key 2 replaces key 1. It travels with generation 2, which
	// key 2 signed: the rotation is taken before the release is verified.
	r2 := rel(f.relB, 2, f.key2)
	shipKeySet(t, r2, 1, []*release.PrivateKey{root1}, []*release.PublicKey{root1Pub}, []*release.PublicKey{f.pub2}, 1, year)
	res, err := applyDir(t, s, r2)
	if err != nil {
		t.Fatal(err)
	}
	if len(res.KeySets) != 1 || res.KeySets[0] != 1 || res.KeySetVersion != 1 {
		t.Fatalf("result %+v: want key set 1 taken", res)
	}
	if !strings.Contains(logs.String(), "store: key set rotated") {
		t.Fatalf("rotation not logged:\n%s", logs.String())
	}

	t.Run("RevokedKeyRefused", func(t *testing.T) {
		before := snapshot(t, dir)
		_, err := applyDir(t, s, rel(f.relA, 3, f.key))
		var ref *release.Refusal
		if !errors.As(err, &ref) || !strings.Contains(err.Error(), "signed by untrusted key(s)") {
			t.Fatalf("release signed by a revoked key: %v", err)
		}
		if snapshot(t, dir) != before {
			t.Fatal("store changed by a refused release")
		}
	})

	t.Run("RollbackToRevokedRefusedUnlessForced", func(t *testing.T) {
		_, _, err := s.Rollback(context.Background(), 1, false)
		if err == nil || !strings.Contains(err.Error(), "not vouched for by the current key set (version 1)") || !strings.Contains(err.Error(), "--force") {
			t.Fatalf("rollback to a generation only a revoked key signed: %v", err)
		}
		if cur, _ := s.Current(); cur != 2 {
			t.Fatalf("current %d after a refused rollback", cur)
		}
		logs.Reset()
		if _, _, err := s.Rollback(context.Background(), 1, true); err != nil {
			t.Fatal(err)
		}
		if cur, _ := s.Current(); cur != 1 {
			t.Fatalf("current %d after a forced rollback", cur)
		}
		l := logs.String()
		if !strings.Contains(l, "FORCED rollback") || !strings.Contains(l, "from=2 to=1 key_set_version=1") {
			t.Fatalf("forced rollback not audited:\n%s", l)
		}
		// store verify with keys reports the current generation for what it is.
		if _, err := s.Verify(context.Background(), false); !errors.Is(err, ErrCorrupt) {
			t.Fatalf("verify of a generation signed by a revoked key: %v", err)
		}
		if _, _, err := s.Rollback(context.Background(), 2, false); err != nil {
			t.Fatalf("back to the vouched-for generation: %v", err)
		}
	})

	t.Run("RootRotationChain", func(t *testing.T) {
		// Version 2 moves the root to root2 (signed by the old root and
		// the new), version 3 is signed by root2 alone and trusts key 1
		// again; both travel with one release.
		r := rel(f.relA, 3, f.key)
		shipKeySet(t, r, 2, []*release.PrivateKey{root1, root2}, []*release.PublicKey{root2Pub}, []*release.PublicKey{f.pub2}, 1, year)
		shipKeySet(t, r, 3, []*release.PrivateKey{root2}, []*release.PublicKey{root2Pub}, []*release.PublicKey{f.pub}, 1, year)
		res, err := applyDir(t, s, r)
		if err != nil {
			t.Fatal(err)
		}
		if len(res.KeySets) != 2 || res.KeySetVersion != 3 {
			t.Fatalf("result %+v: want key sets 2 and 3", res)
		}
		tr, err := s.Trust()
		must(t, err)
		if tr.Version != 3 || tr.RootKeys[0].ID != root2Pub.ID {
			t.Fatalf("trust after the chain: version %d", tr.Version)
		}
		// The old root can no longer sign a rotation on its own.
		r4 := rel(f.relB, 4, f.key)
		shipKeySet(t, r4, 4, []*release.PrivateKey{root1}, []*release.PublicKey{root1Pub}, []*release.PublicKey{f.pub}, 1, year)
		if _, err := applyDir(t, s, r4); err == nil || !strings.Contains(err.Error(), "key set 4 is not signed by the root keys of version 3") {
			t.Fatalf("rotation signed by a replaced root: %v", err)
		}
	})

	t.Run("TamperedStoredKeySetFailsClosed", func(t *testing.T) {
		p := filepath.Join(dir, release.KeySetDir, release.KeySetFile(1))
		raw, err := os.ReadFile(p)
		must(t, err)
		must(t, os.Chmod(p, 0o644))
		must(t, os.WriteFile(p, bytes.Replace(raw, []byte(`"threshold": 1`), []byte(`"threshold": 01`), 1), 0o644))
		defer os.WriteFile(p, raw, 0o444)
		if _, err := applyDir(t, s, rel(f.relB, 9, f.key)); err == nil || !strings.Contains(err.Error(), "key set chain does not verify") {
			t.Fatalf("apply with a tampered key set on disk: %v", err)
		}
	})
}

// A new root must prove it holds its keys, and an expired root key set
// lets no release in.
func TestKeySetRefusals(t *testing.T) {
	f := getFixture(t)
	root1, root1Pub, _ := releasetest.Key(t, release.AlgEd25519)
	root2, root2Pub, _ := releasetest.Key(t, release.AlgEd25519)
	year := time.Now().Add(365 * 24 * time.Hour)
	for _, c := range []struct {
		name string
		ship func(dir string)
		want string
	}{
		{"ExpiredRoot", func(d string) {
			shipKeySet(t, d, 1, []*release.PrivateKey{root1}, []*release.PublicKey{root1Pub}, []*release.PublicKey{f.pub}, 1, time.Now().Add(-time.Hour))
		}, "key set version 1 expired at"},
		{"NewRootDidNotSign", func(d string) {
			shipKeySet(t, d, 1, []*release.PrivateKey{root1}, []*release.PublicKey{root2Pub}, []*release.PublicKey{f.pub}, 1, year)
		}, "key set 1 is not signed by its own root keys"},
		{"SignedByUnknownRoot", func(d string) {
			shipKeySet(t, d, 1, []*release.PrivateKey{root2}, []*release.PublicKey{root2Pub}, []*release.PublicKey{f.pub}, 1, year)
		}, "key set 1 is not signed by the root keys of version 0"},
		{"SkipsAVersion", func(d string) {
			shipKeySet(t, d, 1, []*release.PrivateKey{root1}, []*release.PublicKey{root1Pub}, []*release.PublicKey{f.pub}, 1, year)
			// keys/1.json names version 2: the chain cannot skip.
			raw, sig := keySetFiles(t, d, 1)
			ks, err := release.ParseKeySet(raw)
			must(t, err)
			ks.Version = 2
			raw, sig, err = release.SignKeySet(ks, []*release.PrivateKey{root1})
			must(t, err)
			writeKeySetFiles(t, d, 1, raw, sig)
		}, "key set version 2 does not follow version 0"},
	} {
		t.Run(c.name, func(t *testing.T) {
			root := filepath.Join(t.TempDir(), "root")
			s := f.open(t, root, func(o *Options) { o.RootKeys = []*release.PublicKey{root1Pub} })
			d := filepath.Join(t.TempDir(), "rel")
			linkRelease(t, f, f.relB, d, 1)
			c.ship(d)
			_, err := applyDir(t, s, d)
			var ref *release.Refusal
			if !errors.As(err, &ref) || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("got %v, want a refusal containing %q", err, c.want)
			}
			if cur, _ := s.Current(); cur != 0 {
				t.Fatalf("current %d", cur)
			}
		})
	}
}

func keySetFiles(t *testing.T, dir string, v uint64) ([]byte, []byte) {
	name := filepath.Join(dir, release.KeySetDir, release.KeySetFile(v))
	raw, err := os.ReadFile(name)
	must(t, err)
	sig, err := os.ReadFile(name + ".sig")
	must(t, err)
	return raw, sig
}

func writeKeySetFiles(t *testing.T, dir string, v uint64, raw, sig []byte) {
	name := filepath.Join(dir, release.KeySetDir, release.KeySetFile(v))
	must(t, os.WriteFile(name, raw, 0o644))
	must(t, os.WriteFile(name+".sig", sig, 0o644))
}

// An expiring or expired key set freezes the channel as surely as an
// expired release: Freshness and Verify report it.
func TestKeySetExpiryReported(t *testing.T) {
	f := getFixture(t)
	root1, root1Pub, _ := releasetest.Key(t, release.AlgEd25519)
	clock := time.Now()
	s := f.open(t, filepath.Join(t.TempDir(), "root"), func(o *Options) {
		o.RootKeys = []*release.PublicKey{root1Pub}
		o.ExpiryWarning = 7 * 24 * time.Hour
		o.Now = func() time.Time { return clock }
	})
	d := filepath.Join(t.TempDir(), "rel")
	linkRelease(t, f, f.relB, d, 1) // the release itself is good for 30 days
	keysExpire := time.Now().Add(3 * 24 * time.Hour)
	shipKeySet(t, d, 1, []*release.PrivateKey{root1}, []*release.PublicKey{root1Pub}, []*release.PublicKey{f.pub}, 1, keysExpire)
	if _, err := applyDir(t, s, d); err != nil {
		t.Fatal(err)
	}
	fr, err := s.Freshness()
	if err != nil || fr.State != FreshExpiring || fr.KeySetState != FreshExpiring || fr.KeySetVersion != 1 ||
		!strings.Contains(fr.Message(), "key set version 1 expires at") || strings.Contains(fr.Message(), "generation 1's release") {
		t.Fatalf("key set expiring in 3 days: %+v %q %v", fr, fr.Message(), err)
	}
	clock = clock.Add(4 * 24 * time.Hour)
	fr, _ = s.Freshness()
	if fr.State != FreshExpired || !strings.Contains(fr.Message(), "no release can be accepted") {
		t.Fatalf("key set expired: %+v %q", fr, fr.Message())
	}
	if _, err := s.Verify(context.Background(), false); !errors.Is(err, ErrExpired) {
		t.Fatalf("verify with an expired key set: %v", err)
	}
}
