package cli

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/nixcage/nixcage/internal/auditlog"
	"github.com/nixcage/nixcage/internal/bus"
	"github.com/nixcage/nixcage/internal/paths"
)

func init() {
	register(&command{
		name:  "audit",
		args:  "[AGENT...] [--decision D] [--host H] [--since T] [--until T] [--distinct] [--follow] [--json] [-n N] [--bus ADDR]",
		short: "show egress decisions, one line each (root reads the logs directly, others ask caged)",
		run:   runAudit,
	})
}

// auditSource reads records from an offset; negative means "the newest".
type auditSource func(ctx context.Context, offset int64, max uint32) ([]string, int64, error)

// auditFilter selects records; the zero value selects all.
type auditFilter struct {
	decisions    map[string]bool
	host         string // exact, or "*.suffix"
	since, until time.Time
}

func (f *auditFilter) active() bool {
	return len(f.decisions) > 0 || f.host != "" || !f.since.IsZero() || !f.until.IsZero()
}

func (f *auditFilter) match(r *auditlog.Record) bool {
	if len(f.decisions) > 0 && !f.decisions[r.Decision] {
		return false
	}
	if f.host != "" {
		h := strings.ToLower(r.Host)
		if suf, ok := strings.CutPrefix(f.host, "*."); ok {
			if !strings.HasSuffix(h, "."+suf) {
				return false
			}
		} else if h != f.host {
			return false
		}
	}
	if !f.since.IsZero() || !f.until.IsZero() {
		ts, err := time.Parse(time.RFC3339Nano, r.TS)
		if err != nil || (!f.since.IsZero() && ts.Before(f.since)) || (!f.until.IsZero() && !ts.Before(f.until)) {
			return false
		}
	}
	return true
}

// parseWhen accepts an RFC 3339 time, a date (UTC midnight) or a duration
// meaning that long ago ("90m", "2h"), as journalctl's --since does.
func parseWhen(flagName, s string, now time.Time) (time.Time, error) {
	if s == "" {
		return time.Time{}, nil
	}
	if t, err := time.Parse(time.RFC3339, s); err == nil {
		return t, nil
	}
	if t, err := time.Parse("2006-01-02", s); err == nil {
		return t, nil
	}
	if d, err := time.ParseDuration(s); err == nil && d > 0 {
		return now.Add(-d), nil
	}
	return time.Time{}, usageError("--%s %q: use an RFC 3339 time (2026-12-01T09:00:00Z), a date (2026-12-01) or a duration ago (90m, 2h)", flagName, s)
}

func runAudit(ctx context.Context, env *Env, args []string) error {
	fs := newFlags(env, "audit")
	addr := addBusFlag(fs, env)
	follow := fs.Bool("follow", false, "keep printing new records (Ctrl-C ends)")
	fs.BoolVar(follow, "f", false, "short for --follow")
	asJSON := fs.Bool("json", false, "print the raw JSONL records")
	n := fs.Uint("n", 20, "show the newest `N` matching records first")
	var decisions listFlag
	fs.Var(&decisions, "decision", "only `DECISION`s: allowed, flagged or blocked (repeatable, or comma-separated)")
	host := fs.String("host", "", "only requests to `HOST` (exact, or *.example.com for its subdomains)")
	since := fs.String("since", "", "only records at or after `TIME` (RFC 3339, a date, or a duration ago: 2h)")
	until := fs.String("until", "", "only records before `TIME` (same forms as --since)")
	distinct := fs.Bool("distinct", false, "the first record of each distinct decision, rule and host in the whole log, oldest first, with how many decisions it stands for (all of them unless -n is given): what a flood of repeats cannot hide")
	agents, err := parseFlags(fs, args)
	if err != nil {
		return err
	}
	for _, a := range agents {
		if err := checkAgent(a); err != nil {
			return err
		}
	}
	f := &auditFilter{host: strings.ToLower(*host)}
	for _, d := range decisions {
		for _, x := range strings.Split(d, ",") {
			switch x {
			case auditlog.Allowed, auditlog.Flagged, auditlog.Blocked:
				if f.decisions == nil {
					f.decisions = map[string]bool{}
				}
				f.decisions[x] = true
			default:
				return usageError("--decision %q: use allowed, flagged or blocked", x)
			}
		}
	}
	now := time.Now()
	if f.since, err = parseWhen("since", *since, now); err != nil {
		return err
	}
	if f.until, err = parseWhen("until", *until, now); err != nil {
		return err
	}

	// Root reads the logs directly; everyone else asks caged (viewer role).
	var c *bus.Client
	direct := os.Geteuid() == 0
	if len(agents) == 0 {
		// All agents: the declared ones, as caged knows them; root without
		// caged gets every agent that has a log.
		var st *bus.Status
		c, err = dialCaged(ctx, *addr)
		if err == nil {
			defer c.Close()
			if st, err = c.Status(ctx); err != nil {
				err = busError(err)
			}
		}
		switch {
		case err == nil:
			for _, a := range st.Agents {
				agents = append(agents, a.Name)
			}
		case direct:
			dirs, _ := os.ReadDir(filepath.Dir(paths.AuditDir("x")))
			for _, d := range dirs {
				if d.IsDir() && agentNameRE.MatchString(d.Name()) {
					agents = append(agents, d.Name())
				}
			}
		default:
			return err
		}
	}
	srcs := make([]auditSource, len(agents))
	for i, agent := range agents {
		file := filepath.Join(paths.AuditDir(agent), "audit.jsonl")
		if direct {
			if _, err := os.Stat(file); err == nil {
				srcs[i] = func(_ context.Context, off int64, max uint32) ([]string, int64, error) {
					return auditlog.Read(file, off, int(max))
				}
				continue
			}
		}
		if c == nil {
			if c, err = dialCaged(ctx, *addr); err != nil {
				return err
			}
			defer c.Close()
		}
		srcs[i] = func(ctx context.Context, off int64, max uint32) ([]string, int64, error) {
			return c.ReadAudit(ctx, agent, off, max)
		}
	}
	p := &auditPrinter{env: env, raw: *asJSON, f: f, agentColumn: len(agents) > 1}
	next := make([]int64, len(srcs))
	var first []auditLine
	nSet := false
	fs.Visit(func(fl *flag.Flag) { nSet = nSet || fl.Name == "n" })
	for i, src := range srcs {
		pick := newestMatching
		if *distinct {
			pick = distinctMatching
		}
		lines, off, err := pick(ctx, src, f, int(*n))
		if err != nil {
			return busError(fmt.Errorf("audit %s: %w", agents[i], err))
		}
		next[i] = off
		first = append(first, lines...)
	}
	// Several agents: interleave by time, then keep the newest n overall.
	sort.SliceStable(first, func(i, j int) bool { return first[i].rec.TS < first[j].rec.TS })
	switch {
	case *distinct && nSet && len(first) > int(*n):
		first = first[:*n]
	case !*distinct && len(first) > int(*n):
		first = first[len(first)-int(*n):]
	}
	for _, l := range first {
		p.print(l)
	}
	for *follow {
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(500 * time.Millisecond):
		}
		for i, src := range srcs {
			lines, off, err := src(ctx, next[i], 1000)
			if err != nil {
				if ctx.Err() != nil {
					return nil
				}
				return busError(err)
			}
			next[i] = off
			for _, l := range lines {
				if al, ok := parseAudit(l); !ok || f.match(&al.rec) {
					p.print(al)
				}
			}
		}
	}
	return nil
}

// auditLine is one line of a log and its record, if it is one.
type auditLine struct {
	raw string
	rec auditlog.Record
	ok  bool
	// count, with --distinct, is how many decisions the line stands for.
	count int64
}

func parseAudit(line string) (auditLine, bool) {
	al := auditLine{raw: line}
	al.ok = json.Unmarshal([]byte(line), &al.rec) == nil
	return al, al.ok
}

// newestMatching returns the newest n records that pass f and the offset to
// follow from. Without a filter that is one read of the tail; with one, the
// whole log is read once, in chunks.
func newestMatching(ctx context.Context, src auditSource, f *auditFilter, n int) ([]auditLine, int64, error) {
	if !f.active() {
		lines, next, err := src(ctx, -1, uint32(n))
		out := make([]auditLine, 0, len(lines))
		for _, l := range lines {
			al, _ := parseAudit(l)
			out = append(out, al)
		}
		return out, next, err
	}
	var out []auditLine
	next, err := scanMatching(ctx, src, f, func(al auditLine) {
		out = append(out, al)
		if len(out) > n {
			out = out[1:]
		}
	})
	return out, next, err
}

// distinctMatching returns the first record of each distinct (decision,
// rule, host) that passes f, oldest first, each with the decisions its key
// stands for in the whole log (summary records count theirs), and the
// offset to follow from. The gateway writes the first refusal to each
// destination whole, so a flood of repeats or of made-up names does not
// hide it here, however many records came after it.
func distinctMatching(ctx context.Context, src auditSource, f *auditFilter, _ int) ([]auditLine, int64, error) {
	var out []auditLine
	at := map[string]int{}
	next, err := scanMatching(ctx, src, f, func(al auditLine) {
		k := al.rec.Decision + "\x00" + al.rec.Rule + "\x00" + al.rec.Host
		i, ok := at[k]
		if !ok {
			i = len(out)
			at[k] = i
			out = append(out, al)
		}
		out[i].count += int64(al.rec.Decisions())
	})
	return out, next, err
}

// scanMatching calls fn with every record of src that passes f, reading the
// whole log once in chunks, and returns the offset to follow from.
func scanMatching(ctx context.Context, src auditSource, f *auditFilter, fn func(auditLine)) (int64, error) {
	var off int64
	for {
		lines, next, err := src(ctx, off, 10000)
		if err != nil {
			return 0, err
		}
		for _, l := range lines {
			if al, ok := parseAudit(l); ok && f.match(&al.rec) {
				fn(al)
			}
		}
		if len(lines) == 0 || next == off {
			return next, nil
		}
		off = next
	}
}

type auditPrinter struct {
	env         *Env
	raw         bool
	f           *auditFilter
	agentColumn bool
}

func (p *auditPrinter) print(l auditLine) {
	if p.agentColumn && l.ok && !p.raw {
		fmt.Fprintf(p.env.Out, "%-12s ", auditlog.Escape(l.rec.Agent))
	}
	if l.count > 0 && l.ok && !p.raw {
		fmt.Fprintf(p.env.Out, "%s  [%d decisions like it]\n", l.rec.Line(), l.count)
		return
	}
	printAudit(p.env, l.raw, p.raw)
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
