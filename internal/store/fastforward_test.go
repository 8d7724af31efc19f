package store

import (
	"context"
	"errors"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nixcage/nixcage/internal/release"
	"github.com/nixcage/nixcage/internal/release/releasetest"
)

// TestRevokedKeyCannotFreezeTheStore is a malicious publisher (red team,
// issue 12 item 4): holding a trusted release key, it publishes generation
// 2^64-1. The root keys then rotate that key out; the legitimate
// publisher's next release, signed by the new key and carrying the key set
// that revokes the old one, must be accepted. Otherwise the counter the
// revoked key set stays in force for ever: no release can be newer, and
// the store is frozen on what the attacker last shipped (TUF's
// fast-forward attack; TUF resets the counters of a role whose keys the
// root rotates).
func TestRevokedKeyCannotFreezeTheStore(t *testing.T) {
	f := getFixture(t)
	root1, root1Pub, _ := releasetest.Key(t, release.AlgEd25519)
	dir := filepath.Join(t.TempDir(), "root")
	s := f.open(t, dir, func(o *Options) {
		o.RootKeys = []*release.PublicKey{root1Pub}
	})
	rel := func(base string, gen uint64, signer *release.PrivateKey) string {
		return resigned(t, f, base, gen, signer)
	}
	if _, err := applyDir(t, s, rel(f.relA, 1, f.key)); err != nil {
		t.Fatal(err)
	}
	// The compromised key fast-forwards the counter.
	if _, err := applyDir(t, s, rel(f.relB, math.MaxUint64, f.key)); err != nil {
		t.Fatalf("release of the (still trusted) attacker: %v", err)
	}
	// The root revokes key 1 and trusts key 2; the legitimate publisher
	// ships the key set with its next release.
	good := rel(f.relA, 2, f.key2)
	shipKeySet(t, good, 1, []*release.PrivateKey{root1}, []*release.PublicKey{root1Pub}, []*release.PublicKey{f.pub2}, 1, time.Now().Add(365*24*time.Hour))
	res, err := applyDir(t, s, good)
	if err != nil {
		cur, _ := s.Current()
		h, _ := s.Highest()
		t.Fatalf("after the root revoked the key that published generation %d, the legitimate release is refused: %v (current %d, counter %d): the store stays on the revoked key's release for ever", uint64(math.MaxUint64), err, cur, h)
	}
	if res.KeySetVersion != 1 {
		t.Fatalf("result %+v: want key set 1", res)
	}
	if cur, _ := s.Current(); cur == math.MaxUint64 {
		t.Fatalf("current is still the revoked key's generation")
	}
}

// TestRevokedGenerationReportedThenReplaced walks the recovery from the
// fast-forward as an operator sees it: the root's rotation arrives (here
// with a release the revoked key signed, refused, the key set recorded
// all the same); status and verify then say the current generation is not
// vouched for; the next vouched release is accepted, the revoked key's
// generation is pruned, and rollback protection holds again for what the
// new key signed.
func TestRevokedGenerationReportedThenReplaced(t *testing.T) {
	f := getFixture(t)
	root1, root1Pub, _ := releasetest.Key(t, release.AlgEd25519)
	s := f.open(t, filepath.Join(t.TempDir(), "root"), func(o *Options) { o.Keep, o.RootKeys = 3, []*release.PublicKey{root1Pub} })
	if _, err := applyDir(t, s, resigned(t, f, f.relA, 1, f.key)); err != nil {
		t.Fatal(err)
	}
	if _, err := applyDir(t, s, resigned(t, f, f.relB, math.MaxUint64-1, f.key)); err != nil {
		t.Fatal(err)
	}
	// The rotation travels with a release the revoked key signed: the key
	// set is recorded, the release refused.
	bad := resigned(t, f, f.relA, math.MaxUint64, f.key)
	shipKeySet(t, bad, 1, []*release.PrivateKey{root1}, []*release.PublicKey{root1Pub}, []*release.PublicKey{f.pub2}, 1, time.Now().Add(365*24*time.Hour))
	if _, err := applyDir(t, s, bad); err == nil || !strings.Contains(err.Error(), "release refused") {
		t.Fatalf("a release signed by the revoked key: err=%v, want a refusal", err)
	}
	const want = "current generation is not vouched for by the trusted key set"
	fr, err := s.Freshness()
	if err != nil || !strings.Contains(fr.Message(), want) || fr.Unvouched == "" {
		t.Fatalf("freshness %+v (%q), err=%v: want %q", fr, fr.Message(), err, want)
	}
	rep, err := s.Verify(context.Background(), false)
	if !errors.Is(err, ErrCorrupt) || len(rep.Problems) == 0 || !strings.Contains(rep.Problems[0].Reason, want) {
		t.Fatalf("verify: %v %+v: want a problem %q", err, rep, want)
	}
	// A vouched release follows; the revoked key's generation goes.
	if _, err := applyDir(t, s, resigned(t, f, f.relA, 5, f.key2)); err != nil {
		t.Fatalf("vouched release after the rotation: %v", err)
	}
	gens, err := s.Generations()
	if err != nil {
		t.Fatal(err)
	}
	for _, g := range gens {
		if g.Number == math.MaxUint64-1 {
			t.Fatalf("the revoked key's generation is still kept: %+v", gens)
		}
	}
	if fr, _ := s.Freshness(); fr.Unvouched != "" {
		t.Fatalf("after a vouched release: %q", fr.Message())
	}
	if _, err := s.Verify(context.Background(), false); err != nil {
		t.Fatalf("verify after the vouched release: %v", err)
	}
	// Rollback protection counts what key 2 signed.
	if _, err := applyDir(t, s, resigned(t, f, f.relB, 4, f.key2)); err == nil || !strings.Contains(err.Error(), "not newer than the accepted generation 5") {
		t.Fatalf("older release by the trusted key: err=%v, want rollback refusal", err)
	}
}

// TestKeySetGenerationFloor: a key set's generation_floor is a counter
// vouched for by the root keys: a release at or below it is refused even
// though no trusted key signed anything yet.
func TestKeySetGenerationFloor(t *testing.T) {
	f := getFixture(t)
	root1, root1Pub, _ := releasetest.Key(t, release.AlgEd25519)
	s := f.open(t, filepath.Join(t.TempDir(), "root"), func(o *Options) {
		o.RootKeys = []*release.PublicKey{root1Pub}
	})
	d := resigned(t, f, f.relA, 7, f.key2)
	ks := &release.KeySet{Schema: release.Schema, Version: 1, Created: time.Now().Add(-time.Minute),
		Expires: time.Now().Add(24 * time.Hour), GenerationFloor: 10}
	var err error
	if ks.Root, err = release.NewRole([]*release.PublicKey{root1Pub}, 1); err != nil {
		t.Fatal(err)
	}
	if ks.Release, err = release.NewRole([]*release.PublicKey{f.pub2}, 1); err != nil {
		t.Fatal(err)
	}
	raw, sig, err := release.SignKeySet(ks, []*release.PrivateKey{root1})
	if err != nil {
		t.Fatal(err)
	}
	must(t, os.MkdirAll(filepath.Join(d, release.KeySetDir), 0o755))
	writeKeySetFiles(t, d, 1, raw, sig)
	if _, err := applyDir(t, s, d); err == nil || !strings.Contains(err.Error(), "not newer than the accepted generation 10") {
		t.Fatalf("generation 7 under a floor of 10: err=%v", err)
	}
}

// resigned is release base renumbered to gen and signed by signer alone.
func resigned(t *testing.T, f *fixture, base string, gen uint64, signer *release.PrivateKey) string {
	d := filepath.Join(t.TempDir(), "rel")
	linkRelease(t, f, base, d, gen)
	releasetest.Resign(t, d, []*release.PrivateKey{signer}, nil)
	return d
}
