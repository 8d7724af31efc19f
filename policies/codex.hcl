# OpenAI Codex CLI with an API key held by the gateway. Only the API host is
# needed when the key is injected; the ChatGPT login flow is not.
egress_policy "codex" {
  allow   = ["api.openai.com"]
  ports   = [443]
  inspect = ["api.openai.com"]

  # agent "x" { secret "openai" { source = "...", env = "OPENAI_API_KEY" } }
  credential "openai" {
    hosts  = ["api.openai.com"]
    header = "Authorization"
  }
}
