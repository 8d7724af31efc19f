# want: 4:14 Real credential values are always blocked
egress_policy "p" {
  inspector "real_values" {
    action = "flag"
  }
}
