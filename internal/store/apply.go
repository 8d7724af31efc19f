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
	"sync"
	"sync/atomic"

	"github.com/nix-community/go-nix/pkg/nar"
	"golang.org/x/sys/unix"

	"github.com/nixcage/nixcage/internal/release"
)

// crashPoint is a test hook called between the durable steps of an apply;
// the crash-safety test kills the process inside it.
var crashPoint = func(string) {}

// Result summarises an apply.
type Result struct {
	Generation uint64
	Previous   uint64
	Channel    string
	Top        string
	Added      int   // paths unpacked
	Reused     int   // paths already present
	Bytes      int64 // NAR bytes unpacked
	Pruned     []uint64
	Collected  []string
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
		return nil, err
	}
	highest, err := s.Highest()
	if err != nil {
		return nil, err
	}
	prev, err := s.Current()
	if err != nil {
		return nil, err
	}
	s.progress(Progress{Phase: "verify"})
	rel, err := release.Open(ctx, src, release.Policy{
		Keys: s.keys, Threshold: s.opts.Threshold, Channel: s.opts.Channel,
		After: highest, NixKeys: s.nixKeys, Now: s.opts.Now(),
	})
	if err != nil {
		return nil, err
	}
	if err := rel.CheckCacheInfo(ctx); err != nil {
		return nil, err
	}
	m := rel.Manifest
	res := &Result{Generation: m.Generation, Previous: prev, Channel: m.Channel, Top: m.Top}

	known, err := s.knownHashes()
	if err != nil {
		return nil, err
	}
	var todo []release.PathInfo
	var total int64
	for _, p := range m.Paths {
		if h, ok := known[p.Name()]; ok {
			if h != p.NarHash {
				return nil, fmt.Errorf("release refused: %s is already in the store with NarHash %s, the release says %s", p.Path, h, p.NarHash)
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

	tmp, err := os.MkdirTemp(s.root, tmpPrefix+strconv.FormatUint(m.Generation, 10)+"-")
	if err != nil {
		return nil, fmt.Errorf("create work directory: %w", err)
	}
	defer removeAll(tmp)
	if err := s.unpackAll(ctx, rel, todo, tmp, total); err != nil {
		return nil, err
	}
	res.Added, res.Bytes = len(todo), total
	crashPoint("unpacked")

	// One syncfs makes every unpacked byte durable before any path gets its
	// real name; cheaper than an fsync per file.
	if err := syncFS(tmp); err != nil {
		return nil, err
	}
	s.progress(Progress{Phase: "switch", Done: len(todo), Total: len(todo), Bytes: total, TotalBytes: total})
	for _, p := range todo {
		crashPoint("rename-path")
		if err := renameDir(filepath.Join(tmp, p.Name()), filepath.Join(s.storeDir(), p.Name())); err != nil {
			return nil, fmt.Errorf("move %s into the store: %w", p.Name(), err)
		}
	}
	if err := release.SyncDir(s.storeDir()); err != nil {
		return nil, err
	}
	crashPoint("paths-in-place")

	if err := s.writeGeneration(rel); err != nil {
		return nil, err
	}
	crashPoint("generation-written")
	if err := s.switchCurrent(m.Generation); err != nil {
		return nil, err
	}
	crashPoint("switched")
	st, err := s.readState()
	if err != nil {
		return nil, err
	}
	st.Highest = m.Generation
	if err := s.writeState(st); err != nil {
		return nil, fmt.Errorf("record generation: %w", err)
	}
	crashPoint("recorded")
	s.log.Info("store: applied release", "generation", m.Generation, "previous", prev,
		"channel", m.Channel, "top", m.Top, "added", res.Added, "reused", res.Reused, "bytes", total)
	res.Pruned, res.Collected, err = s.pruneLocked()
	if err != nil {
		// The release is active; only cleanup failed.
		return res, fmt.Errorf("generation %d is active, but cleanup failed: %w", m.Generation, err)
	}
	return res, nil
}

func (s *Store) progress(p Progress) {
	if s.opts.Progress != nil {
		s.opts.Progress(p)
	}
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
		// Only a leftover can be here (recovery removes generations above
		// the highest accepted, and n is above it); replace it.
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
