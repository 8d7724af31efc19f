package cli

import (
	"context"
	"fmt"
)

func init() {
	for _, c := range []struct{ name, short string }{
		{"start", "start agents (refused while quarantined)"},
		{"stop", "stop agents"},
		{"restart", "restart agents (refused while quarantined)"},
		{"kill", "SIGKILL every process of agents' cages at once (audited)"},
		{"release", "lift agents' quarantine (they stay stopped until started)"},
	} {
		name := c.name
		register(&command{name: name, args: "AGENT... [--bus ADDR]", short: c.short,
			run: func(ctx context.Context, env *Env, args []string) error { return runControl(ctx, env, name, args) }})
	}
	register(&command{
		name:  "reload",
		args:  "[--bus ADDR]",
		short: "make caged re-read its configuration and reconcile (admin)",
		run:   runReload,
	})
	register(&command{
		name:  "quarantine",
		args:  "AGENT --reason TEXT [--bus ADDR]",
		short: "freeze an agent, cut its egress, keep evidence; it stays down until released",
		run:   runQuarantine,
	})
}

func runControl(ctx context.Context, env *Env, verb string, args []string) error {
	fs := newFlags(env, verb)
	addr := addBusFlag(fs, env)
	agents, err := parseFlags(fs, args)
	if err != nil {
		return err
	}
	if len(agents) == 0 {
		return usageError("usage: cagectl %s AGENT...", verb)
	}
	for _, a := range agents {
		if err := checkAgent(a); err != nil {
			return err
		}
	}
	c, err := dialCaged(ctx, *addr)
	if err != nil {
		return err
	}
	defer c.Close()
	op := map[string]func(context.Context, string) error{
		"start": c.Start, "stop": c.Stop, "restart": c.Restart, "kill": c.Kill, "release": c.Release,
	}[verb]
	done := map[string]string{"start": "started", "stop": "stopped", "restart": "restarted", "kill": "killed (SIGKILL)", "release": "released"}[verb]
	for _, a := range agents {
		if err := op(ctx, a); err != nil {
			return busError(fmt.Errorf("%s %s: %w", verb, a, err))
		}
		fmt.Fprintf(env.Out, "%s: %s\n", a, done)
	}
	return nil
}

func runQuarantine(ctx context.Context, env *Env, args []string) error {
	fs := newFlags(env, "quarantine")
	addr := addBusFlag(fs, env)
	reason := fs.String("reason", "", "why (recorded in the mark and the evidence; required)")
	agents, err := parseFlags(fs, args)
	if err != nil {
		return err
	}
	if len(agents) != 1 || *reason == "" {
		return usageError("usage: cagectl quarantine AGENT --reason TEXT")
	}
	if err := checkAgent(agents[0]); err != nil {
		return err
	}
	c, err := dialCaged(ctx, *addr)
	if err != nil {
		return err
	}
	defer c.Close()
	ev, err := c.Quarantine(ctx, agents[0], *reason)
	if err != nil {
		if ev != "" {
			fmt.Fprintf(env.Out, "%s: quarantined, evidence in %s\n", agents[0], ev)
		}
		return busError(fmt.Errorf("quarantine %s: %w", agents[0], err))
	}
	fmt.Fprintf(env.Out, "%s: quarantined, evidence in %s (verify: cd %s && sha256sum -c SHA256SUMS)\n", agents[0], ev, ev)
	return nil
}

func runReload(ctx context.Context, env *Env, args []string) error {
	fs := newFlags(env, "reload")
	addr := addBusFlag(fs, env)
	pos, err := parseFlags(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 0 {
		return usageError("usage: cagectl reload")
	}
	c, err := dialCaged(ctx, *addr)
	if err != nil {
		return err
	}
	defer c.Close()
	if err := c.Reload(ctx); err != nil {
		return busError(fmt.Errorf("reload: %w", err))
	}
	fmt.Fprintln(env.Out, "caged reloaded its configuration")
	return nil
}
