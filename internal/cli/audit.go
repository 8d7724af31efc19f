package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/nixcage/nixcage/internal/auditlog"
	"github.com/nixcage/nixcage/internal/paths"
)

func init() {
	register(&command{
		name:  "audit",
		args:  "AGENT [--follow] [--json] [-n N] [--bus ADDR]",
		short: "show an agent's egress decisions (root reads the log directly, others ask caged)",
		run:   runAudit,
	})
}

// auditSource reads records from an offset; negative means "the newest".
type auditSource func(ctx context.Context, offset int64, max uint32) ([]string, int64, error)

func runAudit(ctx context.Context, env *Env, args []string) error {
	fs := newFlags(env, "audit")
	addr := addBusFlag(fs, env)
	follow := fs.Bool("follow", false, "keep printing new records (Ctrl-C ends)")
	fs.BoolVar(follow, "f", false, "short for --follow")
	asJSON := fs.Bool("json", false, "print the raw JSONL records")
	n := fs.Uint("n", 20, "show the newest `N` records first")
	pos, err := parseFlags(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 1 {
		return usageError("usage: cagectl audit AGENT [--follow] [--json] [-n N]")
	}
	agent := pos[0]
	if err := checkAgent(agent); err != nil {
		return err
	}
	var src auditSource
	file := filepath.Join(paths.AuditDir(agent), "audit.jsonl")
	if _, err := os.Stat(file); err == nil && os.Geteuid() == 0 {
		src = func(_ context.Context, off int64, max uint32) ([]string, int64, error) {
			return auditlog.Read(file, off, int(max))
		}
	} else {
		c, err := dialCaged(ctx, *addr)
		if err != nil {
			return err
		}
		defer c.Close()
		src = func(ctx context.Context, off int64, max uint32) ([]string, int64, error) {
			return c.ReadAudit(ctx, agent, off, max)
		}
	}
	lines, next, err := src(ctx, -1, uint32(*n))
	if err != nil {
		return busError(err)
	}
	for _, l := range lines {
		printAudit(env, l, *asJSON)
	}
	for *follow {
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(500 * time.Millisecond):
		}
		lines, next, err = src(ctx, next, 1000)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return busError(err)
		}
		for _, l := range lines {
			printAudit(env, l, *asJSON)
		}
	}
	return nil
}

// printAudit prints one record: raw, or one readable line.
func printAudit(env *Env, line string, raw bool) {
	if raw {
		fmt.Fprintln(env.Out, line)
		return
	}
	var r struct {
		TS       string   `json:"ts"`
		Method   string   `json:"method"`
		Host     string   `json:"host"`
		Port     int      `json:"port"`
		Path     string   `json:"path"`
		Decision string   `json:"decision"`
		Reason   string   `json:"reason"`
		Rule     string   `json:"rule"`
		Inspect  []string `json:"inspectors"`
	}
	if err := json.Unmarshal([]byte(line), &r); err != nil {
		fmt.Fprintln(env.Out, line)
		return
	}
	target := r.Host
	if r.Port != 0 {
		target = fmt.Sprintf("%s:%d", r.Host, r.Port)
	}
	var why []string
	if r.Reason != "" {
		why = append(why, r.Reason)
	}
	if r.Rule != "" {
		why = append(why, "rule "+r.Rule)
	}
	if len(r.Inspect) > 0 {
		why = append(why, "inspectors "+strings.Join(r.Inspect, ","))
	}
	fmt.Fprintf(env.Out, "%s  %-7s  %-7s %s%s  %s\n", r.TS, r.Decision, r.Method, target, r.Path, strings.Join(why, "; "))
}
