# want: 6:19 Secret without a variable
agent "coder" {
  backend = "service"
  harness = "claude-code"
  command = ["/nix/tools/bin/claude", "-p", "hello"]
  secret "github" {
    source = "/run/secrets/github"
    hosts  = ["api.github.com"]
  }
  secret "anthropic" { source = "/run/secrets/anthropic" }
}
