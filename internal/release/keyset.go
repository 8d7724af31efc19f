package release

import (
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/sigstore/sigstore/pkg/cryptoutils"
)

// Key rotation follows TUF's split of the root role from the targets role:
// root keys, kept offline, sign a key set (keys/<version>.json) naming the
// release keys, their threshold, the next root keys and their threshold,
// and an expiry; release keys sign releases. Version 0 is the store's
// configuration (store.root_keys, store.keys); each later version must be
// exactly one above the last, carry signatures from a threshold of the
// previous root keys (the chain) and from a threshold of its own root keys
// (the new root proves it holds its keys), and the newest must not have
// expired. Dropping a release key from the set revokes it.

// KeySetDir holds key sets inside a release or a store: <version>.json and
// <version>.json.sig.
const KeySetDir = "keys"

// MaxKeySetSize bounds an untrusted key set document.
const MaxKeySetSize = 256 << 10

// KeySet is keys/<version>.json.
type KeySet struct {
	Schema  int       `json:"schema"`
	Version uint64    `json:"version"`
	Created time.Time `json:"created"`
	Expires time.Time `json:"expires"`
	Root    Role      `json:"root"`
	Release Role      `json:"release"`
	// GenerationFloor, when set, is a generation the root keys vouch for
	// as the lowest a release may follow: releases must be above it. It
	// restores rollback protection after a rotation drops the keys whose
	// generations counted (see docs/store.md, "Anti-rollback counter").
	GenerationFloor uint64 `json:"generation_floor,omitempty"`
}

// Role is a set of PEM public keys and how many of them must sign.
type Role struct {
	Keys      []string `json:"keys"`
	Threshold int      `json:"threshold"`
}

// KeySetFile is the name of version v's key set inside KeySetDir.
func KeySetFile(v uint64) string { return strconv.FormatUint(v, 10) + ".json" }

// Trust is what a store trusts at one key set version.
type Trust struct {
	Version          uint64
	Expires          time.Time // zero for version 0 (the configuration)
	RootKeys         []*PublicKey
	RootThreshold    int
	ReleaseKeys      []*PublicKey
	ReleaseThreshold int
	GenerationFloor  uint64 // releases must be above it (0 for version 0)
}

// ParseKeySet decodes a key set strictly and checks its structure.
func ParseKeySet(data []byte) (*KeySet, error) {
	if len(data) > MaxKeySetSize {
		return nil, fmt.Errorf("key set is %d bytes, more than the %d allowed", len(data), MaxKeySetSize)
	}
	var ks KeySet
	if err := DecodeStrict(data, &ks, "key set"); err != nil {
		return nil, err
	}
	if ks.Schema != Schema {
		return nil, fmt.Errorf("key set schema %d is not supported", ks.Schema)
	}
	if ks.Version == 0 {
		return nil, errors.New("key set version must be at least 1 (version 0 is the store's configuration)")
	}
	if ks.Created.IsZero() || !ks.Expires.After(ks.Created) {
		return nil, errors.New("key set needs created and an expires after it")
	}
	if _, err := ks.Trust(); err != nil {
		return nil, err
	}
	return &ks, nil
}

// Marshal renders the key set (the bytes that get signed).
func (ks *KeySet) Marshal() ([]byte, error) {
	b, err := json.MarshalIndent(ks, "", "  ")
	if err != nil {
		return nil, err
	}
	return append(b, '\n'), nil
}

// Trust is what this key set makes trusted.
func (ks *KeySet) Trust() (*Trust, error) {
	root, err := parseRole("root", ks.Root)
	if err != nil {
		return nil, err
	}
	rel, err := parseRole("release", ks.Release)
	if err != nil {
		return nil, err
	}
	return &Trust{Version: ks.Version, Expires: ks.Expires, RootKeys: root, RootThreshold: ks.Root.Threshold,
		ReleaseKeys: rel, ReleaseThreshold: ks.Release.Threshold, GenerationFloor: ks.GenerationFloor}, nil
}

func parseRole(name string, r Role) ([]*PublicKey, error) {
	var keys []*PublicKey
	seen := map[string]bool{}
	for _, pem := range r.Keys {
		k, err := ParsePublicKey([]byte(pem))
		if err != nil {
			return nil, fmt.Errorf("key set %s key: %w", name, err)
		}
		if seen[k.ID] {
			return nil, fmt.Errorf("key set lists %s key %s twice: a threshold counts distinct keys", name, short(k.ID))
		}
		seen[k.ID] = true
		keys = append(keys, k)
	}
	if r.Threshold < 1 || r.Threshold > len(keys) {
		return nil, fmt.Errorf("key set %s threshold %d with %d key(s): it must be between 1 and the number of keys", name, r.Threshold, len(keys))
	}
	return keys, nil
}

// NewRole builds a role from public keys.
func NewRole(keys []*PublicKey, threshold int) (Role, error) {
	r := Role{Threshold: threshold}
	for _, k := range keys {
		pem, err := cryptoutils.MarshalPublicKeyToPEM(k.Key)
		if err != nil {
			return Role{}, err
		}
		r.Keys = append(r.Keys, string(pem))
	}
	return r, nil
}

// SignKeySet renders ks and signs it with every key in keys (the previous
// root keys and, when the root changes, the new ones).
func SignKeySet(ks *KeySet, keys []*PrivateKey) (raw, rawSig []byte, err error) {
	if _, err := ks.Trust(); err != nil {
		return nil, nil, err
	}
	if raw, err = ks.Marshal(); err != nil {
		return nil, nil, err
	}
	sigs, err := Sign(raw, keys)
	if err != nil {
		return nil, nil, err
	}
	rawSig, err = sigs.Marshal()
	return raw, rawSig, err
}

// Next verifies raw/rawSig as the key set that follows t: its version is
// t.Version+1, a threshold of t's root keys signed it, and a threshold of
// its own root keys did too. Expiry is not checked here: an intermediate
// key set may have expired, only the newest must be fresh (CheckFresh).
func (t *Trust) Next(raw, rawSig []byte) (*Trust, error) {
	ks, err := ParseKeySet(raw)
	if err != nil {
		return nil, err
	}
	if ks.Version != t.Version+1 {
		return nil, fmt.Errorf("key set version %d does not follow version %d (key sets are applied one version at a time)", ks.Version, t.Version)
	}
	sigs, err := ParseSignatures(rawSig)
	if err != nil {
		return nil, fmt.Errorf("key set %d: %w", ks.Version, err)
	}
	if len(t.RootKeys) == 0 {
		return nil, fmt.Errorf("key set %d: no root keys are configured (store.root_keys), so no key rotation can be trusted", ks.Version)
	}
	if err := VerifySignatures(raw, sigs, t.RootKeys, t.RootThreshold); err != nil {
		return nil, fmt.Errorf("key set %d is not signed by the root keys of version %d: %w", ks.Version, t.Version, err)
	}
	next, err := ks.Trust()
	if err != nil {
		return nil, err
	}
	if err := VerifySignatures(raw, sigs, next.RootKeys, next.RootThreshold); err != nil {
		return nil, fmt.Errorf("key set %d is not signed by its own root keys: %w", ks.Version, err)
	}
	return next, nil
}

// CheckFresh refuses a trust whose key set has expired: releases then
// need a new key set signed by the root keys first.
func (t *Trust) CheckFresh(now time.Time) error {
	if !t.Expires.IsZero() && !now.Before(t.Expires) {
		return fmt.Errorf("key set version %d expired at %s (root expiry); sign a new key set with the root keys (`cagectl key rotate`) and ship it in keys/ of the next release", t.Version, t.Expires.UTC().Format(time.RFC3339))
	}
	return nil
}

// VerifyRelease checks a manifest's signatures against t's release keys.
func (t *Trust) VerifyRelease(raw []byte, sigs *Signatures) error {
	return VerifySignatures(raw, sigs, t.ReleaseKeys, t.ReleaseThreshold)
}
