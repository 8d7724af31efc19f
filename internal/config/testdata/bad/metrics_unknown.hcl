# want: 3:3 Unsupported argument
metrics {
  port = 9477
}
