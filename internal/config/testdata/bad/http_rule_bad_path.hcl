# want: 6:15 Invalid path pattern
egress_policy "p" {
  allow   = ["api.example.com"]
  inspect = ["api.example.com"]
  http_rule "telemetry" {
    paths   = ["/api/*/batch"]
    hosts   = ["api.example.com"]
    action  = "deny"
  }
}
