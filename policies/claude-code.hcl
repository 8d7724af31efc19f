# Claude Code (Anthropic's CLI harness) with an API key held by the gateway.
# The harness only needs the Messages API. Its telemetry and error reporting
# are listed as denied so that the intent is explicit and an operator who
# widens `allow` with a wildcard does not let them through by accident.
egress_policy "claude-code" {
  allow   = ["api.anthropic.com"]
  deny    = ["statsig.anthropic.com", "statsig.com", "sentry.io", "*.sentry.io"]
  ports   = [443]
  inspect = ["api.anthropic.com"]

  # agent "x" { secret "anthropic" { source = "...", env = "ANTHROPIC_API_KEY" } }
  credential "anthropic" {
    hosts  = ["api.anthropic.com"]
    header = "x-api-key"
  }
}
