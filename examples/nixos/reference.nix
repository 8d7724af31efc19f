# examples/reference.hcl as a NixOS module: three agents, one per backend,
# sharing one egress policy. checks/nixeval renders both and requires
# byte-identical output, so the two front doors cannot drift apart.
{ ... }:
{
  virtualisation.podman.enable = true; # carol runs under podman

  services.nixcage = {
    enable = true;

    egressPolicies.web = {
      allow = [ "api.example.com" "*.example.org" ];
      deny = [ "evil.example.org" ];
      ports = [ 443 ];
      inspect = [ "api.example.com" ];
    };

    agents.alice = {
      backend = "service";
      command = [ "/bin/sh" "-c" "echo hello" ];
      workspace = "/var/lib/nixcage/agents/alice";
      egress = "web";
      # With sops-nix: source = config.sops.secrets.alice-api.path;
      secrets.api = {
        source = "/run/secrets/alice-api";
        env = "API_KEY";
        hosts = [ "api.example.com" ];
        header = "Authorization";
      };
    };

    agents.bob = {
      backend = "nspawn";
      command = [ "/bin/sh" "-c" "echo hello" ];
      egress = "web";
    };

    agents.carol = {
      backend = "podman";
      command = [ "/bin/sh" "-c" "echo hello" ];
      egress = "web";
    };

    accounts.ops = {
      group = "wheel";
      role = "operator";
      agents = [ "alice" "bob" ];
    };

    # The Telegram relay (docs/relay.md): owners talk to alice in her group.
    # It acts on caged as this account, so it can reach alice and nobody else.
    accounts.relay = {
      user = "cage-relay";
      role = "operator";
      agents = [ "alice" ];
    };

    relay = {
      tokenFile = "/etc/nixcage/secrets/telegram-bot-token";
      owners = [ 123456789 ];
      account = "relay";
      chats.alice.chatId = -1001234567890;
    };

    store = {
      root = "/var/lib/nixcage/store";
      channel = "stable";
      keys = [ "/etc/nixcage/release.pub" ];
      threshold = 1;
    };

    # Bounds of each quarantine's workspace copy (defaults: 1 GiB, 100000
    # entries, 2m); what a bound leaves out is named in omitted.txt.
    evidence = {
      maxBytes = 2147483648;
      maxEntries = 200000;
      maxDuration = "5m";
    };
  };
}
