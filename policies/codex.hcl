# OpenAI Codex CLI with an API key held by the gateway. Only the API host is
# needed when the key is injected; the ChatGPT login flow is not.
#
# `codex exec` reads its key from CODEX_API_KEY (not OPENAI_API_KEY) and
# sends it as "Authorization: Bearer <key>" to api.openai.com: the Responses
# API (/v1/responses, a WebSocket first, then HTTP streaming) and the model
# list (/v1/models). At start it also calls ChatGPT's backend (chatgpt.com,
# ab.chatgpt.com, denied here so that a wildcard added later does not let
# them through) and api.github.com (refused: not allowed). See
# docs/harnesses.md.
egress_policy "codex" {
  allow   = ["api.openai.com"]
  deny    = ["chatgpt.com"]
  ports   = [443]
  inspect = ["api.openai.com"]

  # agent "x" { harness = "codex"  secret "openai" { source = "..." } }
  # or without a harness: secret "openai" { source = "...", env = "CODEX_API_KEY" }
  credential "openai" {
    hosts  = ["api.openai.com"]
    header = "Authorization"
  }
}
