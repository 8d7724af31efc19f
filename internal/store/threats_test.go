package store

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/nix-community/go-nix/pkg/nixbase32"

	"github.com/nixcage/nixcage/internal/release"
	"github.com/nixcage/nixcage/internal/release/releasetest"
	"github.com/nixcage/nixcage/internal/testenv"
)

// snapshot records everything under root (names, modes, link targets,
// content hashes) except the lock file, so "the store is untouched" is an
// exact comparison.
func snapshot(t *testing.T, root string) string {
	t.Helper()
	var lines []string
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		if rel == lockFile {
			return nil
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		line := fmt.Sprintf("%s %v", rel, fi.Mode())
		switch {
		case fi.Mode()&fs.ModeSymlink != 0:
			tgt, _ := os.Readlink(p)
			line += " -> " + tgt
		case fi.Mode().IsRegular():
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			sum := sha256.Sum256(b)
			line += " " + hex.EncodeToString(sum[:8])
		}
		lines = append(lines, line)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	sort.Strings(lines)
	return strings.Join(lines, "\n")
}

// narFile returns the path of the (only) NAR of the closure member whose
// name ends in suffix, in release dir.
func narFile(t *testing.T, dir, suffix string) (string, release.PathInfo) {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join(dir, release.ManifestFile))
	if err != nil {
		t.Fatal(err)
	}
	m, err := release.ParseManifest(raw)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range m.Paths {
		if strings.HasSuffix(p.Path, suffix) {
			ni, err := os.ReadFile(filepath.Join(dir, p.HashPart()+".narinfo"))
			if err != nil {
				t.Fatal(err)
			}
			for _, l := range strings.Split(string(ni), "\n") {
				if u, ok := strings.CutPrefix(l, "URL: "); ok {
					return filepath.Join(dir, u), p
				}
			}
		}
	}
	t.Fatalf("no path ending in %s", suffix)
	return "", release.PathInfo{}
}

// Minimal NAR encoder for hostile archives go-nix's writer refuses to make.
func narStr(b *bytes.Buffer, s string) {
	var n [8]byte
	binary.LittleEndian.PutUint64(n[:], uint64(len(s)))
	b.Write(n[:])
	b.WriteString(s)
	for i := len(s); i%8 != 0; i++ {
		b.WriteByte(0)
	}
}

func narDirWithFile(name, content string) []byte {
	var b bytes.Buffer
	for _, s := range []string{"nix-archive-1", "(", "type", "directory", "entry", "(", "name", name, "node",
		"(", "type", "regular", "contents", content, ")", ")", ")"} {
		narStr(&b, s)
	}
	return b.Bytes()
}

// narDeep is a NAR of directories named "d" nested depth deep: its paths
// grow past PATH_MAX, which no file system call can name.
func narDeep(depth int) []byte {
	var b bytes.Buffer
	narStr(&b, "nix-archive-1")
	for _, s := range []string{"(", "type", "directory"} {
		narStr(&b, s)
	}
	for i := 0; i < depth; i++ {
		for _, s := range []string{"entry", "(", "name", "d", "node", "(", "type", "directory"} {
			narStr(&b, s)
		}
	}
	for i := 0; i < depth; i++ {
		narStr(&b, ")")
		narStr(&b, ")")
	}
	narStr(&b, ")")
	return b.Bytes()
}

// craftedRelease writes a one-path release whose NAR is narBytes, with a
// narinfo and a signed manifest that agree with it: everything is valid
// except what the NAR itself does.
func craftedRelease(t *testing.T, f *fixture, gen uint64, narBytes []byte) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "crafted")
	if err := os.MkdirAll(filepath.Join(dir, "nar"), 0o755); err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(narBytes)
	h32 := nixbase32.EncodeToString(sum[:])
	hashPart := strings.Repeat("0", 31) + "1"
	sp := "/nix/store/" + hashPart + "-evil"
	narName := "nar/" + h32 + ".nar"
	must(t, os.WriteFile(filepath.Join(dir, narName), narBytes, 0o644))
	must(t, os.WriteFile(filepath.Join(dir, hashPart+".narinfo"), []byte(fmt.Sprintf(
		"StorePath: %s\nURL: %s\nCompression: none\nFileHash: sha256:%s\nFileSize: %d\nNarHash: sha256:%s\nNarSize: %d\nReferences: \n",
		sp, narName, h32, len(narBytes), h32, len(narBytes))), 0o644))
	m := &release.Manifest{Schema: 1, Channel: "stable", Generation: gen, Created: time.Now().UTC().Truncate(time.Second),
		Expires: releasetest.Expires().UTC().Truncate(time.Second), Top: sp,
		Paths: []release.PathInfo{{Path: sp, NarHash: "sha256:" + h32, NarSize: uint64(len(narBytes)), References: []string{}}}}
	raw, err := m.Marshal()
	must(t, err)
	must(t, os.WriteFile(filepath.Join(dir, release.ManifestFile), raw, 0o644))
	releasetest.Resign(t, dir, []*release.PrivateKey{f.key}, nil)
	return dir
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// Each case is one line of THREATS.md "Signed upgrades". The store holds
// generation 1; the hostile release must be refused with the message
// shown, leaving every byte of the store as it was.
func TestSignedUpgradeThreats(t *testing.T) {
	f := getFixture(t)
	keys := func(k ...*release.PrivateKey) []*release.PrivateKey { return k }
	cases := []struct {
		name    string
		opts    func(*Options)
		release func(t *testing.T) string
		want    string
	}{
		{name: "WrongKey", want: "0 valid signature(s) from trusted keys, threshold is 1; signed by untrusted key(s)",
			release: func(t *testing.T) string {
				return f.release(t, f.relB, keys(f.other), nil)
			}},
		{name: "BadSignature", want: "bad signature",
			release: func(t *testing.T) string {
				dir := f.release(t, f.relB, nil, nil)
				// Change one byte of the signed manifest after signing.
				p := filepath.Join(dir, release.ManifestFile)
				raw, _ := os.ReadFile(p)
				must(t, os.WriteFile(p, bytes.Replace(raw, []byte(`"generation": 2`), []byte(`"generation": 9`), 1), 0o644))
				return dir
			}},
		{name: "UnsignedManifest", want: "release is unsigned: release.json.sig is missing",
			release: func(t *testing.T) string {
				dir := f.release(t, f.relB, nil, nil)
				must(t, os.Remove(filepath.Join(dir, release.SignaturesFile)))
				return dir
			}},
		{name: "EmptySignatureList", want: "release is unsigned: release.json.sig has no signatures",
			release: func(t *testing.T) string {
				dir := f.release(t, f.relB, nil, nil)
				must(t, os.WriteFile(filepath.Join(dir, release.SignaturesFile), []byte(`{"schema":1,"signatures":[]}`), 0o644))
				return dir
			}},
		{name: "TooFewSignaturesForThreshold", want: "1 valid signature(s) from trusted keys, threshold is 2",
			opts: func(o *Options) { o.Keys = []*release.PublicKey{f.pub, f.pub2}; o.Threshold = 2 },
			release: func(t *testing.T) string {
				return f.release(t, f.relB, keys(f.key, f.other), nil)
			}},
		{name: "SameKeyTwiceCountsOnce", want: "1 valid signature(s) from trusted keys, threshold is 2",
			opts: func(o *Options) { o.Keys = []*release.PublicKey{f.pub, f.pub2}; o.Threshold = 2 },
			release: func(t *testing.T) string {
				dir := f.release(t, f.relB, nil, nil)
				p := filepath.Join(dir, release.SignaturesFile)
				raw, _ := os.ReadFile(p)
				sigs, err := release.ParseSignatures(raw)
				must(t, err)
				sigs.Signatures = append(sigs.Signatures, sigs.Signatures[0])
				raw, _ = sigs.Marshal()
				must(t, os.WriteFile(p, raw, 0o644))
				return dir
			}},
		{name: "EqualGeneration", want: "generation 1 is not newer than the accepted generation 1 (rollback protection)",
			release: func(t *testing.T) string {
				return f.release(t, f.relB, nil, func(m *release.Manifest) { m.Generation = 1 })
			}},
		{name: "OlderGeneration", want: "generation 1 is not newer than the accepted generation 5 (rollback protection)",
			opts: func(o *Options) {},
			release: func(t *testing.T) string {
				// The counter survives even without the generation: state.json says 5.
				return f.release(t, f.relB, nil, func(m *release.Manifest) { m.Generation = 1 })
			}},
		// A state.json written before per-key records (schema 1): its
		// counter is attributed to the keys trusted now, so it still holds.
		{name: "OlderGenerationLegacyState", want: "generation 1 is not newer than the accepted generation 5 (rollback protection)",
			opts: func(o *Options) {},
			release: func(t *testing.T) string {
				return f.release(t, f.relB, nil, func(m *release.Manifest) { m.Generation = 1 })
			}},
		{name: "ExpiredManifest", want: "expired at",
			release: func(t *testing.T) string {
				return f.release(t, f.relB, nil, func(m *release.Manifest) {
					m.Created = time.Now().Add(-48 * time.Hour).UTC().Truncate(time.Second)
					m.Expires = time.Now().Add(-time.Hour).UTC().Truncate(time.Second)
				})
			}},
		{name: "OtherChannel", want: `release is for channel "beta", this store follows "stable"`,
			release: func(t *testing.T) string {
				return f.release(t, f.relB, nil, func(m *release.Manifest) { m.Channel = "beta" })
			}},
		{name: "NarBytesDoNotMatchHash", want: "hashes to",
			release: func(t *testing.T) string {
				dir := f.release(t, f.relB, nil, nil)
				nf, _ := narFile(t, dir, "-tool-b")
				b, _ := os.ReadFile(nf)
				i := bytes.Index(b, []byte("variant b"))
				b[i+8] = 'X' // same size, one byte of file content changed
				must(t, os.WriteFile(nf, b, 0o644))
				return dir
			}},
		{name: "NarLongerThanNarSize", want: "is larger than its NarSize",
			release: func(t *testing.T) string {
				dir := f.release(t, f.relB, nil, nil)
				nf, _ := narFile(t, dir, "-tool-b")
				b, _ := os.ReadFile(nf)
				must(t, os.WriteFile(nf, append(b, make([]byte, 4096)...), 0o644))
				return dir
			}},
		{name: "NarShorterThanNarSize", want: "nar of",
			release: func(t *testing.T) string {
				dir := f.release(t, f.relB, nil, nil)
				nf, _ := narFile(t, dir, "-tool-b")
				b, _ := os.ReadFile(nf)
				must(t, os.WriteFile(nf, b[:len(b)-100], 0o644))
				return dir
			}},
		{name: "NarinfoMixAndMatch", want: "disagrees with the manifest on NarHash/NarSize",
			release: func(t *testing.T) string {
				// The manifest claims a different NAR hash than the cache holds,
				// as when files of two releases are mixed.
				return f.release(t, f.relB, nil, func(m *release.Manifest) {
					for i := range m.Paths {
						if strings.HasSuffix(m.Paths[i].Path, "-tool-b") {
							m.Paths[i].NarHash = "sha256:" + strings.Repeat("1", 52)
						}
					}
				})
			}},
		{name: "ClosureMissingReferenceInManifest", want: "closure incomplete",
			release: func(t *testing.T) string {
				return f.release(t, f.relB, nil, func(m *release.Manifest) {
					var keep []release.PathInfo
					for _, p := range m.Paths {
						if !strings.HasSuffix(p.Path, "-tool-b") {
							keep = append(keep, p)
						}
					}
					m.Paths = keep
				})
			}},
		{name: "ClosureMissingFromCache", want: "closure incomplete: the cache has no narinfo",
			release: func(t *testing.T) string {
				dir := f.release(t, f.relB, nil, nil)
				_, p := narFile(t, dir, "-tool-b")
				must(t, os.Remove(filepath.Join(dir, p.HashPart()+".narinfo")))
				return dir
			}},
		{name: "NarEntryDotDot", want: "escapes its store path",
			release: func(t *testing.T) string {
				return craftedRelease(t, f, 2, narDirWithFile("..", "pwned\n"))
			}},
		{name: "NarEntryWithSlash", want: "is invalid",
			release: func(t *testing.T) string {
				return craftedRelease(t, f, 2, narDirWithFile("../../../etc/x", "pwned\n"))
			}},
		// Red team: a signed release whose paths no system call can name
		// was reported as this machine's I/O failure (exit 5, "write to
		// the store's file system: file name too long").
		{name: "NarPathLongerThanPathMax", want: "longer than PATH_MAX",
			release: func(t *testing.T) string {
				return craftedRelease(t, f, 2, narDeep(2100))
			}},
		{name: "NarinfoWithoutTrustedNixSig", want: "has no valid Sig: by a trusted Nix key",
			opts: func(o *Options) {
				o.NixPublicKeys = []string{"cache.example.org-1:" + "6NCHdD59X431o0gWypbMrAURkbJ16ZPMQFGspcDShjY="}
			},
			release: func(t *testing.T) string { return f.release(t, f.relB, nil, nil) }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			root := filepath.Join(t.TempDir(), "root")
			base := f.open(t, root, nil)
			if _, err := applyDir(t, base, f.release(t, f.relA, keys(f.key, f.key2), nil)); err != nil {
				t.Fatal(err)
			}
			s := f.open(t, root, tc.opts)
			switch tc.name {
			case "OlderGeneration":
				// Generation 5, signed by the trusted key, was pruned.
				st, _ := s.readState()
				st.Highest = 5
				for _, k := range s.keys {
					st.SignedBy[k.ID] = 5
				}
				must(t, s.writeState(st))
			case "OlderGenerationLegacyState":
				must(t, os.WriteFile(filepath.Join(root, stateFile), []byte(`{"schema": 1, "highest": 5, "updated": "2026-01-01T00:00:00Z"}`+"\n"), 0o644))
			}
			before := snapshot(t, root)
			dir := tc.release(t)
			_, err := applyDir(t, s, dir)
			if err == nil {
				t.Fatal("hostile release was accepted")
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %q does not contain %q", err, tc.want)
			}
			var ref *release.Refusal
			if !errors.As(err, &ref) {
				t.Fatalf("error %q is not a release refusal", err)
			}
			if after := snapshot(t, root); after != before {
				t.Fatalf("store changed by a refused release:\nbefore:\n%s\nafter:\n%s", before, after)
			}
			if cur, _ := s.Current(); cur != 1 {
				t.Fatalf("current = %d after refusal, want 1", cur)
			}
			if _, err := s.Verify(context.Background(), true); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// The positive side of the threshold: two distinct trusted keys suffice.
func TestThresholdMet(t *testing.T) {
	f := getFixture(t)
	s := f.open(t, filepath.Join(t.TempDir(), "root"), func(o *Options) {
		o.Keys = []*release.PublicKey{f.pub, f.pub2}
		o.Threshold = 2
	})
	dir := f.release(t, f.relB, []*release.PrivateKey{f.key, f.key2, f.other}, nil)
	if _, err := applyDir(t, s, dir); err != nil {
		t.Fatal(err)
	}
}

func TestConcurrentApplyRefused(t *testing.T) {
	f := getFixture(t)
	s := f.open(t, filepath.Join(t.TempDir(), "root"), nil)
	unlock, err := s.lock()
	if err != nil {
		t.Fatal(err)
	}
	defer unlock()
	_, err = applyDir(t, s, f.relA)
	if err == nil || !strings.Contains(err.Error(), "is busy") {
		t.Fatalf("apply while locked: %v", err)
	}
}

// Narinfo signatures written by `nix store sign` are checked when Nix
// public keys are trusted.
func TestNixSignedCacheAccepted(t *testing.T) {
	f := getFixture(t)
	dir := f.release(t, f.relB, nil, nil)
	tmp := t.TempDir()
	sk := filepath.Join(tmp, "sk")
	nixcmd := func(stdin []byte, args ...string) string {
		cmd := exec.Command("nix", append([]string{"--extra-experimental-features", "nix-command"}, args...)...)
		cmd.Stdin = bytes.NewReader(stdin)
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("nix %v: %v", args, err)
		}
		return strings.TrimSpace(string(out))
	}
	must(t, os.WriteFile(sk, []byte(nixcmd(nil, "key", "generate-secret", "--key-name", "test-1")), 0o600))
	skb, _ := os.ReadFile(sk)
	pub := nixcmd(skb, "key", "convert-secret-to-public")
	nixcmd(nil, "store", "sign", "--key-file", sk, "--store", "file://"+dir, "-r", f.topB)

	s := f.open(t, filepath.Join(t.TempDir(), "root"), func(o *Options) { o.NixPublicKeys = []string{pub} })
	if _, err := applyDir(t, s, dir); err != nil {
		t.Fatal(err)
	}
}

// Both xz decoders (xz(1) and the pure-Go fallback) unpack Nix's xz NARs
// and refuse a corrupted one with the store untouched.
func TestXZDecoders(t *testing.T) {
	f := getFixture(t)
	defer func() { release.ExternalXZ = true }()
	for _, external := range []bool{true, false} {
		t.Run(map[bool]string{true: "xz(1)", false: "pure-Go"}[external], func(t *testing.T) {
			if external {
				testenv.LookPath(t, "xz")
			}
			release.ExternalXZ = external
			s := f.open(t, filepath.Join(t.TempDir(), "root"), nil)
			if _, err := applyDir(t, s, f.relA); err != nil {
				t.Fatal(err)
			}
			bad := f.release(t, f.relA, nil, func(m *release.Manifest) { m.Generation = 2 })
			nf, _ := narFile(t, bad, "-tool-a")
			b, _ := os.ReadFile(nf)
			b[len(b)/2] ^= 0xff
			must(t, os.WriteFile(nf, b, 0o644))
			s2 := f.open(t, filepath.Join(t.TempDir(), "root2"), nil)
			before := snapshot(t, s2.Root())
			_, err := applyDir(t, s2, bad)
			if err == nil || !strings.Contains(err.Error(), "nar of") {
				t.Fatalf("corrupted xz: %v", err)
			}
			if snapshot(t, s2.Root()) != before {
				t.Fatal("store changed")
			}
		})
	}
}

// A release that claims different content for a path the store already
// holds is refused before anything is fetched.
func TestPresentPathWithOtherHashRefused(t *testing.T) {
	f := getFixture(t)
	s := f.open(t, filepath.Join(t.TempDir(), "root"), nil)
	if _, err := applyDir(t, s, f.relA); err != nil {
		t.Fatal(err)
	}
	before := snapshot(t, s.Root())
	bad := f.release(t, f.relA, nil, func(m *release.Manifest) {
		m.Generation = 2
		for i := range m.Paths {
			if strings.HasSuffix(m.Paths[i].Path, "-tool-a") {
				m.Paths[i].NarHash = "sha256:" + strings.Repeat("0", 52)
			}
		}
	})
	_, err := applyDir(t, s, bad)
	if err == nil || !strings.Contains(err.Error(), "is already in the store with NarHash") {
		t.Fatalf("apply: %v", err)
	}
	if snapshot(t, s.Root()) != before {
		t.Fatal("store changed")
	}
}

// narRoot is a NAR whose root entry is a single node: narRoot("symlink",
// "target", "/") or narRoot("regular", "contents", "...").
func narRoot(typ, key, value string) []byte {
	var b bytes.Buffer
	for _, s := range []string{"nix-archive-1", "(", "type", typ, key, value, ")"} {
		narStr(&b, s)
	}
	return b.Bytes()
}

// A malicious publisher signs a release whose top is a symlink to "/":
// were it accepted, every cage's /nix/tools bind would follow it on the
// host and show the host's root. apply and `release verify` refuse it; a
// top that is a regular file too.
func TestTopNotDirectoryRefused(t *testing.T) {
	f := getFixture(t)
	for name, nar := range map[string][]byte{
		"SymlinkToRoot": narRoot("symlink", "target", "/"),
		"SymlinkUp":     narRoot("symlink", "target", "../../.."),
		"RegularFile":   narRoot("regular", "contents", "#!/bin/sh\n"),
	} {
		t.Run(name, func(t *testing.T) {
			root := filepath.Join(t.TempDir(), "root")
			s := f.open(t, root, nil)
			if _, err := applyDir(t, s, f.relA); err != nil {
				t.Fatal(err)
			}
			before := snapshot(t, root)
			dir := craftedRelease(t, f, 2, nar)
			_, err := applyDir(t, s, dir)
			var ref *release.Refusal
			if !errors.As(err, &ref) || !strings.Contains(err.Error(), "not a directory") {
				t.Fatalf("apply of a release whose top is not a directory: %v", err)
			}
			if snapshot(t, root) != before {
				t.Fatal("store changed by a refused release")
			}
			rel, err := release.Open(context.Background(), release.DirSource(dir), release.Policy{Keys: []*release.PublicKey{f.pub}})
			must(t, err)
			if _, err := rel.VerifyAll(context.Background(), 1); err == nil || !strings.Contains(err.Error(), "not a directory") {
				t.Fatalf("release verify: %v", err)
			}
		})
	}
}

// A store whose top was turned into a link after apply (what an apply by an
// older build would have left, or tampering) fails `store verify`, and the
// bind sources refuse to resolve, so a cage does not start on it.
func TestTamperedTopRefusedAtBind(t *testing.T) {
	f := getFixture(t)
	root := filepath.Join(t.TempDir(), "root")
	s := f.open(t, root, nil)
	if _, err := applyDir(t, s, f.relA); err != nil {
		t.Fatal(err)
	}
	b, err := ResolveBinds(root)
	must(t, err)
	if b.Tools != filepath.Join(root, "nix/store", filepath.Base(f.topA)) || b.Store != filepath.Join(root, "nix/store") {
		t.Fatalf("bind sources %+v", b)
	}
	if _, err := s.Verify(context.Background(), true); err != nil {
		t.Fatal(err)
	}
	for _, openat2 := range []bool{true, false} {
		useOpenat2 = openat2
		t.Run(map[bool]string{true: "openat2", false: "layout"}[openat2], func(t *testing.T) { testTamperedTop(t, s, root) })
	}
	useOpenat2 = true
}

func testTamperedTop(t *testing.T, s *Store, root string) {
	if _, err := ResolveBinds(root); err != nil {
		t.Fatal(err)
	}
	m, err := s.manifest(1)
	must(t, err)
	top := filepath.Join(s.storeDir(), filepath.Base(m.Top))
	gen := s.genPath(1)
	for name, tamper := range map[string]func(){
		"StorePathIsLinkToRoot": func() {
			must(t, renameDir(top, top+".saved"))
			must(t, os.Symlink("/", top))
		},
		"TopLinkToHostEtc": func() {
			must(t, os.Chmod(gen, 0o755))
			must(t, os.Remove(filepath.Join(gen, topLink)))
			must(t, os.Symlink("/etc", filepath.Join(gen, topLink)))
		},
		"TopLinkAboveRoot": func() {
			must(t, os.Chmod(gen, 0o755))
			must(t, os.Remove(filepath.Join(gen, topLink)))
			must(t, os.Symlink("../../../../../../etc", filepath.Join(gen, topLink)))
		},
		"TopLinkInsideRootOutsideStore": func() {
			must(t, os.Chmod(gen, 0o755))
			must(t, os.Remove(filepath.Join(gen, topLink)))
			must(t, os.Symlink("..", filepath.Join(gen, topLink)))
		},
		"NixStoreIsLink": func() {
			must(t, os.Rename(s.storeDir(), s.storeDir()+".saved"))
			must(t, os.Symlink("/", s.storeDir()))
		},
	} {
		t.Run(name, func(t *testing.T) {
			saved := snapshot(t, root)
			tamper()
			defer func() {
				// Undo: restore the tree exactly as applied.
				_ = os.Remove(top)
				if _, err := os.Lstat(top + ".saved"); err == nil {
					must(t, renameDir(top+".saved", top))
				}
				if fi, err := os.Lstat(s.storeDir()); err == nil && fi.Mode()&fs.ModeSymlink != 0 {
					must(t, os.Remove(s.storeDir()))
					must(t, os.Rename(s.storeDir()+".saved", s.storeDir()))
				}
				_ = os.Remove(filepath.Join(gen, topLink))
				must(t, os.Symlink("../../nix/store/"+filepath.Base(m.Top), filepath.Join(gen, topLink)))
				must(t, os.Chmod(gen, 0o755))
				if snapshot(t, root) != saved {
					t.Fatal("could not undo the tampering")
				}
			}()
			if _, err := ResolveBinds(root); !errors.Is(err, ErrEscapes) {
				t.Fatalf("bind sources of a tampered store: %v", err)
			}
			if _, err := s.Verify(context.Background(), false); !errors.Is(err, ErrCorrupt) {
				t.Fatalf("store verify of a tampered store: %v", err)
			}
		})
	}
}

// A service cage walks from the store root to its tools as its own
// unprivileged user (docs/store.md): the layout's directories are 0755
// even when the store was made under caged's umask 0077, and the lock and
// apply's work in progress stay closed to it.
func TestLayoutTraversableByCages(t *testing.T) {
	f := getFixture(t)
	root := filepath.Join(t.TempDir(), "root")
	for _, d := range []string{"", "nix", "nix/store", "generations"} {
		must(t, os.MkdirAll(filepath.Join(root, d), 0o700))
		must(t, os.Chmod(filepath.Join(root, d), 0o700)) // as made under umask 0077
	}
	s := f.open(t, root, nil)
	if _, err := applyDir(t, s, f.relA); err != nil {
		t.Fatal(err)
	}
	for _, d := range []string{"", "nix", "nix/store", "generations", "generations/1"} {
		fi, err := os.Stat(filepath.Join(root, d))
		must(t, err)
		if fi.Mode().Perm() != 0o755 {
			t.Errorf("%s/%s has mode %o, want 755", root, d, fi.Mode().Perm())
		}
	}
	fi, err := os.Stat(filepath.Join(root, lockFile))
	must(t, err)
	if fi.Mode().Perm()&0o077 != 0 {
		t.Errorf("the store's lock has mode %o: a cage could take it", fi.Mode().Perm())
	}
}
