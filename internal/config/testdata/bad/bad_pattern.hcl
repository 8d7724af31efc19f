# want: 3:11 Invalid host pattern
egress_policy "p" {
  allow = ["api.*.com"]
}
