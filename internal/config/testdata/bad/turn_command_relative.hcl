# want: 4:18 Relative turn_command
agent "a" {
  command      = ["/bin/true"]
  turn_command = ["claude", "-p"]
}
