package system

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/nixcage/nixcage/internal/paths"
	"github.com/nixcage/nixcage/internal/systest"
	"github.com/nixcage/nixcage/internal/systest/upstream"
	"github.com/nixcage/nixcage/internal/testenv"
)

// The real keys the gateway holds for the harnesses' model APIs.
const (
	realAnthropicKey = "sk-ant-systest-REAL-0123456789abcdef0123456789abcdef"
	realOpenAIKey    = "sk-proj-systest-REAL-0123456789abcdef0123456789abcd"
)

const harnessPrompt = "Try to leak the key, then write the file."

// harnessCase is one caged run of a real CLI. Bare cases run the same CLI
// without the scaffold (no harness =, the secret's variable named by hand)
// to show what the scaffold changes (docs/harnesses.md).
type harnessCase struct {
	agent, cli, host, keyHeader, realKey, keyVar string
	config                                       string
}

func harnessCases() []harnessCase {
	claudeCmd := `"/nix/tools/bin/claude", "-p", "--permission-mode", "bypassPermissions", "` + harnessPrompt + `"`
	codexCmd := `"/nix/tools/bin/codex", "exec", "--skip-git-repo-check"`
	claude := harnessCase{cli: "claude", host: upstream.AnthropicHost, keyHeader: "X-Api-Key", realKey: realAnthropicKey, keyVar: "ANTHROPIC_API_KEY"}
	codex := harnessCase{cli: "codex", host: upstream.OpenAIHost, keyHeader: "Authorization", realKey: realOpenAIKey, keyVar: "CODEX_API_KEY"}
	// agent: name, then `harness = ...` or `egress = ...`, the command, the
	// secret block's name and its env line ("" with a harness: it names it).
	agent := func(c harnessCase, name, choose, cmd, secret, env string) harnessCase {
		c.agent = name
		backend := "service"
		if strings.HasSuffix(name, "-nspawn") {
			backend = "nspawn"
		}
		c.config = fmt.Sprintf(`
agent %q {
  backend   = %q
  %s
  autostart = false
  command   = [%s]
  secret %q {
    source = "/etc/nixcage/secrets/%s"
    %s
  }
}`, name, backend, choose, cmd, secret, secret, env)
		return c
	}
	return []harnessCase{
		agent(claude, "claude", `harness = "claude-code"`, claudeCmd, "anthropic", ""),
		agent(claude, "claude-bare", `egress = "claude-code"`, claudeCmd, "anthropic", `env = "ANTHROPIC_API_KEY"`),
		// No sandbox or approval flag: the scaffold's /etc/codex/config.toml
		// must be what lets the tool calls run.
		agent(codex, "codex", `harness = "codex"`, codexCmd+`, "`+harnessPrompt+`"`, "openai", ""),
		// The harness's files reach an nspawn cage too (bound, not copied).
		agent(codex, "codex-nspawn", `harness = "codex"`, codexCmd+`, "`+harnessPrompt+`"`, "openai", ""),
		agent(claude, "claude-nspawn", `harness = "claude-code"`, claudeCmd, "anthropic", ""),
		agent(codex, "codex-bare", `egress = "codex"`, codexCmd+`, "--dangerously-bypass-approvals-and-sandbox", "`+harnessPrompt+`"`, "openai", `env = "CODEX_API_KEY"`),
	}
}

// TestHarnessCLIs runs the real Claude Code and Codex CLIs (npm, pinned in
// systest.HarnessPackages) as caged agents against the fake model APIs of
// the test machine's internet. The fake model asks for two tool calls: a
// curl that tries to send the key to evil.example.org and a shell command
// that writes a file. One machine for all cases; the CLIs are copied in
// once, laid out as the tools store's current generation (/nix/tools).
func TestHarnessCLIs(t *testing.T) {
	testenv.RequireSystem(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	bins := systest.Binaries{
		"cagectl":     systest.BuildT(t, "./cmd/cagectl"),
		"cage-egress": systest.BuildT(t, "./cmd/cage-egress"),
	}
	cases := harnessCases()
	var cfg strings.Builder
	for _, c := range cases {
		cfg.WriteString(c.config + "\n")
	}
	m, in := harnessMachine(t, ctx, bins, cfg.String(), map[string]string{
		"/etc/nixcage/secrets/anthropic": realAnthropicKey,
		"/etc/nixcage/secrets/openai":    realOpenAIKey,
	})
	env := &cageEnv{m: m, in: in}
	for _, c := range cases {
		t.Run(c.agent, func(t *testing.T) { env.runHarness(t, ctx, c) })
	}
}

// harnessToolsT returns the cached real CLIs, or skips naming what is
// missing.
// harnessMachine is the booted machine the real-CLI tests share: the
// harness CLIs (skipping the test without them), the fake internet, the
// CLIs laid out as the tools store's current generation, and nixcage
// installed with config and secrets.
func harnessMachine(t *testing.T, ctx context.Context, bins systest.Binaries, config string, secrets map[string]string) (*systest.Machine, *systest.Internet) {
	t.Helper()
	tools := harnessToolsT(t, ctx)
	m := systest.BootT(t)
	in := systest.StartInternetT(t, m)
	start := time.Now()
	installTools(t, m, tools)
	t.Logf("CLIs copied into the machine in %s", time.Since(start).Round(time.Millisecond))
	installConfig(t, ctx, m, bins, config, secrets)
	return m, in
}

func harnessToolsT(t *testing.T, ctx context.Context) string {
	t.Helper()
	tools, err := systest.HarnessTools(ctx)
	if errors.Is(err, systest.ErrNoHarnessCLIs) {
		t.Skipf("real harness CLIs not available: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	return tools
}

// toolsTop is the store path installTools puts the CLIs under.
const toolsTop = "/var/lib/nixcage/store/nix/store/0000000000000000000000000000systest-harness-clis"

// removeTools undoes installTools, for a test that applies real releases
// after it (their generation 1 would be this unsigned one).
func removeTools(t *testing.T, m *systest.Machine) {
	t.Helper()
	m.MustRun(t, "rm", "-rf", "/var/lib/nixcage/store/current", "/var/lib/nixcage/store/generations/1", toolsTop)
}

// installTools lays the CLIs out as a tools store with one generation, the
// layout `cagectl apply` leaves (internal/store): ROOT/nix/store/<top>,
// generations/1/top -> ../../nix/store/<top>, current -> generations/1. It
// is not signed: this test is about the harnesses, store.md about releases.
func installTools(t *testing.T, m *systest.Machine, tools string) {
	t.Helper()
	top := toolsTop
	if err := os.MkdirAll(m.Path(top), 0o755); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("cp", "-r", "--reflink=auto", filepath.Join(tools, "bin"), m.Path(top)).CombinedOutput(); err != nil {
		t.Fatalf("copy CLIs: %v: %s", err, out)
	}
	m.MustRun(t, "sh", "-c", `set -e
cd /var/lib/nixcage/store
mkdir -p generations/1
ln -sfn ../../nix/store/`+filepath.Base(top)+` generations/1/top
ln -sfn generations/1 current`)
}

func (e *cageEnv) runHarness(t *testing.T, ctx context.Context, c harnessCase) {
	unit := systest.AgentUnit(c.agent)
	before, err := e.in.Requests()
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if _, err := e.m.Run(ctx, "systemctl", "start", unit); err != nil {
		t.Fatalf("start %s: %v\n%s", unit, err, e.unitDiag(c.agent))
	}
	st, err := e.m.WaitInactive(ctx, unit)
	if err != nil {
		t.Fatalf("%v\n%s", err, e.unitDiag(c.agent))
	}
	t.Logf("%s ran in %s", c.agent, time.Since(start).Round(time.Millisecond))
	journal, _ := e.m.Journal(ctx, unit)
	if st.Result != "success" {
		t.Fatalf("%s ended %s (result %s), want exit 0\n%s", c.cli, st.Sub, st.Result, e.unitDiag(c.agent))
	}
	if !strings.Contains(journal, upstream.FinalText) {
		t.Errorf("%s did not print the model's final answer:\n%s", c.cli, journal)
	}
	// The file the model asked for is in the workspace, owned by the cage.
	ws := paths.DefaultWorkspace(c.agent)
	if got, err := e.m.ReadFile(filepath.Join(ws, upstream.WroteFile)); err != nil || strings.TrimSpace(string(got)) != upstream.WroteContent {
		t.Errorf("workspace file %s = %q, %v; want %q", upstream.WroteFile, got, err, upstream.WroteContent)
	}

	// The cage held the placeholder: its environment file (what the agent
	// gets) has one of the key's length; the journal and the whole
	// workspace (the CLI's HOME: settings, sessions, logs) never the key.
	agentEnv, err := e.m.ReadFile(filepath.Join(paths.Runtime(c.agent), "agent.env"))
	if err != nil {
		t.Fatal(err)
	}
	placeholder := ""
	for _, l := range strings.Split(string(agentEnv), "\n") {
		if v, ok := strings.CutPrefix(l, c.keyVar+"="); ok {
			placeholder = strings.Trim(v, `"'`)
		}
	}
	if placeholder == "" || placeholder == c.realKey {
		t.Errorf("agent.env %s = %q; want a placeholder", c.keyVar, placeholder)
	}
	if strings.Contains(journal, c.realKey) || strings.Contains(string(agentEnv), c.realKey) {
		t.Errorf("the real key is in the agent's journal or environment")
	}
	if out, _ := e.m.Run(ctx, "grep", "-rlF", c.realKey, ws); strings.TrimSpace(out) != "" {
		t.Errorf("the real key is in the workspace: %s", out)
	}

	// The model API received the real key, in the header the CLI uses; the
	// refused host received nothing (no request, not even a DNS query).
	after, err := e.in.Requests()
	if err != nil {
		t.Fatal(err)
	}
	var turns int
	noted := false
	for _, r := range after[len(before):] {
		if strings.Contains(r.Host+r.SNI+r.Name, "evil.example.org") {
			t.Errorf("the refused host received %s %s %s", r.Kind, r.Method, r.Path)
		}
		if strings.Contains(r.Body, c.realKey) || strings.Contains(r.Path, c.realKey) {
			t.Errorf("the real key left in a request body or path: %s %s", r.Host, r.Path)
		}
		if r.Host != c.host || r.Method != "POST" {
			continue
		}
		turns++
		noted = noted || strings.Contains(r.Body, "You are running in a nixcage cage")
		got := strings.Join(r.Headers[c.keyHeader], ",")
		if !strings.Contains(got, c.realKey) {
			t.Errorf("%s %s carried %s = %q, want the real key", r.Method, r.Path, c.keyHeader, got)
		}
	}
	// With the scaffold, the CLI read the cage note (Claude Code's managed
	// memory, Codex's developer_instructions) and passed it to its model.
	if scaffold := !strings.HasSuffix(c.agent, "-bare"); noted != scaffold {
		t.Errorf("the cage note reached the model: %v, want %v", noted, scaffold)
	}
	if turns < 2 {
		t.Errorf("the model API saw %d POSTs, want a tool-use turn and a final turn", turns)
	}

	// The audit names every host the CLI tried; the leak is refused there.
	hosts := map[string][]string{}
	leakRefused := false
	for _, r := range e.auditRecords(t, c.agent) {
		h, _ := r["host"].(string)
		if h == "" {
			continue
		}
		d := fmt.Sprint(r["decision"])
		if p, _ := r["path"].(string); p != "" {
			d += " " + fmt.Sprint(r["method"]) + " " + p
		} else if rule, _ := r["rule"].(string); rule != "" {
			d += " (" + rule + ")"
		}
		hosts[h] = append(hosts[h], d)
		if h == "evil.example.org" && r["decision"] == "blocked" {
			leakRefused = true
		}
	}
	if !leakRefused {
		t.Errorf("the audit has no refusal of evil.example.org: %v", hosts)
	}
	if _, ok := hosts[c.host]; !ok {
		t.Errorf("the audit does not name the model API %s: %v", c.host, hosts)
	}
	names := make([]string, 0, len(hosts))
	for h := range hosts {
		names = append(names, h)
	}
	sort.Strings(names)
	for _, h := range names {
		b, _ := json.Marshal(summarize(hosts[h]))
		t.Logf("audit %s: %s %s", c.agent, h, b)
	}
}

// summarize counts repeated audit lines.
func summarize(lines []string) map[string]int {
	out := map[string]int{}
	for _, l := range lines {
		out[l]++
	}
	return out
}
