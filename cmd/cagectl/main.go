// Command cagectl is the operator's tool: validate and render configs, build
// and verify releases, and talk to caged. All logic lives in internal/cli.
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"github.com/nixcage/nixcage/internal/cli"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := cli.Main(ctx, os.Args[1:], cli.OS())
	stop()
	os.Exit(code)
}
