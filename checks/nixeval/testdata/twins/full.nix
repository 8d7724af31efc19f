# full.hcl in Nix: every option of services.nixcage. TestExamples renders
# both and requires identical trees.
{
  virtualisation.podman.enable = true;
  services.nixcage = {
    enable = true;

    egressPolicies.web = {
      allow = [ "api.example.com" "*.example.org" ];
      deny = [ "evil.example.org" ];
      ports = [ 443 8443 ];
      inspect = [ "api.example.com" ];
      rateLimit = { perSecond = 5; burst = 10; };
      inspectors = {
        entropy = { action = "block"; threshold = 5.5; };
        body_size = { action = "flag"; maxBytes = 1048576; };
        encoded_blobs = { action = "block"; minLength = 256; };
      };
      limits = {
        maxTunnels = 8;
        maxHeaderBytes = 16384;
        maxBodyBytes = 2097152;
        idleTimeout = "90s";
      };
      dns = {
        enabled = true;
        allowTypes = [ "A" "AAAA" "MX" ];
        denyTypes = [ "TXT" "ANY" ];
        maxLabelLength = 40;
      };
      credentials.api = { hosts = [ "api.example.com" ]; header = "x-api-key"; };
      websocket = false;
      httpRules.read-only = { hosts = [ "api.example.com" ]; methods = [ "GET" "HEAD" ]; action = "allow"; };
      httpRules.no-admin = { hosts = [ "api.example.com" ]; paths = [ "/admin/*" "/debug" ]; action = "deny"; };
      unsafeAllowLoopbackUpstreams = false;
      unsafeAllowPrivateUpstreams = true;
    };

    agents.alpha = {
      backend = "podman";
      command = [ "/nix/tools/bin/agent" "--flag" "100%" "$HOME" ];
      environment = { LANG = "C.UTF-8"; MODE = "strict"; };
      workspace = "/var/lib/cages/alpha";
      tools = "agent-2.1";
      image = "docker.io/library/debian:bookworm";
      autostart = false;
      egress = "web";
      secrets.api = { source = "/run/agenix/alpha-api"; env = "API_TOKEN"; };
      resources = { memory = "1G"; cpu = "150%"; tasks = 256; };
    };

    agents.beta = {
      backend = "nspawn";
      command = [ "/nix/tools/bin/agent" ];
      egressPolicy = {
        allow = [ "github.com" "*.github.com" ];
        inspect = [ "github.com" ];
        dns.enabled = false;
      };
      secrets.gh = {
        source = "/run/secrets/gh";
        env = "GH_TOKEN";
        hosts = [ "github.com" ];
        header = "Authorization";
      };
    };

    accounts.root-admin = { user = "root"; role = "admin"; };
    accounts.viewers = { group = "users"; role = "viewer"; agents = [ "beta" ]; };

    store = {
      root = "/srv/nixcage/store";
      channel = "edge";
      keys = [ "/etc/nixcage/a.pub" "/etc/nixcage/b.pub" ];
      nixKeys = [ "cache.example.org-1:6NCHdD59X431o0gWypbMrAURkbJ16ZPMQFGspcDShjY=" ];
      threshold = 2;
      generations = 5;
      expiryWarning = "3d";
      rootKeys = [ "/etc/nixcage/root-1.pub" "/etc/nixcage/root-2.pub" ];
      rootThreshold = 2;
    };

    evidence = {
      maxBytes = 2147483648;
      maxEntries = 5000;
      maxDuration = "90s";
    };

    metrics.listen = "127.0.0.1:9478";
    control = {
      hostId = "web-01";
      keys = [ "/etc/nixcage/control/ops.pub" "/etc/nixcage/control/sec.pub" ];
      threshold = 2;
      ackUrl = "https://acks.example.com/fleet/";
    };

    accounts.chat = { user = "cage-relay"; role = "operator"; agents = [ "beta" ]; };
    relay = {
      tokenFile = "/etc/nixcage/secrets/telegram";
      owners = [ 11 22 ];
      account = "chat";
      apiUrl = "http://127.0.0.1:8081";
      maxFileBytes = 1048576;
      chats.beta = { chatId = -1009; topic = 4; };
    };

    channel = {
      url = "https://releases.example.org/nixcage/edge/";
      interval = "10m";
      caFile = "/etc/nixcage/channel-ca.pem";
    };
  };
}
