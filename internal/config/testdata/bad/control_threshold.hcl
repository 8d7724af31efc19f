# want: 4:15 Invalid signature threshold
control {
  keys      = ["/etc/nixcage/control/ops-1.pub"]
  threshold = 2
}
