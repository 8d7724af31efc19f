// Command narhash times nixcage's NAR verification path (parse with
// go-nix, SHA-256 over every byte, no unpacking) over a NAR file, for
// bench/store/run.sh to compare against sha256sum on the same bytes.
package main

import (
	"bufio"
	"fmt"
	"os"
	"time"

	"github.com/nix-community/go-nix/pkg/nixhash"
	"github.com/nixcage/nixcage/internal/release"
)

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: narhash FILE.nar")
		os.Exit(2)
	}
	f, err := os.Open(os.Args[1])
	if err != nil {
		fmt.Fprintln(os.Stderr, "narhash:", err)
		os.Exit(1)
	}
	defer f.Close()
	start := time.Now()
	st, err := release.UnpackNAR(bufio.NewReaderSize(f, 1<<20), "")
	if err != nil {
		fmt.Fprintln(os.Stderr, "narhash:", err)
		os.Exit(1)
	}
	sec := time.Since(start).Seconds()
	h := nixhash.MustNewHashWithEncoding(nixhash.SHA256, st.Digest, nixhash.Base16, false)
	fmt.Printf("%s %d bytes %.3fs %.0f MiB/s\n", h, st.Size, sec, float64(st.Size)/(1<<20)/sec)
}
