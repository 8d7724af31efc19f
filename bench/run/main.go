// Command runbench times `cagectl run -- true` against systemd-run and srt
// (run it through bench/run/run.sh). All logic lives in
// internal/systest/runbench.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/nixcage/nixcage/internal/systest/runbench"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := runbench.Run(ctx, os.Args[1:], os.Stdout)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "run-latency:", err)
		os.Exit(1)
	}
}
