package release

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os/exec"
	"strings"
	"sync"

	"github.com/ulikunitz/xz"
)

// ExternalXZ selects the xz(1) binary (liblzma, as Nix itself uses) for
// decompression when it is installed; it decodes about twice as fast as
// the pure-Go decoder, which remains the fallback. Either way the output
// is only trusted after its SHA-256 matched the signed manifest.
var ExternalXZ = true

// xzMemLimit caps the decoder's memory: Nix writes xz with preset 6
// (8 MiB dictionary); a hostile header asking for more is refused.
const xzMemLimit = "256MiB"

func openXZ(ctx context.Context, r io.Reader) (io.ReadCloser, error) {
	if ExternalXZ {
		if path, err := exec.LookPath("xz"); err == nil {
			return startXZ(ctx, path, r)
		}
	}
	xr, err := xz.NewReader(bufio.NewReaderSize(r, 1<<20))
	if err != nil {
		return nil, err
	}
	return io.NopCloser(xr), nil
}

// xzProc streams the stdout of `xz -dc`; a non-zero exit turns the end of
// the stream into an error rather than a silently short NAR.
type xzProc struct {
	cmd    *exec.Cmd
	out    io.ReadCloser
	stderr *strings.Builder
	once   sync.Once
	werr   error
}

func startXZ(ctx context.Context, path string, r io.Reader) (io.ReadCloser, error) {
	cmd := exec.CommandContext(ctx, path, "--decompress", "--stdout", "--memlimit="+xzMemLimit, "--threads=1")
	cmd.Stdin = r
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		// This machine could not run the decoder (fork limit, ...): not
		// a verdict on the release.
		return nil, &localError{fmt.Errorf("start xz: %w", err)}
	}
	return &xzProc{cmd: cmd, out: out, stderr: &stderr}, nil
}

func (x *xzProc) wait() error {
	x.once.Do(func() {
		x.werr = x.cmd.Wait()
		if x.werr != nil {
			x.werr = fmt.Errorf("xz: %w: %s", x.werr, strings.TrimSpace(x.stderr.String()))
		}
	})
	return x.werr
}

func (x *xzProc) Read(p []byte) (int, error) {
	n, err := x.out.Read(p)
	if errors.Is(err, io.EOF) {
		if werr := x.wait(); werr != nil {
			return n, werr
		}
	}
	return n, err
}

// Close stops xz if the stream was abandoned early (a refused NAR).
func (x *xzProc) Close() error {
	if x.cmd.ProcessState == nil {
		_ = x.cmd.Process.Kill()
	}
	_ = x.wait()
	return nil
}

// localError is a failure of this machine while reading a release, which
// callers must not report as a refusal.
type localError struct{ error }

func (e *localError) Unwrap() error { return e.error }
