# want: 4:3 Unsupported argument
agent "a" {
  backend = "service"
  colour  = "blue"
  command = ["/bin/true"]
}
