# want: 4:15 learn_for without learn
agent "a" {
  command   = ["/bin/true"]
  learn_for = "10m"
}
