package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/nixcage/nixcage/internal/auditlog"
	"github.com/nixcage/nixcage/internal/bus"
	"github.com/nixcage/nixcage/internal/policy"
)

func init() {
	register(&command{
		name:  "allow",
		args:  "AGENT HOST[:PORT] [--for DURATION] [--reason TEXT] [--bus ADDR]",
		short: "let an agent reach a host for a while, in the running gateway (operator; wildcards: admin)",
		run:   runAllow,
	})
	register(&command{
		name:  "grants list",
		args:  "[AGENT] [--json] [--bus ADDR]",
		short: "list the time-bound grants in force",
		run:   runGrantsList,
	})
	register(&command{
		name:  "grants revoke",
		args:  "ID [--bus ADDR]",
		short: "end a grant now (operator)",
		run:   runGrantsRevoke,
	})
	register(&command{
		name:  "grants promote",
		args:  "ID [--bus ADDR]",
		short: "print the policy change that makes a grant permanent",
		run:   runGrantsPromote,
	})
}

// splitGrantHost parses HOST[:PORT] as `cagectl allow` takes it.
func splitGrantHost(s string) (string, int, error) {
	host, port := s, 0
	if h, p, err := net.SplitHostPort(s); err == nil {
		n, err := strconv.Atoi(p)
		if err != nil || n < 1 || n > 65535 {
			return "", 0, usageError("port %q: want 1-65535", p)
		}
		host, port = h, n
	}
	host = policy.Normalize(host)
	if err := policy.CheckPattern(host); err != nil {
		return "", 0, usageError("%v", err)
	}
	return host, port, nil
}

func runAllow(ctx context.Context, env *Env, args []string) error {
	fs := newFlags(env, "allow")
	addr := addBusFlag(fs, env)
	dur := fs.Duration("for", policy.DefaultGrantDuration, "how long the grant lasts (at most "+policy.MaxGrantDuration.String()+")")
	reason := fs.String("reason", "", "why, for the audit and `grants list`")
	pos, err := parseFlags(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 2 {
		return usageError("allow needs AGENT and HOST[:PORT]")
	}
	if err := checkAgent(pos[0]); err != nil {
		return err
	}
	host, port, err := splitGrantHost(pos[1])
	if err != nil {
		return err
	}
	if *dur < time.Second || *dur > policy.MaxGrantDuration {
		return usageError("--for %s: a grant lasts 1s to %s; for longer, add the host to the policy", *dur, policy.MaxGrantDuration)
	}
	c, err := dialCaged(ctx, *addr)
	if err != nil {
		return err
	}
	defer c.Close()
	g, err := c.AllowHost(ctx, pos[0], host, port, *dur, *reason)
	if err != nil {
		return busError(err)
	}
	fmt.Fprintf(env.Out, "grant %s: %s may reach %s until %s (the running gateway applies it within a second)\n",
		g.ID, g.Agent, grantTarget(*g), time.Unix(g.ExpiresUnix, 0).UTC().Format(time.RFC3339))
	return nil
}

func grantTarget(g bus.Grant) string {
	if g.Port == 0 {
		return g.Host
	}
	return net.JoinHostPort(g.Host, strconv.Itoa(int(g.Port)))
}

func runGrantsList(ctx context.Context, env *Env, args []string) error {
	l, err := parseAgentList(ctx, env, "grants list", args)
	if err != nil {
		return err
	}
	defer l.c.Close()
	gs, err := l.c.ListGrants(ctx, l.agent)
	if err != nil {
		return busError(err)
	}
	if l.json {
		return printJSON(env, orEmpty(gs))
	}
	if len(gs) == 0 {
		fmt.Fprintln(env.Out, "no grants in force")
		return nil
	}
	printGrants(env, gs)
	return nil
}

// agentList is a parsed `NAME [AGENT] [--json] [--bus ADDR]` listing
// command, with caged dialled.
type agentList struct {
	agent string // "" for every agent the caller may view
	json  bool
	c     *bus.Client
}

func parseAgentList(ctx context.Context, env *Env, name string, args []string) (*agentList, error) {
	fs := newFlags(env, name)
	addr := addBusFlag(fs, env)
	asJSON := fs.Bool("json", false, "print JSON")
	pos, err := parseFlags(fs, args)
	if err != nil {
		return nil, err
	}
	l := &agentList{json: *asJSON}
	switch len(pos) {
	case 0:
	case 1:
		if err := checkAgent(pos[0]); err != nil {
			return nil, err
		}
		l.agent = pos[0]
	default:
		return nil, usageError("%s takes at most one AGENT", name)
	}
	if l.c, err = dialCaged(ctx, *addr); err != nil {
		return nil, err
	}
	return l, nil
}

// orEmpty makes a nil list print as [] in JSON.
func orEmpty[T any](v []T) []T {
	if v == nil {
		return []T{}
	}
	return v
}

func printJSON(env *Env, v any) error {
	enc := json.NewEncoder(env.Out)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// printGrants prints grants as a table. By and reason are an operator's
// text: escaped like audit fields.
func printGrants(env *Env, gs []bus.Grant) {
	tw := tabwriter.NewWriter(env.Out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tAGENT\tHOST\tUNTIL\tBY\tREASON")
	for _, g := range gs {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", g.ID, g.Agent, grantTarget(g), time.Unix(g.ExpiresUnix, 0).UTC().Format(time.RFC3339),
			auditlog.Escape(g.By), auditlog.Escape(g.Reason))
	}
	tw.Flush()
}

// grantCommand parses a command taking one grant ID and dials caged.
func grantCommand(ctx context.Context, env *Env, name string, args []string) (string, *bus.Client, error) {
	fs := newFlags(env, name)
	addr := addBusFlag(fs, env)
	pos, err := parseFlags(fs, args)
	if err != nil {
		return "", nil, err
	}
	if len(pos) != 1 || !strings.HasPrefix(pos[0], "g-") {
		return "", nil, usageError("%s needs one grant ID (g-..., from cagectl grants list)", name)
	}
	c, err := dialCaged(ctx, *addr)
	if err != nil {
		return "", nil, err
	}
	return pos[0], c, nil
}

func runGrantsRevoke(ctx context.Context, env *Env, args []string) error {
	id, c, err := grantCommand(ctx, env, "grants revoke", args)
	if err != nil {
		return err
	}
	defer c.Close()
	if err := c.RevokeGrant(ctx, id); err != nil {
		return busError(err)
	}
	fmt.Fprintf(env.Out, "grant %s revoked; open tunnels stay, new requests are refused\n", id)
	return nil
}

func runGrantsPromote(ctx context.Context, env *Env, args []string) error {
	id, c, err := grantCommand(ctx, env, "grants promote", args)
	if err != nil {
		return err
	}
	defer c.Close()
	gs, err := c.ListGrants(ctx, "")
	if err != nil {
		return busError(err)
	}
	for _, g := range gs {
		if g.ID != id {
			continue
		}
		fmt.Fprintf(env.Out, "# Make grant %s permanent: in the egress policy agent %s uses, add\n", g.ID, g.Agent)
		fmt.Fprintf(env.Out, "allow = [..., %q]\n", g.Host)
		if g.Port != 0 {
			fmt.Fprintf(env.Out, "ports = [..., %d]\n", g.Port)
			fmt.Fprintf(env.Out, "# (ports apply to every allowed host of the policy)\n")
		}
		fmt.Fprintf(env.Out, "# then apply the config (cagectl apply-config FILE, or nixos-rebuild switch) and `cagectl grants revoke %s`.\n", g.ID)
		return nil
	}
	return &ExitError{Code: ExitFailure, Err: fmt.Errorf("no grant %s in force that you may view (cagectl grants list)", id)}
}
