# want: 3:18 Invalid evidence time limit
evidence {
  max_duration = "soon"
}
