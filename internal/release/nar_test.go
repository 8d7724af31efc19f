package release

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"os"
	"path/filepath"
	"strings"
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
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			dst := filepath.Join(t.TempDir(), "out")
			st, err := UnpackNAR(bytes.NewReader(tc.nar), dst)
			if tc.want != "" {
				if err == nil || !strings.Contains(err.Error(), tc.want) {
					t.Fatalf("error %v, want %q", err, tc.want)
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
