package relay

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/nixcage/nixcage/internal/auditlog"
	"github.com/nixcage/nixcage/internal/bus"
	"github.com/nixcage/nixcage/internal/config"
)

// command is one owner command; run answers in the chat and returns the
// outcome and detail for the audit.
type command struct {
	args  string
	short string
	run   func(ctx context.Context, r *Relay, q *request, args string) (outcome, detail string)
}

// Bounds of the N of /logs and /audit.
const (
	defaultLines = 30
	maxLines     = 1000
	// defaultGrant is how long /allow HOST opens a host.
	defaultGrant = time.Hour
)

var commands map[string]command

func init() {
	commands = map[string]command{
		"help":       {"", "this list", cmdHelp},
		"status":     {"", "the agent's state and the store's generation", cmdStatus},
		"start":      {"", "start the agent", control("start", Caged.Start)},
		"stop":       {"", "stop the agent", control("stop", Caged.Stop)},
		"kill":       {"", "SIGKILL every process of the agent", control("kill", Caged.Kill)},
		"quarantine": {"[REASON]", "stop the agent, cut its egress, keep evidence", cmdQuarantine},
		"logs":       {"[N]", "the agent's last N journal lines", cmdLogs},
		"audit":      {"[N]", "the agent's last N egress decisions", cmdAudit},
		"allow":      {"HOST[:PORT] [DURATION]", "let the agent reach HOST for a while (default 1h)", cmdAllow},
		"grants":     {"", "the agent's time-bound grants in force", cmdGrants},
		"approvals":  {"", "the agent's requests waiting for an operator", cmdApprovals},
		"approve":    {"ID once|host|deny", "decide a waiting request (host: a 1h grant)", cmdApprove},
	}
	addFileCommands(commands)
}

func cmdHelp(ctx context.Context, r *Relay, q *request, _ string) (string, string) {
	names := make([]string, 0, len(commands))
	for n := range commands {
		names = append(names, n)
	}
	sort.Strings(names)
	var b strings.Builder
	fmt.Fprintf(&b, "This chat is agent %s. A plain message is a turn for the agent.\n\n", q.agent)
	for _, n := range names {
		c := commands[n]
		fmt.Fprintf(&b, "/%s %s — %s\n", n, c.args, c.short)
	}
	b.WriteString("\nA document is saved into the agent's workspace inbox; a release (a tar of a release directory) sent with the caption /apply is applied like cagectl apply.")
	r.answer(ctx, q, b.String())
	return bus.RelayOK, ""
}

// refusal shows caged's answer to the owner and classifies it for the
// audit: caged's refusals (access denied, quarantined, invalid) are
// "refused", anything else "failed".
func (r *Relay) refusal(ctx context.Context, q *request, what string, err error) (string, string) {
	var re *bus.RemoteError
	outcome := bus.RelayFailed
	if errors.As(err, &re) && (errors.Is(err, bus.ErrDenied) || re.Name == bus.ErrorQuarantined || re.Name == bus.ErrorInvalid || re.Name == bus.ErrorNoSuchAgent || re.Name == bus.ErrorBusy) {
		outcome = bus.RelayRefused
	}
	word := "Failed"
	if outcome == bus.RelayRefused {
		word = "Refused"
	}
	r.answer(ctx, q, fmt.Sprintf("%s: %s: %v", word, what, err))
	return outcome, err.Error()
}

func control(what string, f func(Caged, context.Context, string) error) func(context.Context, *Relay, *request, string) (string, string) {
	return func(ctx context.Context, r *Relay, q *request, _ string) (string, string) {
		if err := f(r.caged, ctx, q.agent); err != nil {
			return r.refusal(ctx, q, what+" "+q.agent, err)
		}
		r.answer(ctx, q, fmt.Sprintf("%s: %s done.", q.agent, what))
		return bus.RelayOK, what + " done"
	}
}

func cmdStatus(ctx context.Context, r *Relay, q *request, _ string) (string, string) {
	st, err := r.caged.Status(ctx)
	if err != nil {
		return r.refusal(ctx, q, "status", err)
	}
	var a *bus.AgentStatus
	for i := range st.Agents {
		if st.Agents[i].Name == q.agent {
			a = &st.Agents[i]
		}
	}
	if a == nil {
		r.answer(ctx, q, fmt.Sprintf("caged knows no agent %s (removed from the configuration?).", q.agent))
		return bus.RelayFailed, "agent not in caged's status"
	}
	r.answer(ctx, q, formatStatus(st, a))
	return bus.RelayOK, a.ActiveState + "/" + a.SubState
}

func formatStatus(st *bus.Status, a *bus.AgentStatus) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s: %s/%s (%s backend), egress %s\n", a.Name, a.ActiveState, a.SubState, a.Backend, a.EgressState)
	if a.Quarantined {
		fmt.Fprintf(&b, "QUARANTINED: %s\n", a.QuarantineReason)
	}
	if a.Generation > 0 {
		fmt.Fprintf(&b, "tools: generation %d\n", a.Generation)
	}
	fmt.Fprintf(&b, "egress since caged started: %d allowed, %d flagged, %d blocked\n", a.Allowed, a.Flagged, a.Blocked)
	if st.Generation > 0 {
		fmt.Fprintf(&b, "store: generation %d (channel %s), %s", st.Generation, st.Channel, st.Freshness)
		if st.FreshnessMessage != "" {
			fmt.Fprintf(&b, ": %s", st.FreshnessMessage)
		}
		b.WriteString("\n")
	} else {
		b.WriteString("store: no generation\n")
	}
	if st.ReconcileError != "" {
		fmt.Fprintf(&b, "last reconcile failed: %s\n", st.ReconcileError)
	}
	return strings.TrimSuffix(b.String(), "\n")
}

func cmdQuarantine(ctx context.Context, r *Relay, q *request, args string) (string, string) {
	reason := oneLine(args, 200)
	if reason == "" {
		reason = "from Telegram by " + q.actor
	} else {
		reason += " (from Telegram by " + q.actor + ")"
	}
	ev, err := r.caged.Quarantine(ctx, q.agent, reason)
	if err != nil {
		return r.refusal(ctx, q, "quarantine "+q.agent, err)
	}
	r.answer(ctx, q, fmt.Sprintf("%s is quarantined: %s\nevidence: %s\nIt stays down until an operator releases it (cagectl release %s).", q.agent, reason, ev, q.agent))
	return bus.RelayOK, "evidence " + ev
}

// count parses the N of /logs and /audit.
func count(args string) (int, error) {
	if args == "" {
		return defaultLines, nil
	}
	n, err := strconv.Atoi(args)
	if err != nil || n < 1 || n > maxLines {
		return 0, fmt.Errorf("give a number of lines from 1 to %d", maxLines)
	}
	return n, nil
}

func cmdLogs(ctx context.Context, r *Relay, q *request, args string) (string, string) {
	return r.tail(ctx, q, "logs", args, "journal lines", func(n int) ([]string, error) {
		lines, _, err := r.caged.ReadLogs(ctx, q.agent, uint32(n), "")
		return lines, err
	}, auditlog.Escape)
}

func cmdAudit(ctx context.Context, r *Relay, q *request, args string) (string, string) {
	return r.tail(ctx, q, "audit", args, "egress decisions", func(n int) ([]string, error) {
		lines, _, err := r.caged.ReadAudit(ctx, q.agent, -1, uint32(n))
		return lines, err
	}, formatAudit)
}

// tail answers /logs and /audit: the last N lines read, each formatted,
// as messages or a file.
func (r *Relay) tail(ctx context.Context, q *request, cmd, args, what string, read func(n int) ([]string, error), format func(string) string) (string, string) {
	n, err := count(args)
	if err != nil {
		r.answer(ctx, q, "/"+cmd+" [N]: "+err.Error())
		return bus.RelayRefused, err.Error()
	}
	lines, err := read(n)
	if err != nil {
		return r.refusal(ctx, q, cmd+" "+q.agent, err)
	}
	if len(lines) == 0 {
		r.answer(ctx, q, fmt.Sprintf("No %s for %s.", what, q.agent))
		return bus.RelayOK, "0 lines"
	}
	for i, l := range lines {
		lines[i] = format(l)
	}
	r.answerNamed(ctx, q, strings.Join(lines, "\n"), q.agent+"-"+cmd+".txt")
	return bus.RelayOK, fmt.Sprintf("%d lines", len(lines))
}

// formatAudit makes one gateway record readable; what the agent wrote
// (host, path, reason) is escaped as cagectl audit escapes it.
func formatAudit(line string) string {
	var rec auditlog.Record
	if json.Unmarshal([]byte(line), &rec) != nil {
		return auditlog.Escape(line)
	}
	target := net.JoinHostPort(rec.Host, strconv.Itoa(rec.Port))
	s := fmt.Sprintf("%s %s %s %s%s", rec.TS, rec.Decision, rec.Method, target, rec.Path)
	if rec.Reason != "" {
		s += " — " + rec.Reason
	}
	return auditlog.Escape(s)
}

func cmdAllow(ctx context.Context, r *Relay, q *request, args string) (string, string) {
	f := strings.Fields(args)
	if len(f) < 1 || len(f) > 2 {
		r.answer(ctx, q, "/allow HOST[:PORT] [DURATION], e.g. /allow api.example.com 30m")
		return bus.RelayRefused, "usage"
	}
	host, port := f[0], 0
	if h, p, err := net.SplitHostPort(f[0]); err == nil {
		n, err := strconv.Atoi(p)
		if err != nil || n < 1 || n > 65535 {
			r.answer(ctx, q, "/allow: the port must be 1-65535")
			return bus.RelayRefused, "bad port"
		}
		host, port = h, n
	}
	d := defaultGrant
	if len(f) == 2 {
		var err error
		if d, err = config.ParseDays(f[1]); err != nil || d <= 0 {
			r.answer(ctx, q, "/allow: the duration is like 30m, 2h or 1d")
			return bus.RelayRefused, "bad duration"
		}
	}
	g, err := r.caged.AllowHost(ctx, q.agent, host, port, d, "from Telegram by "+q.actor)
	if err != nil {
		return r.refusal(ctx, q, "allow "+host, err)
	}
	r.answer(ctx, q, fmt.Sprintf("%s may reach %s until %s (grant %s).", q.agent, grantTarget(*g), time.Unix(g.ExpiresUnix, 0).UTC().Format(time.RFC3339), g.ID))
	return bus.RelayOK, "grant " + g.ID + " " + grantTarget(*g)
}

func grantTarget(g bus.Grant) string {
	if g.Port == 0 {
		return g.Host
	}
	return net.JoinHostPort(g.Host, strconv.Itoa(int(g.Port)))
}

func cmdGrants(ctx context.Context, r *Relay, q *request, _ string) (string, string) {
	gs, err := r.caged.ListGrants(ctx, q.agent)
	if err != nil {
		return r.refusal(ctx, q, "grants of "+q.agent, err)
	}
	if len(gs) == 0 {
		r.answer(ctx, q, "No grants in force for "+q.agent+".")
		return bus.RelayOK, "0 grants"
	}
	lines := make([]string, 0, len(gs))
	for _, g := range gs {
		l := fmt.Sprintf("%s %s until %s by %s", g.ID, grantTarget(g), time.Unix(g.ExpiresUnix, 0).UTC().Format(time.RFC3339), g.By)
		if g.Reason != "" {
			l += " (" + g.Reason + ")"
		}
		lines = append(lines, auditlog.Escape(l))
	}
	r.answer(ctx, q, strings.Join(lines, "\n"))
	return bus.RelayOK, fmt.Sprintf("%d grants", len(gs))
}
