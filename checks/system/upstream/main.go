// Command upstream is the fake internet inside a system-test machine (HTTPS,
// HTTP and DNS for a test zone). All logic lives in internal/systest/upstream.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/nixcage/nixcage/internal/systest/upstream"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := upstream.Run(ctx, os.Args[1:], os.Stderr)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "upstream:", err)
		os.Exit(1)
	}
}
