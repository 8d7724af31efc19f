# want: 12:14 Credential host not inspected
egress_policy "p" {
  allow = ["api.example.com"]
}
agent "a" {
  backend = "service"
  command = ["/bin/true"]
  egress  = "p"
  secret "k" {
    source = "/run/secrets/k"
    env    = "K"
    hosts  = ["api.example.com"]
  }
}
