# want: 3:13 Invalid host id
control {
  host_id = "Web_01"
  keys    = ["/etc/nixcage/control/ops-1.pub"]
}
