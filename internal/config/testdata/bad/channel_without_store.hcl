# want: 2:9 Channel without a store
channel {
  url = "https://releases.example.org/stable/"
}
