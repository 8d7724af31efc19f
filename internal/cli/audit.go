package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
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

// printAudit prints one record: raw, or one readable line. Both are safe
// for a terminal: a line that is not a record is escaped whole, and raw
// JSON keeps only characters a terminal does not act on (auditlog.Escape;
// the JSONL the gateway writes already escapes C0 controls, but a C1 CSI or
// a bidi override is valid JSON text).
func printAudit(env *Env, line string, raw bool) {
	var r auditlog.Record
	if err := json.Unmarshal([]byte(line), &r); err != nil {
		fmt.Fprintln(env.Out, auditlog.Escape(line))
		return
	}
	if raw {
		fmt.Fprintln(env.Out, auditlog.EscapeJSON(line))
		return
	}
	fmt.Fprintln(env.Out, r.Line())
}
