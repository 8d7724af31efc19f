# want: 3:18 Invalid evidence cap
evidence {
  max_bytes    = 0
  max_duration = "2m"
}
