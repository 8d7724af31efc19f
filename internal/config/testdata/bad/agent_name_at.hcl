# want: 2:17 Invalid agent name
agent "a@b.svc" {
  backend = "service"
  command = ["/bin/true"]
}
