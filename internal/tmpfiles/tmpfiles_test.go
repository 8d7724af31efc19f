package tmpfiles

import (
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/nixcage/nixcage/internal/testenv"
)

// The rules the renderer writes (its golden files: a run's and the
// reference configuration's, with numeric owners), applied by Apply and by
// the real systemd-tmpfiles --create, give the same tree: on an empty root,
// and again on a root whose modes and owners were changed meanwhile.
func TestApplyMatchesSystemdTmpfiles(t *testing.T) {
	testenv.RequireRoot(t, "the rules make root- and uid-owned files")
	tool := testenv.LookPath(t, "systemd-tmpfiles")
	for _, rules := range []string{
		"../render/testdata/golden/throwaway/service/run/nixcage/runs/run-test/tmpfiles.d/nixcage.conf",
		"../render/testdata/golden/reference/tmpfiles.d/nixcage.conf",
	} {
		t.Run(filepath.Base(filepath.Dir(filepath.Dir(rules))), func(t *testing.T) {
			text, err := os.ReadFile(rules)
			if err != nil {
				t.Fatal(err)
			}
			conf, _ := filepath.Abs(rules)
			ours, theirs := t.TempDir(), t.TempDir()
			apply := func() {
				if err := Apply(ours, text); err != nil {
					t.Fatal(err)
				}
				if out, err := exec.Command(tool, "--create", "--root="+theirs, conf).CombinedOutput(); err != nil {
					t.Fatalf("systemd-tmpfiles: %v\n%s", err, out)
				}
			}
			apply()
			want := tree(t, theirs)
			if got := tree(t, ours); got != want {
				t.Fatalf("Apply made\n%s\nsystemd-tmpfiles made\n%s", got, want)
			}
			if !strings.Contains(want, "var/lib/nixcage/rootfs/nix/tools L .nixcage/current/top") {
				t.Fatalf("the skeleton's store links are not links:\n%s", want)
			}
			if !strings.Contains(want, "var/lib/nixcage/rootfs/bin L usr/bin") || !strings.Contains(want, "var/lib/nixcage/rootfs/etc/resolv.conf f 644 0:0") {
				t.Fatalf("the comparison saw no skeleton:\n%s", want)
			}
			// Modes and owners drift; both put them back, links stay.
			for _, root := range []string{ours, theirs} {
				os.Chmod(filepath.Join(root, "var/lib/nixcage"), 0o777)
				os.Chown(filepath.Join(root, "var/lib/nixcage/rootfs/etc/hosts"), 1234, 1234)
				os.Remove(filepath.Join(root, "var/lib/nixcage/rootfs/sbin"))
				os.Symlink("elsewhere", filepath.Join(root, "var/lib/nixcage/rootfs/sbin"))
				// The skeleton of an older install: mount points where the
				// store's links now are ("L+").
				for _, d := range []string{"nix/store", "nix/tools"} {
					os.Remove(filepath.Join(root, "var/lib/nixcage/rootfs", d))
					os.Mkdir(filepath.Join(root, "var/lib/nixcage/rootfs", d), 0o755)
				}
			}
			apply()
			want = tree(t, theirs)
			if got := tree(t, ours); got != want {
				t.Fatalf("re-applied, Apply made\n%s\nsystemd-tmpfiles made\n%s", got, want)
			}
		})
	}
}

// tree lists every path under root with its type, mode and owner.
func tree(t *testing.T, root string) string {
	t.Helper()
	var b strings.Builder
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil || p == root {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		fi, err := os.Lstat(p)
		if err != nil {
			return err
		}
		st := fi.Sys().(*syscall.Stat_t)
		switch {
		case fi.Mode()&fs.ModeSymlink != 0:
			target, _ := os.Readlink(p)
			fmt.Fprintf(&b, "%s L %s\n", rel, target)
		case fi.IsDir():
			fmt.Fprintf(&b, "%s d %o %d:%d\n", rel, st.Mode&0o7777, st.Uid, st.Gid)
		default:
			fmt.Fprintf(&b, "%s f %o %d:%d size %d\n", rel, st.Mode&0o7777, st.Uid, st.Gid, fi.Size())
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return b.String()
}

// A line of a type the renderer never writes, or with an age or an
// argument, is refused naming the line, and nothing after it is applied.
func TestApplyRefusesWhatItDoesNotKnow(t *testing.T) {
	for _, line := range []string{
		"D /var/lib/x 0755 root root -",
		"d /var/lib/x 0755 root root 10d",
		"f /var/lib/x 0644 root root - content",
		"d var/lib/x 0755 root root -",
		"d /var/lib/../x 0755 root root -",
		"d /var/lib/x 0755 alice root -",
		"L /var/lib/x 0755 - - - usr/bin",
	} {
		root := t.TempDir()
		err := Apply(root, []byte(line+"\nd /after 0755 root root -\n"))
		if err == nil || !strings.Contains(err.Error(), "line 1") {
			t.Errorf("%q: err %v, want a refusal naming line 1", line, err)
		}
		if _, err := os.Lstat(filepath.Join(root, "after")); err == nil {
			t.Errorf("%q: the line after a refused one was applied", line)
		}
	}
}
