// Command cage-egress is a cage's egress gateway. All logic lives in
// internal/egress.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/nixcage/nixcage/internal/egress"
	"github.com/nixcage/nixcage/internal/stdio"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := egress.Main(ctx, os.Args[1:], stdio.OS())
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "cage-egress:", err)
		os.Exit(1)
	}
}
