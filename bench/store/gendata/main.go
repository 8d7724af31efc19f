// Command gendata writes the deterministic benchmark closure for
// bench/store/run.sh: PATHS directories under OUT totalling about SIZE MiB,
// each with large files, many small files in nested directories,
// executables and symlinks. Half of the bytes are random (incompressible),
// half hex text (compresses about 2:1, like source and scripts). The same
// arguments always produce the same bytes.
package main

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
)

func stream(seed string, n int) []byte {
	out := make([]byte, 0, n+32)
	var ctr [8]byte
	for i := uint64(0); len(out) < n; i++ {
		binary.LittleEndian.PutUint64(ctr[:], i)
		h := sha256.Sum256(append([]byte(seed), ctr[:]...))
		out = append(out, h[:]...)
	}
	return out[:n]
}

func content(seed string, n int, text bool) []byte {
	if !text {
		return stream(seed, n)
	}
	return []byte(hex.EncodeToString(stream(seed, (n+1)/2))[:n])
}

func main() {
	if len(os.Args) != 4 {
		fmt.Fprintln(os.Stderr, "usage: gendata OUT SIZE_MIB PATHS")
		os.Exit(2)
	}
	out := os.Args[1]
	sizeMiB, _ := strconv.Atoi(os.Args[2])
	paths, _ := strconv.Atoi(os.Args[3])
	if sizeMiB <= 0 || paths <= 0 {
		fmt.Fprintln(os.Stderr, "gendata: SIZE_MIB and PATHS must be positive")
		os.Exit(2)
	}
	per := sizeMiB << 20 / paths
	for p := range paths {
		root := filepath.Join(out, fmt.Sprintf("bench-tool-%02d", p))
		must(os.MkdirAll(filepath.Join(root, "bin"), 0o755))
		// Two thirds in 4 large files, one third in small files.
		large := per * 2 / 3 / 4
		for i := range 4 {
			name := filepath.Join(root, "lib", fmt.Sprintf("blob%d.bin", i))
			must(os.MkdirAll(filepath.Dir(name), 0o755))
			must(os.WriteFile(name, content(fmt.Sprintf("L%d-%d", p, i), large, i%2 == 1), 0o644))
		}
		small, written := 16<<10, 0
		for i := 0; written < per/3; i++ {
			dir := filepath.Join(root, "share", fmt.Sprintf("d%02d", i%32), fmt.Sprintf("e%02d", i%7))
			must(os.MkdirAll(dir, 0o755))
			n := small/2 + (i*7919)%small
			mode := os.FileMode(0o644)
			if i%50 == 0 {
				mode = 0o755
			}
			must(os.WriteFile(filepath.Join(dir, fmt.Sprintf("f%05d", i)), content(fmt.Sprintf("S%d-%d", p, i), n, i%2 == 0), mode))
			if i%100 == 0 {
				must(os.Symlink(fmt.Sprintf("../share/d%02d/e%02d/f%05d", i%32, i%7, i), filepath.Join(root, "bin", fmt.Sprintf("l%05d", i))))
			}
			written += n
		}
	}
}

func must(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, "gendata:", err)
		os.Exit(1)
	}
}
