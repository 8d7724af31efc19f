// Package harness holds the shipped scaffolds for AI coding harnesses: what
// `harness = "claude-code"` (or "codex", "gemini") in an agent block brings.
// Each scaffold is data, here and nowhere else: the shipped egress policy it
// uses (policies/<name>.hcl), the credential of that policy and the variable
// the CLI really reads it from, the environment that keeps the CLI from
// calling home, the files the CLI reads at start (rendered read-only into
// the cage) and the note that tells the agent it is caged.
//
// Every fact below was checked against the real CLI at the version named,
// by checks/system (TestHarnessCLIs) and docs/harnesses.md.
package harness

import (
	"sort"
	"strings"
)

// Harness is one scaffold.
type Harness struct {
	Name string
	// Policy is the shipped egress policy the agent gets unless it names
	// its own.
	Policy string
	// Secret is the credential block of Policy that carries the API key;
	// Env is the variable the CLI reads it from (the cage sees only the
	// placeholder there).
	Secret, Env string
	// Environment is merged under the agent's own (the agent's wins).
	Environment map[string]string
	// Files are written read-only into the cage at these absolute paths,
	// outside the workspace (the agent cannot change them); NoteFile marks
	// where the note goes, "{{note}}" in a file's text is replaced by it.
	Files map[string]string
	// Binary is where the CLI lives in the signed tools store.
	Binary string
	// Tested is the CLI version the scaffold was proven with.
	Tested string
	// TurnCommand runs one turn (docs/relay.md): the text on stdin, the
	// answer on stdout, resuming the previous conversation in the
	// workspace. nil: none proven (turn_command needed).
	TurnCommand []string
}

// NotePath is where every harness finds the note, whatever else reads it.
const NotePath = "/etc/nixcage/CAGE.md"

// Note tells the caged agent where it is. It names no secret.
const Note = `# You are running in a nixcage cage

- Network: only what the egress policy allows, through the gateway at
  127.0.0.1:3128 (HTTPS_PROXY is set). Everything else is refused: a refused
  HTTPS request is answered 403 with a body naming the rule. There is no other
  route, no DNS except through the gateway.
- Your API key variable holds a placeholder; the gateway puts the real key
  into requests to the model API only. Do not try to read or send it.
- Files: /workspace (your HOME and working directory) is the only writable
  place that lasts; /nix/tools holds the tools; the rest is read-only.
- Need another host or tool? Ask the operator, naming the host and why: they
  widen the policy with cagectl (an egress_policy of their own) and restart
  the cage. Every request you make is in their audit log.
`

var harnesses = map[string]Harness{
	"claude-code": {
		Name: "claude-code", Policy: "claude-code", Secret: "anthropic", Env: "ANTHROPIC_API_KEY",
		Environment: map[string]string{
			// Telemetry, error reporting, the auto-updater and other
			// calls that are not the model API (docs/harnesses.md).
			"CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
			"DISABLE_AUTOUPDATER":                      "1",
			"DISABLE_TELEMETRY":                        "1",
			"DISABLE_ERROR_REPORTING":                  "1",
			// The cage is a sandbox: under nspawn and podman the agent is
			// root of its own user namespace (no host privilege), where
			// Claude Code refuses bypassPermissions unless told so.
			"IS_SANDBOX": "1",
		},
		Files: map[string]string{
			// Claude Code's managed memory on Linux: read at every start,
			// whatever the working directory.
			"/etc/claude-code/CLAUDE.md": "{{note}}",
		},
		Binary: "/nix/tools/bin/claude",
		Tested: "@anthropic-ai/claude-code 2.1.332",
		// -p reads the prompt from stdin; --continue resumes the most
		// recent conversation in the working directory and starts one
		// when there is none (checked on 2.1.332).
		TurnCommand: []string{"/nix/tools/bin/claude", "-p", "--continue"},
	},
	"codex": {
		Name: "codex", Policy: "codex", Secret: "openai", Env: "CODEX_API_KEY",
		Environment: map[string]string{},
		Files: map[string]string{
			// Codex's system configuration layer (below ~/.codex/config.toml).
			"/etc/codex/config.toml": `# Rendered by nixcage for a caged Codex (docs/harnesses.md).
# The cage is the sandbox: Codex's own (bubblewrap, user namespaces) cannot
# start inside it, and would add nothing the cage does not already enforce.
sandbox_mode = "danger-full-access"
approval_policy = "never"
check_for_update_on_startup = false
developer_instructions = """
{{note}}"""

[analytics]
enabled = false
`,
		},
		Binary: "/nix/tools/bin/codex",
		Tested: "@openai/codex 0.171.0",
		// "-" reads the prompt from stdin; resume --last takes the most
		// recent session and starts one when there is none; exec refuses
		// a workspace that is not a git repository without the flag
		// (checked on 0.171.0).
		TurnCommand: []string{"/nix/tools/bin/codex", "exec", "resume", "--last", "--skip-git-repo-check", "-"},
	},
	"gemini": {
		Name: "gemini", Policy: "gemini", Secret: "gemini", Env: "GEMINI_API_KEY",
		Environment: map[string]string{
			"GEMINI_CLI_DISABLE_AUTO_UPDATE": "true",
		},
		Files: map[string]string{
			// Gemini CLI's system settings file on Linux.
			"/etc/gemini-cli/settings.json": `{"general": {"disableAutoUpdate": true, "disableUpdateNag": true}, "privacy": {"usageStatisticsEnabled": false}, "telemetry": {"enabled": false}}
`,
		},
		Binary: "/nix/tools/bin/gemini",
		Tested: "not run (needs Node.js >= 20 in the cage; docs/harnesses.md)",
	},
}

// Lookup returns the scaffold called name.
func Lookup(name string) (Harness, bool) {
	h, ok := harnesses[name]
	return h, ok
}

// Names lists the shipped scaffolds, sorted.
func Names() []string {
	var n []string
	for k := range harnesses {
		n = append(n, k)
	}
	sort.Strings(n)
	return n
}

// RenderedFiles are the files of h as the cage sees them (path -> content),
// the note included.
func (h Harness) RenderedFiles() map[string]string {
	out := map[string]string{NotePath: Note}
	for p, text := range h.Files {
		out[p] = strings.ReplaceAll(text, "{{note}}", Note)
	}
	return out
}
