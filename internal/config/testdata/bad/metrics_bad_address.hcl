# want: 3:12 Invalid metrics address
metrics {
  listen = "localhost"
}
