package releasetest

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/nixcage/nixcage/internal/testenv"
)

// SmallFS mounts a fresh tmpfs of size bytes and inodes inodes on a new
// directory and returns it; unmounted at cleanup. Privileged tier: it needs
// root. A real file system that really fills up, for the out-of-space and
// out-of-inodes paths of apply.
func SmallFS(t testing.TB, size int64, inodes int) string {
	t.Helper()
	testenv.RequirePrivileged(t)
	dir, err := os.MkdirTemp("", "nixcage-smallfs-")
	must(t, err)
	SmallFSAt(t, dir, size, inodes)
	return dir
}

// SmallFSAt is SmallFS on an existing empty directory.
func SmallFSAt(t testing.TB, dir string, size int64, inodes int) {
	t.Helper()
	testenv.RequirePrivileged(t)
	opts := fmt.Sprintf("size=%d,nr_inodes=%d,mode=0755", size, inodes)
	if err := unix.Mount("tmpfs", dir, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, opts); err != nil {
		os.Remove(dir)
		t.Fatalf("mount tmpfs (%s) on %s: %v", opts, dir, err)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(dir, unix.MNT_DETACH); err != nil {
			t.Errorf("unmount %s: %v", dir, err)
		}
		os.Remove(dir)
	})
}

// Fill takes the free space and inodes of the file system holding dir,
// leaving about leaveBytes and leaveInodes, and returns a function that
// gives them back.
func Fill(t testing.TB, dir string, leaveBytes int64, leaveInodes int) (free func()) {
	t.Helper()
	filler, err := os.MkdirTemp(dir, ".filler-")
	must(t, err)
	var st unix.Statfs_t
	must(t, unix.Statfs(dir, &st))
	if n := int64(st.Bavail)*int64(st.Bsize) - leaveBytes; n > 0 {
		f, err := os.Create(filepath.Join(filler, "space"))
		must(t, err)
		// tmpfs allocates with fallocate(2); fall back to writing.
		if err := unix.Fallocate(int(f.Fd()), 0, 0, n); err != nil {
			buf := make([]byte, 1<<20)
			for left := n; left > 0; left -= int64(len(buf)) {
				if _, err := f.Write(buf[:min(int64(len(buf)), left)]); err != nil {
					break
				}
			}
		}
		f.Close()
	}
	must(t, unix.Statfs(dir, &st))
	for i := 0; int(st.Ffree) > leaveInodes; i++ {
		err := os.WriteFile(filepath.Join(filler, fmt.Sprint(i)), nil, 0o644)
		if errors.Is(err, unix.ENOSPC) {
			break
		}
		must(t, err)
		if i%256 == 0 {
			must(t, unix.Statfs(dir, &st))
		} else {
			st.Ffree--
		}
	}
	return func() { must(t, os.RemoveAll(filler)) }
}
