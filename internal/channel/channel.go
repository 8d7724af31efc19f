// Package channel is the pulled release channel: a directory tree on any
// static HTTP(S) server that caged polls for newer signed releases and for
// a feed of control commands (docs/fleet.md "Channels"). It knows the
// layout (this file), fetches with hard limits on size and time
// (client.go), schedules polls with backoff and jitter (schedule.go) and
// lays a channel out from a release directory (publish.go).
//
// Nothing here is trusted: the index only says where the newest release
// is. Trust comes from the release's signatures, checked by package store
// exactly as for `cagectl apply`, and from the control commands' own
// signatures, checked by their consumer.
package channel

import (
	"bytes"
	"encoding/json"
	"fmt"
	"path"
	"regexp"
	"strings"

	"github.com/nixcage/nixcage/internal/release"
)

// Names in a channel (docs/fleet.md "Layout").
const (
	// IndexFile names the newest release; it is the only file a publisher
	// ever replaces, and it replaces it last, atomically.
	IndexFile = "channel.json"
	// ReleasesDir holds releases/<generation>/release.json and .sig.
	ReleasesDir = "releases"
	// ControlsDir holds the control feed: index.json and the commands.
	ControlsDir = "controls"
	// ControlIndexFile is the feed's index inside ControlsDir.
	ControlIndexFile = "index.json"
)

// Limits on what a channel server may make caged read. The release's own
// files keep the limits of package release (manifest 16 MiB, narinfo 1 MiB,
// NARs their signed size).
const (
	MaxIndexSize        = 64 << 10
	MaxControlIndexSize = 64 << 10
	MaxControlSize      = 64 << 10
	MaxControls         = 256
)

// Index is channel.json.
type Index struct {
	Schema     int    `json:"schema"`
	Channel    string `json:"channel"`
	Generation uint64 `json:"generation"`
	// Release is the directory (relative to the channel) holding
	// release.json and release.json.sig.
	Release string `json:"release"`
}

// ParseIndex parses channel.json strictly.
func ParseIndex(data []byte) (*Index, error) {
	var ix Index
	if err := decodeStrict(data, &ix); err != nil {
		return nil, fmt.Errorf("%s: %w", IndexFile, err)
	}
	if ix.Schema != 1 {
		return nil, fmt.Errorf("%s: schema %d is not supported (want 1): upgrade nixcage or republish the channel", IndexFile, ix.Schema)
	}
	if !release.ValidChannel(ix.Channel) {
		return nil, fmt.Errorf("%s: channel %q is not a channel name", IndexFile, ix.Channel)
	}
	if ix.Generation == 0 {
		return nil, fmt.Errorf("%s: generation is missing or 0", IndexFile)
	}
	if err := cleanRel(ix.Release); err != nil {
		return nil, fmt.Errorf("%s: release %q: %w", IndexFile, ix.Release, err)
	}
	return &ix, nil
}

// Marshal is the index as a publisher writes it.
func (ix *Index) Marshal() ([]byte, error) {
	b, err := json.MarshalIndent(ix, "", "  ")
	if err != nil {
		return nil, err
	}
	return append(b, '\n'), nil
}

// ReleaseDir is where a publisher puts generation n's manifest.
func ReleaseDir(n uint64) string { return fmt.Sprintf("%s/%d", ReleasesDir, n) }

// ControlIndex is controls/index.json.
type ControlIndex struct {
	Schema   int      `json:"schema"`
	Commands []string `json:"commands"`
}

// Control is one command file of the feed, as fetched: unverified bytes.
type Control struct {
	Name string // its name in controls/
	Data []byte
}

var controlNameRe = regexp.MustCompile(`^[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}$`)

// ParseControlIndex parses controls/index.json strictly.
func ParseControlIndex(data []byte) (*ControlIndex, error) {
	var ci ControlIndex
	where := ControlsDir + "/" + ControlIndexFile
	if err := decodeStrict(data, &ci); err != nil {
		return nil, fmt.Errorf("%s: %w", where, err)
	}
	if ci.Schema != 1 {
		return nil, fmt.Errorf("%s: schema %d is not supported (want 1)", where, ci.Schema)
	}
	if len(ci.Commands) > MaxControls {
		return nil, fmt.Errorf("%s lists %d commands, more than the %d allowed: drop expired ones", where, len(ci.Commands), MaxControls)
	}
	seen := map[string]bool{}
	for _, n := range ci.Commands {
		if !controlNameRe.MatchString(n) {
			return nil, fmt.Errorf("%s: command name %q is not 1-128 of A-Z a-z 0-9 . _ - (not starting with .)", where, n)
		}
		if seen[n] {
			return nil, fmt.Errorf("%s lists %q twice", where, n)
		}
		seen[n] = true
	}
	return &ci, nil
}

func decodeStrict(data []byte, v any) error {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return err
	}
	if dec.More() {
		return fmt.Errorf("trailing data after the JSON object")
	}
	return nil
}

// cleanRel accepts a clean relative slash path that stays inside the
// channel.
func cleanRel(p string) error {
	if p == "" || path.IsAbs(p) || path.Clean(p) != p || p == "." || p == ".." || strings.HasPrefix(p, "../") || strings.ContainsAny(p, "\\\x00?#") {
		return fmt.Errorf("not a clean relative path inside the channel")
	}
	return nil
}
