package store

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"github.com/nixcage/nixcage/internal/release"
)

// Problem is one thing Verify found wrong.
type Problem struct {
	Generation uint64
	Path       string
	Reason     string
}

func (p Problem) String() string {
	if p.Path == "" {
		return fmt.Sprintf("generation %d: %s", p.Generation, p.Reason)
	}
	return fmt.Sprintf("generation %d: %s: %s", p.Generation, p.Path, p.Reason)
}

// VerifyReport is what Verify checked.
type VerifyReport struct {
	Generations []uint64
	Paths       int
	Bytes       int64
	Problems    []Problem
	Freshness   Freshness // of the current generation
}

// ErrExpired is returned (wrapped) by Verify when the store is intact but
// the current generation's release has expired.
var ErrExpired = errors.New("the current generation's release has expired")

// ErrCorrupt is returned (wrapped) when Verify found problems.
var ErrCorrupt = errors.New("store does not match its manifests")

// Verify re-hashes what is live against its manifest: every path of the
// current generation (all kept generations if all is set) must exist,
// serialise to a NAR with the manifest's hash and size, and carry no write
// permission. With trusted keys configured, each manifest's signatures are
// checked again too. Read-only: takes no lock and changes nothing.
func (s *Store) Verify(ctx context.Context, all bool) (*VerifyReport, error) {
	cur, err := s.Current()
	if err != nil {
		return nil, err
	}
	rep := &VerifyReport{}
	var gens []uint64
	if all {
		if gens, err = s.generations(); err != nil {
			return nil, err
		}
	} else if cur != 0 {
		gens = []uint64{cur}
	}
	if len(gens) == 0 {
		return rep, errors.New("store has no generation yet: apply a release first")
	}
	// With release keys given, each generation's signatures are checked
	// against the key set trusted now (a revoked key's generation fails).
	var trust *release.Trust
	if len(s.keys) > 0 || len(s.rootKeys) > 0 {
		if trust, err = s.Trust(); err != nil {
			return rep, err
		}
	}
	checked := map[string]bool{}
	for _, n := range gens {
		rep.Generations = append(rep.Generations, n)
		m, err := s.manifest(n)
		if err != nil {
			rep.Problems = append(rep.Problems, Problem{Generation: n, Reason: err.Error()})
			continue
		}
		if trust != nil {
			if err := s.vouchedFor(n, trust); err != nil {
				reason := err.Error()
				if n == cur {
					reason = fmt.Sprintf("current generation is not vouched for by the trusted key set (version %d): %v; apply a newer release signed by the current release keys", trust.Version, err)
				}
				rep.Problems = append(rep.Problems, Problem{Generation: n, Reason: reason})
			}
		}
		if reason := s.verifyTop(n, m); reason != "" {
			rep.Problems = append(rep.Problems, Problem{Generation: n, Reason: reason})
		}
		for _, p := range m.Paths {
			if err := ctx.Err(); err != nil {
				return rep, err
			}
			if checked[p.Path] {
				continue
			}
			checked[p.Path] = true
			rep.Paths++
			if reason := s.verifyPath(p); reason != "" {
				rep.Problems = append(rep.Problems, Problem{Generation: n, Path: p.Path, Reason: reason})
			}
			rep.Bytes += int64(p.NarSize)
		}
	}
	if cur != 0 {
		// What a cage would bind, resolved as the bind wrapper does.
		if _, err := ResolveBinds(s.root); err != nil {
			rep.Problems = append(rep.Problems, Problem{Generation: cur, Reason: err.Error()})
		}
	}
	if len(rep.Problems) > 0 {
		return rep, fmt.Errorf("%w: %d problem(s)", ErrCorrupt, len(rep.Problems))
	}
	if rep.Freshness, err = s.Freshness(); err != nil {
		return rep, err
	}
	if rep.Freshness.State == FreshExpired {
		return rep, fmt.Errorf("%w: %s", ErrExpired, rep.Freshness.Message())
	}
	return rep, nil
}

// verifyTop checks generations/N/top is exactly the relative link apply
// writes and that it names a directory: a top that is a link would take a
// cage's /nix/tools bind wherever it points on the host.
func (s *Store) verifyTop(n uint64, m *release.Manifest) string {
	name := strings.TrimPrefix(m.Top, "/nix/store/")
	if t, err := os.Readlink(filepath.Join(s.genPath(n), topLink)); err != nil || t != "../../nix/store/"+name {
		return "top link does not name " + m.Top
	}
	fi, err := os.Lstat(filepath.Join(s.storeDir(), name))
	if err != nil {
		return "top " + m.Top + " is missing"
	}
	if !fi.IsDir() {
		return release.TopNotDirectory(m.Top, fileKind(fi.Mode())).Error()
	}
	return ""
}

func (s *Store) verifyPath(p release.PathInfo) string {
	dst := filepath.Join(s.storeDir(), p.Name())
	if _, err := os.Lstat(dst); err != nil {
		return "missing"
	}
	var writable string
	_ = filepath.WalkDir(dst, func(q string, d fs.DirEntry, err error) error {
		if err != nil || writable != "" {
			return err
		}
		if d.Type()&fs.ModeSymlink != 0 {
			return nil
		}
		fi, err := d.Info()
		if err == nil && fi.Mode().Perm()&0o222 != 0 {
			writable = q
		}
		return nil
	})
	if writable != "" {
		return "writable: " + writable
	}
	digest, size, err := hashPath(dst)
	if err != nil {
		return "cannot serialise: " + err.Error()
	}
	want, _ := p.Digest()
	if uint64(size) != p.NarSize || !bytes.Equal(digest, want) {
		return fmt.Sprintf("content differs from the manifest (NAR of %d bytes, want %d, hash mismatch=%v)", size, p.NarSize, !bytes.Equal(digest, want))
	}
	return ""
}
