package relay

import (
	"archive/tar"
	"bufio"
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/nixcage/nixcage/internal/bus"
)

// A release comes as one document: a tar (optionally gzip-compressed) of
// a release directory, as `tar -C DIR -cf release.tar .` makes it. The
// relay unpacks it into a private directory and hands caged a descriptor
// of that directory, exactly as cagectl apply does (ApplyDir); caged
// verifies it as any other release. The relay trusts nothing in it, but it
// does bound what unpacking may cost.
const (
	maxReleaseEntries = 100000
	// unpackFactor bounds the unpacked size by the document's size limit.
	unpackFactor = 16
)

func (r *Relay) applyRelease(ctx context.Context, q *request) (string, string) {
	d := q.msg.Document
	f, err := r.download(ctx, d.FileID, d.FileSize)
	if err != nil {
		r.answer(ctx, q, "Refused: "+err.Error())
		return bus.RelayRefused, err.Error()
	}
	defer f.Close()
	dir, err := os.MkdirTemp(r.Tmp, "relay-release-")
	if err != nil {
		return r.refusal(ctx, q, "apply", err)
	}
	defer os.RemoveAll(dir)
	if err := untar(f, dir, unpackFactor*r.doc.MaxFileBytes); err != nil {
		r.answer(ctx, q, "Refused: the document is not a release archive: "+err.Error())
		return bus.RelayRefused, "unpack: " + err.Error()
	}
	rd, err := os.OpenFile(dir, os.O_RDONLY|unix.O_DIRECTORY, 0)
	if err != nil {
		return r.refusal(ctx, q, "apply", err)
	}
	defer rd.Close()
	res, err := r.caged.ApplyDir(ctx, rd)
	if err != nil {
		return r.refusal(ctx, q, "apply "+d.FileName, err)
	}
	msg := fmt.Sprintf("Release applied: generation %d (channel %s) is current, was %d; %d paths added, %d reused.", res.Generation, res.Channel, res.Previous, res.Added, res.Reused)
	for _, w := range res.Warnings {
		msg += "\nwarning: " + w
	}
	r.answer(ctx, q, msg)
	return bus.RelayOK, fmt.Sprintf("generation %d (was %d)", res.Generation, res.Previous)
}

// untar unpacks regular files and directories only (no links, devices or
// anything else), each inside dir, at most limit bytes in all.
func untar(src io.Reader, dir string, limit int64) error {
	br := bufio.NewReader(src)
	var in io.Reader = br
	if magic, _ := br.Peek(2); len(magic) == 2 && magic[0] == 0x1f && magic[1] == 0x8b {
		zr, err := gzip.NewReader(br)
		if err != nil {
			return err
		}
		defer zr.Close()
		in = zr
	}
	tr := tar.NewReader(in)
	var total int64
	for n := 0; ; n++ {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			if n == 0 {
				return fmt.Errorf("empty archive")
			}
			return nil
		}
		if err != nil {
			return err
		}
		if n >= maxReleaseEntries {
			return fmt.Errorf("more than %d entries", maxReleaseEntries)
		}
		name := path.Clean(strings.TrimPrefix(h.Name, "./"))
		if name == "." {
			continue
		}
		if path.IsAbs(name) || name == ".." || strings.HasPrefix(name, "../") {
			return fmt.Errorf("entry %q points outside the archive", h.Name)
		}
		dst := filepath.Join(dir, filepath.FromSlash(name))
		switch h.Typeflag {
		case tar.TypeDir:
			if err := os.MkdirAll(dst, 0o700); err != nil {
				return err
			}
		case tar.TypeReg:
			if total += h.Size; total > limit {
				return fmt.Errorf("unpacks to more than %d bytes", limit)
			}
			if err := os.MkdirAll(filepath.Dir(dst), 0o700); err != nil {
				return err
			}
			// O_EXCL: a second entry of the same name is refused, and
			// nothing already there is followed or overwritten.
			out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL|unix.O_NOFOLLOW, 0o600)
			if err != nil {
				return err
			}
			_, err = io.Copy(out, io.LimitReader(tr, h.Size))
			if cerr := out.Close(); err == nil {
				err = cerr
			}
			if err != nil {
				return err
			}
		default:
			return fmt.Errorf("entry %q is not a file or directory (type %q); a release holds only those", h.Name, h.Typeflag)
		}
	}
}
