// Command latency measures cage start latency per backend against systemd-run
// with no cage (run it through bench/system/start-latency.sh). All logic
// lives in internal/systest/latency.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/nixcage/nixcage/internal/systest/latency"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := latency.Run(ctx, os.Args[1:], os.Stdout)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "start-latency:", err)
		os.Exit(1)
	}
}
