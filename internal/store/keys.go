package store

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/nixcage/nixcage/internal/release"
)

// baseTrust is key set version 0: the store's configuration.
func (s *Store) baseTrust() *release.Trust {
	return &release.Trust{RootKeys: s.rootKeys, RootThreshold: s.opts.RootThreshold,
		ReleaseKeys: s.keys, ReleaseThreshold: s.opts.Threshold}
}

// Trust is what the store trusts now: the configuration, then every key
// set accepted into ROOT/keys, each verified again against the one before
// it (so a key set written there by anything but a verified rotation
// breaks the chain, and the store then trusts nothing rather than it).
func (s *Store) Trust() (*release.Trust, error) {
	t := s.baseTrust()
	dir := filepath.Join(s.root, release.KeySetDir)
	for {
		name := release.KeySetFile(t.Version + 1)
		raw, err := os.ReadFile(filepath.Join(dir, name))
		if errors.Is(err, fs.ErrNotExist) {
			return t, nil
		}
		if err != nil {
			return nil, fmt.Errorf("read key set: %w", err)
		}
		rawSig, err := os.ReadFile(filepath.Join(dir, name+".sig"))
		if err != nil {
			return nil, fmt.Errorf("read key set signatures: %w", err)
		}
		next, err := t.Next(raw, rawSig)
		if err != nil {
			return nil, fmt.Errorf("the store's key set chain does not verify: %w; check store.root_keys (--root-key)", err)
		}
		t = next
	}
}

// updateTrust takes the key sets a release ships in keys/ that follow t,
// verifies each against the one before it and records them in ROOT/keys.
// As in TUF, the root is updated before the release is looked at: a
// rotation is a statement of the root keys, valid whatever the release
// it travels with turns out to be.
func (s *Store) updateTrust(ctx context.Context, src release.Source, t *release.Trust) (*release.Trust, []uint64, error) {
	var added []uint64
	for {
		name := release.KeySetDir + "/" + release.KeySetFile(t.Version+1)
		raw, err := release.ReadFile(ctx, src, name, release.MaxKeySetSize)
		if errors.Is(err, fs.ErrNotExist) {
			return t, added, nil
		}
		if err != nil {
			return nil, nil, fmt.Errorf("read %s: %w", name, err)
		}
		rawSig, err := release.ReadFile(ctx, src, name+".sig", release.MaxSignaturesSize)
		if errors.Is(err, fs.ErrNotExist) {
			return nil, nil, &release.Refusal{Reason: fmt.Sprintf("%s has no %s.sig: sign key sets with `cagectl key rotate`", name, name)}
		}
		if err != nil {
			return nil, nil, fmt.Errorf("read %s.sig: %w", name, err)
		}
		next, err := t.Next(raw, rawSig)
		if err != nil {
			return nil, nil, &release.Refusal{Reason: err.Error()}
		}
		if err := s.writeKeySet(next.Version, raw, rawSig); err != nil {
			return nil, nil, storageFailure("record key set", err)
		}
		s.log.Warn("store: key set rotated", "version", next.Version, "release_keys", len(next.ReleaseKeys),
			"release_threshold", next.ReleaseThreshold, "root_keys", len(next.RootKeys), "expires", next.Expires)
		added = append(added, next.Version)
		t = next
	}
}

// writeKeySet records a verified key set: signatures first, then the set
// under its final name (Trust stops at the first missing set, so a crash
// in between leaves the previous version in force).
func (s *Store) writeKeySet(v uint64, raw, rawSig []byte) error {
	dir := filepath.Join(s.root, release.KeySetDir)
	if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, fs.ErrExist) {
		return err
	}
	name := filepath.Join(dir, release.KeySetFile(v))
	if err := release.WriteFileAtomic(name+".sig", rawSig, 0o444); err != nil {
		return err
	}
	return release.WriteFileAtomic(name, raw, 0o444)
}

// vouchedFor checks that trust's release keys signed generation n.
func (s *Store) vouchedFor(n uint64, t *release.Trust) error {
	raw, err := os.ReadFile(filepath.Join(s.genPath(n), release.ManifestFile))
	if err != nil {
		return err
	}
	rawSig, err := os.ReadFile(filepath.Join(s.genPath(n), release.SignaturesFile))
	if err != nil {
		return err
	}
	sigs, err := release.ParseSignatures(rawSig)
	if err != nil {
		return err
	}
	return t.VerifyRelease(raw, sigs)
}
