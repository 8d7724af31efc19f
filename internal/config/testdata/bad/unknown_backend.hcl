# want: 3:13 Unknown backend
agent "a" {
  backend = "vm"
  command = ["/bin/true"]
}
