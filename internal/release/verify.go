package release

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"regexp"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/nix-community/go-nix/pkg/nar"
	"github.com/nix-community/go-nix/pkg/narinfo"
	nixsig "github.com/nix-community/go-nix/pkg/narinfo/signature"
	"github.com/nix-community/go-nix/pkg/storepath"
)

// Policy is what a release must satisfy to be accepted.
type Policy struct {
	Keys      []*PublicKey // trusted release keys
	Threshold int          // distinct trusted keys that must sign; 0 means 1
	// Channel the release must be on. Empty accepts any channel; only
	// offline inspection (`cagectl release verify`) leaves it empty.
	Channel string
	// After is the highest generation already accepted: a release must
	// have a strictly greater one (anti-rollback).
	After uint64
	// NixKeys, when set, must also have signed every narinfo (Nix's own
	// `Sig:` lines, as `nix store sign` writes them).
	NixKeys []nixsig.PublicKey
	Now     time.Time // zero: time.Now()
}

// ParseNixKeys parses "name:base64" Nix public keys.
func ParseNixKeys(keys []string) ([]nixsig.PublicKey, error) {
	var out []nixsig.PublicKey
	for _, k := range keys {
		pk, err := nixsig.ParsePublicKey(k)
		if err != nil {
			return nil, fmt.Errorf("nix public key %q: %w (want name:base64, as `nix key convert-secret-to-public` prints)", k, err)
		}
		out = append(out, pk)
	}
	return out, nil
}

// Release is a release whose manifest passed signature and freshness checks.
// Its NARs are still untrusted until Unpack has hashed them.
type Release struct {
	Src      Source
	Manifest *Manifest
	Raw      []byte // release.json exactly as signed
	RawSig   []byte
	nixKeys  []nixsig.PublicKey
}

// Refusal is a release rejected by policy (as opposed to an I/O failure).
type Refusal struct{ Reason string }

func (r *Refusal) Error() string { return "release refused: " + r.Reason }

func refuse(format string, args ...any) error {
	return &Refusal{Reason: fmt.Sprintf(format, args...)}
}

// ReadFile reads name from src, at most max bytes.
func ReadFile(ctx context.Context, src Source, name string, max int64) ([]byte, error) {
	rc, err := src.Open(ctx, name, max)
	if err != nil {
		return nil, err
	}
	defer rc.Close()
	return io.ReadAll(rc)
}

// Open reads the manifest and its signatures from src and checks them
// against pol: signatures and threshold first (nothing else of the manifest
// is trusted before that), then schema, channel, generation and expiry.
func Open(ctx context.Context, src Source, pol Policy) (*Release, error) {
	raw, err := ReadFile(ctx, src, ManifestFile, MaxManifestSize)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("%s has no %s: is it a release made by `cagectl release create`?", src, ManifestFile)
	}
	if err != nil {
		return nil, fmt.Errorf("read manifest: %w", err)
	}
	rawSig, err := ReadFile(ctx, src, SignaturesFile, MaxSignaturesSize)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, refuse("%v: %s is missing; sign the release with `cagectl release create --key`", ErrUnsigned, SignaturesFile)
	}
	if err != nil {
		return nil, fmt.Errorf("read signatures: %w", err)
	}
	sigs, err := ParseSignatures(rawSig)
	if err != nil {
		return nil, refuse("%v", err)
	}
	threshold := pol.Threshold
	if threshold == 0 {
		threshold = 1
	}
	if err := VerifySignatures(raw, sigs, pol.Keys, threshold); err != nil {
		return nil, refuse("%v", err)
	}
	m, err := ParseManifest(raw)
	if err != nil {
		return nil, refuse("%v", err)
	}
	if pol.Channel != "" && m.Channel != pol.Channel {
		return nil, refuse("release is for channel %q, this store follows %q", m.Channel, pol.Channel)
	}
	if m.Generation <= pol.After {
		return nil, refuse("generation %d is not newer than the accepted generation %d (rollback protection); publish a release with a higher generation", m.Generation, pol.After)
	}
	now := pol.Now
	if now.IsZero() {
		now = time.Now()
	}
	if !now.Before(m.Expires) {
		return nil, refuse("release expired at %s (freeze protection); publish a fresh release", m.Expires.UTC().Format(time.RFC3339))
	}
	return &Release{Src: src, Manifest: m, Raw: raw, RawSig: rawSig, nixKeys: pol.NixKeys}, nil
}

var narURLRe = regexp.MustCompile(`^nar/[0-9a-z]+\.nar(\.xz)?$`)

// Narinfo fetches and checks the narinfo of p: it must describe exactly the
// manifest's entry (mix-and-match protection) and, if Nix keys are trusted,
// carry a valid signature by one of them.
func (r *Release) Narinfo(ctx context.Context, p PathInfo) (*narinfo.NarInfo, error) {
	raw, err := ReadFile(ctx, r.Src, p.HashPart()+".narinfo", MaxNarinfoSize)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, refuse("closure incomplete: the cache has no narinfo for %s", p.Path)
	}
	if err != nil {
		return nil, fmt.Errorf("read narinfo of %s: %w", p.Path, err)
	}
	ni, err := narinfo.Parse(bytes.NewReader(raw))
	if err != nil {
		return nil, refuse("narinfo of %s: %v", p.Path, err)
	}
	if err := ni.Check(); err != nil {
		return nil, refuse("narinfo of %s: %v", p.Path, err)
	}
	if ni.StorePath != p.Path {
		return nil, refuse("narinfo %s.narinfo names %s, manifest expects %s", p.HashPart(), ni.StorePath, p.Path)
	}
	want, _ := p.Digest()
	if ni.NarHash == nil || !bytes.Equal(ni.NarHash.Digest(), want) || ni.NarSize != p.NarSize {
		return nil, refuse("narinfo of %s disagrees with the manifest on NarHash/NarSize", p.Path)
	}
	refs := make([]string, len(ni.References))
	for i, ref := range ni.References {
		refs[i] = storepath.StoreDir + "/" + ref
	}
	slices.Sort(refs)
	if !slices.Equal(refs, p.References) {
		return nil, refuse("narinfo of %s disagrees with the manifest on references", p.Path)
	}
	if !narURLRe.MatchString(ni.URL) {
		return nil, refuse("narinfo of %s: URL %q is not nar/<hash>.nar[.xz]", p.Path, ni.URL)
	}
	switch {
	case ni.Compression == "none" && strings.HasSuffix(ni.URL, ".nar"):
	case ni.Compression == "xz" && strings.HasSuffix(ni.URL, ".nar.xz"):
	default:
		return nil, refuse("narinfo of %s: compression %q (URL %s) is not supported: use none or xz", p.Path, ni.Compression, ni.URL)
	}
	if len(r.nixKeys) > 0 {
		fp := ni.Fingerprint()
		ok := false
		for _, k := range r.nixKeys {
			for _, s := range ni.Signatures {
				if k.Verify(fp, s) {
					ok = true
				}
			}
		}
		if !ok {
			return nil, refuse("narinfo of %s has no valid Sig: by a trusted Nix key", p.Path)
		}
	}
	return ni, nil
}

// OpenNAR returns the uncompressed NAR stream of p, capped at NarSize+1
// bytes so that a longer stream fails the size check instead of running on.
func (r *Release) OpenNAR(ctx context.Context, p PathInfo, ni *narinfo.NarInfo) (io.ReadCloser, error) {
	// Compressed files may be slightly larger than their content, never
	// by much; the cap stops endless data before decompression.
	max := int64(p.NarSize)
	if ni.Compression == "xz" {
		max += max/16 + 64<<10
	}
	f, err := r.Src.Open(ctx, ni.URL, max)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, refuse("closure incomplete: the cache has no %s for %s", ni.URL, p.Path)
	}
	if errors.Is(err, ErrTooLarge) {
		return nil, refuse("nar of %s is larger than its NarSize %d allows: %v", p.Path, p.NarSize, err)
	}
	if err != nil {
		return nil, fmt.Errorf("open nar of %s: %w", p.Path, err)
	}
	fr := &fetchRecorder{r: f}
	if ni.Compression == "none" {
		return &narStream{&limitedReader{r: fr, c: f, left: int64(p.NarSize), name: ni.URL}, fr}, nil
	}
	xr, err := openXZ(ctx, fr)
	var le *localError
	if errors.As(err, &le) {
		f.Close()
		return nil, fmt.Errorf("nar of %s: %w", p.Path, err)
	}
	if err != nil {
		f.Close()
		return nil, refuse("nar of %s: %v", p.Path, err)
	}
	return &narStream{&limitedReader{r: xr, c: multiCloser{xr, f}, left: int64(p.NarSize), name: ni.URL}, fr}, nil
}

// narStream is a NAR being read, with what went wrong fetching it.
type narStream struct {
	io.ReadCloser
	fetch *fetchRecorder
}

// fetchRecorder keeps the first error the source gave while a NAR was
// read from it. A decoder (xz) turns such an error into "unexpected end of
// input", which would read as a verdict on the release; Unpack reports the
// fetch failure instead (a dropped connection is this side's trouble).
type fetchRecorder struct {
	r   io.Reader
	mu  sync.Mutex
	err error
}

func (f *fetchRecorder) Read(p []byte) (int, error) {
	n, err := f.r.Read(p)
	if err != nil && !errors.Is(err, io.EOF) {
		f.mu.Lock()
		if f.err == nil {
			f.err = err
		}
		f.mu.Unlock()
	}
	return n, err
}

// Err is the first fetch error, except a file over its size cap, which is
// the release's fault (a verdict).
func (f *fetchRecorder) Err() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if errors.Is(f.err, ErrTooLarge) {
		return nil
	}
	return f.err
}

type multiCloser []io.Closer

func (m multiCloser) Close() error {
	var first error
	for _, c := range m {
		if err := c.Close(); err != nil && first == nil {
			first = err
		}
	}
	return first
}

// VerifyAll checks every closure member's narinfo and NAR (nothing is
// unpacked), using workers goroutines.
func (r *Release) VerifyAll(ctx context.Context, workers int) (int64, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	paths := r.Manifest.Paths
	errs := make(chan error, len(paths))
	sizes := make(chan int64, len(paths))
	next := make(chan PathInfo)
	go func() {
		defer close(next)
		for _, p := range paths {
			select {
			case next <- p:
			case <-ctx.Done():
				return
			}
		}
	}()
	done := make(chan struct{})
	for range max(1, min(workers, len(paths))) {
		go func() {
			defer func() { done <- struct{}{} }()
			for p := range next {
				st, err := r.Unpack(ctx, p, "")
				if err != nil {
					errs <- err
					cancel()
					return
				}
				sizes <- st.Size
			}
		}()
	}
	for range max(1, min(workers, len(paths))) {
		<-done
	}
	close(errs)
	close(sizes)
	var first error
	for err := range errs {
		// Prefer the real cause over the cancellations it triggered.
		if first == nil || (errors.Is(first, context.Canceled) && !errors.Is(err, context.Canceled)) {
			first = err
		}
	}
	if first != nil {
		return 0, first
	}
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	var total int64
	for n := range sizes {
		total += n
	}
	return total, nil
}

// Unpack verifies p's narinfo and NAR and, if dst is not empty, unpacks the
// NAR there. On any error dst may hold a partial tree the caller removes.
func (r *Release) Unpack(ctx context.Context, p PathInfo, dst string) (NarStats, error) {
	ni, err := r.Narinfo(ctx, p)
	if err != nil {
		return NarStats{}, err
	}
	rc, err := r.OpenNAR(ctx, p, ni)
	if err != nil {
		return NarStats{}, err
	}
	defer rc.Close()
	st, err := unpackNAR(ctxReader{ctx, rc}, dst, p.Path)
	if errors.Is(err, ErrTooLarge) {
		return st, refuse("nar of %s is larger than its NarSize %d", p.Path, p.NarSize)
	}
	var we *WriteError
	if errors.As(err, &we) {
		// Our disk, not the release: an I/O failure, never a verdict.
		return st, fmt.Errorf("unpack %s: %w", p.Path, err)
	}
	if err != nil {
		if ctx.Err() != nil {
			return st, ctx.Err()
		}
		if ns, ok := rc.(*narStream); ok {
			if ferr := ns.fetch.Err(); ferr != nil {
				// Not a verdict: the release was not read whole.
				return st, fmt.Errorf("fetch nar of %s: %w", p.Path, ferr)
			}
		}
		return st, refuse("nar of %s: %v", p.Path, err)
	}
	want, _ := p.Digest()
	if uint64(st.Size) != p.NarSize {
		return st, refuse("nar of %s is %d bytes, manifest says %d", p.Path, st.Size, p.NarSize)
	}
	if !bytes.Equal(st.Digest, want) {
		return st, refuse("nar of %s hashes to %s, manifest says %s", p.Path, formatNarHash(st.Digest), p.NarHash)
	}
	if p.Path == r.Manifest.Top && st.Root != nar.TypeDirectory {
		return st, refuse("%v", TopNotDirectory(p.Path, string(st.Root)))
	}
	return st, nil
}

type ctxReader struct {
	ctx context.Context
	r   io.Reader
}

func (c ctxReader) Read(p []byte) (int, error) {
	if err := c.ctx.Err(); err != nil {
		return 0, err
	}
	return c.r.Read(p)
}

// TopNotDirectory is the reason a release whose top is not a directory is
// refused: every cage binds top at /nix/tools, and a bind follows a link on
// the host, so a top that is a symlink (to "/", say) would show every cage
// the host's root.
func TopNotDirectory(top, kind string) error {
	return fmt.Errorf("top %s is a %s, not a directory: every cage binds top at /nix/tools, and a bind of a link would follow it on the host; publish a directory (e.g. a buildEnv) as top", top, kind)
}

// CheckCacheInfo refuses caches made for another store directory.
func (r *Release) CheckCacheInfo(ctx context.Context) error {
	raw, err := ReadFile(ctx, r.Src, CacheInfoFile, MaxCacheInfoSize)
	if errors.Is(err, fs.ErrNotExist) {
		return nil // optional: Nix writes it, but nothing depends on it
	}
	if err != nil {
		return fmt.Errorf("read %s: %w", CacheInfoFile, err)
	}
	for _, line := range strings.Split(string(raw), "\n") {
		if v, ok := strings.CutPrefix(line, "StoreDir: "); ok && strings.TrimSpace(v) != storepath.StoreDir {
			return refuse("cache was made for store %s, not %s", strings.TrimSpace(v), storepath.StoreDir)
		}
	}
	return nil
}
