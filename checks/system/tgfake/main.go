// Command tgfake is the fake Telegram Bot API inside a system-test machine.
// All logic lives in internal/relay/tgfake.
package main

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/nixcage/nixcage/internal/relay/tgfake"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := tgfake.Run(ctx, os.Args[1:], os.Stderr)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "tgfake:", err)
		os.Exit(1)
	}
}
