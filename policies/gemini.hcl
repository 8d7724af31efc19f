# Gemini CLI (Google's harness) with an API key held by the gateway. With a
# key (not a Google login) it needs only the Generative Language API.
egress_policy "gemini" {
  allow   = ["generativelanguage.googleapis.com"]
  deny    = ["play.googleapis.com", "oauth2.googleapis.com", "accounts.google.com"]
  ports   = [443]
  inspect = ["generativelanguage.googleapis.com"]

  # agent "x" { harness = "gemini"  secret "gemini" { source = "..." } }
  credential "gemini" {
    hosts  = ["generativelanguage.googleapis.com"]
    header = "x-goog-api-key"
  }
}
