# want: 10:15 Shared workspace
agent "a" {
  backend   = "service"
  command   = ["/bin/true"]
  workspace = "/var/lib/w"
}
agent "b" {
  backend   = "service"
  command   = ["/bin/true"]
  workspace = "/var/lib/w"
}
