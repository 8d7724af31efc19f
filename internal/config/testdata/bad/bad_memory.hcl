# want: 5:24 Invalid memory limit
agent "a" {
  backend = "service"
  command = ["/bin/true"]
  resources { memory = "lots" }
}
