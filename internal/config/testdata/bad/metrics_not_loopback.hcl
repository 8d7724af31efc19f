# want: 3:12 Metrics address not on loopback
metrics {
  listen = "0.0.0.0:9477"
}
