# want: 13:14 Credential host not allowed
egress_policy "p" {
  allow   = ["api.example.com"]
  inspect = ["api.example.com"]
}
agent "a" {
  backend = "service"
  command = ["/bin/true"]
  egress  = "p"
  secret "k" {
    source = "/run/secrets/k"
    env    = "K"
    hosts  = ["evil.example.net"]
  }
}
