package daemon

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"unicode/utf8"

	sys "golang.org/x/sys/unix"

	"github.com/nixcage/nixcage/internal/bus"
	"github.com/nixcage/nixcage/internal/paths"
)

// Workspace files (docs/relay.md): GetFile copies a regular file out of an
// agent's workspace, PutFile saves one into its inbox/. The workspace
// belongs to the agent, who may have planted anything in it: symlinks to
// host files, "..", FIFOs that block a reader, names that race a check.
// So every path is resolved by the kernel relative to the workspace
// directory with openat2(RESOLVE_BENEATH) — nothing a path or a link says
// can lead out — and what is handed over is a sealed copy, never the
// agent's file itself.

// Limits on names and paths (docs/relay.md).
const (
	maxGetPath    = 4096
	maxInboxName  = 200
	maxInboxTries = 100 // NAME, NAME-1 ... NAME-99
	// InboxDir is where PutFile saves, relative to the workspace.
	InboxDir = "inbox"
)

// CheckWorkspacePath refuses a GetFile path before anything is opened: the
// kernel's RESOLVE_BENEATH is the wall, this gives the clear message.
func CheckWorkspacePath(p string) error {
	switch {
	case p == "":
		return errors.New("the path is empty; give a path relative to the workspace, e.g. notes/today.md")
	case len(p) > maxGetPath:
		return fmt.Errorf("the path is %d bytes, over the limit of %d", len(p), maxGetPath)
	case strings.IndexByte(p, 0) >= 0:
		return errors.New("the path contains a NUL byte")
	case strings.HasPrefix(p, "/"):
		return fmt.Errorf("%q is absolute; give a path relative to the workspace (%s)", p, paths.CageWorkspace)
	}
	for _, el := range strings.Split(p, "/") {
		if el == ".." {
			return fmt.Errorf("%q contains '..'; only paths inside the workspace can be read", p)
		}
	}
	return nil
}

// CheckInboxName refuses a PutFile name: a plain file name, visible (no
// leading dot: nothing the agent's tools treat as configuration), printable.
func CheckInboxName(name string) error {
	switch {
	case name == "":
		return errors.New("the file name is empty")
	case len(name) > maxInboxName:
		return fmt.Errorf("the file name is %d bytes, over the limit of %d", len(name), maxInboxName)
	case !utf8.ValidString(name):
		return errors.New("the file name is not valid UTF-8")
	case strings.HasPrefix(name, "."):
		return fmt.Errorf("%q starts with '.'; hidden files cannot be put (rename it)", name)
	case strings.Contains(name, "/"):
		return fmt.Errorf("%q contains '/'; give a file name, not a path", name)
	}
	for _, r := range name {
		if r < 0x20 || r == 0x7f || (r >= 0x80 && r < 0xa0) {
			return fmt.Errorf("%q contains a control character", name)
		}
	}
	return nil
}

// inboxCandidate is the i-th name tried for name: name, then name-1.ext,
// name-2.ext, ...
func inboxCandidate(name string, i int) string {
	if i == 0 {
		return name
	}
	ext := filepath.Ext(name)
	if ext == name { // "tar" has no extension to keep
		ext = ""
	}
	return strings.TrimSuffix(name, ext) + "-" + strconv.Itoa(i) + ext
}

// openWorkspace opens the agent's workspace directory on the host.
func (d *Daemon) openWorkspace(agent string) (*os.File, error) {
	if err := d.refuseRun(agent, "read or written by file transfer"); err != nil {
		return nil, err
	}
	a := d.config().Agent(agent)
	if a == nil {
		return nil, fmt.Errorf("%w: %q", bus.ErrNoSuchAgent, agent)
	}
	ws := d.qdirs.Host(a.Workspace)
	fd, err := sys.Open(ws, sys.O_RDONLY|sys.O_DIRECTORY|sys.O_CLOEXEC, 0)
	if errors.Is(err, sys.ENOENT) {
		return nil, fmt.Errorf("%w: agent %s has no workspace yet (%s appears when it first starts)", bus.ErrInvalid, agent, a.Workspace)
	}
	if err != nil {
		return nil, fmt.Errorf("open the workspace of %s: %w", agent, err)
	}
	return os.NewFile(uintptr(fd), ws), nil
}

// beneath opens p under dir; nothing in p or in a link on the way can
// leave dir, and no magic link (/proc/self/fd/...) is followed.
func beneath(dir *os.File, p string, flags uint64, resolve uint64) (int, error) {
	for !noOpenat2.Load() {
		fd, err := sys.Openat2(int(dir.Fd()), p, &sys.OpenHow{Flags: flags | sys.O_CLOEXEC, Resolve: resolve | sys.RESOLVE_BENEATH | sys.RESOLVE_NO_MAGICLINKS})
		if errors.Is(err, sys.EAGAIN) || errors.Is(err, sys.EINTR) {
			continue // a rename raced the lookup; the kernel asks to retry
		}
		if errors.Is(err, sys.ENOSYS) {
			noOpenat2.Store(true)
			break
		}
		return fd, err
	}
	return walkBeneath(dir, p, flags)
}

// noOpenat2 is set once openat2 answered ENOSYS: a kernel before 5.6, or a
// seccomp filter older than the call (systemd-nspawn 252's own filter, in
// which the booted test machines run caged). Tests set it to exercise
// walkBeneath.
var noOpenat2 atomic.Bool

// walkBeneath is beneath without openat2: one openat per path element,
// none of them following a symlink (any symlink is refused, ELOOP), ".."
// refused (EXDEV). Stricter than RESOLVE_BENEATH, which follows links
// that stay inside.
func walkBeneath(dir *os.File, p string, flags uint64) (int, error) {
	var elems []string
	for _, e := range strings.Split(p, "/") {
		if e != "" && e != "." {
			elems = append(elems, e)
		}
	}
	if len(elems) == 0 {
		return -1, sys.ENOENT
	}
	cur, owned := int(dir.Fd()), -1
	defer func() {
		if owned >= 0 {
			sys.Close(owned)
		}
	}()
	for i, e := range elems {
		if e == ".." {
			return -1, sys.EXDEV
		}
		last := i == len(elems)-1
		fl := sys.O_PATH | sys.O_NOFOLLOW | sys.O_CLOEXEC
		if last {
			fl = int(flags) | sys.O_NOFOLLOW | sys.O_CLOEXEC
		}
		fd, err := sys.Openat(cur, e, fl, 0)
		if err != nil {
			return -1, err
		}
		var st sys.Stat_t
		if err := sys.Fstat(fd, &st); err != nil {
			sys.Close(fd)
			return -1, err
		}
		switch {
		case st.Mode&sys.S_IFMT == sys.S_IFLNK: // O_PATH|O_NOFOLLOW opens the link itself
			sys.Close(fd)
			return -1, sys.ELOOP
		case !last && st.Mode&sys.S_IFMT != sys.S_IFDIR:
			sys.Close(fd)
			return -1, sys.ENOTDIR
		}
		if owned >= 0 {
			sys.Close(owned)
		}
		if last {
			owned = -1
			return fd, nil
		}
		cur, owned = fd, fd
	}
	return -1, sys.ENOENT
}

func resolveError(p string, err error) error {
	switch {
	case errors.Is(err, sys.EXDEV):
		return fmt.Errorf("%w: %q leads out of the workspace (a symlink or '..'); only files inside it can be read", bus.ErrInvalid, p)
	case errors.Is(err, sys.ELOOP):
		return fmt.Errorf("%w: %q: a symlink that is not followed here, or too many of them", bus.ErrInvalid, p)
	case errors.Is(err, sys.ENOENT):
		return fmt.Errorf("%w: %q: no such file in the workspace", bus.ErrInvalid, p)
	case errors.Is(err, sys.ENOTDIR):
		return fmt.Errorf("%w: %q: a part of the path is not a directory", bus.ErrInvalid, p)
	}
	return fmt.Errorf("%q: %w", p, err)
}

// GetFile implements bus.TurnBackend.
func (d *Daemon) GetFile(ctx context.Context, agent, p string, maxBytes uint64, by string) (*os.File, uint64, error) {
	f, size, err := d.getFile(agent, p, maxBytes)
	d.fileEvent(agent, bus.FileGet, p, size, err, by)
	return f, size, err
}

func (d *Daemon) getFile(agent, p string, maxBytes uint64) (*os.File, uint64, error) {
	if maxBytes == 0 {
		maxBytes = bus.MaxFileBytes
	}
	if maxBytes > bus.MaxFileBytes {
		return nil, 0, fmt.Errorf("%w: max_bytes %d is over the ceiling of %d bytes", bus.ErrInvalid, maxBytes, bus.MaxFileBytes)
	}
	if err := CheckWorkspacePath(p); err != nil {
		return nil, 0, fmt.Errorf("%w: %v", bus.ErrInvalid, err)
	}
	ws, err := d.openWorkspace(agent)
	if err != nil {
		return nil, 0, err
	}
	defer ws.Close()
	return copyOut(ws, p, maxBytes)
}

// copyOut copies the regular file p under ws into a sealed memfd. The file
// is first opened as a path only (O_PATH opens no FIFO or device), checked
// to be regular, and only then reopened for reading through that very
// descriptor, so a swap between check and read changes nothing.
func copyOut(ws *os.File, p string, maxBytes uint64) (*os.File, uint64, error) {
	pfd, err := beneath(ws, p, sys.O_PATH, 0)
	if err != nil {
		return nil, 0, resolveError(p, err)
	}
	defer sys.Close(pfd)
	var st sys.Stat_t
	if err := sys.Fstat(pfd, &st); err != nil {
		return nil, 0, fmt.Errorf("%q: %w", p, err)
	}
	if st.Mode&sys.S_IFMT != sys.S_IFREG {
		return nil, 0, fmt.Errorf("%w: %q is not a regular file (%s); only regular files can be read", bus.ErrInvalid, p, fileKind(st.Mode))
	}
	if uint64(st.Size) > maxBytes {
		return nil, 0, fmt.Errorf("%w: %q is %d bytes, over the limit of %d bytes", bus.ErrInvalid, p, st.Size, maxBytes)
	}
	rfd, err := sys.Open("/proc/self/fd/"+strconv.Itoa(pfd), sys.O_RDONLY|sys.O_NONBLOCK|sys.O_NOCTTY|sys.O_CLOEXEC, 0)
	if err != nil {
		return nil, 0, fmt.Errorf("%q: reopen for reading: %w", p, err)
	}
	src := os.NewFile(uintptr(rfd), p)
	defer src.Close()
	var st2 sys.Stat_t
	if err := sys.Fstat(rfd, &st2); err != nil || st2.Dev != st.Dev || st2.Ino != st.Ino {
		return nil, 0, fmt.Errorf("%q changed while it was opened; try again", p)
	}
	mfd, err := sys.MemfdCreate("nixcage-get", sys.MFD_CLOEXEC|sys.MFD_ALLOW_SEALING)
	if err != nil {
		return nil, 0, fmt.Errorf("memfd: %w", err)
	}
	out := os.NewFile(uintptr(mfd), "get "+p)
	// The agent may still be writing it: copy at most one byte past the
	// limit to tell.
	n, err := io.Copy(out, io.LimitReader(src, int64(maxBytes)+1))
	if err == nil && uint64(n) > maxBytes {
		err = fmt.Errorf("%w: %q grew past the limit of %d bytes while it was read", bus.ErrInvalid, p, maxBytes)
	}
	if err == nil {
		err = seal(out)
	}
	if err != nil {
		out.Close()
		return nil, 0, fmt.Errorf("read %q: %w", p, err)
	}
	return out, uint64(n), nil
}

func fileKind(mode uint32) string {
	switch mode & sys.S_IFMT {
	case sys.S_IFDIR:
		return "a directory"
	case sys.S_IFIFO:
		return "a FIFO"
	case sys.S_IFSOCK:
		return "a socket"
	case sys.S_IFCHR, sys.S_IFBLK:
		return "a device"
	case sys.S_IFLNK:
		return "a symlink"
	}
	return "not a file"
}

// PutFile implements bus.TurnBackend. It owns f.
func (d *Daemon) PutFile(ctx context.Context, agent, name string, f *os.File, by string) (string, error) {
	defer f.Close()
	saved, n, err := d.putFile(agent, name, f)
	what := name
	if saved != "" {
		what = saved
	}
	d.fileEvent(agent, bus.FilePut, what, n, err, by)
	return saved, err
}

func (d *Daemon) putFile(agent, name string, f *os.File) (string, uint64, error) {
	if err := CheckInboxName(name); err != nil {
		return "", 0, fmt.Errorf("%w: %v", bus.ErrInvalid, err)
	}
	if err := d.refuseQuarantined(agent); err != nil {
		return "", 0, err
	}
	// Only a regular file (or memfd) the caller opened: a pipe or socket
	// could keep caged reading forever.
	var st sys.Stat_t
	if err := sys.Fstat(int(f.Fd()), &st); err != nil {
		return "", 0, fmt.Errorf("%w: the descriptor: %v", bus.ErrInvalid, err)
	}
	if st.Mode&sys.S_IFMT != sys.S_IFREG {
		return "", 0, fmt.Errorf("%w: the descriptor is %s; pass a regular file or memfd", bus.ErrInvalid, fileKind(st.Mode))
	}
	if st.Size > bus.MaxFileBytes {
		return "", 0, fmt.Errorf("%w: the file is %d bytes, over the limit of %d bytes", bus.ErrInvalid, st.Size, bus.MaxFileBytes)
	}
	ws, err := d.openWorkspace(agent)
	if err != nil {
		return "", 0, err
	}
	defer ws.Close()
	final, n, err := saveInbox(ws, name, io.NewSectionReader(f, 0, bus.MaxFileBytes+1))
	if err != nil {
		return "", n, err
	}
	return paths.CageWorkspace + "/" + InboxDir + "/" + final, n, nil
}

// saveInbox writes r into ws/inbox under name or the next free variant,
// owned by the workspace's owner. The bytes go into an unnamed file
// (O_TMPFILE) that is linked into place only when complete; linking never
// replaces an existing name.
func saveInbox(ws *os.File, name string, r io.Reader) (string, uint64, error) {
	var wst sys.Stat_t
	if err := sys.Fstat(int(ws.Fd()), &wst); err != nil {
		return "", 0, fmt.Errorf("the workspace: %w", err)
	}
	inbox, err := openInbox(ws, wst.Uid, wst.Gid)
	if err != nil {
		return "", 0, err
	}
	defer inbox.Close()
	tfd, err := sys.Openat(int(inbox.Fd()), ".", sys.O_TMPFILE|sys.O_WRONLY|sys.O_CLOEXEC, 0o600)
	if err != nil {
		return "", 0, fmt.Errorf("inbox: an unnamed file (O_TMPFILE; does the workspace's file system support it?): %w", err)
	}
	tmp := os.NewFile(uintptr(tfd), "inbox upload")
	defer tmp.Close()
	n, err := io.Copy(tmp, r)
	if err == nil && n > bus.MaxFileBytes {
		err = fmt.Errorf("%w: the file grew past the limit of %d bytes while it was read", bus.ErrInvalid, bus.MaxFileBytes)
	}
	if err == nil {
		err = handOver(tfd, wst.Uid, wst.Gid)
	}
	if err == nil {
		err = sys.Fchmod(tfd, 0o644)
	}
	if err == nil {
		err = tmp.Sync()
	}
	if err != nil {
		return "", uint64(max(n, 0)), fmt.Errorf("inbox: write: %w", err)
	}
	for i := 0; i < maxInboxTries; i++ {
		cand := inboxCandidate(name, i)
		if len(cand) > 255 {
			break
		}
		err := sys.Linkat(sys.AT_FDCWD, "/proc/self/fd/"+strconv.Itoa(tfd), int(inbox.Fd()), cand, sys.AT_SYMLINK_FOLLOW)
		if errors.Is(err, sys.EEXIST) {
			continue
		}
		if err != nil {
			return "", uint64(n), fmt.Errorf("inbox: link %s: %w", cand, err)
		}
		return cand, uint64(n), nil
	}
	return "", uint64(n), fmt.Errorf("%w: inbox/%s and its next %d variants exist; rename the file", bus.ErrInvalid, name, maxInboxTries-1)
}

// openInbox opens ws/inbox, making it (owned by uid:gid, 0755) if missing.
// A symlink there, or anything but a directory, is refused, not followed.
func openInbox(ws *os.File, uid, gid uint32) (*os.File, error) {
	open := func() (int, error) {
		return beneath(ws, InboxDir, sys.O_RDONLY|sys.O_DIRECTORY|sys.O_NOFOLLOW, sys.RESOLVE_NO_SYMLINKS)
	}
	fd, err := open()
	if errors.Is(err, sys.ENOENT) {
		if err := sys.Mkdirat(int(ws.Fd()), InboxDir, 0o755); err != nil && !errors.Is(err, sys.EEXIST) {
			return nil, fmt.Errorf("make inbox/: %w", err)
		}
		fd, err = open()
		if err == nil {
			if err := handOver(fd, uid, gid); err != nil {
				sys.Close(fd)
				return nil, fmt.Errorf("inbox/: %w", err)
			}
			sys.Fchmod(fd, 0o755)
		}
	}
	switch {
	case errors.Is(err, sys.ELOOP):
		return nil, fmt.Errorf("%w: inbox/ in the workspace is a symlink; remove it (files are only put into a real directory)", bus.ErrInvalid)
	case errors.Is(err, sys.ENOTDIR):
		var st sys.Stat_t
		if sys.Fstatat(int(ws.Fd()), InboxDir, &st, sys.AT_SYMLINK_NOFOLLOW) == nil && st.Mode&sys.S_IFMT == sys.S_IFLNK {
			return nil, fmt.Errorf("%w: inbox/ in the workspace is a symlink; remove it (files are only put into a real directory)", bus.ErrInvalid)
		}
		return nil, fmt.Errorf("%w: inbox in the workspace is not a directory; remove or rename it", bus.ErrInvalid)
	case err != nil:
		return nil, fmt.Errorf("open inbox/: %w", err)
	}
	return os.NewFile(uintptr(fd), "inbox"), nil
}

// handOver gives a file caged made in a workspace to the workspace's
// owner. A caged whose unit predates docs/relay.md may not chown (its
// syscall filter); the file then stays root's, still readable by the
// agent (0644, 0755).
func handOver(fd int, uid, gid uint32) error {
	err := sys.Fchown(fd, int(uid), int(gid))
	if errors.Is(err, sys.EPERM) {
		return nil
	}
	return err
}

// fileEvent audits a file operation: the journal and the bus.
func (d *Daemon) fileEvent(agent, op, p string, n uint64, err error, by string) {
	outcome := "ok"
	if err != nil {
		outcome = err.Error()
		d.log.Warn("file transfer refused", "agent", agent, "op", op, "path", p, "by", by, "err", err)
	} else {
		d.log.Info("file transferred", "agent", agent, "op", op, "path", p, "bytes", n, "by", by)
	}
	d.emit(bus.SignalFileTransferred, agent, op, p, n, outcome, by)
}
