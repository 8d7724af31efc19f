# want: 5:13 Unknown egress policy
agent "a" {
  backend = "service"
  command = ["/bin/true"]
  egress  = "nope"
}
