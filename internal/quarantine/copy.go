package quarantine

import (
	"cmp"
	"crypto/sha256"
	"errors"
	"fmt"
	"hash"
	"io"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"golang.org/x/sys/unix"
)

// Limits bound the workspace copy of one agent's evidence. The agent owns
// its workspace and chooses what is in it; without bounds a sparse file of
// a terabyte or a million empty files would keep caged busy and fill the
// evidence disk. What a bound leaves out is named in omitted.txt.
type Limits struct {
	// MaxBytes is how much file content is copied, holes included: a hole
	// costs no disk in the evidence (it stays a hole) but it is hashed,
	// and hashing zeros takes as long as hashing data.
	MaxBytes int64
	// MaxEntries is how many workspace entries (files, directories,
	// symlinks, skipped specials) are looked at.
	MaxEntries int
	// MaxDuration bounds the whole workspace copy.
	MaxDuration time.Duration
}

// Defaults for Limits; caged's --evidence-* flags override them.
const (
	DefaultMaxBytes    = 1 << 30
	DefaultMaxEntries  = 100_000
	DefaultMaxDuration = 2 * time.Minute
	// MaxPathLen bounds an evidence-relative name: deeper entries are
	// recorded and skipped, so every copied file stays openable by path
	// (PATH_MAX is 4096) and `sha256sum -c` can check it.
	MaxPathLen = 3072
)

func (l Limits) withDefaults() Limits {
	if l.MaxBytes <= 0 {
		l.MaxBytes = DefaultMaxBytes
	}
	if l.MaxEntries <= 0 {
		l.MaxEntries = DefaultMaxEntries
	}
	if l.MaxDuration <= 0 {
		l.MaxDuration = DefaultMaxDuration
	}
	return l
}

// walker copies a workspace relative to open directory descriptors
// (openat, fstatat, mkdirat, all with O_NOFOLLOW semantics), never by
// joined path: a path the agent made too long, or a symlink it swapped in
// mid-walk, cannot redirect or end the copy. Every problem with one entry
// is recorded in omitted.txt and the walk goes on.
type walker struct {
	lim      Limits
	deadline time.Time
	m        *manifest

	bytes   int64 // content bytes copied (holes included)
	entries int
	stopped string // why the walk ended early, "" if it did not

	srcPath []string  // names of the directories being walked
	dstPath []string  // the same, as named in the evidence
	large   []pending // files copied after the walk

	links   strings.Builder // symlinks.txt
	omitted strings.Builder // omitted.txt
	names   strings.Builder // names.txt: evidence name <- original name
	nOmit   int
}

func (w *walker) omit(rel, why string) {
	w.nOmit++
	fmt.Fprintf(&w.omitted, "%s: %s\n", strconv.Quote(rel), why)
}

// budget reports whether the walk may look at one more entry, and stops it
// (recording why, once) when a bound is reached.
func (w *walker) budget() bool {
	if w.stopped != "" {
		return false
	}
	switch {
	case w.entries >= w.lim.MaxEntries:
		w.stopped = fmt.Sprintf("entry cap of %d reached", w.lim.MaxEntries)
	case time.Now().After(w.deadline):
		w.stopped = fmt.Sprintf("time limit of %s reached", w.lim.MaxDuration)
	default:
		w.entries++
		return true
	}
	w.nOmit++
	fmt.Fprintf(&w.omitted, "# walk stopped: %s; entries not yet visited were not copied\n", w.stopped)
	return false
}

// dir copies the entries of the open source directory src into the open
// evidence directory dst. rel and erel are the directory's names (the
// agent's and the evidence's) relative to the evidence root.
func (w *walker) dir(src, dst int, rel, erel string) {
	// Never list more names than the entry cap lets the walk visit.
	names, err := readDirNames(src, w.lim.MaxEntries-w.entries+1)
	if err != nil {
		w.omit(rel+"/", "listing incomplete: "+err.Error())
	}
	// Sorted, so which files a cap cuts does not depend on the file
	// system's directory order.
	sort.Strings(names)
	for _, name := range names {
		if !w.budget() {
			return
		}
		w.entry(src, dst, name, rel+"/"+name, erel)
	}
}

func (w *walker) entry(src, dst int, name, rel, eparent string) {
	ename := safeName(name)
	erel := eparent + "/" + ename
	if len(erel) > MaxPathLen {
		w.omit(rel, fmt.Sprintf("name longer than %d bytes, not copied", MaxPathLen))
		return
	}
	var st unix.Stat_t
	if err := unix.Fstatat(src, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		w.omit(rel, "stat: "+err.Error())
		return
	}
	kind := st.Mode & unix.S_IFMT
	if kind != unix.S_IFDIR && kind != unix.S_IFLNK && kind != unix.S_IFREG {
		w.omit(rel, fileType(kind)+", not copied")
		return
	}
	// An encoded name must not take the name of a real entry (which keeps
	// its own) or of another encoded one.
	if ename != name {
		base := ename
		for i := 1; exists(src, ename) || exists(dst, ename); i++ {
			ename = fmt.Sprintf("%s~%d", base, i)
		}
		erel = eparent + "/" + ename
	}
	if err := w.create(src, dst, name, ename, rel, erel, &st); err != nil {
		w.omit(rel, err.Error())
		return
	}
	if ename != name {
		fmt.Fprintf(&w.names, "%s <- %s\n", strconv.Quote(erel), strconv.Quote(rel))
	}
}

func exists(dir int, name string) bool {
	var st unix.Stat_t
	return unix.Fstatat(dir, name, &st, unix.AT_SYMLINK_NOFOLLOW) == nil
}

func (w *walker) create(src, dst int, name, ename, rel, erel string, st *unix.Stat_t) error {
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFDIR:
		if err := unix.Mkdirat(dst, ename, 0o700); err != nil {
			return err
		}
		sfd, err := unix.Openat(src, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("open directory: %w (kept empty)", err)
		}
		defer unix.Close(sfd)
		dfd, err := unix.Openat(dst, ename, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("open evidence directory: %w", err)
		}
		defer unix.Close(dfd)
		w.srcPath, w.dstPath = append(w.srcPath, name), append(w.dstPath, ename)
		w.dir(sfd, dfd, rel, erel)
		w.srcPath, w.dstPath = w.srcPath[:len(w.srcPath)-1], w.dstPath[:len(w.dstPath)-1]
		return nil
	case unix.S_IFLNK:
		target, err := readlinkat(src, name)
		if err != nil {
			return fmt.Errorf("readlink: %w", err)
		}
		if err := unix.Symlinkat(target, dst, ename); err != nil {
			return err
		}
		fmt.Fprintf(&w.links, "%s -> %s\n", strconv.Quote(erel), strconv.Quote(target))
		return nil
	default:
		return w.file(src, dst, name, ename, rel, erel, st)
	}
}

// SmallFile is the size up to which a file is copied as the walk meets it.
// Larger files are copied after the walk, smallest first, so the byte cap
// cuts the largest files, never the agent's notes and code.
const SmallFile = 1 << 20

// pending is a large file whose placeholder exists in the evidence.
type pending struct {
	srcDir, dstDir []string // directory names from the workspace root
	name, ename    string
	rel, erel      string
	size           int64
	dev, ino       uint64
}

// file copies one regular file, or leaves a placeholder for the second
// pass if it is large.
func (w *walker) file(src, dst int, name, ename, rel, erel string, st *unix.Stat_t) error {
	in, fst, err := openRegular(src, name, st)
	if err != nil {
		return err
	}
	defer unix.Close(in)
	// setuid/setgid/sticky bits are dropped and the owner may always read.
	mode := uint32(fst.Mode)&0o700 | 0o400
	out, err := unix.Openat(dst, ename, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, mode)
	if err != nil {
		return err
	}
	defer unix.Close(out)
	if fst.Size > SmallFile {
		w.large = append(w.large, pending{
			srcDir: slices.Clone(w.srcPath), dstDir: slices.Clone(w.dstPath), name: name, ename: ename,
			rel: rel, erel: erel, size: fst.Size, dev: fst.Dev, ino: fst.Ino,
		})
		return nil
	}
	w.fill(in, out, fst.Size, rel, erel)
	return nil
}

// openRegular opens name in dir for reading if it is still the regular
// file st describes. O_NONBLOCK: if the agent swapped a FIFO in after the
// fstatat, the open must not hang; the fstat then refuses it.
func openRegular(dir int, name string, st *unix.Stat_t) (int, *unix.Stat_t, error) {
	in, err := unix.Openat(dir, name, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_NOCTTY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, nil, fmt.Errorf("open: %w", err)
	}
	var fst unix.Stat_t
	if err := unix.Fstat(in, &fst); err != nil {
		unix.Close(in)
		return -1, nil, fmt.Errorf("stat: %w", err)
	}
	if fst.Mode&unix.S_IFMT != unix.S_IFREG || fst.Ino != st.Ino || fst.Dev != st.Dev {
		unix.Close(in)
		return -1, nil, errors.New("changed while copying, not copied")
	}
	return in, &fst, nil
}

// fill copies in to the evidence file out (holes kept, byte cap applied)
// and lists it in the manifest. A failed copy leaves it empty, listed, and
// named in omitted.txt.
func (w *walker) fill(in, out int, size int64, rel, erel string) {
	keep := min(size, w.lim.MaxBytes-w.bytes)
	h := sha256.New()
	n, err := copySparse(in, out, keep, h)
	if err == nil {
		err = unix.Ftruncate(out, n)
	}
	if err == nil {
		err = unix.Fsync(out)
	}
	if err != nil {
		unix.Ftruncate(out, 0)
		empty := sha256.Sum256(nil)
		w.m.add(erel, empty[:], 0)
		w.omit(rel, fmt.Sprintf("copy failed, kept empty: %v", err))
		return
	}
	w.bytes += n
	w.m.add(erel, h.Sum(nil), n)
	switch {
	case n < keep:
		w.omit(rel, fmt.Sprintf("shrank while copying: kept %d of %d bytes", n, size))
	case keep < size:
		w.omit(rel, fmt.Sprintf("truncated: kept the first %d of %d bytes (evidence byte cap %d reached)", keep, size, w.lim.MaxBytes))
	}
}

// copyLarge fills the placeholders of large files, smallest first, each
// reopened relative to the workspace root one O_NOFOLLOW component at a
// time.
func (w *walker) copyLarge(srcRoot, dstRoot int) {
	slices.SortStableFunc(w.large, func(a, b pending) int { return cmp.Compare(a.size, b.size) })
	for _, p := range w.large {
		if w.stopped == "" && time.Now().After(w.deadline) {
			w.stopped = fmt.Sprintf("time limit of %s reached", w.lim.MaxDuration)
		}
		if w.stopped != "" {
			empty := sha256.Sum256(nil)
			w.m.add(p.erel, empty[:], 0)
			w.omit(p.rel, fmt.Sprintf("not copied, kept empty (%d bytes): %s", p.size, w.stopped))
			continue
		}
		if err := w.copyPending(srcRoot, dstRoot, p); err != nil {
			empty := sha256.Sum256(nil)
			w.m.add(p.erel, empty[:], 0)
			w.omit(p.rel, fmt.Sprintf("copy failed, kept empty: %v", err))
		}
	}
}

func (w *walker) copyPending(srcRoot, dstRoot int, p pending) error {
	sdir, err := openDirPath(srcRoot, p.srcDir)
	if err != nil {
		return err
	}
	defer unix.Close(sdir)
	ddir, err := openDirPath(dstRoot, p.dstDir)
	if err != nil {
		return err
	}
	defer unix.Close(ddir)
	in, _, err := openRegular(sdir, p.name, &unix.Stat_t{Mode: unix.S_IFREG, Dev: p.dev, Ino: p.ino})
	if err != nil {
		return err
	}
	defer unix.Close(in)
	out, err := unix.Openat(ddir, p.ename, unix.O_WRONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(out)
	w.fill(in, out, p.size, p.rel, p.erel)
	return nil
}

// openDirPath opens the directory names[0]/names[1]/... under root, each
// component with O_NOFOLLOW.
func openDirPath(root int, names []string) (int, error) {
	fd, err := unix.Openat(root, ".", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, err
	}
	for _, n := range names {
		next, err := unix.Openat(fd, n, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		unix.Close(fd)
		if err != nil {
			return -1, fmt.Errorf("reopen directory: %w", err)
		}
		fd = next
	}
	return fd, nil
}

var zeros = make([]byte, 64<<10)

// copySparse copies the first limit bytes of in to the same offsets of out,
// writing only data extents, and hashes all of it (holes as zeros). It
// returns how many bytes were covered (less than limit if in shrank).
func copySparse(in, out int, limit int64, h hash.Hash) (int64, error) {
	buf := make([]byte, 1<<20)
	var off int64
	for off < limit {
		data, err := unix.Seek(in, off, unix.SEEK_DATA)
		switch {
		case errors.Is(err, unix.ENXIO):
			data = limit // only a hole remains
		case err != nil:
			data = off // no SEEK_DATA here: treat everything as data
		}
		data = min(data, limit)
		hashZeros(h, data-off)
		off = data
		if off >= limit {
			break
		}
		end, err := unix.Seek(in, off, unix.SEEK_HOLE)
		if err != nil {
			end = limit
		}
		end = min(end, limit)
		for off < end {
			k, err := unix.Pread(in, buf[:min(int64(len(buf)), end-off)], off)
			if err == unix.EINTR {
				continue
			}
			if err != nil {
				return off, err
			}
			if k == 0 {
				return off, nil // the file shrank
			}
			if _, err := unix.Pwrite(out, buf[:k], off); err != nil {
				return off, err
			}
			h.Write(buf[:k])
			off += int64(k)
		}
	}
	return off, nil
}

func hashZeros(h io.Writer, n int64) {
	for n > 0 {
		k := min(n, int64(len(zeros)))
		h.Write(zeros[:k])
		n -= k
	}
}

// safeName returns name as it is stored in the evidence: unchanged if every
// rune is printable UTF-8, otherwise with each offending byte (controls,
// invalid UTF-8, and '%' itself) written as %XX. GNU sha256sum -c prints
// names raw, so a control byte in a manifest name would reach the
// operator's terminal; names.txt maps encoded names back to the original.
func safeName(name string) string {
	ok := true
	for _, r := range name {
		if r == utf8.RuneError || !unicode.IsPrint(r) {
			ok = false
			break
		}
	}
	if ok {
		return name
	}
	var b strings.Builder
	for i := 0; i < len(name); {
		r, n := utf8.DecodeRuneInString(name[i:])
		if (r == utf8.RuneError && n <= 1) || !unicode.IsPrint(r) || r == '%' {
			for _, c := range []byte(name[i : i+n]) {
				fmt.Fprintf(&b, "%%%02X", c)
			}
		} else {
			b.WriteString(name[i : i+n])
		}
		i += n
	}
	return b.String()
}

func fileType(kind uint32) string {
	switch kind {
	case unix.S_IFIFO:
		return "fifo"
	case unix.S_IFSOCK:
		return "socket"
	case unix.S_IFCHR:
		return "character device"
	case unix.S_IFBLK:
		return "block device"
	}
	return fmt.Sprintf("file type %#o", kind)
}

// readDirNames lists at most max names of a directory descriptor, reading
// through a fresh descriptor so fd's own offset is untouched.
func readDirNames(fd, max int) ([]string, error) {
	dup, err := unix.Openat(fd, ".", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	defer unix.Close(dup)
	var names []string
	buf := make([]byte, 32<<10)
	for {
		n, err := unix.Getdents(dup, buf)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return names, err
		}
		if n <= 0 || len(names) >= max {
			return names, nil
		}
		_, _, names = unix.ParseDirent(buf[:n], max-len(names), names)
	}
}

func readlinkat(dir int, name string) (string, error) {
	for size := 256; ; size *= 2 {
		buf := make([]byte, size)
		n, err := unix.Readlinkat(dir, name, buf)
		if err != nil {
			return "", err
		}
		if n < size {
			return string(buf[:n]), nil
		}
	}
}
