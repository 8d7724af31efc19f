package release

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"strings"
	"testing"

	"github.com/ulikunitz/xz"
)

// brokenSource serves files from memory; the NAR breaks off with errCut
// halfway (a dropped connection whose resumes also failed).
type brokenSource struct {
	files map[string][]byte
	cut   string // the file that breaks off
}

var errCut = errors.New("connection reset by peer")

func (b brokenSource) String() string { return "broken" }

func (b brokenSource) Open(_ context.Context, name string, max int64) (io.ReadCloser, error) {
	data, ok := b.files[name]
	if !ok {
		return nil, fs.ErrNotExist
	}
	var r io.Reader = bytes.NewReader(data)
	if name == b.cut {
		r = io.MultiReader(bytes.NewReader(data[:len(data)/2]), errReader{errCut})
	}
	return &limitedReader{r: r, c: io.NopCloser(nil), left: max, name: name}, nil
}

type errReader struct{ err error }

func (e errReader) Read([]byte) (int, error) { return 0, e.err }

// A NAR whose download fails midway is a fetch failure naming the cause,
// not a refusal of the release: with xz the decoder saw only "unexpected
// end of input", which apply reported as "release refused: nar of ...:
// xz: ... Unexpected end of input" (and caged journalled a refused
// release) before the fetch error was kept.
func TestUnpackReportsFetchFailureNotRefusal(t *testing.T) {
	narData := dirNAR(file("hello", strings.Repeat("x", 200<<10), true))
	sum := sha256.Sum256(narData)
	const hash = "0123456789abcdfghijklmnpqrsvwxyz"
	p := PathInfo{Path: "/nix/store/" + hash + "-tool", NarHash: formatNarHash(sum[:]), NarSize: uint64(len(narData)), References: []string{}}
	var xzData bytes.Buffer
	w, err := xz.NewWriter(&xzData)
	if err != nil {
		t.Fatal(err)
	}
	w.Write(narData)
	w.Close()
	for _, tc := range []struct {
		compression, url string
		body             []byte
	}{
		{"none", "nar/" + hash + ".nar", narData},
		{"xz", "nar/" + hash + ".nar.xz", xzData.Bytes()},
	} {
		t.Run(tc.compression, func(t *testing.T) {
			fsum := sha256.Sum256(tc.body)
			ni := fmt.Sprintf("StorePath: %s\nURL: %s\nCompression: %s\nFileHash: %s\nFileSize: %d\nNarHash: %s\nNarSize: %d\nReferences: \n",
				p.Path, tc.url, tc.compression, formatNarHash(fsum[:]), len(tc.body), p.NarHash, p.NarSize)
			src := brokenSource{files: map[string][]byte{hash + ".narinfo": []byte(ni), tc.url: tc.body}}
			r := &Release{Src: src, Manifest: &Manifest{Top: p.Path, Paths: []PathInfo{p}}}
			if _, err := r.Unpack(context.Background(), p, ""); err != nil {
				t.Fatalf("whole NAR: %v", err)
			}
			src.cut = tc.url
			r.Src = src
			_, err := r.Unpack(context.Background(), p, "")
			var ref *Refusal
			if err == nil || errors.As(err, &ref) || !errors.Is(err, errCut) {
				t.Fatalf("NAR cut off mid-download: %v; want a fetch error wrapping %q, not a refusal", err, errCut)
			}
			// A NAR the source ends early (short, no error) is still the
			// release's fault.
			short := brokenSource{files: map[string][]byte{hash + ".narinfo": []byte(ni), tc.url: tc.body[:len(tc.body)/2]}}
			r.Src = short
			if _, err := r.Unpack(context.Background(), p, ""); !errors.As(err, &ref) {
				t.Fatalf("a short NAR: %v, want a refusal", err)
			}
		})
	}
}
