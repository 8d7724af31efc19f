# want: 4:13 Harness without its key
agent "coder" {
  backend = "service"
  harness = "codex"
  command = ["/nix/tools/bin/codex", "exec", "hello"]
}
