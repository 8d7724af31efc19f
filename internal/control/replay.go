package control

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"github.com/nixcage/nixcage/internal/release"
)

// MaxCacheEntries bounds the replay cache. Entries leave when their command
// expires (plus ClockSkew), at most MaxLifetime after issue; a host would
// need more than this many distinct valid commands within a day to fill it,
// and then it refuses new ones (rejected, "replay cache full") rather than
// forget old ones, which would make them replayable.
const MaxCacheEntries = 10000

// Entry is one command the host has claimed.
type Entry struct {
	SHA256  string    `json:"sha256"`
	Nonce   string    `json:"nonce"`
	Expires time.Time `json:"expires"`
	Claimed time.Time `json:"claimed"`
}

type cacheDoc struct {
	Schema  int     `json:"schema"`
	Entries []Entry `json:"entries"`
}

// Cache is the replay cache: every command claimed and not yet expired,
// kept in one file rewritten atomically (temporary file, fsync, rename,
// directory fsync) on every claim, so it survives caged restarts, crashes
// and reboots.
type Cache struct {
	path string
	mu   sync.Mutex
}

// OpenCache uses the cache file at path; its directory is created (0700).
func OpenCache(path string) (*Cache, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return nil, fmt.Errorf("replay cache: %w", err)
	}
	return &Cache{path: path}, nil
}

// load reads the file. A file that does not parse is an error, never an
// empty cache: forgetting would make every command in it replayable.
func (c *Cache) load() ([]Entry, error) {
	b, err := os.ReadFile(c.path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("replay cache: %w", err)
	}
	var d cacheDoc
	if err := release.DecodeStrict(b, &d, "replay cache"); err != nil || d.Schema != Schema {
		return nil, fmt.Errorf("replay cache %s is unreadable (%v): no command is executed until it is repaired or, knowing every command in it has expired, removed", c.path, err)
	}
	return d.Entries, nil
}

// Claim records the command as seen before it is executed (at most once:
// a crash after the claim leaves it claimed, not executed twice). It
// returns a duplicate refusal when the hash or the nonce is already there,
// and drops entries whose command expired more than ClockSkew ago.
func (c *Cache) Claim(hash, nonce string, expires, now time.Time) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	entries, err := c.load()
	if err != nil {
		return reject("%v", err)
	}
	entries = slices.DeleteFunc(entries, func(e Entry) bool { return !now.Before(e.Expires.Add(ClockSkew)) })
	for _, e := range entries {
		if e.SHA256 == hash || e.Nonce == nonce {
			what := "this command"
			if e.SHA256 != hash {
				what = "a command with the same nonce"
			}
			return &Refusal{Status: StatusDuplicate, Reason: fmt.Sprintf("replay: %s was already executed here at %s (command %s)", what, e.Claimed.UTC().Format(time.RFC3339), short(e.SHA256))}
		}
	}
	if len(entries) >= MaxCacheEntries {
		return reject("replay cache full (%d unexpired commands): refusing rather than forgetting", len(entries))
	}
	entries = append(entries, Entry{SHA256: hash, Nonce: nonce, Expires: expires.UTC(), Claimed: now.UTC()})
	if err := c.write(entries); err != nil {
		return reject("replay cache: %v", err)
	}
	return nil
}

// Entries returns the unexpired entries at now.
func (c *Cache) Entries(now time.Time) ([]Entry, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	entries, err := c.load()
	if err != nil {
		return nil, err
	}
	return slices.DeleteFunc(entries, func(e Entry) bool { return !now.Before(e.Expires.Add(ClockSkew)) }), nil
}

func (c *Cache) write(entries []Entry) error {
	if entries == nil {
		entries = []Entry{}
	}
	b, err := json.MarshalIndent(cacheDoc{Schema: Schema, Entries: entries}, "", "  ")
	if err != nil {
		return err
	}
	return release.WriteFileAtomic(c.path, append(b, '\n'), 0o600)
}
