# want: 5:9 Duplicate metrics block
metrics {
}

metrics {
  listen = "[::1]:9100"
}
