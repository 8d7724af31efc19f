package system

import (
	"context"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/nixcage/nixcage/internal/systest/upstream"
	"github.com/nixcage/nixcage/internal/testenv"
)

// ansi matches the escape sequences a TUI draws with; Claude Code moves
// the cursor instead of printing spaces, so the screen is compared with
// whitespace removed too.
var ansi = regexp.MustCompile(`\x1b\[[0-9;?<>=]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(\x07|\x1b\\)|\x1b[()][0-9A-Za-z]|\x1b[=>78]`)

func screenText(s string) string {
	return strings.Join(strings.Fields(ansi.ReplaceAllString(s, "")), "")
}

// TestRunClaudeCodeInteractive drives the real Claude Code TUI through a
// pty under `cagectl run` (issue 13): the test types a prompt, the fake
// Anthropic API answers with a Bash tool call that tries to send the key
// to evil.example.org (refused) and one that writes a file, and the test
// checks the screen, the audit, and that the fake API saw the real key
// while the cage saw only the placeholder.
//
// Claude Code's first-run screens are skipped the way a user's own config
// does: ~/.claude.json (HOME is /workspace) with onboarding done, the
// workspace trusted and the key the cage sees (the placeholder; its last
// 20 characters, as Claude Code records approvals) approved, written by
// the cage's command before it starts claude. No --dangerously-* flag:
// --permission-mode bypassPermissions, as a user of a cage would.
func TestRunClaudeCodeInteractive(t *testing.T) {
	testenv.RequireSystem(t)
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	_, bins := cagedBinaries(t)
	m, in := harnessMachine(t, ctx, bins, runConfig, nil)
	m.MustRun(t, "sh", "-c", `useradd --no-create-home --uid 1500 runner && systemctl reload dbus && systemctl start nixcage-caged.service
mkdir -p /var/lib/nixcage/cc && mount -t tmpfs tmpfs /var/lib/nixcage/cc && chown runner: /var/lib/nixcage/cc
printf %s '`+realAnthropicKey+`' > /var/lib/nixcage/cc-key && chown runner: /var/lib/nixcage/cc-key && chmod 600 /var/lib/nixcage/cc-key`)
	m.MustWriteFile(t, "/var/lib/nixcage/cc/start.sh", []byte(`#!/bin/sh
k=$(printf %s "$ANTHROPIC_API_KEY" | tail -c 20)
printf '{"hasCompletedOnboarding":true,"theme":"dark","projects":{"/workspace":{"hasTrustDialogAccepted":true}},"bypassPermissionsModeAccepted":true,"customApiKeyResponses":{"approved":["%s"],"rejected":[]}}' "$k" > "$HOME/.claude.json"
mkdir -p "$HOME/.claude" && printf '{"skipDangerousModePermissionPrompt":true}' > "$HOME/.claude/settings.json"
exec /nix/tools/bin/claude --permission-mode bypassPermissions
`), 0o755)
	// Both backends: nspawn's console is a pty of the cage's own devpts, a
	// service cage's terminal is the caller's, an fd with no name in its
	// empty /dev/pts (threat-model.md, "Service cages' terminals").
	for _, backend := range []string{"nspawn", "service"} {
		t.Run(backend, func(t *testing.T) {
			// A fresh HOME: what the other backend's cage wrote is its uid's.
			m.Run(ctx, "sh", "-c", "cd /var/lib/nixcage/cc && rm -rf .claude.json .claude "+upstream.WroteFile)
			before, err := in.Requests()
			if err != nil {
				t.Fatal(err)
			}
			want := screenText(upstream.FinalText)
			out, code := runPTY(t, ctx, m, "cd /var/lib/nixcage/cc && exec setpriv --reuid runner --regid runner --clear-groups cagectl run --backend "+backend+" --name cc-tui-"+backend+" --policy claude-code --secret anthropic=/var/lib/nixcage/cc-key -- sh /workspace/start.sh",
				func(p *ptyDriver) {
					// The main prompt's footer; if Claude Code still asks to
					// accept bypass mode, answer as a user would (Down, Enter).
					if waitScreen(t, p, "shift+tab", "Yes, I accept") == 1 {
						t.Logf("Claude Code asked to accept bypass permissions mode; accepting")
						p.write("\x1b[B")
						time.Sleep(300 * time.Millisecond)
						p.write("\r")
						waitScreen(t, p, "shift+tab")
					}
					time.Sleep(time.Second)
					p.write(harnessPrompt)
					time.Sleep(500 * time.Millisecond)
					p.write("\r")
					waitScreen(t, p, want)
					p.write("\x03")
					time.Sleep(300 * time.Millisecond)
					p.write("\x03")
				})
			screen := screenText(out)
			if !strings.Contains(screen, want) {
				t.Errorf("the screen never showed the model's final answer %q", upstream.FinalText)
			}
			if !regexp.MustCompile(`\(blocked:[^)]*evil\.example\.org`).MatchString(screen) {
				t.Errorf("cagectl's summary does not name evil.example.org as blocked")
			}
			if strings.Contains(out, realAnthropicKey) {
				t.Errorf("the real key was on the cage's terminal")
			}
			t.Logf("cagectl exited %d", code)

			after, err := in.Requests()
			if err != nil {
				t.Fatal(err)
			}
			turns := 0
			for _, r := range after[len(before):] {
				if strings.Contains(r.Host+r.SNI+r.Name, "evil.example.org") {
					t.Errorf("the refused host received %s %s %s", r.Kind, r.Method, r.Path)
				}
				if r.Host != upstream.AnthropicHost || r.Method != "POST" || !strings.HasPrefix(r.Path, "/v1/messages") {
					continue
				}
				turns++
				if got := strings.Join(r.Headers["X-Api-Key"], ","); got != realAnthropicKey {
					t.Errorf("the fake API got X-Api-Key %q, want the real key", got)
				}
			}
			if turns < 2 {
				t.Errorf("the fake API saw %d Messages calls, want a tool-use turn and a final one", turns)
			}
			// The cage's own view: its HOME (the workspace) holds the placeholder
			// approval, never the key; the file the model asked for is there.
			if got, _ := m.Run(ctx, "grep", "-rlF", realAnthropicKey, "/var/lib/nixcage/cc"); strings.TrimSpace(got) != "" {
				t.Errorf("the real key is in the workspace: %s", got)
			}
			if got, err := m.ReadFile("/var/lib/nixcage/cc/" + upstream.WroteFile); err != nil || strings.TrimSpace(string(got)) != upstream.WroteContent {
				t.Errorf("workspace file %s = %q, %v", upstream.WroteFile, got, err)
			}
			audit, _ := m.Run(ctx, "sh", "-c", "cat /var/log/nixcage-egress/cc-tui-"+backend+"/audit.jsonl")
			if !strings.Contains(audit, `evil.example.org`) || !strings.Contains(audit, `"block`) {
				t.Errorf("the audit does not record evil.example.org blocked:\n%s", audit)
			}
		})
	}
}

// waitScreen waits up to a minute for the ANSI-stripped screen to show
// one of texts, and returns which.
func waitScreen(t *testing.T, p *ptyDriver, texts ...string) int {
	t.Helper()
	for i := 0; i < 600; i++ {
		screen := screenText(p.out.String())
		for j, s := range texts {
			if strings.Contains(screen, screenText(s)) {
				return j
			}
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatalf("terminal never showed %q:\n%s", texts, screenText(p.out.String()))
	return -1
}
