# docs/examples/claude-code.hcl as a NixOS module: Claude Code under the
# shipped "claude-code" policy, its API key from sops-nix. The secret takes
# its hosts and header (x-api-key) from the policy's credential block.
{ config, lib, ... }:
{
  # sops.secrets.anthropic-api-key = { sopsFile = ./secrets.yaml; };
  services.nixcage = {
    enable = true;

    agents.claude = {
      backend = "service";
      command = [ "/nix/tools/bin/claude" "--print" "summarize README.md" ];
      egress = "claude-code";
      secrets.anthropic = {
        # config.sops.secrets.anthropic-api-key.path when sops-nix is imported.
        source = lib.attrByPath [ "sops" "secrets" "anthropic-api-key" "path" ] "/run/secrets/anthropic-api-key" config;
        env = "ANTHROPIC_API_KEY";
      };
      resources = {
        memory = "4G";
        cpu = "200%";
        tasks = 1024;
      };
    };

    accounts.admins = {
      group = "wheel";
      role = "admin";
    };
  };
}
