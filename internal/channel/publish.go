package channel

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/nixcage/nixcage/internal/release"
)

// Published is what Publish did.
type Published struct {
	Channel    string
	Generation uint64
	Previous   uint64 // the index's generation before (0: a new channel)
	Copied     int    // cache files written
	Present    int    // cache files already there, byte-identical
}

// Publish lays the release directory rel (as `cagectl release create`
// writes it, already verified by the caller) out in the channel directory
// dir, in the order that keeps every poller's view consistent: the cache
// files (NARs first, then narinfos, nix-cache-info, key sets), then
// releases/<generation>/, and last channel.json, replaced by a rename.
// Every file is written under a temporary name and renamed, so a web
// server never serves a partial file.
//
// It refuses, before writing anything: a generation not above the
// channel's current one, another channel's release, and a cache file that
// exists with different bytes (a non-reproducible rebuild of a store path
// already published would break the older releases that list it).
func Publish(ctx context.Context, rel, dir string) (*Published, error) {
	raw, err := os.ReadFile(filepath.Join(rel, release.ManifestFile))
	if err != nil {
		return nil, fmt.Errorf("read the release: %w", err)
	}
	rawSig, err := os.ReadFile(filepath.Join(rel, release.SignaturesFile))
	if err != nil {
		return nil, fmt.Errorf("read the release's signatures: %w", err)
	}
	m, err := release.ParseManifest(raw)
	if err != nil {
		return nil, err
	}
	out := &Published{Channel: m.Channel, Generation: m.Generation}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("channel directory: %w", err)
	}
	if b, err := os.ReadFile(filepath.Join(dir, IndexFile)); err == nil {
		ix, err := ParseIndex(b)
		if err != nil {
			return nil, fmt.Errorf("the channel's current index: %w", err)
		}
		if ix.Channel != m.Channel {
			return nil, fmt.Errorf("the release is for channel %q, %s serves %q: publish it to a directory of its own", m.Channel, dir, ix.Channel)
		}
		if m.Generation <= ix.Generation {
			return nil, fmt.Errorf("the release's generation %d is not above the channel's %d: create it with --generation %d or higher", m.Generation, ix.Generation, ix.Generation+1)
		}
		out.Previous = ix.Generation
	} else if !errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("read the channel's index: %w", err)
	}

	files, err := cacheFiles(rel)
	if err != nil {
		return nil, err
	}
	var todo []string
	for _, f := range files {
		same, err := sameFile(filepath.Join(rel, f), filepath.Join(dir, f))
		if err != nil {
			return nil, err
		}
		if same {
			out.Present++
			continue
		}
		todo = append(todo, f)
	}
	for _, f := range todo {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		if err := copyAtomic(filepath.Join(rel, f), filepath.Join(dir, f)); err != nil {
			return nil, fmt.Errorf("publish %s: %w", f, err)
		}
		out.Copied++
	}
	rd := ReleaseDir(m.Generation)
	if err := os.MkdirAll(filepath.Join(dir, rd), 0o755); err != nil {
		return nil, fmt.Errorf("publish %s: %w", rd, err)
	}
	// Signatures before the manifest: a poller that sees the manifest sees
	// its signatures (the index is written later still, so none should look).
	if err := release.WriteFileAtomic(filepath.Join(dir, rd, release.SignaturesFile), rawSig, 0o644); err != nil {
		return nil, fmt.Errorf("publish %s: %w", rd, err)
	}
	if err := release.WriteFileAtomic(filepath.Join(dir, rd, release.ManifestFile), raw, 0o644); err != nil {
		return nil, fmt.Errorf("publish %s: %w", rd, err)
	}
	if err := emptyControlFeed(dir); err != nil {
		return nil, fmt.Errorf("publish %s/%s: %w", ControlsDir, ControlIndexFile, err)
	}
	ix := &Index{Schema: 1, Channel: m.Channel, Generation: m.Generation, Release: rd}
	b, err := ix.Marshal()
	if err != nil {
		return nil, err
	}
	if err := release.WriteFileAtomic(filepath.Join(dir, IndexFile), b, 0o644); err != nil {
		return nil, fmt.Errorf("publish %s: %w", IndexFile, err)
	}
	return out, nil
}

// emptyControlFeed writes an empty controls/index.json unless one exists,
// so every published channel has a feed index: an S3-style bucket answers
// 403, not 404, for a missing object, and a host must be able to tell "no
// commands" from "cannot read the feed".
func emptyControlFeed(dir string) error {
	p := filepath.Join(dir, ControlsDir, ControlIndexFile)
	if _, err := os.Stat(p); err == nil || !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		return err
	}
	return release.WriteFileAtomic(p, []byte("{\"schema\": 1, \"commands\": []}\n"), 0o644)
}

// cacheFiles lists the release's cache files in publishing order: NARs,
// narinfos, nix-cache-info, key sets (a narinfo never names a NAR that is
// not there yet).
func cacheFiles(rel string) ([]string, error) {
	var nars, infos, keys []string
	ents, err := os.ReadDir(rel)
	if err != nil {
		return nil, fmt.Errorf("read the release: %w", err)
	}
	for _, e := range ents {
		switch n := e.Name(); {
		case n == "nar" && e.IsDir():
			sub, err := os.ReadDir(filepath.Join(rel, n))
			if err != nil {
				return nil, err
			}
			for _, s := range sub {
				if s.Type().IsRegular() {
					nars = append(nars, "nar/"+s.Name())
				}
			}
		case n == release.KeySetDir && e.IsDir():
			sub, err := os.ReadDir(filepath.Join(rel, n))
			if err != nil {
				return nil, err
			}
			for _, s := range sub {
				if s.Type().IsRegular() {
					keys = append(keys, release.KeySetDir+"/"+s.Name())
				}
			}
		case strings.HasSuffix(n, ".narinfo") && e.Type().IsRegular():
			infos = append(infos, n)
		}
	}
	if len(infos) == 0 {
		return nil, fmt.Errorf("%s has no narinfo: is it a release made by `cagectl release create`?", rel)
	}
	slices.Sort(nars)
	slices.Sort(infos)
	// Signatures of a key set before the set itself, as a store records them.
	slices.SortFunc(keys, func(a, b string) int {
		as, bs := strings.HasSuffix(a, ".sig"), strings.HasSuffix(b, ".sig")
		if as != bs {
			if as {
				return -1
			}
			return 1
		}
		return strings.Compare(a, b)
	})
	files := append(nars, infos...)
	files = append(files, "nix-cache-info")
	return append(files, keys...), nil
}

// sameFile reports whether dst exists with src's bytes; a dst with other
// bytes is an error (see Publish).
func sameFile(src, dst string) (bool, error) {
	di, err := os.Stat(dst)
	if errors.Is(err, fs.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	if filepath.Base(filepath.Dir(dst)) == "nar" {
		// A NAR's name is the hash of its bytes (Nix's FileHash): the
		// same name and size is the same file, without reading GiBs.
		si, err := os.Stat(src)
		if err != nil {
			return false, err
		}
		if si.Size() != di.Size() {
			return false, fmt.Errorf("%s is already in the channel with a different size: remove the partial copy and publish again", dst)
		}
		return true, nil
	}
	b, err := os.ReadFile(dst)
	if err != nil {
		return false, err
	}
	a, err := os.ReadFile(src)
	if err != nil {
		return false, err
	}
	if !bytes.Equal(a, b) {
		return false, fmt.Errorf("%s is already in the channel with different content (a rebuild that is not reproducible, or another channel's cache): give the closure a new store path, or publish to a fresh directory", dst)
	}
	return true, nil
}

// copyAtomic copies src to dst through a synced temporary file and a rename.
func copyAtomic(src, dst string) error {
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		return err
	}
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	return release.WriteAtomicFrom(dst, in, 0o644)
}
