package egress

import (
	"context"
	"time"

	"github.com/nixcage/nixcage/internal/egress/audit"
	"github.com/nixcage/nixcage/internal/policy"
)

// Learn mode in the gateway (policy/learn.go has the rules). The window is
// read once, at start, from the stamp the root prepare step wrote: the
// gateway cannot write it and a restart does not move it. A missing or
// untrusted stamp means no learning (fail closed: the policy applies).

// SetLearning replaces the learn mode in force (nil: off).
func (g *Gateway) SetLearning(l *policy.Learning) { g.learn.Store(l) }

// Learning returns the learn mode in force, nil when off.
func (g *Gateway) Learning() *policy.Learning { return g.learn.Load() }

// loadLearning reads the learn window named by the runtime document.
func (g *Gateway) loadLearning(rt *policy.Runtime) *policy.Learning {
	if rt.Learn == nil {
		return nil
	}
	w, err := policy.LoadLearnWindow(rt.Learn.File, rt.Agent)
	if err != nil {
		g.log.Error("learn mode refused; the policy applies", "file", rt.Learn.File, "err", err)
		return nil
	}
	return &policy.Learning{Window: *w, Deny: rt.Learn.Deny}
}

// runLearning announces learn mode loudly (log at warning level and one
// audit record) and, when the window ends, announces that the policy
// applies again. It returns when the window is over or ctx ends.
func (g *Gateway) runLearning(ctx context.Context, l *policy.Learning) {
	if l == nil {
		return
	}
	until := l.Window.Until().UTC().Format(time.RFC3339)
	if !l.Active(time.Now()) {
		g.log.Info("learn window is over; the policy applies", "until", until)
		return
	}
	g.log.Warn("LEARN MODE: requests outside the policy are allowed and flagged (audit rule learn) until the window ends; address rules and deny lists still apply", "until", until, "left", time.Until(l.Window.Until()).Round(time.Second).String())
	g.logAudit(audit.Record{Event: audit.EventLearn, Decision: audit.Flagged, Rule: policy.RuleLearn,
		Reason: "learn mode on until " + until + ": requests outside the policy are allowed and flagged; deny lists, IP literals, special-use names and the address rules still refuse"})
	t := time.NewTimer(time.Until(l.Window.Until()))
	defer t.Stop()
	select {
	case <-ctx.Done():
		return
	case <-t.C:
	}
	g.log.Warn("learn mode ended; the policy applies again", "until", until)
	g.logAudit(audit.Record{Event: audit.EventLearn, Decision: audit.Allowed, Rule: policy.RuleLearn,
		Reason: "learn mode ended at " + until + "; the policy applies again"})
}

// learned marks a record of a decision learn mode made: every record of it
// (a request, a tunnel's open and close, each request inside an
// intercepted tunnel) is flagged, whatever else it says, so no learned
// byte reads as allowed by the policy.
func learned(rec *audit.Record) {
	if rec.Rule != policy.RuleLearn || rec.Event == audit.EventLearn || rec.Decision == audit.Blocked {
		return
	}
	rec.Decision = audit.Flagged
	rec.Reason = "learn mode, outside the policy: " + rec.Reason
}
