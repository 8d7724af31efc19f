package release

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
)

// Signatures is release.json.sig: detached signatures over the exact bytes
// of release.json.
type Signatures struct {
	Schema     int         `json:"schema"`
	Signatures []Signature `json:"signatures"`
}

// Signature is one key's signature.
type Signature struct {
	KeyID string `json:"keyid"`
	Alg   string `json:"alg"`
	Sig   []byte `json:"sig"` // base64 in JSON
}

// Sign signs manifest bytes with every key (distinct keys only).
func Sign(manifest []byte, keys []*PrivateKey) (*Signatures, error) {
	out := &Signatures{Schema: Schema}
	seen := map[string]bool{}
	for _, k := range keys {
		if seen[k.ID] {
			return nil, fmt.Errorf("key %s given twice: a threshold counts distinct keys", short(k.ID))
		}
		seen[k.ID] = true
		sig, err := k.s.SignMessage(bytes.NewReader(manifest))
		if err != nil {
			return nil, fmt.Errorf("sign with key %s: %w", short(k.ID), err)
		}
		out.Signatures = append(out.Signatures, Signature{KeyID: k.ID, Alg: k.Alg, Sig: sig})
	}
	return out, nil
}

// Marshal renders release.json.sig.
func (s *Signatures) Marshal() ([]byte, error) {
	b, err := json.MarshalIndent(s, "", "  ")
	if err != nil {
		return nil, err
	}
	return append(b, '\n'), nil
}

// ParseSignatures decodes release.json.sig strictly.
func ParseSignatures(data []byte) (*Signatures, error) {
	if len(data) > MaxSignaturesSize {
		return nil, fmt.Errorf("signature file is %d bytes, more than the %d allowed", len(data), MaxSignaturesSize)
	}
	var s Signatures
	if err := DecodeStrict(data, &s, "signatures"); err != nil {
		return nil, err
	}
	if s.Schema != Schema {
		return nil, fmt.Errorf("signature file schema %d is not supported", s.Schema)
	}
	if len(s.Signatures) > maxSignatures {
		return nil, fmt.Errorf("signature file has %d signatures, more than the %d allowed", len(s.Signatures), maxSignatures)
	}
	return &s, nil
}

// ErrUnsigned means the release carries no signature at all.
var ErrUnsigned = errors.New("release is unsigned")

// VerifySignatures checks that at least threshold distinct trusted keys
// signed manifest. Signatures by unknown keys are ignored (they may be for
// another operator's trust set); a signature by a trusted key that does not
// verify is reported but, as in TUF, only the count of valid ones matters.
func VerifySignatures(manifest []byte, sigs *Signatures, trusted []*PublicKey, threshold int) error {
	if threshold < 1 {
		return fmt.Errorf("threshold %d is invalid: it must be at least 1", threshold)
	}
	if len(trusted) == 0 {
		return errors.New("no trusted release keys configured: add public keys (store.keys / --key)")
	}
	byID := map[string]*PublicKey{}
	for _, k := range trusted {
		byID[k.ID] = k
	}
	if threshold > len(byID) {
		return fmt.Errorf("threshold %d is more than the %d distinct trusted keys; no release could ever be accepted", threshold, len(byID))
	}
	if sigs == nil || len(sigs.Signatures) == 0 {
		return fmt.Errorf("%w: %s has no signatures; sign it with `cagectl release create --key`", ErrUnsigned, SignaturesFile)
	}
	valid, problems, unknown := checkSigs(manifest, sigs, byID)
	if len(valid) >= threshold {
		return nil
	}
	msg := fmt.Sprintf("release has %d valid signature(s) from trusted keys, threshold is %d", len(valid), threshold)
	if len(problems) > 0 {
		msg += "; " + strings.Join(problems, "; ")
	}
	if len(unknown) > 0 {
		slices.Sort(unknown)
		msg += "; signed by untrusted key(s) " + strings.Join(unknown, ", ")
	}
	return errors.New(msg)
}

// ValidSigners lists the IDs of the keys in trusted whose signature on
// manifest verifies, sorted. The store records them per accepted
// generation: its anti-rollback counter counts only what keys still
// trusted signed.
func ValidSigners(manifest []byte, sigs *Signatures, trusted []*PublicKey) []string {
	byID := map[string]*PublicKey{}
	for _, k := range trusted {
		byID[k.ID] = k
	}
	valid, _, _ := checkSigs(manifest, sigs, byID)
	ids := make([]string, 0, len(valid))
	for id := range valid {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	return ids
}

// checkSigs verifies each signature by a key of byID; a key counts once.
func checkSigs(manifest []byte, sigs *Signatures, byID map[string]*PublicKey) (valid map[string]bool, problems, unknown []string) {
	valid = map[string]bool{}
	if sigs == nil {
		return valid, nil, nil
	}
	for _, s := range sigs.Signatures {
		k, ok := byID[s.KeyID]
		if !ok {
			unknown = append(unknown, short(s.KeyID))
			continue
		}
		if valid[k.ID] {
			continue // a key counts once however often it signed
		}
		if err := k.v.VerifySignature(bytes.NewReader(s.Sig), bytes.NewReader(manifest)); err != nil {
			problems = append(problems, fmt.Sprintf("key %s: bad signature", short(k.ID)))
			continue
		}
		valid[k.ID] = true
	}
	return valid, problems, unknown
}

func short(id string) string {
	if len(id) > 16 {
		return id[:16]
	}
	return id
}
