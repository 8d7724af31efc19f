// Command summary prints the per-tier summary at the end of checks/test.sh
// (internal/testreport).
package main

import (
	"context"
	"errors"
	"fmt"
	"os"

	"github.com/nixcage/nixcage/internal/testreport"
)

func main() {
	err := testreport.Run(context.Background(), os.Args[1:], os.Stdin, os.Stdout, os.Stderr)
	if err != nil {
		if !errors.Is(err, testreport.ErrFailed) {
			fmt.Fprintln(os.Stderr, "summary:", err)
		}
		os.Exit(1)
	}
}
