# want: 6:11 Duplicate agent
agent "a" {
  backend = "service"
  command = ["/bin/true"]
}
agent "a" {
  backend = "service"
  command = ["/bin/true"]
}
