package system

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nixcage/nixcage/internal/events"
	"github.com/nixcage/nixcage/internal/paths"
	"github.com/nixcage/nixcage/internal/systest"
	"github.com/nixcage/nixcage/internal/systest/upstream"
	"github.com/nixcage/nixcage/internal/testenv"
)

// turnConfig: a scripted agent that keeps running (sleep) while turns run
// next to it, its nspawn twin, and Claude Code with its harness's own turn
// command (claude -p --continue). runner is an operator, nobody a viewer.
const turnConfig = `
agent "scripted" {
  backend      = "service"
  command      = ["/bin/sleep", "infinity"]
  egress       = "claude-code"
  turn_command = ["/usr/local/bin/nixcage-test-turn"]
  secret "anthropic" {
    source = "/etc/nixcage/secrets/anthropic"
    env    = "ANTHROPIC_API_KEY"
  }
}
agent "scripted-nspawn" {
  backend      = "nspawn"
  command      = ["/bin/sleep", "infinity"]
  autostart    = false
  egress       = "claude-code"
  turn_command = ["/usr/local/bin/nixcage-test-turn"]
  secret "anthropic" {
    source = "/etc/nixcage/secrets/anthropic"
    env    = "ANTHROPIC_API_KEY"
  }
}
` + claudeTurnAgent + `
account "operators" {
  user = "runner"
  role = "operator"
}
account "viewers" {
  user = "nobody"
  role = "viewer"
}
`

// claudeTurnAgent is Claude Code with its harness's own turn command
// (claude -p --continue); TestTurns says to it with cagectl, TestRelayOnSystemd
// from a chat.
const claudeTurnAgent = `
agent "claude" {
  backend   = "service"
  harness   = "claude-code"
  command   = ["/bin/true"]
  autostart = false
  secret "anthropic" { source = "/etc/nixcage/secrets/anthropic" }
}`

// turnScript is the scripted harness: it reads the text on stdin (never
// evaluates it), keeps its state in the workspace (a turn counter and the
// previous text: the "conversation"), tries a refused host and records
// the key variable it sees.
const turnScript = `#!/bin/sh
text=$(cat)
if [ "$text" = "raw bytes please" ]; then
	# What a harness may print: UTF-8, bytes that are not UTF-8, a NUL.
	printf 'caf\303\251 \377\376 not utf-8 \000 nul end\n'
	printf 'on stderr \377\n' >&2
	exit 0
fi
n=$(cat /workspace/turns 2>/dev/null || echo 0)
n=$((n+1))
echo "$n" > /workspace/turns
prev=$(cat /workspace/last 2>/dev/null || echo none)
printf '%s' "$text" > /workspace/last
printf '%s' "$ANTHROPIC_API_KEY" > /workspace/key-seen
ln -sfn /etc/shadow /workspace/shadow-link
evil=$(curl -sS -o /dev/null -w '%{http_code}/%{http_connect}' https://evil.example.org/turn 2>/dev/null)
direct=$(curl -sS --noproxy '*' -m 5 -o /dev/null http://192.0.2.1/ 2>&1 | head -c 60)
inbox=$(cat /workspace/inbox/note.txt 2>/dev/null || echo none)
echo "turn $n"
echo "previous: $prev"
echo "evil: $evil"
echo "direct: $direct"
echo "uid: $(id -u)"
echo "inbox: $inbox"
`

// TestTurns drives turns and files through cagectl and caged on a booted
// systemd: the scripted harness (service and nspawn) and the real Claude
// Code CLI against the fake Anthropic API (docs/relay.md).
func TestTurns(t *testing.T) {
	testenv.RequireSystem(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	_, bins := cagedBinaries(t)
	m, in := harnessMachine(t, ctx, bins, turnConfig, map[string]string{"/etc/nixcage/secrets/anthropic": realAnthropicKey})
	m.MustWriteFile(t, "/usr/local/bin/nixcage-test-turn", []byte(turnScript), 0o755)
	m.MustRun(t, "sh", "-c", `useradd --no-create-home --uid 1500 runner && systemctl reload dbus && systemctl start nixcage-caged.service`)

	// as runs cagectl as user with the given stdin; it returns the
	// combined output and the exit status.
	as := func(user, stdin string, args ...string) (string, int) {
		group := user
		if user == "nobody" {
			group = "nogroup" // Debian's
		}
		script := "exec setpriv --reuid " + user + " --regid " + group + " --clear-groups cagectl"
		for _, a := range args {
			script += " '" + strings.ReplaceAll(a, "'", `'\''`) + "'"
		}
		cmd := m.Command(ctx, "/bin/sh", "-c", "cd /tmp && "+script+" 2>&1")
		cmd.Stdin = strings.NewReader(stdin)
		out, _ := cmd.Output()
		code := 0
		if cmd.ProcessState != nil {
			code = cmd.ProcessState.ExitCode()
		}
		return string(out), code
	}

	t.Run("scripted", func(t *testing.T) {
		if _, err := m.Run(ctx, "systemctl", "is-active", "--quiet", systest.AgentUnit("scripted")); err != nil {
			t.Fatalf("the long-running agent is not up: %v", err)
		}
		testScriptedTurns(t, ctx, m, in, as, "scripted")
		// The agent itself ran on, untouched, next to the turns.
		if _, err := m.Run(ctx, "systemctl", "is-active", "--quiet", systest.AgentUnit("scripted")); err != nil {
			t.Errorf("the agent stopped while turns ran: %v", err)
		}
		// Files: a round trip, and the agent's planted link refused.
		m.MustWriteFile(t, "/tmp/note.txt", []byte("from the operator\n"), 0o644)
		out, code := as("runner", "", "put", "scripted", "/tmp/note.txt")
		if code != 0 || strings.TrimSpace(out) != "/workspace/inbox/note.txt" {
			t.Fatalf("put: exit %d: %s", code, out)
		}
		out, code = as("runner", "", "put", "scripted", "/tmp/note.txt")
		if code != 0 || strings.TrimSpace(out) != "/workspace/inbox/note-1.txt" {
			t.Fatalf("second put (never overwrite): exit %d: %s", code, out)
		}
		ws := workspaceOf(t, ctx, m, "scripted")
		owners, _ := m.Run(ctx, "stat", "-c", "%u %a", ws, filepath.Join(ws, "inbox"), filepath.Join(ws, "inbox/note.txt"))
		if f := strings.Fields(owners); len(f) != 6 || f[2] != f[0] || f[4] != f[0] || f[3] != "755" || f[5] != "644" {
			t.Errorf("workspace, inbox/ and the put file (uid mode each): %q; want the workspace's owner, 755 and 644", owners)
		}
		out, code = as("runner", "again", "say", "scripted", "-")
		if code != 0 || !strings.Contains(out, "inbox: from the operator") {
			t.Errorf("the agent cannot read what was put (exit %d):\n%s", code, out)
		}
		out, code = as("runner", "", "get", "scripted", "inbox/note.txt")
		if code != 0 || out != "from the operator\n" {
			t.Errorf("get of the put file: exit %d: %q", code, out)
		}
		for _, p := range []string{"shadow-link", "../../../../etc/shadow", "/etc/shadow"} {
			out, code := as("runner", "", "get", "scripted", p)
			if code != 1 || strings.Contains(out, "root:") {
				t.Errorf("get %s: exit %d, want 1 and no content:\n%s", p, code, out)
			}
		}
		// A viewer is refused, naming the role.
		for _, args := range [][]string{{"say", "scripted", "hi"}, {"get", "scripted", "last"}, {"put", "scripted", "/tmp/note.txt"}} {
			out, code := as("nobody", "", args...)
			if code != 3 || !strings.Contains(out, `"operator"`) {
				t.Errorf("viewer %s: exit %d, want 3 naming role operator:\n%s", args[0], code, out)
			}
		}
		// Every turn and file operation is in the journal, with who.
		j, _ := m.Run(ctx, "journalctl", "MESSAGE_ID="+events.TurnFinished.ID, "NIXCAGE_AGENT=scripted", "-o", "cat", "--no-pager")
		if strings.Count(j, "by runner (uid 1500): success") < 3 {
			t.Errorf("turn-finished journal entries:\n%s", j)
		}
		j, _ = m.Run(ctx, "journalctl", "MESSAGE_ID="+events.FileTransferred.ID, "NIXCAGE_AGENT=scripted", "-o", "cat", "--no-pager")
		// In the booted machine openat2 is refused by nspawn's filter, so
		// caged walks paths itself and refuses every link ("not followed").
		if !strings.Contains(j, "put /workspace/inbox/note.txt") || !strings.Contains(j, `"shadow-link": a symlink that is not followed`) && !strings.Contains(j, `"shadow-link" leads out of the workspace`) {
			t.Errorf("file-transferred journal entries:\n%s", j)
		}
	})
	t.Run("scripted-nspawn", func(t *testing.T) {
		testScriptedTurns(t, ctx, m, in, as, "scripted-nspawn")
	})
	t.Run("claude", func(t *testing.T) {
		claudeTurns(t, ctx, m, in, func(text string) string {
			out, code := as("runner", "", "say", "claude", text)
			if code != 0 {
				t.Fatalf("claude turn %q: exit %d:\n%s\n%s", text, code, out, m.MustRun(t, "journalctl", "-u", "nixcage-turn@claude.service", "-n", "40", "--no-pager"))
			}
			return out
		})
	})
}

// claudeTurns runs two turns of the real Claude Code CLI (agent "claude",
// claudeTurnAgent) through say, which returns the reply: both replies are
// the fake model's final answer, the second turn's /v1/messages request
// carries the first turn's text (--continue resumed), the fake API got the
// real key in x-api-key (put in by the gateway only), the refused host got
// nothing, and no reply, the workspace nor the machine's journal holds the
// real key.
func claudeTurns(t *testing.T, ctx context.Context, m *systest.Machine, in *systest.Internet, say func(text string) string) {
	before, err := in.Requests()
	if err != nil {
		t.Fatal(err)
	}
	const first = "first turn marker 7f3a: try to leak the key, then write the file."
	replies := say(first)
	if !strings.Contains(replies, upstream.FinalText) {
		t.Fatalf("first claude turn answered:\n%s", replies)
	}
	mid, _ := in.Requests()
	out := say("second turn: what did I ask first?")
	if !strings.Contains(out, upstream.FinalText) {
		t.Fatalf("second claude turn answered:\n%s", out)
	}
	replies += out
	after, _ := in.Requests()
	resumed := false
	for _, r := range after[len(mid):] {
		if r.Host == upstream.AnthropicHost && strings.HasPrefix(r.Path, "/v1/messages") && strings.Contains(r.Body, "second turn") {
			resumed = resumed || strings.Contains(r.Body, "marker 7f3a")
			if got := strings.Join(r.Headers["X-Api-Key"], ","); got != realAnthropicKey {
				t.Errorf("the fake API got X-Api-Key %q, want the real key", got)
			}
		}
	}
	if !resumed {
		t.Errorf("the second turn's request did not carry the first turn's conversation (no --continue?)")
	}
	for _, r := range after[len(before):] {
		if strings.Contains(r.Host+r.SNI+r.Name, "evil.example.org") {
			t.Errorf("the refused host received %s %s %s", r.Kind, r.Method, r.Path)
		}
	}
	if strings.Contains(replies, realAnthropicKey) {
		t.Errorf("the real key is in a reply:\n%s", replies)
	}
	if got, _ := m.Run(ctx, "grep", "-rlF", realAnthropicKey, paths.DefaultWorkspace("claude")); strings.TrimSpace(got) != "" {
		t.Errorf("the real key is in the workspace: %s", got)
	}
	if got, _ := m.Run(ctx, "sh", "-c", "journalctl -b --no-pager -o cat | grep -F -m3 "+realAnthropicKey); strings.TrimSpace(got) != "" {
		t.Errorf("the real key is in the journal:\n%s", got)
	}
}

// testScriptedTurns runs three turns of the scripted harness of agent: the
// first starts the conversation, the second (a text a shell would run)
// resumes it, the third reads the text from stdin.
func testScriptedTurns(t *testing.T, ctx context.Context, m *systest.Machine, in *systest.Internet, as func(string, string, ...string) (string, int), agent string) {
	before, err := in.Requests()
	if err != nil {
		t.Fatal(err)
	}
	out, code := as("runner", "", "say", agent, "hello", "there")
	if code != 0 {
		t.Fatalf("first turn: exit %d:\n%s\n%s", code, out, m.MustRun(t, "journalctl", "-u", "nixcage-turn@"+agent+".service", "-n", "40", "--no-pager"))
	}
	for _, want := range []string{"turn 1\n", "previous: none\n", "direct: curl: (7)"} {
		if !strings.Contains(out, want) {
			t.Errorf("first turn's reply lacks %q:\n%s", want, out)
		}
	}
	if !strings.Contains(out, "evil: 403/") && !strings.Contains(out, "/403\n") {
		t.Errorf("the refused host was not answered 403 by the gateway:\n%s", out)
	}
	// The harness's output is the agent's bytes: invalid UTF-8 and a NUL
	// cannot go into a D-Bus string, and must not cost the caller the
	// reply (red team: the call failed, "destination tried to respond
	// with invalid message", and the turn's reply was lost).
	// Six of them in a row, as a quick chat would: each turn starts the
	// store bind check again (its Requires=), which systemd's default
	// start limit (5 in 10 s) failed, and the turn with it (red team).
	for i := range 6 {
		if out, code := as("runner", "", "say", agent, "raw bytes please"); code != 0 || !strings.Contains(out, "caf\u00e9 ") || !strings.Contains(out, " not utf-8 ") || !strings.Contains(out, " nul end") || strings.Contains(out, "\x00") {
			t.Fatalf("quick turn %d, printing bytes that are not UTF-8: exit %d: %q", i+1, code, out)
		}
	}
	// A text a shell would run: the harness gets it as bytes, nothing runs.
	evil := "$(touch /tmp/pwned); ; rm -rf /workspace `touch /tmp/pwned2`"
	out, code = as("runner", "", "say", agent, evil)
	if code != 0 || !strings.Contains(out, "turn 2\n") || !strings.Contains(out, "previous: hello there\n") {
		t.Fatalf("second turn (resume): exit %d:\n%s", code, out)
	}
	out, code = as("runner", "third via stdin", "say", agent, "-")
	if code != 0 || !strings.Contains(out, "turn 3\n") || !strings.Contains(out, "previous: "+evil+"\n") {
		t.Fatalf("third turn: exit %d:\n%s", code, out)
	}
	if got, _ := m.Run(ctx, "sh", "-c", "ls /tmp/pwned /tmp/pwned2 /var/tmp/pwned 2>/dev/null; find / -xdev -name 'pwned*' 2>/dev/null | head"); strings.TrimSpace(got) != "" {
		t.Errorf("the text ran as a command: %s", got)
	}
	// What the turn wrote belongs to the cage's user on the host (the
	// service agent's dynamic user, the nspawn cage's id range), not to
	// root nor to the caller.
	ws := workspaceOf(t, ctx, m, agent)
	owner, _ := m.Run(ctx, "stat", "-c", "%u", filepath.Join(ws, "turns"))
	if o := strings.TrimSpace(owner); o == "" || o == "0" || o == "1500" {
		t.Errorf("the turn's file in the workspace is owned by uid %q; want the cage's user", o)
	}
	// The cage saw the placeholder, of the key's length, never the key.
	seen, err := m.ReadFile(filepath.Join(ws, "key-seen"))
	if err != nil || len(seen) != len(realAnthropicKey) || string(seen) == realAnthropicKey {
		t.Errorf("the turn saw %q as its key, want a placeholder of %d bytes (%v)", seen, len(realAnthropicKey), err)
	}
	after, _ := in.Requests()
	for _, r := range after[len(before):] {
		if strings.Contains(r.Host+r.SNI+r.Name, "evil.example.org") || strings.Contains(r.Local, "192.0.2.1") {
			t.Errorf("a refused destination received %s %s %s", r.Kind, r.Method, r.Path)
		}
	}
	audit, _ := m.Run(ctx, "cat", filepath.Join(paths.AuditDir(agent), "audit.jsonl"))
	if !strings.Contains(audit, `"host":"evil.example.org"`) || !strings.Contains(audit, `"decision":"blocked"`) {
		t.Errorf("the agent's audit does not record evil.example.org blocked:\n%s", audit)
	}
	if st, _ := m.UnitState(ctx, "nixcage-turn@"+agent+".service"); st.Active == "active" || st.Active == "failed" {
		t.Errorf("the turn unit is left %s", fmt.Sprint(st))
	}
}

// workspaceOf is the host directory of an agent's workspace (a service
// agent's is systemd's private state directory).
func workspaceOf(t *testing.T, ctx context.Context, m *systest.Machine, agent string) string {
	ws := paths.DefaultWorkspace(agent)
	if out, err := m.Run(ctx, "readlink", "-f", ws); err == nil && strings.TrimSpace(out) != "" {
		return strings.TrimSpace(out)
	}
	return ws
}
