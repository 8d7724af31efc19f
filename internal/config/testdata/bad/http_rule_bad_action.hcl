# want: 7:15 Unknown http_rule action
egress_policy "p" {
  allow   = ["api.example.com"]
  inspect = ["api.example.com"]
  http_rule "telemetry" {
    hosts   = ["api.example.com"]
    action  = "block"
  }
}
