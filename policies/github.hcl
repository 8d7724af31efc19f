# git and the GitHub API over HTTPS, with a token held by the gateway.
# git sends the token as HTTP Basic auth; the gateway swaps it inside the
# base64 value. Raw file and release downloads are tunnelled, not inspected.
egress_policy "github" {
  allow   = ["github.com", "api.github.com", "codeload.github.com", "objects.githubusercontent.com", "raw.githubusercontent.com"]
  ports   = [443]
  inspect = ["github.com", "api.github.com"]

  # agent "x" { secret "github" { source = "...", env = "GITHUB_TOKEN" } }
  credential "github" {
    hosts  = ["github.com", "api.github.com"]
    header = "Authorization"
  }
}
