package store

import (
	"context"
	"errors"
	"path/filepath"
	"syscall"
	"testing"

	"github.com/nixcage/nixcage/internal/release"
	"github.com/nixcage/nixcage/internal/release/releasetest"
)

// preCommit are the step boundaries before the switch of current: a full
// disk there must leave generation 1 current, intact and verifying, be
// reported as a StorageError (never a refusal), and the same release must
// apply once space is back. At the others the switch has happened: apply
// succeeds and says so, whatever failed after it.
var stepBoundaries = []struct {
	point     string
	preCommit bool
}{
	{"unpacked-path", true}, {"unpacked", true}, {"rename-path", true}, {"paths-in-place", true},
	{"generation-written", true}, {"switched", false}, {"recorded", false},
	{"prune-generation", false}, {"gc-path", false},
}

// TestDiskFullAtEachStep fills a real (tmpfs) file system completely,
// space and inodes, at each step boundary of an apply, and before one (so
// the unpack itself runs out of space, and out of inodes).
func TestDiskFullAtEachStep(t *testing.T) {
	f := getFixture(t)
	rels := t.TempDir()
	rel1, rel2 := filepath.Join(rels, "1"), filepath.Join(rels, "2")
	linkRelease(t, f, f.relB, rel1, 1) // small closure
	linkRelease(t, f, f.relA, rel2, 2) // 4 MiB closure

	type tc struct {
		name      string
		point     string // fill completely at this crash point
		leave     int64  // or: fill before apply, leaving this many bytes
		inodes    int    // and this many inodes
		preCommit bool
	}
	cases := []tc{
		{name: "unpack-out-of-space", leave: 512 << 10, inodes: 1000, preCommit: true},
		{name: "unpack-out-of-inodes", leave: 32 << 20, inodes: 6, preCommit: true},
	}
	for _, b := range stepBoundaries {
		cases = append(cases, tc{name: "full-at-" + b.point, point: b.point, preCommit: b.preCommit})
	}
	defer func() { crashPoint = func(string) {} }()
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			mnt := releasetest.SmallFS(t, 48<<20, 4096)
			root := filepath.Join(mnt, "root")
			s, err := Open(Options{Root: root, Channel: "stable", Keys: []*release.PublicKey{f.pub}, Keep: 1})
			must(t, err)
			if _, err := applyDir(t, s, rel1); err != nil {
				t.Fatal(err)
			}
			var free func()
			if c.point == "" {
				free = releasetest.Fill(t, mnt, c.leave, c.inodes)
			}
			hit := false
			crashPoint = func(p string) {
				if p == c.point && !hit {
					hit = true
					free = releasetest.Fill(t, mnt, 0, 0)
				}
			}
			res, err := applyDir(t, s, rel2)
			crashPoint = func(string) {}
			if c.point != "" && !hit {
				t.Fatalf("apply never reached %s", c.point)
			}
			cur, cerr := s.Current()
			must(t, cerr)
			if c.preCommit {
				var se *StorageError
				var ref *release.Refusal
				if !errors.As(err, &se) || !errors.Is(err, syscall.ENOSPC) || errors.As(err, &ref) {
					t.Fatalf("apply on a full disk: %v, want a StorageError with ENOSPC", err)
				}
				if cur != 1 {
					t.Fatalf("current is %d after a failed apply, want 1", cur)
				}
				t.Logf("reported: %v", err)
			} else {
				if err != nil {
					t.Fatalf("apply whose switch happened reports failure: %v", err)
				}
				if cur != 2 || res.Generation != 2 {
					t.Fatalf("current %d, result %+v; want generation 2", cur, res)
				}
				if h, _ := s.Highest(); h != 2 {
					t.Fatalf("highest %d with current 2", h)
				}
				t.Logf("warnings: %q", res.Warnings)
			}
			// Still full: what is current verifies, and nothing is half-written.
			if rep, err := s.Verify(context.Background(), true); err != nil {
				t.Fatalf("verify on the full disk: %v %v", err, rep.Problems)
			}
			free()
			must(t, s.Recover())
			if rep, err := s.Verify(context.Background(), true); err != nil {
				t.Fatalf("verify after freeing space: %v %v", err, rep.Problems)
			}
			if c.preCommit {
				// The retry is not "not newer": nothing was accepted.
				if _, err := applyDir(t, s, rel2); err != nil {
					t.Fatalf("retry after freeing space: %v", err)
				}
			}
			st, err := s.readState()
			must(t, err)
			if st.Highest != 2 {
				t.Fatalf("state.json records %d after recovery, want 2", st.Highest)
			}
			leftovers, _ := filepath.Glob(filepath.Join(root, tmpPrefix+"*"))
			if len(leftovers) > 0 {
				t.Fatalf("work directories left after recovery: %v", leftovers)
			}
		})
	}
}
