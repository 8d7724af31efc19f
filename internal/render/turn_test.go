package render

import (
	"slices"
	"strings"
	"testing"

	"github.com/nixcage/nixcage/internal/config"
	"github.com/nixcage/nixcage/internal/paths"
)

// TestTurnHasTheAgentsWalls: a turn's drop-in is the agent's own unit line
// for line, but for exactly the lines that make it a turn (its command, run
// once, its own unit and container name). Any other difference would be a
// wall the turn lacks or gains.
func TestTurnHasTheAgentsWalls(t *testing.T) {
	src := `
agent "a" {
  backend      = "BACKEND"
  command      = ["/bin/sleep", "infinity"]
  harness      = "claude-code"
  interactive  = INTERACTIVE
  turn_timeout = "90s"
  secret "anthropic" { source = "/etc/nixcage/secrets/anthropic" }
}`
	argv := []string{"/nix/tools/bin/claude", "-p", "--continue"}
	for _, backend := range []string{config.BackendService, config.BackendNspawn, config.BackendPodman} {
		t.Run(backend, func(t *testing.T) {
			interactive := "false"
			if backend != config.BackendPodman {
				interactive = "true" // a turn is never on the agent's terminal
			}
			cfg, diags := config.NewLoader().Load(config.Source{Name: "t.hcl", Data: []byte(strings.NewReplacer("BACKEND", backend, "INTERACTIVE", interactive).Replace(src))})
			if diags.HasErrors() {
				t.Fatal(diags)
			}
			if got := cfg.Agent("a").TurnArgv(); !slices.Equal(got, argv) {
				t.Fatalf("claude-code's turn command = %q, want %q", got, argv)
			}
			files, err := Render(cfg, DefaultOptions())
			if err != nil {
				t.Fatal(err)
			}
			var agent string
			for _, f := range files {
				if f.Path == "systemd/system/"+paths.Instance(paths.AgentTemplate, "a") {
					agent = string(f.Data)
				}
			}
			turn, err := RenderTurn(cfg, "a", DefaultOptions(), argv)
			if err != nil {
				t.Fatal(err)
			}
			if turn.Path != "run/systemd/system/nixcage-turn@a.service.d/50-cage.conf" {
				t.Fatalf("drop-in path %s", turn.Path)
			}
			onlyAgent, onlyTurn := lineDiff(agent, string(turn.Data))
			// What may differ, as substrings of the differing lines.
			allowAgent := []string{"Description=", "Restart=on-failure", "RestartSec=", "PartOf=", "ExecStart=", "ExecStopPost=",
				"StandardInput=tty", "StandardOutput=tty", "StandardError=tty", "TTYPath=", "TTYReset=", "TTYVHangup=", "ConditionPathExists=/run/nixcage/console/",
				"nixcage-agent@a.service:/sys/fs/cgroup",
				"Environment=TERM=xterm-256color"} // an interactive agent's terminal
			allowTurn := []string{"Description=", "Restart=no", "RemainAfterExit=yes", "RuntimeMaxSec=150", "ExecStart=", "ExecStopPost=",
				"nixcage-turn@a.service:/sys/fs/cgroup",
				"TemporaryFileSystem=/dev/pts:ro"} // no terminal of its own, unlike an interactive agent
			check := func(lines, allow []string, side string) {
				for _, l := range lines {
					if !slices.ContainsFunc(allow, func(a string) bool { return strings.Contains(l, a) }) {
						t.Errorf("only in the %s unit: %q", side, l)
					}
				}
			}
			check(onlyAgent, allowAgent, "agent's")
			check(onlyTurn, allowTurn, "turn's")
			// The command lines differ only in the command and the names.
			exec := func(unit string) string {
				for _, l := range strings.Split(unit, "\n") {
					if strings.HasPrefix(l, "ExecStart=") {
						return l
					}
				}
				return ""
			}
			want := strings.NewReplacer("/bin/sleep infinity", "/nix/tools/bin/claude -p --continue",
				"--machine=nixcage-a ", "--machine=nixcage-a-turn ", "--name nixcage-a ", "--name nixcage-a-turn ",
				"--console=interactive", "--console=pipe", "--setenv=TERM=xterm-256color ", "", "nixcage-a --rm", "nixcage-a --interactive --rm").Replace(exec(agent))
			if got := exec(string(turn.Data)); got != want {
				t.Errorf("turn ExecStart:\n%s\nwant (the agent's with the turn command):\n%s", got, want)
			}
		})
	}
}

// lineDiff returns the lines only in a and only in b (as multisets).
func lineDiff(a, b string) (onlyA, onlyB []string) {
	count := map[string]int{}
	for _, l := range strings.Split(a, "\n") {
		count[l]++
	}
	for _, l := range strings.Split(b, "\n") {
		if count[l] > 0 {
			count[l]--
			continue
		}
		onlyB = append(onlyB, l)
	}
	for l, n := range count {
		for ; n > 0; n-- {
			onlyA = append(onlyA, l)
		}
	}
	return onlyA, onlyB
}
