# want: 8:14 Invalid channel interval
store {
  channel = "stable"
  keys    = ["/etc/nixcage/a.pub"]
}
channel {
  url      = "https://releases.example.org/stable/"
  interval = "10ms"
}
