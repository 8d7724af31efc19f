# Claude Code in a cage, using the shipped "claude-code" policy. The secret
# takes its hosts and header (x-api-key) from the policy's credential block.
agent "claude" {
  backend = "service"
  command = ["/nix/tools/bin/claude", "--print", "summarize README.md"]
  egress  = "claude-code"

  secret "anthropic" {
    source = "/run/secrets/anthropic-api-key"
    env    = "ANTHROPIC_API_KEY"
  }

  resources {
    memory = "4G"
    cpu    = "200%"
    tasks  = 1024
  }
}

account "admins" {
  group = "wheel"
  role  = "admin"
}
