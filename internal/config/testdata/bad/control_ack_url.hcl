# want: 4:13 Invalid ack URL
control {
  keys    = ["/etc/nixcage/control/ops-1.pub"]
  ack_url = "ftp://acks.example.com/"
}
