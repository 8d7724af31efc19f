// Package tmpfiles applies the tmpfiles.d rules nixcage renders itself, as
// `systemd-tmpfiles --create` would: caged prepares a throw-away cage in its
// own process instead of through a unit that runs systemd-tmpfiles
// (docs/run.md, "Units"). Only the line types the renderer writes are
// understood — d, f, L and L+, owned by root or a numeric id, no age, no
// argument but a link's target — and any other line is an error, so a
// renderer that starts writing something else fails the run instead of
// being half applied.
package tmpfiles

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

// Apply creates what rules (a tmpfiles.d file's text) declare under root
// ("/" or "" for the host): a missing directory or file is made with its
// mode and owner, an existing one gets them; a missing link is made, an
// existing path is left as it is ("L") or replaced by the link ("L+", if it
// is a file, a link or an empty directory). Nothing is followed through a
// symlink.
func Apply(root string, rules []byte) error {
	sc := bufio.NewScanner(bytes.NewReader(rules))
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		if err := apply(root, line); err != nil {
			return fmt.Errorf("tmpfiles line %d %q: %w", n, line, err)
		}
	}
	return sc.Err()
}

func apply(root, line string) error {
	f := strings.Fields(line)
	if len(f) < 2 || !filepath.IsAbs(f[1]) || filepath.Clean(f[1]) != f[1] {
		return errors.New("want TYPE PATH ... with a clean absolute path")
	}
	p := filepath.Join(root, f[1])
	if err := MkdirAll(filepath.Dir(p)); err != nil {
		return err
	}
	switch f[0] {
	case "L", "L+":
		if len(f) != 7 || f[2] != "-" || f[3] != "-" || f[4] != "-" || f[5] != "-" {
			return fmt.Errorf("want %s PATH - - - - TARGET", f[0])
		}
		if _, err := os.Lstat(p); err == nil {
			if f[0] == "L" {
				return nil
			}
			if cur, err := os.Readlink(p); err == nil && cur == f[6] {
				return nil
			}
			// "L+" replaces what is there: an older skeleton's mount point
			// (an empty directory) or another link. systemd-tmpfiles would
			// remove a full directory too; nixcage's never is, so refuse.
			if err := os.Remove(p); err != nil {
				return fmt.Errorf("replace with a link: %w", err)
			}
		}
		return os.Symlink(f[6], p)
	case "d", "f":
		if len(f) != 6 || f[5] != "-" {
			return fmt.Errorf("want %s PATH MODE USER GROUP -", f[0])
		}
		mode, err := strconv.ParseUint(f[2], 8, 32)
		if err != nil || mode > 0o7777 {
			return fmt.Errorf("mode %q", f[2])
		}
		uid, err := id(f[3])
		if err != nil {
			return err
		}
		gid, err := id(f[4])
		if err != nil {
			return err
		}
		return ensure(p, f[0] == "d", os.FileMode(mode), uid, gid)
	}
	return fmt.Errorf("line type %q is not one nixcage renders", f[0])
}

// MkdirAll makes dir and its missing parents 0755 whatever the umask (as
// systemd-tmpfiles makes a rule's parents; caged's umask is 0077).
func MkdirAll(dir string) error {
	if st, err := os.Stat(dir); err == nil && st.IsDir() {
		return nil
	}
	if err := MkdirAll(filepath.Dir(dir)); err != nil {
		return err
	}
	if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
		return err
	}
	return syscall.Chmod(dir, 0o755)
}

func id(s string) (int, error) {
	if s == "root" {
		return 0, nil
	}
	n, err := strconv.ParseUint(s, 10, 32)
	if err != nil {
		return 0, fmt.Errorf("owner %q: only root or a numeric id", s)
	}
	return int(n), nil
}

// ensure makes p a directory (dir) or regular file with mode and owner.
// The permission bits are set after creation: the caller's umask (caged's
// is 0077) must not decide them.
func ensure(p string, dir bool, mode os.FileMode, uid, gid int) error {
	st, err := os.Lstat(p)
	switch {
	case errors.Is(err, os.ErrNotExist) && dir:
		if err := os.Mkdir(p, 0o700); err != nil && !errors.Is(err, os.ErrExist) {
			return err
		}
	case errors.Is(err, os.ErrNotExist):
		fd, err := syscall.Open(p, syscall.O_CREAT|syscall.O_EXCL|syscall.O_WRONLY|syscall.O_NOFOLLOW|syscall.O_CLOEXEC, 0o600)
		if err != nil && !errors.Is(err, os.ErrExist) {
			return &os.PathError{Op: "create", Path: p, Err: err}
		}
		if err == nil {
			syscall.Close(fd)
		}
	case err != nil:
		return err
	case dir && !st.IsDir(), !dir && !st.Mode().IsRegular():
		return fmt.Errorf("%s exists and is a %s", p, st.Mode().Type())
	}
	if err := os.Lchown(p, uid, gid); err != nil {
		return err
	}
	if err := syscall.Chmod(p, uint32(mode)); err != nil {
		return &os.PathError{Op: "chmod", Path: p, Err: err}
	}
	return nil
}
