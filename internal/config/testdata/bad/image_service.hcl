# want: 5:13 Image without podman
agent "a" {
  backend = "service"
  command = ["/bin/true"]
  image   = "docker.io/library/debian"
}
