package store

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/nix-community/go-nix/pkg/nar"
	"golang.org/x/sys/unix"

	"github.com/nixcage/nixcage/internal/release"
)

// crashPoint is a test hook called between the durable steps of an apply;
// the crash-safety test kills the process inside it.
var crashPoint = func(string) {}

// Result summarises an apply.
type Result struct {
	Generation    uint64
	Previous      uint64
	Channel       string
	Top           string
	Added         int   // paths unpacked
	Reused        int   // paths already present
	Bytes         int64 // NAR bytes unpacked
	Pruned        []uint64
	Collected     []string
	Phases        []Phase  // wall time per step, for operators and benchmarks
	KeySets       []uint64 // key set versions this release brought (rotations)
	KeySetVersion uint64   // the key set version that verified it
	// Warnings are failures after the commit point: the generation is
	// current all the same (cleanup, or recording the counter, failed).
	Warnings []string
}

// Phase is the duration of one step of an apply.
type Phase struct {
	Name     string
	Duration time.Duration
}

// Apply verifies the release at src and makes it the current generation.
//
// Order of work, each step durable before the next:
//  1. lock, recover from any earlier crash;
//  2. manifest: signatures and threshold, channel, generation above the
//     highest accepted, not expired (release.Open);
//  3. every missing path: narinfo checked against the manifest, NAR
//     streamed, hashed and unpacked into ROOT/tmp-* (same filesystem),
//     read-only; any mismatch aborts with the store untouched;
//  4. syncfs, then each path renamed into nix/store (atomic per path; a
//     path not yet referenced by a generation is harmless);
//  5. generations/N written in a temp dir and renamed into place;
//  6. current switched by renaming a new symlink over it;
//  7. state.json records N (recovery also derives it from current);
//  8. generations beyond Keep and unreferenced paths removed.
func (s *Store) Apply(ctx context.Context, src release.Source) (*Result, error) {
	if s.opts.Channel == "" {
		return nil, errors.New("store has no channel configured: set store.channel (or --channel)")
	}
	unlock, err := s.lock()
	if err != nil {
		return nil, err
	}
	defer unlock()
	if err := s.recoverLocked(); err != nil {
		return nil, storageFailure("recover", err)
	}
	st, err := s.readState()
	if err != nil {
		return nil, err
	}
	prev, err := s.Current()
	if err != nil {
		return nil, err
	}
	var phases []Phase
	mark := time.Now()
	phase := func(name string) {
		now := time.Now()
		phases = append(phases, Phase{name, now.Sub(mark)})
		mark = now
	}
	s.progress(Progress{Phase: "verify"})
	trust, err := s.Trust()
	if err != nil {
		return nil, err
	}
	st = migrate(st, prev, trust)
	trust, rotated, err := s.updateTrust(ctx, src, trust)
	if err != nil {
		return nil, err
	}
	if err := trust.CheckFresh(s.opts.Now()); err != nil {
		return nil, &release.Refusal{Reason: err.Error()}
	}
	rel, err := release.Open(ctx, src, release.Policy{
		Keys: trust.ReleaseKeys, Threshold: trust.ReleaseThreshold, Channel: s.opts.Channel,
		After: s.counter(st, prev, trust), NixKeys: s.nixKeys, Now: s.opts.Now(),
	})
	if err != nil {
		return nil, err
	}
	if rel.Manifest.Generation == prev {
		// Only possible when current is a revoked key's generation (the
		// counter no longer counts it): replacing generations/N under
		// current would leave no current generation on a crash.
		return nil, &release.Refusal{Reason: fmt.Sprintf("generation %d is the number of the current generation, which the trusted key set no longer vouches for; publish a release with a higher generation", prev)}
	}
	sigs, err := release.ParseSignatures(rel.RawSig)
	if err != nil {
		return nil, &release.Refusal{Reason: err.Error()}
	}
	signers := release.ValidSigners(rel.Raw, sigs, trust.ReleaseKeys)
	if err := rel.CheckCacheInfo(ctx); err != nil {
		return nil, err
	}
	m := rel.Manifest
	res := &Result{Generation: m.Generation, Previous: prev, Channel: m.Channel, Top: m.Top, KeySets: rotated, KeySetVersion: trust.Version}

	known, err := s.knownHashes()
	if err != nil {
		return nil, err
	}
	var todo []release.PathInfo
	var total int64
	for _, p := range m.Paths {
		if h, ok := known[p.Name()]; ok {
			if !sameHash(h, p.NarHash) {
				return nil, &release.Refusal{Reason: fmt.Sprintf("%s is already in the store with NarHash %s, the release says %s", p.Path, h, p.NarHash)}
			}
			if _, err := os.Lstat(filepath.Join(s.storeDir(), p.Name())); err == nil {
				res.Reused++
				continue
			}
			todo = append(todo, p)
			total += int64(p.NarSize)
			continue
		}
		present, err := s.checkOrphan(p)
		if err != nil {
			return nil, err
		}
		if present {
			res.Reused++
			continue
		}
		todo = append(todo, p)
		total += int64(p.NarSize)
	}

	if err := s.checkPresentTop(m, todo); err != nil {
		return nil, err
	}
	phase("verify-manifest")
	tmp, err := os.MkdirTemp(s.root, tmpPrefix+strconv.FormatUint(m.Generation, 10)+"-")
	if err != nil {
		return nil, storageFailure("create work directory", err)
	}
	defer removeAll(tmp)
	if err := s.unpackAll(ctx, rel, todo, tmp, total); err != nil {
		var we *release.WriteError
		if errors.As(err, &we) {
			return nil, storageFailure("unpack", err)
		}
		return nil, err
	}
	res.Added, res.Bytes = len(todo), total
	phase("unpack")
	crashPoint("unpacked")

	// One syncfs makes every unpacked byte durable before any path gets its
	// real name; cheaper than an fsync per file.
	if err := syncFS(tmp); err != nil {
		return nil, storageFailure("syncfs", err)
	}
	phase("syncfs")
	s.progress(Progress{Phase: "switch", Done: len(todo), Total: len(todo), Bytes: total, TotalBytes: total})
	for _, p := range todo {
		crashPoint("rename-path")
		if err := renameDir(filepath.Join(tmp, p.Name()), filepath.Join(s.storeDir(), p.Name())); err != nil {
			return nil, storageFailure("move "+p.Name()+" into the store", err)
		}
	}
	if err := release.SyncDir(s.storeDir()); err != nil {
		return nil, storageFailure("sync nix/store", err)
	}
	crashPoint("paths-in-place")

	if err := s.writeGeneration(rel); err != nil {
		return nil, storageFailure("write generation", err)
	}
	crashPoint("generation-written")
	// The commit point: the rename of current. Before it every failure
	// leaves the previous generation current (and is reported as such);
	// after it the new generation is current whatever else fails, so
	// nothing below may turn the apply into an error.
	committed, err := s.switchCurrent(m.Generation)
	if !committed {
		return nil, storageFailure("switch current", err)
	}
	if err != nil {
		res.Warnings = append(res.Warnings, fmt.Sprintf("generation %d is current, but syncing the store root failed (%v): a power loss now may bring back generation %d", m.Generation, err, prev))
	}
	crashPoint("switched")
	// state.json only caches the counter: Highest and recovery derive it
	// from current too, so failing to write it loses nothing.
	if err := s.recordAccepted(st, m.Generation, signers); err != nil {
		res.Warnings = append(res.Warnings, fmt.Sprintf("generation %d is current, but recording it in %s failed (%v); the next apply, rollback, gc or caged start records it", m.Generation, stateFile, err))
	}
	phase("switch")
	crashPoint("recorded")
	s.log.Info("store: applied release", "generation", m.Generation, "previous", prev,
		"channel", m.Channel, "top", m.Top, "added", res.Added, "reused", res.Reused, "bytes", total)
	res.Pruned, res.Collected, err = s.pruneLocked()
	phase("prune")
	res.Phases = phases
	if err != nil {
		res.Warnings = append(res.Warnings, fmt.Sprintf("generation %d is current, but cleanup failed (%v); `cagectl store gc` retries it", m.Generation, err))
	}
	for _, w := range res.Warnings {
		s.log.Warn("store: " + w)
	}
	return res, nil
}

// recordHighest raises state.json's counter to kept generation n (never
// lowers it) and records the keys trusted now that signed it, so the
// counter survives current moving below n (rollback) or a crash before
// Apply recorded it.
func (s *Store) recordHighest(n uint64) error {
	st, err := s.readState()
	if err != nil {
		return err
	}
	var signers []string
	if st.SignedBy != nil {
		if signers, err = s.generationSigners(n); err != nil {
			return err
		}
	}
	changed := st.Highest < n
	for _, id := range signers {
		changed = changed || st.SignedBy[id] < n
	}
	if !changed {
		return nil
	}
	return s.recordAccepted(st, n, signers)
}

// generationSigners lists the release keys trusted now whose signature on
// kept generation n verifies.
func (s *Store) generationSigners(n uint64) ([]string, error) {
	trust, err := s.Trust()
	if err != nil {
		return nil, err
	}
	raw, err := os.ReadFile(filepath.Join(s.genPath(n), release.ManifestFile))
	if err != nil {
		return nil, err
	}
	rawSig, err := os.ReadFile(filepath.Join(s.genPath(n), release.SignaturesFile))
	if err != nil {
		return nil, err
	}
	sigs, err := release.ParseSignatures(rawSig)
	if err != nil {
		return nil, err
	}
	return release.ValidSigners(raw, sigs, trust.ReleaseKeys), nil
}

// recordAccepted records generation n as accepted and signed by signers
// (key IDs), on top of st (read, and migrated, under the same lock).
func (s *Store) recordAccepted(st state, n uint64, signers []string) error {
	st.Highest = max(st.Highest, n)
	for _, id := range signers {
		if st.SignedBy != nil {
			st.SignedBy[id] = max(st.SignedBy[id], n)
		}
	}
	return s.writeState(st)
}

// StorageError is an apply, rollback or gc that failed on the store's own
// file system (out of space or inodes, read-only, an I/O error) before its
// commit point: a fault of this machine, not a verdict on the release. The
// previous generation is still current and verifies; the same release can
// be applied again once the cause is fixed.
type StorageError struct {
	Step string
	Err  error
}

func (e *StorageError) Error() string {
	hint := ""
	if errors.Is(e.Err, syscall.ENOSPC) || errors.Is(e.Err, syscall.EDQUOT) {
		hint = "; free space or inodes on the store's file system (df -h, df -i) and apply again"
	}
	return fmt.Sprintf("store I/O failure at %s, nothing was switched: %v%s", e.Step, e.Err, hint)
}

func (e *StorageError) Unwrap() error { return e.Err }

func storageFailure(step string, err error) error {
	var se *StorageError
	if err == nil || errors.As(err, &se) {
		return err
	}
	return &StorageError{Step: step, Err: err}
}

func (s *Store) progress(p Progress) {
	if s.opts.Progress != nil {
		s.opts.Progress(p)
	}
}

// checkPresentTop refuses a release whose top is already in the store (an
// older generation listed it as an ordinary member) and is not a directory.
// A top about to be unpacked is checked by release.Unpack from its NAR.
func (s *Store) checkPresentTop(m *release.Manifest, todo []release.PathInfo) error {
	for _, p := range todo {
		if p.Path == m.Top {
			return nil
		}
	}
	fi, err := os.Lstat(filepath.Join(s.storeDir(), strings.TrimPrefix(m.Top, "/nix/store/")))
	if err != nil {
		return fmt.Errorf("check top: %w", err)
	}
	if !fi.IsDir() {
		return &release.Refusal{Reason: release.TopNotDirectory(m.Top, fileKind(fi.Mode())).Error()}
	}
	return nil
}

func fileKind(m fs.FileMode) string {
	switch {
	case m&fs.ModeSymlink != 0:
		return "symlink"
	case m.IsRegular():
		return "regular file"
	case m.IsDir():
		return "directory"
	}
	return m.Type().String()
}

// sameHash compares two NAR hashes by digest, whatever their encoding.
func sameHash(a, b string) bool {
	da, err1 := release.PathInfo{NarHash: a}.Digest()
	db, err2 := release.PathInfo{NarHash: b}.Digest()
	return err1 == nil && err2 == nil && bytes.Equal(da, db)
}

// knownHashes maps every path of every kept generation to its NarHash.
func (s *Store) knownHashes() (map[string]string, error) {
	ns, err := s.generations()
	if err != nil {
		return nil, err
	}
	out := map[string]string{}
	for _, n := range ns {
		m, err := s.manifest(n)
		if err != nil {
			return nil, err
		}
		for _, p := range m.Paths {
			out[p.Name()] = p.NarHash
		}
	}
	return out, nil
}

// checkOrphan handles a path present in nix/store that no kept generation
// lists (an apply crashed after moving it in, or gc has not run). It is
// reused only if it re-hashes to the manifest's value; otherwise it is
// moved out and unpacked afresh.
func (s *Store) checkOrphan(p release.PathInfo) (bool, error) {
	dst := filepath.Join(s.storeDir(), p.Name())
	if _, err := os.Lstat(dst); errors.Is(err, fs.ErrNotExist) {
		return false, nil
	} else if err != nil {
		return false, err
	}
	digest, size, err := hashPath(dst)
	want, _ := p.Digest()
	if err == nil && uint64(size) == p.NarSize && bytes.Equal(digest, want) {
		return true, nil
	}
	s.log.Warn("store: replacing unreferenced path that does not match the release", "path", p.Path)
	trash := filepath.Join(s.root, tmpPrefix+"stale-"+p.Name())
	if err := renameDir(dst, trash); err != nil {
		return false, err
	}
	return false, removeAll(trash)
}

// hashPath serialises a live path as a NAR (go-nix) and hashes it.
func hashPath(p string) ([]byte, int64, error) {
	h := sha256.New()
	cw := &countWriter{w: h}
	if err := nar.DumpPath(cw, p); err != nil {
		return nil, 0, err
	}
	return h.Sum(nil), cw.n, nil
}

type countWriter struct {
	w io.Writer
	n int64
}

func (c *countWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}

// unpackAll verifies and unpacks paths in parallel into tmp/<name>.
func (s *Store) unpackAll(ctx context.Context, rel *release.Release, todo []release.PathInfo, tmp string, total int64) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var (
		mu       sync.Mutex
		firstErr error
		done     int
		bytes    atomic.Int64
		next     atomic.Int64
		wg       sync.WaitGroup
	)
	s.progress(Progress{Phase: "unpack", Total: len(todo), TotalBytes: total})
	for range min(s.opts.Workers, len(todo)) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1)) - 1
				if i >= len(todo) || ctx.Err() != nil {
					return
				}
				p := todo[i]
				_, err := rel.Unpack(ctx, p, filepath.Join(tmp, p.Name()))
				mu.Lock()
				if err == nil {
					crashPoint("unpacked-path")
				}
				if err != nil {
					if firstErr == nil || errors.Is(firstErr, context.Canceled) {
						firstErr = err
					}
					cancel()
				} else {
					done++
					b := bytes.Add(int64(p.NarSize))
					s.progress(Progress{Phase: "unpack", Done: done, Total: len(todo), Bytes: b, TotalBytes: total})
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	if firstErr != nil {
		return firstErr
	}
	return ctx.Err()
}

func syncFS(dir string) error {
	f, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer f.Close()
	if err := unix.Syncfs(int(f.Fd())); err != nil {
		return fmt.Errorf("syncfs: %w", err)
	}
	return nil
}

// writeGeneration creates generations/N atomically: files written and
// synced in a temp directory that is then renamed.
func (s *Store) writeGeneration(rel *release.Release) error {
	n := rel.Manifest.Generation
	final := s.genPath(n)
	if _, err := os.Lstat(final); err == nil {
		// A leftover of an interrupted apply, or a kept generation signed
		// only by a revoked key (n is above every vouched one, and never
		// current: Apply refuses that); replace it.
		if err := s.removeGeneration(n); err != nil {
			return err
		}
	}
	tmp, err := os.MkdirTemp(filepath.Join(s.root, genDir), tmpPrefix)
	if err != nil {
		return fmt.Errorf("write generation: %w", err)
	}
	defer removeAll(tmp)
	for name, data := range map[string][]byte{release.ManifestFile: rel.Raw, release.SignaturesFile: rel.RawSig} {
		if err := writeSynced(filepath.Join(tmp, name), data); err != nil {
			return fmt.Errorf("write generation: %w", err)
		}
	}
	top := rel.Manifest.Paths[0].Name()
	if p, ok := rel.Manifest.Lookup(rel.Manifest.Top); ok {
		top = p.Name()
	}
	if err := os.Symlink("../../nix/store/"+top, filepath.Join(tmp, topLink)); err != nil {
		return fmt.Errorf("write generation: %w", err)
	}
	if err := os.Chmod(tmp, 0o755); err != nil {
		return err
	}
	if err := release.SyncDir(tmp); err != nil {
		return err
	}
	if err := os.Rename(tmp, final); err != nil {
		return fmt.Errorf("write generation: %w", err)
	}
	return release.SyncDir(filepath.Join(s.root, genDir))
}

func writeSynced(p string, data []byte) error {
	f, err := os.OpenFile(p, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o444)
	if err != nil {
		return err
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}
