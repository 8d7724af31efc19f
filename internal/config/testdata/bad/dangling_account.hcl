# want: 5:12 Unknown agent
account "ops" {
  group  = "wheel"
  role   = "operator"
  agents = ["ghost"]
}
