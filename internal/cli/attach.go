package cli

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"

	termpkg "github.com/nixcage/nixcage/internal/term"
)

func init() {
	register(&command{
		name:  "attach",
		args:  "AGENT [--bus ADDR]",
		short: "connect this terminal to an interactive agent's console; Ctrl-] detaches, the agent goes on (operator)",
		run:   runAttach,
	})
}

// detachKey is Ctrl-], as telnet and virsh console use.
const detachKey = 0x1d

func runAttach(ctx context.Context, env *Env, args []string) error {
	fs := newFlags(env, "attach")
	addr := addBusFlag(fs, env)
	pos, err := parseFlags(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 1 {
		return usageError("usage: cagectl attach AGENT")
	}
	agent := pos[0]
	if err := checkAgent(agent); err != nil {
		return err
	}
	stdio, err := osStdio(env)
	if err != nil {
		return err
	}
	if !termpkg.IsTerminal(stdio[0]) {
		return usageError("attach needs a terminal on stdin")
	}
	c, err := dialCaged(ctx, *addr)
	if err != nil {
		return err
	}
	defer c.Close()
	conn, err := c.AttachConsole(ctx, agent)
	if err != nil {
		return busError(fmt.Errorf("attach %s: %w", agent, err))
	}
	defer conn.Close()
	resize := func() {
		if rows, cols, ok := termpkg.Size(stdio[0]); ok {
			c.ResizeConsole(ctx, agent, rows, cols)
		}
	}
	resize()
	fmt.Fprintf(env.Err, "cagectl: attached to %s; Ctrl-] detaches (the agent goes on)\r\n", agent)
	restore, err := termpkg.MakeRaw(stdio[0])
	if err != nil {
		return fmt.Errorf("attach: raw mode: %w", err)
	}
	defer restore()

	winch := make(chan os.Signal, 1)
	signal.Notify(winch, syscall.SIGWINCH)
	defer signal.Stop(winch)
	detached := make(chan struct{})
	gone := make(chan struct{})
	go func() {
		defer close(detached)
		buf := make([]byte, 4096)
		for {
			n, err := stdio[0].Read(buf)
			if n > 0 {
				if i := bytes.IndexByte(buf[:n], detachKey); i >= 0 {
					conn.Write(buf[:i])
					return
				}
				if _, werr := conn.Write(buf[:n]); werr != nil {
					return
				}
			}
			if err != nil {
				return
			}
		}
	}()
	go func() {
		defer close(gone)
		io.Copy(stdio[1], conn)
	}()
	for {
		select {
		case <-winch:
			resize()
		case <-detached:
			restore()
			fmt.Fprintf(env.Err, "\r\ncagectl: detached from %s; it goes on (cagectl attach %s to come back)\n", agent, agent)
			return nil
		case <-gone:
			restore()
			return &ExitError{Code: ExitFailure, Err: errors.New("the console was taken over by another attach, or caged went away")}
		}
	}
}
