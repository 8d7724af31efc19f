# want: 5:15 Invalid learn_for
agent "a" {
  command   = ["/bin/true"]
  learn     = true
  learn_for = "30d"
}
