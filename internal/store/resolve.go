package store

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// ErrEscapes is returned (wrapped) when a bind source would leave the store.
var ErrEscapes = errors.New("bind source does not resolve inside the store")

// BindSources are the host paths a cage may bind from this store, resolved
// so that no symlink remains in them: Store is ROOT/nix/store (bound at
// /nix/store) and Tools the current generation's top directory (bound at
// /nix/tools), empty while the store has no current generation.
type BindSources struct {
	Store string
	Tools string
}

// ResolveBinds resolves the store's bind sources the way a mount would, but
// refusing every step a mount would take outside the store: ROOT/nix/store
// must be a real directory reached through no symlink at all, and
// current/top must resolve beneath ROOT (openat2 RESOLVE_BENEATH: no
// absolute link, no ".." above ROOT, no /proc magic link) to a directory
// that is a direct child of ROOT/nix/store. A bind of the returned paths
// cannot follow a link out of the store, since they contain none.
//
// Apply refuses a top that is not a directory; this is the second wall, for
// a store changed after apply (by anything but apply).
func ResolveBinds(root string) (BindSources, error) {
	rfd, err := unix.Open(root, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if errors.Is(err, unix.ENOENT) {
		return BindSources{}, nil // no store yet: cages start without tools
	}
	if err != nil {
		return BindSources{}, fmt.Errorf("open store root %s: %w", root, err)
	}
	defer unix.Close(rfd)
	rootReal, err := fdPath(rfd)
	if err != nil {
		return BindSources{}, err
	}
	sfd, err := openBeneath(rfd, "nix/store", unix.RESOLVE_NO_SYMLINKS)
	if errors.Is(err, unix.ENOSYS) {
		// No openat2 (kernel before 5.6, or a seccomp filter that does not
		// know it, as systemd 252's @system-service): check the layout.
		return resolveByLayout(root)
	}
	if errors.Is(err, unix.ENOENT) {
		return BindSources{}, nil
	}
	if err != nil {
		return BindSources{}, fmt.Errorf("%w: %s/nix/store: %w; restore it as a plain directory (cagectl store verify)", ErrEscapes, root, err)
	}
	defer unix.Close(sfd)
	storeReal, err := fdPath(sfd)
	if err != nil {
		return BindSources{}, err
	}
	if storeReal != filepath.Join(rootReal, "nix", "store") {
		return BindSources{}, fmt.Errorf("%w: %s/nix/store is %s", ErrEscapes, root, storeReal)
	}
	out := BindSources{Store: storeReal}
	if _, err := os.Lstat(filepath.Join(root, currentLink)); errors.Is(err, fs.ErrNotExist) {
		return out, nil
	}
	tfd, err := openBeneath(rfd, currentLink+"/"+topLink, 0)
	if err != nil {
		return out, fmt.Errorf("%w: %s/current/top: %w; run `cagectl store verify` and roll back or re-apply", ErrEscapes, root, err)
	}
	defer unix.Close(tfd)
	toolsReal, err := fdPath(tfd)
	if err != nil {
		return out, err
	}
	if filepath.Dir(toolsReal) != storeReal {
		return out, fmt.Errorf("%w: %s/current/top resolves to %s, not a store path under %s", ErrEscapes, root, toolsReal, storeReal)
	}
	out.Tools = toolsReal
	return out, nil
}

// useOpenat2 is false in tests of the fallback.
var useOpenat2 = true

// openBeneath opens a directory under dirfd without ever leaving it.
func openBeneath(dirfd int, name string, resolve uint64) (int, error) {
	if !useOpenat2 {
		return -1, unix.ENOSYS
	}
	for {
		fd, err := unix.Openat2(dirfd, name, &unix.OpenHow{
			Flags:   unix.O_PATH | unix.O_DIRECTORY | unix.O_CLOEXEC,
			Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_MAGICLINKS | resolve,
		})
		if errors.Is(err, unix.EAGAIN) || errors.Is(err, unix.EINTR) {
			continue // a concurrent rename elsewhere; retry as the man page says
		}
		switch {
		case errors.Is(err, unix.EXDEV):
			return -1, errors.New("a link leads out of the store")
		case errors.Is(err, unix.ELOOP):
			return -1, errors.New("a symlink is in the way")
		case errors.Is(err, unix.ENOTDIR):
			return -1, errors.New("not a directory")
		}
		return fd, err
	}
}

func fdPath(fd int) (string, error) {
	p, err := os.Readlink("/proc/self/fd/" + strconv.Itoa(fd))
	if err != nil {
		return "", fmt.Errorf("resolve bind source: %w", err)
	}
	return p, nil
}

// resolveByLayout is ResolveBinds without openat2: every link on the way
// must be exactly what apply writes (current -> generations/N, top ->
// ../../nix/store/NAME) and every directory a real one, so nothing a bind
// follows can lead out of the store.
func resolveByLayout(root string) (BindSources, error) {
	root, err := filepath.Abs(root)
	if err != nil {
		return BindSources{}, err
	}
	for _, d := range []string{"nix", "nix/store"} {
		fi, err := os.Lstat(filepath.Join(root, d))
		if errors.Is(err, fs.ErrNotExist) {
			return BindSources{}, nil
		}
		if err != nil || !fi.IsDir() {
			return BindSources{}, fmt.Errorf("%w: %s/%s is not a plain directory; restore it (cagectl store verify)", ErrEscapes, root, d)
		}
	}
	out := BindSources{Store: filepath.Join(root, "nix", "store")}
	cur, err := os.Readlink(filepath.Join(root, currentLink))
	if errors.Is(err, fs.ErrNotExist) {
		return out, nil
	}
	n, perr := strconv.ParseUint(strings.TrimPrefix(cur, genDir+"/"), 10, 64)
	if err != nil || perr != nil || cur != genDir+"/"+strconv.FormatUint(n, 10) {
		return out, fmt.Errorf("%w: %s/current is %q, not generations/N", ErrEscapes, root, cur)
	}
	gen := filepath.Join(root, genDir, strconv.FormatUint(n, 10))
	if fi, err := os.Lstat(gen); err != nil || !fi.IsDir() {
		return out, fmt.Errorf("%w: %s is not a plain directory", ErrEscapes, gen)
	}
	top, err := os.Readlink(filepath.Join(gen, topLink))
	name, ok := strings.CutPrefix(top, "../../nix/store/")
	if err != nil || !ok || name == "" || name == "." || name == ".." || strings.Contains(name, "/") {
		return out, fmt.Errorf("%w: %s/top is %q, not ../../nix/store/NAME", ErrEscapes, gen, top)
	}
	tools := filepath.Join(out.Store, name)
	if fi, err := os.Lstat(tools); err != nil || !fi.IsDir() {
		return out, fmt.Errorf("%w: %s is not a directory", ErrEscapes, tools)
	}
	out.Tools = tools
	return out, nil
}
