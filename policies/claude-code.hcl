# Claude Code (Anthropic's CLI harness) with an API key held by the gateway.
# The harness only needs the Messages API. Its telemetry and error reporting
# are listed as denied so that the intent is explicit and an operator who
# widens `allow` with a wildcard does not let them through by accident.
egress_policy "claude-code" {
  allow   = ["api.anthropic.com"]
  deny    = ["statsig.anthropic.com", "statsig.com", "sentry.io", "*.sentry.io", "datadoghq.com"]
  ports   = [443]
  inspect = ["api.anthropic.com"]

  # agent "x" { secret "anthropic" { source = "...", env = "ANTHROPIC_API_KEY" } }
  credential "anthropic" {
    hosts  = ["api.anthropic.com"]
    header = "x-api-key"
  }

  # Claude Code sends its own telemetry to the same host as the model API,
  # so the user's real key would be injected into it: first-party event
  # logging, the metrics exporter and its opt-in check, and feature-flag
  # evaluation (GrowthBook remote eval). Denied; the harness carries on
  # without them. To re-allow, declare a policy of your own (copy this file
  # under another name, or under this name in your config, which then wins
  # over the shipped one) without this block. See docs/config.md.
  http_rule "telemetry" {
    hosts  = ["api.anthropic.com"]
    paths  = [
      "/api/event_logging/*",
      "/api/claude_code/metrics",
      "/api/claude_code/organizations/metrics_enabled",
      "/api/eval/*",
      "/api/eval-authed/*",
    ]
    action = "deny"
  }
}
