package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"sort"
	"strings"

	"github.com/nixcage/nixcage/internal/version"
)

// errHelp ends a command run only to capture its flags.
var errHelp = errors.New("help requested")

// helpText is a command's long description and examples. Every command has
// one (TestEveryCommandHasHelp); --help, the man page and the completions
// are all written from it and the command's own FlagSet.
type helpText struct {
	long     string
	examples []string
}

var help = map[string]helpText{
	"apply": {
		long: "Through caged (admin role) unless --offline: the release is verified (signatures against the store's keys, generation, expiry, channel, every NAR re-hashed) before it becomes the current generation. Running agents keep their generation until restarted. A local DIR is opened by cagectl and handed to caged as a descriptor, so any directory the caller can read works (caged itself runs with ProtectHome= and PrivateTmp=). On a terminal a progress line is drawn; -v prints how long each phase took.",
		examples: []string{
			"cagectl apply /var/lib/nixcage/incoming/release-42",
			"cagectl apply https://releases.example.com/stable/42",
			"cagectl apply ./release --offline --store /var/lib/nixcage/store --channel stable --key /etc/nixcage/release.pub",
		},
	},
	"apply-config": {
		long: "The one-step configuration change on a host without NixOS (on NixOS: nixos-rebuild switch). The files are validated here, then sent to caged as bytes (so any path works), validated again, and planned: agents added, changed and removed, files written and removed, units stopped, restarted and started. Without --dry-run caged then installs exactly that: removed agents are stopped and their units pruned, systemd is reloaded, exactly the running units that read a changed file are restarted, and caged's status shows the new agents at once. Needs the admin role over all agents.",
		examples: []string{
			"cagectl apply-config /etc/nixcage/cage.hcl --dry-run",
			"cagectl apply-config /etc/nixcage/cage.hcl",
			"cagectl apply-config base.hcl agents.hcl --json",
		},
	},
	"audit": {
		long: "One line per egress decision of the agent's gateway: time, decision, method, host:port and path, reason and rule. Root reads the JSONL log directly; others ask caged (viewer role).",
		examples: []string{
			"cagectl audit claude",
			"cagectl audit claude -n 100 --json",
			"cagectl audit claude --follow",
			"cagectl audit claude --distinct --decision blocked",
		},
	},
	"policy suggest": {
		long: "Reads the agent's audit (root reads the log, others ask caged: viewer role) and prints an egress_policy block whose allow list and ports would have let through what the host patterns and ports refused, each entry with its counts and first/last time, and a WARNING comment on wildcards, upload-heavy hosts and hosts that were sent a placeholder. Never suggested (listed as comments): IP addresses, names that resolved to private, loopback or metadata addresses, names a deny entry of the agent's policy or of a shipped policy covers, special-use names. The output passes `cagectl validate`; merge its entries into the agent's policy after review. See docs/grants.md.",
		examples: []string{
			"cagectl policy suggest claude",
			"cagectl policy suggest claude --since 2h > suggested.hcl && cagectl validate suggested.hcl",
		},
	},
	"allow": {
		long: "Through caged: an operator over the agent may grant an exact host name, an admin over it also a wildcard (*.example.com). Without :PORT the grant covers the default ports (443 for CONNECT, 80 for plain HTTP) and the policy's ports; with one, that port only. caged writes the agent's grants file (/run/nixcage/cage/AGENT/grants.json) atomically; the running gateway reads it within a second, with no restart and no open tunnel dropped, and enforces the expiry itself. A grant never beats a deny entry nor the address rules (private, loopback, metadata). Decisions it allows are audited with rule grant:ID. See docs/grants.md.",
		examples: []string{
			"cagectl allow claude registry.npmjs.org --for 2h --reason \"npm install\"",
			"cagectl allow claude api.example.com:8443 --for 30m",
		},
	},
	"approvals": {
		long:     "Requests outside an agent's policy that wait for an operator (agents with an approval { wait = \"30s\" } block): id, agent, host and port, method and path where the gateway saw them (a CONNECT has no path), when they started waiting and how long is left. Viewer role; without AGENT every agent you may view. caged also announces each one (D-Bus signal ApprovalPending, journal event approval-pending). See docs/grants.md.",
		examples: []string{"cagectl approvals", "cagectl approvals claude --json"},
	},
	"approve": {
		long:     "Decides a waiting request (operator over its agent): once lets it (and any request waiting for the same host and port) through; host also grants the host for the default grant time (cagectl grants list shows it); deny refuses it with a 403 saying it was denied, and the same host is refused without asking for a minute. The gateway applies the decision within a fraction of a second; the audit names the approver (rule approval:ID). See docs/grants.md.",
		examples: []string{"cagectl approve a-3f2a9c01b7de once", "cagectl approve a-3f2a9c01b7de host", "cagectl approve a-3f2a9c01b7de deny"},
	},
	"grants list": {
		long:     "The grants in force (expired ones are gone), of one agent or of every agent you may view (viewer role); also shown by cagectl status.",
		examples: []string{"cagectl grants list", "cagectl grants list claude --json"},
	},
	"grants revoke": {
		long:     "Ends a grant now (operator over its agent). Tunnels opened under it stay open until they close; new requests are refused.",
		examples: []string{"cagectl grants revoke g-3f2a9c01b7de"},
	},
	"grants promote": {
		long:     "Prints the change to the agent's egress policy that makes a grant permanent; nothing is changed. Apply the edited config, then revoke the grant.",
		examples: []string{"cagectl grants promote g-3f2a9c01b7de"},
	},
	"completion": {
		long: "Completion scripts are generated from the command table: commands, each command's flags, and agent names (asked of caged with `cagectl status --names` when completing).",
		examples: []string{
			"source <(cagectl completion bash)",
			"cagectl completion zsh > \"${fpath[1]}/_cagectl\"",
			"cagectl completion fish > ~/.config/fish/completions/cagectl.fish",
		},
	},
	"events": {
		long:     "A live stream of caged's D-Bus signals: agent state changes, flagged and blocked egress decisions, releases applied, quarantines, kills, reconciles. Ctrl-C ends it. Exits 4 when caged is not running.",
		examples: []string{"cagectl events", "cagectl events --json | jq ."},
	},
	"generations": {
		long:     "Reads the store directly (it is world-readable); needs no daemon and changes nothing. The current generation is marked with *.",
		examples: []string{"cagectl generations", "cagectl generations --json"},
	},
	"version": {
		long:     "The version stamped into the binary at build time (-ldflags -X github.com/nixcage/nixcage/internal/version.Version=...); caged's status shows its own.",
		examples: []string{"cagectl --version", "caged --version"},
	},
	"help": {
		long:     "Without a command: every command with its summary. With one: that command's help, as --help prints it.",
		examples: []string{"cagectl help", "cagectl help apply-config"},
	},
	"control sign": {
		long: "Builds a control command (docs/fleet.md, \"Control commands\"): action, target host (its control.host_id, or '*') and agent (or '*'), the host name to ban for ban-host/unban-host, a reason, issued now, expires after --expires (at most 24h), a random 128-bit nonce. It is checked as a host would, then signed over its canonical bytes with every --key. Hosts accept it only with control.threshold valid signatures by their control.keys (not the store's release keys). Put the file on the channel or run cagectl control apply on the host.",
		examples: []string{
			"cagectl control sign --key /root/keys/ops.key --action quarantine --host web-01 --agent claude --reason 'exfiltration seen in audit' --out q.json",
			"cagectl control sign --key ops.key --key sec.key --action ban-host --host '*' --agent '*' --ban evil.example.com --expires 2h --out ban.json",
		},
	},
	"control cosign": {
		long:     "Adds a signature by each --key to a signed command, for a control.threshold above 1: the command's bytes are unchanged, so every signer signs the same canonical command. A key that already signed is refused.",
		examples: []string{"cagectl control cosign ban.json --key /root/keys/sec.key"},
	},
	"control apply": {
		long:     "Sends the file's bytes to caged (admin role, as for apply), which checks the signatures against control.keys and control.threshold, the action, the target host and agent, issued/expires (5 minutes of clock skew allowed), and the replay cache, then executes the command at most once. Every outcome is an acknowledgement (executed, failed, rejected, duplicate, expired, with the reason), written to the ack file, the journal and the ack URL; it is printed here. The exit status is 0 only when the command was executed.",
		examples: []string{"cagectl control apply q.json", "cagectl control apply ban.json --json"},
	},
	"control acks": {
		long:     "The acknowledgements caged recorded for control commands, newest first: time, status, action, target, command hash (sha256 of its canonical bytes), source (file or channel) and reason. Viewer role over all agents. --json prints the ack file's records.",
		examples: []string{"cagectl control acks", "cagectl control acks -n 0 --json"},
	},
	"key generate": {
		long:     "Writes PREFIX.key (the private key, mode 0600, never overwritten) and PREFIX.pub. Put the .pub file in the store block's keys (release keys) or the control block's keys (control-command keys); keep the .key file off the appliance, and keep the two sets apart.",
		examples: []string{"cagectl key generate --out /root/keys/release", "cagectl key generate --out ci-signer --type ecdsa-p256"},
	},
	"key rotate": {
		long:     "Signs key set version N with the current root keys: the release keys it trusts (keys left out are revoked), how many must sign a release, and the root keys that sign the next set. Put DIR/keys/N.json and its .sig next to releases; caged accepts a set only if the previous root vouches for it.",
		examples: []string{"cagectl key rotate --root-key /root/keys/root.key --version 2 --release-key ci.pub --release-key ops.pub --threshold 1 --out /srv/releases"},
	},
	"kill": {
		long:     "SIGKILL to every process of the agent's cgroup at once, logged by caged at warning level with the caller and signalled as AgentKilled. With Restart=on-failure systemd starts the agent again; quarantine it to keep it down. Operator role.",
		examples: []string{"cagectl kill claude"},
	},
	"logs": {
		long:     "journalctl for the agent, its gateway, its prepare step and its namespace unit, interleaved. Root reads the journal itself; anyone else asks caged (viewer role for the agent), and if caged refuses or is down, reads the journal with their own rights (members of systemd-journal or adm see everything). Lines from caged are escaped for the terminal.",
		examples: []string{"cagectl logs claude", "cagectl logs claude -f", "cagectl logs claude -n 500"},
	},
	"quarantine": {
		long:     "Marks the agent quarantined (systemd itself then refuses to start it), freezes or stops it, cuts its egress, and copies its workspace, audit log and status into an evidence directory with a SHA256SUMS manifest. It stays down, across caged restarts and reboots, until `cagectl release`. Operator role.",
		examples: []string{"cagectl quarantine claude --reason 'exfiltration attempt'", "cd /var/lib/nixcage/evidence/claude-* && sha256sum -c SHA256SUMS"},
	},
	"release": {
		long:     "Removes the quarantine mark (logged with who released it). The agent stays stopped until started. For releases of the tool store, see `cagectl release create` and `cagectl release verify`.",
		examples: []string{"cagectl release claude && cagectl start claude"},
	},
	"release create": {
		long:     "Copies a closure from the local Nix store into a Nix binary cache directory and signs a manifest naming the channel, generation, expiry, top-level path and every closure member. Generations must increase on a channel.",
		examples: []string{"cagectl release create $(nix-build -A tools) --key /root/keys/release.key --channel stable --generation 42 --expires 30d --out /srv/releases/42"},
	},
	"release publish": {
		long:     "Verifies a release as every host will (signatures against the given keys, every NAR re-hashed), then lays it out in a channel directory that a static web server serves: the closure's cache files first, releases/<generation>/ next, channel.json last (atomically replaced). Refuses a generation not above the channel's and a cache file that exists with other bytes. caged polls the channel (docs/fleet.md).",
		examples: []string{"cagectl release publish /tmp/rel43 --to /srv/www/nixcage/stable --key release.pub"},
	},
	"release verify": {
		long:     "Everything caged checks before accepting a release, offline: signatures against the given keys (k-of-n with --threshold), channel, generation, expiry, and every NAR re-hashed.",
		examples: []string{"cagectl release verify /srv/releases/42 --key release.pub --channel stable"},
	},
	"reload": {
		long:     "caged re-reads its --config file and reconciles. An invalid file is refused and the running configuration kept. To change the configuration in one step, use apply-config. Admin role; `systemctl reload nixcage-caged` does the same.",
		examples: []string{"cagectl reload"},
	},
	"render": {
		long:     "Writes the units, the gateway documents, the D-Bus policy, tmpfiles rules and the canonical config into DIR, laid out like /etc, plus nixcage/rendered.json (what was written and with which options). NixOS calls this in a derivation; on other hosts install the whole tree (--out /etc) or, with --caged-units render, only caged's unit, the bus policy and the config.",
		examples: []string{"cagectl render cage.hcl --out /etc", "cagectl render cage.hcl --out /root/nixcage-render --caged-units render"},
	},
	"restart": {
		long:     "Restarts the agent's whole cage: the prepare step re-runs (a changed secret source or placeholder is picked up), the gateway re-reads its credentials, and the agent starts again, also if it was down. Refused while quarantined. Operator role.",
		examples: []string{"cagectl restart claude", "cagectl restart claude codex"},
	},
	"rollback": {
		long:     "Switches the store back to an older kept generation, through caged (admin role) unless --offline. Logged and signalled; releases must still be above the highest generation ever accepted.",
		examples: []string{"cagectl rollback", "cagectl rollback --to 41", "cagectl rollback --offline --store /var/lib/nixcage/store"},
	},
	"run": {
		long:     "A throw-away cage with a declared agent's walls (network namespace, gateway, sandbox), made by caged at run time and removed on exit. The terminal crosses the bus as file descriptors; the current directory is the workspace unless --workspace or --no-workspace. Egress follows --policy or --allow; --secret FILEs are read by cagectl and held by the gateway, the cage sees placeholders. Operator role.",
		examples: []string{"cagectl run --policy claude-code --secret anthropic:ANTHROPIC_API_KEY=/root/keys/anthropic -- claude", "cagectl run --allow github.com --no-workspace -- git ls-remote https://github.com/nixcage/nixcage"},
	},
	"say": {
		long:     "One turn of the agent's harness, run by caged inside the agent's cage with the agent's walls (its network namespace, gateway, placeholders, sandbox), resuming the previous conversation (claude -p --continue, codex exec resume --last, or the agent's turn_command). The text goes to the harness on its stdin, never through a shell; the reply (its stdout) is printed. Turns of one agent run one at a time, others wait (at most 8). The exit status is the harness's (124: stopped at the agent's turn_timeout). Flags go before AGENT: every word after it is text. Operator role over the agent. See docs/relay.md.",
		examples: []string{"cagectl say claude what did you change in the last commit?", "git diff | cagectl say claude -"},
	},
	"get": {
		long:     "A regular file from the agent's workspace, PATH relative to it; absolute paths, '..', and symlinks out of the workspace are refused, and files over --max (at most 50 MiB). caged hands over a sealed copy; -o FILE is created, never overwritten. Operator role over the agent. See docs/relay.md.",
		examples: []string{"cagectl get claude notes/report.md", "cagectl get claude out/build.log -o build.log"},
	},
	"put": {
		long:     "Saves FILE into the agent's workspace as inbox/NAME, owned by the agent; an existing file is never overwritten (NAME-1, NAME-2, ... is taken instead), and the file appears complete or not at all. Names with '/', a leading '.', control characters or over 200 bytes are refused; files over 50 MiB too. Prints the path the agent sees. Operator role over the agent. See docs/relay.md.",
		examples: []string{"cagectl put claude ./spec.pdf", "cagectl put claude /tmp/x.csv --name data.csv"},
	},
	"attach": {
		long:     "Connects this terminal to the console caged holds for an interactive agent (interactive = true): what it printed while nobody was attached comes first, then your keys go to it and your window size follows. Ctrl-] detaches; the agent goes on and a later attach comes back. One terminal at a time: a new attach takes the console over. Operator role over the agent.",
		examples: []string{"cagectl attach claude"},
	},
	"shell": {
		long:     "Opens a shell (default /bin/sh, or COMMAND after --) inside a running cage, for debugging: as the agent's user, in its network namespace (no route), with its mounts, capabilities (none), seccomp filters and limits, never more. A terminal on stdin gets a real pty (window size, Ctrl-C), pipes otherwise; the shell's exit status is cagectl's. caged starts it as a transient unit of its own; opening and closing are events (shell-opened, shell-closed) naming who ran what. Service and nspawn cages; not podman. Admin role over the agent.",
		examples: []string{"cagectl shell claude", "cagectl shell claude -- sh -c 'id; ls -la /workspace'"},
	},
	"store binds": {
		long:     "What an nspawn or podman cage start binds from the store: every path resolved inside the store, any link out of it refused. Prints SRC:DST lines (the default) or nspawn/podman options. Reads only. (Service cages resolve the store inside the cage instead: docs/store.md.)",
		examples: []string{"cagectl store binds", "cagectl store binds --for nspawn"},
	},
	"secret rotate": {
		long:     "After you changed a secret's source file: the gateway is restarted and re-reads it, and the agent keeps running with its placeholder if the new value fits it (same length and provider prefix). Otherwise, or with --new-placeholder, the prepare step makes a new placeholder and the cage is restarted with it. NAME defaults to all of the agent's secrets. Operator role.",
		examples: []string{"cagectl secret rotate claude anthropic", "cagectl secret rotate claude --new-placeholder"},
	},
	"start": {
		long:     "Starts the agent (its namespace, prepare step and gateway sockets come with it). Refused while quarantined; a missing secret source is named. Operator role.",
		examples: []string{"cagectl start claude", "cagectl start claude codex"},
	},
	"status": {
		long:     "caged's version, unit mode and store generation, then one row per agent: backend, state, gateway state, store generation, egress decisions since caged started, notes. Readable by every local user.",
		examples: []string{"cagectl status", "cagectl status claude --json", "cagectl status --names"},
	},
	"stop": {
		long:     "Stops the agent. An autostart agent stays down until the next reload or caged restart. Operator role.",
		examples: []string{"cagectl stop claude"},
	},
	"store gc": {
		long:     "Removes generations beyond --keep (never the current one) and store paths no kept generation references. Acts on the store directly: run as root with --offline.",
		examples: []string{"cagectl store gc --offline --keep 2"},
	},
	"store verify": {
		long:     "Re-hashes every path of the current generation (all kept ones with --all) against its manifest; with --key the manifests' signatures are checked too. Reads only.",
		examples: []string{"cagectl store verify", "cagectl store verify --all --key /etc/nixcage/release.pub"},
	},
	"validate": {
		long:     "Checks configuration files as one configuration; every error names file:line:col and the fix. With --host-checks it also checks this host for what the config names (secret sources exist and are not empty, store keys, the nspawn or podman program) and names each missing piece with its fix. Exit status 1 if invalid or a host check fails.",
		examples: []string{"cagectl validate cage.hcl", "cagectl validate base.hcl agents.hcl", "cagectl validate cage.hcl --host-checks"},
	},
}

func init() {
	register(&command{name: "help", args: "[COMMAND]", short: "show the commands, or one command's help", run: runHelp})
	register(&command{name: "version", short: "print cagectl's version (also --version)", run: func(_ context.Context, env *Env, _ []string) error {
		fmt.Fprintln(env.Out, "cagectl", version.Version)
		return nil
	}})
}

// flagsOf returns the flags c defines: c runs with --help and a cancelled
// context (so nothing it might reach for is done), and its FlagSet is
// captured before parsing stops it.
func flagsOf(ctx context.Context, c *command) []*flag.Flag {
	var sets []*flag.FlagSet
	env := &Env{Stdio: Stdio{In: strings.NewReader(""), Out: io.Discard, Err: io.Discard}, Getenv: func(string) string { return "" },
		capture: func(fs *flag.FlagSet) { sets = append(sets, fs) }}
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	_ = c.run(cctx, env, []string{"--help"})
	var out []*flag.Flag
	for _, fs := range sets {
		fs.VisitAll(func(f *flag.Flag) { out = append(out, f) })
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// flagLine is "--name VALUE" as operators write it.
func flagLine(f *flag.Flag) (string, string) {
	name, usage := flag.UnquoteUsage(f)
	dash := "--"
	if len(f.Name) == 1 {
		dash = "-"
	}
	s := dash + f.Name
	if name != "" {
		s += " " + name
	}
	if f.DefValue != "" && f.DefValue != "false" && f.DefValue != "0" && f.DefValue != "[]" {
		usage += fmt.Sprintf(" (default %q)", f.DefValue)
	}
	return s, usage
}

func printHelp(ctx context.Context, env *Env, c *command) {
	w := env.Out
	fmt.Fprintf(w, "usage: cagectl %s\n\n%s.\n", strings.TrimSpace(c.name+" "+c.args), capitalize(c.short))
	h := help[c.name]
	if h.long != "" {
		fmt.Fprintf(w, "\n%s\n", wrap(h.long, 78))
	}
	if fl := flagsOf(ctx, c); len(fl) > 0 {
		fmt.Fprintln(w, "\nflags:")
		for _, f := range fl {
			s, u := flagLine(f)
			fmt.Fprintf(w, "  %-24s %s\n", s, u)
		}
	}
	if len(h.examples) > 0 {
		fmt.Fprintln(w, "\nexamples:")
		for _, e := range h.examples {
			fmt.Fprintf(w, "  %s\n", e)
		}
	}
}

func runHelp(ctx context.Context, env *Env, args []string) error {
	if len(args) == 0 {
		printUsage(env.Out)
		return nil
	}
	c, rest := lookup(args)
	if c == nil || len(rest) > 0 {
		if subs := subcommands(args[0]); len(subs) > 0 && len(args) == 1 {
			printGroup(env.Out, args[0], subs)
			return nil
		}
		return usageError("no command %q; run 'cagectl help' for the list", strings.Join(args, " "))
	}
	printHelp(ctx, env, c)
	return nil
}

func capitalize(s string) string {
	if s == "" {
		return s
	}
	return strings.ToUpper(s[:1]) + s[1:]
}

// wrap breaks text into lines of at most width columns.
func wrap(text string, width int) string {
	var b strings.Builder
	n := 0
	for _, w := range strings.Fields(text) {
		if n > 0 && n+1+len(w) > width {
			b.WriteByte('\n')
			n = 0
		} else if n > 0 {
			b.WriteByte(' ')
			n++
		}
		b.WriteString(w)
		n += len(w)
	}
	return b.String()
}
