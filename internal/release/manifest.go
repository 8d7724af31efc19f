// Package release reads, writes, signs and verifies nixcage releases: a Nix
// binary cache directory (as `nix copy --to file://DIR` writes it) plus a
// signed manifest, release.json, that binds a channel, a strictly increasing
// generation, a validity window and every closure member's NAR hash and size.
//
// Trust flows only from the manifest's signatures: narinfo files and NARs are
// untrusted input that must agree with the manifest byte for byte, so a cache
// can be served from anywhere (a directory, plain HTTP) without weakening the
// guarantees. The package never writes into a store; internal/store does.
package release

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"regexp"
	"slices"
	"strings"
	"time"

	"github.com/nix-community/go-nix/pkg/nixhash"
	"github.com/nix-community/go-nix/pkg/storepath"
)

// File names inside a release directory.
const (
	ManifestFile   = "release.json"
	SignaturesFile = "release.json.sig"
	CacheInfoFile  = "nix-cache-info"
)

// Schema is the manifest schema this package writes and accepts.
const Schema = 1

// Limits on untrusted metadata, so a hostile source cannot make us read
// without end before anything is verified.
const (
	MaxManifestSize   = 16 << 20
	MaxSignaturesSize = 64 << 10
	MaxNarinfoSize    = 1 << 20
	MaxCacheInfoSize  = 4 << 10
	maxSignatures     = 32
)

// Manifest is release.json. Paths are sorted by Path and unique; every
// reference names a member of Paths, so the closure is complete.
type Manifest struct {
	Schema     int        `json:"schema"`
	Channel    string     `json:"channel"`
	Generation uint64     `json:"generation"`
	Created    time.Time  `json:"created"`
	Expires    time.Time  `json:"expires"`
	Top        string     `json:"top"`
	Paths      []PathInfo `json:"paths"`
}

// PathInfo is one closure member: what its NAR must hash to.
type PathInfo struct {
	Path       string   `json:"path"`    // absolute, /nix/store/<hash>-<name>
	NarHash    string   `json:"narHash"` // sha256:<nixbase32>
	NarSize    uint64   `json:"narSize"`
	References []string `json:"references"` // absolute store paths, sorted
}

// Name is the store path without the /nix/store/ prefix.
func (p PathInfo) Name() string { return strings.TrimPrefix(p.Path, storepath.StoreDir+"/") }

// HashPart is the 32-character hash part, which names the narinfo file.
func (p PathInfo) HashPart() string { return p.Name()[:32] }

// Digest returns the raw sha256 digest of NarHash.
func (p PathInfo) Digest() ([]byte, error) { return parseNarHash(p.NarHash) }

var channelRe = regexp.MustCompile(`^[a-z0-9][a-z0-9._-]{0,63}$`)

// ValidChannel reports whether s is a usable channel name.
func ValidChannel(s string) bool { return channelRe.MatchString(s) }

// ParseManifest decodes release.json strictly (unknown fields are errors) and
// checks its structure. It does not check signatures or freshness.
func ParseManifest(data []byte) (*Manifest, error) {
	if len(data) > MaxManifestSize {
		return nil, fmt.Errorf("manifest is %d bytes, more than the %d allowed", len(data), MaxManifestSize)
	}
	var m Manifest
	if err := DecodeStrict(data, &m, "manifest"); err != nil {
		return nil, err
	}
	if err := m.Validate(); err != nil {
		return nil, err
	}
	return &m, nil
}

// DecodeStrict decodes one JSON object, refusing unknown fields and
// trailing data: every signed document of a release is read this way.
func DecodeStrict(data []byte, v any, what string) error {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return fmt.Errorf("decode %s: %w", what, err)
	}
	if _, err := dec.Token(); !errors.Is(err, io.EOF) {
		return fmt.Errorf("decode %s: trailing data after the JSON object", what)
	}
	return nil
}

// Marshal renders the manifest canonically (the bytes that get signed).
func (m *Manifest) Marshal() ([]byte, error) {
	b, err := json.MarshalIndent(m, "", "  ")
	if err != nil {
		return nil, err
	}
	return append(b, '\n'), nil
}

// Validate checks the manifest's structure: schema, names, times, sort order
// and closure completeness.
func (m *Manifest) Validate() error {
	if m.Schema != Schema {
		return fmt.Errorf("manifest schema %d is not supported (this build reads schema %d); upgrade cagectl/caged", m.Schema, Schema)
	}
	if !ValidChannel(m.Channel) {
		return fmt.Errorf("manifest channel %q is invalid: use lowercase letters, digits, '.', '_' or '-'", m.Channel)
	}
	if m.Generation == 0 {
		return errors.New("manifest generation must be at least 1")
	}
	if m.Created.IsZero() || m.Expires.IsZero() {
		return errors.New("manifest needs both created and expires")
	}
	if !m.Expires.After(m.Created) {
		return fmt.Errorf("manifest expires (%s) is not after created (%s)", m.Expires.Format(time.RFC3339), m.Created.Format(time.RFC3339))
	}
	if len(m.Paths) == 0 {
		return errors.New("manifest lists no store paths")
	}
	present := make(map[string]bool, len(m.Paths))
	for i, p := range m.Paths {
		if err := storepath.Validate(p.Path); err != nil {
			return fmt.Errorf("manifest path %q: %w", p.Path, err)
		}
		if i > 0 && m.Paths[i-1].Path >= p.Path {
			return fmt.Errorf("manifest paths are not sorted and unique at %q", p.Path)
		}
		if _, err := parseNarHash(p.NarHash); err != nil {
			return fmt.Errorf("manifest path %s: %w", p.Path, err)
		}
		if p.NarSize == 0 {
			return fmt.Errorf("manifest path %s: narSize is 0", p.Path)
		}
		if !slices.IsSorted(p.References) {
			return fmt.Errorf("manifest path %s: references are not sorted", p.Path)
		}
		present[p.Path] = true
	}
	if !present[m.Top] {
		return fmt.Errorf("manifest top %q is not among its paths", m.Top)
	}
	for _, p := range m.Paths {
		for _, r := range p.References {
			if !present[r] {
				return fmt.Errorf("closure incomplete: %s references %s, which the manifest does not list", p.Path, r)
			}
		}
	}
	return nil
}

// Lookup returns the entry for an absolute store path.
func (m *Manifest) Lookup(path string) (PathInfo, bool) {
	i, ok := slices.BinarySearchFunc(m.Paths, path, func(p PathInfo, t string) int { return strings.Compare(p.Path, t) })
	if !ok {
		return PathInfo{}, false
	}
	return m.Paths[i], true
}

// parseNarHash accepts only sha256 NAR hashes, as Nix writes them.
func parseNarHash(s string) ([]byte, error) {
	h, err := nixhash.ParseAny(s, nil)
	if err != nil {
		return nil, fmt.Errorf("narHash %q: %w", s, err)
	}
	if h.Algo() != nixhash.SHA256 {
		return nil, fmt.Errorf("narHash %q: only sha256 is accepted", s)
	}
	return h.Digest(), nil
}

// formatNarHash renders a sha256 digest as Nix does in narinfo files.
func formatNarHash(d []byte) string {
	return nixhash.MustNewHashWithEncoding(nixhash.SHA256, d, nixhash.NixBase32, true).String()
}
