# want: 4:13 Relative command
agent "a" {
  backend = "service"
  command = ["claude", "--help"]
}
