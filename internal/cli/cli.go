// Package cli is cagectl: every subcommand is a file in this package that
// registers itself, and Run is the whole program, so tests drive the CLI
// in-process with injected stdio exactly as a user would from a shell.
package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"sort"
	"strings"

	"github.com/nixcage/nixcage/internal/stdio"
)

// Stdio is the program's view of the terminal.
type Stdio = stdio.Stdio

// OS returns the process's own stdio.
func OS() Stdio { return stdio.OS() }

// Exit codes scripts can rely on.
const (
	ExitOK      = 0
	ExitFailure = 1 // the operation ran and failed (invalid config, refused apply, ...)
	ExitUsage   = 2 // the command line was wrong
	ExitDenied  = 3 // the daemon refused: not authorized
	ExitNoConn  = 4 // caged could not be reached
	// ExitIO: the store's own file system failed (out of space or inodes,
	// read-only, I/O error) before the switch; the previous generation is
	// still current. Distinct from a refused release (1), a policy verdict.
	ExitIO = 5
	// ExitExpired: `store verify` found the store intact but the current
	// generation's release expired (a frozen mirror); see docs/store.md.
	ExitExpired = 6
)

// ExitError carries an exit code through Run. Its message, if any, has been
// printed already or is printed by Main.
type ExitError struct {
	Code int
	Err  error
}

func (e *ExitError) Error() string {
	if e.Err == nil {
		return fmt.Sprintf("exit status %d", e.Code)
	}
	return e.Err.Error()
}
func (e *ExitError) Unwrap() error { return e.Err }

// usageError marks a bad command line.
func usageError(format string, args ...any) error {
	return &ExitError{Code: ExitUsage, Err: fmt.Errorf(format, args...)}
}

// command is one cagectl subcommand.
type command struct {
	name  string // may contain a space for nested commands: "key generate"
	args  string // synopsis of positional arguments
	short string
	run   func(ctx context.Context, env *Env, args []string) error
}

var commands = map[string]*command{}

func register(c *command) {
	if _, dup := commands[c.name]; dup {
		panic("cli: duplicate command " + c.name)
	}
	commands[c.name] = c
}

// Env is what a subcommand gets: stdio and the process environment.
type Env struct {
	Stdio
	Getenv func(string) string
}

// Run runs cagectl with args (without the program name).
func Run(ctx context.Context, args []string, stdio Stdio) error {
	env := &Env{Stdio: stdio, Getenv: os.Getenv}
	if len(args) == 0 || args[0] == "-h" || args[0] == "--help" || args[0] == "help" {
		printUsage(stdio.Out)
		if len(args) == 0 {
			return &ExitError{Code: ExitUsage}
		}
		return nil
	}
	// Longest match first so "key generate" wins over "key".
	for n := min(2, len(args)); n >= 1; n-- {
		if c, ok := commands[strings.Join(args[:n], " ")]; ok {
			return c.run(ctx, env, args[n:])
		}
	}
	return usageError("unknown command %q; run 'cagectl help' for the list", args[0])
}

// Main runs cagectl and returns the process exit code.
func Main(ctx context.Context, args []string, stdio Stdio) int {
	err := Run(ctx, args, stdio)
	if err == nil {
		return ExitOK
	}
	var ee *ExitError
	if errors.As(err, &ee) {
		if ee.Err != nil {
			fmt.Fprintln(stdio.Err, "cagectl:", ee.Err)
		}
		return ee.Code
	}
	fmt.Fprintln(stdio.Err, "cagectl:", err)
	return ExitFailure
}

func printUsage(w io.Writer) {
	defer fmt.Fprint(w, exitCodesHelp)
	fmt.Fprintln(w, "usage: cagectl COMMAND [ARGS]\n\ncommands:")
	names := make([]string, 0, len(commands))
	for n := range commands {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		c := commands[n]
		fmt.Fprintf(w, "  %-28s %s\n", strings.TrimSpace(n+" "+c.args), c.short)
	}
}

// newFlags returns a FlagSet that reports errors instead of exiting.
func newFlags(env *Env, name string) *flag.FlagSet {
	fs := flag.NewFlagSet("cagectl "+name, flag.ContinueOnError)
	fs.SetOutput(env.Err)
	return fs
}

// parseFlags parses flags anywhere among args (flag stops at the first
// positional argument; operators write `render x.hcl --out DIR`).
func parseFlags(fs *flag.FlagSet, args []string) ([]string, error) {
	var pos []string
	for {
		if err := fs.Parse(args); err != nil {
			return nil, &ExitError{Code: ExitUsage}
		}
		args = fs.Args()
		if len(args) == 0 {
			return pos, nil
		}
		pos = append(pos, args[0])
		args = args[1:]
	}
}

const exitCodesHelp = `
exit status:
  0  success
  1  the operation ran and failed (invalid config, release refused by policy, store corrupt)
  2  bad command line
  3  caged refused: not authorized
  4  caged could not be reached
  5  store I/O failure (out of space or inodes, read-only, I/O error); nothing was switched
  6  store verify: intact, but the current generation's release has expired
`
