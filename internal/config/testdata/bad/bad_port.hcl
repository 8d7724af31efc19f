# want: 3:11 Invalid port
egress_policy "p" {
  ports = [0]
}
