# want: 3:11 Invalid host pattern
egress_policy "p" {
  allow = ["api.example.com", "203.0.113.10"]
}
agent "a" {
  command = ["/bin/true"]
  egress  = "p"
}
