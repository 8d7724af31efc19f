package cli

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"time"

	"github.com/nixcage/nixcage/internal/auditlog"
	"github.com/nixcage/nixcage/internal/config"
	"github.com/nixcage/nixcage/internal/paths"
	"github.com/nixcage/nixcage/internal/suggest"
)

func init() {
	register(&command{
		name:  "policy suggest",
		args:  "AGENT [--since TIME] [--name NAME] [--bus ADDR]",
		short: "print an egress policy (HCL) that would have allowed what the agent was refused, with counts and warnings",
		run:   runPolicySuggest,
	})
}

func runPolicySuggest(ctx context.Context, env *Env, args []string) error {
	fs := newFlags(env, "policy suggest")
	addr := addBusFlag(fs, env)
	since := fs.String("since", "", "only records at or after `TIME` (RFC 3339, a date, or a duration ago: 2h)")
	name := fs.String("name", "", "name of the printed policy (default AGENT-suggested)")
	pos, err := parseFlags(fs, args)
	if err != nil {
		return err
	}
	if len(pos) != 1 {
		return usageError("policy suggest needs exactly one AGENT")
	}
	agent := pos[0]
	if err := checkAgent(agent); err != nil {
		return err
	}
	var o suggest.Options
	if o.Since, err = parseWhen("since", *since, time.Now()); err != nil {
		return err
	}
	o.Denies = config.NewLoader().BuiltinDenies()
	o.Forbidden = suggest.Resolved(func(h string) ([]netip.Addr, error) {
		lctx, cancel := context.WithTimeout(ctx, 3*time.Second)
		defer cancel()
		return net.DefaultResolver.LookupNetIP(lctx, "ip", h)
	}, suggest.StdBad)
	src, closeSrc, err := agentAuditSource(ctx, *addr, agent)
	if err != nil {
		return err
	}
	defer closeSrc()
	lines, err := readWholeAudit(ctx, src)
	if err != nil {
		return busError(fmt.Errorf("audit %s: %w", agent, err))
	}
	s := suggest.Build(agent, lines, o)
	if *name == "" {
		*name = agent + "-suggested"
	}
	if err := checkAgent(*name); err != nil {
		return usageError("--name %q: %v", *name, err)
	}
	fmt.Fprint(env.Out, s.HCL(*name))
	if len(s.Entries) == 0 {
		fmt.Fprintf(env.Err, "nothing to suggest: no refusal of agent %s in %d records that an allow entry would fix\n", agent, s.Records)
	}
	return nil
}

// agentAuditSource reads one agent's audit: root reads the file, everyone
// else asks caged (viewer role), as `cagectl audit` does.
func agentAuditSource(ctx context.Context, addr, agent string) (auditSource, func(), error) {
	file := filepath.Join(paths.AuditDir(agent), "audit.jsonl")
	if os.Geteuid() == 0 {
		if _, err := os.Stat(file); err == nil {
			return func(_ context.Context, off int64, max uint32) ([]string, int64, error) {
				return auditlog.Read(file, off, int(max))
			}, func() {}, nil
		}
	}
	c, err := dialCaged(ctx, addr)
	if err != nil {
		return nil, nil, err
	}
	return func(ctx context.Context, off int64, max uint32) ([]string, int64, error) {
		return c.ReadAudit(ctx, agent, off, max)
	}, func() { c.Close() }, nil
}

// readWholeAudit reads every complete record from the start.
func readWholeAudit(ctx context.Context, src auditSource) ([]string, error) {
	var out []string
	var off int64
	for {
		lines, next, err := src(ctx, off, 10000)
		if err != nil {
			return nil, err
		}
		out = append(out, lines...)
		if len(lines) == 0 || next == off {
			return out, nil
		}
		off = next
	}
}
