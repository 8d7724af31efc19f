# Claude Code in a cage, with the shipped "claude-code" harness
# (docs/harnesses.md): the "claude-code" policy, the key in ANTHROPIC_API_KEY
# (its hosts and header, x-api-key, from the policy's credential block), the
# environment that turns off non-essential traffic and the updater, and the
# cage note as Claude Code's managed memory.
agent "claude" {
  backend = "service"
  harness = "claude-code"
  command = ["/nix/tools/bin/claude", "--print", "--permission-mode", "bypassPermissions", "summarize README.md"]

  secret "anthropic" {
    source = "/run/secrets/anthropic-api-key"
  }

  resources {
    memory = "4G"
    cpu    = "200%"
    tasks  = 1024
  }
}

# Codex, with the shipped "codex" harness: key in CODEX_API_KEY, Codex's own
# sandbox off (the cage is the sandbox) through /etc/codex/config.toml.
agent "codex" {
  backend = "service"
  harness = "codex"
  command = ["/nix/tools/bin/codex", "exec", "--skip-git-repo-check", "summarize README.md"]

  secret "openai" {
    source = "/run/secrets/openai-api-key"
  }
}

account "admins" {
  group = "wheel"
  role  = "admin"
}
