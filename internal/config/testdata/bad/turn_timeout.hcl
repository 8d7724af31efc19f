# want: 4:18 Invalid turn_timeout
agent "a" {
  command      = ["/bin/true"]
  turn_timeout = "0s"
}
