# want: 7:9 Invalid channel URL
store {
  channel = "stable"
  keys    = ["/etc/nixcage/a.pub"]
}
channel {
  url = "ftp://releases.example.org/stable/"
}
