package cli

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"time"

	"github.com/nixcage/nixcage/internal/auditlog"
	"github.com/nixcage/nixcage/internal/paths"
)

func init() {
	register(&command{
		name:  "logs",
		args:  "AGENT [-f] [-n N] [--bus ADDR]",
		short: "show the journal of an agent, its gateway and its prepare step (journalctl)",
		run:   runLogs,
	})
}

func runLogs(ctx context.Context, env *Env, args []string) error {
	fs := newFlags(env, "logs")
	addr := addBusFlag(fs, env)
	follow := fs.Bool("f", false, "follow the journal")
	fs.BoolVar(follow, "follow", false, "follow the journal")
	n := fs.Int("n", 100, "number of lines")
	pos, err := parseFlags(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 1 {
		return usageError("usage: cagectl logs AGENT [-f] [-n N]")
	}
	agent := pos[0]
	if err := checkAgent(agent); err != nil {
		return err
	}
	// Root reads the journal itself. Anyone else asks caged (viewer role),
	// and falls back to journalctl with their own rights (members of
	// systemd-journal or adm see everything) if caged refuses or is down.
	if os.Geteuid() != 0 {
		err := logsViaCaged(ctx, env, *addr, agent, *n, *follow)
		var ee *ExitError
		if err == nil || !errors.As(err, &ee) || (ee.Code != ExitDenied && ee.Code != ExitNoConn) {
			return err
		}
		fmt.Fprintf(env.Err, "cagectl: %v; reading the journal with your own rights\n", ee.Err)
	}
	journalctl, err := exec.LookPath("journalctl")
	if err != nil {
		return &ExitError{Code: ExitFailure, Err: fmt.Errorf("journalctl not found: cagectl logs reads the systemd journal")}
	}
	argv := []string{"--no-pager", "-o", "short-iso", "-n", strconv.Itoa(*n)}
	for _, tpl := range []string{paths.AgentTemplate, paths.EgressTemplate, paths.PrepTemplate, paths.NetnsTemplate} {
		argv = append(argv, "-u", paths.Instance(tpl, agent))
	}
	if *follow {
		argv = append(argv, "-f")
	}
	cmd := exec.CommandContext(ctx, journalctl, argv...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = env.In, env.Out, env.Err
	if err := cmd.Run(); err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return &ExitError{Code: ExitFailure, Err: fmt.Errorf("journalctl: %w", err)}
	}
	return nil
}

func logsViaCaged(ctx context.Context, env *Env, addr, agent string, n int, follow bool) error {
	c, err := dialCaged(ctx, addr)
	if err != nil {
		return err
	}
	defer c.Close()
	lines, cursor, err := c.ReadLogs(ctx, agent, uint32(max(n, 1)), "")
	if err != nil {
		return busError(fmt.Errorf("logs %s: %w", agent, err))
	}
	for {
		for _, l := range lines {
			fmt.Fprintln(env.Out, auditlog.Escape(l))
		}
		if !follow {
			return nil
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(time.Second):
		}
		if lines, cursor, err = c.ReadLogs(ctx, agent, 10000, cursor); err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return busError(err)
		}
	}
}
