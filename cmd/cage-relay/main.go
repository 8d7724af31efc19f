// Command cage-relay is nixcage's chat relay: it carries owners' Telegram
// commands to caged and answers back. All logic lives in internal/relay.
package main

import (
	"context"
	"fmt"
	"os"

	"github.com/nixcage/nixcage/internal/relay"
	"github.com/nixcage/nixcage/internal/stdio"
)

func main() {
	if err := relay.Run(context.Background(), os.Args[1:], stdio.OS()); err != nil {
		fmt.Fprintln(os.Stderr, "cage-relay:", err)
		os.Exit(1)
	}
}
