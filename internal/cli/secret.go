package cli

import (
	"context"
	"fmt"
)

func init() {
	register(&command{
		name:  "secret rotate",
		args:  "AGENT [NAME] [--new-placeholder] [--bus ADDR]",
		short: "make an agent's gateway re-read a secret's source after you changed it (operator)",
		run:   runSecretRotate,
	})
}

func runSecretRotate(ctx context.Context, env *Env, args []string) error {
	fs := newFlags(env, "secret rotate")
	addr := addBusFlag(fs, env)
	newPH := fs.Bool("new-placeholder", false, "also give the cage a new placeholder (restarts the agent)")
	pos, err := parseFlags(fs, args)
	if err != nil {
		return err
	}
	if len(pos) < 1 || len(pos) > 2 {
		return usageError("usage: cagectl secret rotate AGENT [NAME] [--new-placeholder]")
	}
	if err := checkAgent(pos[0]); err != nil {
		return err
	}
	name := ""
	if len(pos) == 2 {
		name = pos[1]
	}
	c, err := dialCaged(ctx, *addr)
	if err != nil {
		return err
	}
	defer c.Close()
	msg, err := c.RotateSecret(ctx, pos[0], name, *newPH)
	if err != nil {
		return busError(fmt.Errorf("secret rotate %s: %w", pos[0], err))
	}
	fmt.Fprintln(env.Out, msg)
	return nil
}
