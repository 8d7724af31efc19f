# want: 6:15 http_rule on a host that is not intercepted
egress_policy "p" {
  allow   = ["api.example.com", "registry.example.org"]
  inspect = ["api.example.com"]
  http_rule "read-only" {
    hosts   = ["registry.example.org"]
    methods = ["GET"]
    action  = "allow"
  }
}
