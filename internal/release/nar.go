package release

import (
	"bufio"
	"crypto/sha256"
	"errors"
	"fmt"
	"hash"
	"io"
	"os"
	"path"
	"path/filepath"
	"slices"
	"sync/atomic"
	"syscall"

	"github.com/nix-community/go-nix/pkg/nar"
)

// NarStats counts what a NAR held.
type NarStats struct {
	// Root is the type of the NAR's root entry (nar.TypeDirectory, ...):
	// a release's top must be a directory, never a link a bind would follow.
	Root                  nar.NodeType
	Files, Dirs, Symlinks int
	Size                  int64 // NAR bytes read, trailing data included
	Digest                []byte
}

// hashReader hashes and counts every byte that passes, so the digest covers
// the whole stream, including anything after the NAR's closing token.
type hashReader struct {
	r     io.Reader
	h     hash.Hash
	n     int64
	abort atomic.Bool
}

var errAborted = errors.New("nar read aborted")

func (h *hashReader) Read(p []byte) (int, error) {
	if h.abort.Load() {
		return 0, errAborted
	}
	n, err := h.r.Read(p)
	h.h.Write(p[:n])
	h.n += int64(n)
	return n, err
}

// WriteError is a failure of the local file system while unpacking (out of
// space or inodes, read-only, I/O error): a fault of this machine, not of
// the release, so it must never be reported as a refusal.
type WriteError struct{ Err error }

func (e *WriteError) Error() string { return "write to the store's file system: " + e.Err.Error() }
func (e *WriteError) Unwrap() error { return e.Err }

// UnpackNAR parses the NAR in r, hashing every byte, and (if dst is not
// empty) recreates it at dst, which must not exist. It reads r to EOF.
//
// Confinement invariant: every entry is created by name inside a directory
// this function created itself moments before, with O_EXCL/O_NOFOLLOW, and
// names ".", "..", "" or containing "/" or NUL are refused. Symlinks are
// created as data and never followed, so no entry can land outside dst.
// Files get mode 0444 or 0555 and directories 0555 once their children are
// written (Nix's canonical permissions).
func UnpackNAR(r io.Reader, dst string) (NarStats, error) {
	return unpackNAR(r, dst, "")
}

// PathMax is Linux's PATH_MAX: the longest path, its NUL included, that a
// system call accepts.
const PathMax = 4096

// unpackNAR is UnpackNAR for the NAR of storePath ("/nix/store/<name>",
// empty if unknown): every entry, named as a cage sees it
// (storePath+entry), must be shorter than PathMax, or the NAR is refused
// (no program could open it). What was unpacked so far sits in the
// caller's work directory, which it removes; nothing reaches the store.
func unpackNAR(r io.Reader, dst, storePath string) (NarStats, error) {
	hr := &hashReader{r: r, h: sha256.New()}
	br := bufio.NewReaderSize(hr, 256<<10)
	st, err := unpack(br, hr, dst, storePath)
	if err != nil {
		return st, err
	}
	// Consume (and hash) anything after the NAR so the digest and size
	// describe the whole file; trailing garbage then fails the hash check.
	if _, err := io.Copy(io.Discard, br); err != nil {
		return st, err
	}
	st.Size = hr.n
	st.Digest = hr.h.Sum(nil)
	return st, nil
}

// tooLong is the refusal of an entry no system call can name.
func tooLong(p string, n int, where string) error {
	if len(p) > 64 {
		p = p[:64] + "..."
	}
	return fmt.Errorf("nar entry %q is %d bytes long %s, longer than PATH_MAX (%d): no program could open it; publish the path with a shallower tree", p, n, where, PathMax-1)
}

// nameError turns a failed create into a verdict when the name itself is
// what the kernel refused (ENAMETOOLONG: a component over NAME_MAX, or the
// path under this store's root over PATH_MAX): a property of the release,
// not a fault of this machine, so never a WriteError.
func nameError(p, target string, err error) error {
	if errors.Is(err, syscall.ENAMETOOLONG) {
		if len(target) >= PathMax {
			return tooLong(p, len(target), "where this store unpacks it")
		}
		// go-nix refuses names over 255 bytes (NAME_MAX on Linux file
		// systems), so this is a file system with a smaller limit.
		return fmt.Errorf("nar entry %q: this store's file system refuses its name as too long (ENAMETOOLONG)", p)
	}
	return &WriteError{Err: err}
}

func unpack(br io.Reader, hr *hashReader, dst, storePath string) (st NarStats, err error) {
	nr, err := nar.NewReader(br)
	if err != nil {
		return st, fmt.Errorf("read nar: %w", err)
	}
	defer func() {
		if err != nil {
			// go-nix's parser runs in a goroutine that keeps reading until
			// it fails; make the source fail and drain it so it exits.
			hr.abort.Store(true)
			for {
				if _, e := nr.Next(); e != nil {
					break
				}
			}
		}
		nr.Close()
	}()
	dirs := map[string]bool{}
	seen := map[string]bool{}
	var dirOrder []string
	buf := make([]byte, 256<<10)
	for {
		hdr, err := nr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return st, fmt.Errorf("read nar: %w", err)
		}
		if err := hdr.Validate(); err != nil {
			return st, fmt.Errorf("nar entry %q: %w", hdr.Path, err)
		}
		p := hdr.Path
		if seen[p] {
			return st, fmt.Errorf("nar entry %q appears twice: it escapes its store path (an entry named '.' or '..') or is a duplicate", p)
		}
		if p != "/" {
			parent, name := path.Dir(p), path.Base(p)
			if !dirs[parent] || name == "." || name == ".." || name == "/" || path.Join(parent, name) != p {
				return st, fmt.Errorf("nar entry %q escapes its store path or has no parent directory", p)
			}
		} else if len(seen) > 0 {
			return st, errors.New("nar has a second root entry")
		}
		seen[p] = true
		if storePath != "" && p != "/" && len(storePath)+len(p) >= PathMax {
			return st, tooLong(p, len(storePath)+len(p), "as "+storePath+"/...")
		}
		if p == "/" {
			st.Root = hdr.Type
		}
		target := ""
		if dst != "" {
			target = filepath.Join(dst, filepath.FromSlash(p))
		}
		switch hdr.Type {
		case nar.TypeDirectory:
			st.Dirs++
			dirs[p] = true
			if target != "" {
				if err := os.Mkdir(target, 0o755); err != nil {
					return st, nameError(p, target, err)
				}
				dirOrder = append(dirOrder, target)
			}
		case nar.TypeSymlink:
			st.Symlinks++
			if target != "" {
				if err := os.Symlink(hdr.LinkTarget, target); err != nil {
					return st, nameError(p, target, err)
				}
			}
		case nar.TypeRegular:
			st.Files++
			if target == "" {
				if _, err := io.CopyBuffer(io.Discard, nr, buf); err != nil {
					return st, fmt.Errorf("read nar: %w", err)
				}
				continue
			}
			mode := os.FileMode(0o444)
			if hdr.Executable {
				mode = 0o555
			}
			n, err := writeFile(target, mode, nr, buf)
			var we *WriteError
			if errors.As(err, &we) {
				if errors.Is(err, syscall.ENAMETOOLONG) {
					return st, nameError(p, target, err)
				}
				return st, err
			}
			if err != nil {
				return st, fmt.Errorf("unpack %s: %w", p, err)
			}
			if n != hdr.Size {
				return st, fmt.Errorf("nar entry %q: got %d bytes, header says %d", p, n, hdr.Size)
			}
		default:
			return st, fmt.Errorf("nar entry %q has unknown type %q", p, hdr.Type)
		}
	}
	// Children first, so a directory is made read-only only after nothing
	// more needs to be created in it.
	for _, d := range slices.Backward(dirOrder) {
		if err := os.Chmod(d, 0o555); err != nil {
			return st, &WriteError{Err: err}
		}
	}
	return st, nil
}
