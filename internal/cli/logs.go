package cli

import (
	"context"
	"fmt"
	"os/exec"
	"strconv"

	"github.com/nixcage/nixcage/internal/paths"
)

func init() {
	register(&command{
		name:  "logs",
		args:  "AGENT [-f] [-n N]",
		short: "show the journal of an agent, its gateway and its prepare step (journalctl)",
		run:   runLogs,
	})
}

func runLogs(ctx context.Context, env *Env, args []string) error {
	fs := newFlags(env, "logs")
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
