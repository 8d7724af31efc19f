# want: 4:13 Unknown harness
agent "coder" {
  backend = "service"
  harness = "claude"
  command = ["/nix/tools/bin/claude", "-p", "hello"]
}
