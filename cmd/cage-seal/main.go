// Command cage-seal seals an nspawn or podman cage from inside (a seccomp
// filter) and execs the agent's command, or, as an nspawn cage's PID 1
// (--init), runs it as its child. All logic lives in internal/seal.
package main

import (
	"fmt"
	"os"

	"github.com/nixcage/nixcage/internal/seal"
)

func main() {
	err := seal.Run(os.Args[1:])
	fmt.Fprintln(os.Stderr, "cage-seal:", err)
	os.Exit(127)
}
