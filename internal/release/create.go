package release

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"time"

	"github.com/nix-community/go-nix/pkg/narinfo"
	"github.com/nix-community/go-nix/pkg/storepath"
)

// CreateOptions describe a release to build from the local Nix store.
type CreateOptions struct {
	StorePath   string // top-level store path (or a symlink to one, like ./result)
	Keys        []*PrivateKey
	Channel     string
	Generation  uint64
	Expires     time.Time
	Out         string // release directory; created if missing
	Compression string // "xz" (Nix's default) or "none"
	Nix         string // nix binary; "" means "nix" from PATH
	Now         time.Time
}

// Create copies the closure of StorePath into Out with `nix copy --to
// file://Out`, builds the manifest from the narinfo files Nix wrote, checks
// every NAR against them, and writes the signed manifest.
func Create(ctx context.Context, o CreateOptions) (*Manifest, error) {
	if len(o.Keys) == 0 {
		return nil, errors.New("no signing key: pass --key KEY (from `cagectl key generate`)")
	}
	if !ValidChannel(o.Channel) {
		return nil, fmt.Errorf("channel %q is invalid: use lowercase letters, digits, '.', '_' or '-'", o.Channel)
	}
	if o.Generation == 0 {
		return nil, errors.New("generation must be at least 1 and higher than the last release on this channel")
	}
	now := o.Now
	if now.IsZero() {
		now = time.Now()
	}
	now = now.UTC().Truncate(time.Second)
	if !o.Expires.After(now) {
		return nil, fmt.Errorf("expires %s is not in the future", o.Expires.UTC().Format(time.RFC3339))
	}
	switch o.Compression {
	case "":
		o.Compression = "xz"
	case "xz", "none":
	default:
		return nil, fmt.Errorf("compression %q is not supported: use xz or none", o.Compression)
	}
	top, err := resolveStorePath(o.StorePath)
	if err != nil {
		return nil, err
	}
	out, err := filepath.Abs(o.Out)
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(out, 0o755); err != nil {
		return nil, fmt.Errorf("create release directory: %w", err)
	}
	nix := o.Nix
	if nix == "" {
		nix = "nix"
	}
	cmd := exec.CommandContext(ctx, nix, "--extra-experimental-features", "nix-command",
		"copy", "--to", "file://"+out+"?compression="+o.Compression, top)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil {
		return nil, fmt.Errorf("nix copy: %w: %s", err, strings.TrimSpace(stderr.String()))
	}

	m := &Manifest{
		Schema: Schema, Channel: o.Channel, Generation: o.Generation,
		Created: now, Expires: o.Expires.UTC(), Top: top,
	}
	// Walk the closure through the narinfo files, so the manifest lists
	// exactly what the cache holds for this top-level path and nothing else
	// an earlier copy may have left in Out.
	src := DirSource(out)
	queue, seen := []string{top}, map[string]bool{top: true}
	for len(queue) > 0 {
		p := queue[0]
		queue = queue[1:]
		sp, err := storepath.FromAbsolutePath(p)
		if err != nil {
			return nil, err
		}
		raw, err := ReadFile(ctx, src, sp.String()[:32]+".narinfo", MaxNarinfoSize)
		if err != nil {
			return nil, fmt.Errorf("read narinfo of %s: %w", p, err)
		}
		ni, err := narinfo.Parse(bytes.NewReader(raw))
		if err != nil {
			return nil, fmt.Errorf("parse narinfo of %s: %w", p, err)
		}
		if ni.NarHash == nil {
			return nil, fmt.Errorf("narinfo of %s has no NarHash", p)
		}
		pi := PathInfo{Path: p, NarHash: formatNarHash(ni.NarHash.Digest()), NarSize: ni.NarSize, References: []string{}}
		for _, r := range ni.References {
			abs := storepath.StoreDir + "/" + r
			pi.References = append(pi.References, abs)
			if !seen[abs] {
				seen[abs] = true
				queue = append(queue, abs)
			}
		}
		slices.Sort(pi.References)
		m.Paths = append(m.Paths, pi)
	}
	slices.SortFunc(m.Paths, func(a, b PathInfo) int { return strings.Compare(a.Path, b.Path) })
	if err := m.Validate(); err != nil {
		return nil, err
	}
	// Never sign what we have not checked: re-hash every NAR Nix wrote.
	rel := &Release{Src: src, Manifest: m}
	if _, err := rel.VerifyAll(ctx, runtime.GOMAXPROCS(0)); err != nil {
		return nil, fmt.Errorf("check cache before signing: %w", err)
	}
	raw, err := m.Marshal()
	if err != nil {
		return nil, err
	}
	sigs, err := Sign(raw, o.Keys)
	if err != nil {
		return nil, err
	}
	rawSig, err := sigs.Marshal()
	if err != nil {
		return nil, err
	}
	// Signatures first: a reader that finds a manifest always finds the
	// signatures that belong to it, never an older file.
	if err := os.Remove(filepath.Join(out, ManifestFile)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, err
	}
	if err := WriteFileAtomic(filepath.Join(out, SignaturesFile), rawSig, 0o644); err != nil {
		return nil, err
	}
	if err := WriteFileAtomic(filepath.Join(out, ManifestFile), raw, 0o644); err != nil {
		return nil, err
	}
	return m, nil
}

// resolveStorePath turns ./result or a path inside a store path into the
// top-level store path.
func resolveStorePath(p string) (string, error) {
	if p == "" {
		return "", errors.New("no store path given")
	}
	real := p
	if !strings.HasPrefix(p, storepath.StoreDir+"/") || strings.Count(p, "/") > 3 {
		r, err := filepath.EvalSymlinks(p)
		if err != nil {
			return "", fmt.Errorf("store path: %w", err)
		}
		real = r
	}
	rest, ok := strings.CutPrefix(real, storepath.StoreDir+"/")
	if !ok {
		return "", fmt.Errorf("%s is not in %s: build it with Nix first (nix-build / nix build)", p, storepath.StoreDir)
	}
	top := storepath.StoreDir + "/" + strings.SplitN(rest, "/", 2)[0]
	if err := storepath.Validate(top); err != nil {
		return "", fmt.Errorf("%s: %w", p, err)
	}
	return top, nil
}

// WriteFileAtomic writes data to path via a synced temporary file and a
// rename, then syncs the directory, so path holds either the old or the new
// content after a crash.
func WriteFileAtomic(path string, data []byte, mode os.FileMode) error {
	return WriteAtomicFrom(path, bytes.NewReader(data), mode)
}

// WriteAtomicFrom is WriteFileAtomic for content streamed from r.
func WriteAtomicFrom(path string, r io.Reader, mode os.FileMode) error {
	dir := filepath.Dir(path)
	f, err := os.CreateTemp(dir, ".tmp-"+filepath.Base(path)+"-*")
	if err != nil {
		return err
	}
	tmp := f.Name()
	defer os.Remove(tmp)
	if _, err := io.Copy(f, r); err != nil {
		f.Close()
		return err
	}
	if err := f.Chmod(mode); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	if err := os.Rename(tmp, path); err != nil {
		return err
	}
	return SyncDir(dir)
}

// SyncDir fsyncs a directory so renames and creations in it are durable.
func SyncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}
