# want: 4:11 Conflicting host rules
egress_policy "p" {
  allow = ["api.example.com"]
  deny  = ["api.example.com"]
}
