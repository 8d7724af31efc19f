// Package releasetest builds real Nix store paths and Nix-written binary
// caches for tests of internal/release, internal/store and cagectl. Tests
// that use it skip when not root (they write to the host's /nix/store) and
// skip (or, with a tier switched on, fail) when nix-bin is not installed.
package releasetest

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nixcage/nixcage/internal/release"
	"github.com/nixcage/nixcage/internal/testenv"
)

// RequireNix skips unless the test runs as root and nix-store, nix and
// nix-build are installed.
func RequireNix(t testing.TB) {
	t.Helper()
	testenv.RequireRoot(t, "the test adds paths to the host's /nix/store, which Debian's nix-bin (single-user Nix) lets only root write")
	testenv.LookPath(t, "nix-store")
	testenv.LookPath(t, "nix")
	testenv.LookPath(t, "nix-build")
}

// NixConfig is the test-scoped Nix configuration: single-user mode, builds
// run as the calling user (root) without build users. Debian's nix-bin
// defaults to build-users-group = nixbld but only nix-setup-systemd creates
// that group; the tests use Nix as it is installed and leave /etc/nix and
// the host's accounts alone (docs/testing.md). Later lines of NIX_CONFIG
// win, so this goes last.
const NixConfig = "build-users-group ="

// Command is exec.Command for a Nix tool with NixConfig in its environment.
func Command(name string, args ...string) *exec.Cmd {
	cmd := exec.Command(name, args...)
	conf := NixConfig
	if c := os.Getenv("NIX_CONFIG"); c != "" {
		conf = c + "\n" + NixConfig
	}
	cmd.Env = append(os.Environ(), "NIX_CONFIG="+conf)
	return cmd
}

func run(t testing.TB, name string, args ...string) string {
	t.Helper()
	cmd := Command(name, args...)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		t.Fatalf("%s %s: %v\n%s", name, strings.Join(args, " "), err, errb.String())
	}
	return strings.TrimSpace(out.String())
}

// Deterministic returns n pseudo-random bytes derived from seed (SHA-256 in
// counter mode): incompressible, reproducible, no global state.
func Deterministic(seed string, n int) []byte {
	out := make([]byte, 0, n+32)
	var ctr [8]byte
	for i := uint64(0); len(out) < n; i++ {
		binary.LittleEndian.PutUint64(ctr[:], i)
		h := sha256.Sum256(append([]byte(seed), ctr[:]...))
		out = append(out, h[:]...)
	}
	return out[:n]
}

// Closure adds a small tool closure to the local Nix store and returns its
// top-level path. The closure has two members: a source tree added with
// `nix-store --add` (an executable, relative and absolute symlinks, nested
// directories, an empty file and a file of largeSize bytes) and a
// derivation output that references it (so the closure has a real
// reference edge). variant makes different, reproducible closures.
func Closure(t testing.TB, variant string, largeSize int) string {
	t.Helper()
	RequireNix(t)
	dir := t.TempDir()
	src := filepath.Join(dir, "tool-"+variant)
	must(t, os.MkdirAll(filepath.Join(src, "bin"), 0o755))
	must(t, os.MkdirAll(filepath.Join(src, "share", "doc", "deep", "er"), 0o755))
	must(t, os.WriteFile(filepath.Join(src, "bin", "hello"), []byte("#!/bin/sh\necho hello "+variant+"\n"), 0o755))
	must(t, os.WriteFile(filepath.Join(src, "share", "doc", "README"), []byte("variant "+variant+"\n"), 0o644))
	must(t, os.WriteFile(filepath.Join(src, "share", "doc", "deep", "er", "empty"), nil, 0o644))
	must(t, os.WriteFile(filepath.Join(src, "share", "large.bin"), Deterministic("large-"+variant, largeSize), 0o644))
	must(t, os.Symlink("../share/doc/README", filepath.Join(src, "bin", "readme")))
	must(t, os.Symlink("/etc/hostname", filepath.Join(src, "share", "abs-link")))
	dep := run(t, "nix-store", "--add", src)

	expr := filepath.Join(dir, "top.nix")
	// builtins.storePath gives the string its context, so the output's
	// reference to dep is real (scanned by Nix), not just text.
	must(t, os.WriteFile(expr, []byte(fmt.Sprintf(`let dep = builtins.storePath %q; in derivation {
  name = "env-%s"; system = builtins.currentSystem; builder = "/bin/sh";
  args = [ "-c" "/bin/mkdir -p $out/bin && /bin/ln -s ${dep}/bin/hello $out/bin/hello && echo ${dep} > $out/dep" ];
}
`, dep, variant)), 0o644))
	return run(t, "nix-build", "--no-out-link", "--option", "sandbox", "false", "--option", "substituters", "", expr)
}

// Copy writes the closure of top into a Nix binary cache at dir, exactly as
// an operator would: nix copy --to file://dir.
func Copy(t testing.TB, top, dir, compression string) {
	t.Helper()
	run(t, "nix", "--extra-experimental-features", "nix-command", "copy",
		"--to", "file://"+dir+"?compression="+compression, top)
}

// Key generates a release key pair on disk and returns the parsed halves
// and the public key's path.
func Key(t testing.TB, alg string) (*release.PrivateKey, *release.PublicKey, string) {
	t.Helper()
	priv, pub, err := release.GenerateKey(alg)
	must(t, err)
	dir := t.TempDir()
	pubPath := filepath.Join(dir, "release.pub")
	must(t, os.WriteFile(filepath.Join(dir, "release.key"), priv, 0o600))
	must(t, os.WriteFile(pubPath, pub, 0o644))
	sk, err := release.ParsePrivateKey(priv)
	must(t, err)
	pk, err := release.ParsePublicKey(pub)
	must(t, err)
	return sk, pk, pubPath
}

// Resign rewrites the manifest of the release in dir with edit applied and
// signs it with keys: how tests make otherwise-valid releases that differ in
// one field (generation, channel, expiry, a path's hash...).
func Resign(t testing.TB, dir string, keys []*release.PrivateKey, edit func(*release.Manifest)) {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join(dir, release.ManifestFile))
	must(t, err)
	m, err := release.ParseManifest(raw)
	must(t, err)
	if edit != nil {
		edit(m)
	}
	raw, err = m.Marshal()
	must(t, err)
	sigs, err := release.Sign(raw, keys)
	must(t, err)
	rawSig, err := sigs.Marshal()
	must(t, err)
	must(t, os.WriteFile(filepath.Join(dir, release.ManifestFile), raw, 0o644))
	must(t, os.WriteFile(filepath.Join(dir, release.SignaturesFile), rawSig, 0o644))
}

// CopyDir copies a release directory (regular files only, hard links where
// possible) so a test can tamper with its copy.
func CopyDir(t testing.TB, src, dst string) {
	t.Helper()
	must(t, filepath.Walk(src, func(p string, fi os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(src, p)
		target := filepath.Join(dst, rel)
		if fi.IsDir() {
			return os.MkdirAll(target, 0o755)
		}
		b, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		return os.WriteFile(target, b, 0o644)
	}))
}

// Expires is a validity window comfortably in the future.
func Expires() time.Time { return time.Now().Add(30 * 24 * time.Hour) }

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}
