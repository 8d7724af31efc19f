// Package store is the shared read-only Nix store that caged owns and cages
// bind-mount at /nix/store: applying signed releases into it, switching
// generations atomically, rolling back, verifying what is live and
// collecting garbage. cagectl --offline and caged call the same functions.
//
// Layout under Root (see docs/store.md):
//
//	nix/store/<hash>-<name>   unpacked paths, read-only (0444/0555)
//	generations/<N>/          release.json, release.json.sig, top -> ../../nix/store/<top>
//	current -> generations/<N>
//	state.json                highest generation ever accepted (anti-rollback)
//	lock                      flock: one writer at a time
//	tmp-*                     work in progress; removed at the next start
//
// Crash invariant: every step either leaves current pointing at a complete,
// verified generation or is a rename that makes it point at the next one.
// Nothing reachable from current is ever written in place.
package store

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	nixsig "github.com/nix-community/go-nix/pkg/narinfo/signature"

	"github.com/nixcage/nixcage/internal/paths"
	"github.com/nixcage/nixcage/internal/release"
)

// Options configure a store. They mirror the config block
// `store { root, channel, keys, nix_keys, threshold, generations }`.
type Options struct {
	Root          string               // default paths.DefaultStoreRoot
	Channel       string               // required for Apply
	TrustedKeys   []string             // PEM public key files
	Keys          []*release.PublicKey // already parsed keys, added to TrustedKeys
	NixPublicKeys []string             // "name:base64"; when set every narinfo must be signed
	Threshold     int                  // distinct trusted keys that must sign; default 1
	// Root keys sign key rotations (keys/<version>.json): RootKeyFiles are
	// PEM files (store.root_keys), RootKeys already parsed; RootThreshold
	// distinct ones must sign (store.root_threshold, default 1). Without
	// root keys the trusted release keys are only the configured ones.
	RootKeyFiles  []string
	RootKeys      []*release.PublicKey
	RootThreshold int
	Keep          int // generations kept (current included); default 3
	Workers       int // parallel NAR unpackers; default max(2, GOMAXPROCS)
	// ExpiryWarning is how long before its release expires the current
	// generation is reported as expiring (store.expiry_warning; its default
	// is config.DefaultExpiryWarning). Zero reports only expired.
	ExpiryWarning time.Duration
	Now           func() time.Time
	Logger        *slog.Logger
	Progress      func(Progress) // called from one goroutine at a time
	// ReadOnly opens an existing store without creating anything (for
	// generations and verify, which must not leave a root behind).
	ReadOnly bool
}

// Progress reports an apply's advance.
type Progress struct {
	Phase      string // "verify", "unpack", "switch"
	Done       int
	Total      int
	Bytes      int64 // NAR bytes processed
	TotalBytes int64
}

// Store is an opened store root.
type Store struct {
	opts     Options
	root     string
	keys     []*release.PublicKey
	rootKeys []*release.PublicKey
	nixKeys  []nixsig.PublicKey
	log      *slog.Logger
}

const (
	stateFile   = "state.json"
	lockFile    = "lock"
	currentLink = "current"
	genDir      = "generations"
	topLink     = "top"
	tmpPrefix   = "tmp-"
)

// Open checks opts and creates the store's directories if missing.
func Open(opts Options) (*Store, error) {
	if opts.Root == "" {
		opts.Root = paths.DefaultStoreRoot
	}
	root, err := filepath.Abs(opts.Root)
	if err != nil {
		return nil, err
	}
	if opts.Keep == 0 {
		opts.Keep = 3
	}
	if opts.Keep < 1 {
		return nil, fmt.Errorf("store generations %d is invalid: keep at least 1", opts.Keep)
	}
	if opts.Threshold == 0 {
		opts.Threshold = 1
	}
	if opts.RootThreshold == 0 {
		opts.RootThreshold = 1
	}
	if opts.Workers <= 0 {
		opts.Workers = max(2, runtime.GOMAXPROCS(0))
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	s := &Store{opts: opts, root: root, log: opts.Logger}
	if s.log == nil {
		s.log = slog.New(slog.DiscardHandler)
	}
	keys, err := release.LoadPublicKeys(opts.TrustedKeys)
	if err != nil {
		return nil, err
	}
	s.keys = append(keys, opts.Keys...)
	rootKeys, err := release.LoadPublicKeys(opts.RootKeyFiles)
	if err != nil {
		return nil, err
	}
	s.rootKeys = append(rootKeys, opts.RootKeys...)
	s.nixKeys, err = release.ParseNixKeys(opts.NixPublicKeys)
	if err != nil {
		return nil, err
	}
	if opts.ReadOnly {
		if _, err := os.Stat(filepath.Join(root, genDir)); err != nil {
			return nil, fmt.Errorf("no store at %s (%w): apply a release first or pass --store", root, err)
		}
		return s, nil
	}
	// 0755 whatever the umask (caged runs with 0077): a service cage
	// walks from the store root to its tools inside the cage, as its own
	// unprivileged user (docs/store.md, "Bind sources never leave the
	// store"); what it must not read is closed by its own mode (lock,
	// tmp-*).
	for _, d := range []string{root, filepath.Join(root, "nix"), s.storeDir(), filepath.Join(root, genDir)} {
		if err := os.Mkdir(d, 0o755); err != nil && !errors.Is(err, fs.ErrExist) {
			return nil, fmt.Errorf("create store layout: %w", err)
		}
		if err := os.Chmod(d, 0o755); err != nil {
			return nil, fmt.Errorf("create store layout: %w", err)
		}
	}
	return s, nil
}

// Root is the store's root directory.
func (s *Store) Root() string { return s.root }

func (s *Store) storeDir() string { return filepath.Join(s.root, "nix", "store") }

func (s *Store) genPath(n uint64) string {
	return filepath.Join(s.root, genDir, strconv.FormatUint(n, 10))
}

// lock takes the store's writer lock or fails at once: concurrent applies
// are refused rather than queued, so an operator sees the conflict.
func (s *Store) lock() (func(), error) {
	f, err := os.OpenFile(filepath.Join(s.root, lockFile), os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open store lock: %w", err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, syscall.EWOULDBLOCK) {
			return nil, fmt.Errorf("store %s is busy: another apply, rollback or gc holds %s; retry when it has finished", s.root, lockFile)
		}
		return nil, fmt.Errorf("lock store: %w", err)
	}
	return func() { f.Close() }, nil
}

// state is state.json.
type state struct {
	Schema  int       `json:"schema"`
	Highest uint64    `json:"highest"` // highest generation ever accepted
	Updated time.Time `json:"updated"`
	// SignedBy is, per release key ID, the highest accepted generation
	// that key validly signed. The anti-rollback counter is taken over
	// the keys trusted now (counter), so a key rotated out takes the
	// generations it alone signed with it. Nil in a schema 1 state (written
	// before per-key records): see migrate.
	SignedBy map[string]uint64 `json:"signed_by,omitempty"`
}

// stateSchema 2 added SignedBy.
const stateSchema = 2

func (s *Store) readState() (state, error) {
	var st state
	b, err := os.ReadFile(filepath.Join(s.root, stateFile))
	if errors.Is(err, fs.ErrNotExist) {
		return state{Schema: stateSchema, SignedBy: map[string]uint64{}}, nil
	}
	if err != nil {
		return st, fmt.Errorf("read store state: %w", err)
	}
	if err := json.Unmarshal(b, &st); err != nil {
		return st, fmt.Errorf("store state %s is corrupt: %w; restore it from the highest generations/N", filepath.Join(s.root, stateFile), err)
	}
	if st.Schema >= stateSchema && st.SignedBy == nil {
		st.SignedBy = map[string]uint64{}
	}
	return st, nil
}

// migrate gives a schema 1 state (one counter, no record of who signed
// what) per-key records: its counter is attributed to every release key
// of trust, the key set in force before this apply's rotations, i.e. the
// keys that accepted those generations. A later rotation that drops them
// then frees the counter just as it does for a schema 2 state.
func migrate(st state, cur uint64, trust *release.Trust) state {
	if st.SignedBy != nil {
		return st
	}
	st.SignedBy = map[string]uint64{}
	if h := max(st.Highest, cur); h > 0 {
		for _, k := range trust.ReleaseKeys {
			st.SignedBy[k.ID] = h
		}
	}
	return st
}

// counter is the anti-rollback counter under trust: a release must be
// above it. It is the highest generation that a key trusted now signed
// (state.json's SignedBy, which outlives pruned generations), the current
// generation if trust vouches for it, and the key set's GenerationFloor.
// Generations signed only by revoked keys do not count: otherwise a
// compromised key's generation 2^64-1 would stay in force after the root
// revoked it, and no release could ever be newer (TUF's fast-forward
// attack, recovered in TUF by resetting the counters of rotated roles).
func (s *Store) counter(st state, cur uint64, trust *release.Trust) uint64 {
	c := trust.GenerationFloor
	for _, k := range trust.ReleaseKeys {
		c = max(c, st.SignedBy[k.ID])
	}
	if cur > c && s.vouchedFor(cur, trust) == nil {
		c = cur
	}
	return c
}

func (s *Store) writeState(st state) error {
	st.Schema = stateSchema
	if st.SignedBy == nil {
		st.Schema = 1 // not migrated yet: only Apply knows whose it was
	}
	st.Updated = s.opts.Now().UTC()
	b, err := json.MarshalIndent(st, "", "  ")
	if err != nil {
		return err
	}
	return release.WriteFileAtomic(filepath.Join(s.root, stateFile), append(b, '\n'), 0o644)
}

// Current returns the active generation, 0 if none.
func (s *Store) Current() (uint64, error) {
	t, err := os.Readlink(filepath.Join(s.root, currentLink))
	if errors.Is(err, fs.ErrNotExist) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("read current generation: %w", err)
	}
	n, err := strconv.ParseUint(strings.TrimPrefix(t, genDir+"/"), 10, 64)
	if err != nil || !strings.HasPrefix(t, genDir+"/") {
		return 0, fmt.Errorf("current points at %q, not generations/N", t)
	}
	return n, nil
}

// generations lists kept generation numbers in ascending order.
func (s *Store) generations() ([]uint64, error) {
	ents, err := os.ReadDir(filepath.Join(s.root, genDir))
	if err != nil {
		return nil, fmt.Errorf("list generations: %w", err)
	}
	var out []uint64
	for _, e := range ents {
		if n, err := strconv.ParseUint(e.Name(), 10, 64); err == nil && e.IsDir() {
			out = append(out, n)
		}
	}
	slices.Sort(out)
	return out, nil
}

// manifest reads a kept generation's manifest. It was verified when the
// generation was accepted and lives in root-owned storage, so it is not
// re-verified here (Verify does that).
func (s *Store) manifest(n uint64) (*release.Manifest, error) {
	b, err := os.ReadFile(filepath.Join(s.genPath(n), release.ManifestFile))
	if err != nil {
		return nil, fmt.Errorf("generation %d: %w", n, err)
	}
	m, err := release.ParseManifest(b)
	if err != nil {
		return nil, fmt.Errorf("generation %d: %w", n, err)
	}
	return m, nil
}

// Generation describes one kept generation.
type Generation struct {
	Number  uint64    `json:"generation"`
	Channel string    `json:"channel"`
	Created time.Time `json:"created"`
	Expires time.Time `json:"expires"`
	Top     string    `json:"top"`
	Paths   int       `json:"paths"`
	Current bool      `json:"current"`
}

// Generations lists the kept generations, oldest first.
func (s *Store) Generations() ([]Generation, error) {
	cur, err := s.Current()
	if err != nil {
		return nil, err
	}
	ns, err := s.generations()
	if err != nil {
		return nil, err
	}
	var out []Generation
	for _, n := range ns {
		m, err := s.manifest(n)
		if err != nil {
			return nil, err
		}
		out = append(out, Generation{Number: n, Channel: m.Channel, Created: m.Created, Expires: m.Expires,
			Top: m.Top, Paths: len(m.Paths), Current: n == cur})
	}
	return out, nil
}

// Highest is the highest generation ever accepted, whoever signed it
// (Apply compares against counter, which counts only trusted keys).
func (s *Store) Highest() (uint64, error) {
	st, err := s.readState()
	if err != nil {
		return 0, err
	}
	cur, err := s.Current()
	if err != nil {
		return 0, err
	}
	return max(st.Highest, cur), nil
}

// removeAll deletes a tree that may be read-only.
func removeAll(p string) error {
	err := os.RemoveAll(p)
	if err == nil {
		return nil
	}
	_ = filepath.WalkDir(p, func(q string, d fs.DirEntry, err error) error {
		if err == nil && d.IsDir() {
			_ = os.Chmod(q, 0o755)
		}
		return nil
	})
	return os.RemoveAll(p)
}

// removeGeneration renames generations/N out of the way before deleting
// it, so a crash mid-delete never leaves a half-empty generations/N that
// looks kept; the renamed leftover is a tmp-* that recovery removes.
func (s *Store) removeGeneration(n uint64) error {
	trash := filepath.Join(s.root, genDir, tmpPrefix+"del-"+strconv.FormatUint(n, 10))
	if err := os.Rename(s.genPath(n), trash); err != nil {
		return err
	}
	if err := release.SyncDir(filepath.Join(s.root, genDir)); err != nil {
		return err
	}
	return removeAll(trash)
}

// recoverLocked brings the store back to a consistent state after a crash.
// Called with the lock held, before any change.
//
//   - tmp-* directories are work of an interrupted apply or gc: removed;
//   - current newer than state.json means the crash hit between the switch
//     and the state write: the switch happened, so record it;
//   - generation directories newer than the recorded highest were never
//     switched to: removed, so they cannot be mistaken for accepted ones.
func (s *Store) recoverLocked() error {
	for _, dir := range []string{s.root, filepath.Join(s.root, genDir), s.storeDir()} {
		ents, err := os.ReadDir(dir)
		if err != nil {
			return fmt.Errorf("recover: %w", err)
		}
		for _, e := range ents {
			if strings.HasPrefix(e.Name(), tmpPrefix) || strings.HasPrefix(e.Name(), ".tmp-") {
				if err := removeAll(filepath.Join(dir, e.Name())); err != nil {
					return fmt.Errorf("recover: remove %s: %w", e.Name(), err)
				}
			}
		}
	}
	st, err := s.readState()
	if err != nil {
		return err
	}
	cur, err := s.Current()
	if err != nil {
		return err
	}
	if cur > st.Highest {
		s.log.Info("store: recording generation switched before a crash", "generation", cur)
		// Only a cache (Highest and counter derive it from current too):
		// a full disk here must not stop the store from working.
		st.Highest = cur
		if err := s.recordHighest(cur); err != nil {
			s.log.Warn("store: could not record the current generation", "generation", cur, "err", err)
		}
	}
	ns, err := s.generations()
	if err != nil {
		return err
	}
	for _, n := range ns {
		if n > st.Highest {
			s.log.Info("store: removing generation never switched to", "generation", n)
			if err := s.removeGeneration(n); err != nil {
				return fmt.Errorf("recover: %w", err)
			}
		}
	}
	return nil
}

// switchCurrent points current at generation n with a rename, the only
// atomic way to replace a symlink. committed reports whether the rename
// happened: an error with committed set is a failed sync of the root after
// it, and generation n is current all the same.
func (s *Store) switchCurrent(n uint64) (committed bool, _ error) {
	tmp := filepath.Join(s.root, ".tmp-current")
	_ = os.Remove(tmp)
	if err := os.Symlink(genDir+"/"+strconv.FormatUint(n, 10), tmp); err != nil {
		return false, fmt.Errorf("switch generation: %w", err)
	}
	if err := os.Rename(tmp, filepath.Join(s.root, currentLink)); err != nil {
		_ = os.Remove(tmp)
		return false, fmt.Errorf("switch generation: %w", err)
	}
	return true, release.SyncDir(s.root)
}

// pruneLocked removes generations beyond Keep (never current) and then
// every store path no kept generation references.
func (s *Store) pruneLocked() (removedGens []uint64, removedPaths []string, err error) {
	cur, err := s.Current()
	if err != nil {
		return nil, nil, err
	}
	ns, err := s.generations()
	if err != nil {
		return nil, nil, err
	}
	keep := map[uint64]bool{}
	if cur != 0 {
		keep[cur] = true
	}
	// Generations above current that the trusted key set does not vouch
	// for are a revoked key's (a rotation let a lower generation follow
	// them): dropped, so they take no keep slot and cannot be rolled to.
	trust, terr := s.Trust()
	revoked := func(n uint64) bool {
		return n > cur && cur != 0 && terr == nil && len(trust.ReleaseKeys) > 0 && s.vouchedFor(n, trust) != nil
	}
	for i := len(ns) - 1; i >= 0 && len(keep) < s.opts.Keep; i-- {
		if !revoked(ns[i]) {
			keep[ns[i]] = true
		}
	}
	live := map[string]bool{}
	for _, n := range ns {
		if !keep[n] {
			continue
		}
		m, err := s.manifest(n)
		if err != nil {
			return nil, nil, err
		}
		for _, p := range m.Paths {
			live[p.Name()] = true
		}
	}
	for _, n := range ns {
		if keep[n] {
			continue
		}
		crashPoint("prune-generation")
		if err := s.removeGeneration(n); err != nil {
			return removedGens, nil, fmt.Errorf("prune generation %d: %w", n, err)
		}
		removedGens = append(removedGens, n)
	}
	ents, err := os.ReadDir(s.storeDir())
	if err != nil {
		return removedGens, nil, err
	}
	for _, e := range ents {
		if live[e.Name()] || strings.HasPrefix(e.Name(), tmpPrefix) {
			continue
		}
		// Move out of nix/store first: a path is either complete or gone,
		// never half-deleted under its real name.
		tmp := filepath.Join(s.root, tmpPrefix+"gc-"+e.Name())
		if err := renameDir(filepath.Join(s.storeDir(), e.Name()), tmp); err != nil {
			return removedGens, removedPaths, fmt.Errorf("gc %s: %w", e.Name(), err)
		}
		crashPoint("gc-path")
		if err := removeAll(tmp); err != nil {
			return removedGens, removedPaths, fmt.Errorf("gc %s: %w", e.Name(), err)
		}
		removedPaths = append(removedPaths, e.Name())
	}
	if len(removedPaths) > 0 {
		if err := release.SyncDir(s.storeDir()); err != nil {
			return removedGens, removedPaths, err
		}
	}
	return removedGens, removedPaths, nil
}

// GC removes generations beyond Keep and store paths that no kept
// generation references.
func (s *Store) GC(ctx context.Context) (gens []uint64, removed []string, err error) {
	unlock, err := s.lock()
	if err != nil {
		return nil, nil, err
	}
	defer unlock()
	if err := s.recoverLocked(); err != nil {
		return nil, nil, err
	}
	gens, removed, err = s.pruneLocked()
	if err == nil {
		s.log.Info("store: gc", "generations_removed", len(gens), "paths_removed", len(removed))
	}
	return gens, removed, err
}

// Recover runs crash recovery alone (caged does it at start).
func (s *Store) Recover() error {
	unlock, err := s.lock()
	if err != nil {
		return err
	}
	defer unlock()
	return s.recoverLocked()
}

// Rollback switches current to an older kept generation (the newest one
// below current when to is 0). It is an explicit operator action: it is
// logged, and it does not lower the anti-rollback counter, so releases
// must still be newer than the highest generation ever accepted.
//
// The target must be vouched for by the current key set: signed by a
// threshold of the release keys trusted now. A generation signed only by a
// key since revoked is refused unless force is set; a forced rollback is
// logged as such (store: FORCED rollback ...), with the key set version.
func (s *Store) Rollback(ctx context.Context, to uint64, force bool) (from uint64, _ uint64, err error) {
	unlock, err := s.lock()
	if err != nil {
		return 0, 0, err
	}
	defer unlock()
	if err := s.recoverLocked(); err != nil {
		return 0, 0, storageFailure("recover", err)
	}
	from, err = s.Current()
	if err != nil {
		return 0, 0, err
	}
	ns, err := s.generations()
	if err != nil {
		return 0, 0, err
	}
	if to == 0 {
		for _, n := range ns {
			if n < from {
				to = n
			}
		}
		if to == 0 {
			return from, 0, fmt.Errorf("no generation older than %d is kept; `cagectl generations` lists what is", from)
		}
	}
	if !slices.Contains(ns, to) {
		return from, 0, fmt.Errorf("generation %d is not kept; `cagectl generations` lists what is", to)
	}
	if to == from {
		return from, to, fmt.Errorf("generation %d is already current", to)
	}
	m, err := s.manifest(to)
	if err != nil {
		return from, 0, err
	}
	trust, err := s.Trust()
	if err != nil {
		return from, 0, err
	}
	vouch := s.vouchedFor(to, trust)
	if vouch != nil && len(trust.ReleaseKeys) == 0 {
		vouch = errors.New("no trusted release keys are configured to check it against (store.keys / --key)")
	}
	if vouch != nil && !force {
		return from, 0, fmt.Errorf("rollback refused: generation %d is not vouched for by the current key set (version %d): %v; `cagectl rollback --to %d --force` switches anyway and is logged as forced", to, trust.Version, vouch, to)
	}
	for _, p := range m.Paths {
		if _, err := os.Lstat(filepath.Join(s.storeDir(), p.Name())); err != nil {
			return from, 0, fmt.Errorf("generation %d is incomplete (%s missing); run `cagectl store verify`", to, p.Name())
		}
	}
	// Lowering current must not lower the counter, which Highest derives
	// from current too: record it first, or do not switch.
	if err := s.recordHighest(from); err != nil {
		return from, 0, storageFailure("record generation before rollback", err)
	}
	if committed, err := s.switchCurrent(to); !committed {
		return from, 0, storageFailure("switch current", err)
	} else if err != nil {
		s.log.Warn("store: rollback switched, but syncing the store root failed", "err", err)
	}
	if vouch != nil {
		s.log.Warn("store: FORCED rollback to a generation the current key set does not vouch for",
			"from", from, "to", to, "key_set_version", trust.Version, "reason", vouch.Error())
	} else {
		s.log.Warn("store: rollback by operator", "from", from, "to", to, "key_set_version", trust.Version)
	}
	return from, to, nil
}

func renameDir(from, to string) error {
	err := os.Rename(from, to)
	if err == nil || !errors.Is(err, fs.ErrPermission) {
		return err
	}
	// Without CAP_DAC_OVERRIDE, moving a directory to another parent needs
	// write permission on it (its ".." changes): lend it briefly.
	fi, serr := os.Lstat(from)
	if serr != nil || !fi.IsDir() {
		return err
	}
	if err := os.Chmod(from, 0o755); err != nil {
		return err
	}
	if err := os.Rename(from, to); err != nil {
		_ = os.Chmod(from, fi.Mode().Perm())
		return err
	}
	return os.Chmod(to, fi.Mode().Perm())
}
