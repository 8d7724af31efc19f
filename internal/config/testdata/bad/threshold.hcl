# want: 5:15 Invalid signature threshold
store {
  channel   = "stable"
  keys      = ["/etc/nixcage/a.pub"]
  threshold = 2
}
