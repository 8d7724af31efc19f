# want: 4:12 Unknown role
account "ops" {
  user   = "alice"
  role   = "root"
}
