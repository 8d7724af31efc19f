# want: 5:12 Duplicate approval block
agent "a" {
  command = ["/bin/true"]
  approval {}
  approval {}
}
