package channel

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nixcage/nixcage/internal/release"
)

// fakeRelease writes a release directory shaped as `cagectl release
// create` writes it (the manifest is valid but names no real NAR: Publish
// only lays files out; hosts verify).
func fakeRelease(t *testing.T, channel string, gen uint64, hash string) string {
	t.Helper()
	dir := t.TempDir()
	p := "/nix/store/" + hash + "-tools"
	m := &release.Manifest{Schema: 1, Channel: channel, Generation: gen, Created: time.Now().UTC().Truncate(time.Second),
		Expires: time.Now().Add(time.Hour).UTC().Truncate(time.Second), Top: p,
		Paths: []release.PathInfo{{Path: p, NarHash: "sha256:" + strings.Repeat("0", 52), NarSize: 8, References: []string{}}}}
	raw, err := m.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	files := map[string]string{
		release.ManifestFile:            string(raw),
		release.SignaturesFile:          `{"schema":1,"signatures":[]}`,
		"nix-cache-info":                "StoreDir: /nix/store\n",
		hash + ".narinfo":               "StorePath: " + p + "\nURL: nar/" + hash + ".nar\n",
		"nar/" + hash + ".nar":          "nar-" + hash,
		release.KeySetDir + "/1.json":   "{}",
		release.KeySetDir + "/1.json.s": "ignored name, copied all the same",
	}
	for n, c := range files {
		if err := os.MkdirAll(filepath.Dir(filepath.Join(dir, n)), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, n), []byte(c), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

func TestPublishLayoutAndRefusals(t *testing.T) {
	ctx := context.Background()
	ch := filepath.Join(t.TempDir(), "stable")
	h1, h2 := strings.Repeat("a", 32), strings.Repeat("b", 32)

	p, err := Publish(ctx, fakeRelease(t, "stable", 1, h1), ch)
	if err != nil || p.Generation != 1 || p.Previous != 0 || p.Copied != 5 || p.Present != 0 {
		t.Fatalf("first publish: %+v, %v", p, err)
	}
	ci, err := os.ReadFile(filepath.Join(ch, ControlsDir, ControlIndexFile))
	if err != nil {
		t.Fatal(err)
	}
	if c, err := ParseControlIndex(ci); err != nil || len(c.Commands) != 0 {
		t.Fatalf("the empty control feed: %s: %+v %v", ci, c, err)
	}
	// A feed the control tooling wrote is left alone by later publishes.
	feed := `{"schema":1,"commands":["x.json"]}`
	if err := os.WriteFile(filepath.Join(ch, ControlsDir, ControlIndexFile), []byte(feed), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{IndexFile, "releases/1/release.json", "releases/1/release.json.sig", h1 + ".narinfo", "nar/" + h1 + ".nar", "nix-cache-info", "keys/1.json"} {
		fi, err := os.Stat(filepath.Join(ch, f))
		if err != nil || fi.Mode().Perm() != 0o644 {
			t.Errorf("%s: %v %v (want a 0644 file a web server can read)", f, fi, err)
		}
	}
	b, _ := os.ReadFile(filepath.Join(ch, IndexFile))
	ix, err := ParseIndex(b)
	if err != nil || *ix != (Index{Schema: 1, Channel: "stable", Generation: 1, Release: "releases/1"}) {
		t.Fatalf("index %s: %+v %v", b, ix, err)
	}

	// The next generation adds its files, keeps the shared ones, moves the index.
	p, err = Publish(ctx, fakeRelease(t, "stable", 2, h2), ch)
	if err != nil || p.Previous != 1 || p.Copied != 2 || p.Present != 3 {
		t.Fatalf("second publish: %+v, %v", p, err)
	}
	if _, err := os.Stat(filepath.Join(ch, "releases/1/release.json")); err != nil {
		t.Fatal("publishing generation 2 removed generation 1's manifest")
	}
	if b, _ := os.ReadFile(filepath.Join(ch, ControlsDir, ControlIndexFile)); string(b) != feed {
		t.Fatalf("publishing replaced the control feed: %s", b)
	}

	snapshot := func() map[string]string {
		out := map[string]string{}
		filepath.Walk(ch, func(p string, fi os.FileInfo, err error) error {
			if err == nil && fi.Mode().IsRegular() {
				b, _ := os.ReadFile(p)
				out[p] = string(b)
			}
			return nil
		})
		return out
	}
	before := snapshot()
	conflict := fakeRelease(t, "stable", 5, h2)
	os.WriteFile(filepath.Join(conflict, h2+".narinfo"), []byte("StorePath: other\n"), 0o644)
	for _, tc := range []struct {
		name, rel, want string
	}{
		{"SameGeneration", fakeRelease(t, "stable", 2, h2), "generation 2 is not above the channel's 2: create it with --generation 3"},
		{"OlderGeneration", fakeRelease(t, "stable", 1, h1), "generation 1 is not above the channel's 2"},
		{"OtherChannel", fakeRelease(t, "edge", 3, h1), `the release is for channel "edge"`},
		{"CacheConflict", conflict, "already in the channel with different content"},
		{"NotARelease", t.TempDir(), "read the release"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Publish(ctx, tc.rel, ch)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("publish: %v, want %q", err, tc.want)
			}
			after := snapshot()
			if len(after) != len(before) {
				t.Fatalf("a refused publish changed the channel: %d files, was %d", len(after), len(before))
			}
			for p, c := range before {
				if after[p] != c {
					t.Fatalf("a refused publish changed %s", p)
				}
			}
		})
	}
}
