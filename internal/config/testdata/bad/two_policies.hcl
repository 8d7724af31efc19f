# want: 5:13 Two egress policies
agent "a" {
  backend = "service"
  command = ["/bin/true"]
  egress  = "none"
  egress_policy {
    allow = ["x.example.com"]
  }
}
