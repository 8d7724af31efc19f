package relay

import (
	"context"
	"fmt"
	"net"
	"strconv"
	"strings"
	"time"

	"github.com/nixcage/nixcage/internal/auditlog"
	"github.com/nixcage/nixcage/internal/bus"
	"github.com/nixcage/nixcage/internal/policy"
	"github.com/nixcage/nixcage/internal/relay/tg"
)

// Approvals in chat (docs/relay.md, docs/grants.md "Approvals"): the
// owner sees and decides the chat's agent's waiting requests. caged
// decides whether the relay's account may (operator over the agent); the
// relay only keeps a chat to its own agent.

func cmdApprovals(ctx context.Context, r *Relay, q *request, _ string) (string, string) {
	as, err := r.caged.ListApprovals(ctx, q.agent)
	if err != nil {
		return r.refusal(ctx, q, "approvals of "+q.agent, err)
	}
	if len(as) == 0 {
		r.answer(ctx, q, "No requests of "+q.agent+" wait for approval.")
		return bus.RelayOK, "0 waiting"
	}
	now := time.Now()
	lines := make([]string, 0, len(as)+1)
	for _, a := range as {
		lines = append(lines, formatApproval(a, now))
	}
	lines = append(lines, "\nDecide with /approve ID once|host|deny")
	r.answer(ctx, q, strings.Join(lines, "\n"))
	return bus.RelayOK, fmt.Sprintf("%d waiting", len(as))
}

// formatApproval is one waiting request; host, method and path are the
// agent's words, escaped as cagectl approvals escapes them.
func formatApproval(a bus.Approval, now time.Time) string {
	left := max(time.Unix(a.ExpiresUnix, 0).Sub(now).Round(time.Second), 0)
	target := net.JoinHostPort(a.Host, strconv.Itoa(int(a.Port)))
	return auditlog.Escape(fmt.Sprintf("%s %s %s%s, %s left", a.ID, a.Method, target, a.Path, left))
}

func cmdApprove(ctx context.Context, r *Relay, q *request, args string) (string, string) {
	f := strings.Fields(args)
	if len(f) != 2 {
		r.answer(ctx, q, "/approve ID once|host|deny (IDs: /approvals)")
		return bus.RelayRefused, "usage"
	}
	id, verdict := f[0], f[1]
	if err := policy.CheckApprovalID(id); err != nil {
		r.answer(ctx, q, "/approve: "+err.Error())
		return bus.RelayRefused, "bad id"
	}
	// Decide finds the agent from the id; a chat is bound to one agent,
	// so the relay first checks the id is that agent's (an id of another
	// agent is refused here, not decided from the wrong chat).
	as, err := r.caged.ListApprovals(ctx, q.agent)
	if err != nil {
		return r.refusal(ctx, q, "approvals of "+q.agent, err)
	}
	var a *bus.Approval
	for i := range as {
		if as[i].ID == id {
			a = &as[i]
		}
	}
	if a == nil {
		r.answer(ctx, q, fmt.Sprintf("Refused: no request %s of %s is waiting (decided, timed out, or another agent's; /approvals lists them).", id, q.agent))
		return bus.RelayRefused, "no request " + id + " of " + q.agent
	}
	target := auditlog.Escape(net.JoinHostPort(a.Host, strconv.Itoa(int(a.Port))))
	g, err := r.caged.Decide(ctx, id, verdict)
	if err != nil {
		return r.refusal(ctx, q, "approve "+id, err)
	}
	switch verdict {
	case policy.VerdictHost:
		r.answer(ctx, q, fmt.Sprintf("Approved %s (%s): grant %s lets %s reach the host for %s (/grants lists it); the waiting request proceeds.", id, target, g, q.agent, policy.DefaultGrantDuration))
		return bus.RelayOK, "host " + id + " " + target + " grant " + g
	case policy.VerdictDeny:
		r.answer(ctx, q, fmt.Sprintf("Denied %s (%s): the agent gets a 403 saying so.", id, target))
	default:
		r.answer(ctx, q, fmt.Sprintf("Approved %s once (%s): the waiting request proceeds.", id, target))
	}
	return bus.RelayOK, verdict + " " + id + " " + target
}

// watchApprovals subscribes to caged's signals and posts each
// ApprovalPending into its agent's chats. Without the stream (caged
// refused the subscription, or is away) the relay still serves commands:
// /approvals lists what waits.
func (r *Relay) watchApprovals(ctx context.Context) {
	evs, err := r.caged.Events(ctx)
	if err != nil {
		r.log.Warn("no approval announcements: subscribing to caged's signals failed; /approvals still lists them", "err", err)
		return
	}
	r.wg.Add(1)
	go func() {
		defer r.wg.Done()
		for ev := range evs {
			if ev.Kind == bus.SignalApprovalPending {
				r.announceApproval(ctx, ev)
			}
		}
	}()
}

// announceApproval posts one waiting request to every chat bound to its
// agent; host, method and path are the agent's words, escaped.
func (r *Relay) announceApproval(ctx context.Context, ev bus.Event) {
	d := ev.Data
	if policy.CheckApprovalID(d["id"]) != nil {
		return
	}
	text := auditlog.Escape(fmt.Sprintf("agent %s wants %s (id %s; %s %s)", ev.Agent, net.JoinHostPort(d["host"], d["port"]), d["id"], d["method"], d["path"])) +
		fmt.Sprintf(" — /approve %s once|host|deny", d["id"])
	if exp, err := strconv.ParseInt(d["expires_unix"], 10, 64); err == nil {
		text += fmt.Sprintf(" (within %s)", max(time.Until(time.Unix(exp, 0)).Round(time.Second), 0))
	}
	for _, c := range r.doc.Chats {
		if c.Agent != ev.Agent {
			continue
		}
		to := tg.Target{ChatID: c.ChatID, Topic: int(c.Topic)}
		if err := r.tg.SendText(ctx, to, text); err != nil {
			r.log.Warn("announce approval", "agent", ev.Agent, "approval", d["id"], "chat", c.ChatID, "err", err)
		}
	}
}
