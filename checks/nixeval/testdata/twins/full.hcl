# Every option of the schema, to hold the Nix model's mapping to account.
# full.nix declares the same in Nix; both must render identically.
version = 1

egress_policy "web" {
  allow   = ["api.example.com", "*.example.org"]
  deny    = ["evil.example.org"]
  ports   = [443, 8443]
  inspect = ["api.example.com"]

  rate_limit {
    per_second = 5
    burst      = 10
  }
  inspector "entropy" {
    action    = "block"
    threshold = 5.5
  }
  inspector "body_size" {
    action    = "flag"
    max_bytes = 1048576
  }
  inspector "encoded_blobs" {
    action     = "block"
    min_length = 256
  }
  limits {
    max_tunnels      = 8
    max_header_bytes = 16384
    max_body_bytes   = 2097152
    idle_timeout     = "90s"
  }
  dns {
    enabled          = true
    allow_types      = ["A", "AAAA", "MX"]
    deny_types       = ["TXT", "ANY"]
    max_label_length = 40
  }
  credential "api" {
    hosts  = ["api.example.com"]
    header = "x-api-key"
  }
  websocket = false
  http_rule "read-only" {
    hosts   = ["api.example.com"]
    methods = ["GET", "HEAD"]
    action  = "allow"
  }
  http_rule "no-admin" {
    hosts  = ["api.example.com"]
    paths  = ["/admin/*", "/debug"]
    action = "deny"
  }
  unsafe_allow_loopback_upstreams = false
  unsafe_allow_private_upstreams  = true
}

agent "alpha" {
  backend     = "podman"
  command     = ["/nix/tools/bin/agent", "--flag", "100%", "$HOME"]
  environment = { LANG = "C.UTF-8", MODE = "strict" }
  workspace   = "/var/lib/cages/alpha"
  tools       = "agent-2.1"
  image       = "docker.io/library/debian:bookworm"
  autostart   = false
  egress      = "web"

  secret "api" {
    source = "/run/agenix/alpha-api"
    env    = "API_TOKEN"
  }

  resources {
    memory = "1G"
    cpu    = "150%"
    tasks  = 256
  }
}

agent "beta" {
  backend = "nspawn"
  command = ["/nix/tools/bin/agent"]

  egress_policy {
    allow   = ["github.com", "*.github.com"]
    inspect = ["github.com"]
    dns {
      enabled = false
    }
  }

  secret "gh" {
    source = "/run/secrets/gh"
    env    = "GH_TOKEN"
    hosts  = ["github.com"]
    header = "Authorization"
  }
}

account "chat" {
  user   = "cage-relay"
  role   = "operator"
  agents = ["beta"]
}

account "root-admin" {
  user = "root"
  role = "admin"
}

account "viewers" {
  group  = "users"
  role   = "viewer"
  agents = ["beta"]
}

store {
  root        = "/srv/nixcage/store"
  channel     = "edge"
  keys        = ["/etc/nixcage/a.pub", "/etc/nixcage/b.pub"]
  nix_keys    = ["cache.example.org-1:6NCHdD59X431o0gWypbMrAURkbJ16ZPMQFGspcDShjY="]
  threshold   = 2
  generations = 5
  expiry_warning = "3d"
  root_keys      = ["/etc/nixcage/root-1.pub", "/etc/nixcage/root-2.pub"]
  root_threshold = 2
}

evidence {
  max_bytes    = 2147483648
  max_entries  = 5000
  max_duration = "90s"
}

metrics {
  listen = "127.0.0.1:9478"
}

control {
  host_id   = "web-01"
  keys      = ["/etc/nixcage/control/ops.pub", "/etc/nixcage/control/sec.pub"]
  threshold = 2
  ack_url   = "https://acks.example.com/fleet/"
}

relay {
  token_file     = "/etc/nixcage/secrets/telegram"
  owners         = [11, 22]
  account        = "chat"
  api_url        = "http://127.0.0.1:8081"
  max_file_bytes = 1048576
  chat "beta" {
    chat_id = -1009
    topic   = 4
  }
}

channel {
  url      = "https://releases.example.org/nixcage/edge/"
  interval = "10m"
  ca_file  = "/etc/nixcage/channel-ca.pem"
}
