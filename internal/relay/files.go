package relay

import (
	"context"
	"fmt"
	"io"
	"os"
	"path"
	"strings"
	"unicode/utf8"

	"github.com/nixcage/nixcage/internal/bus"
)

func addFileCommands(cs map[string]command) {
	cs["get"] = command{"PATH", "a file from the agent's workspace, as a document", cmdGet}
}

func cmdGet(ctx context.Context, r *Relay, q *request, args string) (string, string) {
	p := strings.TrimSpace(args)
	if p == "" {
		r.answer(ctx, q, "/get PATH: a path in the agent's workspace, such as /get out/report.md")
		return bus.RelayRefused, "usage"
	}
	// caged checks the path (inside the workspace, a regular file, within
	// the limit) and hands over a sealed snapshot.
	f, size, err := r.caged.GetFile(ctx, q.agent, p, uint64(r.doc.MaxFileBytes))
	if err != nil {
		return r.refusal(ctx, q, "get "+p, err)
	}
	defer f.Close()
	name := path.Base(p)
	err = r.tg.SendDocument(ctx, q.to, name, fmt.Sprintf("%s: %s (%d bytes)", q.agent, p, size), func() (io.ReadCloser, error) {
		// Each attempt reads from the start: a 429 retry sends it whole.
		return io.NopCloser(io.NewSectionReader(f, 0, int64(size))), nil
	})
	if err != nil {
		r.log.Warn("send file", "path", p, "err", err)
		return bus.RelayFailed, "send: " + err.Error()
	}
	return bus.RelayOK, fmt.Sprintf("%s (%d bytes)", p, size)
}

// safeName checks an uploaded file's name as the relay passes it on: a
// plain file name (caged checks again and never overwrites).
func safeName(name string) (string, error) {
	if name == "" || name == "." || name == ".." || strings.ContainsAny(name, "/\\\x00") || strings.HasPrefix(name, ".") ||
		len(name) > 128 || !utf8.ValidString(name) {
		return "", fmt.Errorf("file name %q: use a plain name (no path, not hidden, at most 128 bytes)", name)
	}
	for _, c := range name {
		if c < 0x20 || c == 0x7f {
			return "", fmt.Errorf("file name %q has control characters", name)
		}
	}
	return name, nil
}

// download fetches a message's document into a private temporary file
// (unlinked: it goes when closed), within the size limit.
func (r *Relay) download(ctx context.Context, fileID string, size int64) (*os.File, error) {
	if size > r.doc.MaxFileBytes {
		return nil, fmt.Errorf("the file has %d bytes; the relay takes at most %d (relay max_file_bytes)", size, r.doc.MaxFileBytes)
	}
	f, err := os.CreateTemp(r.Tmp, "relay-upload-")
	if err != nil {
		return nil, fmt.Errorf("temporary file: %w", err)
	}
	os.Remove(f.Name())
	if _, err := r.tg.Download(ctx, fileID, r.doc.MaxFileBytes, f); err != nil {
		f.Close()
		return nil, err
	}
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		f.Close()
		return nil, err
	}
	return f, nil
}

// handleDocument saves an upload into the workspace inbox, or applies a
// release sent with the caption /apply.
func (r *Relay) handleDocument(ctx context.Context, q *request, apply bool) (string, string, string) {
	d := q.msg.Document
	if apply {
		o, det := r.applyRelease(ctx, q)
		return "apply", o, det
	}
	name, err := safeName(d.FileName)
	if err != nil {
		r.answer(ctx, q, "Refused: "+err.Error())
		return "upload", bus.RelayRefused, err.Error()
	}
	f, err := r.download(ctx, d.FileID, d.FileSize)
	if err != nil {
		r.answer(ctx, q, "Refused: "+err.Error())
		return "upload", bus.RelayRefused, err.Error()
	}
	defer f.Close()
	saved, err := r.caged.PutFile(ctx, q.agent, name, f)
	if err != nil {
		o, det := r.refusal(ctx, q, "save "+name, err)
		return "upload", o, det
	}
	r.answer(ctx, q, fmt.Sprintf("Saved as %s in %s's workspace.", saved, q.agent))
	return "upload", bus.RelayOK, fmt.Sprintf("%s (%d bytes) as %s", name, d.FileSize, saved)
}
