egress_policy "web" {
  allow   = ["api.example.com", "*.example.org"]
  deny    = ["evil.example.org"]
  ports   = [443]
  inspect = ["api.example.com"]
}

agent "alice" {
  backend   = "service"
  command   = ["/bin/sh", "-c", "echo hello"]
  workspace = "/var/lib/nixcage/agents/alice"
  egress    = "web"

  secret "api" {
    source = "/run/secrets/alice-api"
    env    = "API_KEY"
    hosts  = ["api.example.com"]
    header = "Authorization"
  }
}

agent "bob" {
  backend = "nspawn"
  command = ["/bin/sh", "-c", "echo hello"]
  egress  = "web"
}

agent "carol" {
  backend = "podman"
  command = ["/bin/sh", "-c", "echo hello"]
  egress  = "web"
}

account "ops" {
  group  = "wheel"
  role   = "operator"
  agents = ["alice", "bob"]
}

# The Telegram relay (docs/relay.md): owners talk to alice in her group. It
# acts on caged as this account, so it can reach alice and nobody else.
account "relay" {
  user   = "cage-relay"
  role   = "operator"
  agents = ["alice"]
}

relay {
  token_file = "/etc/nixcage/secrets/telegram-bot-token"
  owners     = [123456789]
  account    = "relay"
  chat "alice" {
    chat_id = -1001234567890
  }
}

store {
  root      = "/var/lib/nixcage/store"
  channel   = "stable"
  keys      = ["/etc/nixcage/release.pub"]
  threshold = 1
}

# Bounds of each quarantine's workspace copy (defaults: 1 GiB, 100000
# entries, 2m); what a bound leaves out is named in omitted.txt.
evidence {
  max_bytes    = 2147483648
  max_entries  = 200000
  max_duration = "5m"
}
