package cli

import (
	"context"
	"fmt"
	"net"
	"strconv"
	"text/tabwriter"
	"time"

	"github.com/nixcage/nixcage/internal/auditlog"
	"github.com/nixcage/nixcage/internal/policy"
)

func init() {
	register(&command{
		name:  "approvals",
		args:  "[AGENT] [--json] [--bus ADDR]",
		short: "list requests outside the policy waiting for an operator (agents with an approval block)",
		run:   runApprovals,
	})
	register(&command{
		name:  "approve",
		args:  "ID once|host|deny [--bus ADDR]",
		short: "decide a waiting request: once lets it through, host grants the host for " + policy.DefaultGrantDuration.String() + ", deny refuses it (operator)",
		run:   runApprove,
	})
}

func runApprovals(ctx context.Context, env *Env, args []string) error {
	l, err := parseAgentList(ctx, env, "approvals", args)
	if err != nil {
		return err
	}
	defer l.c.Close()
	as, err := l.c.ListApprovals(ctx, l.agent)
	if err != nil {
		return busError(err)
	}
	if l.json {
		return printJSON(env, orEmpty(as))
	}
	if len(as) == 0 {
		fmt.Fprintln(env.Out, "no requests waiting for approval")
		return nil
	}
	// Host, method and path are the agent's words: escaped like audit
	// fields, so a request cannot draw on the operator's terminal.
	now := time.Now()
	tw := tabwriter.NewWriter(env.Out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tAGENT\tHOST\tMETHOD\tPATH\tWAITING SINCE\tLEFT")
	for _, a := range as {
		left := time.Unix(a.ExpiresUnix, 0).Sub(now).Round(time.Second)
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\n", a.ID, a.Agent, auditlog.Escape(net.JoinHostPort(a.Host, strconv.Itoa(int(a.Port)))),
			auditlog.Escape(a.Method), orDash(auditlog.Escape(a.Path)), time.Unix(a.SinceUnix, 0).UTC().Format(time.RFC3339), max(left, 0))
	}
	tw.Flush()
	fmt.Fprintln(env.Out, "\ndecide with: cagectl approve ID once|host|deny")
	return nil
}

func runApprove(ctx context.Context, env *Env, args []string) error {
	fs := newFlags(env, "approve")
	addr := addBusFlag(fs, env)
	pos, err := parseFlags(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 2 {
		return usageError("approve needs ID and once, host or deny")
	}
	id, verdict := pos[0], pos[1]
	if err := policy.CheckApprovalID(id); err != nil {
		return usageError("%v (cagectl approvals lists the waiting requests)", err)
	}
	switch verdict {
	case policy.VerdictOnce, policy.VerdictHost, policy.VerdictDeny:
	default:
		return usageError("verdict %q: use once (this request), host (grant the host for %s) or deny", verdict, policy.DefaultGrantDuration)
	}
	c, err := dialCaged(ctx, *addr)
	if err != nil {
		return err
	}
	defer c.Close()
	grant, err := c.Decide(ctx, id, verdict)
	if err != nil {
		return busError(err)
	}
	switch verdict {
	case policy.VerdictOnce:
		fmt.Fprintf(env.Out, "approved %s once: the waiting request proceeds\n", id)
	case policy.VerdictHost:
		fmt.Fprintf(env.Out, "approved %s: grant %s for %s (cagectl grants list); the waiting request proceeds\n", id, grant, policy.DefaultGrantDuration)
	default:
		fmt.Fprintf(env.Out, "denied %s: the agent gets a 403 saying so\n", id)
	}
	return nil
}
