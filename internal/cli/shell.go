package cli

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/nixcage/nixcage/internal/bus"
	termpkg "github.com/nixcage/nixcage/internal/term"
)

func init() {
	register(&command{
		name:  "shell",
		args:  "AGENT [--bus ADDR] [-- COMMAND [ARGS...]]",
		short: "open a shell (or COMMAND) inside a running cage, as the agent, with its walls; audited; its exit status is cagectl's (admin)",
		run:   runShell,
	})
}

func runShell(ctx context.Context, env *Env, args []string) error {
	fs := newFlags(env, "shell")
	addr := addBusFlag(fs, env)
	var cmd []string
	for i, a := range args {
		if a == "--" {
			args, cmd = args[:i], args[i+1:]
			break
		}
	}
	pos, err := parseFlags(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 1 {
		return usageError("usage: cagectl shell AGENT [-- COMMAND [ARGS...]] (the command goes after --)")
	}
	agent := pos[0]
	if err := checkAgent(agent); err != nil {
		return err
	}
	stdio, err := osStdio(env)
	if err != nil {
		return err
	}
	c, err := dialCaged(ctx, *addr)
	if err != nil {
		return err
	}
	defer c.Close()
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	ends, err := c.WatchShells(wctx)
	if err != nil {
		return busError(err)
	}
	req := bus.ShellRequest{Agent: agent, Command: cmd}
	term, cageIO, err := cageStdio(stdio)
	if err != nil {
		return err
	}
	defer term.Close()
	if term != nil {
		req.TTY, req.Term = true, env.Getenv("TERM")
	}
	unit, err := c.OpenShell(ctx, req, cageIO)
	if err != nil {
		return busError(fmt.Errorf("shell %s: %w", agent, err))
	}
	if err := term.handOver(); err != nil {
		return err
	}
	code, err := waitShell(ctx, c, unit, ends, term)
	term.finish()
	if err != nil {
		return err
	}
	if code != 0 {
		return &ExitError{Code: int(code)}
	}
	return nil
}

// waitShell waits for the shell's end and returns its exit status. Without
// a terminal, a signal that ends cagectl ends the shell too: caged stops it
// when cagectl leaves the bus.
func waitShell(ctx context.Context, c *bus.Client, unit string, ends <-chan bus.ShellEnd, term *terminal) (int32, error) {
	var winch chan os.Signal
	if term != nil {
		winch = make(chan os.Signal, 1)
		signal.Notify(winch, syscall.SIGWINCH)
		defer signal.Stop(winch)
	}
	alive := time.NewTicker(time.Second)
	defer alive.Stop()
	owner := c.Owner(ctx)
	lost := &ExitError{Code: ExitNoConn, Err: errors.New("lost the connection to caged while the shell ran; caged closes it")}
	for {
		select {
		case end, ok := <-ends:
			if !ok {
				return 0, lost
			}
			if end.Unit == unit {
				return end.Exit, nil
			}
		case <-winch:
			termpkg.CopySize(term.user[0], term.master)
		case <-alive.C:
			if !c.Connected() {
				return 0, lost
			}
			if now := c.Owner(ctx); now != owner {
				return 0, &ExitError{Code: ExitNoConn, Err: fmt.Errorf("caged stopped or restarted while the shell (%s) ran; it was closed", unit)}
			}
		case <-ctx.Done():
			return 0, ctx.Err()
		}
	}
}
