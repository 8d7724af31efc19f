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
	// generation's release, or the trusted key set, expired (a frozen
	// channel); see docs/store.md.
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

// command is one cagectl subcommand. Its run makes its flags with newFlags
// and parses them with parseFlags before doing anything (help and
// completions capture them that way); a run without flags returns errHelp
// for a --help argument.
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
	// capture, when set, receives every FlagSet the command makes (help
	// and completion generation).
	capture func(*flag.FlagSet)
}

// Run runs cagectl with args (without the program name).
func Run(ctx context.Context, args []string, stdio Stdio) error {
	env := &Env{Stdio: stdio, Getenv: os.Getenv}
	if len(args) == 0 || args[0] == "-h" || args[0] == "--help" {
		printUsage(stdio.Out)
		if len(args) == 0 {
			return &ExitError{Code: ExitUsage}
		}
		return nil
	}
	if args[0] == "--version" {
		args = append([]string{"version"}, args[1:]...)
	}
	c, rest := lookup(args)
	if c == nil {
		if subs := subcommands(args[0]); len(subs) > 0 {
			// A group word alone ("cagectl key"): list its commands.
			printGroup(stdio.Out, args[0], subs)
			if len(args) > 1 && wantsHelp(args[1:]) {
				return nil
			}
			return &ExitError{Code: ExitUsage}
		}
		return usageError("unknown command %q; run 'cagectl help' for the list", args[0])
	}
	if wantsHelp(rest) {
		printHelp(ctx, env, c)
		return nil
	}
	return c.run(ctx, env, rest)
}

// lookup finds the command args start with, longest match first so that
// "key generate" wins over "key".
func lookup(args []string) (*command, []string) {
	for n := min(2, len(args)); n >= 1; n-- {
		if c, ok := commands[strings.Join(args[:n], " ")]; ok {
			return c, args[n:]
		}
	}
	return nil, nil
}

// wantsHelp reports whether args ask for help before any "--".
func wantsHelp(args []string) bool {
	for _, a := range args {
		switch a {
		case "--":
			return false
		case "-h", "-help", "--help":
			return true
		}
	}
	return false
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
	fmt.Fprintln(w, "usage: cagectl COMMAND [ARGS]\n       cagectl COMMAND --help\n       cagectl --version\n\ncommands:")
	for _, n := range commandNames() {
		fmt.Fprintf(w, "  %-20s %s\n", n, commands[n].short)
	}
	fmt.Fprint(w, exitCodesHelp)
}

// commandNames lists the commands, sorted.
func commandNames() []string {
	names := make([]string, 0, len(commands))
	for n := range commands {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// subcommands lists the commands nested under a group word ("key").
func subcommands(group string) []string {
	var out []string
	for _, n := range commandNames() {
		if g, _, ok := strings.Cut(n, " "); ok && g == group {
			out = append(out, n)
		}
	}
	return out
}

func printGroup(w io.Writer, group string, subs []string) {
	fmt.Fprintf(w, "usage: cagectl %s COMMAND [ARGS]\n\ncommands:\n", group)
	for _, n := range subs {
		fmt.Fprintf(w, "  %-20s %s\n", n, commands[n].short)
	}
	fmt.Fprintf(w, "\nRun 'cagectl %s COMMAND --help' for one command's flags and examples.\n", group)
}

// newFlags returns a FlagSet that reports errors instead of exiting.
// While a command's help is being written (env.capture), it hands the
// FlagSet over instead, so the flags a help page or completion lists are
// the ones the command parses.
func newFlags(env *Env, name string) *flag.FlagSet {
	fs := flag.NewFlagSet("cagectl "+name, flag.ContinueOnError)
	fs.SetOutput(env.Err)
	fs.Usage = func() { fmt.Fprintf(env.Err, "run 'cagectl %s --help' for its flags and examples\n", name) }
	if env.capture != nil {
		env.capture(fs)
	}
	return fs
}

// parseFlags parses flags anywhere among args (flag stops at the first
// positional argument; operators write `render x.hcl --out DIR`).
func parseFlags(fs *flag.FlagSet, args []string) ([]string, error) {
	var pos []string
	if wantsHelp(args) {
		return nil, errHelp // only reached while capturing flags (Run handles --help)
	}
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
  6  store verify: intact, but the current generation's release (or the trusted key set) has expired
`
