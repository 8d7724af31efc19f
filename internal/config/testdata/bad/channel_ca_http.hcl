# want: 8:13 CA file without https
store {
  channel = "stable"
  keys    = ["/etc/nixcage/a.pub"]
}
channel {
  url     = "http://releases.example.org/stable/"
  ca_file = "/etc/nixcage/ca.pem"
}
