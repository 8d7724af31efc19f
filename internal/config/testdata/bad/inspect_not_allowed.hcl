# want: 4:13 Inspected host not allowed
egress_policy "p" {
  allow   = ["api.example.com"]
  inspect = ["other.example.com"]
}
