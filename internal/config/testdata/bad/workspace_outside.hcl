# want: 5:15 Workspace outside /var/lib
agent "a" {
  backend   = "service"
  command   = ["/bin/true"]
  workspace = "/home/a/work"
}
