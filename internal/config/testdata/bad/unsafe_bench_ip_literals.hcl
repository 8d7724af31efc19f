# want: 4:30 Bench-only setting
egress_policy "p" {
  allow = ["api.example.com"]
  unsafe_bench_ip_literals = true
}
agent "a" {
  command = ["/bin/true"]
  egress  = "p"
}
