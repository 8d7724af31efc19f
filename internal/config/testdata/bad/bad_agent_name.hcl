# want: 2:16 Invalid agent name
agent "../etc" {
  backend = "service"
  command = ["/bin/true"]
}
