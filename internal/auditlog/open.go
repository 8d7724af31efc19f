package auditlog

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"syscall"

	"golang.org/x/sys/unix"
)

// ErrNotPlainFile refuses an audit log that is a symlink, a hard link to
// another file, or not a regular file.
var ErrNotPlainFile = errors.New("audit log is not a plain file of its own")

// Open opens the audit log at path for reading without following links in
// its last component. The directory is systemd's LogsDirectory= (made by
// root, under DynamicUser= reached through root's own symlink), but the
// file inside it is the gateway's: a compromised gateway could replace it
// with a link to any file, and caged reads it with CAP_DAC_READ_SEARCH and
// hands the lines to viewers. So the file is opened relative to an open
// handle on its directory with openat2(RESOLVE_NO_SYMLINKS|RESOLVE_BENEATH)
// (O_NOFOLLOW on kernels before 5.6), non-blocking (a FIFO cannot hang
// caged), and must be a regular file with one link (a hard link to a root
// file is the same attack where fs.protected_hardlinks is off).
func Open(path string) (*os.File, error) {
	dir, err := os.OpenFile(filepath.Dir(path), unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("audit: %w", err)
	}
	defer dir.Close()
	base := filepath.Base(path)
	flags := unix.O_RDONLY | unix.O_CLOEXEC | unix.O_NOFOLLOW | unix.O_NONBLOCK | unix.O_NOCTTY
	fd, err := unix.Openat2(int(dir.Fd()), base, &unix.OpenHow{Flags: uint64(flags), Resolve: unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_BENEATH})
	if errors.Is(err, unix.ENOSYS) {
		fd, err = unix.Openat(int(dir.Fd()), base, flags, 0)
	}
	switch {
	case errors.Is(err, unix.ELOOP):
		return nil, fmt.Errorf("audit: %s: %w (a symlink)", path, ErrNotPlainFile)
	case err != nil:
		return nil, &os.PathError{Op: "open", Path: path, Err: err}
	}
	f := os.NewFile(uintptr(fd), path)
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("audit: %w", err)
	}
	if !fi.Mode().IsRegular() {
		f.Close()
		return nil, fmt.Errorf("audit: %s: %w (%s)", path, ErrNotPlainFile, fi.Mode().Type())
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok && st.Nlink != 1 {
		f.Close()
		return nil, fmt.Errorf("audit: %s: %w (%d hard links)", path, ErrNotPlainFile, st.Nlink)
	}
	return f, nil
}
