package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"sort"
	"strings"
	"time"
)

func init() {
	register(&command{
		name:  "events",
		args:  "[--follow] [--json] [--bus ADDR]",
		short: "print caged's signals as they happen: agent states, egress decisions, releases",
		run:   runEvents,
	})
}

func runEvents(ctx context.Context, env *Env, args []string) error {
	fs := newFlags(env, "events")
	addr := addBusFlag(fs, env)
	fs.Bool("follow", true, "keep printing (the default; events are a live stream)")
	fs.Bool("f", true, "short for --follow")
	asJSON := fs.Bool("json", false, "print one JSON object per event")
	pos, err := parseFlags(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 0 {
		return usageError("usage: cagectl events [--follow] [--json]")
	}
	c, err := dialCaged(ctx, *addr)
	if err != nil {
		return err
	}
	defer c.Close()
	events, err := c.Events(ctx)
	if err != nil {
		return busError(err)
	}
	enc := json.NewEncoder(env.Out)
	for ev := range events {
		ts := time.Now().UTC().Format(time.RFC3339)
		if *asJSON {
			enc.Encode(struct {
				TS    string            `json:"ts"`
				Kind  string            `json:"kind"`
				Agent string            `json:"agent,omitempty"`
				Data  map[string]string `json:"data,omitempty"`
			}{ts, ev.Kind, ev.Agent, ev.Data})
			continue
		}
		keys := make([]string, 0, len(ev.Data))
		for k := range ev.Data {
			if k != "record" {
				keys = append(keys, k)
			}
		}
		sort.Strings(keys)
		var kv []string
		for _, k := range keys {
			kv = append(kv, fmt.Sprintf("%s=%q", k, ev.Data[k]))
		}
		fmt.Fprintf(env.Out, "%s %-18s %-12s %s\n", ts, ev.Kind, ev.Agent, strings.Join(kv, " "))
	}
	return nil
}
