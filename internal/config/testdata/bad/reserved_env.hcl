# want: 5:17 Reserved environment variable
agent "a" {
  backend     = "service"
  command     = ["/bin/true"]
  environment = { HTTPS_PROXY = "http://elsewhere:8080" }
}
