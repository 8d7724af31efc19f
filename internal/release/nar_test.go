package release

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

type narBuf struct{ bytes.Buffer }

func (b *narBuf) str(ss ...string) *narBuf {
	for _, s := range ss {
		var n [8]byte
		binary.LittleEndian.PutUint64(n[:], uint64(len(s)))
		b.Write(n[:])
		b.WriteString(s)
		for i := len(s); i%8 != 0; i++ {
			b.WriteByte(0)
		}
	}
	return b
}

func file(name, content string, exec bool) []string {
	s := []string{"entry", "(", "name", name, "node", "(", "type", "regular"}
	if exec {
		s = append(s, "executable", "")
	}
	return append(s, "contents", content, ")", ")")
}

func dirNAR(entries ...[]string) []byte {
	b := (&narBuf{}).str("nix-archive-1", "(", "type", "directory")
	for _, e := range entries {
		b.str(e...)
	}
	b.str(")")
	return b.Bytes()
}

func TestUnpackNAR(t *testing.T) {
	link := []string{"entry", "(", "name", "l", "node", "(", "type", "symlink", "target", "/etc/passwd", ")", ")"}
	sub := []string{"entry", "(", "name", "sub", "node", "(", "type", "directory"}
	sub = append(sub, file("f", "inner", false)...)
	sub = append(sub, ")", ")")
	cases := []struct {
		name string
		nar  []byte
		want string // error substring, "" = ok
	}{
		{"Valid", dirNAR(file("a", "hello", false), file("b", "#!/bin/sh", true), link, sub), ""},
		{"DotDot", dirNAR(file("..", "x", false)), "escapes its store path"},
		{"Dot", dirNAR(file(".", "x", false)), "escapes its store path"},
		{"Slash", dirNAR(file("a/b", "x", false)), "is invalid"},
		{"Duplicate", dirNAR(file("a", "x", false), file("a", "y", false)), "appears twice"},
		{"Unsorted", dirNAR(file("b", "x", false), file("a", "y", false)), "wrong order"},
		{"Truncated", dirNAR(file("a", "hello", false))[:60], "read nar"},
		{"NotANar", []byte("definitely not a nar"), "read nar"},
		{"NameOverNameMax", dirNAR(file(strings.Repeat("n", 300), "x", false)), "exceeds maximum of 255 bytes"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			dst := filepath.Join(t.TempDir(), "out")
			st, err := UnpackNAR(bytes.NewReader(tc.nar), dst)
			if tc.want != "" {
				if err == nil || !strings.Contains(err.Error(), tc.want) {
					t.Fatalf("error %v, want %q", err, tc.want)
				}
				if we := (*WriteError)(nil); errors.As(err, &we) {
					t.Fatalf("error %v is a WriteError: a verdict on the NAR must not read as this machine's I/O failure", err)
				}
				if _, err := os.Lstat(filepath.Join(filepath.Dir(dst), "x")); err == nil {
					t.Fatal("an entry landed outside dst")
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			sum := sha256.Sum256(tc.nar)
			if !bytes.Equal(st.Digest, sum[:]) || st.Size != int64(len(tc.nar)) {
				t.Fatal("digest/size do not cover the NAR")
			}
			if st.Files != 3 || st.Dirs != 2 || st.Symlinks != 1 {
				t.Fatalf("stats %+v", st)
			}
			fi, _ := os.Stat(filepath.Join(dst, "b"))
			if fi.Mode().Perm() != 0o555 {
				t.Fatalf("executable mode %v", fi.Mode())
			}
			fi, _ = os.Stat(filepath.Join(dst, "a"))
			if fi.Mode().Perm() != 0o444 {
				t.Fatalf("file mode %v", fi.Mode())
			}
			fi, _ = os.Stat(filepath.Join(dst, "sub"))
			if fi.Mode().Perm() != 0o555 {
				t.Fatalf("dir mode %v", fi.Mode())
			}
			if tgt, _ := os.Readlink(filepath.Join(dst, "l")); tgt != "/etc/passwd" {
				t.Fatalf("symlink target %q", tgt)
			}
			if b, _ := os.ReadFile(filepath.Join(dst, "sub", "f")); string(b) != "inner" {
				t.Fatalf("sub/f = %q", b)
			}
			// Trailing bytes are hashed too, so they can never go unnoticed.
			st2, err := UnpackNAR(bytes.NewReader(append(append([]byte{}, tc.nar...), "junk"...)), "")
			if err != nil || bytes.Equal(st2.Digest, st.Digest) || st2.Size != st.Size+4 {
				t.Fatalf("trailing data not covered: %v", err)
			}
			makeWritable(dst)
		})
	}
}

func makeWritable(dir string) {
	filepath.Walk(dir, func(p string, fi os.FileInfo, err error) error {
		if err == nil && fi.IsDir() {
			os.Chmod(p, 0o755)
		}
		return nil
	})
}

func FuzzUnpackNAR(f *testing.F) {
	f.Add(dirNAR(file("a", "hello", false)))
	f.Add(dirNAR(file("..", "x", false)))
	f.Fuzz(func(t *testing.T, b []byte) {
		UnpackNAR(bytes.NewReader(b), "") // must not panic or hang
	})
}

// Cages read the store as other users: modes must be exactly 0444/0555
// even when the unpacking process runs with umask 077. The umask is
// process-wide, so this runs in a child process.
func TestUnpackNARIgnoresUmask(t *testing.T) {
	if dst := os.Getenv("NIXCAGE_UMASK_CHILD"); dst != "" {
		syscall.Umask(0o077)
		if _, err := UnpackNAR(bytes.NewReader(dirNAR(file("a", "x", false), file("b", "y", true))), dst); err != nil {
			t.Fatal(err)
		}
		return
	}
	dst := filepath.Join(t.TempDir(), "out")
	cmd := exec.Command(os.Args[0], "-test.run=^TestUnpackNARIgnoresUmask$")
	cmd.Env = append(os.Environ(), "NIXCAGE_UMASK_CHILD="+dst)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("child: %v\n%s", err, out)
	}
	defer makeWritable(dst)
	for name, want := range map[string]os.FileMode{"": 0o555, "a": 0o444, "b": 0o555} {
		fi, err := os.Stat(filepath.Join(dst, name))
		if err != nil || fi.Mode().Perm() != want {
			t.Errorf("%q: mode %v (%v), want %v", name, fi.Mode().Perm(), err, want)
		}
	}
}

// TestUnpackRefusesPathsPastPathMax: an entry whose path in a cage
// (/nix/store/<name>/...) is PATH_MAX or longer is refused as a verdict,
// whether or not it is being written (dst empty: hash only), and one the
// kernel refuses while unpacking under a longer store root too, never as
// a WriteError.
func TestUnpackRefusesPathsPastPathMax(t *testing.T) {
	deep := func(depth int) []byte {
		var b narBuf
		b.str("nix-archive-1", "(", "type", "directory")
		for range depth {
			b.str("entry", "(", "name", "d", "node", "(", "type", "directory")
		}
		for range depth {
			b.str(")", ")")
		}
		b.str(")")
		return b.Bytes()
	}
	const sp = "/nix/store/00000000000000000000000000000001-deep"
	// 2030 levels of "/d": 4060 bytes, +49 for the store path: past 4095.
	if _, err := unpackNAR(bytes.NewReader(deep(2030)), "", sp); err == nil || !strings.Contains(err.Error(), "longer than PATH_MAX") {
		t.Fatalf("hash-only: err=%v", err)
	}
	// 2000 levels: 4049 bytes in a cage, fine there; unpacked under a root
	// padded to make it too long for this machine: refused, not I/O.
	if _, err := unpackNAR(bytes.NewReader(deep(2000)), "", sp); err != nil {
		t.Fatalf("4049-byte path, hash-only: %v", err)
	}
	root := t.TempDir()
	dst := filepath.Join(root, strings.Repeat("p", 200), "out")
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		t.Fatal(err)
	}
	_, err := unpackNAR(bytes.NewReader(deep(2000)), dst, sp)
	var we *WriteError
	if err == nil || !strings.Contains(err.Error(), "longer than PATH_MAX") || errors.As(err, &we) {
		t.Fatalf("unpack under a long root: err=%v (WriteError=%v)", err, errors.As(err, &we))
	}
}
