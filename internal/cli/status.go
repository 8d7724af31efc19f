package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/nixcage/nixcage/internal/bus"
)

func init() {
	register(&command{
		name:  "status",
		args:  "[AGENT...] [--json] [--bus ADDR]",
		short: "show caged and every agent (readable by every local user)",
		run:   runStatus,
	})
}

func runStatus(ctx context.Context, env *Env, args []string) error {
	fs := newFlags(env, "status")
	addr := addBusFlag(fs, env)
	asJSON := fs.Bool("json", false, "print JSON (stable field names, for scripts)")
	names := fs.Bool("names", false, "print only agent names, one per line (for shell completion)")
	agents, err := parseFlags(fs, args)
	if err != nil {
		return err
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
	st, err := c.Status(ctx)
	if err != nil {
		return busError(err)
	}
	if len(agents) > 0 {
		var keep []bus.AgentStatus
		for _, want := range agents {
			found := false
			for _, a := range st.Agents {
				if a.Name == want {
					keep, found = append(keep, a), true
				}
			}
			if !found {
				return &ExitError{Code: ExitFailure, Err: fmt.Errorf("no agent named %q is declared", want)}
			}
		}
		st.Agents = keep
	}
	if st.Agents == nil {
		st.Agents = []bus.AgentStatus{}
	}
	switch {
	case *names:
		for _, a := range st.Agents {
			fmt.Fprintln(env.Out, a.Name)
		}
		return nil
	case *asJSON:
		enc := json.NewEncoder(env.Out)
		enc.SetIndent("", "  ")
		return enc.Encode(st)
	}
	printStatus(env, st)
	// Grants change what an agent may reach without a config change, so
	// status shows them (to whoever may view them).
	gs, _ := c.ListGrants(ctx, "")
	gs = slices.DeleteFunc(gs, func(g bus.Grant) bool {
		return !slices.ContainsFunc(st.Agents, func(a bus.AgentStatus) bool { return a.Name == g.Agent })
	})
	if len(gs) > 0 {
		fmt.Fprintln(env.Out, "\negress grants in force (cagectl grants list):")
		printGrants(env, gs)
	}
	if len(st.Bans) > 0 {
		fmt.Fprintln(env.Out, "\nhosts banned by control commands (docs/fleet.md):")
		tw := tabwriter.NewWriter(env.Out, 0, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "BAN\tHOST\tAGENT\tSINCE\tCOMMAND\tREASON")
		for _, b := range st.Bans {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\n", b.ID, b.Host, b.Agent, time.Unix(b.CreatedUnix, 0).UTC().Format(time.RFC3339), shortHash(b.Command), b.Reason)
		}
		tw.Flush()
	}
	return nil
}

func printStatus(env *Env, st *bus.Status) {
	gen := "none"
	if st.Generation != 0 {
		gen = fmt.Sprintf("%d (%s)", st.Generation, st.Channel)
	}
	fmt.Fprintf(env.Out, "caged %s, units %s, store generation %s, up since %s\n", st.Version, st.Mode, gen,
		time.Unix(st.StartedUnix, 0).UTC().Format(time.RFC3339))
	switch st.Freshness {
	case "expired":
		fmt.Fprintf(env.Out, "store EXPIRED: %s\n", st.FreshnessMessage)
	case "expiring":
		fmt.Fprintf(env.Out, "store expiring: %s\n", st.FreshnessMessage)
	}
	printChannel(env, st)
	if st.ReconcileError != "" {
		fmt.Fprintf(env.Out, "last reconcile FAILED: %s\n", st.ReconcileError)
	}
	if len(st.Agents) == 0 {
		fmt.Fprintln(env.Out, "no agents declared")
		return
	}
	fmt.Fprintln(env.Out)
	tw := tabwriter.NewWriter(env.Out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "AGENT\tBACKEND\tSTATE\tEGRESS\tGEN\tALLOWED\tFLAGGED\tBLOCKED\tNOTE")
	for _, a := range st.Agents {
		state := a.ActiveState + "/" + a.SubState
		if a.LoadState != "" && a.LoadState != "loaded" {
			state = a.LoadState
		}
		g := "-"
		if a.Generation != 0 {
			g = fmt.Sprint(a.Generation)
			if st.Generation != 0 && a.Generation != st.Generation {
				g += "*"
			}
		}
		var note []string
		if a.Quarantined {
			note = append(note, "QUARANTINED: "+a.QuarantineReason)
		}
		if a.LearnUntilUnix != 0 {
			if left := time.Until(time.Unix(a.LearnUntilUnix, 0)); left > 0 {
				note = append(note, "LEARNING ("+left.Round(time.Second).String()+" left)")
			} else {
				note = append(note, "learn window over")
			}
		}
		switch {
		case a.RunBy != "":
			note = append(note, "throw-away (cagectl run) by "+a.RunBy)
		case !a.Autostart:
			note = append(note, "manual start")
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%d\t%d\t%d\t%s\n", a.Name, a.Backend, state, orDash(a.EgressState), g,
			a.Allowed, a.Flagged, a.Blocked, strings.Join(note, "; "))
	}
	tw.Flush()
	for _, a := range st.Agents {
		if until := time.Unix(a.LearnUntilUnix, 0); a.LearnUntilUnix != 0 && time.Now().Before(until) {
			fmt.Fprintf(env.Out, "\nLEARNING: %s allows requests outside its policy, flagged (audit rule learn), until %s (%s left); then the policy applies again. `cagectl policy suggest %s` turns them into a policy.\n",
				a.Name, until.UTC().Format(time.RFC3339), time.Until(until).Round(time.Second), a.Name)
		}
	}
	for _, a := range st.Agents {
		if a.Generation != 0 && st.Generation != 0 && a.Generation != st.Generation {
			fmt.Fprintln(env.Out, "\n* runs an older store generation; restart the agent to use the current one")
			break
		}
	}
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// printChannel shows the pulled channel: what it publishes against what is
// applied, when it was last polled, and why the last poll failed.
func printChannel(env *Env, st *bus.Status) {
	c := st.ChannelPoll
	if c.URL == "" {
		return
	}
	when := func(u int64) string {
		if u == 0 {
			return "never"
		}
		return time.Unix(u, 0).UTC().Format(time.RFC3339)
	}
	pub := "unknown"
	switch {
	case c.Published == 0:
	case c.Lag == 0:
		pub = fmt.Sprintf("%d (up to date)", c.Published)
	case c.Lag > 0:
		pub = fmt.Sprintf("%d (%d behind)", c.Published, c.Lag)
	default:
		pub = fmt.Sprintf("%d (older than current)", c.Published)
	}
	fmt.Fprintf(env.Out, "channel %s: published %s, last poll %s, last success %s, next poll %s\n",
		c.URL, pub, when(c.LastPollUnix), when(c.LastSuccessUnix), when(c.NextPollUnix))
	if c.LastError != "" {
		fmt.Fprintf(env.Out, "channel poll FAILED (%d in a row): %s\n", c.Failures, c.LastError)
	}
}
