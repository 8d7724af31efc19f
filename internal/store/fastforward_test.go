package store

import (
	"math"
	"path/filepath"
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
		d := filepath.Join(t.TempDir(), "rel")
		linkRelease(t, f, base, d, gen)
		releasetest.Resign(t, d, []*release.PrivateKey{signer}, nil)
		return d
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
