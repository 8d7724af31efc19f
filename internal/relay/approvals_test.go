package relay_test

import (
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/nixcage/nixcage/internal/daemon/daemontest"
	"github.com/nixcage/nixcage/internal/paths"
	"github.com/nixcage/nixcage/internal/policy"
	"github.com/nixcage/nixcage/internal/testenv"
)

// TestApprovalsInChatThroughCaged: /approvals and /approve against a real
// caged on a real dbus-daemon (daemontest), the test in the gateway's
// place writing the pending file as the gateway does and reading the
// decision with the gateway's reader (policy.LoadDecision): the waiting
// request is announced in its agent's chat (ApprovalPending) and listed,
// escaped; `/approve ID host` makes caged write the
// decision and a grant, and a stranger's /approve decides nothing.
func TestApprovalsInChatThroughCaged(t *testing.T) {
	testenv.RequirePrivileged(t)
	c := daemontest.Start(t, `
agent "alice" {
  backend = "service"
  command = ["/bin/sleep", "infinity"]
}
agent "bob" {
  backend   = "service"
  command   = ["/bin/sleep", "infinity"]
  autostart = false
}
`)
	h := startWith(t, c.Client())
	seq := h.say(owner, chatA, 0, "/approvals")
	if got := h.reply(t, seq, "sendMessage"); got.Text != "No requests of alice wait for approval." {
		t.Fatalf("approvals reply %q", got.Text)
	}

	// The relay is subscribed once it has answered (Serve subscribes
	// before reading updates): a request waiting from now on is announced
	// in alice's chat through caged's ApprovalPending.
	id, _ := policy.NewApprovalID()
	now := time.Now()
	seq = len(h.tg.Sent(0))
	ap := c.Pend(policy.Pending{Schema: policy.ApprovalSchema, ID: id, Agent: "alice", Method: "GET", Host: "registry.npmjs.org", Port: 80,
		Path: "/pkg\x1b[31mred", SinceUnix: now.Unix(), ExpiresUnix: now.Add(time.Minute).Unix()})
	if got := h.reply(t, seq, "sendMessage"); got.ChatID != chatA || strings.Contains(got.Text, "\x1b") ||
		!strings.HasPrefix(got.Text, "agent alice wants registry.npmjs.org:80 (id "+id+"; GET /pkg\\x1b[31mred) — /approve "+id+" once|host|deny") {
		t.Fatalf("announcement %+v", got)
	}

	seq = h.say(owner, chatA, 0, "/approvals")
	if got := h.reply(t, seq, "sendMessage"); !strings.Contains(got.Text, id+" GET registry.npmjs.org:80/pkg\\x1b[31mred") || strings.Contains(got.Text, "\x1b") {
		t.Fatalf("approvals reply %q", got.Text)
	}
	// bob's chat lists none of alice's and cannot decide hers.
	seq = h.say(owner, forum, topicB, "/approve "+id+" once")
	if got := h.reply(t, seq, "sendMessage"); !strings.Contains(got.Text, "Refused: no request "+id+" of bob") {
		t.Fatalf("bob's chat: %q", got.Text)
	}
	seq = h.say(stranger, chatA, 0, "/approve "+id+" deny")
	if got := h.reply(t, seq, "sendMessage"); !strings.Contains(got.Text, "Refused") {
		t.Fatalf("stranger: %q", got.Text)
	}
	if d, err := policy.LoadDecision(ap, "alice", id); err != nil || d != nil {
		t.Fatalf("a refused /approve left a decision: %+v %v", d, err)
	}

	seq = h.say(owner, chatA, 0, "/approve "+id+" host")
	got := h.reply(t, seq, "sendMessage")
	m := regexp.MustCompile(`Approved ` + id + ` \(registry.npmjs.org:80\): grant (g-[0-9a-f]+) lets alice reach the host for 1h0m0s`).FindStringSubmatch(got.Text)
	if m == nil {
		t.Fatalf("approve reply %q", got.Text)
	}
	d, err := policy.LoadDecision(ap, "alice", id)
	if err != nil || d == nil || d.Verdict != policy.VerdictHost || d.Grant != m[1] {
		t.Fatalf("decision as the gateway reads it: %+v %v", d, err)
	}
	doc, err := policy.LoadGrants(c.Path(paths.GrantsFile("alice")), "alice")
	if err != nil || len(doc.Grants) != 1 || doc.Grants[0].ID != m[1] || doc.Grants[0].Host != "registry.npmjs.org" {
		t.Fatalf("grant: %+v %v", doc, err)
	}
}
