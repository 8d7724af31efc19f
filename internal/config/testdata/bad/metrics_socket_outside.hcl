# want: 3:12 Invalid metrics socket
metrics {
  listen = "unix:/tmp/metrics.sock"
}
