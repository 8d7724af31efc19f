# want: 3:10 Duplicate evidence block
evidence {}
evidence {
  max_entries = 5
}
