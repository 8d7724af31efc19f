// Command caged is nixcage's manager: it reconciles the declared agents into
// systemd units and serves org.nixcage.cage1 on the system bus. All logic
// lives in internal/daemon.
package main

import (
	"context"
	"fmt"
	"os"

	"github.com/nixcage/nixcage/internal/daemon"
)

func main() {
	err := daemon.Run(context.Background(), os.Args[1:], daemon.Stdio{In: os.Stdin, Out: os.Stdout, Err: os.Stderr})
	if err != nil {
		fmt.Fprintln(os.Stderr, "caged:", err)
		os.Exit(1)
	}
}
